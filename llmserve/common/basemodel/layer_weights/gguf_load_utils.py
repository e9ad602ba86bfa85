"""Reading GGUF (llama.cpp) checkpoints as an HF-style config dict plus HF-named float32 tensors.

The rest of llmserve only knows Hugging Face names and layouts, so a GGUF file is translated
here once: metadata -> a ``config.json``-like dict, ``blk.N.attn_q.weight`` ->
``model.layers.N.self_attn.q_proj.weight`` (by the model family's ``GGUFArch`` table), quantized
blocks -> float32 ``[out, in]`` tensors, and llama.cpp's rotary permutation of q/k undone.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape
from tqdm.auto import tqdm

from llmserve.common.cache import cache_root
from llmserve.common.errors import ModelLoadError

T = TypeVar("T")

if TYPE_CHECKING:
    import torch

    from llmserve.kernels.quantized_linear import QuantizedWeight

__all__ = ["GGUFArch", "GGUFCheckpoint", "load_gguf", "load_gguf_tokenizer", "gguf_config", "ModelLoadError"]


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture (a file's ``general.architecture``) maps onto a Hugging Face model.
    Each model family keeps its own next to its model code (``llmserve/models/llama/gguf.py``); the
    loader here takes them as ``archs``, a GGUF architecture name -> its ``GGUFArch``."""

    model_type: str
    hf_class: str
    permuted_qk: bool                   # llama.cpp's converter permutes q/k rows for its rope layout
    global_tensors: Mapping[str, str]   # GGUF stem -> HF name (``output_norm`` -> ``model.norm``)
    # stem in ``blk.N`` -> HF name in ``model.layers.N``. A name with ``{expert}`` is a stack of
    # experts (``ffn_gate_exps``, ``[experts, out, in]``): one HF tensor per expert.
    block_tensors: Mapping[str, str]
    # What the HF config says that the GGUF metadata leaves to the architecture, from the file's
    # tensor shapes (GGUF name -> shape) and its metadata under ``{architecture}.`` (the prefix
    # dropped: ``attention.sliding_window``).
    extra_config: Callable[[Mapping[str, tuple[int, ...]], Mapping[str, Any]], dict[str, Any]] | None = None
    # llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the
    # weight, HF's Gemma norm by 1 + weight): subtracted from every ``*norm.weight`` here.
    norm_offset: float = 0.0


_TOKEN_ID_KEYS: dict[str, str] = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
}

# llama.cpp stores Llama-3-style rope scaling as this tensor of per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"


@dataclass
class GGUFCheckpoint:
    """A GGUF checkpoint in Hugging Face terms.

    ``config``: a ``config.json``-style dict. ``tensors``: HF parameter names -> float32 CPU tensors
    in HF shapes (``[out, in]`` for linear weights), or, loaded with ``quantized=True``, the 2-D
    Q4_0 / Q4_1 / Q8_0 ones as ``QuantizedWeight`` (their blocks as stored). With ``config["tie_word_embeddings"]`` there
    is no ``lm_head.weight``: the embedding doubles as the output projection.
    """

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor | QuantizedWeight] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# metadata


def _field_value(reader_field: Any) -> Any:
    """A metadata field's value as plain Python (str, int, float, bool, or a list of them).

    Reads ``parts``/``data``/``types`` directly: they exist in every gguf-py release, unlike the
    newer ``ReaderField.contents()``.
    """
    types = list(reader_field.types)
    values = [_scalar(reader_field.parts[i], types[-1]) for i in reader_field.data]
    if types and types[0] == GGUFValueType.ARRAY:
        return values
    return values[0] if values else None


def _scalar(part: np.ndarray, value_type: GGUFValueType) -> Any:
    if value_type == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part.reshape(-1)[0]
    if value_type == GGUFValueType.FLOAT32:
        # str() gives the shortest decimal that round-trips in float32: 1e-05, not 9.99999974e-06,
        # matching what the original config.json said.
        return float(str(value))
    if value_type == GGUFValueType.BOOL:
        return bool(value)
    return value.item()


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """The scalar metadata fields. Arrays (token lists, merges: ~100k strings) are left out:
    nothing here needs them and converting them to Python would cost seconds."""
    return {
        name: _field_value(f)
        for name, f in reader.fields.items()
        if f.types and f.types[0] != GGUFValueType.ARRAY
    }


def _require(meta: dict[str, Any], key: str, path: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF file {path} lacks the metadata key {key}")
    return meta[key]


def _rope_scaling_from_metadata(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or the older ``rope.scale_linear``)."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type")
    factor = meta.get(prefix + "factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind in (None, "none") or factor is None or factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    optional = {
        "original_context_length": "original_max_position_embeddings",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
        "attn_factor": "attention_factor",
    }
    for gguf_key, hf_key in optional.items():
        if meta.get(prefix + gguf_key) is not None:
            scaling[hf_key] = meta[prefix + gguf_key]
    return scaling


def _rope_wavelengths(rope_theta: float, head_dim: int) -> np.ndarray:
    return 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _llama3_rope_factors(wavelen: np.ndarray, factor: float, low: float, high: float, orig_ctx: int) -> np.ndarray:
    """The ``rope_freqs`` llama.cpp's converter writes for a Llama 3 ``rope_scaling``."""
    smooth = (orig_ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig_ctx / high, 1.0, out)
    return np.where(wavelen > orig_ctx / low, factor, out)


def _llama3_factor(factors: np.ndarray, wavelen: np.ndarray, low: float, high: float, orig_ctx: int) -> float:
    """``factor`` given the other parameters: read off a fully scaled frequency if there is one,
    else solved from the most scaled frequency of the blend."""
    i = int(np.argmax(factors))
    if wavelen[i] > orig_ctx / low:
        return float(factors[i])
    smooth = (orig_ctx / wavelen[i] - low) / (high - low)
    denominator = 1 / factors[i] - smooth
    return float((1 - smooth) / denominator) if denominator > 0 else float(factors[i])


def _llama3_candidates(factors: np.ndarray, wavelen: np.ndarray) -> list[tuple[float, float, int]]:
    """Plausible (low_freq_factor, high_freq_factor, original context) for ``factors``.

    Along the blend, ``smooth`` is linear in ``1 / wavelength`` with slope ``ctx / (high - low)``
    and intercept ``-low / (high - low)``; with ``low = 1`` (every Llama 3.x release) that gives
    the rest. The Llama 3.x defaults come last, for blends too short to fit.
    """
    candidates = [(1.0, 4.0, 8192)]
    top = float(factors.max())
    blend = ~np.isclose(factors, 1.0, rtol=1e-5) & ~np.isclose(factors, top, rtol=1e-5)
    if blend.sum() >= 2:
        smooth = (1 / factors[blend] - 1 / top) / (1 - 1 / top)
        slope, intercept = np.polyfit(1 / wavelen[blend], smooth, 1)
        if intercept < 0:
            high = round(float(1.0 - 1.0 / intercept), 4)
            candidates.insert(0, (1.0, high, int(round(float(slope) * (high - 1.0)))))
    return candidates


def _rope_scaling_from_freqs(
    factors: np.ndarray, rope_theta: float, head_dim: int, path: str
) -> dict[str, Any] | None:
    """Recover a Llama 3 ``rope_scaling`` from a ``rope_freqs`` tensor, or raise.

    The tensor holds 1 for high frequencies, ``factor`` for low ones and a smooth blend between.
    Every guess is checked by recomputing the tensor, so a file written some other way is
    rejected instead of run with the wrong rotary embedding.
    """
    factors = factors.astype(np.float64).reshape(-1)
    if factors.size != head_dim // 2:
        raise ModelLoadError(f"{_ROPE_FREQS} in {path} has {factors.size} entries, expected {head_dim // 2}")
    if np.allclose(factors, 1.0):
        return None
    wavelen = _rope_wavelengths(rope_theta, head_dim)
    for low, high, orig_ctx in _llama3_candidates(factors, wavelen):
        factor = _llama3_factor(factors, wavelen, low, high, orig_ctx)
        if np.allclose(_llama3_rope_factors(wavelen, factor, low, high, orig_ctx), factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": round(factor, 4),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig_ctx,
            }
    raise ModelLoadError(
        f"{_ROPE_FREQS} in {path} does not match Llama 3 rope scaling; this rope scaling is not supported"
    )


def _build_config(
    meta: dict[str, Any], arch: str, spec: GGUFArch, tensor_shapes: dict[str, tuple[int, ...]], path: str
) -> dict[str, Any]:
    """The HF config.json equivalent of the GGUF metadata."""
    key = f"{arch}.{{}}".format
    hidden = int(_require(meta, key("embedding_length"), path))
    heads = int(_require(meta, key("attention.head_count"), path))
    kv_heads = meta.get(key("attention.head_count_kv"), heads)
    # key_length is the head size proper; rope.dimension_count equals it for llama / qwen2.
    head_dim = meta.get(key("attention.key_length"), meta.get(key("rope.dimension_count"), hidden // heads))
    if "token_embd.weight" not in tensor_shapes:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, key("feed_forward_length"), path)),
        "num_hidden_layers": int(_require(meta, key("block_count"), path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": float(meta.get(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(_require(meta, key("context_length"), path)),
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
    }
    if spec.extra_config is not None:
        arch_meta = {k[len(arch) + 1:]: v for k, v in meta.items() if k.startswith(arch + ".")}
        config.update(spec.extra_config(tensor_shapes, arch_meta))
    for gguf_key, hf_key in _TOKEN_ID_KEYS.items():
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    rope_scaling = _rope_scaling_from_metadata(meta, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


# ---------------------------------------------------------------------------------------------
# tensors


def _hf_name(gguf_name: str, spec: GGUFArch) -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.bias`` -> ``model.layers.3.self_attn.q_proj.bias``;
    a stack of experts keeps ``{expert}`` in it)."""
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in spec.global_tensors:
        return f"{spec.global_tensors[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in spec.block_tensors:
        return f"model.layers.{parts[1]}.{spec.block_tensors[parts[2]]}.{suffix}"
    return None


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``w.reshape(n_head, 2, d, *rest).swapaxes(1, 2).reshape(w.shape)``.

    llama.cpp's rope rotates adjacent pairs (x0, x1), HF's rotates halves (x0, x_{d/2}); the
    converter reorders q/k rows to match, and this puts them back.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _type_name(qtype: Any) -> str:
    return getattr(qtype, "name", str(qtype))


def _dequantize(tensor: Any) -> np.ndarray:
    """A reader tensor as a writable C-contiguous float32 array in numpy order (``[out, in]``)."""
    qtype = tensor.tensor_type
    try:
        data = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} has type {_type_name(qtype)}, which cannot be dequantized"
        ) from e
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot dequantize GGUF tensor {tensor.name} of type {_type_name(qtype)}: {e}") from e
    # GGUF lists dimensions innermost first.
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    # F32 comes back as a read-only view of the memory map: copy (torch wants writable memory).
    return np.require(np.asarray(data).reshape(shape), dtype=np.float32, requirements=["C", "W"])


def _open_reader(path: str) -> GGUFReader:
    return _read_checked(path, lambda: GGUFReader(path, "r"))


def _read_checked(path: str, read: Callable[[], T]) -> T:
    """``read()`` of a GGUF file, with a missing file or a bad one reported as ModelLoadError."""
    if not os.path.exists(path):
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF path {path} is not a file")
    try:
        return read()
    except Exception as e:  # gguf-py reports bad files as ValueError, struct/reshape errors, ...
        raise ModelLoadError(f"{path} is not a valid GGUF file ({e})") from e


def _arch_of(meta: dict[str, Any], path: str, archs: Mapping[str, GGUFArch]) -> tuple[str, GGUFArch]:
    arch = meta.get("general.architecture")
    if arch not in archs:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {path} (supported: {', '.join(archs)})")
    return arch, archs[arch]


def load_gguf(path: str, archs: Mapping[str, GGUFArch], progress: bool = True, quantized: bool = False) -> GGUFCheckpoint:
    """Read a GGUF checkpoint: its HF-style config and its tensors, dequantized to float32, or
    with ``quantized`` the matrices in the block formats `QuantizedWeight` holds kept as they are
    (no dequantizing: faster to load, 4-8x smaller, and run by the CPU's quantized kernel).
    ``archs``: the architectures to read, by name (``GGUFArch``).

    Raises ``ModelLoadError`` (one line) for a missing file, a file that is not GGUF, an
    architecture not in ``archs``, an unexpected tensor, or a tensor type gguf-py cannot
    dequantize. ``progress`` shows a progress bar on stderr while dequantizing, if stderr is a terminal (a log file gets no carriage returns).
    """
    import torch  # here, not at the top: the HTTP process reads GGUF tokenizers and never needs torch

    from llmserve.kernels.quantized_linear import QTYPES, QuantizedWeight

    layout = _read_checked(path, lambda: _read_layout(path))
    if layout is None:                  # a layout the header's reader leaves to GGUFReader
        reader = _open_reader(path)
        header, file_tensors = _header_of(reader), reader.tensors
    else:
        header, file_tensors = (layout.meta, layout.shapes()), _read_checked(path, lambda: _mapped_tensors(path, layout))
    config, spec = _config_of(*header, path, archs)
    n_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    bar = tqdm(
        file_tensors, desc="Reading GGUF" if quantized else "Dequantizing GGUF", unit="tensor", file=sys.stderr, leave=False, disable=None if progress else True
    )
    with bar:
        for t in bar:
            if t.name == _ROPE_FREQS:
                scaling = _rope_scaling_from_freqs(_dequantize(t), config["rope_theta"], config["head_dim"], path)
                if scaling is not None:
                    config["rope_scaling"] = scaling
                continue
            hf_name = _hf_name(t.name, spec)
            if hf_name is None:
                raise ModelLoadError(f"unexpected tensor {t.name} in {config['model_type']} GGUF file {path}")
            keep = quantized and _type_name(t.tensor_type) in QTYPES and len(t.shape) == 2
            # quantized, the rows of a tensor are its raw blocks, which _unpermute_qk moves alike
            w = np.asarray(t.data) if keep else _dequantize(t)
            kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
            if spec.permuted_qk and kind in n_heads:
                w = _unpermute_qk(w, n_heads[kind])
            if spec.norm_offset and hf_name.endswith("norm.weight"):
                w = w - np.float32(spec.norm_offset)
            if "{expert}" in hf_name:     # [experts, out, in] (dequantized: 3-D tensors never stay in blocks)
                for e in range(w.shape[0]):
                    tensors[hf_name.format(expert=e)] = torch.from_numpy(np.ascontiguousarray(w[e]))
            elif keep:
                shape = tuple(int(d) for d in reversed(list(t.shape)))
                tensors[hf_name] = QuantizedWeight.from_gguf(_type_name(t.tensor_type), w, shape)
            else:
                tensors[hf_name] = torch.from_numpy(w)
    return GGUFCheckpoint(config=config, tensors=tensors)


def load_gguf_tokenizer(path: str) -> Any:
    """The tokenizer embedded in a GGUF file, via ``AutoTokenizer.from_pretrained(..., gguf_file=...)``.

    Converting the GGUF vocabulary to a fast tokenizer takes seconds (about 8 s for SmolLM2's on
    a laptop core) and every process that serves the file needs one, so the converted tokenizer
    is saved once under the cache folder (``tokenizer_cache_dir``) and loaded from there after,
    keyed by the file's path, size and modification time and the transformers version. A cache
    that cannot be written is skipped.
    """
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path} does not exist")
    cached = _cached_tokenizer_dir(path)
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        try:
            return _load_saved_tokenizer(cached)
        except Exception:
            pass    # a damaged cache entry: convert again, below
    from transformers import AutoTokenizer  # heavy import (torch with it), only needed here
    directory, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except Exception as e:  # transformers raises many types for a bad or unsupported file
        raise ModelLoadError(f"cannot load the tokenizer of GGUF file {path}: {e}") from e
    if cached is not None:
        _save_to_cache(tokenizer, cached)
    return tokenizer


def _load_saved_tokenizer(directory: str) -> Any:
    """A tokenizer `_save_to_cache` wrote. transformers saves a converted GGUF vocabulary as a
    ``TokenizersBackend``, which is what AutoTokenizer would load here; loading that class itself
    skips AutoTokenizer's imports, which take torch with them (200 MB in the HTTP process)."""
    with open(os.path.join(directory, "tokenizer_config.json")) as f:
        tokenizer_class = json.load(f).get("tokenizer_class")
    if tokenizer_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def tokenizer_cache_dir() -> str:
    """``gguf-tokenizers`` under the cache root (``llmserve.common.cache.cache_root``)."""
    return os.path.join(cache_root(), "gguf-tokenizers")


def _cached_tokenizer_dir(path: str) -> str | None:
    import hashlib

    import transformers

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    return os.path.join(tokenizer_cache_dir(), hashlib.sha256(key.encode()).hexdigest()[:32])


def _save_to_cache(tokenizer: Any, target: str) -> None:
    """Save next to ``target`` and rename into place, so that a process reading the cache never
    sees half a tokenizer, and two processes converting at once both succeed."""
    import shutil
    import tempfile

    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        pass        # another process put it there first, or the folder is read-only
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _header_of(reader: GGUFReader) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The scalar metadata and the tensor shapes (HF order) as GGUFReader read them."""
    return _metadata(reader), {t.name: tuple(int(d) for d in reversed(list(t.shape))) for t in reader.tensors}


def _config_of(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: str,
               archs: Mapping[str, GGUFArch]) -> tuple[dict[str, Any], GGUFArch]:
    arch, spec = _arch_of(meta, path, archs)
    return _build_config(meta, arch, spec, shapes, path), spec


def gguf_config(path: str, archs: Mapping[str, GGUFArch]) -> dict[str, Any]:
    """The HF-style config of a GGUF file from its metadata and tensor shapes alone (no tensor
    data is read, so rope scaling stored as a rope_freqs tensor is not in it)."""
    header = _read_checked(path, lambda: _read_header(path))
    return _config_of(*(header or _header_of(_open_reader(path))), path, archs)[0]


# struct formats of GGUF's scalar value types (little-endian), by GGUFValueType
_SCALAR_FORMATS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
                   GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
                   GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
                   GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}


class _TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]           # GGUF order: innermost first
    tensor_type: int                # a GGMLQuantizationType's value
    offset: int                     # from the start of the data section


class _Layout(NamedTuple):
    """A GGUF file's header: its scalar metadata (as `_metadata` gives it), its tensors' infos and
    where the data section starts."""

    meta: dict[str, Any]
    tensors: list[_TensorInfo]
    data_start: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensor shapes, in HF order."""
        return {t.name: tuple(reversed(t.dims)) for t in self.tensors}


def _read_header(path: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]] | None:
    """The scalar metadata and the tensor shapes (HF order) of the file, as `_header_of` reads them
    through GGUFReader; None where `_read_layout` is."""
    layout = _read_layout(path)
    return None if layout is None else (layout.meta, layout.shapes())


def _read_layout(path: str) -> _Layout | None:
    """The header of a little-endian GGUF v2 / v3 file, read straight from it: GGUFReader turns
    each of the vocabulary's ~100k strings into numpy views first (3-7 CPU-s for SmolLM2's, at
    every start of a worker), and this needs none of them. None for a file of another layout
    (GGUFReader reads those)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, n_tensors, n_fields = struct.unpack_from("<IIQQ", buf, 0)
        if magic != 0x46554747 or version not in (2, 3):     # b"GGUF"; v1's lengths are 32-bit
            return None
        offs = 24

        def string() -> bytes:
            nonlocal offs
            (n,) = struct.unpack_from("<Q", buf, offs)
            offs += 8 + n
            return buf[offs - n:offs]

        def value(value_type: int) -> Any:
            nonlocal offs
            if value_type == GGUFValueType.STRING:
                return string().decode("utf-8", errors="replace")
            fmt = _SCALAR_FORMATS[GGUFValueType(value_type)]
            (v,) = struct.unpack_from(fmt, buf, offs)
            offs += struct.calcsize(fmt)
            # str() of the float32 gives the shortest decimal that round-trips in it, as _scalar
            return float(str(np.float32(v))) if value_type == GGUFValueType.FLOAT32 else v

        # GGUFReader lists the header's counts as fields too
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_fields}
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_fields):
            key = string().decode("utf-8")
            (value_type,) = struct.unpack_from("<I", buf, offs)
            offs += 4
            if value_type != GGUFValueType.ARRAY:
                meta[key] = value(value_type)
                if key == "general.alignment":
                    alignment = meta[key]
                    if value_type != GGUFValueType.UINT32 or alignment <= 0 or alignment & (alignment - 1):
                        raise ValueError(f"bad general.alignment {alignment!r}")   # as GGUFReader
                continue
            item_type, count = struct.unpack_from("<IQ", buf, offs)     # skipped: see _metadata
            offs += 12
            if item_type == GGUFValueType.STRING:
                for _ in range(count):
                    string()
            elif item_type in _SCALAR_FORMATS:
                offs += count * struct.calcsize(_SCALAR_FORMATS[GGUFValueType(item_type)])
            else:
                return None                                   # nested arrays: GGUFReader's
        tensors: list[_TensorInfo] = []
        for _ in range(n_tensors):
            name = string().decode("utf-8")
            (n_dims,) = struct.unpack_from("<I", buf, offs)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
            offs += 4 + 8 * n_dims
            tensor_type, offset = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            tensors.append(_TensorInfo(name, dims, tensor_type, offset))
    return _Layout(meta, tensors, -(-offs // alignment) * alignment)


@dataclass(frozen=True)
class _MappedTensor:
    """A tensor of the file, with the fields of GGUFReader's ``ReaderTensor`` that load_gguf reads."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]          # GGUF order: innermost first
    data: np.ndarray                # a read-only view of the memory map, shaped as GGUFReader's


# the types GGUFReader gives as elements; every other one comes as its bytes, a block's to a row
_ELEMENT_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}


def _mapped_tensors(path: str, layout: _Layout) -> list[_MappedTensor]:
    """The tensors of ``layout`` as views of the file's memory map (nothing is read until used)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    tensors: list[_MappedTensor] = []
    names: set[str] = set()
    for info in layout.tensors:
        if info.name in names:
            raise ValueError(f"duplicated tensor {info.name}")
        names.add(info.name)
        qtype = GGMLQuantizationType(info.tensor_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = math.prod(info.dims) * type_size // block_size
        start = layout.data_start + info.offset
        if start + n_bytes > buf.size:
            raise ValueError(f"tensor {info.name} ends past the end of the file")
        shape = tuple(reversed(info.dims))
        raw = buf[start:start + n_bytes]
        dtype = _ELEMENT_DTYPES.get(qtype)
        data = raw.view(dtype).reshape(shape) if dtype is not None else raw.reshape(quant_shape_to_byte_shape(shape, qtype))
        tensors.append(_MappedTensor(info.name, qtype, info.dims, data))
    return tensors

"""Quantized checkpoints written the way their publishers write them, for the quantization tests.

Each writer takes an HF model directory (float32 safetensors), quantizes the decoder's linear
layers (the embedding and lm_head stay as they are, as every publisher leaves them) and writes a
new directory with the format's tensors and ``quantization_config``, returning also the weights
those tensors stand for (dequantized by this file's own arithmetic, not llmserve's), which the
reference model runs with:

- ``ct-fp8-dynamic`` / ``ct-fp8-static``: compressed-tensors' own compressor (the
  ``FP8_DYNAMIC`` and ``FP8`` presets, as llm-compressor saves them);
- ``fp8-block``: DeepSeek / Qwen3-FP8's layout (float8 ``weight``, ``weight_scale_inv`` per tile);
- ``awq`` / ``gptq``: AutoAWQ's GEMM packing and GPTQ's original (v1) packing, by hand.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FORMATS = ("ct-fp8-dynamic", "ct-fp8-static", "fp8-block", "awq", "gptq")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _copy_dir(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def _save(dst: Path, config: dict, qconfig: dict, tensors: dict[str, torch.Tensor]) -> None:
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))


# -- int4 ----------------------------------------------------------------------------------------
def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit, per group of ``group`` columns: q ``[N, K]``, zeros and fp16 scales ``[N, K / group]``."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = (-lo / scale.float()).round().clamp(0, 15)
    q = (g / scale.float()[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).to(torch.int32), zero.to(torch.int32), scale


def dequantize_int4(q, zero, scale, group):
    n, k = q.shape
    return ((q.view(n, -1, group) - zero[..., None]).float() * scale.float()[..., None]).reshape(n, k)


def pack_columns(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] of 4-bit values -> [R, C / 8] words, nibble i holding column 8c + order[i]."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int32)
    for i, col in enumerate(order):
        out |= (v[:, col::8] & 15) << (4 * i)
    return out


def pack_rows(v: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> [R / 8, C] words, nibble i holding row 8r + i (GPTQ's qweight)."""
    out = torch.zeros(v.shape[0] // 8, v.shape[1], dtype=torch.int32)
    for i in range(8):
        out |= (v[i::8] & 15) << (4 * i)
    return out


# -- calibration: GPTQ ------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Per linear layer input (keyed by the first layer reading it: q_proj, o_proj, gate_proj,
    down_proj), over the calibration tokens: ``hessian`` X^T X / n."""

    hessian: dict[str, torch.Tensor]


# The layers reading one input, under the name of the first.
SHARED_INPUT = {"q_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                "gate_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def calibrate(src: str | Path, tokens: list[int]) -> Calibration:
    """Statistics of each linear layer's input as the float32 model in ``src`` reads ``tokens``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    cal = Calibration({})

    def hook(module, args, name):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        cal.hessian[name] = x.t() @ x / x.shape[0]

    for name, mod in model.named_modules():
        if name.split(".")[-1] in SHARED_INPUT:
            mod.register_forward_pre_hook(lambda m, args, name=name: hook(m, args, name))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    return cal


def _int4_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's asymmetric 4-bit grid of each row of ``w`` [N, group]: fp16 scale, zero point."""
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    return scale, (-lo / scale).round().clamp(0, 15)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group: int, block: int = 128, damp: float = 0.01):
    """GPTQ (Frantar et al. 2022, its reference implementation's order, ``desc_act`` false): the
    columns quantized left to right, each one's error, weighted by the inverse Hessian's Cholesky
    factor, pushed onto the columns not yet quantized (lazily, a block of ``block`` at a time); each
    group's scale and zero taken from its columns as they stand when the group begins."""
    # The column steps are small: split over threads, their synchronisation costs 25x their
    # arithmetic (measured: 8.3 s vs 0.33 s for a 576 x 576 layer on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(w, h, group, block, damp)
    finally:
        torch.set_num_threads(threads)


def _gptq(w: torch.Tensor, h: torch.Tensor, group: int, block: int, damp: float):
    # The weights are held transposed, [K, N]: a column step reads and updates contiguous rows
    # (a third of the time of strided columns, with the same numbers).
    wt = w.float().t().contiguous()
    k, n = wt.shape
    h = h.double().clone()     # the factorisations in float64, the column steps in float32
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    wt[dead] = 0
    h += damp * h.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(k, n, dtype=torch.int32)
    scales, zeros = torch.zeros(k // group, n), torch.zeros(k // group, n)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1, err1, hinv1 = wt[b0:b1], torch.zeros(b1 - b0, n), hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            c = b0 + i
            if c % group == 0:
                s, z = _int4_params(wt[c:c + group].t())
                scales[c // group], zeros[c // group] = s, z
            col = w1[i]
            qc = (col / s + z).round().clamp(0, 15)
            q[c] = qc.int()
            err = (col - (qc - z) * s) / hinv1[i, i]
            w1[i:] -= hinv1[i, i:, None] * err[None, :]
            err1[i] = err
        wt[b1:] -= hinv[b0:b1, b1:].t() @ err1
    return q.t().contiguous(), zeros.t().contiguous().to(torch.int32), scales.t().contiguous().half()


def _layer_groups(state: dict[str, torch.Tensor]):
    """(prefix "model.layers.i.self_attn." or "....mlp.", first layer's name, the names reading its input)."""
    for name in state:
        module = name.removesuffix(".weight").split(".")
        if name.endswith(".weight") and module[-1] in SHARED_INPUT:
            prefix = ".".join(module[:-1]) + "."
            yield prefix, ".".join(module), [prefix + m + ".weight" for m in SHARED_INPUT[module[-1]]]


def gptq_checkpoint(state: dict[str, torch.Tensor], cal: Calibration, group: int) -> dict:
    """{weight name: (q, zeros, scales)} by `gptq_quantize`; the layers reading one input run as
    one matrix (GPTQ treats rows independently, and they share the Hessian)."""
    out = {}
    for _, first, names in _layer_groups(state):
        q, z, s = gptq_quantize(torch.cat([state[n] for n in names]), cal.hessian[first], group)
        rows = [state[n].shape[0] for n in names]
        for name, qi, zi, si in zip(names, q.split(rows), z.split(rows), s.split(rows)):
            out[name] = (qi, zi, si)
    return out


# -- the writers -----------------------------------------------------------------------------------
def write_quantized(src: str | Path, dst: str | Path, fmt: str, group: int = 128,
                    block: tuple[int, int] = (128, 128), calibration: Calibration | None = None) -> dict[str, torch.Tensor]:
    """Write ``src`` in format ``fmt`` to ``dst``; returns ``{name: weight it stands for}`` of the
    quantized linear weights. ``gptq`` with ``calibration``: GPTQ's algorithm on those statistics;
    otherwise 4-bit is round-to-nearest."""
    src, dst = Path(src), Path(dst)
    if fmt.startswith("ct-"):
        return _write_compressed_tensors(src, dst, static=fmt == "ct-fp8-static")
    config = _copy_dir(src, dst)
    state = load_file(str(src / "model.safetensors"))
    int4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    if calibration is not None and fmt == "gptq":
        int4 = gptq_checkpoint(state, calibration, group)
    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not is_linear(name):
            out[name] = w
            continue
        module = name.removesuffix(".weight")
        if fmt == "fp8-block":
            n, k = w.shape
            bn, bk = block
            tiles = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).view(-(-n // bn), bn, -(-k // bk), bk)
            s = (tiles.abs().amax((1, 3)) / 448).clamp(min=1e-12)
            s_full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
            q = (w / s_full).to(FP8)
            out[name], out[module + ".weight_scale_inv"] = q, s
            ref[name] = q.float() * s_full
            continue
        q, zero, scale = int4[name] if name in int4 else quantize_int4(w, group)
        ref[name] = dequantize_int4(q, zero, scale, group)
        if fmt == "awq":     # AutoAWQ's WQLinear_GEMM: [K, N / 8] words in AWQ_ORDER
            out[module + ".qweight"] = pack_columns(q.t().contiguous(), AWQ_ORDER)
            out[module + ".qzeros"] = pack_columns(zero.t().contiguous(), AWQ_ORDER)
            out[module + ".scales"] = scale.t()
        else:                # GPTQ v1: qweight packed along K, zero points stored less one
            out[module + ".qweight"] = pack_rows(q.t().contiguous())
            out[module + ".qzeros"] = pack_columns((zero - 1).t().contiguous())
            out[module + ".scales"] = scale.t()
            out[module + ".g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // group
    qconfig = {
        "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": list(block)},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
                 "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True},
    }[fmt]
    _save(dst, config, qconfig, out)
    return ref


def _write_compressed_tensors(src: Path, dst: Path, static: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' FP8_DYNAMIC (per-channel weights) or FP8 (per-tensor weights, static
    per-tensor input scales) preset, scales set as an observer would (amax / 448), compressed and
    saved by its ModelCompressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    scheme = preset_name_to_scheme("FP8" if static else "FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    ref = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not hasattr(mod, "weight_scale"):
                continue
            w = mod.weight
            amax = w.abs().amax() if static else w.abs().amax(1, keepdim=True)
            mod.weight_scale.copy_((amax / 448).reshape(mod.weight_scale.shape))
            if static:
                mod.input_scale.fill_(static_input_scale(name))
            ref[name + ".weight"] = (w / mod.weight_scale).clamp(-448, 448).to(FP8).float() * mod.weight_scale
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return ref


def static_input_scale(module: str) -> float:
    """The "calibrated" input scale of a module: the same for layers that read the same input
    (q/k/v, gate/up), as a calibration would find, different between inputs and layers."""
    layer = int(module.split(".")[2])
    which = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
    return 0.02 + 0.004 * which[module.split(".")[-1]] + 0.002 * layer

"""Write a Hugging Face Llama model directory with random weights, for serving benchmarks.

What it writes (into ``--out``)
  config.json                     LlamaForCausalLM with ``offline.py``'s shapes: Llama-3-8B
                                  (``--shape 8b``: hidden 4096, 32 layers, 32 / 8 heads,
                                  intermediate 14336, vocab 128256, rope theta 500000) or its
                                  2-layer ``tiny`` twin (for tests); Qwen3ForCausalLM / Gemma2ForCausalLM with
                                  ``--shape qwen3-8b`` / ``gemma2-9b`` (tiny twins: ``qwen3-tiny``,
                                  ``gemma2-tiny``); MixtralForCausalLM /
                                  Qwen3MoeForCausalLM with ``mixtral-8x7b`` (93 GB bf16) /
                                  ``qwen3-30b-a3b`` (61 GB), one tensor per expert as published
                                  checkpoints (tiny twins: ``mixtral-tiny``, ``qwen3-moe-tiny``);
                                  ``--num-layers`` shrinks any
  model-0000i-of-0000N.safetensors
  model.safetensors.index.json    the weights, drawn by ``random_hf_weights``
                                  (llmserve/common/basemodel/layer_weights/random_weights.py: the
                                  same seed gives the same weights as ``offline.py`` and
                                  ``--load-format dummy``), one layer at a time, in shards of at most ``--shard-size`` bytes (5 GB, as HF)
  tokenizer.json, ...             ``--tokenizer``'s tokenizer, padded to the config's vocab size

  With ``--config-only`` no weights: the server draws the same random weights at load
  (``llmserve serve --load-format dummy``), which is how a 70B shape (``--shape 70b``) is
  benchmarked without writing 141 GB.

The tokenizer
  There is no network and no Llama-3 tokenizer here, so any saved HF tokenizer (by default the
  embedded SmolLM2 one, 49152 ids) is padded with plain vocabulary entries ``<|t{id}|>`` until it
  has exactly ``vocab_size`` ids: every id the random model can sample then decodes to text. The
  entries go straight into ``tokenizer.json``'s model vocabulary rather than through
  ``add_tokens``: 79104 added tokens save fine (0.4 s) but make every later load build a matcher
  for them (3 s instead of 0.3 s, and a 18 MB tokenizer.json instead of 3.4 MB). They have no
  merges, so no text ever encodes to them; prompts keep the original vocabulary.

Memory
  Only one layer is on ``--device`` at a time (8B bf16: 436 MB; the first "layer", embedding +
  lm_head, 2.1 GB); the host holds at most one shard (``--shard-size``) before writing it.

Run:  python benchmarks/make_random_model.py --out /data/llama3-8b-random            (GPU: ~1 min)
      python benchmarks/make_random_model.py --shape tiny --device cpu --out /tmp/tiny  (seconds)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from offline import CONFIGS, random_hf_weights  # also takes this folder off sys.path (see common.py)

from common import dtype_name, resolve_dtype  # noqa: E402  (sys.modules hit: common is already imported by offline)

INDEX_FILE = "model.safetensors.index.json"
PAD_TOKEN_FORMAT = "<|t{}|>"


# -- tokenizer -------------------------------------------------------------------------------
def load_source_tokenizer(path: str | None):
    """The tokenizer to pad: a saved HF tokenizer directory, or the embedded default model's."""
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from llmserve.common.basemodel.layer_weights.gguf_load_utils import load_gguf_tokenizer
    from llmserve.default_model import default_model_path

    return load_gguf_tokenizer(default_model_path())


def pad_tokenizer_json(tokenizer_json: dict, vocab_size: int, first_id: int) -> int:
    """Add ``PAD_TOKEN_FORMAT`` entries with ids ``first_id .. vocab_size-1`` to the model
    vocabulary of a parsed ``tokenizer.json``. Returns how many were added."""
    model = tokenizer_json["model"]
    kind = model.get("type")
    vocab = model.get("vocab")
    taken = {t["content"] for t in tokenizer_json.get("added_tokens") or []}
    if kind in ("BPE", "WordPiece", "WordLevel") and isinstance(vocab, dict):
        taken.update(vocab)
        add = lambda token, i: vocab.__setitem__(token, i)  # noqa: E731
    elif kind == "Unigram" and isinstance(vocab, list):
        if len(vocab) != first_id:
            raise ValueError(f"Unigram vocabulary has {len(vocab)} pieces, expected {first_id}")
        taken.update(piece for piece, _ in vocab)
        min_score = min(score for _, score in vocab)
        add = lambda token, i: vocab.append([token, min_score - 1.0])  # noqa: E731
    else:
        raise ValueError(f"cannot pad a {kind!r} tokenizer model")
    for i in range(first_id, vocab_size):
        token = PAD_TOKEN_FORMAT.format(i)
        if token in taken:
            raise ValueError(f"the tokenizer already has a token {token!r}")
        add(token, i)
    return vocab_size - first_id


def write_padded_tokenizer(tokenizer, vocab_size: int, out: Path) -> None:
    """Save ``tokenizer`` into ``out``, padded to ``vocab_size`` ids; checks the result loads with
    that many ids and that the last one decodes to text."""
    from transformers import AutoTokenizer

    n = len(tokenizer)
    if n > vocab_size:
        raise ValueError(f"the tokenizer has {n} ids, more than the vocabulary size {vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tokenizer_json = Path(tmp) / "tokenizer.json"
        if n < vocab_size:
            if tokenizer_json.is_file():
                data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
                ids = list(_vocab_ids(data["model"])) + [t["id"] for t in data.get("added_tokens") or []]
                if max(ids) + 1 != n:
                    raise ValueError(f"tokenizer ids are not contiguous 0..{n - 1} (largest {max(ids)})")
                pad_tokenizer_json(data, vocab_size, n)
                tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
            else:  # a slow (Python) tokenizer: added tokens are its only way to grow
                from tokenizers import AddedToken

                tokenizer.add_tokens([AddedToken(PAD_TOKEN_FORMAT.format(i), special=False, normalized=False)
                                      for i in range(n, vocab_size)])
                tokenizer.save_pretrained(tmp)
        for f in Path(tmp).iterdir():
            shutil.copy2(f, out / f.name)
    check = AutoTokenizer.from_pretrained(out)
    if len(check) != vocab_size:
        raise RuntimeError(f"the saved tokenizer has {len(check)} ids, expected {vocab_size}")
    if not check.decode([vocab_size - 1]):
        raise RuntimeError(f"id {vocab_size - 1} decodes to nothing")


def _vocab_ids(model: dict) -> Iterable[int]:
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        return vocab.values()
    return range(len(vocab or []))


# -- weights ---------------------------------------------------------------------------------
def write_shards(layers: Iterable[dict[str, torch.Tensor]], out: Path, shard_bytes: int,
                 progress: bool = True) -> dict:
    """Save the layers' tensors in safetensors shards of at most ``shard_bytes`` (a layer is never
    split; a layer larger than that gets a shard of its own), named as HF names them, plus the
    index. Returns {"total_size", "shards", "draw_s" (per layer), "write_s"}."""
    from safetensors.torch import save_file

    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    shards: list[list[str]] = []
    draw_s: list[float] = []
    write_s = 0.0
    total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, write_s
        t0 = time.perf_counter()
        save_file(pending, str(out / f".shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
        write_s += time.perf_counter() - t0
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    it = iter(layers)
    while True:
        t0 = time.perf_counter()
        layer = next(it, None)
        if layer is None:
            break
        layer = {k: v.to("cpu").contiguous() for k, v in layer.items()}  # one device layer at a time
        draw_s.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in layer.values())
        if pending and pending_bytes + nbytes > shard_bytes:
            flush()
        pending.update(layer)
        pending_bytes += nbytes
        total += nbytes
        if progress:
            print(f"  layer {len(draw_s) - 1}: {nbytes / 1e6:.0f} MB drawn in {draw_s[-1]:.2f} s", file=sys.stderr)
    if pending:
        flush()

    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        (out / f".shard-{i}.safetensors").rename(out / name)
        (out / name).chmod(0o644)  # safetensors writes its files 0600
    weight_map = {tensor: name for name, tensors in zip(names, shards) for tensor in tensors}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return {"total_size": total, "shards": names, "draw_s": draw_s, "write_s": write_s}


def write_config(cfg: dict, tokenizer, dtype: torch.dtype, out: Path) -> None:
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]     # LlamaForCausalLM, Qwen3ForCausalLM
    config = AutoConfig.for_model(**cfg, architectures=[architecture], dtype=dtype,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id).save_pretrained(out)


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write (created; must be empty if it exists)")
    p.add_argument("--shape", choices=sorted(CONFIGS), default="8b", help="8b: Llama-3-8B shapes (default); 70b: Llama-3-70B's; qwen3-8b, gemma2-9b: Qwen3-8B's, Gemma-2-9B's; qwen3-30b-a3b, mixtral-8x7b: those MoE models' (per-expert tensors, as published); tiny, qwen3-tiny, gemma2-tiny, qwen3-moe-tiny, mixtral-tiny: 2 small layers")
    p.add_argument("--num-layers", type=int, default=None, help="override the shape's layer count")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="override the vocabulary size (default: the shape's, or the tokenizer's rounded up to 64 "
                        "where the shape's is smaller, as for tiny)")
    p.add_argument("--tokenizer", default=None, help="saved HF tokenizer directory (default: the embedded SmolLM2's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the weights are drawn: cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    p.add_argument("--shard-size", type=float, default=5e9, help="bytes per safetensors shard at most (default 5e9)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (0 = offline.py's weights)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.add_argument("--config-only", action="store_true",
                   help="write the config and tokenizer, no weights: a directory `llmserve serve --load-format dummy` "
                        "serves with random weights drawn at load (a 70B shape in seconds, no 141 GB written)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise SystemExit(f"{out} is not empty (--force to write into it anyway)")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)

    t_start = time.perf_counter()
    tokenizer = load_source_tokenizer(args.tokenizer)
    cfg = dict(CONFIGS[args.shape])
    if args.num_layers is not None:
        cfg["num_hidden_layers"] = args.num_layers
    if args.vocab_size is not None:
        cfg["vocab_size"] = args.vocab_size
    elif cfg["vocab_size"] < len(tokenizer):
        cfg["vocab_size"] = -(-len(tokenizer) // 64) * 64
    vocab = cfg["vocab_size"]

    t0 = time.perf_counter()
    write_padded_tokenizer(tokenizer, vocab, out)
    tok_s = time.perf_counter() - t0
    tok_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"tokenizer: {len(tokenizer)} ids padded to {vocab} in {tok_s:.1f} s, {tok_bytes / 1e6:.1f} MB on disk",
          file=sys.stderr)
    write_config(cfg, tokenizer, dtype, out)
    if args.config_only:
        print(f"wrote {out}: config and tokenizer only (serve it with --load-format dummy)", file=sys.stderr)
        return 0

    print(f"weights: {args.shape} shapes, {cfg['num_hidden_layers']} layers, {dtype_name(dtype)}, "
          f"drawn on {device}", file=sys.stderr)
    with torch.no_grad():
        info = write_shards(random_hf_weights(cfg, device, dtype, seed=args.seed), out, int(args.shard_size))
    draw = info["draw_s"]
    layer_mean = sum(draw[1:]) / max(1, len(draw) - 1)
    print(f"wrote {out}: {info['total_size'] / 1e9:.2f} GB in {len(info['shards'])} shard(s); "
          f"embedding+lm_head {draw[0]:.1f} s, {layer_mean:.2f} s per layer drawn, {info['write_s']:.1f} s writing; "
          f"{time.perf_counter() - t_start:.1f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

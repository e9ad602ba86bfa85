"""Decode-step latency of a Llama-3-8B-shaped (or Qwen3-8B-shaped) model, against the memory-bandwidth floor.

What is measured
  A ``LlamaTpPartModel`` with Llama-3-8B's shapes (hidden 4096, 32 layers, 32 query / 8 KV
  heads, intermediate 14336, vocab 128256, rope theta 500000; bf16), or with ``--model-size
  qwen3-8b`` a ``Qwen3TpPartModel`` with Qwen3-8B's (hidden 4096, 36 layers, 32 / 8 heads of 128,
  intermediate 12288, vocab 151936, rope theta 1e6, q/k norms), and random weights, drawn
  on the device one layer at a time (scale 0.02, norms 1) so the peak memory stays at about the
  weights' own size. No checkpoint and no network are needed. For each batch size:

  1. prefill ``batch`` random prompts of ``--prompt-len`` tokens, in groups of at most 16384
     tokens per forward (timed by wall clock, reported as "prefill tok/s");
  2. run ``--warmup-steps`` decode steps of the whole batch, untimed;
  3. time ``--steps`` decode steps: each is ``model.forward`` on the batch's previous argmax
     tokens plus the argmax of the logits, between two CUDA events (no synchronisation between
     steps, so a step's time includes any GPU idle time its host-side work caused).

  Logits must stay finite (checked after the prefill and after the last step).

  With ``--verify K[,K]`` each batch size and mode also times speculative verify steps of 1 + K
  tokens a request (the previous token and K random draft tokens, every row's logits and their
  argmax, as the server's verify step wants them), the draft then rejected (cut from the table),
  so each step attends to as many cached tokens as the decode step it stands beside. The model
  is built with --speculate max(K), so the graphs mode replays the verify step's CUDA graph as
  the server does. Its floor is the decode step's (the K draft keys' bytes are far below 0.1% of it).

Columns
  ms/step          mean of the timed steps (the KV cache grows by one token per step)
  tok/s            batch / (ms/step)
  weights GB       parameter bytes a decode step reads: every weight tensor the model holds
                   (counted from its weight objects) except the token-embedding table, of which
                   a step reads only the batch's rows (1.05 GB of the 16.06 GB held at 8B), and
                   less, in a mixture-of-experts model, the experts no token of the step routes to
                   (expected_experts_hit: at batch 1 Qwen3-30B-A3B reads 8 of each layer's 128)
  KV GB/step       batch * kv_len * layers * 2 (K and V) * Hkv * head_dim * bytes, kv_len being
                   the tokens each query attends to, averaged over the timed steps (bytes: the
                   cache's dtype's, 1 with --kv-cache-dtype fp8)
  floor ms         (weights GB + KV GB/step) / measured device-to-device copy bandwidth (bytes
                   read + written, 1 GiB copy): the step time if the GPU did nothing but stream
                   those bytes once at the bandwidth a plain copy achieves. Activations, logits
                   and the KV writes are left out (under 1% here), so it is a lower bound.
  measured/floor   ms/step / floor ms (1.0 would be perfect)

  mode             eager: every kernel launched from Python on every step; graphs: the step
                   replayed from a CUDA graph captured at start-up, as the server runs it on a GPU
                   (one model: the eager rows run the same weights with its graphs set aside);
                   "verify 1+K": a verify step of 1 + K tokens a request (--verify)

Run (GPU):   python benchmarks/offline.py --json benchmarks/results/offline.json
Smoke (CPU): python benchmarks/offline.py --device cpu --model-size tiny --batch-sizes 1,4 --prompt-len 32 --steps 4
             (qwen3-tiny, gemma2-tiny, qwen3-moe-tiny, mixtral-tiny: the same for those model classes)
MoE (GPU):   python benchmarks/offline.py --model-size qwen3-30b-a3b --batch-sizes 1,64 --peer hf-compiled
FP8 KV (GPU): python benchmarks/offline.py --batch-sizes 1,128 --modes graphs --kv-cache-dtype fp8
Verify (GPU): python benchmarks/offline.py --batch-sizes 1,8 --prompt-len 1024 --verify 4,8 --peer hf-compiled
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from common import (
    add_device_arguments,
    IntervalTimer,
    dtype_name,
    gc_paused,
    environment,
    markdown_table,
    measure_copy_bandwidth,
    remove_script_dir_from_sys_path,
    resolve_dtype,
    synchronize,
    write_json,
)
from hf_peer import PEERS, HFPeer, build_hf_model

remove_script_dir_from_sys_path()

from llmserve.common.basemodel import ModelInitParams  # noqa: E402  (after the sys.path fix above)
from llmserve.common.basemodel.layer_weights.gguf_load_utils import load_gguf  # noqa: E402
from llmserve.common.basemodel.layer_weights.random_weights import random_hf_weights  # noqa: E402
from llmserve.kernels import QuantizedWeight  # noqa: E402
from llmserve.kernels.quantized_linear import kernel_available  # noqa: E402
from llmserve.common.basemodel import TpPartBaseModel  # noqa: E402
from llmserve.models.registry import GGUF_ARCHS, get_model_class  # noqa: E402
from llmserve.quantization import KV_CACHE_DTYPES  # noqa: E402
from llmserve.quantization.config import quantize_fp8_blocks, quantize_int4  # noqa: E402
from llmserve.quantization.weights import PackedWeight  # noqa: E402

LLAMA3_8B_CONFIG: dict = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

# Llama-3-70B's: hidden 8192, 80 layers, 64 / 8 heads, intermediate 28672. bf16: 141 GB, four
# GPUs (tp=4: `llmserve serve --load-format dummy` on `make_random_model.py --config-only`'s directory).
LLAMA3_70B_CONFIG: dict = {**LLAMA3_8B_CONFIG, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                           "intermediate_size": 28672}

# Same architecture, small enough to build and run on a CPU in seconds.
TINY_CONFIG: dict = {
    **LLAMA3_8B_CONFIG,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 1024,
}

# SmolLM2-135M's shapes (the embedded default model): the CPU comparison with HF. Its lm_head is
# tied to the embedding; untied here (random weights for both), which reads the same bytes a step.
SMOLLM2_135M_CONFIG: dict = {
    **LLAMA3_8B_CONFIG,
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
}

# Qwen3-8B's shapes: Llama's layer plus per-head q/k RMSNorm; 36 layers, a wider vocabulary.
QWEN3_8B_CONFIG: dict = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

# Its CPU-sized twin; the head size is not hidden / heads, as in Qwen3-0.6B (128 for 1024 / 16).
QWEN3_TINY_CONFIG: dict = {**TINY_CONFIG, **{k: QWEN3_8B_CONFIG[k] for k in ("model_type", "rope_theta", "rms_norm_eps")},
                           "head_dim": 64}

# Gemma-2-9B's shapes: 42 layers of 16 query / 8 KV heads of 256, GeGLU, four norms a layer, a
# 256k vocabulary whose embedding is also the lm_head (read once a step: the floor counts it once),
# windows of 4096 on alternate layers, attention (50) and final-logit (30) soft-caps.
GEMMA2_9B_CONFIG: dict = {
    "model_type": "gemma2",
    "hidden_size": 3584,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "intermediate_size": 14336,
    "vocab_size": 256000,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}
# Its CPU-sized twin, with a window (64) that --prompt-len 100 outgrows.
GEMMA2_TINY_CONFIG: dict = {**GEMMA2_9B_CONFIG, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 1024,
                            "query_pre_attn_scalar": 32, "sliding_window": 64}

# Qwen3-30B-A3B's shapes: Qwen3's attention (32 / 4 heads of 128) and 128 experts of 768 in every
# layer, 8 routed per token and renormalised. bf16: 61 GB, one H100.
QWEN3_30B_A3B_CONFIG: dict = {
    **QWEN3_8B_CONFIG,
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# Mixtral-8x7B's: Mistral's attention and 8 experts of 14336 in every layer, top 2. bf16: 93 GB,
# two GPUs (tp=2: make_random_model.py, then the server or engine.py with --tp 2).
MIXTRAL_8X7B_CONFIG: dict = {
    **LLAMA3_8B_CONFIG,
    "model_type": "mixtral",
    "vocab_size": 32000,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": None,
}

# Their CPU-sized twins.
QWEN3_MOE_TINY_CONFIG: dict = {**QWEN3_30B_A3B_CONFIG, **{k: TINY_CONFIG[k] for k in (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")},
    "head_dim": 64, "moe_intermediate_size": 64, "num_experts": 16, "num_experts_per_tok": 4}
MIXTRAL_TINY_CONFIG: dict = {**TINY_CONFIG, **{k: MIXTRAL_8X7B_CONFIG[k] for k in (
    "model_type", "num_local_experts", "num_experts_per_tok", "sliding_window")}}

CONFIGS = {"8b": LLAMA3_8B_CONFIG, "70b": LLAMA3_70B_CONFIG, "smollm2": SMOLLM2_135M_CONFIG, "tiny": TINY_CONFIG,
           "qwen3-8b": QWEN3_8B_CONFIG, "qwen3-tiny": QWEN3_TINY_CONFIG,
           "gemma2-9b": GEMMA2_9B_CONFIG, "gemma2-tiny": GEMMA2_TINY_CONFIG,
           "qwen3-30b-a3b": QWEN3_30B_A3B_CONFIG, "qwen3-moe-tiny": QWEN3_MOE_TINY_CONFIG,
           "mixtral-8x7b": MIXTRAL_8X7B_CONFIG, "mixtral-tiny": MIXTRAL_TINY_CONFIG}
MAX_PREFILL_TOKENS = 16384


# -- the model -----------------------------------------------------------------------------
# Formats the benchmark quantizes the random weights to (a checkpoint's kernel and bytes, not its values).
BENCH_QUANTIZERS: dict[str, Callable[[torch.Tensor], PackedWeight]] = {"fp8-block": quantize_fp8_blocks, "int4": quantize_int4}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized_linears(weights: Iterable[dict], quantize: Callable[[torch.Tensor], PackedWeight]) -> Iterator[dict]:
    """``weights`` with each decoder linear weight replaced by ``quantize(weight)``, layer by layer
    (so only one layer's dense weights are live)."""
    for layer in weights:
        yield {name: quantize(t) if name.endswith(".weight") and name.split(".")[-2] in _LINEARS else t
               for name, t in layer.items()}


def nbytes(w: torch.Tensor | QuantizedWeight | PackedWeight) -> int:
    """Bytes of a weight, a quantized one's scales included (the floor's bytes)."""
    return w.nbytes


def weight_bytes(model: TpPartBaseModel) -> tuple[int, int]:
    """(bytes held, bytes a decode step reads): all weights, less the embedding table when it is
    not also the lm_head (a step looks up only the batch's rows of it)."""
    held = sum(nbytes(w) for w in model.held_weights())
    wte, lm_head = model.pre_post_weight.wte_weight_, model.pre_post_weight.lm_head_weight_
    return held, held - (0 if wte is lm_head else nbytes(wte))


def expected_experts_hit(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer's router picks for ``batch`` tokens, on average, when each token's
    k experts are a uniform draw (random weights route so: their router logits are near zero).
    One token hits k of them; 64 tokens of Qwen3-30B-A3B (8 of 128) hit 125 of the 128."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_weight_bytes(model: TpPartBaseModel, read: int, batch: int) -> float:
    """Bytes a decode step of ``batch`` requests reads: ``read`` (every weight, see weight_bytes)
    less the experts its tokens leave untouched (an expert nobody routes to is never read)."""
    for layer in model.trans_layers_weight:
        moe = getattr(layer, "moe_", None)
        if moe is not None:
            experts = moe.w13.shape[0]
            per_expert = (nbytes(moe.w13) + nbytes(moe.w2)) / experts
            read -= (experts - expected_experts_hit(experts, moe.top_k, batch)) * per_expert
    return read


def hf_weight_bytes(hf_model) -> int:
    """Bytes a decode step of the HF peer reads: its parameters less an untied embedding table."""
    held = sum(p.numel() * p.element_size() for p in hf_model.parameters())   # tied ones once
    emb, head = hf_model.get_input_embeddings().weight, hf_model.get_output_embeddings().weight
    return held - (0 if emb is head else emb.numel() * emb.element_size())


def kv_bytes_per_token(model: TpPartBaseModel) -> int:
    """KV-cache bytes of one token over all layers (K and V)."""
    mem = model.mem_manager
    return mem.layer_num * 2 * mem.head_num * mem.head_dim * mem.dtype.itemsize


def build_model(cfg: dict, device: torch.device, dtype: torch.dtype, max_batch: int, max_len: int,
                graphs: bool = False, weights: Iterable[dict] | None = None,
                quantization: str | None = None, kv_cache_dtype: str = "auto", speculate: int = 0,
                tp_rank: int = 0, world_size: int = 1) -> TpPartBaseModel:
    """Our model of ``cfg``'s shapes holding ``weights`` (default: `random_hf_weights`); with
    ``speculate`` its verify steps of up to 1 + speculate tokens a request replay graphs too;
    at ``world_size`` > 1, rank ``tp_rank``'s share (torch.distributed joined already)."""
    params = ModelInitParams(
        tp_rank=tp_rank,
        world_size=world_size,
        cuda_graph_max_bs=max_batch if graphs else 0,          # the model takes them on a GPU only
        model_path="",
        device=str(device),
        dtype=dtype,
        max_total_token_num=max_batch * max_len + 64,
        max_running_requests=max_batch,
        max_seq_len=max_len,
        config=cfg,
        weights=weights if weights is not None else random_hf_weights(cfg, device, dtype),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        speculate=speculate,
        speculate_max_batch=max_batch,
    )
    return get_model_class(cfg["model_type"])(params)


# -- the benchmark -------------------------------------------------------------------------
@dataclass
class BatchResult:
    mode: str                     # eager | graphs
    batch: int
    prompt_len: int
    prefill_s: float
    step_ms: list[float] = field(repr=False)
    ms_per_step: float
    median_ms_per_step: float
    tokens_per_s: float
    weight_bytes_read: int
    kv_bytes_per_step: float
    floor_ms: float
    measured_over_floor: float


def check_finite(logits: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError(f"non-finite logits after {what}: the random weights' scale is off")


def prefill(model: TpPartBaseModel, rows: list[int], prompt_len: int) -> torch.Tensor:
    """Random prompts for ``rows``, prefilled in forwards of at most MAX_PREFILL_TOKENS tokens.
    Returns the logits of each request's last prompt token."""
    group = max(1, MAX_PREFILL_TOKENS // prompt_len)
    logits = []
    for i in range(0, len(rows), group):
        chunk = rows[i:i + group]
        ids = torch.randint(model.vocab_size, (len(chunk) * prompt_len,), device=model.device)
        logits.append(model.forward(ids, chunk, [0] * len(chunk), [prompt_len] * len(chunk)))
    return torch.cat(logits)


def run_batch(model: TpPartBaseModel, mode: str, batch: int, prompt_len: int, warmup: int, steps: int,
              copy_bw: float, weights_read: int, draft: int = 0) -> BatchResult:
    """Decode steps of ``batch`` requests, or with ``draft`` verify steps of 1 + draft tokens each."""
    graphs = model.decode_graphs, model.verify_graphs
    if mode == "eager":
        model.decode_graphs = model.verify_graphs = None   # the same model, its steps run the plain forward
    try:
        return _run_batch(model, mode, batch, prompt_len, warmup, steps, copy_bw, weights_read, draft)
    finally:
        model.decode_graphs, model.verify_graphs = graphs


def summarize(mode: str, batch: int, prompt_len: int, prefill_s: float, step_ms: list[float], warmup: int,
              copy_bw: float, weights_read: int, kv_per_token: int, device: torch.device) -> BatchResult:
    steps = len(step_ms)
    # Timed step s attends to prompt_len + warmup + s + 1 tokens per request (its own included).
    kv_lens = [prompt_len + warmup + s + 1 for s in range(steps)]
    kv_bytes = batch * statistics.mean(kv_lens) * kv_per_token
    ms = statistics.mean(step_ms)
    floor_ms = (weights_read + kv_bytes) / copy_bw * 1e3
    median = statistics.median(step_ms)
    if device.type == "cuda" and max(step_ms) > 3 * median:
        print(f"warning: {mode}, batch {batch}: slowest step {max(step_ms):.1f} ms vs median {median:.1f} ms "
              "(a JIT compile or allocator growth inside the timed steps?)", file=sys.stderr)
    return BatchResult(
        mode=mode, batch=batch, prompt_len=prompt_len, prefill_s=prefill_s, step_ms=step_ms,
        ms_per_step=ms, median_ms_per_step=median, tokens_per_s=batch / (ms * 1e-3),
        weight_bytes_read=weights_read, kv_bytes_per_step=kv_bytes, floor_ms=floor_ms,
        measured_over_floor=ms / floor_ms,
    )


def _run_batch(model: TpPartBaseModel, mode: str, batch: int, prompt_len: int, warmup: int, steps: int,
               copy_bw: float, weights_read: int, draft: int) -> BatchResult:
    rows = [model.req_manager.alloc_req() for _ in range(batch)]
    try:
        synchronize(model.device)
        t0 = time.perf_counter()
        logits = prefill(model, rows, prompt_len)
        synchronize(model.device)
        prefill_s = time.perf_counter() - t0
        check_finite(logits, "prefill")

        tokens = logits.argmax(dim=-1)
        lens = [prompt_len] * batch
        q_lens = [1 + draft] * batch
        drafts = torch.randint(model.vocab_size, (batch, draft), device=model.device)
        timer = IntervalTimer(model.device)
        with gc_paused():
            for _ in range(warmup + steps):
                timer.start()
                if draft:   # every row's logits; the token after the first row's goes on
                    ids = torch.cat([tokens[:, None], drafts], dim=1).flatten()
                    logits = model.forward(ids, rows, lens, q_lens, return_all_logits=True)
                    tokens = logits.argmax(dim=-1).view(batch, 1 + draft)[:, 0]
                else:
                    logits = model.forward(tokens, rows, lens, q_lens)
                    tokens = logits.argmax(dim=-1)
                timer.stop()
                lens = [n + 1 for n in lens]
                if draft:   # the drafts rejected, as the worker cuts them (not timed)
                    model.req_manager.truncate_batch(rows, lens)
        step_ms = timer.elapsed_ms()[warmup:]
        check_finite(logits, "verify" if draft else "decode")
    finally:
        for row in rows:
            model.req_manager.free_req(row)

    return summarize(f"{mode} verify 1+{draft}" if draft else mode, batch, prompt_len, prefill_s, step_ms, warmup,
                     copy_bw, weights_read, kv_bytes_per_token(model), model.device)


@torch.inference_mode()
def last_logits(model: TpPartBaseModel) -> tuple[torch.Tensor, torch.Tensor]:
    """A short random prompt and our logits of its last token: what the peer must reproduce."""
    n = min(16, model.max_seq_len)
    ids = torch.randint(model.vocab_size, (n,), device=model.device)
    row = model.req_manager.alloc_req()
    try:
        return ids, model.forward(ids, [row], [0], [n])[0].float()
    finally:
        model.req_manager.free_req(row)


@torch.inference_mode()
def check_same_model(reference: tuple[torch.Tensor, torch.Tensor], hf_model, dtype: torch.dtype,
                     experts: bool = False) -> None:
    """The peer computes what we compute: one short prompt's last logits agree (to the dtype's
    rounding), so the two hold the same weights and the table compares like with like."""
    ids, ours = reference
    theirs = hf_model(input_ids=ids[None], logits_to_keep=1).logits[0, -1].float()
    err = float((ours - theirs).norm() / theirs.norm())
    # float32 agrees to rounding; in half precision 32 random layers drift apart by several
    # percent (as in tests/parity_utils.py), while different weights would differ by ~100%; with
    # experts, that drift also flips near-tied routing choices (a different expert for a token)
    if err > (1e-3 if dtype == torch.float32 else 0.3 if experts else 0.1):
        raise RuntimeError(f"the peer's logits differ from ours by {err:.3f} (relative): not the same model")
    print(f"peer check: last-token logits agree to {err:.1e} (relative)", file=sys.stderr)


def warm_up_kernels(model: TpPartBaseModel, prompt_len: int, max_batch: int) -> None:
    """Prefill one request, then a full prefill group, then two decode steps, so Triton's
    compiles (the attention tiles depend on the batch's shape) and cuBLAS's set-up are not
    charged to a measured prefill."""
    group = max(1, min(max_batch, MAX_PREFILL_TOKENS // prompt_len))
    rows = [model.req_manager.alloc_req() for _ in range(group)]
    try:
        prefill(model, rows[:1], prompt_len)
        model.req_manager.free_req(rows[0])
        rows[0] = model.req_manager.alloc_req()
        logits = prefill(model, rows, prompt_len)
        for n in (prompt_len, prompt_len + 1):
            logits = model.forward(logits.argmax(dim=-1), rows, [n] * group, [1] * group)
        synchronize(model.device)
    finally:
        for row in rows:
            model.req_manager.free_req(row)


# -- output ----------------------------------------------------------------------------------
def results_table(results: list[BatchResult]) -> str:
    headers = ["mode", "batch", "prompt", "ms/step", "tok/s", "weights GB", "KV GB/step", "floor ms",
               "measured/floor", "prefill tok/s"]
    rows = [
        [r.mode, r.batch, r.prompt_len, f"{r.ms_per_step:.2f}", f"{r.tokens_per_s:.0f}", f"{r.weight_bytes_read / 1e9:.2f}",
         f"{r.kv_bytes_per_step / 1e9:.2f}", f"{r.floor_ms:.2f}", f"{r.measured_over_floor:.2f}",
         f"{r.batch * r.prompt_len / r.prefill_s:.0f}"]
        for r in results
    ]
    return markdown_table(headers, rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,32,128", help="comma-separated (default: 1,32,128)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps before them")
    p.add_argument("--model-size", choices=sorted(CONFIGS), default="8b",
                   help="8b: Llama-3-8B shapes; qwen3-8b: Qwen3-8B's; gemma2-9b: Gemma-2-9B's; qwen3-30b-a3b, "
                        "mixtral-8x7b: those MoE models' (Mixtral-8x7B needs two GPUs: see make_random_model.py); "
                        "smollm2: SmolLM2-135M's (the embedded model; for CPU comparisons); tiny, qwen3-tiny, "
                        "gemma2-tiny, qwen3-moe-tiny, mixtral-tiny: 2 small layers, for CPU smoke tests")
    p.add_argument("--peer-batch-sizes", default=None,
                   help="the batch sizes the peer runs, some of --batch-sizes (default: all of them; hf-compiled "
                        "compiles once per batch size, which takes minutes for an 8B model)")
    p.add_argument("--modes", default="eager,graphs",
                   help="decode step modes to time, comma-separated: eager (every kernel launched from Python), "
                        "graphs (CUDA graphs, as the server runs on a GPU; CUDA only) (default: eager,graphs)")
    p.add_argument("--verify", default="", metavar="K,...",
                   help="also time speculative verify steps of 1 + K tokens a request beside each decode row, "
                        "e.g. 4,8 (the model takes --speculate max(K); default: none)")
    p.add_argument("--peer", choices=["none", *PEERS], default="none",
                   help="also time HF transformers on the same weights: hf (eager, dynamic cache, as generate "
                        "does) or hf-compiled (static cache + torch.compile reduce-overhead) (default: none)")
    p.add_argument("--quantization", choices=["fp8", *BENCH_QUANTIZERS], default=None,
                   help="quantize the decoder's linear weights at load: fp8 as `llmserve serve --quantization fp8` "
                        "does (per-channel FP8 weights, dynamic per-token FP8 activations, _scaled_mm); fp8-block "
                        "in 128 x 128 tiles and int4 in groups of 128 (asymmetric, as AWQ / GPTQ checkpoints hold "
                        "them) by round-to-nearest, run by the dequantizing kernel; the floor counts their bytes, "
                        "scales and zeros included")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's dtype, as `llmserve serve --kv-cache-dtype`: fp8 stores K and V in float8 "
                        "(scales 1.0); the floor counts its bytes (default: auto, the model's)")
    p.add_argument("--gguf", default=None, metavar="FILE|default",
                   help="the weights and shapes of a GGUF file instead of random ones ('default': the embedded "
                        "SmolLM2-135M-Instruct): on CPU ours runs its Q4_0/Q4_1/Q8_0 matrices in their blocks "
                        "(as llmserve serve does), the HF peer the same weights dequantized to float32")
    add_device_arguments(p)
    return p.parse_args()


def peer_batch_sizes(arg: str | None, batch_sizes: list[int]) -> list[int]:
    """The batch sizes the peer runs: ``--peer-batch-sizes`` (some of ``--batch-sizes``), else all."""
    chosen = [int(b) for b in arg.split(",") if b.strip()] if arg else batch_sizes
    if not set(chosen) <= set(batch_sizes):
        raise SystemExit(f"--peer-batch-sizes {arg!r} must be among --batch-sizes {batch_sizes}")
    return chosen


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cfg, weights, peer_weights, shapes = CONFIGS[args.model_size], None, None, args.model_size
    if args.gguf:
        from llmserve.default_model import default_model_path

        path = default_model_path() if args.gguf == "default" else args.gguf
        quantized = device.type == "cpu" and dtype == torch.float32 and kernel_available()
        ckpt = load_gguf(path, GGUF_ARCHS, progress=False, quantized=quantized)
        cfg, weights, shapes = ckpt.config, [ckpt.tensors], os.path.basename(path)
        if args.peer != "none":
            peer_weights = [load_gguf(path, GGUF_ARCHS, progress=False).tensors]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    max_len = args.prompt_len + args.warmup_steps + args.steps
    torch.manual_seed(0)

    copy_bw = measure_copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s; building {shapes} model "
          f"({dtype_name(dtype)}, {'its' if args.gguf else 'random'} weights) on {device} ...", file=sys.stderr)
    modes = [m for m in args.modes.split(",") if m.strip() and (m != "graphs" or device.type == "cuda")]
    if not set(modes) <= {"eager", "graphs"}:
        raise SystemExit(f"--modes: eager and/or graphs, got {args.modes!r}")
    if args.quantization in BENCH_QUANTIZERS:
        weights = quantized_linears(weights or random_hf_weights(cfg, device, dtype), BENCH_QUANTIZERS[args.quantization])
    drafts = [int(k) for k in args.verify.split(",") if k.strip()]
    model = build_model(cfg, device, dtype, max(batch_sizes), max_len + max(drafts, default=0), graphs="graphs" in modes,
                        weights=weights, quantization="fp8" if args.quantization == "fp8" else None,
                        kv_cache_dtype=args.kv_cache_dtype, speculate=max(drafts, default=0))
    if model.decode_graphs is not None:
        print(f"CUDA graphs for batch <= {model.decode_graphs.max_batch_size}: captured in "
              f"{model.decode_graphs.capture_seconds:.1f} s, {model.decode_graphs.capture_bytes / 2**20:.0f} MiB", file=sys.stderr)
    held, read = weight_bytes(model)
    print(f"weights held {held / 1e9:.2f} GB, read per decode step {read / 1e9:.2f} GB; KV pool "
          f"{model.max_total_token_num} tokens ({model.max_total_token_num * kv_bytes_per_token(model) / 1e9:.2f} GB)",
          file=sys.stderr)
    warm_up_kernels(model, args.prompt_len, max(batch_sizes))
    reference = last_logits(model) if args.peer != "none" else None

    results: list[BatchResult] = []
    for batch in batch_sizes:
        for mode in modes:
            for draft in [0, *drafts]:
                print(f"batch {batch}, {mode}: prefill {batch} x {args.prompt_len}, then {args.warmup_steps} + "
                      f"{args.steps} {f'verify (1 + {draft})' if draft else 'decode'} steps", file=sys.stderr)
                results.append(run_batch(model, mode, batch, args.prompt_len, args.warmup_steps, args.steps, copy_bw,
                                         step_weight_bytes(model, read, batch), draft))
    model_type, kv_per_token = model.model_type, kv_bytes_per_token(model)
    quant = f", {model.quantization.description}" if model.quantization else ""
    if args.quantization in BENCH_QUANTIZERS:
        quant = f", {args.quantization} quantized at load (round-to-nearest)"
    if model.kv_cache_dtype_ is not None:
        quant += f", KV cache {model.kv_cache_description}"
    # HF's cache is in the model's dtype whatever ours is
    peer_kv_per_token = kv_per_token * dtype.itemsize // model.mem_manager.dtype.itemsize
    untouched = {b: read - step_weight_bytes(model, read, b) for b in batch_sizes}  # experts no token routes to
    if args.peer != "none":
        # Ours first, in case the peer does not finish (torch.compile of a large model at several
        # batch sizes takes minutes).
        print(results_table(results), file=sys.stderr, flush=True)
        # Ours is freed first: a model and its peer of Qwen3-30B-A3B's size do not both fit one H100.
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # the same weights: the same generator, seed and order as the model's
        peer = HFPeer(build_hf_model(cfg, device, dtype, peer_weights or random_hf_weights(cfg, device, dtype)),
                      args.peer)
        check_same_model(reference, peer.model, dtype, experts=any(untouched.values()))
        for batch in peer_batch_sizes(args.peer_batch_sizes, batch_sizes):
            print(f"batch {batch}, {peer.mode}", file=sys.stderr)
            try:
                prefill_s, step_ms = peer.run(batch, args.prompt_len, args.warmup_steps, args.steps)
            except Exception as e:  # e.g. torch.compile of a model it cannot capture: ours stay in the table
                print(f"the {peer.mode} peer failed at batch {batch}: {type(e).__name__}: {e}", file=sys.stderr)
                break
            results.append(summarize(peer.mode, batch, args.prompt_len, prefill_s, step_ms, args.warmup_steps,
                                     copy_bw, hf_weight_bytes(peer.model) - untouched[batch], peer_kv_per_token, device))
        results.sort(key=lambda r: r.batch)   # stable: each batch's rows ours first, then the peer's

    print(f"\n### Decode step, {shapes} shapes ({model_type}), {dtype_name(dtype)}{quant}, "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s\n")
    print(results_table(results))

    if args.json:
        write_json(args.json, {
            "benchmark": "offline",
            "environment": environment(device),
            "model_size": args.model_size,
            "config": cfg,
            "dtype": dtype_name(dtype),
            "prompt_len": args.prompt_len,
            "warmup_steps": args.warmup_steps,
            "steps": args.steps,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "weight_bytes_held": held,
            "weight_bytes_read_per_step": read,
            "kv_bytes_per_token": kv_per_token,
            "kv_cache_dtype": args.kv_cache_dtype,
            "verify_drafts": drafts,
            "results": [asdict(r) for r in results],
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention kernels: our paged Triton kernels against PyTorch's SDPA.

What is measured
  * Decode attention (``decode_attention_fwd``, flash decoding with split-K): one query token
    per request over ``ctx`` cached tokens, batch {1, 32, 128} x ctx {512, 4096}, plus
    batch 8 x ctx 32768 (few requests, long contexts: the case split-K is for).
  * Context attention (``context_attention_fwd``, prefill): batch {1, 8} x {512, 2048} new
    tokens, causal, nothing cached; plus one request with 1024 cached + 128 new tokens (chunked
    prefill / prefix-cache hit: the new queries attend to the cache and causally to each other).
  * Verify attention (``verify_attention_fwd``, split-K over a few new tokens a request: a
    speculative verify step): batch {1, 8} x 1 + {4, 8} new tokens over 1024 cached ones,
    beside the context kernel on the same problem (what verify steps ran before) and the floor
    of reading the K/V once.

Shapes are Llama-3-8B attention: 32 query heads, 8 KV heads, head dim 128, bf16 by default.
Our kernels read K/V from a token-level pool ``[slots, Hkv, D]`` through the ``req_to_token``
table, and every request's tokens are scattered over a random permutation of the pool, as in a
long-running server. SDPA (``F.scaled_dot_product_attention`` with ``enable_gqa``) gets the
same K/V gathered into contiguous dense ``[B, H, L, D]`` tensors; the gather is not timed. That
layout is a favour to SDPA: it cannot serve a paged cache at all, and contiguous rows are the
best case for its loads. On CUDA, SDPA is pinned in turn to each fused backend that accepts the
problem (flash, cuDNN, memory-efficient) and the fastest is reported, named in the table.

Before timing, each shape is checked once: the max abs difference between our output and the
first SDPA backend's is printed (flagged with ``!`` and a non-zero exit status when above 2% of
max|SDPA output| for 16-bit dtypes, 0.01% for fp32).

Times are medians of CUDA-event timings of single calls, each call preceded by an L2 flush
(as ``triton.testing.do_bench``), so they are GPU time with cold caches, without Python launch
overhead. For decode, the floor is the time to read every K and V element once at the measured
device-to-device copy bandwidth: ``B * ctx * Hkv * D * 2 (K and V) * bytes_per_element / copy
bandwidth``; "GB/s" is those bytes over our measured time and "floor/ours" the share of the
copy bandwidth that is (100% = at the floor). For prefill, TFLOP/s counts the useful causal
FLOPs only: ``4 * Hq * D * sum over queries of the keys each attends to``. "SDPA/ours" above 1
means our kernel is faster.

Run (GPU):   python benchmarks/kernels.py --json benchmarks/results/kernels.json
Smoke (CPU): python benchmarks/kernels.py --device cpu --quick
On CPU the kernels' torch twins run (``LLMSERVE_KERNEL_BACKEND=torch`` unless set otherwise),
on tiny shapes: that checks the script, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from common import (
    add_device_arguments,
    cuda_time_ms,
    dtype_name,
    environment,
    markdown_table,
    measure_copy_bandwidth,
    remove_script_dir_from_sys_path,
    resolve_dtype,
    write_json,
)

remove_script_dir_from_sys_path()

from llmserve.kernels import (  # noqa: E402
    context_attention_fwd, decode_attention_fwd, set_backend, use_triton, verify_attention_fwd,
)
from llmserve.kernels.backend import ENV_VAR as KERNEL_BACKEND_ENV_VAR  # noqa: E402


@dataclass(frozen=True)
class Heads:
    q: int = 32
    kv: int = 8
    dim: int = 128


LLAMA3_8B = Heads()

DECODE_CASES: list[tuple[int, int]] = [(b, n) for b in (1, 32, 128) for n in (512, 4096)] + [(8, 32768)]
CONTEXT_CASES: list[tuple[int, int, int]] = [(b, n, 0) for b in (1, 8) for n in (512, 2048)] + [(1, 128, 1024)]
QUICK_DECODE_CASES: list[tuple[int, int]] = [(1, 64), (4, 256)]
QUICK_CONTEXT_CASES: list[tuple[int, int, int]] = [(2, 64, 0), (1, 32, 64)]
VERIFY_CASES: list[tuple[int, int, int]] = [(b, 1 + k, 1024) for b in (1, 8) for k in (4, 8)]
QUICK_VERIFY_CASES: list[tuple[int, int, int]] = [(1, 5, 64)]


@dataclass
class Comparison:
    """Our kernel against SDPA on one problem."""

    ours_ms: float
    sdpa_ms: float                        # the fastest SDPA backend's
    sdpa_backend: str
    sdpa_ms_by_backend: dict[str, float]
    max_abs_err: float                    # ours vs the first SDPA backend's output
    err_ok: bool


@dataclass
class DecodeResult:
    batch: int
    context: int
    kv_bytes: int                         # K and V bytes the kernel must read
    floor_ms: float                       # kv_bytes at the copy bandwidth
    cmp: Comparison


@dataclass
class ContextResult:
    batch: int
    new_tokens: int
    cached_tokens: int
    flops: int                            # useful causal FLOPs
    cmp: Comparison


# -- problem set-up ----------------------------------------------------------------------------
def paged_kv(batch: int, kv_len: int, heads: Heads, dtype: torch.dtype, device: torch.device):
    """K/V pools of ``batch * kv_len`` slots and a ``req_to_token`` table mapping request i's
    positions to a random permutation of them. Returns (k_cache, v_cache, req_to_token)."""
    slots = batch * kv_len
    k_cache = torch.randn(slots, heads.kv, heads.dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    req_to_token = torch.randperm(slots, device=device).to(torch.int32).view(batch, kv_len)
    return k_cache, v_cache, req_to_token


def dense_kv(cache: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
    """The pool gathered per request into the contiguous ``[B, Hkv, L, D]`` layout SDPA wants."""
    return cache[req_to_token.long()].transpose(1, 2).contiguous()


# Fused SDPA backends, tried in this order; the fastest that accepts a problem is reported.
SDPA_BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def sdpa_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """SDPA on dense ``[B, H, L, D]`` tensors, pinned to each fused backend that accepts the
    problem (CUDA), else as torch dispatches it (``auto``: CPU, or no fused backend took it).

    With more keys than queries, causal means aligned to the last key (``causal_lower_right``),
    as in our kernels.
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = causal_lower_right(q_len, kv_len) if causal and q_len != kv_len else None
    is_causal = causal and mask is None

    def plain() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)

    def pinned(backend: SDPBackend) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with sdpa_kernel(backend):
                return plain()
        return call

    calls: dict[str, Callable[[], torch.Tensor]] = {}
    if q.is_cuda:
        for name, backend in SDPA_BACKENDS.items():
            try:
                with warnings.catch_warnings():  # a refusing backend warns why, then raises
                    warnings.simplefilter("ignore")
                    pinned(backend)()
            except (RuntimeError, NotImplementedError):
                continue
            calls[name] = pinned(backend)
    return calls or {"auto": plain}


def error_ok(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """Max abs difference and whether it is within tolerance relative to max|ref|."""
    err = (ours.float() - ref.float()).abs().max().item()
    rel_tol = 1e-4 if ref.dtype == torch.float32 else 2e-2
    return err, err <= rel_tol * ref.float().abs().max().item()


# -- benchmarks ----------------------------------------------------------------------------
def compare(ours: Callable[[], torch.Tensor], sdpa: dict[str, Callable[[], torch.Tensor]],
            sdpa_to_ours: Callable[[torch.Tensor], torch.Tensor],
            warmup: int, iters: int, device: torch.device) -> Comparison:
    """Check our output against the first SDPA backend's (``sdpa_to_ours`` brings SDPA's output
    to our layout), then time ours and every SDPA backend that agrees with the first."""
    names = list(sdpa)
    ref = sdpa_to_ours(sdpa[names[0]]())
    err, ok = error_ok(ours(), ref)
    sdpa_ms: dict[str, float] = {}
    for name in names:
        if name != names[0] and not error_ok(sdpa_to_ours(sdpa[name]()), ref)[1]:
            print(f"  SDPA backend {name} disagrees with {names[0]}: left out", file=sys.stderr)
            continue
        sdpa_ms[name] = cuda_time_ms(sdpa[name], warmup, iters, device)
    best = min(sdpa_ms, key=sdpa_ms.__getitem__)
    return Comparison(
        ours_ms=cuda_time_ms(ours, warmup, iters, device), sdpa_ms=sdpa_ms[best], sdpa_backend=best,
        sdpa_ms_by_backend=sdpa_ms, max_abs_err=err, err_ok=ok,
    )


def bench_decode(batch: int, ctx: int, heads: Heads, dtype: torch.dtype, device: torch.device,
                 copy_bw: float, warmup: int, iters: int) -> DecodeResult:
    k_cache, v_cache, req_to_token = paged_kv(batch, ctx, heads, dtype, device)
    q = torch.randn(batch, heads.q, heads.dim, dtype=dtype, device=device)
    o = torch.empty_like(q)
    b_req_idx = torch.arange(batch, dtype=torch.int32, device=device)
    b_seq_len = torch.full((batch,), ctx, dtype=torch.int32, device=device)

    def ours() -> torch.Tensor:
        decode_attention_fwd(q, k_cache, v_cache, o, req_to_token, b_req_idx, b_seq_len, ctx)
        return o

    sdpa = sdpa_calls(q.unsqueeze(2), dense_kv(k_cache, req_to_token), dense_kv(v_cache, req_to_token), causal=False)
    kv_bytes = batch * ctx * heads.kv * heads.dim * 2 * dtype.itemsize
    return DecodeResult(
        batch=batch, context=ctx, kv_bytes=kv_bytes, floor_ms=kv_bytes / copy_bw * 1e3,
        cmp=compare(ours, sdpa, lambda out: out.squeeze(2), warmup, iters, device),
    )


def bench_context(batch: int, new: int, cached: int, heads: Heads, dtype: torch.dtype, device: torch.device,
                  warmup: int, iters: int, attention: Callable = context_attention_fwd) -> ContextResult:
    """``attention`` (context_attention_fwd, or verify_attention_fwd: the same operation) on
    ``batch`` requests of ``new`` tokens over ``cached`` ones."""
    # The new tokens' K/V are already in the pool when the kernel runs, as in the model.
    k_cache, v_cache, req_to_token = paged_kv(batch, cached + new, heads, dtype, device)
    q = torch.randn(batch * new, heads.q, heads.dim, dtype=dtype, device=device)
    o = torch.empty_like(q)
    b_req_idx = torch.arange(batch, dtype=torch.int32, device=device)
    b_q_start = torch.arange(0, batch * new, new, dtype=torch.int32, device=device)
    b_q_len = torch.full((batch,), new, dtype=torch.int32, device=device)
    b_cached_len = torch.full((batch,), cached, dtype=torch.int32, device=device)

    def ours() -> torch.Tensor:
        attention(q, k_cache, v_cache, o, req_to_token, b_req_idx, b_q_start, b_q_len, b_cached_len, new)
        return o

    def to_packed(out: torch.Tensor) -> torch.Tensor:  # [B, Hq, new, D] -> [B * new, Hq, D]
        return out.transpose(1, 2).reshape(batch * new, heads.q, heads.dim)

    q_dense = q.view(batch, new, heads.q, heads.dim).transpose(1, 2).contiguous()
    sdpa = sdpa_calls(q_dense, dense_kv(k_cache, req_to_token), dense_kv(v_cache, req_to_token), causal=True)
    keys_attended = batch * (new * cached + new * (new + 1) // 2)
    return ContextResult(
        batch=batch, new_tokens=new, cached_tokens=cached, flops=4 * heads.q * heads.dim * keys_attended,
        cmp=compare(ours, sdpa, to_packed, warmup, iters, device),
    )


# -- output ----------------------------------------------------------------------------------
def sdpa_cell(c: Comparison) -> str:
    return f"{c.sdpa_ms * 1e3:.1f} ({c.sdpa_backend})"


def err_cell(c: Comparison) -> str:
    return f"{c.max_abs_err:.1e}" + ("" if c.err_ok else " !")


def decode_table(results: list[DecodeResult], ours_name: str) -> str:
    headers = ["batch", "ctx", f"{ours_name} µs", "SDPA µs", "SDPA/ours", "K+V MB", "floor µs",
               f"{ours_name} GB/s", "floor/ours", "max err"]
    rows = [
        [r.batch, r.context, f"{r.cmp.ours_ms * 1e3:.1f}", sdpa_cell(r.cmp), f"{r.cmp.sdpa_ms / r.cmp.ours_ms:.2f}",
         f"{r.kv_bytes / 1e6:.1f}", f"{r.floor_ms * 1e3:.1f}", f"{r.kv_bytes / (r.cmp.ours_ms * 1e-3) / 1e9:.0f}",
         f"{r.floor_ms / r.cmp.ours_ms:.0%}", err_cell(r.cmp)]
        for r in results
    ]
    return markdown_table(headers, rows)


def context_table(results: list[ContextResult], ours_name: str) -> str:
    headers = ["batch", "new", "cached", f"{ours_name} µs", "SDPA µs", "SDPA/ours",
               f"{ours_name} TFLOP/s", "SDPA TFLOP/s", "max err"]
    rows = [
        [r.batch, r.new_tokens, r.cached_tokens, f"{r.cmp.ours_ms * 1e3:.1f}", sdpa_cell(r.cmp),
         f"{r.cmp.sdpa_ms / r.cmp.ours_ms:.2f}", f"{r.flops / (r.cmp.ours_ms * 1e-3) / 1e12:.1f}",
         f"{r.flops / (r.cmp.sdpa_ms * 1e-3) / 1e12:.1f}", err_cell(r.cmp)]
        for r in results
    ]
    return markdown_table(headers, rows)


def verify_table(pairs: list[tuple[ContextResult, ContextResult]], ours_name: str, copy_bw: float,
                 heads: Heads, itemsize: int) -> str:
    """(verify kernel, context kernel) on the same problems, against SDPA and the K/V floor."""
    headers = ["batch", "new", "cached", f"verify {ours_name} µs", f"context {ours_name} µs", "context/verify",
               "SDPA µs", "floor µs", "floor/verify", "max err"]
    rows = []
    for v, c in pairs:
        floor_ms = v.batch * (v.cached_tokens + v.new_tokens) * heads.kv * heads.dim * 2 * itemsize / copy_bw * 1e3
        rows.append([v.batch, v.new_tokens, v.cached_tokens, f"{v.cmp.ours_ms * 1e3:.1f}", f"{c.cmp.ours_ms * 1e3:.1f}",
                     f"{c.cmp.ours_ms / v.cmp.ours_ms:.2f}", sdpa_cell(v.cmp), f"{floor_ms * 1e3:.1f}",
                     f"{floor_ms / v.cmp.ours_ms:.0%}", err_cell(v.cmp)])
    return markdown_table(headers, rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two tiny shapes per kernel (CPU smoke test)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 100, quick: 3)")
    p.add_argument("--tables", default="decode,context,verify", help="which tables to run (comma-separated)")
    add_device_arguments(p)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu" and KERNEL_BACKEND_ENV_VAR not in os.environ:
        set_backend("torch")  # Triton's interpreter would take minutes on CPU
    torch.manual_seed(0)
    heads = LLAMA3_8B
    iters = args.iters or (3 if args.quick else 100)
    warmup = 1 if args.quick else 10
    ours_name = "triton" if use_triton(torch.empty(0, device=device)) else "torch"
    tables = set(args.tables.split(","))
    decode_cases = (QUICK_DECODE_CASES if args.quick else DECODE_CASES) if "decode" in tables else []
    context_cases = (QUICK_CONTEXT_CASES if args.quick else CONTEXT_CASES) if "context" in tables else []
    verify_cases = (QUICK_VERIFY_CASES if args.quick else VERIFY_CASES) if "verify" in tables else []

    copy_bw = measure_copy_bandwidth(device)
    print(f"device: {device} | dtype: {dtype_name(dtype)} | heads: Hq={heads.q} Hkv={heads.kv} "
          f"D={heads.dim} | our kernels: {ours_name} | copy bandwidth (read + write): {copy_bw / 1e9:.0f} GB/s",
          file=sys.stderr)

    decode: list[DecodeResult] = []
    for batch, ctx in decode_cases:
        print(f"decode  batch={batch} ctx={ctx}", file=sys.stderr)
        decode.append(bench_decode(batch, ctx, heads, dtype, device, copy_bw, warmup, iters))
    context: list[ContextResult] = []
    for batch, new, cached in context_cases:
        print(f"context batch={batch} new={new} cached={cached}", file=sys.stderr)
        context.append(bench_context(batch, new, cached, heads, dtype, device, warmup, iters))
    verify: list[tuple[ContextResult, ContextResult]] = []
    for batch, new, cached in verify_cases:
        print(f"verify  batch={batch} new={new} cached={cached}", file=sys.stderr)
        verify.append(tuple(bench_context(batch, new, cached, heads, dtype, device, warmup, iters, attention)
                            for attention in (verify_attention_fwd, context_attention_fwd)))

    if decode:
        print(f"\n### Decode attention (Hq={heads.q}, Hkv={heads.kv}, D={heads.dim}, {dtype_name(dtype)}, "
              f"copy bandwidth {copy_bw / 1e9:.0f} GB/s)\n")
        print(decode_table(decode, ours_name))
    if context:
        print("\n### Context attention (causal prefill)\n")
        print(context_table(context, ours_name))
    if verify:
        print("\n### Verify attention (a few new tokens a request over a cached context), beside the context kernel\n")
        print(verify_table(verify, ours_name, copy_bw, heads, dtype.itemsize))

    if args.json:
        write_json(args.json, {
            "benchmark": "kernels",
            "environment": environment(device),
            "dtype": dtype_name(dtype),
            "heads": asdict(heads),
            "kernel_backend": ours_name,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "decode": [asdict(r) for r in decode],
            "context": [asdict(r) for r in context],
            "verify": [{"verify": asdict(v), "context": asdict(c)} for v, c in verify],
        })

    failed = [r for r in [*decode, *context, *(r for pair in verify for r in pair)] if not r.cmp.err_ok]
    if failed:
        print(f"\n{len(failed)} shape(s) differ from SDPA beyond tolerance (marked !)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

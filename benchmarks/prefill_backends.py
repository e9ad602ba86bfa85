"""Prefill attention through the library kernels torch ships, against ours: could a fresh prompt's
attention be handed to cuDNN (issue 11's yardstick) instead of our Triton kernel?

For each batch of fresh prompts (nothing cached; Llama-3-8B heads: 32 query, 8 KV, head dim 128,
bf16) the script times, eagerly (a prefill step is not graphed), with CUDA events, best of 3 x 10
calls:
  * ours: `context_attention_fwd` reading K/V through a shuffled req->token table;
  * cuDNN varlen: `aten._cudnn_attention_forward` with cumulative lengths, on q/k/v as they come
    out of the fused qkv projection (what a server would call; it handles GQA and ragged batches);
  * flash varlen: `aten._flash_attention_forward` (FlashAttention-2) likewise;
  * cuDNN dense: SDPA pinned to cuDNN on padded [B, H, L, D] tensors (equal lengths only; the
    yardstick of benchmarks/kernels.py).
Each library call's first use at a shape is timed apart ("first"), since a server meets new
prompt lengths all the time. Max errors are against an fp32 reference per request.

    python benchmarks/prefill_backends.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels import context_attention_fwd  # noqa: E402

HQ, HKV, D = 32, 8, 128
BATCHES = [[512], [2048], [512] * 8, [2048] * 8, [100, 700, 1500, 37]]


def eager_us(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / 10)
    return best


def first_call_ms(fn) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out


def main() -> None:
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, bf16")
    rows = []
    for lens in BATCHES:
        T, L, scale = sum(lens), max(lens), D ** -0.5
        qkv = torch.randn(T, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16)
        q = qkv[:, :HQ * D].view(T, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.int32)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        want = torch.cat([F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None].float(), k[a:b].transpose(0, 1)[None].float(), v[a:b].transpose(0, 1)[None].float(),
            is_causal=True, enable_gqa=True)[0].transpose(0, 1) for a, b in bounds])

        slots = torch.randperm(T, device=dev)
        k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
        k_cache[slots], v_cache[slots] = k, v
        req_to_token = torch.zeros(len(lens), L, device=dev, dtype=torch.int32)
        for i, (a, b) in enumerate(bounds):
            req_to_token[i, :b - a] = slots[a:b].int()
        o = torch.empty_like(q)
        n = len(lens)
        args = (q, k_cache, v_cache, o, req_to_token, torch.arange(n, device=dev, dtype=torch.int32), cu[:-1].clone(),
                torch.tensor(lens, device=dev, dtype=torch.int32), torch.zeros(n, device=dev, dtype=torch.int32), L)
        context_attention_fwd(*args)
        cells = [f"{eager_us(lambda: context_attention_fwd(*args)):.1f}", f"{(o.float() - want).abs().max().item():.1e}"]

        libs = {
            "cudnn": lambda: torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, L, L, False, 0.0, True, False, scale=scale)[0],
            "flash": lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False, scale=scale)[0],
        }
        for fn in libs.values():
            try:
                first, out = first_call_ms(fn)
                cells += [f"{first:.1f}", f"{eager_us(fn):.1f}", f"{(out.float() - want).abs().max().item():.1e}"]
            except RuntimeError as e:
                cells += ["fails", "-", str(e).splitlines()[0][:60]]
        dense = "-"
        if len(set(lens)) == 1:
            qd = q.view(n, L, HQ, D).transpose(1, 2)
            kd, vd = k.view(n, L, HKV, D).transpose(1, 2), v.view(n, L, HKV, D).transpose(1, 2)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                dense = f"{eager_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)):.1f}"
        label = f"{n} x {lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
        rows.append([label, *cells, dense])
    print(markdown_table(["prompts", "ours µs", "err", "cuDNN varlen first ms", "then µs", "err",
                          "flash varlen first ms", "then µs", "err", "cuDNN dense µs"], rows))


if __name__ == "__main__":
    main()

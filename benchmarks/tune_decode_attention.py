"""Sweep decode attention's split count on the GPU: each (batch, context) problem timed at every
count in SPLITS, next to the count `decode_num_splits` picks and to SDPA's fastest backend on
dense K/V. Its results set DECODE_TARGET_PROGRAMS in kernels/decode_attention.py.

    python benchmarks/tune_decode_attention.py

Times (ours and SDPA's alike) are of a CUDA graph replaying 20 calls on the same K/V, divided by
20: the server replays decode from graphs, and a small problem timed from Python would mostly
measure its launches. Small problems' K/V stay in L2 across the calls, so their times are the
kernels' latency rather than a bandwidth measurement (see kernels.py for that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import graph_us, markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels.decode_attention import decode_attention_fwd_triton, decode_num_splits  # noqa: E402

HQ, HKV, D = 32, 8, 128
SPLITS = (1, 2, 4, 8, 16, 32)
PROBLEMS = [(1, 512), (1, 4096), (4, 512), (8, 512), (16, 512), (32, 512), (32, 4096), (64, 512), (128, 512),
            (128, 4096), (256, 512), (8, 32768), (1, 32768)]


def main() -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for bs, ctx in PROBLEMS:
        slots = bs * ctx
        k = torch.randn(slots, HKV, D, dtype=dtype, device=dev)
        v = torch.randn_like(k)
        req_to_token = torch.randperm(slots, device=dev).to(torch.int32).view(bs, ctx)
        q = torch.randn(bs, HQ, D, dtype=dtype, device=dev)
        o = torch.empty_like(q)
        b_req_idx = torch.arange(bs, dtype=torch.int32, device=dev)
        b_seq_len = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
        k_dense = k[req_to_token.long()].transpose(1, 2).contiguous()
        v_dense = v[req_to_token.long()].transpose(1, 2).contiguous()

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q.unsqueeze(2), k_dense, v_dense, enable_gqa=True)

        want = sdpa().squeeze(2).float()
        times = {}
        for splits in SPLITS:
            def ours(splits: int = splits) -> None:
                decode_attention_fwd_triton(q, k, v, o, req_to_token, b_req_idx, b_seq_len, ctx, num_splits=splits)
            ours()
            err = (o.float() - want).abs().max().item()
            assert err < 2e-2, f"batch {bs} ctx {ctx} splits {splits}: max error {err}"
            times[splits] = graph_us(ours)
        best = min(times, key=times.__getitem__)
        picked = decode_num_splits(bs, HKV)
        rows.append([bs, ctx, f"{graph_us(sdpa):.1f}",
                     *[f"**{t:.1f}**" if s == picked else f"{t:.1f}" for s, t in times.items()], best, picked])
        print(f"batch {bs} ctx {ctx}: best {best} splits, picked {picked}", flush=True)
    print(markdown_table(["batch", "ctx", "SDPA µs", *[f"{s} split{'s' * (s > 1)} µs" for s in SPLITS], "best", "picked"], rows))


if __name__ == "__main__":
    main()

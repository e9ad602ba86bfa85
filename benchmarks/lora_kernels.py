"""The LoRA kernels of a decode step at several rows, per projection group, against the base
projection they ride on: where a LoRA step's extra time goes, and what other tiles would give.

What is measured
  Llama-3-8B's four projection groups (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672,
  down 14336 -> 4096), ``--layers`` copies of every weight (each call reads its own, as a step's
  32 layers do), a ``LoraPool`` of those layers with ``--adapters`` slots of random rank-``--rank``
  adapters, and a batch of
  ``--rows`` tokens spread evenly over the slots (token i on slot i mod S), the segments as
  ``lora_segments`` builds them; ``max_len`` = the rows, as a CUDA graph's bucket has it (tiles
  of a slot past its tokens exit at once). Each column is a CUDA graph of one call per layer,
  replayed (``common.replay_ms``), in microseconds a call:

  base      the base projection alone (``kernels.linear``: cuBLAS at these rows)
  shrink    ``lora_shrink_triton`` alone
  expand    ``lora_expand_triton`` alone (default tiles), on the shrink's s
  linear    ``LoraBatch.linear`` itself, on the route it takes (``route``: timed at the first call)
  extra     linear - base: what the adapters add to a layer's group
  wide      the wide route: one GEMM over the base weight widened by every slot's A, then the
            expand from its tail (the base weights are widened as a model's are, ``LoraPool.widen``)
  beside    the other route: the shrink on a side stream beside the base projection, joined, then
            the expand
  serial    the beside route without the side stream: shrink, base projection, expand in a row

``--sweep`` also times the expand at other tiles (``BLOCK_N`` x warps) and the shrink at other
warps, each alone.

    python benchmarks/lora_kernels.py [--rows 32] [--adapters 8] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
from types import SimpleNamespace

import torch

from common import capture_graph, environment, markdown_table, replay_ms, write_json
from offline import LLAMA3_8B_CONFIG  # also takes this folder off sys.path (see common.py)

from llmserve.common.basemodel.basemodel import hf_config_from_dict  # noqa: E402
from llmserve.kernels.lora import lora_expand_triton, lora_shrink_triton  # noqa: E402
from llmserve.kernels.quantized_linear import linear  # noqa: E402
from llmserve.lora.pool import WEIGHT_ATTRS, LoraBatch, LoraPool, lora_segments  # noqa: E402


def graph_call_us(calls: list, replays: int = 20) -> float:
    graph, _ = capture_graph(lambda: [c() for c in calls])
    return replay_ms(graph, replays) * 1e3 / len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32", help="comma-separated token counts (default: 32)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None, help="also write the tables here")
    args = ap.parse_args()
    dev, dtype, R, S = torch.device("cuda"), torch.bfloat16, args.rank, args.adapters
    torch.manual_seed(0)
    # The model's own pool, its first --layers layers: every slot holds a random rank-R adapter.
    pool = LoraPool(hf_config_from_dict(LLAMA3_8B_CONFIG), S, R, 0, 1, dtype, dev, layers=range(args.layers))
    for weights in pool.groups.values():
        for a in weights.a:
            a.normal_(0, 0.02)
        weights.b.normal_(0, 0.02)
    pool.rank.fill_(R)
    pool.scaling.fill_(2.0)
    L = range(args.layers)
    table, sweep = [], []
    for n in [int(r) for r in args.rows.split(",")]:
        seg, rows_l, _ = lora_segments([i % S for i in range(n)], [1] * n, S)
        batch = LoraBatch(pool, torch.tensor(seg, dtype=torch.int32, device=dev),
                          torch.tensor(rows_l, dtype=torch.int32, device=dev), n)
        lora = (pool.rank, batch.seg_start, batch.rows, n)

        def shrink(i, group, x, **kw):
            a, _, splits = pool.layers[i][group]
            return lora_shrink_triton(x, a, *lora, splits, R, **kw)

        def expand(i, group, y, shrunk, **kw):
            _, b, splits = pool.layers[i][group]
            lora_expand_triton(y, shrunk, b, pool.scaling, *lora[:3], splits, R, **kw)

        for group, (a0, b0, splits) in pool.layers[0].items():
            k, N = a0.shape[-1], b0.shape[1]
            # The layers' base weights, widened by the pool as a model's are (`LoraPool.widen`).
            layers = [SimpleNamespace(**dict.fromkeys(WEIGHT_ATTRS.values())) for _ in L]
            for w in layers:
                setattr(w, WEIGHT_ATTRS[group], torch.randn(N, k, device=dev, dtype=dtype) * 0.02)
            pool.widen(layers)
            W = [getattr(w, WEIGHT_ATTRS[group]) for w in layers]
            x = torch.randn(n, k, device=dev, dtype=dtype)
            y = torch.zeros(n, N, device=dev, dtype=dtype)
            shrunk = [shrink(i, group, x) for i in L]
            base = graph_call_us([lambda i=i: linear(x, W[i], None) for i in L])
            shrink_us = graph_call_us([lambda i=i: shrink(i, group, x) for i in L])
            expand_us = graph_call_us([lambda i=i: expand(i, group, y, shrunk[i]) for i in L])
            full = graph_call_us([lambda i=i: batch.linear(i, group, x, W[i]) for i in L])
            wide = graph_call_us([lambda i=i: batch._wide(i, group, x, W[i], None) for i in L])
            beside = graph_call_us([lambda i=i: batch._beside(i, group, x, W[i], None) for i in L])
            side, pool.side_stream = pool.side_stream, None
            serial = graph_call_us([lambda i=i: batch._beside(i, group, x, W[i], None) for i in L])
            pool.side_stream = side
            table.append({"rows": n, "group": group, "base us": round(base, 2), "shrink us": round(shrink_us, 2),
                          "expand us": round(expand_us, 2), "linear us": round(full, 2), "extra us": round(full - base, 2),
                          "route": batch.route(0, group, x, W[0]), "wide us": round(wide, 2),
                          "beside us": round(beside, 2), "serial us": round(serial, 2)})
            print(table[-1], flush=True)
            if args.sweep:
                for bn, w in itertools.product((128, 256, 512), (2, 4, 8)):
                    us = graph_call_us([lambda i=i: expand(i, group, y, shrunk[i], block_n=bn, num_warps=w) for i in L])
                    sweep.append({"rows": n, "group": group, "kernel": "expand", "BLOCK_N": bn, "warps": w, "us": round(us, 2)})
                for w in (2, 4, 8):
                    us = graph_call_us([lambda i=i: shrink(i, group, x, num_warps=w) for i in L])
                    sweep.append({"rows": n, "group": group, "kernel": "shrink", "BLOCK_N": "", "warps": w, "us": round(us, 2)})
            del W, shrunk, layers
            for i in L:
                pool.wide.pop((i, group))
    for rows_ in (table, sweep):
        if rows_:
            print(markdown_table(list(rows_[0]), [list(r.values()) for r in rows_]))
    if args.json:
        write_json(args.json, {"environment": environment(dev), "args": vars(args), "groups": table, "sweep": sweep})


if __name__ == "__main__":
    main()

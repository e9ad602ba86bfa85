"""The CPU quantized linear kernel (`kernels/quantized_linear.c`) at few rows: milliseconds of one
`quantized_linear_kernel(x, w)` call for M rows of x, on the embedded model's real weights (layer
0's four Q4_1 matrices and the Q8_0 lm_head), for the M a decode step (1..) and a prompt-lookup
verify step (1 + 1..10 drafts) bring.

Each time is the best of ``--repeats`` runs of ``--calls`` calls (the minimum: the machine may be
shared; each case's runs are spread over the whole run, so that a busy spell costs no case all
of them), per call. ``--against FILE`` also times another version of the C file (e.g. main's,
``git show main:kernels/quantized_linear.c > /tmp/old.c``) in the same process, the two
interleaved run by run so that both see the same load, and checks that the two give the same
bits. "layer" is the four matrices of one layer together.

    python benchmarks/quantized_linear_rows.py [--rows 1,2,3,4,5,6,8,11,12,16] [--against /tmp/old.c]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

from llmserve.kernels.quantized_linear import _CFLAGS, build_library, quantized_linear_kernel  # noqa: E402

LAYER = ("qkv_weight_", "o_weight_", "gate_up_weight_", "down_weight_")


def load_weights() -> dict:
    from llmserve.common.basemodel import ModelInitParams
    from llmserve.engine.config import resolve_model_path
    from llmserve.models.registry import get_model_class, peek_model_config

    path = resolve_model_path(None)
    params = ModelInitParams(model_path=path, device="cpu", dtype=None, max_total_token_num=4096, max_running_requests=4,
                             max_seq_len=2048)
    model = get_model_class(peek_model_config(path)["model_type"])(params)
    weights = {name.rstrip("_").removesuffix("_weight"): getattr(model.trans_layers_weight[0], name) for name in LAYER}
    weights["lm_head"] = model.pre_post_weight.lm_head_weight_
    return weights


def per_call_ms(lib, x: torch.Tensor, w, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        quantized_linear_kernel(x, w, lib)
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,5,6,8,11,12,16", help="comma-separated row counts M")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="default torch's (the cores)")
    p.add_argument("--against", default=None, help="another version of quantized_linear.c to time beside this one")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    libs = {"this": build_library(_CFLAGS)}
    if args.against:
        libs = {"against": build_library(_CFLAGS, args.against), **libs}
    weights = load_weights()
    cases = []
    for name, w in weights.items():
        for m in rows:
            x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
            outs = [quantized_linear_kernel(x, w, lib) for lib in libs.values()]   # warm-up
            assert all(torch.equal(o, outs[0]) for o in outs), f"{name} M={m}: the two versions differ"
            cases.append((name, w, m, x))
    best = {}           # (name, lib, M) -> ms
    for _ in range(args.repeats):   # the outer loop: each case's runs spread over the whole run
        for name, w, m, x in cases:
            for key, lib in libs.items():
                ms = per_call_ms(lib, x, w, args.calls)
                best[name, key, m] = min(best.get((name, key, m), float("inf")), ms)
    for key in libs:
        for m in rows:
            best["layer", key, m] = sum(best[n, key, m] for n in weights if n != "lm_head")
    names = [n for n in weights if n != "lm_head"] + ["layer", "lm_head"]
    shapes = {n: "x".join(map(str, w.shape)) + f" {w.qtype}" for n, w in weights.items()}
    print(f"ms a call, best of {args.repeats} x {args.calls} calls, {torch.get_num_threads()} threads")
    headers = ["M"] + [f"{n} {shapes.get(n, '')}".strip() for n in names]
    table = []
    for m in rows:
        if args.against:
            table.append([m] + [f"{best[n, 'against', m]:.3f} -> {best[n, 'this', m]:.3f}" for n in names])
        else:
            table.append([m] + [f"{best[n, 'this', m]:.3f}" for n in names])
    print(markdown_table(headers, table))


if __name__ == "__main__":
    main()

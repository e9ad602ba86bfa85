"""What programmatic dependent launch (PDL, `kernels/backend.py`'s `pdl`) saves: chains of our
decode kernels in CUDA graphs, captured once with ``LLMSERVE_PDL=0`` and once with PDL on, the
outputs checked bitwise equal, beside the floor of the bytes the chain must read.

  * ``norms``: 600 dependent `add_rmsnorm` launches on one row of 4096 (tiny kernels: the time is
    almost all the boundary between two kernels; its floor is ~0), after one copy.
  * ``layers``: the linear layers and norms of Llama-3-8B's 32 layers at one row, each kernel
    reading the one before's output: rmsnorm, qkv GEMV, o GEMV (over q's columns: no attention
    kernel), add_rmsnorm, gate_up GEMV with SiLU, down GEMV, add_rmsnorm: 194 launches with the
    first copy; floor = the weights' bytes over the measured copy bandwidth.

A whole step with and without: ``LLMSERVE_PDL=0 python benchmarks/offline.py ...`` against the
same command without the variable.

    python benchmarks/pdl.py [--layers 32] [--json benchmarks/results/pdl-GPU-COMMIT.json]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from common import (
    capture_graph, environment, markdown_table, measure_copy_bandwidth, remove_script_dir_from_sys_path, replay_ms,
    write_json,
)

remove_script_dir_from_sys_path()

from llmserve.kernels.add_rmsnorm import add_rmsnorm_forward  # noqa: E402
from llmserve.kernels.backend import PDL_ENV_VAR  # noqa: E402
from llmserve.kernels.gemv import gemv, gemv_act_and_mul  # noqa: E402
from llmserve.kernels.rmsnorm import rmsnorm_forward  # noqa: E402

HIDDEN, QKV, INTERMEDIATE = 4096, 6144, 14336
EPS = 1e-5


def norms_chain(device: torch.device) -> tuple[Callable[[], torch.Tensor], int]:
    h0 = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    h = h0.clone()
    w = torch.rand(HIDDEN, device=device, dtype=torch.bfloat16) + 0.5

    def run() -> torch.Tensor:
        h.copy_(h0)                       # each replay from the same residual row
        x = h0
        for _ in range(600):
            x = add_rmsnorm_forward(h, x, w, EPS)
        return x
    return run, 0


def layers_chain(device: torch.device, layers: int) -> tuple[Callable[[], torch.Tensor], int]:
    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    stack = [(weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN), weight(2 * INTERMEDIATE, HIDDEN),
              weight(HIDDEN, INTERMEDIATE)) for _ in range(layers)]
    norm = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
    h0 = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    h = h0.clone()

    def run() -> torch.Tensor:
        h.copy_(h0)
        x = rmsnorm_forward(h, norm, EPS)
        for qkv, o, gate_up, down in stack:
            q = gemv(x, qkv)[:, :HIDDEN]           # one row: a contiguous view
            x = add_rmsnorm_forward(h, gemv(q, o), norm, EPS)
            x = add_rmsnorm_forward(h, gemv(gemv_act_and_mul(x, gate_up, "silu"), down), norm, EPS)
        return x
    return run, sum(w.numel() * w.element_size() for layer in stack for w in layer)


def graph_ms(run: Callable[[], torch.Tensor], pdl: bool, replays: int = 20) -> tuple[float, torch.Tensor]:
    """Capture ``run`` with PDL on or off (the launches read the variable as they are captured),
    then the best of 5 means of ``replays`` replays, and the output of the last."""
    os.environ[PDL_ENV_VAR] = "1" if pdl else "0"
    graph, out = capture_graph(run)
    best = min(replay_ms(graph, replays) for _ in range(5))
    os.environ.pop(PDL_ENV_VAR)
    return best, out.clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device)
    rows, results, mismatches = [], [], 0
    for name, (run, nbytes) in {"norms": norms_chain(device), "layers": layers_chain(device, args.layers)}.items():
        off_ms, off_out = graph_ms(run, pdl=False)
        on_ms, on_out = graph_ms(run, pdl=True)
        equal = torch.equal(off_out, on_out)
        mismatches += not equal
        floor_ms = nbytes / bandwidth * 1e3
        launches = 601 if name == "norms" else 6 * args.layers + 2   # with the first copy
        rows.append([name, launches, f"{off_ms:.3f}", f"{on_ms:.3f}", f"{(off_ms - on_ms) / launches * 1e3:.2f}",
                     f"{floor_ms:.3f}", f"{on_ms / floor_ms:.3f}" if nbytes else "", "yes" if equal else "NO"])
        results.append(dict(chain=name, launches=launches, off_ms=off_ms, pdl_ms=on_ms, floor_ms=floor_ms,
                            equal=equal))
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, CUDA graphs")
    print(markdown_table(["chain", "launches", "PDL off ms", "PDL on ms", "saved us/launch", "floor ms",
                          "on/floor", "bitwise equal"], rows))
    if args.json:
        write_json(args.json, dict(environment=environment(device), copy_bandwidth=bandwidth, results=results))
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())

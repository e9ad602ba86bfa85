"""Shared helpers for the kernel tests (devices, dtypes, tolerances, a scattered paged KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from llmserve.kernels.backend import launcher

CUDA = torch.cuda.is_available()


@triton.jit
def _probe_kernel(X, Y, N, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, N, BLOCK):
        acc += tl.load(X + off + tl.arange(0, BLOCK))
    tl.store(Y, tl.sum(acc, 0))


# Whether `@triton.jit` made interpreted kernels here: TRITON_INTERPRET=1 was set before triton
# was imported (tests/conftest.py does so without CUDA). Otherwise CPU tensors cannot run them.
INTERPRETED = isinstance(_probe_kernel, InterpretedFunction)


def _cpu_triton_works() -> bool:
    """Whether Triton kernels can run on CPU tensors (the interpreter) in this process.

    Not unless the kernels are interpreted. It does with Triton 3.7.1 here; Triton 3.6's
    interpreter fails with numpy 2.5 (a loop with a runtime bound turns a 1-element array into
    an int), as on the GPU machines seen so far.
    """
    if not INTERPRETED:
        return False
    try:
        x, y = torch.ones(32), torch.zeros(1)
        launcher(_probe_kernel, x)[(1,)](x, y, 32, BLOCK=16)
        return y.item() == 32.0
    except Exception:
        return False


# Without CUDA the interpreter is the only way to test the kernels, so it must work (never skip);
# with CUDA, the CPU cases are skipped unless it is in use and works (TRITON_INTERPRET is not set
# there, so normally they are), and the cuda cases cover the kernels.
CPU_TRITON = not CUDA or _cpu_triton_works()
cpu_triton = pytest.mark.skipif(not CPU_TRITON, reason="Triton kernels are not interpreted here, or this Triton "
                                "cannot interpret them (see conftest and _cpu_triton_works)")


def _device_marks(dev: str) -> list:
    return [cpu_triton] if dev == "cpu" else []


DEVICES = [pytest.param(dev, marks=_device_marks(dev)) for dev in ["cpu"] + (["cuda"] if CUDA else [])]

# (device, dtype) pairs for Triton-vs-twin tests: the interpreter has no bf16, the GPU does.
DEVICE_DTYPES = [
    pytest.param(dev, dt, id=f"{dev}-{str(dt).removeprefix('torch.')}", marks=_device_marks(dev))
    for dev in ["cpu"] + (["cuda"] if CUDA else [])
    for dt in ([torch.float32, torch.float16] + ([torch.bfloat16] if dev == "cuda" else []))
]


def tol(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for outputs in `dtype` computed two different fp32 ways."""
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.float16: dict(atol=1e-2, rtol=1e-2),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]


def rng(seed: int) -> torch.Generator:
    """A seeded CPU generator: inputs are drawn on CPU so every device sees the same data."""
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    """Random normal data drawn on CPU, then moved."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T (+ bias) computed in float64, rounded once to x's dtype: what the linear kernels
    (gemv, skinny_gemm) are held to."""
    y = x.double() @ w.double().t()
    return (y if bias is None else y + bias.double()).to(x.dtype)


def cos_sin(g: torch.Generator, n: int, D: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style rotary cos/sin [n, D // 2] (fp32) at random (non-consecutive) positions."""
    pos = torch.randint(0, 4096, (n,), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)


@dataclass
class PagedKV:
    """A KV pool whose requests' tokens sit in randomly scattered slots."""

    k_cache: torch.Tensor  # [slots, Hkv, D]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [max_reqs, max_len] int32
    b_req_idx: torch.Tensor  # [bs] int32
    kv_lens: list[int]

    def dense(self, i: int, Hq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's K, V as dense fp64 [Hq, L, D] tensors, each kv head repeated for its group
        of query heads (the independent reference's view)."""
        slots = self.req_to_token[self.b_req_idx[i].item(), : self.kv_lens[i]].long()
        group = Hq // self.k_cache.shape[1]
        k, v = (c[slots].double().repeat_interleave(group, dim=1).transpose(0, 1) for c in (self.k_cache, self.v_cache))
        return k, v


def make_paged_kv(gen: torch.Generator, kv_lens: list[int], Hkv: int, D: int, dtype: torch.dtype,
                  device: str, max_len: int | None = None) -> PagedKV:
    """Scatter requests with kv_lens tokens over a pool of random slots (plus unused, random ones).

    Requests get non-consecutive rows of req_to_token; entries past each request's length hold
    random valid slots, so a kernel that reads past the length gets wrong but finite values.
    """
    bs = len(kv_lens)
    max_len = max_len or max(kv_lens) + 5
    slots = sum(kv_lens) + 23
    k_cache = randn(gen, slots, Hkv, D, dtype=dtype, device=device)
    v_cache = randn(gen, slots, Hkv, D, dtype=dtype, device=device)
    max_reqs = 2 * bs + 1
    req_to_token = torch.randint(0, slots, (max_reqs, max_len), generator=gen, dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen).to(torch.int32)
    rows = torch.randperm(max_reqs, generator=gen)[:bs].to(torch.int32)
    start = 0
    for row, n in zip(rows.tolist(), kv_lens):
        req_to_token[row, :n] = perm[start:start + n]
        start += n
    return PagedKV(k_cache, v_cache, req_to_token.to(device), rows.to(device), list(kv_lens))


def alibi_slopes(H: int, device: str) -> torch.Tensor:
    """BLOOM-style geometric slopes (exactness of the values does not matter, distinctness does)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32, device=device)


def i32(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def run_poisoned(fn, inputs: dict, **kw) -> torch.Tensor:
    """Call an attention kernel on a NaN-poisoned output, so rows or heads it never writes fail
    the comparison. Keys of ``inputs`` starting with ``_`` are test-side extras, not arguments."""
    args = {k: v for k, v in inputs.items() if not k.startswith("_")}
    o = torch.full_like(args["q"], float("nan"))
    fn(o=o, **args, **kw)
    return o


# -- a float8 KV cache (--kv-cache-dtype fp8) --------------------------------------------------------
KV_FP8 = torch.float8_e4m3fn
# Per-tensor scales of the tests' float8 caches: their randn values / scale reach about +-100 of
# e4m3's 448, and the scales are not powers of two, so a scale left out or misplaced shows.
FP8_SCALES = dict(k_scale=0.05, v_scale=0.03)


def with_fp8_cache(inputs: dict, k_scale: float, v_scale: float) -> tuple[dict, dict]:
    """(``inputs`` with their K and V pools stored in float8 as a ``--kv-cache-dtype fp8`` pool
    holds them (value / scale) and the scales as arguments, the same inputs with the float8
    values dequantized back to the pools' dtype): attention over the first must be attention over
    the second."""
    fp8, dequantized = dict(inputs, k_scale=k_scale, v_scale=v_scale), dict(inputs)
    for name, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        pool = inputs[name]
        fp8[name] = (pool.float() / scale).clamp(-448, 448).to(KV_FP8)
        dequantized[name] = (fp8[name].float() * scale).to(pool.dtype)
    return fp8, dequantized


# Compiles kernels for a Hopper GPU without one (Triton's own compiler and its ptxas), in a process
# of its own: here TRITON_INTERPRET makes every @triton.jit function an interpreted one.
_HOPPER_COMPILE = """
import inspect, json, os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, variants = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kernel = getattr(__import__(module, fromlist=[name]), name)
params = list(inspect.signature(kernel.fn).parameters)
for types, constexprs, num_warps in variants:
    signature = {p: types.get(p, "constexpr" if p in constexprs else "i32") for p in params}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], (types, constexprs)
"""


def compile_for_hopper(module: str, kernel: str, variants: list[tuple[dict[str, str], dict, int]]) -> None:
    """Compile ``module.kernel`` for sm_90 once per variant: (argument types by name, as Triton
    writes them, e.g. ``"*bf16"`` or ``"fp32"``, unnamed ones ``i32``; constexprs; num_warps).
    Fails with the compiler's message where one does not compile: a kernel the interpreter runs
    may still not compile (a GPU-only branch, a pass that rejects the IR)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE, module, kernel, json.dumps(variants)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

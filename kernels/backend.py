"""Kernel backend selection: Triton kernels or their plain-torch twins.

`LLMSERVE_KERNEL_BACKEND` (read at call time, or overridden by `set_backend`):
  auto   (default) Triton iff the tensor is on CUDA, the torch twin otherwise;
  triton           always Triton (on CPU this runs Triton's interpreter);
  torch            always the torch twin.

Whether Triton interprets a kernel is normally fixed when `@triton.jit` runs, from
`TRITON_INTERPRET` at import time. `launcher` makes the CPU path independent of that and of
import order: kernels launched on CPU tensors always run in Triton's interpreter.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "LLMSERVE_KERNEL_BACKEND"

_override: str | None = None


def set_backend(name: str | None) -> None:
    """Force a backend for this process (`None` goes back to the environment variable)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}, expected one of {BACKENDS}")
    global _override
    _override = name


def get_backend() -> str:
    """The backend in force: `set_backend`'s choice, else the environment variable, else auto."""
    name = _override if _override is not None else os.environ.get(ENV_VAR, "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r}, expected one of {BACKENDS}")
    return name


def use_triton(t: torch.Tensor) -> bool:
    """True if the op on tensor `t` should run the Triton kernel rather than the torch twin."""
    name = get_backend()
    if name == "auto":
        return t.is_cuda
    return name == "triton"


class _InterpretedKernel:
    """A kernel run by Triton's interpreter, launched as `kernel[grid](*args, **kwargs)`."""

    def __init__(self, fn: Any) -> None:
        self.kernel = InterpretedFunction(fn)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            with _interpretable_language():
                return self.kernel[grid](*args, **kwargs)

        return launch


_interpreted_kernels: dict[Any, _InterpretedKernel] = {}  # kernel's python function -> launcher
_interpreted_library: dict[Any, InterpretedFunction] = {}  # triton.language function -> interpreted copy
_language_lock = threading.RLock()
_MISSING = object()


@contextmanager
def _interpretable_language() -> Iterator[None]:
    """Make triton.language interpretable for one launch, and put it back afterwards.

    Triton makes its own library functions (tl.sum, tl.max, ...) interpretable only if
    TRITON_INTERPRET=1 was set before `import triton`, and anything (transformers, for one)
    may import triton first: so swap in interpreted copies. The interpreter also patches
    triton.language while it runs and leaves some of that behind after nested library calls,
    which would break kernels compiled later in the same process: so restore the attributes
    of the modules and classes it touches.
    """
    with _language_lock:
        modules = [tl, tl.core, tl.standard, tl.math]
        classes = [tl.core.tensor, tl.core.dtype]
        if hasattr(tl.core, "tensor_descriptor_base"):
            classes.append(tl.core.tensor_descriptor_base)
        saved = [(obj, dict(vars(obj))) for obj in modules + classes]
        try:
            for module in modules:
                for name, obj in list(vars(module).items()):
                    if isinstance(obj, JITFunction):
                        if obj.fn not in _interpreted_library:
                            _interpreted_library[obj.fn] = InterpretedFunction(obj.fn)
                        setattr(module, name, _interpreted_library[obj.fn])
            yield
        finally:
            for obj, before in saved:
                now = vars(obj)
                for name, value in before.items():
                    if now.get(name, _MISSING) is not value:
                        setattr(obj, name, value)
                # Names the interpreter added to modules are globals its rewritten functions
                # need next time; attributes it added to classes must go.
                if obj in classes:
                    for name in [n for n in now if n not in before]:
                        delattr(obj, name)


def launcher(kernel: Any, t: torch.Tensor) -> Any:
    """The form of a `@triton.jit` kernel to launch for tensors on `t`'s device.

    CUDA tensors get the kernel as Triton made it (compiled, unless TRITON_INTERPRET=1);
    CPU tensors always get Triton's interpreter, whatever TRITON_INTERPRET said at import.
    """
    if t.is_cuda:
        return kernel
    if kernel.fn not in _interpreted_kernels:
        _interpreted_kernels[kernel.fn] = _InterpretedKernel(kernel.fn)
    return _interpreted_kernels[kernel.fn]


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (block sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands upcast from `dtype`.

    fp16/bf16 values are exact in tf32, so tensor cores lose nothing; real fp32 data
    needs full IEEE products to stay within fp32 tolerances.
    """
    return "ieee" if dtype == torch.float32 else "tf32"

"""Linear layers on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), unpacked as they are read.

On a CPU a decode step is bound by reading the weights: a 135M-parameter model in float32 is
0.54 GB a step, and torch's GEMV reads it at about half the machine's bandwidth. Kept in their
GGUF blocks the same weights are 4-8x smaller, so `QuantizedWeight` holds them that way and
`quantized_linear` multiplies with them directly: a small C kernel (`quantized_linear.c`, built
with the system's C compiler on first use and cached; see `_library`) dequantizes a few rows at a
time into cache and runs float32 dot products. The values it multiplies by are bit for bit
gguf-py's dequantized weights (see the C file), so the model is the dequantized one; only the
order of the float32 additions differs from a BLAS.

The torch twin dequantizes the whole weight and calls `F.linear`. It runs where the kernel
cannot: no C compiler, `LLMSERVE_KERNEL_BACKEND=torch`, or activations other than float32.
`linear` and `embedding` take either a dense tensor or a `QuantizedWeight`, so layer code calls
them without knowing which it holds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .backend import get_backend
from .gemv import gemv, takes_gemv
from .skinny_gemm import skinny_gemm, takes_skinny_gemm

QTYPES = ("Q4_0", "Q4_1", "Q8_0")      # the C kernel's qtype numbers are their indices
BLOCK = 32                              # values per block (scale d, offset m) in all three


@dataclass(frozen=True)
class QuantizedWeight:
    """An ``[N, K]`` linear weight in GGUF blocks of 32 along K, in separate arrays:

    ``qs``: uint8 ``[N, K / 2]`` (Q4_0 / Q4_1: each block's 16 bytes as GGUF lays them out, byte j
    holding q[j] in its low nibble and q[j + 16] in its high one) or int8 ``[N, K]`` (Q8_0);
    ``d``: float32 ``[N, K / 32]`` block scales; ``m``: float32 ``[N, K / 32]`` block offsets (Q4_1
    only). Value = d * (q - 8) (Q4_0), d * q + m (Q4_1), d * q (Q8_0).
    """

    qtype: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"unsupported quantization {self.qtype!r}, expected one of {QTYPES}")
        if (self.m is not None) != (self.qtype == "Q4_1"):
            raise ValueError(f"{self.qtype} weights {'need' if self.qtype == 'Q4_1' else 'have no'} block offsets m")

    # -- shape and layout ---------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.d.shape[0], self.d.shape[1] * BLOCK))

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._arrays())

    def _arrays(self) -> list[torch.Tensor]:
        return [self.qs, self.d] + ([self.m] if self.m is not None else [])

    def _map(self, fn) -> QuantizedWeight:
        """The same rows/blocks selection applied to qs, d and m alike."""
        return QuantizedWeight(self.qtype, fn(self.qs), fn(self.d), None if self.m is None else fn(self.m))

    @classmethod
    def from_gguf(cls, qtype: str, blocks: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
        """From a GGUF tensor's raw bytes, ``[N, bytes of a row]`` uint8 as gguf-py reads them:
        per block an fp16 d, for Q4_1 an fp16 m, then the quants."""
        n, k = shape
        if qtype not in QTYPES or k % BLOCK:
            raise ValueError(f"cannot keep a {qtype} tensor of shape {shape} quantized")
        head = 4 if qtype == "Q4_1" else 2
        quant_bytes = BLOCK if qtype == "Q8_0" else BLOCK // 2
        b = np.ascontiguousarray(blocks).reshape(n, k // BLOCK, head + quant_bytes)
        d = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))
        m = None
        if qtype == "Q4_1":
            m = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
        q = np.ascontiguousarray(b[..., head:]).reshape(n, -1)
        qs = torch.from_numpy(q.view(np.int8) if qtype == "Q8_0" else q)
        return cls(qtype, qs, d, m)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) or columns (dim 1, whole blocks only) start..start+length, like
        `torch.Tensor.narrow` (tensor-parallel cuts)."""
        if dim == 0:
            return self._map(lambda t: t.narrow(0, start, length))
        if dim != 1 or start % BLOCK or length % BLOCK:
            raise ValueError(f"a {self.qtype} weight narrows along its columns by whole blocks of {BLOCK} only")
        per_block = self.qs.shape[1] // self.d.shape[1]     # quant bytes a block
        b0, nb = start // BLOCK, length // BLOCK
        qs = self.qs.narrow(1, b0 * per_block, nb * per_block)
        return QuantizedWeight(self.qtype, qs, self.d.narrow(1, b0, nb), None if self.m is None else self.m.narrow(1, b0, nb))

    def index_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows ``index`` (any shape of row ids; the result has ``index.numel()`` rows)."""
        flat = index.reshape(-1)
        return self._map(lambda t: t.index_select(0, flat))

    def pad_rows(self, rows: int) -> QuantizedWeight:
        """``rows`` more rows of zeros at the end (they dequantize to 0)."""
        return self._map(lambda t: torch.cat([t, t.new_zeros((rows, t.shape[1]))]))

    def contiguous(self) -> QuantizedWeight:
        return self._map(torch.Tensor.contiguous)

    @staticmethod
    def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of ``weights`` stacked (fusing q/k/v or gate/up into one matmul)."""
        if len({w.qtype for w in weights}) != 1:
            raise ValueError("only weights of one quantization type can be stacked")
        w0 = weights[0]
        m = None if w0.m is None else torch.cat([w.m for w in weights])
        return QuantizedWeight(w0.qtype, torch.cat([w.qs for w in weights]), torch.cat([w.d for w in weights]), m)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: bit for bit gguf-py's dequantized values (torch twin of the kernel's
        unpacking)."""
        n, k = self.shape
        d = self.d.unsqueeze(-1)
        if self.qtype == "Q8_0":
            return (self.qs.view(n, -1, BLOCK).float() * d).reshape(n, k)
        b = self.qs.view(n, -1, BLOCK // 2)
        q = torch.cat([b & 15, b >> 4], dim=-1).float()             # q[j] low nibbles, q[j + 16] high
        w = (q - 8) * d if self.qtype == "Q4_0" else q * d + self.m.unsqueeze(-1)
        return w.reshape(n, k)


def stack_rows(weights: list) -> torch.Tensor | QuantizedWeight:
    """The rows of ``weights`` stacked (fusing q/k/v or gate/up into one matmul): torch.cat of dense
    weights, the class's own ``cat`` for quantized ones of one format (GGUF blocks of one type, or
    one `llmserve.quantization` weight class); a mix is dequantized first."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)
    kinds = {(type(w), getattr(w, "qtype", None)) for w in weights}
    if len(kinds) == 1:
        return type(weights[0]).cat(weights)
    dtypes = [w.dtype for w in weights if isinstance(w, torch.Tensor)]
    dtype = dtypes[0] if dtypes else torch.float32
    return torch.cat([w if isinstance(w, torch.Tensor) else w.dequantize().to(dtype) for w in weights])


# -- the kernel ------------------------------------------------------------------------------
_SOURCE = Path(__file__).with_name("quantized_linear.c")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lib_lock = threading.Lock()       # one build per process, whichever thread asks first
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None


def _build_dir() -> Path:
    from llmserve.common.cache import cache_root

    return Path(cache_root()) / "cpu-kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library() -> ctypes.CDLL | None:
    """The built kernel, or None when it cannot be built here (`kernel_unavailable_reason` says
    why). Built once per source, compiler and CPU into the cache folder (it is compiled for this
    machine's CPU: -march=native), under a name that changes with any of them."""
    global _lib, _lib_error
    if _lib is not None:           # the hot path: every linear layer of every step asks
        return _lib
    with _lib_lock:
        if _lib is not None or _lib_error is not None:
            return _lib
        try:
            _lib = build_library(_CFLAGS)
        except Exception as e:   # no compiler, a failed build, an unloadable file: fall back to the twin
            _lib_error = str(e)
        return _lib


def build_library(cflags: list[str], source: Path | None = None) -> ctypes.CDLL:
    """The kernel compiled with ``cflags``, from the cache folder if built there before.
    ``source``: another version of the C file (benchmarks compare two), default this one's."""
    source = Path(source or _SOURCE)
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    cpu = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    flags = next((line for line in cpu.splitlines() if line.startswith(("flags", "Features"))), "")
    key = hashlib.sha256("\0".join([source.read_text(), cc, version, *cflags, flags]).encode()).hexdigest()[:16]
    target = _build_dir() / f"quantized_linear-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run([cc, *cflags, "-o", str(out), str(source)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {source.name} failed: {proc.stderr.strip()[-500:]}")
            os.replace(out, target)   # atomic: a process loading it never sees half a file
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.quantized_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.quantized_linear.restype = ctypes.c_int
    return lib


def kernel_available() -> bool:
    """Whether the C kernel runs here (it is built on the first call)."""
    return _library() is not None


def kernel_unavailable_reason() -> str | None:
    _library()
    return _lib_error


def _qargs(w: QuantizedWeight) -> tuple:
    if not (w.qs.is_contiguous() and w.d.is_contiguous() and (w.m is None or w.m.is_contiguous())):
        raise ValueError("a QuantizedWeight's arrays must be contiguous (call .contiguous() at load)")
    return QTYPES.index(w.qtype), w.qs.data_ptr(), w.d.data_ptr(), 0 if w.m is None else w.m.data_ptr()


def quantized_linear_kernel(x: torch.Tensor, w: QuantizedWeight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ w.T`` by the C kernel (``lib``: a build of it, default this machine's): x float32
    on the CPU, ``[..., K]``."""
    lib = lib or _library()
    assert lib is not None, "the C kernel is not available here (see kernel_unavailable_reason)"
    n, k = w.shape
    x2 = x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    threads = torch.get_num_threads()
    qtype, qs, d, m = _qargs(w)
    y = torch.empty((rows, n), dtype=torch.float32)
    if rows and lib.quantized_linear(qtype, x2.data_ptr(), rows, k, qs, d, m, n, y.data_ptr(), threads):
        raise MemoryError("quantized_linear: no memory for its row buffers")
    return y.view(*x.shape[:-1], n)


def quantized_linear_torch(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Torch twin: dequantize all of w, then F.linear."""
    return F.linear(x, w.dequantize().to(device=x.device, dtype=x.dtype))


def quantized_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    if (get_backend() != "torch" and x.device.type == "cpu" and x.dtype == torch.float32
            and w.device.type == "cpu" and kernel_available()):
        return quantized_linear_kernel(x, w)
    return quantized_linear_torch(x, w)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a dense or a quantized weight. On a GPU, half-precision decode steps of up to
    64 rows go to our kernels (`gemv` for one row, `skinny_gemm` for more) where they read the
    weights faster than cuBLAS does (benchmarks/decode_linear.py; skinny_gemm's is timed against
    cuBLAS on the card, once a shape). A GGUF `QuantizedWeight`
    runs the CPU block kernel; any other quantized weight (`llmserve.quantization.weights`) its
    own ``apply``."""
    if isinstance(weight, torch.Tensor):
        if takes_gemv(x, weight):
            return gemv(x, weight, bias)
        if takes_skinny_gemm(x, weight):
            return skinny_gemm(x, weight, bias)
        return F.linear(x, weight, bias)
    y = quantized_linear(x, weight) if isinstance(weight, QuantizedWeight) else weight.apply(x)
    return y if bias is None else y + bias


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """``F.embedding`` for a dense or a quantized table (whose looked-up rows are dequantized)."""
    if isinstance(weight, torch.Tensor):
        return F.embedding(ids, weight)
    return weight.index_rows(ids).dequantize().view(*ids.shape, weight.shape[1])

"""Kernel tests: Triton kernels against their torch twins, twins against independent references.

Without a GPU the Triton kernels run in Triton's interpreter. TRITON_INTERPRET is set here
before anything in this folder imports triton; the kernels do not depend on it, though:
`llmserve.kernels.backend.launcher` always interprets a kernel launched on CPU tensors and
compiles one launched on CUDA tensors, whatever the variable said at import time (other test
folders may import triton first).
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests import their shared helpers (kernel_test_utils) from this folder under any
# --import-mode; this folder must not become a package (it would shadow PyPI's `kernels`).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

"""Kernel tests: Triton kernels against their torch twins, twins against independent references.

Without a GPU the Triton kernels run in Triton's interpreter: the root tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton (Triton picks the interpreter at import time).
With a GPU it does not, so kernels compile and the CPU Triton-vs-twin cases are skipped.
"""

import os
import sys

# The tests import their shared helpers (kernel_test_utils) from this folder under any
# --import-mode; this folder must not become a package (it would shadow PyPI's `kernels`).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

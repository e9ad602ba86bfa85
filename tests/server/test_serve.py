"""The HTTP process's module: what importing it costs."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_server_imports_neither_torch_nor_triton():
    """The HTTP process starts the engine core right after its imports, so every second they
    take delays the workers. torch, Triton and the kernels (2.5 s on a 2-core CPU) belong to the
    worker; the HTTP process meets torch only later, through transformers' tokenizer loading."""
    code = ("import sys, llmserve.server.serve; "
            "print(sorted(m for m in ('torch', 'triton', 'llmserve.kernels', 'llmserve.common.basemodel.basemodel') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

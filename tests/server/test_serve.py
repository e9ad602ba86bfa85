"""The HTTP process's module: what importing it costs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_importing_the_server_imports_neither_torch_nor_triton():
    """The HTTP process starts the engine core right after its imports, so every second they
    take delays the workers. torch, Triton and the kernels (2.5 s on a 2-core CPU) belong to the
    worker."""
    code = ("import sys, llmserve.server.serve; "
            "print(sorted(m for m in ('torch', 'triton', 'llmserve.kernels', 'llmserve.common.basemodel.basemodel') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"



def test_the_http_process_serves_a_gguf_model_on_cpu_without_torch(default_model_path, tmp_path):
    """What the HTTP process does before serving (load the tokenizer, inspect the model) leaves
    torch unimported on a CPU machine once the GGUF vocabulary is converted (the first run
    converts it through AutoTokenizer, which imports torch, and caches it): torch is 200 MB
    resident, a fifth of what serving the embedded model took."""
    code = (
        "import sys\n"
        "import llmserve.server.serve, llmserve.server.api.app\n"
        "from llmserve.engine.engine import EngineConfig, inspect_model\n"
        "from llmserve.tokenizer import load_tokenizer\n"
        f"spec = inspect_model(EngineConfig(model={default_model_path!r}), load_tokenizer({default_model_path!r}))\n"
        "print(spec.device, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "LLMSERVE_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
            for _ in range(2)]
    if runs[0].split()[0] != "cpu":
        pytest.skip("a GPU machine: the HTTP process asks torch which GPUs there are")
    assert runs[0].split() == ["cpu", "True"]       # converting the vocabulary
    assert runs[1].split() == ["cpu", "False"]      # from the cache

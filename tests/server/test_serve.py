"""The HTTP process's module: what importing it costs, and the socket it holds while loading."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from llmserve.common.basemodel.layer_weights.gguf_load_utils import _cached_tokenizer_dir, _save_to_cache


def _imported(modules: str, candidates: tuple[str, ...]) -> list[str]:
    """Which of ``candidates`` a fresh interpreter has in ``sys.modules`` after ``import modules``."""
    code = f"import json, sys, {modules}; print(json.dumps(sorted(m for m in {candidates!r} if m in sys.modules)))"
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_importing_the_server_imports_neither_torch_nor_triton():
    """The HTTP process starts the engine core right after its imports, so every second they
    take delays the workers. torch, Triton and the kernels (2.5 s on a 2-core CPU) belong to the
    worker."""
    assert _imported("llmserve.server.serve",
                     ("torch", "triton", "llmserve.kernels", "llmserve.common.basemodel.basemodel")) == []


def test_the_http_process_imports_no_engine_implementation():
    """The HTTP process speaks the wire protocol (engine/messages.py, engine/config.py, ipc.py)
    and nothing behind it: the scheduler and the rpyc worker client are the core's."""
    assert _imported("llmserve.cli, llmserve.server.serve, llmserve.server.api.app",
                     ("llmserve.engine.scheduler", "llmserve.engine.worker_client", "llmserve.engine.engine", "rpyc")) == []


def _http_process_start(model: str) -> list[str]:
    """What the HTTP process does before serving (load the tokenizer, inspect the model), in a fresh
    interpreter on CPU: [device, whether torch got imported]."""
    code = (
        "import sys\n"
        "import llmserve.server.serve, llmserve.server.api.app\n"
        "from llmserve.engine.config import EngineConfig, inspect_model\n"
        "from llmserve.tokenizer import load_tokenizer\n"
        f"spec = inspect_model(EngineConfig(model={model!r}), load_tokenizer({model!r}))\n"
        "print(spec.device, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    if out.split()[0] != "cpu":
        pytest.skip("a GPU machine: the HTTP process asks torch which GPUs there are")
    return out.split()


def test_the_http_process_serves_a_gguf_model_on_cpu_without_torch(default_model_path, smollm2_tokenizer, tmp_path,
                                                                   monkeypatch):
    """The HTTP process leaves torch unimported on a CPU machine once the GGUF vocabulary is
    converted and cached (converting goes through AutoTokenizer, which imports torch): torch is
    200 MB resident, a fifth of what serving the embedded model took. The cache entry is the
    session's converted tokenizer, written where a conversion would write it (converting again
    would cost 15 CPU-s)."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    _save_to_cache(smollm2_tokenizer, _cached_tokenizer_dir(default_model_path))
    assert _http_process_start(default_model_path) == ["cpu", "False"]      # the cache: $LLMSERVE_CACHE_DIR


def test_the_http_process_serves_an_hf_model_on_cpu_without_torch(tiny_llama_dir):
    """An HF directory's TokenizersBackend is loaded without AutoTokenizer, whose config classes
    import torch (5 CPU-s of every server's start-up)."""
    assert _http_process_start(tiny_llama_dir) == ["cpu", "False"]


def test_the_listening_port_is_held_from_before_the_model_loads():
    """The port is bound before the model loads and kept until uvicorn listens on it: checking it
    free and binding it later let a tp=2 server's own rendezvous (an ephemeral port) take it in CI."""
    from llmserve.server.serve import bind_listen_socket

    with bind_listen_socket("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with socket.socket() as other:
            with pytest.raises(OSError):     # as a port-0 bind elsewhere can no longer be handed it
                other.bind(("127.0.0.1", port))

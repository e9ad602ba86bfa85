"""The engine-core process's module set: token ids in, token ids out, nothing heavy."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_core_imports_neither_torch_nor_transformers():
    # What `python -m llmserve.engine.core_main` imports, and what its first message brings (a
    # StartEngine, unpickled); a fresh interpreter, since this one has both loaded already.
    code = """
import pickle, sys
import llmserve.engine.core_main, llmserve.engine.core
from llmserve.engine.engine import EngineConfig, ModelSpec
from llmserve.engine.messages import StartEngine
pickle.loads(pickle.dumps(StartEngine(EngineConfig()))), pickle.loads(pickle.dumps(ModelSpec("/m", "llama", "cpu", frozenset({2}))))
print(sorted({"torch", "transformers", "tokenizers"} & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

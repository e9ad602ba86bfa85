"""Servers shared by the end-to-end API tests: real ``llmserve serve`` processes, started once.

``tiny_server`` serves a 2-layer random Llama (SmolLM2's tokenizer and chat template) and is
fast; ``embedded_server`` serves the embedded SmolLM2-135M-Instruct, for answers that must make
sense. Tests that need other flags start their own ServerProcess.
"""

from __future__ import annotations

import pytest

from serving_utils import ServerProcess


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        yield server


@pytest.fixture(scope="session")
def embedded_server():
    with ServerProcess(None) as server:
        yield server

"""Servers shared by the end-to-end API tests: real ``llmserve serve`` processes, started once.

``tiny_server`` serves a 2-layer random Llama (SmolLM2's tokenizer and chat template) and is
fast; ``embedded_server`` serves the embedded SmolLM2-135M-Instruct, for answers that must make
sense; ``keyed_server`` is the tiny one behind ``--api-key`` and ``--payload-limit``, for the
key's tests (test_lifecycle) and the edge's (test_edge), which send no body near the limit but
the edge's own. Tests that need other flags start their own ServerProcess.
"""

from __future__ import annotations

import pytest

from serving_utils import API_KEY, PAYLOAD_LIMIT, ServerProcess


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny") as server:
        yield server


@pytest.fixture(scope="session")
def embedded_server():
    with ServerProcess(None) as server:
        yield server


@pytest.fixture(scope="session")
def keyed_server(tiny_llama_dir):
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--api-key", API_KEY,
                       "--payload-limit", str(PAYLOAD_LIMIT)) as server:
        yield server

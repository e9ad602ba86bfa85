"""Where llmserve keeps what it derives once and reuses across runs (converted GGUF tokenizers,
built CPU kernels)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$LLMSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmserve``, else ``~/.cache/llmserve``."""
    root = os.environ.get("LLMSERVE_CACHE_DIR")
    if root:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve")

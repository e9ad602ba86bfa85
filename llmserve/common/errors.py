"""Errors every process may raise or receive, in a module that imports nothing heavy (the
engine-core process imports neither torch nor transformers)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model path or file the user gave cannot be loaded; the message is one line saying why."""

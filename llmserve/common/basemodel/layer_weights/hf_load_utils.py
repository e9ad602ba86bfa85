"""Reading Hugging Face model directories: ``config.json`` and the weight files.

Weights are yielded one file at a time so that a large sharded checkpoint never has to sit in
host memory whole: a model's weight loader copies what it needs from each dict and drops it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from llmserve.common.errors import ModelLoadError

try:  # exported at the top level since safetensors 0.3; fall back to "any exception" before that
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # pragma: no cover - depends on the installed safetensors
    _SafetensorError = Exception  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import torch

__all__ = ["ModelLoadError", "load_hf_config", "iter_hf_weight_files", "list_hf_weight_files"]

SAFETENSORS_INDEX = "model.safetensors.index.json"


def _check_model_dir(model_dir: str) -> None:
    if not os.path.exists(model_dir):
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model path {model_dir} is not a directory")


def _read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``; ``ModelLoadError`` if unreadable, invalid or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {what} {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} {path} must hold a JSON object, found {type(data).__name__}")
    return data


def load_hf_config(model_dir: str) -> dict:
    """``config.json`` of ``model_dir`` as a dict.

    Raises ``ModelLoadError`` if the directory is missing or not a directory, or if config.json is
    missing or not a valid JSON object.
    """
    _check_model_dir(model_dir)
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"no config.json in {model_dir}")
    return _read_json(path, "config")


def _safetensors_files_from_index(model_dir: str, index_path: str) -> list[str]:
    """The shard files an index names, each checked to exist."""
    weight_map = _read_json(index_path, "weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"weight index {index_path} has no 'weight_map'")
    files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise ModelLoadError(f"weight index {index_path} names missing file(s): {', '.join(missing)}")
    return files


def _glob_files(model_dir: str, prefix: str, suffix: str) -> list[str]:
    return sorted(
        os.path.join(model_dir, name)
        for name in os.listdir(model_dir)
        if name.startswith(prefix) and name.endswith(suffix) and os.path.isfile(os.path.join(model_dir, name))
    )


def list_hf_weight_files(model_dir: str) -> list[str]:
    """The weight files of ``model_dir`` in load order (see :func:`iter_hf_weight_files`)."""
    _check_model_dir(model_dir)
    index_path = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        return _safetensors_files_from_index(model_dir, index_path)
    files = _glob_files(model_dir, "", ".safetensors")
    if not files:
        files = _glob_files(model_dir, "pytorch_model", ".bin")
    if not files:
        raise ModelLoadError(f"no weights found in {model_dir} (looked for *.safetensors, pytorch_model*.bin)")
    return files


def _load_weight_file(path: str) -> dict[str, torch.Tensor]:
    """All tensors of one weight file, on CPU; ``ModelLoadError`` naming the file if it is bad."""
    # torch here, not at the top: the HTTP process reads config.json through this module
    import torch
    from safetensors.torch import load_file as _load_safetensors

    if path.endswith(".safetensors"):
        try:
            return _load_safetensors(path, device="cpu")
        except _SafetensorError as e:
            raise ModelLoadError(f"weight file {path} is corrupt or truncated ({e})") from e
        except OSError as e:
            raise ModelLoadError(f"cannot read weight file {path}: {e}") from e
    try:
        # weights_only: a .bin is a pickle, and a pickle from the internet must not run code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise ModelLoadError(f"cannot read weight file {path}: {e}") from e
    except Exception as e:  # torch.load reports bad files through many exception types
        raise ModelLoadError(f"weight file {path} is corrupt or not a weights-only checkpoint ({e})") from e
    if not isinstance(state, dict):
        raise ModelLoadError(f"weight file {path} does not hold a state dict")
    return state


def iter_hf_weight_files(model_dir: str, progress: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """One ``{name: tensor}`` dict per weight file of ``model_dir`` (CPU tensors, file dtypes).

    Which files: the shards named by ``model.safetensors.index.json`` if it exists (all must
    exist), else every ``*.safetensors``, else every ``pytorch_model*.bin``. Problems with the
    directory or the file list raise ``ModelLoadError`` here, at call time; a corrupt file raises
    it when its turn comes. ``progress`` shows a progress bar over files on stderr, if stderr is a terminal.
    """
    files = list_hf_weight_files(model_dir)
    return _iter_files(files, progress)


def _iter_files(files: list[str], progress: bool) -> Iterator[dict[str, torch.Tensor]]:
    with tqdm(files, desc="Loading weights", unit="file", file=sys.stderr, leave=False, disable=None if progress else True) as bar:
        for path in bar:
            yield _load_weight_file(path)

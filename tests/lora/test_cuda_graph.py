"""LoRA inside decode and verify steps replayed from CUDA graphs (on the CPU: the same padded,
static-buffer step without capture) equals the plain forward, with the base model and two
adapters mixed in one batch and the batch size crossing buckets. The GPU suite
(LLMSERVE_TEST_DEVICE=cuda) runs it with real graphs."""

from __future__ import annotations

import pytest
import torch
from lora_utils import ALL_TARGETS, AdapterSpec, make_peft_adapter
from transformers import LlamaConfig

from llmserve.lora.adapter import read_adapter
from parity_utils import EXACT, TEST_DEVICE, BatchDriver, build_tiny_hf_model, load_ours, random_prompts, rel_err

ADAPTERS = {"x": AdapterSpec(r=8, targets=ALL_TARGETS, seed=1), "y": AdapterSpec(r=4, targets=("q_proj", "up_proj"), seed=2)}
SPECULATE = 3


@pytest.fixture(scope="module")
def eager_and_graphs(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-graphs")
    hf = build_tiny_hf_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                         max_position_embeddings=256), path)
    adapters = [make_peft_adapter(hf, path / name, spec) for name, spec in ADAPTERS.items()]
    kw = dict(max_running_requests=16, max_loras=2, max_lora_rank=8)
    models = [load_ours(path, **kw),
              load_ours(path, **kw, cuda_graph_max_bs=6, cuda_graph_capture=TEST_DEVICE == "cuda",
                        speculate=SPECULATE, speculate_max_batch=4)]
    for model in models:
        for slot, (name, adapter_dir) in enumerate(zip(ADAPTERS, adapters)):
            model.lora_pool.load(slot, read_adapter(name, adapter_dir, model.network_config_, 8))
    return models


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert rel_err(a.cpu(), b.cpu()) < (1e-5 if EXACT else 2e-2)


@pytest.mark.parametrize("slots", [[1], [-1, 0, 1], [0, 1, -1, 1, 0]])
def test_graphed_steps_equal_eager(eager_and_graphs, slots):
    eager, graphs = eager_and_graphs
    assert graphs.decode_graphs is not None and graphs.verify_graphs is not None
    prompts = random_prompts([4 + i for i in range(len(slots))], 512, seed=len(slots))
    drivers = [BatchDriver(m, lora_slots=slots) for m in (eager, graphs)]
    try:
        logits = [d.prefill(prompts) for d in drivers]
        for _ in range(3):           # decode steps: the graphs' path
            _close(logits[1], logits[0])
            tokens = logits[0].argmax(-1).tolist()
            logits = [d.decode(tokens) for d in drivers]
        _close(logits[1], logits[0])
        # A verify step: each request's token and a draft of SPECULATE tokens, all rows' logits.
        chunks = [[t] + p[:SPECULATE] for t, p in zip(logits[0].argmax(-1).tolist(), prompts)]
        _close(drivers[1].extend(chunks, return_all_logits=True), drivers[0].extend(chunks, return_all_logits=True))
    finally:
        for d in drivers:
            d.free()

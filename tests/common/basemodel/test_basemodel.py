"""TpPartBaseModel's own bookkeeping: the per-step infer state (the warm-up is tested with the models)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from parity_utils import build_tiny_hf_model, load_ours


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_hf_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=256), path)
    return load_ours(path, max_running_requests=16)


@pytest.mark.parametrize("bs", range(1, 10))
def test_the_per_request_columns_are_16_byte_aligned_at_every_batch_size(model, bs):
    # Triton keys a compiled kernel on each pointer's 16-byte alignment: columns whose alignment
    # followed the batch size recompiled the attention kernel inside served steps (1-2 s each).
    rows = list(range(bs))
    cached = [3 * i for i in range(bs)]
    q_len = [i % 3 + 1 for i in range(bs)]
    mem_index = torch.arange(sum(q_len))
    state = model._build_infer_state(rows, cached, q_len, mem_index, [False] * bs, is_decode=False)
    columns = {"b_req_idx": rows, "b_q_len": q_len, "b_cached_len": cached,
               "b_seq_len": [c + q for c, q in zip(cached, q_len)],
               "b_q_start": [sum(q_len[:i]) for i in range(bs)]}
    for name, expected in columns.items():
        column = getattr(state, name)
        assert column.tolist() == expected, name
        assert column.data_ptr() % 16 == 0, f"{name} at batch size {bs}"



@pytest.mark.parametrize("model_type, extra", [
    ("llama", {"tie_word_embeddings": True}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_held_weights_count_every_parameter_of_the_checkpoint(model_type, extra, tmp_path):
    """What /info reports (params, bytes): a mixture of experts' weights included (they live in the
    layer's ``moe_``, which the count once missed: Mixtral-8x7B read as 1.7B parameters), a tied
    lm_head once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **extra)
    config.save_pretrained(tmp_path)
    ours = load_ours(tmp_path, load_format="dummy")
    with torch.device("meta"):
        hf_params = AutoModelForCausalLM.from_config(config).num_parameters()
    assert sum(w.shape.numel() for w in ours.held_weights()) == hf_params

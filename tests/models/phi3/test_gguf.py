"""A Phi-3 GGUF file (llama.cpp's ``phi3`` architecture: fused ``attn_qkv`` and ``ffn_up`` (gate
then up), q and k not permuted) read into Phi3TpPartModel gives HF's logits and greedy tokens on the
same weights; a file with LongRoPE factor tensors is refused at load."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import Phi3Config

from gguf_utils import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, write_gguf
from parity_utils import assert_matches_hf_greedy, build_tiny_hf_model, random_prompts

from llmserve.common.basemodel import ModelInitParams
from llmserve.common.basemodel.layer_weights.hf_load_utils import ModelLoadError
from llmserve.models.registry import get_model_class, peek_model_config

FUSED = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """HF's tensors, the fused ones under llama.cpp's names (write_gguf names the rest)."""
    out = {}
    for name, value in hf.state_dict().items():
        stem, suffix = name.rsplit(".", 1)
        _, _, layer, rest = (stem.split(".", 3) + ["", "", "", ""])[:4]
        out[f"blk.{layer}.{FUSED[rest]}.{suffix}" if rest in FUSED else name] = value.numpy()
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    config = Phi3Config(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
                        pad_token_id=0, tie_word_embeddings=False)
    return build_tiny_hf_model(config, tmp_path_factory.mktemp("hf"))


def test_phi3_gguf_matches_hf(hf, tmp_path):
    path = tmp_path / "tiny-phi3.gguf"
    write_gguf(path, "phi3", gguf_tensors(hf))
    cfg = peek_model_config(str(path))
    assert cfg["model_type"] == "phi3"
    ours = get_model_class(cfg["model_type"])(ModelInitParams(model_path=str(path), max_total_token_num=256))
    assert type(ours).__name__ == "Phi3TpPartModel"
    assert_matches_hf_greedy(ours, hf, random_prompts([5, 9, 1], VOCAB), steps=8)


def test_a_longrope_gguf_is_refused(hf, tmp_path):
    path = tmp_path / "longrope-phi3.gguf"
    factors = np.ones(HIDDEN // HEADS // 2, dtype=np.float32)
    write_gguf(path, "phi3", gguf_tensors(hf), extra_kv=lambda w: [w.add_tensor(f"rope_factors_{kind}.weight", factors)
                                                                  for kind in ("long", "short")])
    with pytest.raises(ModelLoadError, match="LongRoPE"):
        peek_model_config(str(path))

"""load_tokenizer: an HF directory's tokenizer is AutoTokenizer's, loaded without its imports where
that is a plain TokenizersBackend."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from llmserve.tokenizer import BACKEND_KEPT_FOR, load_tokenizer

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnewlines", "<|im_start|>user\nhi<|im_end|>", "naïve café 日本語 🙂"]


def _model_dir(tmp_path, tokenizer, model_type: str, tokenizer_class: str = "TokenizersBackend") -> str:
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": tokenizer_class}))
    return str(tmp_path)


@pytest.mark.parametrize(("model_type", "tokenizer_class"),
                         [(t, "TokenizersBackend") for t in sorted(BACKEND_KEPT_FOR)]
                         + [("llama", "PreTrainedTokenizerFast")])
def test_the_tokenizer_is_auto_tokenizers_for_every_model_type_it_is_loaded_directly_for(
        tmp_path, smollm2_tokenizer, model_type, tokenizer_class):
    path = _model_dir(tmp_path, smollm2_tokenizer, model_type, tokenizer_class)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    assert [ours.encode(t) for t in TEXTS] == [auto.encode(t) for t in TEXTS]
    assert ours.decode(ours.encode(TEXTS[3])) == auto.decode(auto.encode(TEXTS[3]))
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                         auto.pad_token_id)
    assert ours.chat_template == auto.chat_template


def test_a_model_type_auto_tokenizer_gives_its_own_class_goes_through_it(tmp_path, smollm2_tokenizer):
    """qwen2 is left out of BACKEND_KEPT_FOR because AutoTokenizer swaps in Qwen2Tokenizer."""
    path = _model_dir(tmp_path, smollm2_tokenizer, "qwen2")
    assert "qwen2" not in BACKEND_KEPT_FOR
    assert type(load_tokenizer(path)) is type(AutoTokenizer.from_pretrained(path))
    assert type(load_tokenizer(path)).__name__ == "Qwen2Tokenizer"

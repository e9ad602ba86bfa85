"""The sampler's tests: their shared fixtures. Their shared helpers are in sampler_test_utils."""

from __future__ import annotations

import os
import sys

import pytest

# The tests import their shared helpers (sampler_test_utils) from this folder under any
# --import-mode, as tests/kernels does.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llmserve.worker.sampling.processors as processors_module  # noqa: E402
from sampler_test_utils import GRAMMAR_CHARS, GRAMMAR_EOS, VOCAB, reference_apply_penalty  # noqa: E402


@pytest.fixture
def reference_penalty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the sampler against the reference penalty, which also checks the inputs' layout."""
    monkeypatch.setattr(processors_module, "apply_penalty", reference_apply_penalty)


@pytest.fixture(scope="module")
def grammar_compiler():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from llmserve.grammar import GrammarCompiler

    vocab = {c: i for i, c in enumerate(GRAMMAR_CHARS)} | {"<eos>": GRAMMAR_EOS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    # The logits are wider than the tokenizer (a padded embedding): the extra ids are never allowed.
    return GrammarCompiler(tok.to_str, VOCAB, [GRAMMAR_EOS])

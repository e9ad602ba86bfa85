"""Incremental detokenization against full decoding, with SmolLM2's byte-level BPE tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from llmserve.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다",
    "Emoji: 🎉🚀👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "café naïve résumé Ærøskøbing Straße",
    "  leading spaces\n\n\ttabs\r\n  trailing   ",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment\n",
    "mixed: αβγ ∑∫ ℝ → ∞, Привет мир, مرحبا",
    "a",
    " ",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer


class SlowTokenizer:
    """Hides the Rust tokenizer, so IncrementalDetokenizer takes its Python fallback."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return self._tokenizer.decode(ids, **kwargs)


@pytest.fixture(params=["fast", "fallback"])
def wrap(request: pytest.FixtureRequest):
    """How to hand a tokenizer to IncrementalDetokenizer: as is, or hiding its Rust core."""
    return (lambda tok: tok) if request.param == "fast" else SlowTokenizer


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.step(token_id) for token_id in ids]


def check_stream(tokenizer: Any, detokenizer: IncrementalDetokenizer, ids: list[int]) -> None:
    """Every prefix of ``ids`` that decodes to complete characters has been emitted exactly
    by the time its last token is fed, and what is never emitted is an unfinished tail.

    (The tokenizer is lossy: some characters encode to bytes it has no tokens for, so the
    full decode itself may contain U+FFFD, possibly at the very end, where no further
    token will ever complete it.)
    """
    full_text = tokenizer.decode(ids, skip_special_tokens=True)
    emitted = ""
    for k, delta in enumerate(stream(detokenizer, ids), start=1):
        emitted += delta
        if REPLACEMENT_CHAR not in full_text:
            assert REPLACEMENT_CHAR not in delta
        prefix_text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if REPLACEMENT_CHAR not in prefix_text:
            assert emitted == prefix_text
    assert full_text.startswith(emitted)
    held_back = full_text[len(emitted) :]
    assert held_back == "" or REPLACEMENT_CHAR in held_back
    assert emitted + detokenizer.flush() == full_text    # the end of the output is never lost


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_full_decode(tokenizer, wrap, text: str):
    ids = tokenizer.encode(text)
    check_stream(tokenizer, IncrementalDetokenizer(wrap(tokenizer)), ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
@example(text="\ufffd")
@example(text="ok \ufffd")
def test_random_unicode(tokenizer, text: str):
    ids = tokenizer.encode(text)
    check_stream(tokenizer, IncrementalDetokenizer(tokenizer), ids)
    # the tokenizer can spell this text (special tokens are skipped in the stream, so here too:
    # Hypothesis tries string constants it finds in the source, "<|im_start|>" among them).
    # A literal U+FFFD cannot be told from an unfinished UTF-8 sequence in a stream, so it is
    # held back until the next token, or until the flush at the end (Hypothesis found "\ufffd").
    if tokenizer.decode(ids, skip_special_tokens=True) == text:
        detokenizer = IncrementalDetokenizer(tokenizer)
        assert "".join(stream(detokenizer, ids)) + detokenizer.flush() == text


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40))
def test_random_unicode_fallback(tokenizer, text: str):
    ids = tokenizer.encode(text)
    check_stream(tokenizer, IncrementalDetokenizer(SlowTokenizer(tokenizer)), ids)


# Ids below 300 are mostly single bytes, often not valid UTF-8 on their own: that is where
# a model sampling freely can produce text that never decodes cleanly.
token_ids = st.lists(st.one_of(st.integers(0, 299), st.integers(0, 49151)), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=token_ids)
def test_random_token_ids(tokenizer, ids: list[int]):
    check_stream(tokenizer, IncrementalDetokenizer(tokenizer), ids)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=token_ids)
def test_random_token_ids_fallback(tokenizer, ids: list[int]):
    check_stream(tokenizer, IncrementalDetokenizer(SlowTokenizer(tokenizer)), ids)


@pytest.mark.parametrize(
    ("prompt", "output"),
    [
        ("The capital of France is", " Paris. It is a big city."),
        ("Say hi:", " 👋 hi"),
        ("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "Hi there! 你好"),
        ("Résumé of", " café owners"),
        ("一二三", "四五六"),
        ("x", "  two spaces"),
    ],
)
def test_output_after_prompt(tokenizer, wrap, prompt: str, output: str):
    prompt_ids = tokenizer.encode(prompt)
    all_ids = tokenizer.encode(prompt + output)
    assert all_ids[: len(prompt_ids)] == prompt_ids, "pick texts that split at a token boundary"
    output_ids = all_ids[len(prompt_ids) :]

    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    expected = tokenizer.decode(all_ids, skip_special_tokens=True)[len(prompt_text) :]
    assert expected == output

    with_prompt = IncrementalDetokenizer(wrap(tokenizer), prompt_token_ids=prompt_ids)
    assert "".join(stream(with_prompt, output_ids)) == expected
    # Byte-level BPE needs no context: the output alone decodes to the same text.
    alone = IncrementalDetokenizer(wrap(tokenizer))
    assert "".join(stream(alone, output_ids)) == expected


def test_special_tokens(tokenizer, wrap):
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tokenizer.all_special_ids[0] in ids
    skipping = IncrementalDetokenizer(wrap(tokenizer))
    assert "".join(stream(skipping, ids)) == "assistant\nHi"
    keeping = IncrementalDetokenizer(wrap(tokenizer), skip_special_tokens=False)
    assert "".join(stream(keeping, ids)) == "<|im_start|>assistant\nHi<|im_end|>"


class HFLikeTokenizer:
    """A transformers-style decode() around a bare tokenizers.Tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("fast", [True, False])
def test_sentencepiece_style_leading_space_needs_the_prompt(fast: bool):
    # A Metaspace decoder strips the leading space of the first token it decodes, so the
    # first output token must be decoded after some prompt context.
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    assert sp.decode([0, 1, 2]) == "Hello world!"
    assert sp.decode([1, 2]) == "world!"

    tokenizer = sp if fast else HFLikeTokenizer(sp)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[0])
    assert stream(detokenizer, [1, 2]) == [" world", "!"]

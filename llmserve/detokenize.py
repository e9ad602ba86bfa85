"""Turning a stream of generated token ids into a stream of text, one token at a time.

Decoding the whole output again after every token costs O(n) per token, O(n^2) per
request. Instead we decode only a short window of recent tokens and emit what the newest
token added to it. Two details make this harder than slicing:

* A character may be split over several tokens (byte-level BPE spells many CJK characters
  and emoji as 2-4 byte tokens). Until its last byte arrives the window decodes to a
  trailing U+FFFD, and we emit nothing.
* An output may end in the middle of a character (a length limit cut it, or the model
  produced bytes that are not UTF-8). ``flush()`` at the end hands out that held-back tail
  as a full decode renders it (with U+FFFD), so the streamed text always adds up to the
  decoded output: nothing the model produced is dropped.
* Decoders are context dependent: SentencePiece-style decoders drop the leading space of
  the first token they are given. The window therefore always keeps at least one already
  emitted token in front of the new ones, and the output's first token is preceded by the
  tail of the prompt, so a leading space of the output is kept.

Fast (Rust) tokenizers do all of this in ``tokenizers.decoders.DecodeStream``; for any
other tokenizer we fall back to the same window technique written out in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"

# DecodeStream raises this when a longer window decodes to text that does not start with
# the shorter window's text (some tokenizers are not monotonic on invalid UTF-8).
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"

# Prompt tokens used as context for the first output token: at least this many...
_MIN_PROMPT_CONTEXT = 4
# ...and if those start in the middle of a character, up to this many.
_MAX_PROMPT_CONTEXT = 24


class _StepDecoder(Protocol):
    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Decodes one request's output tokens incrementally.

    ``step(token_id)`` returns the text that token adds: often one word piece, sometimes
    "" (the token is special and skipped, or ends in the middle of a character), sometimes
    several characters at once (the token completed a character begun earlier).

    Pass the request's ``prompt_token_ids`` so the first output token is decoded in
    context; its text is never part of the output.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        backend = _backend_tokenizer(tokenizer)
        decode: Callable[[list[int]], str]
        if backend is not None:
            decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
            self._decoder: _StepDecoder = _DecodeStreamDecoder(backend, skip_special_tokens)
        else:
            decode = partial(
                tokenizer.decode,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            self._decoder = _WindowDecoder(decode)
        for token_id in _prompt_context(prompt_token_ids, decode):
            self._decoder.step(token_id)  # prime the window; this text is the prompt's

    def step(self, token_id: int) -> str:
        return self._decoder.step(token_id)

    def flush(self) -> str:
        """The text of the tokens ``step`` has held back (an unfinished character at the end of
        the output), decoded as they are; "" if nothing is held back. Call once, at the end."""
        return self._decoder.flush()


def _backend_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The Rust ``tokenizers.Tokenizer`` behind a transformers fast tokenizer, if any."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _prompt_context(prompt_token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[int]:
    """The last few prompt tokens, starting at a character boundary where we can find one."""
    prompt = list(prompt_token_ids)
    if len(prompt) <= _MIN_PROMPT_CONTEXT:
        return prompt
    for length in range(_MIN_PROMPT_CONTEXT, min(len(prompt), _MAX_PROMPT_CONTEXT) + 1):
        suffix = prompt[-length:]
        if REPLACEMENT_CHAR not in decode(suffix):
            return suffix
    return prompt[-_MIN_PROMPT_CONTEXT:]


class _DecodeStreamDecoder:
    """Incremental decoding by the tokenizers library (fast tokenizers).

    DecodeStream keeps its held-back tokens to itself, so we keep our own copy of them for
    ``flush``: the tokens since the last one that produced text, and that one as context.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []   # the last token that produced text
        self._held_back: list[int] = []  # the tokens after it

    def step(self, token_id: int) -> str:
        text = self._step(token_id)
        if text:
            self._context, self._held_back = [token_id], []
        else:
            self._held_back.append(token_id)
        return text

    def flush(self) -> str:
        return _held_back_text(
            partial(self._tokenizer.decode, skip_special_tokens=self._skip_special_tokens),
            self._context, self._held_back,
        )

    def _step(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._tokenizer, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX_ERROR):
                raise
            # The window's state is broken; start a new one at this token. We lose at
            # most the context of the previous token (vLLM does the same).
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            text = self._stream.step(self._tokenizer, token_id)
        return text or ""


class _WindowDecoder:
    """The same technique for tokenizers without DecodeStream (TGI's and vLLM's fallback).

    ``ids[prefix_offset:read_offset]`` is the context that has already been emitted;
    ``ids[read_offset:]`` are tokens whose text has not been emitted yet.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        emitted_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(emitted_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(emitted_text) :]

    def flush(self) -> str:
        return _held_back_text(
            self._decode, self._ids[self._prefix_offset : self._read_offset], self._ids[self._read_offset :]
        )


def _held_back_text(decode: Callable[[list[int]], str], context: list[int], held_back: list[int]) -> str:
    """What ``held_back`` adds to the text of ``context``, invalid bytes rendered as U+FFFD."""
    if not held_back:
        return ""
    context_text = decode(context)
    text = decode(context + held_back)
    return text[len(context_text) :] if text.startswith(context_text) else decode(held_back)

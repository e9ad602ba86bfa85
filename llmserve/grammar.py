"""Constrained decoding through llguidance: a request's ``GuidedDecodingParams`` as a grammar,
checked at the edge, and matched token by token in the worker's sampler.

llguidance was chosen over xgrammar by measurement (benchmarks/grammar_libraries.py: a p99 schema
compile of 3 ms against 2.3 s, a p99 mask of 1.4 ms against 16 ms at a 128k vocabulary) and
because it imports no torch: the HTTP process compiles a request's grammar (without a tokenizer)
to refuse one the library cannot take, and stays torch-free. Its tokenizer is built from the
``tokenizers`` JSON every model we load has (a GGUF file's converted one included).

This module imports nothing heavy at import time; the worker's side (``GrammarCompiler``) needs
a tokenizer, which it loads on the first constrained request.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from threading import Lock
from typing import TYPE_CHECKING

from llmserve.sampling_params import GuidedDecodingParams, InvalidRequest

if TYPE_CHECKING:
    import llguidance

BACKEND = "llguidance"

# Compact JSON: no free whitespace between tokens. With flexible whitespace a model (a small or
# random one above all) can pad an object with newlines until it runs out of tokens; this is
# also what vLLM asks of its guidance backend when whitespace is disabled.
JSON_OPTIONS = {"whitespace_flexible": False}

# Distinct grammars kept compiled per process (a template matcher each, copied per request).
CACHE_SIZE = 256


def grammar_of(params: GuidedDecodingParams) -> str:
    """The llguidance grammar for ``params``; ``InvalidRequest`` if it cannot be written down
    (a schema that is not JSON, a GBNF grammar naming an undefined rule). That the grammar
    compiles is ``check_guided_decoding``'s to say."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    try:
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # Lark alternatives of the choices as JSON string literals (which Lark reads).
            return grammar_from("choice", json.dumps(list(params.choice)))
        # "grammar": Lark (llguidance's dialect) or llama.cpp's GBNF, which it converts.
        return grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise InvalidRequest("guided_decoding", f"`guided_decoding` {kind} is not valid: {_first_line(e)}") from e


@functools.lru_cache(maxsize=CACHE_SIZE)
def check_guided_decoding(params: GuidedDecodingParams) -> None:
    """``InvalidRequest`` naming the problem if llguidance cannot compile ``params``' grammar.

    Needs no tokenizer, hence no torch; a grammar checked once is not checked again (cached by
    the params, which are hashable). Raised errors are not cached, so a bad schema costs its
    compile every time it is sent."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar_of(params))
    if error:
        raise InvalidRequest("guided_decoding", f"`guided_decoding` {params.kind} cannot be compiled: {_first_line(error)}")


def _first_line(error: object) -> str:
    """llguidance's message on one line: without the lines that echo the source or point a caret
    into it (the grammar it shows is its own rewriting of the request's)."""
    lines = [line.strip() for line in str(error).strip().splitlines()
             if line.strip() and not re.fullmatch(r"\s*\^+\s*|\s*\d+ \|.*", line)]
    return " ".join(lines) if lines else type(error).__name__


class GrammarCompiler:
    """One process's compiled grammars over one vocabulary: ``matcher(params)`` gives a fresh
    matcher for a request, copied from a template compiled once per distinct params.

    ``tokenizer_json`` is called on first use (loading a tokenizer takes a second or more): the
    ``tokenizers`` JSON of the model's tokenizer. ``vocab_size`` is the width of the model's
    logits, which may exceed the tokenizer's (padded embeddings); the ids past it are never
    allowed. ``eos_token_ids`` are the ids that end a generation: the grammar allows them once
    its language is complete.
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: dict[GuidedDecodingParams, llguidance.LLMatcher] = {}
        # rpyc's ThreadedServer serves each connection on a thread of its own: the tokenizer (a second
        # or more to build) is built once however many threads first ask for it together.
        self._lock = Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                              eos_token=self._eos_token_ids or None)
            return self._tokenizer

    def matcher(self, params: GuidedDecodingParams) -> llguidance.LLMatcher:
        """A matcher at the start of ``params``' language; ``ValueError`` if it does not compile
        (admission has checked that it does, so that is a bug or a tokenizer-specific failure)."""
        from llguidance import LLMatcher

        template = self._templates.get(params)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar_of(params), log_level=0)
            if template.is_error():
                raise ValueError(f"guided_decoding {params.kind} cannot be compiled: {_first_line(template.get_error())}")
            if len(self._templates) >= CACHE_SIZE:
                self._templates.pop(next(iter(self._templates)))   # the oldest
            self._templates[params] = template
        return template.deep_copy()

    @property
    def mask_words(self) -> int:
        """32-bit words in one row of a token bitmask."""
        return (self.vocab_size + 31) // 32


def tokenizer_json(tokenizer) -> str:
    """The ``tokenizers`` JSON of a transformers fast tokenizer (what llguidance reads)."""
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()

"""Constrained decoding (llmserve/grammar.py): grammars checked at the edge, without torch. (The
sampler's side is in tests/worker/sampling/test_processors.py and test_verify.py, the APIs' and the
property test over generated schemas in tests/server/api/test_structured_output.py.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from llmserve.grammar import check_guided_decoding
from llmserve.sampling_params import GuidedDecodingParams, InvalidRequest

# -- the edge ------------------------------------------------------------------------------

@pytest.mark.parametrize("params, words", [
    (GuidedDecodingParams(json='{"type": "strin"}'), "strin"),
    (GuidedDecodingParams(json="{not json"), "json"),
    # no request field fetches a URL: a remote $ref is refused, not retrieved
    (GuidedDecodingParams(json='{"$ref": "https://example.com/schema.json"}'), "does not fetch"),
    (GuidedDecodingParams(regex="a(b"), "unclosed group"),
    (GuidedDecodingParams(grammar="start: undefined_rule"), "undefined_rule"),
    (GuidedDecodingParams(grammar="root ::= missing"), "missing"),
])
def test_grammars_the_library_cannot_compile_are_invalid_requests(params: GuidedDecodingParams, words: str):
    with pytest.raises(InvalidRequest, match=re.escape(words)) as e:
        check_guided_decoding(params)
    assert e.value.field == "guided_decoding"


def test_llama_cpp_gbnf_and_lark_grammars_compile():
    check_guided_decoding(GuidedDecodingParams(grammar='root ::= "a" | "b" digit\ndigit ::= [0-9]'))
    check_guided_decoding(GuidedDecodingParams(grammar='start: "a" | "b" /[0-9]/'))


def test_the_edge_check_imports_no_torch():
    # The HTTP process compiles a request's grammar to refuse a bad one; it must stay torch-free.
    code = ("import sys; from llmserve.server.api.guided import tgi_guided_decoding; "
            "tgi_guided_decoding({'type': 'json', 'value': {'type': 'object'}}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

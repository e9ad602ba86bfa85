"""SamplingParams validation of the newer knobs: typical_p, min_tokens, prompt_logprobs."""

from __future__ import annotations

import pytest

from llmserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"typical_p": 0.0}, "typical_p"),
        ({"typical_p": 1.01}, "typical_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_new_tokens": 16}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ],
)
def test_out_of_range_is_a_value_error(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_defaults_and_edges_are_accepted():
    p = SamplingParams()
    assert (p.typical_p, p.min_tokens, p.prompt_logprobs) == (1.0, 0, None)
    SamplingParams(typical_p=1e-3, min_tokens=16, max_new_tokens=16, prompt_logprobs=0)

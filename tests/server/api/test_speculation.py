"""``llmserve serve --speculate 10`` end to end: streamed TGI and OpenAI requests give the tokens
they give without drafts (the same server, with the request field ``speculate: false``), one event
or chunk per token, a stop string inside an accepted run cuts the stream there; /info and
/metrics report the speculation."""

from __future__ import annotations

import json

import httpx
import pytest

from llmserve.engine.config import SPECULATE_MAX_BATCH
from serving_utils import ServerProcess

# The embedded model copies a passage it is asked to repeat: its drafts are accepted.
PASSAGE = ("The engine owns one Request per client request. The scheduler moves it between the waiting queue "
           "and the running batch; after every forward pass the engine hands the sampled token to append_token, "
           "which records it and decides whether the request is done.")
PROMPT = f"<|im_start|>user\nRepeat the following text exactly.\n\n{PASSAGE}<|im_end|>\n<|im_start|>assistant\n"
MAX_NEW = 24


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(None, "--speculate", "10") as server:
        yield server


def tgi_stream(server: ServerProcess, **parameters) -> list[dict]:
    """The events of a streamed TGI request, parsed."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW, "details": True, **parameters}}
    with httpx.stream("POST", server.url + "/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


def test_tgi_stream_equals_plain_one_event_per_token(server):
    plain = tgi_stream(server, speculate=False)
    before = server.metrics()
    spec = tgi_stream(server)
    after = server.metrics()
    assert [e["token"]["id"] for e in spec] == [e["token"]["id"] for e in plain]
    assert spec[-1]["generated_text"] == plain[-1]["generated_text"]
    assert len(spec) == spec[-1]["details"]["generated_tokens"] == MAX_NEW      # one event per token
    accepted = after["llmserve_spec_accepted_tokens_total"] - before["llmserve_spec_accepted_tokens_total"]
    drafted = after["llmserve_spec_draft_tokens_total"] - before["llmserve_spec_draft_tokens_total"]
    wasted = after["llmserve_spec_wasted_tokens_total"] - before["llmserve_spec_wasted_tokens_total"]
    assert accepted > 0 and drafted == accepted + wasted
    assert after["llmserve_spec_accepted_length_count"] > before["llmserve_spec_accepted_length_count"]

    # A stop string from the middle of the answer, which an accepted run brings: the stream ends
    # right before it, and no token after the one that completed it comes out.
    text = plain[-1]["generated_text"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = tgi_stream(server, stop=[stop])
    ids = [e["token"]["id"] for e in cut]
    assert ids == [e["token"]["id"] for e in plain][: len(ids)]
    assert stop in "".join(e["token"]["text"] for e in cut) and stop not in "".join(e["token"]["text"] for e in cut[:-1])
    assert cut[-1]["generated_text"] == text[: text.index(stop)]
    assert cut[-1]["details"]["finish_reason"] == "stop_sequence"


def test_openai_stream_equals_plain_and_info(server):
    client = server.openai_client()
    model = client.models.list().data[0].id

    def chunks(**extra) -> list[str]:
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, stream=True,
                                           extra_body=extra)
        return [c.choices[0].text for c in stream if c.choices]

    plain, spec = chunks(speculate=False), chunks()
    assert spec == plain and len(spec) >= MAX_NEW - 1    # a chunk per token (the last may only carry the finish)
    info = httpx.get(server.url + "/info").json()
    assert info["speculate"] == 10 and info["prompt_lookup_ngram"] == [1, 3]
    # --speculate-max-batch left unset: the device's default, resolved by the engine
    assert info["speculate_max_batch"] == SPECULATE_MAX_BATCH[info["model_device_type"]]
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "x", "speculate": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculate"

"""TGI's interface end to end: a real server, driven by TGI's own `text-generation` client and
huggingface_hub's InferenceClient."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def client(tiny_server) -> Client:
    return Client(tiny_server.url, timeout=60)


def greedy(client: Client, prompt: str = PROMPT, **kw):
    return client.generate(prompt, max_new_tokens=kw.pop("max_new_tokens", 12), **kw)


def test_generate_greedy_details(client):
    r = greedy(client, decoder_input_details=True)
    d = r.details
    assert d.finish_reason == "length" and d.generated_tokens == 12 and len(d.tokens) == 12
    assert d.seed is None                                   # greedy: no seed to report
    assert "".join(t.text for t in d.tokens) == r.generated_text
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.tokens)
    # the prompt tokens with logprobs; the first has no context, so no logprob
    assert len(d.prefill) >= 5 and d.prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.prefill[1:])
    assert greedy(client).generated_text == r.generated_text   # greedy is deterministic


def test_stream_matches_generate(client):
    full = greedy(client)
    events = list(client.generate_stream(PROMPT, max_new_tokens=12))
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == full.generated_text == "".join(e.token.text for e in events)
    assert last.details.finish_reason == "length" and last.details.generated_tokens == 12


def test_stop_sequence_cuts_before_the_match(client):
    text = greedy(client, max_new_tokens=16).generated_text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the greedy text is too short to pick a stop sequence from"
    r = greedy(client, max_new_tokens=16, stop_sequences=[stop])
    assert r.details.finish_reason == "stop_sequence"
    assert r.generated_text == text[: text.index(stop)]
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=16, stop_sequences=[stop]))
    assert streamed[-1].generated_text == r.generated_text
    # each token keeps its own text (seed 004), so the tokens spell the stop sequence too
    assert "".join(e.token.text for e in streamed).startswith(r.generated_text + stop)
    assert streamed[-1].details.finish_reason == "stop_sequence"


def test_seed_reproducibility(client):
    def sample(seed):
        return client.generate(PROMPT, max_new_tokens=10, do_sample=True, temperature=1.0, seed=seed)
    a, b, c = sample(42), sample(42), sample(43)
    assert a.details.seed == 42
    assert [t.id for t in a.details.tokens] == [t.id for t in b.details.tokens]
    assert [t.id for t in a.details.tokens] != [t.id for t in c.details.tokens]
    # without a seed the server picks one and reports it; sending it back reproduces the text
    d = client.generate(PROMPT, max_new_tokens=10, do_sample=True)
    assert d.details.seed is not None
    assert sample(d.details.seed).generated_text == d.generated_text


def test_top_n_tokens(client):
    r = greedy(client, top_n_tokens=3)
    assert len(r.details.top_tokens) == 12
    for chosen, top in zip(r.details.tokens, r.details.top_tokens):
        assert len(top) == 3
        assert top[0].id == chosen.id                        # greedy picks the most likely token
        assert top[0].logprob == pytest.approx(chosen.logprob, abs=1e-5)
        assert top[0].logprob >= top[1].logprob >= top[2].logprob


def test_return_full_text_and_truncate(client, tiny_server):
    r = greedy(client, return_full_text=True)
    assert r.generated_text == PROMPT + greedy(client).generated_text
    body = {"inputs": PROMPT, "parameters": {"truncate": 2, "max_new_tokens": 3, "decoder_input_details": True, "details": True}}
    out = httpx.post(tiny_server.url + "/generate", json=body, timeout=60).json()
    assert len(out["details"]["prefill"]) == 2 and out["details"]["prompt_tokens"] == 2
    tokens = httpx.post(tiny_server.url + "/tokenize", json={"inputs": PROMPT}, timeout=10).json()
    assert [t["id"] for t in out["details"]["prefill"]] == [t["id"] for t in tokens[-2:]]


def test_root_route_dispatches_on_stream(tiny_server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    as_list = httpx.post(tiny_server.url + "/", json=body, timeout=60).json()
    assert isinstance(as_list, list) and len(as_list) == 1 and "generated_text" in as_list[0]
    with httpx.stream("POST", tiny_server.url + "/", json=body | {"stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(data) == 4


def test_tokenize_offsets(tiny_server):
    tokens = httpx.post(tiny_server.url + "/tokenize", json={"inputs": PROMPT}, timeout=10).json()
    assert "".join(t["text"] for t in tokens) == PROMPT
    assert all(PROMPT[t["start"]:t["stop"]] == t["text"] for t in tokens)


def test_info_health_and_metrics(tiny_server, client):
    info = httpx.get(tiny_server.url + "/info", timeout=10).json()
    assert info["model_id"] == "tiny" and info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511
    assert info["prefix_cache"] is True
    assert httpx.get(tiny_server.url + "/health", timeout=10).status_code == 200
    greedy(client, max_new_tokens=3)
    m = tiny_server.metrics()
    assert m['llmserve_requests_total{outcome="success"}'] >= 1
    assert m["llmserve_generated_tokens_total"] >= 3
    assert m["llmserve_time_to_first_token_seconds_count"] >= 1
    assert m["llmserve_inter_token_latency_seconds_count"] >= 2
    assert m["llmserve_kv_cache_slots_total"] > 0


def test_huggingface_hub_inference_client(tiny_server, client):
    hub = InferenceClient(model=tiny_server.url, timeout=60)
    expected = greedy(client, max_new_tokens=8)
    out = hub.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert out.generated_text == expected.generated_text
    assert [t.id for t in out.details.tokens] == [t.id for t in expected.details.tokens]
    streamed = list(hub.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(streamed) == expected.generated_text


def test_multibyte_text_streams_whole_characters(client):
    # Whatever the random model emits, every streamed piece is valid text (no U+FFFD halves of a
    # CJK character or emoji) and the pieces add up to the final text.
    events = list(client.generate_stream("日本語のテキスト 🙂", max_new_tokens=24))
    assert "\ufffd" not in "".join(e.token.text for e in events)
    assert "".join(e.token.text for e in events) == events[-1].generated_text


def test_ignore_eos_generates_max_new_tokens(embedded_server):
    """lightllm's and vLLM's ``ignore_eos`` in TGI's parameters: the embedded model answers this raw
    prompt with its EOS at once, and with ignore_eos runs on to max_new_tokens (sent as
    benchmarks/serving.py --backend tgi --ignore-eos sends it)."""
    def generate(**parameters) -> dict:
        r = httpx.post(embedded_server.url + "/generate", timeout=120, json={
            "inputs": "Write a long story about a dragon.",
            "parameters": {"max_new_tokens": 40, "details": True, **parameters}})
        assert r.status_code == 200, r.text
        return r.json()["details"]

    stops = generate()
    assert stops["finish_reason"] == "eos_token" and stops["generated_tokens"] < 40
    details = generate(ignore_eos=True)
    assert details["finish_reason"] == "length" and details["generated_tokens"] == len(details["tokens"]) == 40

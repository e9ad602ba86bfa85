"""TGI's interface against seed 004 (the TGI streaming interface document) item by item: the
stream's last event, each token's own text under a stop sequence, the parameter ranges, the
cumulative-text mode (the seed's response example 2, its fullTextEnabled setting), and TGI's
best_of."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serving_utils import ServerProcess, tgi_stream_events

PROMPT = "The capital of France is"
TIMEOUT = httpx.Timeout(60.0)
REPLACEMENT_CHAR = "\ufffd"


def generate(url: str, **parameters) -> httpx.Response:
    return httpx.post(url + "/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=TIMEOUT)


def stream(url: str, **parameters) -> list[dict]:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await tgi_stream_events(client, url, {"inputs": PROMPT, "parameters": parameters})
    return asyncio.run(run())


def assert_422(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 422, r.text
    assert set(r.json()) == {"error", "error_type"}
    for word in words:
        assert word in r.json()["error"], (word, r.json())


@pytest.fixture(scope="module")
def full_text_server(tiny_llama_dir):
    """Seed 004's cumulative mode (its fullTextEnabled), with room for 3 best_of samples."""
    with ServerProcess(tiny_llama_dir, "--served-model-name", "tiny", "--full-text-enabled", "--max-best-of", "3") as server:
        yield server


def test_last_stream_event_has_details_only_when_asked(tiny_server):
    plain = stream(tiny_server.url, max_new_tokens=4)
    assert all(e["details"] is None for e in plain) and plain[-1]["generated_text"] is not None
    detailed = stream(tiny_server.url, max_new_tokens=4, details=True)
    assert detailed[-1]["details"]["generated_tokens"] == 4 and detailed[-1]["details"]["finish_reason"] == "length"
    assert all(e["details"] is None for e in detailed[:-1])


def test_each_tokens_text_is_its_own_under_a_stop_sequence(tiny_server, smollm2_tokenizer):
    """The stop hold-back delays events; it does not move text from one token to the next."""
    text = generate(tiny_server.url, max_new_tokens=24).json()["generated_text"]
    stop = text[len(text) // 2: len(text) // 2 + 4]
    r = generate(tiny_server.url, max_new_tokens=24, stop=[stop], details=True)
    details = r.json()["details"]
    assert details["finish_reason"] == "stop_sequence" and r.json()["generated_text"] == text[: text.index(stop)]
    events = stream(tiny_server.url, max_new_tokens=24, stop=[stop])
    for tokens in (details["tokens"], [e["token"] for e in events]):
        own = [(t["id"], t["text"]) for t in tokens]
        whole = [(i, smollm2_tokenizer.decode([i])) for i, _ in own]
        # a token that ends mid-character has no text of its own yet ("" here, U+FFFD alone)
        checked = [(pair, expected) for pair, expected in zip(own, whole) if REPLACEMENT_CHAR not in expected[1]]
        assert len(checked) >= len(own) - 2 >= 4
        assert [pair for pair, _ in checked] == [expected for _, expected in checked]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in details["tokens"]]
    assert events[-1]["generated_text"] == r.json()["generated_text"]


@pytest.mark.parametrize("parameters, words", [
    ({"seed": 0, "do_sample": True}, ["seed", "(0,"]),
    ({"seed": 2**64, "do_sample": True}, []),
    ({"typical_p": 1.01}, ["typical_p"]),
    ({"typical_p": 0.0}, ["typical_p"]),
    ({"top_k": 2**31}, ["top_k"]),
    ({"top_p": 1.0}, ["top_p"]),
    ({"truncate": 0}, ["truncate"]),
    ({"truncate": 2**31}, ["truncate"]),
    ({"max_new_tokens": 0}, ["max_new_tokens"]),
])
def test_seed_ranges_are_refused_outside(tiny_server, parameters, words):
    assert_422(generate(tiny_server.url, **({"max_new_tokens": 2} | parameters)), *words)


def test_seed_ranges_are_accepted_inside(tiny_server):
    greedy = generate(tiny_server.url, max_new_tokens=6, decoder_input_details=True).json()
    # typical_p 1.0 is the seed's default and cuts nothing: a greedy request stays greedy
    assert generate(tiny_server.url, max_new_tokens=6, typical_p=1.0).json()["generated_text"] == greedy["generated_text"]
    # a truncate of the prompt's length or more cuts nothing (the seed allows any in (0, 2^31-1])
    long_truncate = generate(tiny_server.url, max_new_tokens=6, truncate=2**31 - 1, decoder_input_details=True).json()
    assert long_truncate == greedy
    for seed in (1, 2**64 - 1):
        r = generate(tiny_server.url, max_new_tokens=2, do_sample=True, seed=seed, details=True)
        assert r.status_code == 200 and r.json()["details"]["seed"] == seed, r.text
    assert generate(tiny_server.url, max_new_tokens=2, top_k=2**31 - 1).status_code == 200


def test_cumulative_text_mode(full_text_server, tiny_server):
    """Seed 004's response example 2: each event's token text is the whole text so far."""
    own = stream(tiny_server.url, max_new_tokens=8, details=True)
    cumulative = stream(full_text_server.url, max_new_tokens=8, details=True)
    assert [e["token"]["id"] for e in cumulative] == [e["token"]["id"] for e in own]
    so_far = ""
    for mine, theirs in zip(own, cumulative):
        so_far += mine["token"]["text"]
        assert theirs["token"]["text"] == so_far
    assert cumulative[-1]["generated_text"] == own[-1]["generated_text"] == so_far


def test_best_of_returns_the_sample_with_the_highest_logprob_sum(full_text_server):
    url = full_text_server.url
    assert httpx.get(url + "/info", timeout=TIMEOUT).json()["max_best_of"] == 3
    r = generate(url, max_new_tokens=6, do_sample=True, temperature=1.5, best_of=3, details=True)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2

    def score(d: dict) -> float:
        return sum(t["logprob"] for t in d["tokens"])
    assert all(score(details) >= score(o) for o in others)
    assert len({details["seed"], *(o["seed"] for o in others)}) == 3
    # each sample is what its seed gives alone
    for sample in (details, *others):
        alone = generate(url, max_new_tokens=6, do_sample=True, temperature=1.5, seed=sample["seed"]).json()
        text = r.json()["generated_text"] if sample is details else sample["generated_text"]
        assert alone["generated_text"] == text
    # without details the answer is the best sample all the same
    plain = generate(url, max_new_tokens=6, do_sample=True, temperature=1.5, best_of=2)
    assert plain.status_code == 200 and set(plain.json()) == {"generated_text"}


@pytest.mark.parametrize("parameters, words", [
    ({"best_of": 2}, ["sampling"]),                                   # greedy
    ({"best_of": 2, "do_sample": True, "seed": 5}, ["seed"]),
    ({"best_of": 4, "do_sample": True}, ["best_of", "3"]),           # beyond --max-best-of
    ({"best_of": 0, "do_sample": True}, ["best_of"]),
])
def test_best_of_rules(full_text_server, parameters, words):
    assert_422(generate(full_text_server.url, max_new_tokens=2, **parameters), *words)


def test_best_of_is_not_streamed(full_text_server):
    r = httpx.post(full_text_server.url + "/generate_stream", timeout=TIMEOUT,
                   json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
    assert_422(r, "streaming")

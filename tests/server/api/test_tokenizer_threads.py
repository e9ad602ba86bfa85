"""Tokenizers are never shared between threads: 64 concurrent requests mixing /tokenize, chat
(template rendering), streaming and non-streaming generation, each checked for its exact output,
repeated. A fast tokenizer used from two threads at once fails with "Already borrowed"."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from serving_utils import FailingEngine
from transformers import AutoTokenizer

ROUNDS = 3
TEXTS = [f"Request number {i}: the quick brown fox jumps over the lazy dog. " * (1 + i % 7) for i in range(64)]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def alone(tiny_server) -> dict[int, str]:
    """Each generation's text when it runs alone."""
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        return {i: client.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 3}}).json()["generated_text"]
                for i, text in enumerate(TEXTS) if i % 4 in (2, 3)}


async def one(client: httpx.AsyncClient, i: int) -> tuple[int, object]:
    text = TEXTS[i]
    kind = i % 4
    if kind == 0:
        r = await client.post("/tokenize", json={"inputs": text})
        return i, [t["id"] for t in r.json()]
    if kind == 1:
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "temperature": 0,
                                                             "messages": [{"role": "user", "content": text}]})
        return i, r.json()["usage"]["prompt_tokens"]
    if kind == 2:
        pieces = []
        async with client.stream("POST", "/generate_stream", json={"inputs": text, "parameters": {"max_new_tokens": 3}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    pieces.append(event["token"]["text"])
        return i, "".join(pieces)
    r = await client.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 3}})
    return i, r.json()["generated_text"]


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_64_concurrent_mixed_requests_get_their_exact_outputs(tiny_server, tokenizer, alone, round_):
    async def storm() -> list[tuple[int, object]]:
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(TEXTS))))

    for i, got in asyncio.run(storm()):
        text = TEXTS[i]
        if i % 4 == 0:
            assert got == tokenizer(text).input_ids
        elif i % 4 == 1:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True, return_dict=True)["input_ids"]
            assert got == len(rendered)
        else:
            assert got == alone[i], (i, got)


def test_every_tokenizer_thread_has_its_copy_before_the_first_request(tiny_llama_dir, smollm2_tokenizer):
    """The pool's threads start with the server state, each copying the tokenizer then (0.16 s
    each for SmolLM2's), not on the first requests."""
    from llmserve.server.api.state import TOKENIZER_THREADS, ServerConfig, ServerState
    from llmserve.server.metrics import ServerMetrics

    state = ServerState(ServerConfig(generation_config="none"), FailingEngine(tiny_llama_dir, smollm2_tokenizer),
                        ServerMetrics())
    try:
        threads = list(state._tokenizer_pool._threads)
        assert len(threads) == TOKENIZER_THREADS and all(t.is_alive() for t in threads)
        barrier = threading.Barrier(TOKENIZER_THREADS)

        def own_copy() -> int:
            barrier.wait(10)                # one task a thread
            return id(state.thread_tokenizer)

        copies = {f.result() for f in [state._tokenizer_pool.submit(own_copy) for _ in range(TOKENIZER_THREADS)]}
        assert len(copies) == TOKENIZER_THREADS and id(state.tokenizer) not in copies
        assert len(state._tokenizer_pool._threads) == TOKENIZER_THREADS
    finally:
        state._tokenizer_pool.shutdown()

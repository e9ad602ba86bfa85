"""benchmarks/serving.py against an in-process fake server that streams TGI and OpenAI events
with known timings, its summary maths on known inputs, and benchmarks/make_random_model.py's
tiny model directory."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


serving = _load("serving")

FIRST_S = 0.03   # the fake server's time to first token
GAP_S = 0.01     # and between tokens


# -- the fake server -------------------------------------------------------------------------
async def _sse(request: web.Request, events: list, line_end: str = "\n", split_first: bool = False,
               done: bool = False) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, event in enumerate(events):
        await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
        payload = f"data: {json.dumps(event)}{line_end}{line_end}".encode()
        if split_first and i == 0:   # one event over two TCP writes
            await resp.write(payload[:9])
            await asyncio.sleep(0.005)
            payload = payload[9:]
        await resp.write(payload)
    if done:
        await resp.write(f"data: [DONE]{line_end}{line_end}".encode())
    await resp.write_eof()
    return resp


def _app(bodies: list) -> web.Application:
    async def generate_stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        prompt, n = body["inputs"], body["parameters"]["max_new_tokens"]
        if prompt == "fail-http":
            return web.json_response({"error": "Input validation error: bad input", "error_type": "validation"}, status=422)
        tokens = [{"token": {"id": i, "text": f" w{i}", "logprob": -1.0, "special": False},
                   "generated_text": None, "details": None} for i in range(n)]
        if prompt == "fail-mid":
            return await _sse(request, tokens[:2] + [{"error": "CUDA out of memory", "error_type": "generation"}])
        if prompt != "no-final":
            tokens[-1]["generated_text"] = "".join(f" w{i}" for i in range(n))
            tokens[-1]["details"] = {"finish_reason": "length", "generated_tokens": n, "seed": None}
        return await _sse(request, tokens, split_first=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        per_chunk = 2 if prompt == "two-per-chunk" else 1
        events = [{"object": "text_completion", "choices": [{"index": 0, "text": " w" * per_chunk, "finish_reason": None}]}
                  for _ in range(n // per_chunk)]
        if prompt == "fail-mid":
            return await _sse(request, events[:2] + [{"error": {"message": "engine died", "type": "InternalServerError"}}])
        events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if prompt != "no-usage" and body.get("stream_options", {}).get("include_usage"):
            events.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
        return await _sse(request, events, done=prompt != "no-done")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]} for i in range(n)]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 19, "completion_tokens": n}})
        return await _sse(request, events, line_end="\r\n", done=True)

    async def interactive(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        session_id = 41 if body["session_id"] == -1 else body["session_id"]
        n = body["request_output_len"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
            line = {"text": f" w{i}", "tokens": i + 1, "input_tokens": 5, "history_tokens": 10 * len(bodies),
                    "finish_reason": "length" if i == n - 1 else None, "session_id": session_id}
            await resp.write((json.dumps(line) + "\n").encode())
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        # counters that grow with every request served: 100 queried and 60 found each
        served = len(bodies)
        return web.Response(text=(
            "# HELP llmserve_prefix_cache_queried_tokens_total x\n# TYPE llmserve_prefix_cache_queried_tokens_total counter\n"
            f'llmserve_prefix_cache_queried_tokens_total{{model_name="m"}} {100.0 * served}\n'
            f'llmserve_prefix_cache_hit_tokens_total{{model_name="m"}} {60.0 * served}\n'
            f'llmserve_prefix_cache_hit_tokens_created{{model_name="m"}} 1.7e9\n'))

    async def tokenize(request: web.Request) -> web.Response:
        words = (await request.json())["inputs"].split()
        return web.json_response([{"id": i, "text": w, "start": 0, "stop": 0} for i, w in enumerate(words)])

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/interactive", interactive)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return app


class FakeServer:
    """The fake app on 127.0.0.1 (a free port), served from a thread with its own event loop."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(_app(self.bodies))
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.close()


def _send(server: FakeServer, backend: str, prompt: str, n: int, **ep_kw) -> serving.RequestResult:
    ep = serving.Endpoint(backend, server.url, model="fake-model", **ep_kw)
    spec = serving.RequestSpec(prompt, prompt_len=3, output_len=n)

    async def go():
        async with serving.new_session() as session:
            return await serving.REQUEST_FUNCS[backend](session, ep, spec)

    return asyncio.run(go())


def _check_timings(r: serving.RequestResult, n_chunks: int) -> None:
    # lower bounds only: the server cannot send sooner, but a busy client may read two events at once
    assert r.ttft >= FIRST_S
    assert len(r.itl) == n_chunks - 1 and all(gap >= 0 for gap in r.itl)
    assert r.latency >= FIRST_S + (n_chunks - 1) * GAP_S
    assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    assert r.tpot == pytest.approx((r.latency - r.ttft) / (r.output_tokens - 1))


# -- request functions -----------------------------------------------------------------------
def test_tgi_stream(server):
    r = _send(server, "tgi", "hello", 5)
    assert r.success, r.error
    assert r.output_tokens == 5 and r.text == " w0 w1 w2 w3 w4"
    _check_timings(r, 5)
    params = server.bodies[-1]["parameters"]
    assert params["max_new_tokens"] == 5 and params["details"] is True and "ignore_eos" not in params
    r = _send(server, "tgi", "hello", 3, ignore_eos=True, extra_body={"top_k": 5})
    assert r.success and r.output_tokens == 3
    assert server.bodies[-1]["parameters"]["ignore_eos"] is True and server.bodies[-1]["parameters"]["top_k"] == 5


def test_tgi_failures(server):
    r = _send(server, "tgi", "fail-http", 4)
    assert not r.success and r.error.startswith("HTTP 422") and "bad input" in r.error
    r = _send(server, "tgi", "fail-mid", 4)
    assert not r.success and r.error == "generation: CUDA out of memory"
    r = _send(server, "tgi", "no-final", 4)
    assert not r.success and "final event" in r.error
    assert r.tpot is None


def test_openai_completions(server):
    r = _send(server, "openai", "hello", 6, ignore_eos=True)
    assert r.success, r.error
    assert r.output_tokens == 6 and r.prompt_len == 7      # from usage
    _check_timings(r, 6)                                    # the empty finish_reason chunk is not a token
    body = server.bodies[-1]
    assert body["max_tokens"] == 6 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"

    r = _send(server, "openai", "two-per-chunk", 8)         # usage counts tokens, not chunks
    assert r.success and r.output_tokens == 8 and len(r.itl) == 3
    r = _send(server, "openai", "no-usage", 4)              # no usage: chunks counted
    assert r.success and r.output_tokens == 4 and r.prompt_len == 3
    r = _send(server, "openai", "no-done", 4)
    assert not r.success and "[DONE]" in r.error
    r = _send(server, "openai", "fail-mid", 4)
    assert not r.success and r.error == "InternalServerError: engine died"


def test_openai_chat(server):
    r = _send(server, "openai-chat", "hello", 4)
    assert r.success, r.error
    assert r.output_tokens == 4 and r.prompt_len == 19 and r.text == " w0 w1 w2 w3"
    _check_timings(r, 4)                                    # the role chunk is not a token
    assert server.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]


def _conversations(turns: int = 3) -> list[list[serving.RequestSpec]]:
    return [[serving.RequestSpec(f"c{c} t{t}", 2, 2, turn=t, last_turn=t == turns - 1) for t in range(turns)]
            for c in range(2)]


def test_multi_turn_chat_resends_the_history(server):
    ep = serving.Endpoint("openai-chat", server.url, model="fake-model")
    start = len(server.bodies)
    results, _ = asyncio.run(serving.run_conversations(ep, _conversations(), max_concurrency=1))
    assert [r.turn for r in results] == [0, 1, 2, 0, 1, 2] and all(r.success for r in results)
    sent = server.bodies[start:]
    assert sent[0]["messages"] == [{"role": "user", "content": "c0 t0"}]
    assert sent[2]["messages"] == [{"role": "user", "content": "c0 t0"}, {"role": "assistant", "content": " w0 w1"},
                                   {"role": "user", "content": "c0 t1"}, {"role": "assistant", "content": " w0 w1"},
                                   {"role": "user", "content": "c0 t2"}]
    summary = serving.summarize(results, 1.0)
    assert sorted(summary["ttft_ms_by_turn"]) == ["0", "1", "2"]
    assert "TTFT ms, turn" in serving.format_summary(summary, "t")


def test_multi_turn_interactive_sends_the_new_turn_only(server):
    ep = serving.Endpoint("interactive", server.url, ignore_eos=True)
    start = len(server.bodies)
    results, _ = asyncio.run(serving.run_conversations(ep, _conversations()[:1]))
    assert all(r.success for r in results), [r.error for r in results]
    sent = server.bodies[start:]
    assert [b["prompt"] for b in sent] == ["c0 t0", "c0 t1", "c0 t2"]
    assert [b["session_id"] for b in sent] == [-1, 41, 41]               # the id the first answer gave
    assert [b["interactive_mode"] for b in sent] == [True, True, False]   # the last turn ends the session
    assert sent[0]["ignore_eos"] is True and sent[0]["request_output_len"] == 2 and sent[0]["stream"] is True
    assert [r.output_tokens for r in results] == [2, 2, 2]
    assert results[1].prompt_len == 5 + 10 * (start + 2)                 # input_tokens + history_tokens
    _check_timings(results[0], 2)


def test_prefix_cache_hit_rate(server):
    async def read(base):
        async with serving.new_session() as session:
            return await serving.prefix_cache_counters(session, base)

    before = asyncio.run(read(server.url))
    _send(server, "openai", "hello", 2)
    use = serving.prefix_cache_use(before, asyncio.run(read(server.url)))
    assert use == {"queried_tokens": 100.0, "hit_tokens": 60.0, "hit_rate": 0.6}
    assert asyncio.run(read(server.url + "/nothing")) is None
    assert serving.prefix_cache_use(None, before) is None


def test_shared_prefix_requests(smollm2_tokenizer):
    specs = serving.shared_prefix_requests(smollm2_tokenizer, 3, 50, 10, 4, as_system=False, seed=1)
    assert len({s.prompt for s in specs}) == 3 and all(s.output_len == 4 for s in specs)
    # the prompts agree on their first ~50 tokens' text, then differ
    shared = next(i for i in range(len(specs[0].prompt)) if len({s.prompt[i] for s in specs}) > 1)
    assert len(smollm2_tokenizer(specs[0].prompt[:shared], add_special_tokens=False).input_ids) >= 49
    assert all(55 <= s.prompt_len <= 65 for s in specs), [s.prompt_len for s in specs]
    chat = serving.shared_prefix_requests(smollm2_tokenizer, 3, 50, 10, 4, as_system=True, seed=1)
    assert len({s.system for s in chat}) == 1 and len({s.prompt for s in chat}) == 3


def test_connection_refused_is_a_failure():
    ep = serving.Endpoint("tgi", "http://127.0.0.1:9")
    results, _ = asyncio.run(serving.run_requests(ep, [serving.RequestSpec("x", 1, 2)]))
    assert not results[0].success and results[0].error


def test_run_requests_concurrency_and_order(server):
    ep = serving.Endpoint("tgi", server.url)
    specs = [serving.RequestSpec(f"p{i}", 2, 3) for i in range(6)]
    results, duration = asyncio.run(serving.run_requests(ep, specs, max_concurrency=2))
    assert all(r.success for r in results)
    single = FIRST_S + 2 * GAP_S
    assert duration >= 3 * single * 0.9                    # three waves of two
    starts = sorted(r.start for r in results)
    assert starts[0] >= 0 and starts[2] >= 0.9 * single    # the third waited for a slot
    summary = serving.summarize(results, duration)
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 18


def test_server_token_counts(server):
    async def go(base):
        async with serving.new_session() as session:
            return await serving.server_token_counts(session, base, ["a b c", "one", "x y"])

    assert asyncio.run(go(server.url)) == ([3, 1, 2], "")
    counts, why_not = asyncio.run(go(server.url + "/nothing"))
    assert counts is None and "HTTP 404" in why_not


# -- arrivals and summary maths --------------------------------------------------------------
def test_arrival_times():
    assert serving.arrival_times(4, math.inf) == [0.0] * 4
    times = serving.arrival_times(4000, 20.0, seed=3)
    assert times == serving.arrival_times(4000, 20.0, seed=3) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0 and sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert serving.arrival_times(50, 20.0, seed=4) != serving.arrival_times(50, 20.0, seed=3)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 5, 100):
        values = [rng.random() for _ in range(n)]
        for p in (0, 25, 50, 90, 99, 100):
            assert serving.percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    assert math.isnan(serving.percentile([], 50))


def test_summary_on_known_results():
    R = serving.RequestResult
    results = [
        R(success=True, prompt_len=10, output_len=5, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        R(success=True, prompt_len=20, output_len=3, output_tokens=3, ttft=0.2, latency=0.4, itl=[0.1, 0.1]),
        R(success=True, prompt_len=30, output_len=4, output_tokens=1, ttft=0.3, latency=0.3, itl=[]),
        R(success=False, error="boom", prompt_len=40, output_len=9),
    ]
    s = serving.summarize(results, duration=2.0, percentiles=(50, 90))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 9 and s["requested_output_tokens"] == 12
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_throughput"] == pytest.approx(30.0) and s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["ttft_ms"]["p90"] == pytest.approx(280)        # 200 + 0.8 * (300 - 200)
    assert s["tpot_ms"]["mean"] == pytest.approx(100)       # (500-100)/4 and (400-200)/2; 1 token: no TPOT
    assert s["itl_ms"]["mean"] == pytest.approx(100) and s["e2e_ms"]["p50"] == pytest.approx(400)
    table = serving.format_summary(s, "t", (50, 90))
    assert "| TTFT | 200.00 | 200.00 | 280.00 |" in table and "3 / 1" in table

    empty = serving.summarize([R(success=False, error="x")], 1.0)
    assert empty["completed"] == 0 and math.isnan(empty["tpot_ms"]["mean"])
    assert serving._json_safe(empty)["tpot_ms"]["mean"] is None


# -- workloads -------------------------------------------------------------------------------
def test_random_prompts_have_exact_token_counts(smollm2_tokenizer):
    specs = serving.random_requests(smollm2_tokenizer, 20, 64, 16, "uniform", 0.5, seed=1)
    for s in specs:
        assert s.prompt_len == len(smollm2_tokenizer(s.prompt)["input_ids"])
        assert 32 <= s.prompt_len <= 96 and 8 <= s.output_len <= 24
    fixed = serving.random_requests(smollm2_tokenizer, 10, 100, 7, seed=2)
    assert [s.prompt_len for s in fixed] == [100] * 10 and {s.output_len for s in fixed} == {7}
    assert fixed[0].prompt == serving.random_requests(smollm2_tokenizer, 10, 100, 7, seed=2)[0].prompt


def test_sharegpt_filter(smollm2_tokenizer, tmp_path):
    long_words = " ".join(["word"] * 30)
    data = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long_words}]},   # prompt too short
        {"conversations": [{"from": "human", "value": long_words}, {"from": "gpt", "value": "ok"}]},   # answer too short
        {"conversations": [{"from": "human", "value": " ".join(["word"] * 1100)}, {"from": "gpt", "value": long_words}]},
        {"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": long_words},
                           {"from": "gpt", "value": long_words + " end"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    specs = serving.sharegpt_requests(str(path), smollm2_tokenizer, 10)
    assert len(specs) == 1 and specs[0].prompt == long_words
    assert specs[0].output_len == len(smollm2_tokenizer(long_words + " end", add_special_tokens=False)["input_ids"])
    assert serving.sharegpt_requests(str(path), smollm2_tokenizer, 10, output_len=3)[0].output_len == 3


def test_main_end_to_end(server, smollm2_tokenizer, tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    smollm2_tokenizer.save_pretrained(tok_dir)
    out = tmp_path / "result.json"
    rc = serving.main(["--backend", "openai", "--base-url", server.url, "--tokenizer", str(tok_dir),
                       "--num-prompts", "5", "--input-len", "16", "--output-len", "3", "--request-rate", "200",
                       "--max-concurrency", "3", "--warmup", "1", "--result-file", str(out), "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "5 / 0" in printed and "TPOT" in printed
    payload = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert payload["model"] == "fake-model" and payload["summary"]["completed"] == 5
    assert payload["prompt_tokens_counted_by"] == "server /tokenize"
    assert len(payload["requests"]) == 5 and all(r["output_tokens"] == 3 for r in payload["requests"])
    assert payload["args"]["request_rate"] == 200


# -- make_random_model -----------------------------------------------------------------------
@pytest.mark.parametrize("shape, model_type", [("tiny", "llama"), ("qwen3-tiny", "qwen3")])
def test_make_random_model_tiny(smollm2_tokenizer, tmp_path, shape, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = tmp_path / "src-tok"
    smollm2_tokenizer.save_pretrained(src)
    out = tmp_path / "tiny"
    vocab = len(smollm2_tokenizer) + 64                     # so that padding happens
    # in-process (a subprocess would spend 5 s importing torch, llmserve and transformers again);
    # the script imports offline.py and common.py from its folder, as when run as a file
    sys.path.insert(0, str(BENCH))
    try:
        make_random_model = _load("make_random_model")
    finally:
        sys.path[:] = [p for p in sys.path if p != str(BENCH)]
    assert make_random_model.main(["--shape", shape, "--device", "cpu", "--tokenizer", str(src),
                                   "--vocab-size", str(vocab), "--shard-size", "1e7", "--out", str(out)]) == 0
    config = AutoConfig.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert config.model_type == model_type and config.vocab_size == vocab and len(tok) == vocab
    assert config.num_hidden_layers == 2 and config.eos_token_id == tok.eos_token_id
    assert tok.decode([vocab - 1]) == f"<|t{vocab - 1}|>"
    assert tok("hello world")["input_ids"] == smollm2_tokenizer("hello world")["input_ids"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((out / f).is_file() for f in shards)   # 1e7-byte shards: the embedding alone is 12.6 MB
    assert "lm_head.weight" in index["weight_map"] and "model.layers.1.mlp.down_proj.weight" in index["weight_map"]
    # HF's own class finds every weight it has (Qwen3's q/k norms too) and nothing else
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

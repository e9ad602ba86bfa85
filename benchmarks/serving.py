"""Online serving benchmark: an asyncio load generator for a TGI or OpenAI-compatible endpoint.

What is measured
  ``--num-prompts`` streaming requests are sent to a running server, arriving as a Poisson
  process of ``--request-rate`` requests/s (exponential gaps, seeded) or all at once (``inf``,
  the default), at most ``--max-concurrency`` in flight. Each request asks for exactly its output
  length: ``max_new_tokens`` / ``max_tokens``, plus ``ignore_eos`` for the OpenAI backends (TGI
  itself has no such parameter, so a TGI request may stop early on EOS; ``--ignore-eos`` sends
  ``parameters.ignore_eos``, which llmserve and lightllm-style servers honour). Greedy by default.

  Backends
    tgi          POST {base}/generate_stream; SSE ``data: {"token": {...}, "generated_text": ...}``
    openai       POST {base}/v1/completions, stream; ``choices[0].text``, ``data: [DONE]``
    openai-chat  POST {base}/v1/chat/completions, stream; ``choices[0].delta.content``
    interactive  POST {base}/v1/chat/interactive (LMDeploy's sessions), stream; one JSON object per
                 line, ``text`` each; only with ``--workload multi-turn``

Workload
  Random (default): prompts of ``--input-len`` tokens (``--len-dist uniform``: drawn from
  [L * (1 - r), L * (1 + r)], r = ``--range-ratio``, as vLLM's random dataset; output lengths
  alike), made of random whole-word tokens of the tokenizer's vocabulary, adjusted until the
  prompt has exactly that many tokens *as the server counts them* (special tokens such as BOS
  included): counted by the server's ``POST /tokenize`` (TGI's format) when it has one, else by
  the local tokenizer. ShareGPT (``--dataset file.json``): the first human turn is the prompt,
  the token count of the gpt answer after it the output length; pairs with a prompt or answer
  under 4 tokens, a prompt over 1024 or a total over 2048 are skipped (vLLM's filter).
  Shared prefix (``--workload shared-prefix``): every prompt is one common random text of
  ``--shared-prefix-len`` tokens (openai-chat: the system message) followed by its own random
  question of ``--input-len`` tokens, as agents and RAG send one system prompt many times.
  Multi-turn (``--workload multi-turn``): ``--num-prompts`` conversations, run side by side (at
  most ``--max-concurrency`` at once), each of ``--turns`` turns sent one after the other, each
  turn a random user message of ``--input-len`` tokens; openai-chat re-sends the whole history
  (earlier answers as they came) every turn, interactive sends the new turn only (session -1,
  then the id the server gave; the last turn ends the session). ``--request-rate`` does not
  apply. The summary adds TTFT per turn.
  With either workload, the server's prefix-cache counters (``/metrics``:
  ``llmserve_prefix_cache_queried_tokens_total``, ``..._hit_tokens_total``) are read before and
  after the timed run: the hit rate is hit / queried over the run (none if the server has no
  such counters).

Per request
  TTFT     time from sending the request to the first token chunk
  ITL      the gaps between successive token chunks
  TPOT     (E2E - TTFT) / (output tokens - 1), requests of 2+ tokens
  E2E      time from sending to the end of the stream
  output tokens: TGI counts token events; OpenAI takes ``usage.completion_tokens`` (asked for
  with ``stream_options.include_usage``) when the server sends it, else counts chunks. Input
  tokens: ``usage.prompt_tokens`` when sent (the chat template's tokens included), else the
  count above. A request fails on a non-200 status, an error event, or a stream that ends
  without its final event (TGI: ``generated_text``; OpenAI: ``[DONE]``).

Summary: duration (first send to last response), completed / failed, request, input and output
token throughput, and mean / percentiles (``--percentiles``, default 50,90,99) of TTFT, TPOT, ITL
and E2E in ms. Table to stdout, progress and notes to stderr; ``--result-file`` saves the
arguments, the summary and one row per request as JSON.

Needs only aiohttp and transformers (for the tokenizer).

  python benchmarks/serving.py --backend openai --base-url http://127.0.0.1:8000 \\
      --tokenizer /data/llama3-8b-random --input-len 512 --output-len 128 --num-prompts 200 \\
      --request-rate 8 --result-file benchmarks/results/serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import platform
import random
import sys
import time
from collections import Counter
from contextlib import aclosing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `python benchmarks/serving.py` puts this folder first on sys.path, where benchmarks/kernels.py
# would shadow the PyPI package `kernels` that transformers probes for. common.py has the same
# fix, but importing it would import torch, which this client must not need.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import aiohttp  # noqa: E402

BACKEND_PATHS = {"tgi": "/generate_stream", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions",
                 "interactive": "/v1/chat/interactive"}
WORKLOADS = ("random", "shared-prefix", "multi-turn")
PREFIX_CACHE_COUNTERS = ("llmserve_prefix_cache_queried_tokens_total", "llmserve_prefix_cache_hit_tokens_total")
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


# -- requests and results --------------------------------------------------------------------
@dataclass
class RequestSpec:
    prompt: str
    prompt_len: int     # tokens, as counted before sending (server /tokenize or local tokenizer)
    output_len: int     # tokens asked for
    system: str | None = None     # openai-chat: a system message before the prompt (shared-prefix)
    turn: int | None = None       # multi-turn: which turn of its conversation (0 first)
    # multi-turn: openai-chat's earlier messages; interactive's session (None: ask for a new one)
    history: list[dict[str, str]] | None = None
    session_id: int | None = None
    last_turn: bool = True


@dataclass
class Endpoint:
    backend: str
    base_url: str
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + BACKEND_PATHS[self.backend]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0           # asked for
    output_tokens: int = 0        # generated, as measured from the stream
    ttft: float = 0.0             # s
    latency: float = 0.0          # s, end to end
    itl: list[float] = field(default_factory=list)   # s, gaps between token chunks
    start: float = 0.0            # s, perf_counter at send (made relative to the run's start later)
    text: str = ""
    turn: int | None = None       # multi-turn: the turn of its conversation
    session_id: int | None = None   # interactive: the session the server keeps

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def row(self) -> dict[str, Any]:
        """The JSON row: times in ms, no text."""
        ms = lambda s: round(s * 1e3, 3)  # noqa: E731
        tpot = self.tpot
        return {
            "success": self.success, "error": self.error, "start_s": round(self.start, 6),
            "prompt_len": self.prompt_len, "output_len": self.output_len, "output_tokens": self.output_tokens,
            "ttft_ms": ms(self.ttft) if self.success else None, "tpot_ms": ms(tpot) if tpot is not None else None,
            "e2e_ms": ms(self.latency) if self.success else None, "itl_ms": [ms(x) for x in self.itl],
            **({"turn": self.turn} if self.turn is not None else {}),
        }


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event, as soon as its closing blank line arrives (data
    left at the end of the stream without one is yielded too). Comments and other fields are
    skipped; multi-line data is joined with newlines."""
    buf = b""
    data: list[str] = []
    async for chunk in response.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if buf.strip():
        name, _, value = buf.rstrip(b"\r").decode("utf-8").partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


class _Stream:
    """Token-chunk bookkeeping shared by the backends."""

    def __init__(self, spec: RequestSpec) -> None:
        self.result = RequestResult(prompt_len=spec.prompt_len, output_len=spec.output_len, turn=spec.turn)
        self.t_start = time.perf_counter()
        self.result.start = self.t_start
        self.t_last: float | None = None
        self.chunks = 0
        self.texts: list[str] = []

    def token_chunk(self, text: str) -> None:
        now = time.perf_counter()
        if self.t_last is None:
            self.result.ttft = now - self.t_start
        else:
            self.result.itl.append(now - self.t_last)
        self.t_last = now
        self.chunks += 1
        self.texts.append(text)

    def finish(self, error: str = "", output_tokens: int | None = None) -> RequestResult:
        r = self.result
        r.latency = time.perf_counter() - self.t_start
        r.text = "".join(self.texts)
        r.output_tokens = output_tokens if output_tokens is not None else self.chunks
        if not error and self.chunks == 0:
            error = "the stream ended without a token"
        r.error, r.success = error, not error
        return r


async def json_lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Each non-empty line of a stream of JSON objects, one per line (the interactive route's)."""
    buf = b""
    async for chunk in response.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            if raw.strip():
                yield raw.decode("utf-8")
    if buf.strip():
        yield buf.decode("utf-8")


async def _post_stream(session: aiohttp.ClientSession, ep: Endpoint, body: dict, spec: RequestSpec,
                       handle: Callable[[_Stream, str], str | None], ended: str,
                       framing: Callable[[aiohttp.ClientResponse], AsyncIterator[str]] = sse_events) -> RequestResult:
    """POST ``body`` and feed each SSE data payload (or what ``framing`` splits the stream into) to
    ``handle(stream, data)``, which returns None to go on, "" when the stream is complete, or an
    error text. ``ended`` is the error for a stream that closed before ``handle`` said it was
    complete."""
    stream = _Stream(spec)
    try:
        async with session.post(ep.url, json=body, headers=ep.headers()) as resp:
            if resp.status != 200:
                text = (await resp.text())[:1000]
                return stream.finish(f"HTTP {resp.status}: {text}")
            async with aclosing(framing(resp)) as events:
                async for data in events:
                    outcome = handle(stream, data)
                    if outcome is not None:
                        return stream.finish(outcome)
            return stream.finish(ended)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeDecodeError) as e:
        return stream.finish(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _error_text(obj: Any) -> str | None:
    """The error an event carries, TGI style ({"error": "...", "error_type": ...}) or OpenAI /
    vLLM style ({"error": {"message": ...}} or {"object": "error", "message": ...})."""
    if not isinstance(obj, dict):
        return f"unexpected event {obj!r}"
    err = obj.get("error")
    if err is None and obj.get("object") == "error":
        err = obj
    if err is None:
        return None
    if isinstance(err, dict):
        msg = err.get("message") or json.dumps(err)
        kind = err.get("type") or err.get("code")
    else:
        msg, kind = str(err), obj.get("error_type")
    return f"{kind}: {msg}" if kind else msg


async def request_tgi(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec) -> RequestResult:
    params: dict[str, Any] = {"max_new_tokens": spec.output_len, "details": True, "do_sample": ep.temperature > 0}
    if ep.temperature > 0:
        params["temperature"] = ep.temperature
    if ep.ignore_eos:
        params["ignore_eos"] = True
    params.update(ep.extra_body)

    def handle(stream: _Stream, data: str) -> str | None:
        obj = json.loads(data)
        err = _error_text(obj)
        if err is not None:
            return err
        token = obj.get("token")
        if token is not None:
            stream.token_chunk("" if token.get("special") else token.get("text") or "")
        if obj.get("generated_text") is not None:
            return ""
        return None

    return await _post_stream(session, ep, {"inputs": spec.prompt, "parameters": params}, spec, handle,
                              "the stream ended without the final event (generated_text)")


def _openai_body(ep: Endpoint, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ep.model, "max_tokens": spec.output_len, "temperature": ep.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ep.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _request_openai(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec, body: dict[str, Any],
                          text_of: Callable[[dict], str | None]) -> RequestResult:
    usage: dict[str, Any] = {}
    body.update(ep.extra_body)

    def handle(stream: _Stream, data: str) -> str | None:
        if data.strip() == "[DONE]":
            return ""
        obj = json.loads(data)
        err = _error_text(obj)
        if err is not None:
            return err
        if obj.get("usage"):
            usage.update(obj["usage"])
        choices = obj.get("choices") or []
        if choices:
            text = text_of(choices[0])
            # chunks carrying no text are not tokens: the chat role chunk, the finish_reason chunk
            if text or (text is not None and choices[0].get("finish_reason") is None):
                stream.token_chunk(text)
        return None

    result = await _post_stream(session, ep, body, spec, handle, "the stream ended without [DONE]")
    if result.success and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        result.prompt_len = int(usage["prompt_tokens"])
    return result


async def request_openai(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec) -> RequestResult:
    body = {**_openai_body(ep, spec), "prompt": spec.prompt}
    return await _request_openai(session, ep, spec, body, lambda choice: choice.get("text"))


async def request_openai_chat(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec) -> RequestResult:
    system = [{"role": "system", "content": spec.system}] if spec.system is not None else []
    messages = [*system, *(spec.history or []), {"role": "user", "content": spec.prompt}]
    body = {**_openai_body(ep, spec), "messages": messages}
    def text_of(choice: dict) -> str | None:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        return None if not content and "role" in delta else content   # the role chunk is no token

    return await _request_openai(session, ep, spec, body, text_of)


async def request_interactive(session: aiohttp.ClientSession, ep: Endpoint, spec: RequestSpec) -> RequestResult:
    """One turn of a session: only the new user message; the answer's lines carry the counts."""
    body: dict[str, Any] = {"session_id": -1 if spec.session_id is None else spec.session_id, "prompt": spec.prompt,
                            "interactive_mode": not spec.last_turn, "stream": True,
                            "request_output_len": spec.output_len, "temperature": ep.temperature}
    if ep.model is not None:
        body["model"] = ep.model
    if ep.ignore_eos:
        body["ignore_eos"] = True
    body.update(ep.extra_body)
    last: dict[str, Any] = {}

    def handle(stream: _Stream, data: str) -> str | None:
        obj = json.loads(data)
        err = _error_text(obj)
        if err is not None:
            return err
        last.update(obj)
        stream.token_chunk(obj.get("text") or "")
        return "" if obj.get("finish_reason") is not None else None

    result = await _post_stream(session, ep, body, spec, handle, "the stream ended without a finish_reason",
                                framing=json_lines)
    if last:
        result.session_id = last.get("session_id")
        if result.success and isinstance(last.get("tokens"), int):
            result.output_tokens = last["tokens"]
        if isinstance(last.get("input_tokens"), int) and isinstance(last.get("history_tokens"), int):
            result.prompt_len = last["input_tokens"] + last["history_tokens"]
    return result


REQUEST_FUNCS: dict[str, Callable[[aiohttp.ClientSession, Endpoint, RequestSpec], Awaitable[RequestResult]]] = {
    "tgi": request_tgi, "openai": request_openai, "openai-chat": request_openai_chat, "interactive": request_interactive,
}


# -- load generation -------------------------------------------------------------------------
def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` requests: 0 for all when the rate is infinite,
    else a Poisson process: the first at 0, then exponential gaps of mean 1 / rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(request_rate)
        times.append(t)
    return times


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    # no overall timeout: a long benchmark's requests may legitimately queue for minutes
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=None)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit), read_bufsize=2**20)


async def run_requests(ep: Endpoint, specs: Sequence[RequestSpec], request_rate: float = math.inf,
                       max_concurrency: int | None = None, seed: int = 0,
                       progress: Callable[[int, int], None] | None = None,
                       session: aiohttp.ClientSession | None = None) -> tuple[list[RequestResult], float]:
    """Send ``specs`` at ``arrival_times``, at most ``max_concurrency`` in flight (they queue
    for a slot; TTFT and E2E count from the actual send). Returns the results in ``specs``'
    order, each ``start`` made relative to the run's start, and the duration (first send to
    last response)."""
    func = REQUEST_FUNCS[ep.backend]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    own_session = session is None
    session = session or new_session(limit=max_concurrency or 0)
    done = 0

    async def one(spec: RequestSpec) -> RequestResult:
        nonlocal done
        if sem is None:
            r = await func(session, ep, spec)
        else:
            async with sem:
                r = await func(session, ep, spec)
        done += 1
        if progress:
            progress(done, len(specs))
        return r

    try:
        t0 = time.perf_counter()
        tasks = []
        for spec, at in zip(specs, arrival_times(len(specs), request_rate, seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    finally:
        if own_session:
            await session.close()
    for r in results:
        r.start -= t0
    return list(results), duration


async def run_conversations(ep: Endpoint, conversations: Sequence[Sequence[RequestSpec]],
                            max_concurrency: int | None = None, progress: Callable[[int, int], None] | None = None,
                            session: aiohttp.ClientSession | None = None) -> tuple[list[RequestResult], float]:
    """Run the conversations side by side (at most ``max_concurrency`` at once), each one's turns
    one after the other: openai-chat turns carry the conversation so far (each answer as it came),
    interactive turns the session the first turn opened. A turn after a failed one is not sent
    (it fails too). Returns the turns' results, conversation by conversation, and the duration."""
    func = REQUEST_FUNCS[ep.backend]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    own_session = session is None
    session = session or new_session(limit=max_concurrency or 0)
    total, done = sum(len(c) for c in conversations), 0

    async def converse(turns: Sequence[RequestSpec]) -> list[RequestResult]:
        nonlocal done
        history: list[dict[str, str]] = []
        session_id: int | None = None
        results: list[RequestResult] = []
        for spec in turns:
            if results and not results[-1].success:
                results.append(RequestResult(error="an earlier turn of its conversation failed", prompt_len=spec.prompt_len,
                                             output_len=spec.output_len, turn=spec.turn))
                continue
            r = await func(session, ep, dataclasses.replace(spec, history=list(history), session_id=session_id))
            results.append(r)
            history += [{"role": "user", "content": spec.prompt}, {"role": "assistant", "content": r.text}]
            session_id = r.session_id
            done += 1
            if progress:
                progress(done, total)
        return results

    async def one(turns: Sequence[RequestSpec]) -> list[RequestResult]:
        if sem is None:
            return await converse(turns)
        async with sem:
            return await converse(turns)

    try:
        t0 = time.perf_counter()
        per_conversation = await asyncio.gather(*(one(c) for c in conversations))
        duration = time.perf_counter() - t0
    finally:
        if own_session:
            await session.close()
    results = [r for rs in per_conversation for r in rs]
    for r in results:
        r.start = r.start - t0 if r.start else 0.0
    return results, duration


async def prefix_cache_counters(session: aiohttp.ClientSession, base_url: str,
                                headers: dict[str, str] | None = None) -> dict[str, float] | None:
    """The server's prefix-cache token counters (summed over their labels), or None if it has none."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers or {}) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in PREFIX_CACHE_COUNTERS:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values if len(values) == len(PREFIX_CACHE_COUNTERS) else None


def prefix_cache_use(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Prompt tokens looked up in the prefix cache during the run, those found, and their ratio."""
    if before is None or after is None:
        return None
    queried_name, hit_name = PREFIX_CACHE_COUNTERS
    queried, hit = after[queried_name] - before[queried_name], after[hit_name] - before[hit_name]
    return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else math.nan}


# -- summary ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    out = {"mean": sum(values) / len(values) if values else math.nan}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(values, p)
    return out


def summarize(results: Sequence[RequestResult], duration: float,
              percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    metrics = {
        "ttft_ms": [r.ttft * 1e3 for r in ok],
        "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
        "itl_ms": [x * 1e3 for r in ok for x in r.itl],
        "e2e_ms": [r.latency * 1e3 for r in ok],
    }
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "requested_output_tokens": sum(r.output_len for r in ok),
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "input_throughput": total_in / duration if duration > 0 else math.nan,
        "output_throughput": total_out / duration if duration > 0 else math.nan,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else math.nan,
        **{name: stats(values, percentiles) for name, values in metrics.items()},
        **ttft_by_turn(ok, percentiles),
    }


def ttft_by_turn(ok: Sequence[RequestResult], percentiles: Sequence[float]) -> dict[str, Any]:
    """Multi-turn runs: TTFT statistics of each turn (0 first), under ``ttft_ms_by_turn``."""
    turns = sorted({r.turn for r in ok if r.turn is not None})
    if not turns:
        return {}
    return {"ttft_ms_by_turn": {str(t): stats([r.ttft * 1e3 for r in ok if r.turn == t], percentiles) for t in turns}}


def format_summary(summary: dict[str, Any], title: str, percentiles: Sequence[float] = (50, 90, 99)) -> str:
    lines = [f"### {title}", ""]
    kv = [
        ("requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("input tokens (total, tok/s)", f"{summary['total_input_tokens']}, {summary['input_throughput']:.1f}"),
        ("output tokens (total, tok/s)", f"{summary['total_output_tokens']}, {summary['output_throughput']:.1f}"),
        ("output tokens / requested", f"{summary['total_output_tokens']} / {summary['requested_output_tokens']}"),
        ("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
    ]
    width = max(len(k) for k, _ in kv)
    lines += [f"{k:<{width}}  {v}" for k, v in kv]
    headers = ["ms", "mean", *(f"p{p:g}" for p in percentiles)]
    rows = [[label, *(f"{summary[key][h]:.2f}" for h in ["mean", *(f"p{p:g}" for p in percentiles)])]
            for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))]
    lines += ["", _markdown_table(headers, rows)]
    if "ttft_ms_by_turn" in summary:
        by_turn = summary["ttft_ms_by_turn"]
        lines += ["", _markdown_table(["TTFT ms, turn", *headers[1:]],
                                      [[str(int(t) + 1), *(f"{by_turn[t][h]:.2f}" for h in ["mean", *(f"p{p:g}" for p in percentiles)])]
                                       for t in by_turn])]
    cache = summary.get("prefix_cache")
    if cache is not None:
        lines += ["", f"prefix cache: {cache['hit_tokens']:.0f} of {cache['queried_tokens']:.0f} prompt tokens found "
                      f"(hit rate {cache['hit_rate']:.3f})"]
    return "\n".join(lines)


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    # common.markdown_table's layout; common.py imports torch, which this client must not need
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda row: "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|",
                      *(line(r) for r in cells[1:])])


# -- workload --------------------------------------------------------------------------------
def token_count(tokenizer: Any, text: str) -> int:
    """Tokens of ``text`` as a server would prefill them (special tokens such as BOS included)."""
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def sample_lengths(n: int, mean_len: int, dist: str, range_ratio: float, rng: random.Random) -> list[int]:
    if dist == "fixed":
        return [mean_len] * n
    lo = max(1, math.floor(mean_len * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean_len * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class RandomPrompts:
    """Prompts of an exact token count made of random whole-word tokens of the vocabulary
    (byte-level BPE "Ġword" or SentencePiece "▁word"), so they decode to plain text that
    re-encodes to about as many tokens; the count is then fixed up by trimming or adding."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.words = [i for i, p in enumerate(pieces)
                      if i not in special and isinstance(p, str) and p[:1] in ("Ġ", "▁")
                      and len(p) >= 3 and p[1:].isascii() and p[1:].isalpha()]
        if len(self.words) < 100:  # some other vocabulary style: any plain-text token
            self.words = [i for i, p in enumerate(pieces) if i not in special and isinstance(p, str)
                          and p.isascii() and p.isalpha()]
        if not self.words:
            raise ValueError("found no plain-text tokens in the tokenizer's vocabulary")
        self.overhead = token_count(tokenizer, "")   # BOS and the like

    def make(self, n_tokens: int, rng: random.Random, tries: int = 8) -> tuple[str, int]:
        """(text, its token count), the count == ``n_tokens`` unless ``tries`` fix-ups miss."""
        target = max(1, n_tokens - self.overhead)
        ids = rng.choices(self.words, k=target)
        text = self.tok.decode(ids)
        for _ in range(tries):
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) == target:
                break
            if len(ids) > target:
                text = self.tok.decode(ids[:target])
            else:
                text = self.tok.decode(ids + rng.choices(self.words, k=target - len(ids)))
        return text, token_count(self.tok, text)


def random_requests(tokenizer: Any, n: int, input_len: int, output_len: int, dist: str = "fixed",
                    range_ratio: float = 0.0, seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    ins = sample_lengths(n, input_len, dist, range_ratio, rng)
    outs = sample_lengths(n, output_len, dist, range_ratio, rng)
    builder = RandomPrompts(tokenizer)
    specs = []
    for i, o in zip(ins, outs):
        text, count = builder.make(i, rng)
        specs.append(RequestSpec(text, count, o))
    return specs


def shared_prefix_requests(tokenizer: Any, n: int, prefix_len: int, input_len: int, output_len: int,
                           as_system: bool, seed: int = 0) -> list[RequestSpec]:
    """One random text of ``prefix_len`` tokens, then per request a random question of
    ``input_len``: joined as the prompt, or (``as_system``, the chat backend) the system message."""
    rng = random.Random(seed)
    builder = RandomPrompts(tokenizer)
    prefix, prefix_count = builder.make(prefix_len, rng)
    specs = []
    for _ in range(n):
        question, count = builder.make(input_len, rng)
        if as_system:
            specs.append(RequestSpec(question, prefix_count + count, output_len, system=prefix))
        else:
            specs.append(RequestSpec(prefix + question, token_count(tokenizer, prefix + question), output_len))
    return specs


def multi_turn_conversations(tokenizer: Any, n: int, turns: int, input_len: int, output_len: int,
                             seed: int = 0) -> list[list[RequestSpec]]:
    """``n`` conversations of ``turns`` random user messages of ``input_len`` tokens each."""
    rng = random.Random(seed)
    builder = RandomPrompts(tokenizer)
    return [[RequestSpec(*builder.make(input_len, rng), output_len, turn=t, last_turn=t == turns - 1)
             for t in range(turns)] for _ in range(n)]


def sharegpt_requests(path: str, tokenizer: Any, n: int, seed: int = 0,
                      output_len: int | None = None) -> list[RequestSpec]:
    """First human turn -> prompt; the gpt answer after it -> output length (``output_len``
    overrides it). Shuffled with ``seed``; too short / too long pairs skipped as vLLM does."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        for j, turn in enumerate(turns[:-1]):
            if turn.get("from") == "human":
                answer = turns[j + 1]
                if answer.get("from") == "gpt":
                    pairs.append((turn.get("value") or "", answer.get("value") or ""))
                break
    random.Random(seed).shuffle(pairs)
    specs: list[RequestSpec] = []
    for prompt, answer in pairs:
        if len(specs) == n:
            break
        p_len = token_count(tokenizer, prompt)
        o_len = output_len if output_len is not None else len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        if p_len < SHAREGPT_MIN_LEN or (output_len is None and o_len < SHAREGPT_MIN_LEN):
            continue
        if p_len > SHAREGPT_MAX_PROMPT or p_len + o_len > SHAREGPT_MAX_TOTAL:
            continue
        specs.append(RequestSpec(prompt, p_len, o_len))
    if len(specs) < n:
        print(f"note: {path} has only {len(specs)} usable conversations (asked for {n})", file=sys.stderr)
    return specs


def _parse_tokenize(obj: Any) -> int | None:
    if isinstance(obj, list):
        return len(obj)                                    # TGI: [{id, text, start, stop}, ...]
    if isinstance(obj, dict):
        if isinstance(obj.get("count"), int):
            return obj["count"]                            # vLLM: {"count", "tokens", ...}
        if isinstance(obj.get("tokens"), list):
            return len(obj["tokens"])
    return None


async def server_token_counts(session: aiohttp.ClientSession, base_url: str, prompts: Sequence[str],
                              headers: dict[str, str] | None = None, concurrency: int = 16) -> tuple[list[int] | None, str]:
    """Each prompt's token count from the server's ``POST /tokenize`` ({"inputs": text}), and ""; or
    None and why not (no such endpoint, an error, an answer of another shape)."""
    url = base_url.rstrip("/") + "/tokenize"
    sem = asyncio.Semaphore(concurrency)

    async def count(text: str) -> int:
        async with sem, session.post(url, json={"inputs": text}, headers=headers or {}) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            n = _parse_tokenize(await resp.json(content_type=None))
            if n is None:
                raise ValueError("an answer of unknown shape")
            return n

    try:
        first = await count(prompts[0])    # one probe before sending them all
        rest = await asyncio.gather(*(count(p) for p in prompts[1:]))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return None, f"POST {url}: {type(e).__name__}: {e}"
    return [first, *rest], ""


async def fetch_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    try:
        async with session.get(url, headers=headers or {}) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("endpoint")
    g.add_argument("--backend", choices=sorted(BACKEND_PATHS), default="tgi")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name for the OpenAI endpoints (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g = p.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals; inf (default): all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    g.add_argument("--warmup", type=int, default=1,
                   help="requests sent (and checked) before the timed run, not counted (default 1; 0: none)")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts, the lengths and the arrivals")
    g = p.add_argument_group("workload")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer directory (default: --model, or the server's model, if that is a local directory)")
    g.add_argument("--dataset", default=None, help="ShareGPT JSON file (default: random prompts)")
    g.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random prompts (default), shared-prefix (one common prefix, then a question each), or "
                        "multi-turn conversations (openai-chat or interactive)")
    g.add_argument("--shared-prefix-len", type=int, default=2000, help="shared-prefix: tokens of the common prefix")
    g.add_argument("--turns", type=int, default=5, help="multi-turn: turns per conversation")
    g.add_argument("--input-len", type=int, default=512, help="random prompts: tokens per prompt (default 512)")
    g.add_argument("--output-len", type=int, default=None,
                   help="tokens per answer (default 128; with --dataset: the answer's own length)")
    g.add_argument("--len-dist", choices=["fixed", "uniform"], default="fixed",
                   help="random prompts: lengths fixed, or uniform in [L*(1-r), L*(1+r)]")
    g.add_argument("--range-ratio", type=float, default=None, help="r for --len-dist uniform (default 0.5)")
    g.add_argument("--no-server-tokenize", action="store_true",
                   help="count prompt tokens with the local tokenizer even if the server has POST /tokenize")
    g = p.add_argument_group("generation")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (default: on for openai / openai-chat, off for tgi, whose API lacks it)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into the request body (tgi: into 'parameters')")
    g = p.add_argument_group("output")
    g.add_argument("--percentiles", default="50,90,99")
    g.add_argument("--result-file", default=None, help="write args, summary and per-request rows as JSON")
    g.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    if args.range_ratio is not None and args.len_dist != "uniform":
        p.error("--range-ratio needs --len-dist uniform")
    if args.range_ratio is None:
        args.range_ratio = 0.5 if args.len_dist == "uniform" else 0.0
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (or inf)")
    if args.ignore_eos is None:
        args.ignore_eos = args.backend != "tgi"
    if args.workload != "random" and args.dataset:
        p.error(f"--workload {args.workload} makes its own prompts: it takes no --dataset")
    if args.backend == "interactive" and args.workload != "multi-turn":
        p.error("--backend interactive runs --workload multi-turn only")
    if args.workload == "multi-turn" and args.backend not in ("openai-chat", "interactive"):
        p.error("--workload multi-turn needs --backend openai-chat or interactive")
    if args.turns < 1 or args.shared_prefix_len < 1:
        p.error("--turns and --shared-prefix-len must be at least 1")
    return args


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _progress(quiet: bool, label: str) -> Callable[[int, int], None] | None:
    if quiet:
        return None
    step = [0]

    def report(done: int, total: int) -> None:
        tenth = done * 10 // total
        if tenth > step[0] or done == total:
            step[0] = tenth
            print(f"  {label}: {done}/{total}", file=sys.stderr)
    return report


async def amain(args: argparse.Namespace) -> int:
    ep = Endpoint(args.backend, args.base_url, args.model, args.api_key, args.ignore_eos, args.temperature, args.extra_body)
    percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    # Three sessions, so that no pooled keep-alive connection outlives the blocking work in between
    # (loading the tokenizer, building prompts): the server may close it meanwhile, unseen by the
    # blocked event loop, and the next POST on it would fail with "Server disconnected".
    async with new_session() as session:
        # the model's name (OpenAI) and, failing --tokenizer, a local directory holding its tokenizer:
        # /v1/models' id (and vLLM's / llmserve's "root"), TGI's /info model_id (and llmserve's model_path)
        server_model, candidates = None, [args.model]
        if args.backend != "tgi" or not args.tokenizer:
            models = await fetch_json(session, ep.base_url.rstrip("/") + "/v1/models", ep.headers())
            if isinstance(models, dict) and models.get("data"):
                server_model = models["data"][0].get("id")
                candidates += [server_model, models["data"][0].get("root")]
            if not args.tokenizer:
                info = await fetch_json(session, ep.base_url.rstrip("/") + "/info", ep.headers())
                if isinstance(info, dict):
                    candidates += [info.get("model_id"), info.get("model_path")]
    if args.backend != "tgi" and ep.model is None:
        if server_model is None:
            raise SystemExit(f"GET {ep.base_url}/v1/models named no model; pass --model")
        ep.model = server_model
    tok_path = args.tokenizer or next((c for c in candidates if isinstance(c, str) and Path(c).is_dir()), None)
    if tok_path is None:
        raise SystemExit("pass --tokenizer DIR (the server names no local model directory)")
    tokenizer = load_tokenizer(tok_path)

    output_len = args.output_len
    conversations: list[list[RequestSpec]] | None = None
    if args.dataset:
        specs = sharegpt_requests(args.dataset, tokenizer, args.num_prompts, args.seed, output_len)
    elif args.workload == "shared-prefix":
        specs = shared_prefix_requests(tokenizer, args.num_prompts, args.shared_prefix_len, args.input_len,
                                       output_len or 128, args.backend == "openai-chat", args.seed)
    elif args.workload == "multi-turn":
        conversations = multi_turn_conversations(tokenizer, args.num_prompts, args.turns, args.input_len,
                                                 output_len or 128, args.seed)
        specs = [s for c in conversations for s in c]
    else:
        specs = random_requests(tokenizer, args.num_prompts, args.input_len, output_len or 128,
                                args.len_dist, args.range_ratio, args.seed)
    if not specs:
        raise SystemExit("no requests to send")

    async with new_session() as session:
        counted_by = "local tokenizer"
        if not args.no_server_tokenize and args.workload == "random":   # the others' prompts are not sent whole
            counts, why_not = await server_token_counts(session, ep.base_url, [s.prompt for s in specs], ep.headers())
            if counts is None:
                print(f"note: prompt tokens counted locally; {why_not}", file=sys.stderr)
            else:
                counted_by = "server /tokenize"
                diffs = [c - s.prompt_len for c, s in zip(counts, specs)]
                if any(diffs):
                    print(f"note: the server counts {sum(d != 0 for d in diffs)} of {len(specs)} prompts differently "
                          f"from the local tokenizer (mean {sum(diffs) / len(diffs):+.2f} tokens); its counts are used",
                          file=sys.stderr)
                for s, c in zip(specs, counts):
                    s.prompt_len = c
        print(f"{len(specs)} requests: {sum(s.prompt_len for s in specs)} prompt tokens ({counted_by}), "
              f"{sum(s.output_len for s in specs)} output tokens asked for; {ep.backend} at {ep.url}"
              + (f", model {ep.model}" if ep.model else ""), file=sys.stderr)

        if args.warmup > 0:
            # a multi-turn run's first turns: each its session's last, so that none stays open
            warm = [dataclasses.replace(specs[i % len(specs)], last_turn=True) for i in range(args.warmup)]
            results, _ = await run_requests(ep, warm, max_concurrency=args.max_concurrency, session=session)
            bad = [r for r in results if not r.success]
            if bad:
                raise SystemExit(f"warm-up: {len(bad)} of {len(results)} requests failed, e.g.: {bad[0].error}")
            print(f"warm-up: {len(results)} request(s) ok", file=sys.stderr)

    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    print(f"sending {len(specs)} requests, rate {rate} req/s, max concurrency {args.max_concurrency or 'none'}",
          file=sys.stderr)
    async with new_session() as session:
        counters_before = await prefix_cache_counters(session, ep.base_url, ep.headers())
    if conversations is not None:
        results, duration = await run_conversations(ep, conversations, args.max_concurrency,
                                                    _progress(args.quiet, "turns done"))
    else:
        results, duration = await run_requests(ep, specs, args.request_rate, args.max_concurrency, args.seed,
                                               _progress(args.quiet, "done"))
    async with new_session() as session:
        counters_after = await prefix_cache_counters(session, ep.base_url, ep.headers())
    summary = summarize(results, duration, percentiles)
    summary["prefix_cache"] = prefix_cache_use(counters_before, counters_after)

    errors = Counter(r.error for r in results if not r.success)
    for err, n in errors.most_common(5):
        print(f"failed x{n}: {err}", file=sys.stderr)
    workload = {"random": "", "shared-prefix": f", shared prefix of {args.shared_prefix_len} tokens",
                "multi-turn": f", {len(conversations or [])} conversations of {args.turns} turns"}[args.workload]
    title = (f"Serving: {ep.backend}{workload}, {len(specs)} requests, rate {rate} req/s, "
             f"max concurrency {args.max_concurrency or 'none'}")
    print()
    print(format_summary(summary, title, percentiles))

    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "serving",
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "host": platform.node(),
            "args": vars(args),
            "model": ep.model,
            "tokenizer": tok_path,
            "prompt_tokens_counted_by": counted_by,
            "summary": summary,
            "requests": [r.row() for r in results],
        }
        path.write_text(json.dumps(_json_safe(payload), indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if summary["completed"] else 1


def _json_safe(obj: Any) -> Any:
    """Strict JSON: NaN (a metric with no samples) becomes null, an infinite rate "inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())

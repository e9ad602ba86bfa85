"""The router of the HTTP server: an asyncio task that drives an ``LLMEngine`` step by step.

Request handlers call :meth:`AsyncEngine.generate` and iterate the returned stream; the router
loop runs one engine step at a time on a thread of its own (a step blocks on the workers) and
hands each request its new token. The engine is only ever touched from the loop, between steps:
arrivals and aborts from handlers wait in two lists until the current step is over, so no lock
is needed and a step always sees a consistent batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llmserve.sampling_params import SamplingParams
from llmserve.server.metrics import ServerMetrics
from llmserve.engine.engine import LLMEngine
from llmserve.worker.protocol import WorkerError
from llmserve.engine.request import FinishReason, Request

logger = logging.getLogger(__name__)

# How often the idle loop, or a loop waiting on a long step, checks that the workers live.
_LIVENESS_INTERVAL_S = 0.5


class EngineError(RuntimeError):
    """The request could not complete: a worker died, or the server is shutting down."""


class RequestError(EngineError):
    """This request failed on its own (its parameters broke the sampler, its rows the forward,
    its tokens the detokenizer); the engine goes on serving the others."""


@dataclass
class TokenEvent:
    """One generated token, as a handler streams it."""
    token_id: int
    text: str                                  # text that became safe to show with this token (may be "")
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: FinishReason | None         # set on the request's last token


class RequestStream:
    """The tokens of one request, in order. Iterating raises ``EngineError`` if the engine fails."""

    def __init__(self, engine: AsyncEngine, request: Request):
        self.request = request
        self._engine = engine
        self._queue: asyncio.Queue[TokenEvent | EngineError] = asyncio.Queue()
        self.finished = False
        self.last_token_time: float | None = None   # for the inter-token latency metric

    @property
    def req_id(self) -> int:
        return self.request.req_id

    def _put(self, item: TokenEvent | EngineError) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, EngineError):
                self.finished = True
                raise item
            self.finished = item.finish_reason is not None
            yield item

    def abort(self) -> None:
        """Stop generating (the client went away); frees the request's KV slots at the next step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.req_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.on_fatal = on_fatal            # the server exits when the engine cannot go on
        self.error: BaseException | None = None
        self._streams: dict[int, RequestStream] = {}
        self._arrivals: list[RequestStream] = []
        self._aborts: list[int] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-step")
        self._task: asyncio.Task | None = None
        if metrics is not None:
            sched = engine.scheduler
            metrics.track_engine(lambda: sched.num_waiting, lambda: sched.num_running,
                                 lambda: sched.num_used_slots, engine.info.max_total_token_num)
            metrics.healthy.set(1)

    # -- handler side ------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request. ``ValueError`` (a client error) if it can never run; ``EngineError``
        if the engine is down."""
        if self.error is not None:
            raise EngineError(f"the engine has stopped: {self.error}")
        # Created now (its id and arrival time are the client's), queued between two steps.
        request = self.engine.new_request(prompt_token_ids, params)
        stream = RequestStream(self, request)
        self._streams[request.req_id] = stream
        self._arrivals.append(stream)
        self._wakeup.set()
        return stream

    def abort(self, req_id: int) -> None:
        if req_id in self._streams:
            self._aborts.append(req_id)
            self._wakeup.set()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self.engine.workers.alive()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="llmserve-router")

    def fail_all(self, message: str) -> None:
        """End every open request with an error (shutdown): each stream gets ``EngineError``."""
        for req_id, stream in list(self._streams.items()):
            stream._put(EngineError(message))
            self._aborts.append(req_id)
        self._wakeup.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    # -- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                self._apply_arrivals_and_aborts()
                if not self.engine.has_unfinished():
                    await self._in_thread(self.engine.flush)   # hand the workers the last frees
                    await self._idle()
                    continue
                updated = await self._step()
                self._publish(updated)
                await asyncio.sleep(0)   # let handlers run between steps even when steps are fast
        except asyncio.CancelledError:
            raise
        except BaseException as e:      # a worker died or fell out of step: nothing can run any more
            logger.error("the engine failed: %s", e)
            self.error = e
            if self.metrics is not None:
                self.metrics.healthy.set(0)
            self.fail_all(f"the engine failed: {e}")
            if self.on_fatal is not None:
                self.on_fatal(e)

    async def _step(self) -> list[Request]:
        """One engine step. The engine ends a request that fails on its own; what it raises
        beyond a worker's failure is tied to no request (a bug of ours), and costs the requests
        in flight, not the server."""
        try:
            return await self._in_thread(self.engine.step)
        except (WorkerError, EngineError):
            raise
        except Exception as e:
            logger.exception("an engine step failed; ending the requests in flight")
            self.fail_all(f"the engine step failed: {e}")
            return []

    async def _idle(self) -> None:
        """Wait for work, checking now and then that the workers are still there."""
        while not (self._arrivals or self._aborts):
            self._check_workers()
            try:
                await asyncio.wait_for(self._wakeup.wait(), _LIVENESS_INTERVAL_S)
            except TimeoutError:
                pass
            self._wakeup.clear()

    async def _in_thread(self, fn: Callable):
        """Run a blocking engine call off the event loop; if a worker dies meanwhile (in TP the
        others may then wait in a collective forever), fail instead of waiting for the call."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        while True:
            done, _ = await asyncio.wait({future}, timeout=_LIVENESS_INTERVAL_S)
            if done:
                return future.result()
            self._check_workers()

    def _check_workers(self) -> None:
        if not self.engine.workers.alive():
            codes = [c.proc.poll() for c in self.engine.workers.clients]
            raise EngineError(f"a model worker exited (exit codes {codes})")

    def _apply_arrivals_and_aborts(self) -> None:
        arrivals, self._arrivals = self._arrivals, []
        for stream in arrivals:
            if stream.finished:           # aborted before it was ever queued
                self._streams.pop(stream.req_id, None)
                continue
            self.engine.enqueue(stream.request)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(stream.request.num_prompt_tokens)
        aborts, self._aborts = self._aborts, []
        for req_id in aborts:
            self.engine.abort_request(req_id)
            self._streams.pop(req_id, None)

    def _publish(self, updated: list[Request]) -> None:
        now = time.monotonic()
        for req in updated:
            stream = self._streams.get(req.req_id)
            if stream is None:           # aborted while the step ran
                continue
            if req.error is not None:
                stream._put(RequestError(f"the request failed: {req.error}"))
                self._streams.pop(req.req_id, None)
                continue
            event = TokenEvent(
                token_id=req.output_token_ids[-1], text=req.take_stream_delta(),
                logprob=req.output_logprobs[-1] if req.output_logprobs else None,
                top_logprobs=req.output_top_logprobs[-1] if req.output_top_logprobs else None,
                finish_reason=req.finish_reason,
            )
            self._observe_latency(stream, now)
            stream._put(event)
            if req.is_finished:
                self._streams.pop(req.req_id, None)

    def _observe_latency(self, stream: RequestStream, now: float) -> None:
        if self.metrics is None:
            return
        req = stream.request
        self.metrics.generated_tokens.inc()
        if stream.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival_time)
        else:
            self.metrics.itl.observe(now - stream.last_token_time)
        stream.last_token_time = now
        if req.is_finished:
            self.metrics.e2e.observe(now - req.arrival_time)

"""The engine core: an ``LLMEngine`` driven step by step, fed by the HTTP process over one socket.

The loop, on one thread: take what the HTTP process sent (new requests, aborts), run one engine
step, send back one ``EngineOutputs`` with every request's delta of that step. While there is
nothing to run it waits on the socket, checking now and then that the workers live.

A step runs on a helper thread only so that the loop can notice a dead worker while it waits
(in TP the surviving ranks may wait in a collective forever), and answer the HTTP process's
``Ping`` (``/health``) at once however long the step takes; it keeps whatever else arrives
until the step is done, so the engine is never touched by two threads at once. A step that
hangs is the workers' deadline's to catch (``ModelWorkerGroup.step_timeout``).

The core deals in token ids only: the HTTP process detokenizes, matches stop strings and aborts
a request whose stop string it found (``llmserve.output``). So this process needs no tokenizer,
and imports neither torch nor transformers (its workers do).
"""

from __future__ import annotations

import logging
import pickle
import select
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from llmserve.engine.config import ModelSpec
from llmserve.engine.engine import LLMEngine
from llmserve.engine.messages import (
    AbortRequests, AddRequest, EndSession, EngineDead, EngineOutputs, EngineReady, EngineStats, FrameBuffer, Ping,
    LoraUpdated, Pong, Shutdown, StartEngine, StartupFailed, StepFailed, UpdateLora, encode,
)
from llmserve.engine.request import FinishReason, Request, RequestDelta
from llmserve.engine.worker_client import ModelWorkerGroup
from llmserve.ipc import error_line, socket_path
from llmserve.worker.protocol import WorkerError

logger = logging.getLogger(__name__)

# How often the idle loop, or a loop waiting on a long step, checks that the workers live.
LIVENESS_INTERVAL_S = 0.5
_RECV_BYTES = 1 << 20

T = TypeVar("T")


class HungUp(Exception):
    """The HTTP process closed its end: it is gone or done with us."""


class EngineCore:
    def __init__(self, engine: LLMEngine, sock: socket.socket):
        self.engine = engine
        self.sock = sock
        self._frames = FrameBuffer()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-step")
        self._last_stats: EngineStats | None = None
        self._inbox: list[object] = []     # what arrived while a step ran, handled once it is done

    def run(self) -> None:
        """Serve until ``Shutdown`` or the HTTP process hangs up. A worker's failure raises
        ``WorkerError``, after the HTTP process was told (``EngineDead``)."""
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not busy:
                    self._in_thread(self.engine.flush)   # hand the workers the last frees
                    self._check_workers()
                messages, self._inbox = self._inbox, []
                messages += self._receive(timeout=0 if busy or messages else LIVENESS_INTERVAL_S)
                for message in messages:
                    if isinstance(message, Shutdown):
                        return
                    self._handle(message)
                deltas = self._step() if self.engine.has_unfinished() else None
                self._send_outputs(deltas)
        except HungUp:
            return
        except WorkerError as e:
            logger.error("the engine failed: %s", e)
            self._try_send(EngineDead(str(e)))
            raise
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- from the HTTP process -----------------------------------------------------------
    def _receive(self, timeout: float) -> list[object]:
        """What the HTTP process sent, waiting up to ``timeout`` for it; its pings are answered."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return []
        data = self.sock.recv(_RECV_BYTES)
        if not data:
            raise HungUp
        # Each frame holds what the HTTP process sent in one turn of its event loop.
        messages = [message for frame in self._frames.feed(data) for message in frame]
        if any(isinstance(message, Ping) for message in messages):
            self._send(Pong())
        return [message for message in messages if not isinstance(message, Ping)]

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            for req_id in message.req_ids:
                self.engine.abort_request(req_id)
        elif isinstance(message, EndSession):
            self.engine.end_session(message.session_id)
        elif isinstance(message, UpdateLora):
            self._update_lora(message)
        else:
            raise TypeError(f"unexpected message from the HTTP process: {type(message).__name__}")

    def _add(self, message: AddRequest) -> None:
        # Admitted by check_request at the API edge; the engine only asserts, and a failed
        # assertion here is a bug of ours that costs this request only.
        req = Request(message.req_id, message.prompt_token_ids, message.params, pixel_values=message.pixel_values,
                      session_id=message.session_id, lora_name=message.lora_name)
        try:
            self.engine.enqueue(req)
        except Exception as e:
            logger.exception("request %d could not be queued", req.req_id)
            self._send(EngineOutputs([RequestDelta(req.req_id, None, finish_reason=FinishReason.ERROR,
                                                   error=error_line(e))], self._stats()))

    def _update_lora(self, message: UpdateLora) -> None:
        try:
            if message.path is None:
                self.engine.unload_lora(message.name)
            else:
                self.engine.load_lora(message.name, message.path)
        except KeyError:
            self._send(LoraUpdated(message.call_id, f"LoRA adapter {message.name!r} is not loaded", not_found=True))
        except ValueError as e:       # AdapterLoadError included: the adapter cannot be served
            self._send(LoraUpdated(message.call_id, error_line(e)))
        else:
            self._send(LoraUpdated(message.call_id))

    # -- one step ------------------------------------------------------------------------
    def _step(self) -> list[RequestDelta]:
        """One engine step and what it did to each request. What the step raises beyond a worker's
        failure is tied to no request (a bug of ours) and costs the requests in flight, not the
        engine."""
        try:
            deltas = self._in_thread(self.engine.step)
        except WorkerError:
            raise
        except Exception as e:
            logger.exception("an engine step failed; ending the requests in flight")
            req_ids = list(self.engine.requests)
            for req_id in req_ids:
                self.engine.abort_request(req_id)
            self._send(StepFailed(req_ids, f"the engine step failed: {e}"))
            return []
        return deltas

    def _in_thread(self, fn: Callable[[], T]) -> T:
        future = self._executor.submit(fn)
        while True:
            try:
                return future.result(timeout=LIVENESS_INTERVAL_S)
            except TimeoutError:
                self._check_workers()
                self._inbox += self._receive(timeout=0)

    def _check_workers(self) -> None:
        if (failure := self.engine.workers.failure()) is not None:
            raise WorkerError(failure)

    # -- to the HTTP process -------------------------------------------------------------
    def _stats(self) -> EngineStats:
        s = self.engine.scheduler
        e = self.engine
        return EngineStats(num_waiting=s.num_waiting, num_running=s.num_running, num_used_slots=s.num_used_slots,
                           num_preemptions=s.num_preemptions, num_prefill_tokens=e.num_prefill_tokens,
                           num_draft_tokens=e.num_draft_tokens, num_accepted_tokens=e.num_accepted_tokens,
                           accepted_length_counts=tuple(e.accepted_length_counts),
                           num_cached_slots=s.num_cached_slots, num_cache_queried_tokens=s.prefix_cache.num_queried_tokens,
                           num_cache_hit_tokens=s.prefix_cache.num_hit_tokens, num_loras_resident=len(s.loras.resident))

    def _send_outputs(self, deltas: list[RequestDelta] | None) -> None:
        """One message per step; between steps, only when the stats changed (an abort, say)."""
        stats = self._stats()
        if deltas is not None or stats != self._last_stats:
            step_tokens = self.engine.last_step_num_tokens if deltas is not None else 0
            self._send(EngineOutputs(deltas or [], stats, step_tokens))
            self._last_stats = stats

    def _send(self, message: object) -> None:
        try:
            self.sock.sendall(encode(message))
        except OSError:
            raise HungUp from None

    def _try_send(self, message: object) -> None:
        try:
            self._send(message)
        except HungUp:
            pass


# -- the process -----------------------------------------------------------------------------

def serve(address: str) -> int:
    """The engine-core process's life: read what to run from stdin (the HTTP process writes a
    ``StartEngine`` there as it starts us, and the ``ModelSpec`` once it has checked the model),
    start the workers, build the engine, then accept the HTTP process on ``address`` and serve
    it. Returns the exit code."""
    try:
        start = pickle.load(sys.stdin.buffer)
    except EOFError:
        return 1            # the HTTP process went away before it said what to run
    assert isinstance(start, StartEngine), start
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path(address))
    listener.listen(1)      # the HTTP process may connect now; it waits for EngineReady
    engine: LLMEngine | None = None
    workers: ModelWorkerGroup | None = None
    first: object | None = None
    try:
        workers = ModelWorkerGroup.of(start.config)     # they import torch while we wait for the model
        model = pickle.load(sys.stdin.buffer)
        assert isinstance(model, ModelSpec), model
        engine = LLMEngine(start.config, model, workers)
        first = EngineReady(engine.info, engine.config, engine.model, engine.summary())
        logger.info("engine ready: %s", first.summary)
    except EOFError:
        pass                # the HTTP process gave up on the model (it failed its checks) or died
    except Exception as e:
        first = StartupFailed(_picklable(e))
    if engine is None and workers is not None:
        workers.close()
    if first is None:
        return 1
    sock, _ = listener.accept()
    listener.close()
    try:
        with sock:
            sock.sendall(encode(first))
            if engine is None:
                return 1
            EngineCore(engine, sock).run()
            return 0
    except WorkerError:
        return 1
    finally:
        if engine is not None:
            engine.shutdown()


def _picklable(e: BaseException) -> BaseException:
    """The exception itself (the HTTP process re-raises it: a ModelLoadError stays one), or its
    line in a RuntimeError if it cannot cross the socket."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(error_line(e))


"""The engine core: an ``LLMEngine`` driven step by step, fed by the HTTP process over one socket.

The loop, on one thread: take what the HTTP process sent (new requests, aborts), run one engine
step, send back one ``EngineOutputs`` with every request's delta of that step. While there is
nothing to run it waits on the socket, checking now and then that the workers live.

With ``--api-server-count N`` there are N HTTP processes, each with its own connection (a
``Client``): a request's deltas go back on the connection it came on, an abort touches only
that connection's requests, and an HTTP process that hangs up loses its requests while the others
are served on. Only the launcher (the first) says ``Shutdown``.

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
    LoraChanged, LoraUpdated, Pong, Shutdown, StartEngine, StartupFailed, StepFailed, UpdateLora, encode,
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
    """Every HTTP process closed its end: they are gone or done with us."""


class Client:
    """One HTTP process's connection (``--api-server-count`` gives several): the bytes of a frame
    not yet whole, and which requests are its own (their deltas go back to it only)."""

    def __init__(self, sock: socket.socket, index: int):
        self.sock = sock
        self.index = index
        self.frames = FrameBuffer()
        self.req_ids: set[int] = set()


class EngineCore:
    def __init__(self, engine: LLMEngine, *socks: socket.socket):
        """``socks``: one connected socket per HTTP process, the launcher's first."""
        self.engine = engine
        self.clients = [Client(sock, i) for i, sock in enumerate(socks)]
        self._owners: dict[int, Client] = {}     # request id -> the connection it came on
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-step")
        self._last_stats: EngineStats | None = None
        self._num_output_tokens = 0       # EngineStats.num_output_tokens
        # what arrived while a step ran, handled once it is done
        self._inbox: list[tuple[Client, object]] = []

    def run(self) -> None:
        """Serve until ``Shutdown`` or every HTTP process hangs up. A worker's failure raises
        ``WorkerError``, after the HTTP processes were told (``EngineDead``)."""
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not busy:
                    self._in_thread(self.engine.flush)   # hand the workers the last frees
                    self._check_workers()
                messages, self._inbox = self._inbox, []
                messages += self._receive(timeout=0 if busy or messages else LIVENESS_INTERVAL_S)
                for client, message in messages:
                    if isinstance(message, Shutdown):
                        return
                    self._handle(message, client)
                deltas = self._step() if self.engine.has_unfinished() else None
                self._send_outputs(deltas)
        except HungUp:
            return
        except WorkerError as e:
            logger.error("the engine failed: %s", e)
            for client in list(self.clients):
                self._try_send(EngineDead(str(e)), client)
            raise
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- from the HTTP processes ---------------------------------------------------------
    def _receive(self, timeout: float) -> list[tuple[Client, object]]:
        """What the HTTP processes sent, waiting up to ``timeout`` for it; their pings are answered."""
        ready, _, _ = select.select([client.sock for client in self.clients], [], [], timeout)
        received = []
        for client in [client for client in self.clients if client.sock in ready]:
            try:
                data = client.sock.recv(_RECV_BYTES)
            except OSError:
                data = b""
            if not data:
                self._hang_up(client)
                continue
            # Each frame holds what the HTTP process sent in one turn of its event loop.
            messages = [message for frame in client.frames.feed(data) for message in frame]
            if any(isinstance(message, Ping) for message in messages):
                self._send(Pong(), client)
            received += [(client, message) for message in messages if not isinstance(message, Ping)]
        return received

    def _hang_up(self, client: Client) -> None:
        """An HTTP process closed its end. Its requests are aborted (no one would read their
        tokens) and the others are served on: whether the server goes on without it is the
        launcher's call (it stops the whole server, and then says Shutdown). With none left,
        ``HungUp``."""
        if client not in self.clients:
            return                      # told already (a failed send, then its EOF)
        self.clients.remove(client)
        self._inbox = [(sender, message) for sender, message in self._inbox if sender is not client]
        for req_id in client.req_ids:
            self.engine.abort_request(req_id)
            del self._owners[req_id]
        if not self.clients:
            raise HungUp
        # info, not warning: at a clean shutdown every HTTP process but the launcher leaves this way
        logger.info("connection %d (an HTTP process) hung up; %d request(s) of its aborted", client.index,
                    len(client.req_ids))

    def _handle(self, message: object, client: Client) -> None:
        if isinstance(message, AddRequest):
            self._add(message, client)
        elif isinstance(message, AbortRequests):
            for req_id in message.req_ids:
                if self._owners.get(req_id) is client:    # never another HTTP process's request
                    self._forget(req_id)
                    self.engine.abort_request(req_id)
        elif isinstance(message, EndSession):
            self.engine.end_session(message.session_id)
        elif isinstance(message, UpdateLora):
            self._update_lora(message, client)
        else:
            raise TypeError(f"unexpected message from the HTTP process: {type(message).__name__}")

    def _add(self, message: AddRequest, client: Client) -> None:
        # Admitted by check_request at the API edge; the engine only asserts, and a failed
        # assertion here is a bug of ours that costs this request only.
        req = Request(message.req_id, message.prompt_token_ids, message.params, pixel_values=message.pixel_values,
                      session_id=message.session_id, lora_name=message.lora_name)
        try:
            if req.req_id in self._owners:
                raise ValueError(f"request id {req.req_id} is in use (HTTP processes must number apart)")
            self.engine.enqueue(req)
        except Exception as e:
            logger.exception("request %d could not be queued", req.req_id)
            self._send(EngineOutputs([RequestDelta(req.req_id, None, finish_reason=FinishReason.ERROR,
                                                   error=error_line(e))], self._stats()), client)
            return
        self._owners[req.req_id] = client
        client.req_ids.add(req.req_id)

    def _forget(self, req_id: int) -> Client | None:
        """The request is over for its HTTP process: its owner, no longer recorded."""
        client = self._owners.pop(req_id, None)
        if client is not None:
            client.req_ids.discard(req_id)
        return client

    def _update_lora(self, message: UpdateLora, client: Client) -> None:
        try:
            if message.path is None:
                self.engine.unload_lora(message.name)
            else:
                self.engine.load_lora(message.name, message.path)
        except KeyError:
            self._send(LoraUpdated(message.call_id, f"LoRA adapter {message.name!r} is not loaded", not_found=True),
                       client)
        except ValueError as e:       # AdapterLoadError included: the adapter cannot be served
            self._send(LoraUpdated(message.call_id, error_line(e)), client)
        else:
            self._send(LoraUpdated(message.call_id), client)
            for other in list(self.clients):
                if other is not client:
                    self._send(LoraChanged(message.name, message.path), other)

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
            failed: dict[Client, list[int]] = {}
            for req_id in list(self.engine.requests):
                self.engine.abort_request(req_id)
                if (client := self._forget(req_id)) is not None:
                    failed.setdefault(client, []).append(req_id)
            for client, req_ids in failed.items():
                self._send(StepFailed(req_ids, f"the engine step failed: {e}"), client)
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
                           num_cache_hit_tokens=s.prefix_cache.num_hit_tokens, num_loras_resident=len(s.loras.resident),
                           num_output_tokens=self._num_output_tokens)

    def _send_outputs(self, deltas: list[RequestDelta] | None) -> None:
        """One message per step to each HTTP process, with its own requests' deltas (and the
        stats, which every one shows); between steps, only when the stats changed (an abort, say)."""
        if deltas:
            self._num_output_tokens += sum(delta.token_id is not None for delta in deltas)
        stats = self._stats()
        if deltas is None and stats == self._last_stats:
            return
        self._last_stats = stats
        step_tokens = self.engine.last_step_num_tokens if deltas is not None else 0
        own: dict[Client, list[RequestDelta]] = {client: [] for client in self.clients}
        for delta in deltas or ():
            client = self._owners.get(delta.req_id)
            if client is None:          # aborted by its HTTP process while the step ran
                continue
            own[client].append(delta)
            if delta.finish_reason is not None:
                self._forget(delta.req_id)
        for client, client_deltas in own.items():
            self._send(EngineOutputs(client_deltas, stats, step_tokens), client)

    def _send(self, message: object, client: Client) -> None:
        try:
            client.sock.sendall(encode(message))
        except OSError:
            self._hang_up(client)       # its end is gone: as if we had read its EOF

    def _try_send(self, message: object, client: Client) -> None:
        try:
            self._send(message, client)
        except HungUp:
            pass


# -- the process -----------------------------------------------------------------------------

def serve(address: str) -> int:
    """The engine-core process's life: read what to run from stdin (the HTTP process writes a
    ``StartEngine`` there as it starts us, and the ``ModelSpec`` once it has checked the model),
    start the workers, build the engine, then accept the HTTP process (``--api-server-count``:
    each of them) on ``address`` and serve them. Returns the exit code."""
    try:
        start = pickle.load(sys.stdin.buffer)
    except EOFError:
        return 1            # the HTTP process went away before it said what to run
    assert isinstance(start, StartEngine), start
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path(address))
    listener.listen(start.num_clients)     # the HTTP process may connect now; it waits for EngineReady
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
    socks = _accept_clients(listener, first, start.num_clients if engine is not None else 1)
    listener.close()
    try:
        if engine is None or len(socks) < start.num_clients:
            return 1
        EngineCore(engine, *socks).run()
        return 0
    except WorkerError:
        return 1
    finally:
        for sock in socks:
            sock.close()
        if engine is not None:
            engine.shutdown()


def _accept_clients(listener: socket.socket, first: object, num_clients: int) -> list[socket.socket]:
    """Accept the HTTP processes, sending each ``first``. The launcher connects first (it starts
    the others once it has the core's answer); if it hangs up before the others have come (one of
    them died starting), the sockets so far: fewer than ``num_clients``."""
    sock, _ = listener.accept()
    socks = [sock]
    sock.sendall(encode(first))
    listener.settimeout(LIVENESS_INTERVAL_S)
    while len(socks) < num_clients:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            if _closed(socks[0]):
                break
            continue
        sock.settimeout(None)
        sock.sendall(encode(first))
        socks.append(sock)
    return socks


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (what it sent meanwhile stays to be read)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _picklable(e: BaseException) -> BaseException:
    """The exception itself (the HTTP process re-raises it: a ModelLoadError stays one), or its
    line in a RuntimeError if it cannot cross the socket."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(error_line(e))


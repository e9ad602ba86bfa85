"""The HTTP process's side of the engine core: start its process, then send it requests and
hand each request's tokens to the handler streaming them.

Handlers call :meth:`EngineClient.generate` and iterate the returned stream; a reader task on
the event loop takes the core's one message per step apart into per-request ``TokenEvent``s,
detokenizing each token and matching stop strings on the way (``ClientRequest.apply``); a
request that ends on a stop string is aborted in the core. Everything here runs on the event
loop (no thread), so the streams, the requests and the tokenizer they detokenize with need no
lock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.common.logs import status_logger
from llmserve.engine.config import EngineConfig, ModelSpec
from llmserve.engine.messages import (
    AbortRequests, AddRequest, EndSession, EngineDead, EngineOutputs, EngineReady, EngineStats, FrameBuffer, LoraChanged,
    LoraUpdated, Ping, Pong, Shutdown, StartEngine, StartupFailed, StepFailed, UpdateLora, encode, frame_size,
)
from llmserve.engine.request import FinishReason, RequestDelta
from llmserve.ipc import ABSTRACT_SOCKETS, socket_path
from llmserve.output import ClientRequest
from llmserve.sampling_params import SamplingParams
from llmserve.server.metrics import ServerMetrics
from llmserve.server.stats_log import StatsLog
from llmserve.worker.protocol import WorkerInfo

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

_POLL_S = 0.5           # how often a wait on the core's socket checks that the core lives
_STOP_TIMEOUT_S = 10.0  # for the core to shut its workers down and exit, before it is killed
# How long /health waits for the core's answer. It answers within one LIVENESS_INTERVAL_S even
# mid-step (core.py), so a longer silence means the core itself is stuck (or stopped).
HEALTH_PROBE_TIMEOUT_S = 5.0


class EngineError(RuntimeError):
    """The request could not complete: the engine core or a worker died, or the server is
    shutting down."""


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

    def __init__(self, engine: EngineClient, request: ClientRequest):
        self.request = request
        self._engine = engine
        self._queue: asyncio.Queue[TokenEvent | EngineError] = asyncio.Queue()
        self.finished = False
        # for /metrics: when its first and latest tokens came, and the engine's prefill time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.prefill_time: float | None = None
        self.lora_name: str | None = None     # its LoRA adapter (per-adapter counts)

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
        """Stop generating (the client went away); the core frees the request's KV slots at its
        next step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.req_id)

    def cancel(self, message: str) -> None:
        """Stop generating for the server's own reason (a session's turn cancelled): like ``abort``,
        and whoever reads the stream gets ``RequestError(message)`` rather than waiting on."""
        if not self.finished:
            self._engine.abort(self.req_id)
            self._put(RequestError(message))


# -- the process ---------------------------------------------------------------------------

class EngineCoreProcess:
    """``python -m llmserve.engine.core_main``: started with what to run on its stdin, so that its
    workers import torch while this process loads its tokenizer and checks the model (then
    ``start_model``); ``wait_ready`` connects and waits until the model is loaded (its workers are
    its children)."""

    def __init__(self, config: EngineConfig, log_level: str = "warning", env: dict[str, str] | None = None,
                 num_clients: int = 1):
        """``env``: variables to set in the core's environment (and so its workers': a data-parallel
        replica's ``CUDA_VISIBLE_DEVICES``); ``num_clients``: the HTTP processes that will connect
        (``--api-server-count``), this one first."""
        # The HTTP process's PID in the name tells whose core this is (ss -xlp; tests look for it).
        self._tmpdir = None if ABSTRACT_SOCKETS else tempfile.TemporaryDirectory(prefix="llmserve-")
        prefix = f"@llmserve-{os.getpid()}-{secrets.token_hex(4)}-" if self._tmpdir is None else self._tmpdir.name + "/"
        self._address = prefix + "core.sock"
        # A fresh interpreter, as for the workers: the parent's __main__ is never re-imported.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.engine.core_main", self._address, str(os.getpid()), log_level],
            stdin=subprocess.PIPE, env=None if env is None else {**os.environ, **env})
        self._send_on_stdin(StartEngine(config, num_clients))
        self.sock: socket.socket | None = None

    def start_model(self, model: ModelSpec) -> None:
        """The model the core loads, once this process has checked it (the core has started its
        workers meanwhile)."""
        self._send_on_stdin(model)
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def _send_on_stdin(self, message: object) -> None:
        try:
            self.proc.stdin.write(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            self.proc.stdin.flush()
        except OSError:
            pass        # it died already: wait_ready says so, with its exit code

    @property
    def address(self) -> str:
        """Where the core accepts its HTTP processes (``--api-server-count``: the others connect too)."""
        return self._address

    def wait_ready(self) -> EngineReady:
        """Connect, and wait until the core has loaded the model (however long that takes: a core
        that dies is noticed at once). Re-raises the core's start-up error."""
        try:
            self.sock = connect_to_core(self._address, self.check_alive)
            return receive_ready(self.sock, self.check_alive)
        except BaseException:
            self.stop(graceful=False)
            raise

    def check_alive(self, when: str, closed: bool = False) -> None:
        """``EngineError`` if the core has exited. ``closed``: the core closed its end, so it is on
        its way out: wait for its exit code."""
        if closed:
            self.proc.wait()
        if self.proc.poll() is not None:
            raise EngineError(f"the engine core exited {when} (exit code {self.proc.returncode})")

    def stop(self, graceful: bool = True) -> None:
        """Close our end (the core takes it for a shutdown) and wait for the core to exit."""
        if self.sock is not None:
            self.sock.close()
        else:
            graceful = False    # not connected: it cannot be told, and has nothing to finish
        if self.proc.poll() is None:
            if not graceful:
                self.proc.kill()
            try:
                self.proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()      # its workers follow it (they watch their parent)
                self.proc.wait()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()


def connect_to_core(address: str, check_alive: Callable[..., None]) -> socket.socket:
    """A connection to the engine core at ``address``. No deadline: a new interpreter importing
    torch on a busy machine can take minutes; ``check_alive(when)`` raises once the core is gone."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    while True:
        try:
            sock.connect(socket_path(address))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            check_alive("during start-up")
            time.sleep(0.05)


def receive_ready(sock: socket.socket, check_alive: Callable[..., None]) -> EngineReady:
    """The core's first message, however long loading the model takes; re-raises its start-up
    error. ``check_alive(when, closed=False)`` raises once the core is gone (``closed``: it
    closed its end)."""
    when = "while loading the model"
    frames = FrameBuffer()
    sock.settimeout(_POLL_S)
    while True:
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            check_alive(when)
            continue
        if not data:
            check_alive(when, closed=True)
            raise EngineError(f"the engine core closed its connection {when}")
        messages = frames.feed(data)
        if messages:
            break
    reply = messages[0]
    if isinstance(reply, StartupFailed):
        raise reply.error
    assert isinstance(reply, EngineReady), reply
    sock.settimeout(None)
    return reply


# -- the client ----------------------------------------------------------------------------

class EngineClient:
    """The engine as the API sees it. ``sock`` is connected to an engine core that has sent
    ``ready``; ``proc`` is its process (None: a core on a thread of this process, in tests).
    With ``--dp N`` there is one a replica, behind a ``DataParallelEngineClient``
    (``server/data_parallel.py``)."""

    def __init__(self, sock: socket.socket, ready: EngineReady, tokenizer, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None, proc: subprocess.Popen | None = None,
                 log_stats_interval: float = 0.0, replica: int = 0, api_server: int = 0, api_server_count: int = 1):
        """``log_stats_interval``: seconds between the status lines of a busy engine (0: none);
        ``replica``: its index among data-parallel replicas (its metrics' label); ``api_server``:
        this HTTP process's index among ``api_server_count`` (``--api-server-count``), which
        numbers its requests apart from the others'. Only the launcher (index 0) tells the core to
        shut down, and counts the engine's own counters in /metrics (every HTTP process gets the
        same stats)."""
        self.info: WorkerInfo = ready.info
        self.config: EngineConfig = ready.config
        self.model_path: str = ready.model.path
        self.summary: str = ready.summary
        self.tokenizer = tokenizer              # used on the event loop only: detokenizing, and the API's short texts
        self.metrics = metrics
        self.on_fatal = on_fatal                # the server exits when the engine cannot go on
        self.error: BaseException | None = None
        self.stats = EngineStats()              # the core's latest snapshot, for /metrics
        self.num_generated_tokens = 0           # handed to the requests since start
        self.num_requests = 0                   # generations queued since start
        self.replica = replica
        self.log_stats_interval = log_stats_interval
        self._sock = sock
        self._proc = proc
        self._streams: dict[int, RequestStream] = {}
        self.api_server = api_server
        self.api_server_count = api_server_count
        self._ids = itertools.count(api_server, api_server_count)     # ids apart from the other HTTP processes'
        self._on_lora_changed: Callable[[str, str | None], None] | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[object] = []         # messages of this turn of the loop (see _send)
        self._task: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self._probe: asyncio.Future[None] | None = None   # the Ping in flight, which every /health awaits
        self._lora_calls: dict[int, asyncio.Future[LoraUpdated]] = {}   # UpdateLora calls awaiting the core
        self._lora_call_ids = itertools.count()
        if metrics is not None:
            metrics.track_engine(replica, lambda: self.stats, self.info.max_total_token_num)
            metrics.healthy.set(1)

    # -- handler side ------------------------------------------------------------------
    def route(self, prompt_token_ids: list[int], session_id: str | None = None,
              lora_name: str | None = None) -> EngineClient:
        """The engine that runs a request with this prompt: with one replica, this one."""
        return self

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 pixel_values: list[np.ndarray] | None = None, session_id: str | None = None,
                 lora_name: str | None = None) -> RequestStream:
        """Queue a request that passed ``check_request`` (``ServerState.start_all``: the core trusts
        it); ``EngineError`` if the engine is down. ``pixel_values``: its images, preprocessed;
        ``session_id``: the interactive session whose turn it is (its tokens stay cached after it);
        ``lora_name``: its LoRA adapter (None: the base model)."""
        if self.error is not None:
            raise EngineError(f"the engine has stopped: {self.error}")
        stream = RequestStream(self, ClientRequest.start(next(self._ids), prompt_token_ids, params, self.tokenizer))
        self._streams[stream.req_id] = stream
        self._send(AddRequest(stream.req_id, stream.request.prompt_token_ids, params, pixel_values, session_id, lora_name))
        stream.lora_name = lora_name
        self.num_requests += 1
        if self.metrics is not None:
            self.metrics.observe_routed(self.replica)
            self.metrics.prompt_tokens.inc(stream.request.num_prompt_tokens)
            if lora_name is not None:
                self.metrics.observe_lora_started(lora_name, stream.request.num_prompt_tokens)
        return stream

    def abort(self, req_id: int) -> None:
        stream = self._streams.pop(req_id, None)
        if stream is not None:       # else it ended already (and was counted then)
            self._send(AbortRequests([req_id]))
            self._observe_end(stream, FinishReason.ABORT)

    def end_session(self, session_id: str) -> None:
        """The interactive session is over: the core unpins the tokens its last turn left cached."""
        if self.error is None:
            self._send(EndSession(session_id))

    @property
    def num_in_flight(self) -> int:
        """Generations queued and not yet ended (the router's measure of load)."""
        return len(self._streams)

    def replica_states(self) -> list[dict]:
        """What /info says of each data-parallel replica: here the one."""
        return [{"replica": self.replica, "requests": self.num_requests, "requests_in_flight": self.num_in_flight,
                 "running": self.stats.num_running, "waiting": self.stats.num_waiting,
                 "prefix_cache_queried_tokens": self.stats.num_cache_queried_tokens,
                 "prefix_cache_hit_tokens": self.stats.num_cache_hit_tokens}]

    @property
    def is_healthy(self) -> bool:
        return self.error is None and (self._proc is None or self._proc.poll() is None)

    async def unhealthy_reason(self, timeout: float = HEALTH_PROBE_TIMEOUT_S) -> str | None:
        """None if the engine is serving and its core answers a ping within ``timeout``; else why
        not (``/health``'s 503). Concurrent calls share one ping."""
        if not self.is_healthy:
            return str(self.error or "the engine core is not running")
        if self._probe is None:
            self._probe = asyncio.get_running_loop().create_future()
            self._send(Ping())
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), timeout)
        except TimeoutError:
            return f"the engine core has not answered for {timeout:g} s"
        return None if self.is_healthy else str(self.error)

    async def update_lora(self, name: str, path: str | None) -> LoraUpdated:
        """Load adapter ``name`` from ``path`` (None: unload it) in the engine; its answer."""
        if self.error is not None:
            raise EngineError(f"the engine has stopped: {self.error}")
        call_id = next(self._lora_call_ids)
        answer = self._lora_calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(UpdateLora(call_id, name, path))
        return await answer

    def server_generated_tokens(self) -> int:
        """Tokens the whole server streamed (its status line's count): this process's, or with
        several HTTP processes, the core's count (each process streams only its own)."""
        return self.num_generated_tokens if self.api_server_count == 1 else self.stats.num_output_tokens

    def watch_loras(self, on_changed: Callable[[str, str | None], None]) -> None:
        """Call ``on_changed(name, path)`` when another HTTP process loads adapter ``name`` from
        ``path`` (None: unloads it)."""
        self._on_lora_changed = on_changed

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._read(reader), name="llmserve-engine-client")
        if self.log_stats_interval > 0:
            self._stats_task = loop.create_task(
                log_stats(self.log_stats_interval, self.info.max_total_token_num, lambda: self.stats,
                          self.server_generated_tokens), name="llmserve-stats-log")

    def fail_all(self, message: str) -> None:
        """End every open request with an error (shutdown): each stream gets ``EngineError``."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(EngineError(message))
            self._observe_end(stream, FinishReason.ERROR)
        if streams:
            self._send(AbortRequests(list(streams)))

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._writer is not None:
            if self.api_server == 0:     # the others only hang up: the core serves on until the launcher's word
                self._send(Shutdown())
            self._flush()
            self._writer.close()
            try:
                await asyncio.wait_for(self._writer.wait_closed(), _POLL_S)
            except (TimeoutError, OSError):
                pass    # then the core sees our end close instead, which it takes for a shutdown too

    def _send(self, message: object) -> None:
        """Queue a message for the core. What the handlers send during one turn of the event
        loop leaves as one frame, so the core takes it in whole between two steps: the prompts
        and choices of one client request start in the same step, as they did in-process."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        # A core that is gone shows as EOF to the reader task, which fails everything then.
        messages, self._outbox = self._outbox, []
        if messages and self._writer is not None and not self._writer.is_closing():
            self._writer.write(encode(messages))

    # -- the core's messages -------------------------------------------------------------
    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header = await reader.readexactly(FrameBuffer.HEADER_SIZE)
                message = pickle.loads(await reader.readexactly(frame_size(header)))
                if isinstance(message, EngineOutputs):
                    self._publish(message)
                elif isinstance(message, StepFailed):
                    self._fail_requests(message.req_ids, message.error)
                elif isinstance(message, Pong):
                    self._answered()
                elif isinstance(message, LoraUpdated):
                    call = self._lora_calls.pop(message.call_id, None)
                    if call is not None and not call.done():
                        call.set_result(message)
                elif isinstance(message, LoraChanged):
                    if self._on_lora_changed is not None:
                        self._on_lora_changed(message.name, message.path)
                elif isinstance(message, EngineDead):
                    self._die(EngineError(message.error))
                    return
                else:
                    raise TypeError(f"unexpected message from the engine core: {type(message).__name__}")
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError):
            self._die(EngineError(f"the engine core exited (exit code {await self._exit_code()})"))
        except BaseException as e:      # a message we cannot read: nothing after it can be trusted
            logger.exception("reading from the engine core failed")
            self._die(e)

    async def _exit_code(self) -> int | None:
        """The core's exit code once its socket closed (the process may take a moment to go)."""
        if self._proc is None:
            return None
        for _ in range(40):
            if self._proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        return self._proc.poll()

    def _publish(self, outputs: EngineOutputs) -> None:
        self.stats = outputs.stats
        if self.metrics is not None and self.api_server == 0:
            self.metrics.observe_engine(outputs, self.replica)
        now = time.monotonic()
        for delta in outputs.deltas:
            stream = self._streams.get(delta.req_id)
            if stream is None:           # aborted while the step ran
                continue
            req = stream.request
            if req.apply(delta):         # it ended here (a stop string, text that will not decode): tell the core
                self._send(AbortRequests([req.req_id]))
            if req.error is not None:
                del self._streams[delta.req_id]
                stream._put(RequestError(f"the request failed: {req.error}"))
                self._observe_end(stream, FinishReason.ERROR)
                continue
            self.num_generated_tokens += 1
            self._observe_latency(stream, delta, now)
            stream._put(TokenEvent(delta.token_id, req.take_stream_delta(), delta.logprob, delta.top_logprobs, req.finish_reason))
            if req.is_finished:
                del self._streams[delta.req_id]

    def _answered(self) -> None:
        """The core answered the ping in flight (or, once the engine died, will not)."""
        if self._probe is not None and not self._probe.done():
            self._probe.set_result(None)
        self._probe = None

    def _fail_requests(self, req_ids: list[int], error: str) -> None:
        for req_id in req_ids:
            stream = self._streams.pop(req_id, None)
            if stream is not None:
                stream._put(EngineError(error))
                self._observe_end(stream, FinishReason.ERROR)

    def _die(self, error: BaseException) -> None:
        """The engine cannot go on (a worker or the core died): fail everything, stop the server."""
        logger.error("the engine failed: %s", error)
        self.error = error
        self._answered()     # a /health waiting on the core now answers with the error
        for call in self._lora_calls.values():
            if not call.done():
                call.set_exception(EngineError(f"the engine failed: {error}"))
        self._lora_calls.clear()
        if self.metrics is not None:
            self.metrics.healthy.set(0)
        self.fail_all(f"the engine failed: {error}")
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _observe_latency(self, stream: RequestStream, delta: RequestDelta, now: float) -> None:
        if self.metrics is None:
            return
        req = stream.request
        self.metrics.generated_tokens.inc()
        if stream.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival_time)
            self.metrics.observe_first_token(delta.queue_time, delta.prefill_time)
            stream.first_token_time, stream.prefill_time = now, delta.prefill_time
        else:
            self.metrics.itl.observe(now - stream.last_token_time)
        stream.last_token_time = now
        if req.is_finished:
            self.metrics.e2e.observe(now - req.arrival_time)
            self._observe_end(stream, req.finish_reason)

    def _observe_end(self, stream: RequestStream, reason: FinishReason) -> None:
        """A request's last word for /metrics: how it ended, its lengths, and (when it ran to
        its end) how long it decoded."""
        if self.metrics is None:
            return
        req = stream.request
        ran_out = reason not in (FinishReason.ABORT, FinishReason.ERROR) and stream.first_token_time is not None
        decode_time = stream.last_token_time - stream.first_token_time if ran_out else None
        self.metrics.observe_finished(reason, req.num_prompt_tokens, req.num_output_tokens, stream.prefill_time,
                                      decode_time)
        if stream.lora_name is not None:
            self.metrics.observe_lora_finished(stream.lora_name, req.num_output_tokens)


async def log_stats(interval: float, kv_total: int, stats: Callable[[], EngineStats],
                    num_generated_tokens: Callable[[], int]) -> None:
    """Log the status line of a busy engine every ``interval`` seconds (``StatsLog``), for ever."""
    log = StatsLog(kv_total, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        line = log.line(stats(), num_generated_tokens(), time.monotonic())
        if line is not None:
            status_logger().info(line.message, extra=line.fields)

"""``llmserve serve``: start the engine-core process (which loads the model in its workers; with
``--dp N``, one core a replica: server/data_parallel.py), then serve HTTP until told to stop.

Shutdown order on SIGINT / SIGTERM: every open request ends with an error event (so streams
close cleanly instead of being cut), uvicorn stops accepting and drains, then the engine core
is told to stop, and it stops its workers. If a worker or an engine core dies, a worker's
device fails, or a step hangs past --step-timeout, /health turns 503, open requests fail, and the
process exits non-zero rather than serving errors (or nothing) forever.

With ``--api-server-count N`` this process is HTTP process 0 of N (``api_servers.py`` says how the
others are started, stopped and watched); ``serve_api_server`` is each other one's life.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable

import uvicorn

from llmserve.chat_template import ChosenTemplate, load_chat_template
from llmserve.common.logs import adopt_library_logging, report_error, status_logger
from llmserve.engine.messages import EngineReady
from llmserve.generation_config import SamplingDefaults, load_sampling_defaults
from llmserve.server.api.app import create_app
from llmserve.server.api.state import ServerConfig, ServerState, default_model_name
from llmserve.server.api_servers import ApiServerProcesses, ApiServerSpec
from llmserve.server.metrics import ServerMetrics, use_shared_dir
from llmserve.server.data_parallel import DataParallelEngineClient, replica_env
from llmserve.server.engine_client import (
    EngineClient, EngineCoreProcess, EngineError, connect_to_core, receive_ready,
)
from llmserve.engine.config import EngineConfig, inspect_model, resolve_model_path
from llmserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down"
# uvicorn's wait for open connections after a signal; streams end well within it (see streaming.py).
GRACEFUL_SHUTDOWN_S = 5


class _Server(uvicorn.Server):
    """uvicorn, plus: fail open requests when a signal arrives, and say when it serves. With
    ``--api-server-count``, the launcher's also watches the other HTTP processes (``api_servers``)
    and stops them before its own engine client tells the core to stop; theirs leave SIGINT to
    the launcher (a terminal's Ctrl-C reaches every process; the launcher sends them SIGTERM)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient | DataParallelEngineClient,
                 on_started: Callable[[], None], api_servers: ApiServerProcesses | None = None,
                 handles_sigint: bool = True):
        super().__init__(config)
        self.engine = engine
        self.on_started = on_started
        self.api_servers = api_servers
        self.handles_sigint = handles_sigint
        self.exit_code = 0
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.Task | None = None     # watching api_servers (held: the loop keeps only a weak reference)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and not self.handles_sigint:
            return
        if not self.should_exit and self._loop is not None:
            # a signal handler runs between two bytecodes of the loop: queue the work on the loop
            self._loop.call_soon_threadsafe(self.engine.fail_all, SHUTDOWN_MESSAGE)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it has shut down, so SIGTERM would kill
        # the process (exit -15, skipping run_server's cleanup) and SIGINT would exit 130. A
        # stop on a signal is a clean shutdown here: run() returns and the process exits 0.
        self._captured_signals.clear()

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            if self.api_servers is not None:
                self._watch = self._loop.create_task(self.api_servers.watch(self._api_server_exited))
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        if self.api_servers is not None:
            # The others drain their streams before this process's lifespan closes its engine
            # client, which tells the core to stop.
            await asyncio.get_running_loop().run_in_executor(None, self.api_servers.stop)
        await super().shutdown(sockets)

    def stop_with_error(self, error: BaseException) -> None:
        """The server cannot go on (a worker, an engine core or an HTTP process died): exit non-zero."""
        if self.error is None:
            self.error = error
        self.exit_code = 1
        self.should_exit = True

    def _api_server_exited(self, error: EngineError) -> None:
        logger.error("%s", error)
        self.engine.fail_all(f"the server is stopping: {error}")
        self.stop_with_error(error)


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound now: a busy port fails in a second, not after a minute of loading the
    model, and nothing started meanwhile (the workers' rendezvous, gloo's pairs) can take the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def describe_template(state: ServerState) -> str:
    chosen = state.chat_template
    if chosen is None:
        return "none (chat requests are refused; see --chat-template)"
    return chosen.name if chosen.source in ("registry", "tokenizer") else f"{chosen.name} ({chosen.source})"


def run_server(engine_config: EngineConfig, config: ServerConfig, log_level: str = "warning",
               log_stats_interval: float = 0.0) -> int:
    """Serve until stopped; the exit code. Logging is the caller's to configure
    (``llmserve.common.logs``): uvicorn's records go through it too. With
    ``config.api_server_count`` > 1 this process is HTTP process 0 of several (``api_servers.py``)."""
    # What can fail without the model fails before the (slow) model load.
    listen_socket = bind_listen_socket(config.host, config.port)
    cores: list[EngineCoreProcess] = []
    api_servers: ApiServerProcesses | None = None
    metrics_dir: str | None = None
    try:
        chat_template = load_chat_template(config.chat_template) if config.chat_template else None
        model_path = resolve_model_path(engine_config.model)
        sampling_defaults = load_sampling_defaults(config.generation_config, model_path)
        # Each data-parallel replica's core starts its workers (importing torch) meanwhile.
        dp, ranks = engine_config.dp, engine_config.world_size
        cores = [EngineCoreProcess(engine_config, log_level, env=replica_env(r, ranks) if dp > 1 else None,
                                   num_clients=config.api_server_count)
                 for r in range(dp)]
        tokenizer = load_tokenizer(model_path)      # this process's: the engine core has none
        adopt_library_logging()                     # loading it may have imported transformers
        model = inspect_model(engine_config, tokenizer)
        for core in cores:
            core.start_model(model)
        readies = [core.wait_ready() for core in cores]    # they load the model side by side
        if config.api_server_count > 1:
            # the HTTP processes' counts, summed at /metrics (this process's from now on too)
            metrics_dir = tempfile.mkdtemp(prefix="llmserve-metrics-")
            use_shared_dir(metrics_dir)
            api_servers = ApiServerProcesses(config, model_path, [core.address for core in cores], log_level,
                                             listen_socket)
        server = _build_server(config, [(core.sock, ready, core.proc) for core, ready in zip(cores, readies)],
                               tokenizer, chat_template, sampling_defaults, log_level, log_stats_interval,
                               api_servers)
        if api_servers is not None:
            def check_cores() -> None:
                for core in cores:
                    core.check_alive("while the HTTP processes started")

            api_servers.wait_ready(check_cores)     # the banner says the server serves: all of it
        server.run(sockets=[listen_socket])
        if server.exit_code:
            report_error(str(server.error))
        return server.exit_code
    finally:
        if api_servers is not None:
            api_servers.stop()
        for core in cores:
            core.stop()
        listen_socket.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def serve_api_server(spec: ApiServerSpec) -> int:
    """HTTP process ``spec.config.api_server`` (> 0) of ``--api-server-count``: connect to every
    engine core the launcher started, then serve the launcher's socket until it says stop."""
    config = spec.config
    listen_socket = socket.socket(fileno=spec.listen_fd)
    chat_template = load_chat_template(config.chat_template) if config.chat_template else None
    sampling_defaults = load_sampling_defaults(config.generation_config, spec.model_path)
    tokenizer = load_tokenizer(spec.model_path)
    adopt_library_logging()
    cores = []
    for address in spec.core_addresses:
        # Its life is the launcher's, which watches the cores: nothing to check here but the socket.
        sock = connect_to_core(address, lambda *_, **__: None)
        cores.append((sock, receive_ready(sock, lambda *_, **__: None), None))

    def started() -> None:
        os.write(spec.ready_fd, b"1")
        os.close(spec.ready_fd)

    server = _build_server(config, cores, tokenizer, chat_template, sampling_defaults, spec.log_level,
                           log_stats_interval=0.0, on_started=started)
    server.run(sockets=[listen_socket])
    if server.exit_code:
        report_error(str(server.error))
    return server.exit_code


def _build_server(config: ServerConfig, cores: list[tuple[socket.socket, EngineReady, subprocess.Popen | None]],
                  tokenizer, chat_template: ChosenTemplate | None, sampling_defaults: SamplingDefaults,
                  log_level: str, log_stats_interval: float, api_servers: ApiServerProcesses | None = None,
                  on_started: Callable[[], None] | None = None) -> _Server:
    """This HTTP process's engine client (one core, or ``--dp``'s), app and uvicorn server.
    ``cores``: each engine core's socket, ``EngineReady`` and process (None: not this process's
    child). The launcher (``config.api_server`` 0) logs the status lines and the banners."""
    first = cores[0][1]
    launcher = config.api_server == 0
    metrics = ServerMetrics(config.served_model_name or default_model_name(first.model.path),
                            max_total_token_num=first.info.max_total_token_num,
                            lora_names=list(first.config.lora_modules))
    server: _Server | None = None

    def on_fatal(error: BaseException) -> None:
        if server is not None:
            server.stop_with_error(error)

    where = dict(api_server=config.api_server, api_server_count=config.api_server_count)
    if len(cores) == 1:
        sock, ready, proc = cores[0]
        engine = EngineClient(sock, ready, tokenizer, metrics, on_fatal=on_fatal, proc=proc,
                              log_stats_interval=log_stats_interval, **where)
    else:
        engine = DataParallelEngineClient(cores, tokenizer, metrics, on_fatal=on_fatal,
                                          log_stats_interval=log_stats_interval, **where)
    state = ServerState(config, engine, metrics, chat_template, sampling_defaults)
    if launcher:
        status_logger().info("%s, max %d tokens per request, chat template: %s, sampling defaults: %s%s",
                             engine.summary, state.limits.max_model_len, describe_template(state),
                             sampling_defaults.summary(),
                             f", {config.api_server_count} HTTP processes" if config.api_server_count > 1 else "")
        banner = (f"llmserve: serving {state.model_name} on http://{config.host}:{config.port} "
                  f"(TGI: /generate, /generate_stream; OpenAI: /v1/completions, /v1/chat/completions"
                  f"{'; chat page: /' if config.ui else ''})")
        on_started = functools.partial(status_logger().info, banner)
    uv_config = uvicorn.Config(
        create_app(state), host=config.host, port=config.port, log_level=log_level,
        access_log=log_level in ("debug", "info"), timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        log_config=None,     # uvicorn's records go through our handler: timestamps, --log-format
    )
    server = _Server(uv_config, engine, on_started, api_servers, handles_sigint=launcher)
    # What start-up made (the tokenizer, the app, the model's description) lives as long
    # as the process: frozen, the collector's full passes, which the garbage of streaming
    # (objects a token) sets off, no longer walk it (one run under load: 5.88 -> 5.39 CPU-s
    # for 32k streamed tokens, within that machine's noise; benchmarks/frontend_cost.py).
    gc.freeze()
    return server

"""``llmserve serve``: start the engine-core process (which loads the model in its workers; with
``--dp N``, one core a replica: server/data_parallel.py), then serve HTTP until told to stop.

Shutdown order on SIGINT / SIGTERM: every open request ends with an error event (so streams
close cleanly instead of being cut), uvicorn stops accepting and drains, then the engine core
is told to stop, and it stops its workers. If a worker or an engine core dies, a worker's
device fails, or a step hangs past --step-timeout, /health turns 503, open requests fail, and the
process exits non-zero rather than serving errors (or nothing) forever.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import uvicorn

from llmserve.chat_template import load_chat_template
from llmserve.common.logs import adopt_library_logging, report_error, status_logger
from llmserve.generation_config import load_sampling_defaults
from llmserve.server.api.app import create_app
from llmserve.server.api.state import ServerConfig, ServerState, default_model_name
from llmserve.server.metrics import ServerMetrics
from llmserve.server.data_parallel import DataParallelEngineClient, replica_env
from llmserve.server.engine_client import EngineClient, EngineCoreProcess
from llmserve.engine.config import EngineConfig, inspect_model, resolve_model_path
from llmserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down"
# uvicorn's wait for open connections after a signal; streams end well within it (see streaming.py).
GRACEFUL_SHUTDOWN_S = 5


class _Server(uvicorn.Server):
    """uvicorn, plus: fail open requests when a signal arrives, and say where we listen."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient | DataParallelEngineClient, banner: str):
        super().__init__(config)
        self.engine = engine
        self.banner = banner
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame) -> None:
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
            status_logger().info(self.banner)

    def stop_with_error(self, error: BaseException) -> None:
        """The engine cannot go on (a worker or the engine core died): exit non-zero."""
        self.exit_code = 1
        self.should_exit = True


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
    (``llmserve.common.logs``): uvicorn's records go through it too."""
    # What can fail without the model fails before the (slow) model load.
    listen_socket = bind_listen_socket(config.host, config.port)
    cores: list[EngineCoreProcess] = []
    try:
        chat_template = load_chat_template(config.chat_template) if config.chat_template else None
        model_path = resolve_model_path(engine_config.model)
        sampling_defaults = load_sampling_defaults(config.generation_config, model_path)
        # Each data-parallel replica's core starts its workers (importing torch) meanwhile.
        dp, tp = engine_config.dp, engine_config.tp
        cores = [EngineCoreProcess(engine_config, log_level, env=replica_env(r, tp) if dp > 1 else None)
                 for r in range(dp)]
        tokenizer = load_tokenizer(model_path)      # this process's: the engine core has none
        adopt_library_logging()                     # loading it may have imported transformers
        model = inspect_model(engine_config, tokenizer)
        for core in cores:
            core.start_model(model)
        readies = [core.wait_ready() for core in cores]    # they load the model side by side
        metrics = ServerMetrics(config.served_model_name or default_model_name(model_path),
                                max_total_token_num=readies[0].info.max_total_token_num,
                                lora_names=list(engine_config.lora_modules))
        server: _Server | None = None

        def on_fatal(error: BaseException) -> None:
            if server is not None:
                server.stop_with_error(error)

        if dp == 1:
            engine = EngineClient(cores[0].sock, readies[0], tokenizer, metrics, on_fatal=on_fatal,
                                  proc=cores[0].proc, log_stats_interval=log_stats_interval)
        else:
            replicas = [(core.sock, ready, core.proc) for core, ready in zip(cores, readies)]
            engine = DataParallelEngineClient(replicas, tokenizer, metrics, on_fatal=on_fatal,
                                              log_stats_interval=log_stats_interval)
        state = ServerState(config, engine, metrics, chat_template, sampling_defaults)
        status_logger().info("%s, max %d tokens per request, chat template: %s, sampling defaults: %s",
                             engine.summary, state.limits.max_model_len, describe_template(state),
                             sampling_defaults.summary())
        banner = (f"llmserve: serving {state.model_name} on http://{config.host}:{config.port} "
                  f"(TGI: /generate, /generate_stream; OpenAI: /v1/completions, /v1/chat/completions"
                  f"{'; chat page: /' if config.ui else ''})")
        uv_config = uvicorn.Config(
            create_app(state), host=config.host, port=config.port, log_level=log_level,
            access_log=log_level in ("debug", "info"), timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            log_config=None,     # uvicorn's records go through our handler: timestamps, --log-format
        )
        server = _Server(uv_config, engine, banner)
        # What start-up made (the tokenizer, the app, the model's description) lives as long
        # as the process: frozen, the collector's full passes, which the garbage of streaming
        # (objects a token) sets off, no longer walk it (one run under load: 5.88 -> 5.39 CPU-s
        # for 32k streamed tokens, within that machine's noise; benchmarks/frontend_cost.py).
        gc.freeze()
        server.run(sockets=[listen_socket])
        if server.exit_code:
            report_error(str(engine.error))
        return server.exit_code
    finally:
        for core in cores:
            core.stop()
        listen_socket.close()

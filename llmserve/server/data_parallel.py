"""``llmserve serve --dp N``: N data-parallel replicas of the model behind one HTTP process.

Each replica is a whole engine: an engine-core process with its own ``--tp`` workers and its
own KV cache and prefix cache, and an ``EngineClient`` on this process's event loop. On GPUs,
replica r runs on devices r*tp .. r*tp+tp-1 of those this process sees (``replica_env``); on a
CPU every replica runs on the CPU. ``DataParallelEngineClient`` is the engine the API sees: it
sends each client request to one replica (``router.py`` says which), and answers /health,
/info, /metrics and LoRA updates for all of them. A stream belongs to its replica's client, so
an abort reaches the replica that runs it. A replica that dies ends the server, as a dead worker
does with one replica: its requests and every other replica's fail, and the server exits
non-zero naming the replica.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import subprocess
from collections.abc import Callable, Mapping

from llmserve.engine.messages import EngineReady, EngineStats, LoraUpdated
from llmserve.server.engine_client import HEALTH_PROBE_TIMEOUT_S, EngineClient, EngineError, log_stats
from llmserve.server.metrics import ServerMetrics
from llmserve.server.router import CacheAwareRouter


def replica_env(replica: int, tp: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment replica ``replica``'s engine core (and so its workers) adds: the GPUs it
    may see, devices r*tp .. r*tp+tp-1 of this process's (``CUDA_VISIBLE_DEVICES`` if set, else
    all, by index), ``tp`` being its ranks (tp x pp). Its workers then take cuda:0 .. cuda:tp-1 as
    with one replica. A CPU machine
    ignores the variable (and an empty one, which hides every GPU, stays empty)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = [str(i) for i in range((replica + 1) * tp)] if visible is None else [d for d in visible.split(",") if d]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[replica * tp : (replica + 1) * tp])}


class DataParallelEngineClient:
    """The engines of ``--dp N`` replicas as the API sees one (the surface of ``EngineClient``
    that the API uses). ``cores``: each replica's socket, ``EngineReady`` and process."""

    def __init__(self, cores: list[tuple[socket.socket, EngineReady, subprocess.Popen | None]], tokenizer,
                 metrics: ServerMetrics | None = None, on_fatal: Callable[[BaseException], None] | None = None,
                 log_stats_interval: float = 0.0, api_server: int = 0, api_server_count: int = 1):
        """``api_server``, ``api_server_count``: as ``EngineClient``'s. With several HTTP processes
        each has its own connection to every replica and routes with its own ``CacheAwareRouter``:
        the prefix-aware routing knows only the prompts this process sent."""
        # Each replica's status lines would interleave: one line for them all (``start``).
        self.replicas = [EngineClient(sock, ready, tokenizer, metrics, on_fatal=functools.partial(self._failed, r),
                                      proc=proc, replica=r, api_server=api_server, api_server_count=api_server_count)
                         for r, (sock, ready, proc) in enumerate(cores)]
        first = self.replicas[0]
        self.config, self.model_path, self.tokenizer = first.config, first.model_path, first.tokenizer
        # A request must fit every replica: the limits are the smallest KV cache's.
        self.info = min((r.info for r in self.replicas), key=lambda info: info.max_total_token_num)
        self.summary = f"{len(self.replicas)} data-parallel replicas, each {first.summary}"
        self.router = CacheAwareRouter(len(self.replicas), self.info.max_total_token_num)
        self.on_fatal = on_fatal
        self.error: BaseException | None = None
        self.log_stats_interval = log_stats_interval
        self._stats_task: asyncio.Task | None = None

    # -- handler side ------------------------------------------------------------------
    def route(self, prompt_token_ids: list[int], session_id: str | None = None,
              lora_name: str | None = None) -> EngineClient:
        """The replica that runs a request with this prompt (the router's rule); ``EngineError``
        if the engine is down."""
        if self.error is not None:
            raise EngineError(f"the engine has stopped: {self.error}")
        loads = [replica.num_in_flight for replica in self.replicas]
        return self.replicas[self.router.route(prompt_token_ids, loads, session_id, lora_name)]

    def end_session(self, session_id: str) -> None:
        replica = self.router.end_session(session_id)
        if replica is not None:
            self.replicas[replica].end_session(session_id)

    @property
    def is_healthy(self) -> bool:
        return self.error is None and all(replica.is_healthy for replica in self.replicas)

    async def unhealthy_reason(self, timeout: float = HEALTH_PROBE_TIMEOUT_S) -> str | None:
        """None if every replica serves and answers a ping within ``timeout``; else why the first
        one that does not, does not (a replica down is the server down: it is on its way out)."""
        if self.error is not None:
            return str(self.error)
        reasons = await asyncio.gather(*(replica.unhealthy_reason(timeout) for replica in self.replicas))
        return next((f"data-parallel replica {r}: {why}" for r, why in enumerate(reasons) if why is not None), None)

    async def update_lora(self, name: str, path: str | None) -> LoraUpdated:
        """Load (or unload) the adapter in every replica; the first refusal, else success. Every
        replica checks the same directory the same way, so they agree."""
        answers = await asyncio.gather(*(replica.update_lora(name, path) for replica in self.replicas))
        return next((answer for answer in answers if answer.error is not None), answers[0])

    def watch_loras(self, on_changed: Callable[[str, str | None], None]) -> None:
        for replica in self.replicas:    # each says so: on_changed must not mind hearing it dp times
            replica.watch_loras(on_changed)

    def replica_states(self) -> list[dict]:
        return [state for replica in self.replicas for state in replica.replica_states()]

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()
        if self.log_stats_interval > 0:
            kv_total = sum(replica.info.max_total_token_num for replica in self.replicas)
            self._stats_task = asyncio.get_running_loop().create_task(
                log_stats(self.log_stats_interval, kv_total, lambda: EngineStats.total([r.stats for r in self.replicas]),
                          lambda: sum(r.server_generated_tokens() for r in self.replicas)), name="llmserve-stats-log")

    def fail_all(self, message: str) -> None:
        for replica in self.replicas:
            replica.fail_all(message)

    async def close(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        await asyncio.gather(*(replica.close() for replica in self.replicas))

    def _failed(self, replica: int, error: BaseException) -> None:
        """Replica ``replica`` cannot go on (it failed its own requests already): fail the others'
        and stop the server, once."""
        if self.error is not None:
            return
        self.error = EngineError(f"data-parallel replica {replica}: {error}")
        self.fail_all(f"the engine failed: {self.error}")
        if self.on_fatal is not None:
            self.on_fatal(self.error)

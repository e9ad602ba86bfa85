"""Prometheus metrics of one server, in a registry of its own (several servers can live in one
test process without their series colliding).

The set mirrors vLLM's (``vllm:X`` is ``llmserve_X``, or the older name we had for the same
thing; the README's table maps them), and every series carries a ``model_name`` label, so
that vLLM's and TGI's dashboards port with a change of names: ``docker/grafana/llmserve.json``
is one ready to import. Per-request times come from the engine core with each request's first
token (``RequestDelta.queue_time``, ``prefill_time``) and from the HTTP process's own clock.

With ``--api-server-count N`` each HTTP process counts what it serves in files under a directory
the launcher makes (prometheus_client's multiprocess mode: ``use_shared_dir``), and any of them
answers /metrics with the sum of all; the engine's own counters are counted by the launcher alone
(every HTTP process gets the same stats), and the engine's gauges are read live, as with one.
"""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from llmserve.engine.messages import EngineOutputs, EngineStats
from llmserve.engine.request import FinishReason

# Latency buckets in seconds: TTFT spans a decode step (ms) to a long queue (tens of s).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# Between two tokens: a decode step (ms), or a long stall (a preemption, a burst of long prompts).
# Draft tokens accepted per verify: 0 up to --speculate (10 is TGI's and the seed's choice).
_ACCEPTED_LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32, 64)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5,
                5.0, 10.0, 20.0, 40.0, 60.0)
# A request's phases: a queue wait or a prefill (ms to minutes), a long generation (minutes).
_REQUEST_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                         480.0, 960.0, 1920.0)


def token_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the first at or beyond ``limit`` (vLLM's spacing for
    lengths)."""
    buckets = []
    for scale in itertools.count():
        for m in (1, 2, 5):
            buckets.append(m * 10**scale)
            if buckets[-1] >= limit:
                return tuple(buckets)


class RequestOutcome(str, enum.Enum):
    SUCCESS = "success"
    VALIDATION_ERROR = "validation_error"
    OVERLOADED = "overloaded"
    ABORTED = "aborted"        # the client went away before the end
    ERROR = "error"            # the engine failed (a worker died, the server shut down)


def use_shared_dir(path: str) -> None:
    """Count this process's metrics created from now on (and, through the environment, those of
    the processes it starts) in files under ``path``, which every HTTP process reads at /metrics."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    # prometheus_client picks its value class when imported, from this variable: pick again
    values.ValueClass = values.get_value_class()


class ServerMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", max_total_token_num: int = 1 << 20, lora_names: Iterable[str] = ()) -> None:
        """``max_total_token_num``: the KV pool, the most tokens a request or a step can have, which
        bounds the length histograms. ``lora_names``: the LoRA adapters served (a series each)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # What /metrics renders: this registry, or with several HTTP processes, the sum of their files
        # (this process's among them) beside this process's live engine gauges.
        self._exposed = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed)
        r, m, name = self.registry, ["model_name"], model_name

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, m, registry=r).labels(name)

        def gauge(metric: str, doc: str, multiprocess_mode: str) -> Gauge:
            return Gauge(metric, doc, m, registry=r, multiprocess_mode=multiprocess_mode).labels(name)

        def histogram(metric: str, doc: str, buckets) -> Histogram:
            return Histogram(metric, doc, m, buckets=buckets, registry=r).labels(name)

        # -- client requests, as the API answered them -------------------------------------
        self._requests = Counter("llmserve_requests", "Finished client requests by outcome.", [*m, "outcome"], registry=r)
        for outcome in RequestOutcome:
            self._requests.labels(name, outcome.value)   # every series exists from the start, at 0
        # the server's admitted generations (several HTTP processes: the sum of theirs)
        self.in_flight = gauge("llmserve_requests_in_flight",
                               "Generations being served now (a client request with several prompts or choices "
                               "counts each; --max-concurrent-requests bounds this).", "livesum")
        self.healthy = gauge("llmserve_healthy", "1 while every model worker is alive.", "livemin")

        # -- tokens --------------------------------------------------------------------------
        self.prompt_tokens = counter("llmserve_prompt_tokens", "Prompt tokens of admitted requests.")
        self.generated_tokens = counter("llmserve_generated_tokens", "Tokens generated.")
        self.iteration_tokens = histogram("llmserve_iteration_tokens",
                                          "Tokens fed by one engine step (decodes and prompt tokens).",
                                          token_buckets(max_total_token_num))
        self.request_prompt_tokens = histogram("llmserve_request_prompt_tokens", "Prompt length of finished generations.",
                                               token_buckets(max_total_token_num))
        self.request_generation_tokens = histogram("llmserve_request_generation_tokens",
                                                   "Tokens generated by finished generations.",
                                                   token_buckets(max_total_token_num))

        # -- per-token and per-request times -------------------------------------------------
        self.ttft = histogram("llmserve_time_to_first_token_seconds", "From arrival to the first generated token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("llmserve_inter_token_latency_seconds", "Between consecutive tokens of one request.",
                             _ITL_BUCKETS)
        self.e2e = histogram("llmserve_request_latency_seconds", "From arrival to the last token.", _REQUEST_TIME_BUCKETS)
        self.queue_time = histogram("llmserve_request_queue_time_seconds",
                                    "From arrival in the engine to the first scheduling.", _REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("llmserve_request_prefill_time_seconds",
                                      "From the first scheduling to the first token.", _REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("llmserve_request_decode_time_seconds", "From the first token to the last.",
                                     _REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("llmserve_request_inference_time_seconds",
                                        "From the first scheduling to the last token (prefill + decode).",
                                        _REQUEST_TIME_BUCKETS)
        self.time_per_output_token = histogram("llmserve_request_time_per_output_token_seconds",
                                               "Decode time over the tokens after the first, per generation.",
                                               _ITL_BUCKETS)
        self._finished = Counter("llmserve_request_finished", "Finished generations by finish reason.",
                                 [*m, "finish_reason"], registry=r)
        for reason in FinishReason:
            self._finished.labels(name, reason.value)

        # -- the engine's state: read live at each scrape (EngineGauges) -----------------------
        self._engine_gauges = EngineGauges(model_name)
        r.register(self._engine_gauges)
        if self._exposed is not r:
            self._exposed.register(self._engine_gauges)
        self.prefix_cache_queried = counter("llmserve_prefix_cache_queried_tokens",
                                            "Tokens of admitted requests looked up in the prefix cache.")
        self.prefix_cache_hits = counter("llmserve_prefix_cache_hit_tokens",
                                         "Tokens of admitted requests found in the prefix cache (not computed again).")
        self.preemptions = counter("llmserve_num_preemptions",
                                   "Requests taken out of the running batch to free KV cache (prefilled again later).")
        # -- speculation (--speculate) ------------------------------------------------------------
        self.spec_draft_tokens = counter("llmserve_spec_draft_tokens", "Prompt-lookup draft tokens verified.")
        self.spec_accepted_tokens = counter("llmserve_spec_accepted_tokens",
                                            "Draft tokens the model agreed with (emitted without a step of their own).")
        self.spec_wasted_tokens = counter("llmserve_spec_wasted_tokens",
                                          "Draft tokens the model rejected (verify rows computed for nothing).")
        self.spec_accepted_length = histogram("llmserve_spec_accepted_length",
                                              "Draft tokens accepted per verified draft (0 to --speculate).",
                                              _ACCEPTED_LENGTH_BUCKETS)
        # -- LoRA adapters (--lora-modules) -----------------------------------------------------
        self._lora_requests = Counter("llmserve_lora_requests", "Generations admitted with a LoRA adapter.",
                                      [*m, "lora_name"], registry=r)
        self._lora_prompt_tokens = Counter("llmserve_lora_prompt_tokens", "Prompt tokens of admitted generations, "
                                           "by LoRA adapter.", [*m, "lora_name"], registry=r)
        self._lora_generated_tokens = Counter("llmserve_lora_generated_tokens", "Tokens generated by finished "
                                              "generations, by LoRA adapter.", [*m, "lora_name"], registry=r)
        for lora in lora_names:
            for per_adapter in (self._lora_requests, self._lora_prompt_tokens, self._lora_generated_tokens):
                per_adapter.labels(name, lora)
        # -- data-parallel replicas (--dp) -------------------------------------------------------
        self._replica_requests = Counter("llmserve_replica_requests", "Generations routed to each data-parallel "
                                         "replica (one replica: all of them to replica 0).", [*m, "replica"], registry=r)
        self._replica_cache_hits = Counter("llmserve_replica_prefix_cache_hit_tokens", "Tokens of admitted requests "
                                           "found in each replica's prefix cache.", [*m, "replica"], registry=r)
        # Each engine's counts are totals since it started: per (counter, replica) the total as last
        # observed (``_count_growth``), and per replica the accepted-length histogram's counts per length.
        self._totals: dict[tuple[Counter, int], int] = {}
        self._accepted_length_counts: dict[int, tuple[int, ...]] = {}

    def track_engine(self, replica: int, stats: Callable[[], EngineStats], kv_total: int) -> None:
        """Read an engine's live state (its latest ``EngineStats``) at scrape time, so a gauge is
        never stale. With data-parallel replicas each engine is tracked, and the gauges add up."""
        self._engine_gauges.engines[replica] = (stats, kv_total)

    def observe_engine(self, outputs: EngineOutputs, replica: int = 0) -> None:
        """What one message of an engine core (data-parallel ``replica``) says beyond its requests'
        tokens."""
        if outputs.num_step_tokens:
            self.iteration_tokens.observe(outputs.num_step_tokens)
        stats = outputs.stats
        self._count_growth(self.preemptions, replica, stats.num_preemptions)
        self._count_growth(self.prefix_cache_queried, replica, stats.num_cache_queried_tokens)
        self._count_growth(self.prefix_cache_hits, replica, stats.num_cache_hit_tokens)
        self._count_growth(self.spec_draft_tokens, replica, stats.num_draft_tokens)
        self._count_growth(self.spec_accepted_tokens, replica, stats.num_accepted_tokens)
        self._count_growth(self.spec_wasted_tokens, replica, stats.num_draft_tokens - stats.num_accepted_tokens)
        self._count_growth(self._replica_cache_hits.labels(self.model_name, str(replica)), replica,
                           stats.num_cache_hit_tokens)
        self._observe_accepted_lengths(replica, stats)

    def observe_routed(self, replica: int) -> None:
        """A generation went to data-parallel ``replica``."""
        self._replica_requests.labels(self.model_name, str(replica)).inc()

    def observe_lora_started(self, lora_name: str, num_prompt_tokens: int) -> None:
        self._lora_requests.labels(self.model_name, lora_name).inc()
        self._lora_prompt_tokens.labels(self.model_name, lora_name).inc(num_prompt_tokens)

    def observe_lora_finished(self, lora_name: str, num_output_tokens: int) -> None:
        self._lora_generated_tokens.labels(self.model_name, lora_name).inc(num_output_tokens)

    def _count_growth(self, counter: Counter, replica: int, total: int) -> None:
        """Add to ``counter`` what an engine's ``total`` (a count since it started) grew by since
        its last message."""
        last = self._totals.get((counter, replica), 0)
        if total > last:
            counter.inc(total - last)
            self._totals[counter, replica] = total

    def _observe_accepted_lengths(self, replica: int, stats: EngineStats) -> None:
        """The verifies since the engine's last message, by draft tokens accepted, into the histogram."""
        before = self._accepted_length_counts.get(replica, ())
        for length, count in enumerate(stats.accepted_length_counts):
            for _ in range(count - (before[length] if length < len(before) else 0)):
                self.spec_accepted_length.observe(length)
        self._accepted_length_counts[replica] = stats.accepted_length_counts

    def observe_first_token(self, queue_time: float | None, prefill_time: float | None) -> None:
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        if prefill_time is not None:
            self.prefill_time.observe(prefill_time)

    def observe_finished(self, reason: FinishReason, num_prompt_tokens: int, num_output_tokens: int,
                         prefill_time: float | None, decode_time: float | None) -> None:
        """A generation ended (any way: its tokens ran out, the client left, it failed)."""
        self._finished.labels(self.model_name, reason.value).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        if decode_time is not None:
            self.decode_time.observe(decode_time)
            if prefill_time is not None:
                self.inference_time.observe(prefill_time + decode_time)
            if num_output_tokens > 1:
                self.time_per_output_token.observe(decode_time / (num_output_tokens - 1))

    def count(self, outcome: RequestOutcome) -> None:
        self._requests.labels(self.model_name, outcome.value).inc()

    def render(self) -> bytes:
        return generate_latest(self._exposed)


class EngineGauges:
    """The engines' state as gauges, read at scrape time from each engine's latest ``EngineStats``
    (a collector rather than ``Gauge``s: in multiprocess mode a gauge shows only what was written to
    its file, and these are the same in every HTTP process, which all get every step's stats)."""

    # name, help, the EngineStats field they add up
    _FIELDS = (
        ("llmserve_queue_size", "Requests waiting for admission (or re-admission after preemption).", "num_waiting"),
        ("llmserve_running_batch_size", "Requests in the running batch.", "num_running"),
        ("llmserve_kv_cache_slots_used", "KV-cache token slots held by running requests.", "num_used_slots"),
        ("llmserve_kv_cache_slots_cached", "KV-cache token slots held only by the prefix cache (evictable).",
         "num_cached_slots"),
        ("llmserve_lora_adapters_resident", "LoRA adapters in the device pool now.", "num_loras_resident"),
    )

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engines: dict[int, tuple[Callable[[], EngineStats], int]] = {}   # replica -> (its stats, its KV slots)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = [read() for read, _ in self.engines.values()]
        total = sum(kv for _, kv in self.engines.values())

        def family(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            return g

        for metric, doc, field in self._FIELDS:
            yield family(metric, doc, sum(getattr(s, field) for s in stats))
        yield family("llmserve_kv_cache_slots_total", "KV-cache token slots in the pool.", total)
        used = sum(s.num_used_slots for s in stats)
        yield family("llmserve_kv_cache_usage_ratio", "Share of the KV-cache token slots in use, 0 to 1.",
                     used / total if total else 0.0)

"""Prometheus metrics of one server, in a registry of its own (several servers can live in one
test process without their series colliding)."""

from __future__ import annotations

import enum
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets in seconds: TTFT spans a decode step (ms) to a long queue (tens of s).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)


class RequestOutcome(str, enum.Enum):
    SUCCESS = "success"
    VALIDATION_ERROR = "validation_error"
    OVERLOADED = "overloaded"
    ABORTED = "aborted"        # the client went away before the end
    ERROR = "error"            # the engine failed (a worker died, the server shut down)


class ServerMetrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmserve_requests", "Finished client requests by outcome.", ["outcome"], registry=r)
        self.prompt_tokens = Counter("llmserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generated_tokens = Counter("llmserve_generated_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("llmserve_time_to_first_token_seconds", "From arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llmserve_inter_token_latency_seconds", "Between consecutive tokens of one request.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("llmserve_request_latency_seconds", "From arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_size = Gauge("llmserve_queue_size", "Requests waiting for admission (or re-admission after preemption).", registry=r)
        self.batch_size = Gauge("llmserve_running_batch_size", "Requests in the running batch.", registry=r)
        self.kv_slots_used = Gauge("llmserve_kv_cache_slots_used", "KV-cache token slots held by running requests.", registry=r)
        self.kv_slots_total = Gauge("llmserve_kv_cache_slots_total", "KV-cache token slots in the pool.", registry=r)
        # set_function'ed by the server to its count of admitted generations
        self.in_flight = Gauge("llmserve_requests_in_flight",
                               "Generations being served now (a client request with several prompts or choices "
                               "counts each; --max-concurrent-requests bounds this).", registry=r)
        self.healthy = Gauge("llmserve_healthy", "1 while every model worker is alive.", registry=r)
        for outcome in RequestOutcome:
            self.requests.labels(outcome.value)   # every series exists from the start, at 0

    def track_engine(self, num_waiting: Callable[[], int], num_running: Callable[[], int],
                     kv_used: Callable[[], int], kv_total: int) -> None:
        """Read the engine's live state at scrape time, so a gauge is never stale."""
        self.queue_size.set_function(num_waiting)
        self.batch_size.set_function(num_running)
        self.kv_slots_used.set_function(kv_used)
        self.kv_slots_total.set(kv_total)

    def count(self, outcome: RequestOutcome) -> None:
        self.requests.labels(outcome.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

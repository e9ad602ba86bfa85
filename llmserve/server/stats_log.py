"""The periodic status line of a busy server (as vLLM's): every few seconds while the engine has
work, or had some since the last line, its prompt and generation throughput over the interval,
the requests running and waiting, the share of the KV cache in use, and the prefix cache's hit
rate over the interval (the looked-up prompt tokens it served). In JSON logs the numbers are
keys of the record too.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.engine.messages import EngineStats


@dataclass
class StatsLine:
    message: str
    fields: dict[str, float]     # the same numbers, for a JSON log record


class StatsLog:
    """Turns the engine's counters into rates between two calls of ``line``."""

    def __init__(self, kv_total: int, now: float):
        self.kv_total = kv_total
        self._last_time = now
        self._last_prefill_tokens = 0
        self._last_generated_tokens = 0
        self._last_cache_queried = self._last_cache_hits = 0

    def line(self, stats: EngineStats, num_generated_tokens: int, now: float) -> StatsLine | None:
        """The line for the interval that ends now; None when the engine was idle all of it."""
        prompt = stats.num_prefill_tokens - self._last_prefill_tokens
        generated = num_generated_tokens - self._last_generated_tokens
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time = now
        self._last_prefill_tokens, self._last_generated_tokens = stats.num_prefill_tokens, num_generated_tokens
        queried = stats.num_cache_queried_tokens - self._last_cache_queried
        hits = stats.num_cache_hit_tokens - self._last_cache_hits
        self._last_cache_queried, self._last_cache_hits = stats.num_cache_queried_tokens, stats.num_cache_hit_tokens
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        fields = {
            "prompt_throughput": round(prompt / elapsed, 1),         # tokens/s
            "generation_throughput": round(generated / elapsed, 1),  # tokens/s
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": round(stats.num_used_slots / self.kv_total, 4) if self.kv_total else 0.0,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_hit_rate": round(hits / queried, 4) if queried else 0.0,
        }
        message = (f"prompt throughput: {fields['prompt_throughput']:.1f} tokens/s, generation throughput: "
                   f"{fields['generation_throughput']:.1f} tokens/s, running: {stats.num_running} reqs, waiting: "
                   f"{stats.num_waiting} reqs, KV cache: {100 * fields['kv_cache_usage']:.1f}% used, "
                   f"preemptions: {stats.num_preemptions}, prefix cache hit rate: "
                   f"{100 * fields['prefix_cache_hit_rate']:.1f}%")
        return StatsLine(message, fields)

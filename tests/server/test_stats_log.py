"""The periodic status line of a busy server."""

from __future__ import annotations

from llmserve.engine.messages import EngineStats
from llmserve.server.stats_log import StatsLog


def test_rates_over_the_interval_and_nothing_when_idle():
    log = StatsLog(kv_total=1000, now=0.0)
    assert log.line(EngineStats(), num_generated_tokens=0, now=5.0) is None      # idle: no line
    busy = EngineStats(num_waiting=1, num_running=2, num_used_slots=250, num_preemptions=1, num_prefill_tokens=500,
                       num_cache_queried_tokens=800, num_cache_hit_tokens=300)
    line = log.line(busy, num_generated_tokens=100, now=10.0)
    assert line.fields == {"prompt_throughput": 100.0, "generation_throughput": 20.0, "num_running": 2,
                           "num_waiting": 1, "kv_cache_usage": 0.25, "num_preemptions": 1,
                           "prefix_cache_hit_rate": 0.375}
    assert "running: 2 reqs, waiting: 1 reqs, KV cache: 25.0% used" in line.message
    assert line.message.endswith("prefix cache hit rate: 37.5%")
    # the interval after the last request ended still gets its line (its tokens), then none
    done = EngineStats(num_prefill_tokens=500, num_preemptions=1, num_cache_queried_tokens=800, num_cache_hit_tokens=300)
    assert log.line(done, num_generated_tokens=110, now=15.0).fields["generation_throughput"] == 2.0
    assert log.line(done, num_generated_tokens=120, now=16.0).fields["prefix_cache_hit_rate"] == 0.0   # none queried
    assert log.line(done, num_generated_tokens=120, now=20.0) is None

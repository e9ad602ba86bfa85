"""Where each data-parallel replica runs (server/data_parallel.py), without a server; the replicas
end to end are tests/server/api/test_data_parallel.py."""

from __future__ import annotations

from llmserve.engine.messages import EngineStats
from llmserve.server.data_parallel import replica_env


def test_replica_r_takes_gpus_r_tp_to_r_tp_plus_tp_minus_1():
    assert [replica_env(r, 1, {}) for r in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    assert replica_env(1, 2, {})["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_replica_takes_its_share_of_the_gpus_this_process_sees():
    environ = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [replica_env(r, 2, environ)["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["4,5", "6,7"]
    assert replica_env(1, 1, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"})["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert replica_env(1, 1, {"CUDA_VISIBLE_DEVICES": ""})["CUDA_VISIBLE_DEVICES"] == ""    # none hidden stays none


def test_replicas_stats_add_up():
    total = EngineStats.total([EngineStats(num_running=2, accepted_length_counts=(1, 2)),
                               EngineStats(num_running=3, num_cache_hit_tokens=7, accepted_length_counts=(1, 0, 4))])
    assert total == EngineStats(num_running=5, num_cache_hit_tokens=7, accepted_length_counts=(2, 2, 4))

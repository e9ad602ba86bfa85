"""model_worker's choices made before a model exists: a CPU rank's threads."""

from __future__ import annotations

import os

import pytest

from llmserve.worker.model_worker import cpu_threads


def test_cpu_threads_are_the_operators_where_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(ranks_per_node=2) == 3


@pytest.mark.parametrize("value", [None, "", "0", "two"])
def test_cpu_threads_else_split_the_allowed_cores_between_the_ranks(monkeypatch: pytest.MonkeyPatch, value) -> None:
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))     # 6 of the machine's cores
    assert cpu_threads(ranks_per_node=1) == 6
    assert cpu_threads(ranks_per_node=4) == 1
    assert cpu_threads(ranks_per_node=8) == 1     # never none

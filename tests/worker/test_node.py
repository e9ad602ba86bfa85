"""Two "nodes" on one machine (gloo on the CPU; NCCL on two GPUs): the head (`llmserve serve --tp 2
--nnodes 2 --node-rank 0`) runs rank 0, and a headless node (`--node-rank 1 --headless`) runs
rank 1, meeting at the head's --dist-init-addr; or with `--pp 2` in place of `--tp 2`, a pipeline
stage on each node. Greedy tokens equal tp=1's; the head's stop ends the headless node; a
headless node's worker that dies ends the head with that error within 10 s; a node that never
comes fails the head's start with an error naming it. No process is left behind.

With two GPUs each "node" sees one of them (``CUDA_VISIBLE_DEVICES``), and NCCL is kept off
peer-to-peer copies and shared memory, so that its traffic goes over the host's network stack as
between two machines; the models run in fp32, where tp=2 and tp=1 pick the same tokens."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest
import torch

from llmserve import LLM, SamplingParams
from serving_utils import ServerProcess, child_pids, free_port, llmserve_command, pid_alive, wait_until

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
if GPUS == 1:
    pytest.skip("two nodes on one machine need the CPU (gloo) or two GPUs (NCCL)", allow_module_level=True)
# Each node's environment: on GPUs, its own GPU and NCCL over sockets (see the docstring).
NCCL_OVER_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
NODE_ENV = ([{"CUDA_VISIBLE_DEVICES": str(gpu), **NCCL_OVER_SOCKETS} for gpu in (0, 1)] if GPUS else [{}, {}])
DTYPE = ("--dtype", "float32") if GPUS else ()

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
NEW_TOKENS = 12


TP2 = ("--tp", "2")


def node_args(addr: str, node_rank: int, shape: tuple[str, ...] = TP2) -> list[str]:
    return [*shape, *DTYPE, "--nnodes", "2", "--node-rank", str(node_rank), "--dist-init-addr", addr]


def start_headless(addr: str, timeout: float = 300, shape: tuple[str, ...] = TP2) -> subprocess.Popen:
    return subprocess.Popen([*llmserve_command(), "serve", *node_args(addr, 1, shape), "--headless",
                             "--dist-timeout", str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **NODE_ENV[1]})


def greedy(url: str, prompt: str) -> list[int]:
    r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS,
                                                                            "details": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def all_pids(head: ServerProcess, headless: subprocess.Popen) -> list[int]:
    return [head.proc.pid, head.core_pid, *head.worker_pids, headless.pid, *child_pids(headless.pid)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[list[int]]:
    with LLM(tiny_llama_dir, dtype="float32") as tp1:
        outs = tp1.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
        return [o.token_ids for o in outs]


@pytest.mark.parametrize("shape", [TP2, ("--pp", "2")], ids=["tp2", "pp2"])
def test_two_nodes_give_tp1_tokens_and_stop_with_the_head(tiny_llama_dir, expected, shape):
    addr = f"127.0.0.1:{free_port()}"
    headless = start_headless(addr, shape=shape)
    try:
        with ServerProcess(tiny_llama_dir, *node_args(addr, 0, shape), env=NODE_ENV[0]) as head:
            assert len(head.worker_pids) == 1 and len(child_pids(headless.pid)) == 1   # rank 0 here, rank 1 there
            assert [greedy(head.url, p) for p in PROMPTS] == expected
            if shape != TP2:
                info = httpx.get(head.url + "/info").json()
                assert (info["tp"], info["pp"]) == (1, 2)
            pids = all_pids(head, headless)
            head.stop(signal.SIGINT)
        assert headless.wait(timeout=30) == 0, headless.stdout.read()
        wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every process of both nodes ends")
    finally:
        headless.kill()


def test_a_dead_headless_worker_ends_the_head_with_its_error(tiny_llama_dir):
    addr = f"127.0.0.1:{free_port()}"
    headless = start_headless(addr)
    try:
        head = ServerProcess(tiny_llama_dir, *node_args(addr, 0), env=NODE_ENV[0])
        pids = all_pids(head, headless)
        [follower] = child_pids(headless.pid)
        os.kill(follower, signal.SIGKILL)
        started = time.monotonic()
        code = head.proc.wait(timeout=30)
        assert time.monotonic() - started < 10
        assert code != 0
        assert "model worker rank 1 on node 1 exited (exit code -9)" in head.output(), head.output()
        assert headless.wait(timeout=10) == 1
        wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every process of both nodes ends")
    finally:
        headless.kill()


def test_a_missing_node_fails_the_head_and_a_missing_head_the_node(tiny_llama_dir):
    # A head with no node and a node with no head, side by side (at two addresses: they must not
    # meet); each mostly waits for its interpreters to start and then for its timeout.
    head_addr, node_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    head = subprocess.Popen([*llmserve_command(), "serve", "--model", tiny_llama_dir, "--port", str(free_port()),
                             *node_args(head_addr, 0), "--dist-timeout", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **NODE_ENV[0]})
    headless = start_headless(node_addr, timeout=2)
    try:
        _, head_err = head.communicate(timeout=300)
        out, _ = headless.communicate(timeout=120)
    finally:
        head.kill()
        headless.kill()
    assert head.returncode != 0
    assert f"rank 1 did not join at {head_addr} within 3 s (node 1 of 2" in head_err, head_err
    assert headless.returncode == 1
    assert f"the head's rendezvous at {node_addr} did not come up within 2 s" in out, out


def test_a_missing_stage_is_named_with_the_command_that_starts_it():
    """Rank 0 alone (no node joins): its error names the node and the --tp / --pp it must run."""
    from llmserve.worker import ranks
    from llmserve.worker.protocol import WorkerError, WorkerInitArgs

    addr = f"127.0.0.1:{free_port()}"
    args = WorkerInitArgs(model_path="", model_type="llama", rank=0, world_size=2, pp=2, device="cpu",
                          dist_init_addr=addr, nnodes=2, dist_timeout=0.5)
    with pytest.raises(WorkerError) as e:
        ranks.host(args)
    assert str(e.value) == (f"model rank 1 did not join at {addr} within 0.5 s (node 1 of 2: is `llmserve serve "
                            f"--headless --node-rank N --nnodes 2 --tp 1 --pp 2 --dist-init-addr {addr}` running "
                            "there?)")

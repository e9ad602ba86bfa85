"""The step's hand-off to the ranks, on its own (issue 34): what it costs the engine to get one
``StepInput`` to every tensor-parallel rank, before any forward runs.

What is measured, for decode steps of --batch-sizes requests (a pickled ``StepInput`` of that
many one-token entries) and --ranks ranks
  rpyc      the old way: one rpyc call per rank (each a worker process that unpickles the step
            and answers b""), issued together, waited for together
  channel   the new way: one rpyc call to rank 0, which hands the bytes to the other ranks in
            one gloo broadcast (``StepChannel``) and unpickles them; the others unpickle theirs
            and wait for the next. The call returns once rank 0 has broadcast and unpickled.
  Per step: the engine's wall time from sending to the answer, median of --steps.

Run:  python benchmarks/step_handoff.py --ranks 2,4 --batch-sizes 1,32,128
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import time

from common import markdown_table, remove_script_dir_from_sys_path

remove_script_dir_from_sys_path()

import rpyc  # noqa: E402
from rpyc.utils.factory import unix_connect  # noqa: E402

from llmserve.engine.worker_client import free_tcp_port  # noqa: E402
from llmserve.ipc import socket_path  # noqa: E402
from llmserve.worker.protocol import RPYC_CONFIG, BatchEntry, StepInput  # noqa: E402


def decode_step(batch: int) -> StepInput:
    return StepInput([BatchEntry(req_id=i, token_ids=[1000 + i], num_cached=600) for i in range(batch)], overlap=True)


# -- the processes ---------------------------------------------------------------------------

def serve(address: str, rank: int, world: int, addr: str) -> None:
    """One rank: rpyc server (mode rpyc, or rank 0 of mode channel) or a broadcast follower."""
    import torch.distributed as dist
    from rpyc.utils.server import OneShotServer

    from llmserve.common.distributed import StepChannel

    channel = None
    if world > 1:
        host, port = addr.split(":")
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        channel = StepChannel()
        if rank > 0:
            while step := channel.recv():
                pickle.loads(step)
            return

    class Rank(rpyc.Service):
        def exposed_step(self, step: bytes) -> bytes:
            if channel is not None:
                channel.send(step)
            pickle.loads(step)
            return b""

        def exposed_stop(self) -> None:
            if channel is not None:
                channel.send(b"")

    OneShotServer(Rank(), socket_path=socket_path(address), protocol_config=RPYC_CONFIG).start()


def connect(address: str) -> rpyc.Connection:
    for _ in range(600):
        try:
            return unix_connect(socket_path(address), config=RPYC_CONFIG)
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.1)
    raise RuntimeError("a rank did not come up")


def time_steps(conns: list[rpyc.Connection], step: StepInput, steps: int) -> float:
    calls = [rpyc.async_(c.root.step) for c in conns]
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        # pickled once per call, as ModelRpcClient.step does
        for r in [call(pickle.dumps(step)) for call in calls]:
            r.value
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e6


def run(mode: str, ranks: int, batches: list[int], steps: int) -> list[float]:
    tag = f"@llmserve-handoff-{os.getpid()}-{mode}-"
    addr = f"127.0.0.1:{free_tcp_port()}"
    procs = []
    for rank in range(ranks):
        world = ranks if mode == "channel" else 1
        procs.append(subprocess.Popen([sys.executable, __file__, "--serve", f"{tag}{rank}", str(rank), str(world), addr]))
    try:
        conns = [connect(f"{tag}{r}") for r in (range(ranks) if mode == "rpyc" else [0])]
        result = [time_steps(conns, decode_step(b), steps) for b in batches]
        for c in conns:
            c.root.stop()
            c.close()
        return result
    finally:
        for p in procs:
            p.wait(timeout=30)


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        address, rank, world, addr = sys.argv[2:]
        serve(address, int(rank), int(world), addr)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for mode in ("rpyc", "channel"):
            for b, us in zip(batches, run(mode, ranks, batches, args.steps)):
                rows.append([ranks, mode, b, len(pickle.dumps(decode_step(b))), f"{us:.0f}"])
    print(markdown_table(["ranks", "hand-off", "batch", "step bytes", "median µs per step"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A headless node: ``llmserve serve --headless --node-rank N``, this machine's share of a model
whose rank 0, engine and HTTP server run on the head.

It starts this node's ranks (followers, ``worker/ranks.py``), which meet rank 0 at the head's
``--dist-init-addr``, and watches them: a rank that dies is reported to the head through the
rendezvous' store (so that the head ends with that error, not its own broken collective) and the
node's other ranks are stopped; when the head stops, its ranks leave their loops and this process
exits with them. SIGINT / SIGTERM stop the node's ranks too.
"""

from __future__ import annotations

import logging
import signal
import time

from llmserve.engine.worker_client import start_followers, stop_process

logger = logging.getLogger(__name__)

_POLL_S = 0.25


class _Stop(Exception):
    pass


def _raise_stop(*_) -> None:
    raise _Stop


def run_node(world_size: int, nnodes: int, node_rank: int, dist_init_addr: str, join_timeout: float) -> int:
    """Run this node's ranks (of ``world_size`` = tp x pp over ``nnodes``) until the head stops (0)
    or one of them fails (1)."""
    from llmserve.common.distributed import Rendezvous
    from llmserve.worker.ranks import rendezvous_gone

    per = world_size // nnodes
    ranks = range(node_rank * per, (node_rank + 1) * per)
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    procs = start_followers(dist_init_addr, ranks, join_timeout)
    try:
        logger.warning("node %d of %d: ranks %d-%d waiting for the head at %s", node_rank, nnodes, ranks[0], ranks[-1],
                       dist_init_addr)
        rendezvous = Rendezvous.join(dist_init_addr, -1, join_timeout)
        while True:
            codes = {rank: proc.poll() for rank, proc in procs.items()}
            failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
            if failed:
                rank, code = next(iter(failed.items()))
                message = f"model worker rank {rank} on node {node_rank} exited (exit code {code})"
                logger.error("%s; stopping this node", message)
                _report(rendezvous, message)
                return 1
            if all(code == 0 for code in codes.values()):
                logger.warning("node %d: the head stopped; its ranks are done", node_rank)
                return 0
            if rendezvous_gone(rendezvous):
                logger.warning("node %d: the head is gone; stopping", node_rank)
                return 0
            time.sleep(_POLL_S)
    except _Stop:
        return 0
    except RuntimeError as e:      # the head never came up
        logger.error("node %d: %s", node_rank, e)
        return 1
    finally:
        for proc in procs.values():
            stop_process(proc)


def _report(rendezvous, message: str) -> None:
    try:
        rendezvous.fail(message)
    except Exception:       # the head is gone already
        pass

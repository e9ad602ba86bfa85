"""How the ranks of one model start together and stay together, over torch.distributed's store
(``common.distributed.Rendezvous``).

Rank 0 is the worker the engine talks to (over rpyc); it hosts the store at ``dist_init_addr``.
Every other rank, on the head or on another node (``llmserve serve --headless``), is a follower:
it connects to the store, says it joined, reads the ``WorkerInitArgs`` rank 0 publishes there,
loads its share of the model, says whether that worked, then runs the steps rank 0 hands over
(``ModelWorker.follow``) until rank 0 ends. A follower that fails reports why in the store before
it exits, so that rank 0 can tell the engine the cause rather than its own broken collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from llmserve.common.distributed import MissingRanks, Rendezvous
from llmserve.ipc import error_line
from llmserve.worker.protocol import WorkerError, WorkerInitArgs

logger = logging.getLogger(__name__)


def host(args: WorkerInitArgs) -> Rendezvous:
    """Rank 0: host the store, wait up to ``dist_timeout`` for every other rank to join, and
    publish what they load."""
    rendezvous = Rendezvous.host(args.dist_init_addr, args.world_size)
    others = list(range(1, args.world_size))
    try:
        rendezvous.wait_for("joined", others, args.dist_timeout)
    except MissingRanks as e:
        nodes = sorted({r // args.ranks_per_node for r in e.ranks})
        shape = f"--tp {args.tp}" + (f" --pp {args.pp}" if args.pp > 1 else "")
        where = (f" (node{'s' * (len(nodes) > 1)} {', '.join(map(str, nodes))} of {args.nnodes}: is `llmserve serve "
                 f"--headless --node-rank N --nnodes {args.nnodes} {shape} --dist-init-addr "
                 f"{args.dist_init_addr}` running there?)" if nodes != [0] else "")
        kind = "tensor-parallel" if args.pp == 1 else "model"
        raise WorkerError(f"{kind} rank{'s' * (len(e.ranks) > 1)} {', '.join(map(str, e.ranks))} did not join "
                          f"at {args.dist_init_addr} within {args.dist_timeout:g} s{where}") from None
    rendezvous.publish("init_args", args)
    return rendezvous


def wait_until_loaded(rendezvous: Rendezvous, args: WorkerInitArgs) -> None:
    """Rank 0, its own share loaded: wait for the others' (loading has no deadline), and fail
    with the first rank's error if any failed."""
    loaded = rendezvous.wait_for("loaded", list(range(1, args.world_size)), None)
    for rank, error in loaded.items():
        if error:
            raise WorkerError(f"model worker rank {rank} failed to load the model: {error.decode()}")


def follow(addr: str, rank: int, join_timeout: float) -> int:
    """A follower's life; its exit code."""
    from llmserve.worker.model_worker import ModelWorker

    rendezvous = Rendezvous.join(addr, rank, join_timeout)
    args = dataclasses.replace(rendezvous.read("init_args"), rank=rank)
    started = time.monotonic()
    try:
        worker = ModelWorker(args, rendezvous)
    except Exception as e:
        logger.exception("rank %d: loading the model failed", rank)
        rendezvous.report(rank, "loaded", error_line(e))
        return 1
    rendezvous.report(rank, "loaded", "")
    logger.info("rank %d: model loaded in %.1f s", rank, time.monotonic() - started)
    try:
        worker.follow()
    except Exception as e:
        if rendezvous_gone(rendezvous):
            logger.info("rank %d: rank 0 is gone; stopping", rank)
            return 0
        logger.exception("rank %d: a step failed; this rank cannot go on", rank)
        # Most often another rank's end failed our collective: its own report, due in a moment,
        # tells the cause better than ours.
        if rendezvous.failure(wait=1.0) is None:
                node = rank // args.ranks_per_node
                rendezvous.fail(f"model worker rank {rank} (node {node}) failed: {error_line(e)}")
        return 1
    return 0


def rendezvous_gone(rendezvous: Rendezvous) -> bool:
    """Whether rank 0 (the store's host) is gone: the head stopped."""
    try:
        rendezvous.failure()
    except Exception:
        return True
    return False


def exit_now(code: int) -> None:
    """Leave without torch's atexit teardown, which may wait on a peer that is gone."""
    logging.shutdown()
    os._exit(code)

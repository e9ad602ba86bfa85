"""The entry point of a model worker process, started by the engine core (``ModelWorkerGroup``)
or by a headless node (``worker/node.py``):

    python -m llmserve.worker.main ADDRESS PARENT_PID              rank 0: serve the engine over rpyc
    python -m llmserve.worker.main follow DIST_INIT_ADDR RANK JOIN_TIMEOUT PARENT_PID
                                                                    any other rank (see ranks.py)

Its first job, before the seconds it takes to import torch, is to tie its life to its parent's:
a worker outlives its parent only by accident (the parent was killed, maybe while this worker
was still starting or loading weights), and should then leave at once rather than hold a GPU and
memory forever. Only then does it import the model code and serve (``model_worker``).
"""

from __future__ import annotations

import sys

from llmserve.common.logs import configure_child_logging
from llmserve.common.process import exit_with_parent


def main(argv: list[str]) -> None:
    if argv[0] == "follow":
        _, addr, rank, join_timeout, parent_pid = argv
        exit_with_parent(int(parent_pid))
        configure_child_logging("worker")
        from llmserve.worker import ranks

        ranks.exit_now(ranks.follow(addr, int(rank), float(join_timeout)))
    address, parent_pid = argv
    exit_with_parent(int(parent_pid))
    configure_child_logging("worker")
    # Imported, not run as __main__, so pickled classes keep their real module path on the way
    # back to the engine core.
    from llmserve.worker import model_worker

    model_worker.serve(address)


if __name__ == "__main__":
    main(sys.argv[1:])

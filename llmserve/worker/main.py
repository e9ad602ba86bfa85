"""The entry point of a model worker process: ``python -m llmserve.worker.main
ADDRESS PARENT_PID`` (the engine core's PID).

Its first job, before the seconds it takes to import torch, is to tie its life to the engine
core's: a worker outlives its engine core only by accident (the engine core was killed, maybe
while this worker was still starting or loading weights), and should then leave at once rather
than hold a GPU and memory forever. Only then does it import the model code and serve (``model_worker``).
"""

from __future__ import annotations

import sys

from llmserve.common.logs import configure_child_logging
from llmserve.common.process import exit_with_parent


def main(argv: list[str]) -> None:
    address, parent_pid = argv
    exit_with_parent(int(parent_pid))
    configure_child_logging("worker")
    # Imported, not run as __main__, so pickled classes keep their real module path on the way
    # back to the engine core.
    from llmserve.worker import model_worker

    model_worker.serve(address)


if __name__ == "__main__":
    main(sys.argv[1:])

"""The entry point of the engine-core process: ``python -m llmserve.engine.core_main ADDRESS
PARENT_PID [LOG_LEVEL]``, started by ``llmserve serve`` (see ``llmserve.server.engine_client``).

As a worker does, it first ties its life to its parent's (the HTTP process), before the seconds
it takes to import torch; its own workers, in turn, follow it. Then it serves (``core.serve``).
"""

from __future__ import annotations

import signal
import sys

from llmserve.common.logs import configure_child_logging
from llmserve.common.process import exit_with_parent


def main(argv: list[str]) -> int:
    address, parent_pid, *rest = argv
    exit_with_parent(int(parent_pid))
    # Ctrl-C in a terminal reaches the whole process group; the HTTP process decides how the
    # engine stops (it ends the open streams first, then tells us to shut down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_child_logging("core", rest[0] if rest else None)
    # Imported, not run as __main__, so pickled classes keep their real module path.
    from llmserve.engine import core

    return core.serve(address)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

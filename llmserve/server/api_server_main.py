"""The entry point of HTTP processes 1 .. N-1 of ``llmserve serve --api-server-count N``:
``python -m llmserve.server.api_server_main LAUNCHER_PID``, with an ``ApiServerSpec`` on its stdin
(see ``llmserve.server.api_servers``).

As the engine core does, it first ties its life to the launcher's; then it serves the launcher's
listen socket (``serve.serve_api_server``).
"""

from __future__ import annotations

import pickle
import signal
import sys

from llmserve.common.logs import configure_child_logging
from llmserve.common.process import exit_with_parent


def main(argv: list[str]) -> int:
    exit_with_parent(int(argv[0]))
    # Ctrl-C in a terminal reaches the whole process group; the launcher decides how the others
    # stop (SIGTERM, once it has ended its own streams), even while they start.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = pickle.load(sys.stdin.buffer)
    # http1[PID], http2[PID], ... beside the launcher's http[PID]
    configure_child_logging(f"http{spec.config.api_server}", spec.log_level)
    from llmserve.server.serve import serve_api_server

    return serve_api_server(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

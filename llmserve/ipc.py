"""What every process of the server shares about talking to the others (HTTP <-> engine core
over one socket, engine core <-> model workers over rpyc): socket addresses, and how a failure
is told in one line. Nothing else here, so that any process can import it for nothing."""

from __future__ import annotations

import sys

# Linux names sockets in an abstract namespace (no file: the name goes with the last socket
# using it, however its process dies). Addresses there are written "@name", as ss(8) does,
# since a command line cannot carry the real leading NUL.
ABSTRACT_SOCKETS = sys.platform.startswith("linux")


def socket_path(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


def error_line(e: BaseException) -> str:
    """Why a request failed, as one line for its client: the exception's type and first line
    (a torch error's message may go on for a page)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__

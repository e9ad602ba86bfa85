"""What the processes ``llmserve serve`` starts share: tying a child's life to its parent's.

Imports nothing heavy: a child calls this first, before the seconds it takes to import torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1     # from <linux/prctl.h>


def exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the process ``parent_pid`` is no longer our parent.

    ``parent_pid`` comes from the parent's command line: by the time this runs the parent may be
    gone already, and ``os.getppid()`` would name whichever process adopted us."""
    if sys.platform.startswith("linux"):
        # The kernel signals us the moment our parent exits, even mid-way through loading weights.
        # It does so too when merely the parent *thread* that started us ends (an LLM built on a
        # thread of its own), hence a handler that checks, rather than SIGKILL.
        signal.signal(signal.SIGUSR1, lambda *_: _exit_if_orphaned(parent_pid))
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
    _exit_if_orphaned(parent_pid)   # the parent died before the line above: no signal will come
    # The fallback (and elsewhere the only way): look every second. (A signal handler runs only
    # when the main thread gets to run Python code.)
    threading.Thread(target=_poll_parent, args=(parent_pid,), daemon=True, name="llmserve-parent-watch").start()


def _exit_if_orphaned(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        os._exit(1)


def _poll_parent(parent_pid: int) -> None:
    while True:
        _exit_if_orphaned(parent_pid)
        time.sleep(1.0)

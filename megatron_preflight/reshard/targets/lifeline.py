"""Worker processes die with the process that started them (a kill -9, an OOM kill or a preemption of the main
``reshard`` process must not leave ~300 MB workers idling on a login node or a training host).

Linux: the kernel's parent-death signal (``PR_SET_PDEATHSIG``). Everywhere, and as a second line on Linux (the
signal follows the parent *thread*): a daemon thread that watches the parent's pid and exits the process when it is
gone. The multiprocessing resource tracker then sees its last users close their end and exits too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit as soon as ``parent_pid`` is gone (call it first thing in a worker)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl here: the watchdog below still runs
            pass
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid,), name="megatron-preflight-lifeline", daemon=True).start()


def _watch(parent_pid: int) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        if os.getppid() != parent_pid:
            os._exit(1)

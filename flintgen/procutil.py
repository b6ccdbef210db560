"""Child processes that do not outlive flintgen."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``; also when the parent is SIGKILLed), and exit now if
    the parent is already gone (it may die before this runs)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: best effort only
        return
    if os.getppid() != parent_pid:
        os._exit(1)

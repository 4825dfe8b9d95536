"""What every process gspo starts does about its own lifetime (a rank, a rollout worker, the math checker)."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process `sig` when its parent dies (PR_SET_PDEATHSIG), so that none outlives
    the process that started it; if the parent is already gone, send it now. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)

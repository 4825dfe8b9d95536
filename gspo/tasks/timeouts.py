"""A time limit on code gspo does not control: a user's reward function, a task's verifier on a user's data.

`call(fn, seconds, what)` runs `fn` in a thread and waits at most `seconds`; a function still running
then ends the run with a one-line `ScoringTimeout` naming what it was doing and the function it was
stuck in (file and line). The thread cannot be killed: it is a daemon and goes with the process, which
ends (the finished steps, their metrics and checkpoints stay as they are). Signals still reach the
main thread while it waits (Ctrl-C, preemption).
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, TypeVar

from gspo.config.errors import ConfigError

T = TypeVar("T")


class ScoringTimeout(ConfigError):
    """A user's code took longer than its time limit (the CLI prints one line, exit code 2)."""


def _stuck_in(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return ""
    return f", stuck in {frame.f_code.co_name}() at {frame.f_code.co_filename}:{frame.f_lineno}"


def call(fn: Callable[[], T], seconds: float, what: str, key: str = "reward.timeout_s") -> T:
    """`fn()`, or a ScoringTimeout once it has run `seconds` (0 or None = no limit). Its exceptions pass through."""
    if not seconds:
        return fn()
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="gspo-scoring")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise ScoringTimeout(f"{key}={seconds:g}: {what} took longer than that{_stuck_in(thread)}; "
                             f"the finished steps and their checkpoints are kept (raise {key} if it is only slow)")
    if "error" in box:
        raise box["error"]
    return box["value"]

"""A time limit on code gspo does not control: a user's reward function, a task's verifier on a user's data.

`call(fn, seconds, what)` runs `fn` IN THE CALLING THREAD, as TRL calls reward functions: code that only
works there (math-verify's own time limits use SIGALRM, which only the main thread may set; an asyncio
event loop kept across batches) runs unchanged. A watchdog thread waits `seconds`; if `fn` is still
running then, it interrupts the main thread with SIGUSR1 and `call` raises a one-line `ScoringTimeout`
naming what it was doing and the function it was stuck in (file and line). The finished steps, their
metrics and checkpoints stay as they are.

What no thread can interrupt: code that holds the GIL inside one C call (a big-integer power in sympy:
`9^{9^{9^{9}}}`). gspo's own math checker therefore runs math-verify in a separate process it can kill
(gspo/tasks/mathcheck.py); a user's function that does so is the user's to bound.

Off the main thread (Python delivers signals there only), `call` falls back to running `fn` in a daemon
thread and waiting for it.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Callable, TypeVar

from gspo.core.errors import ConfigError

T = TypeVar("T")
SIGNAL = signal.SIGUSR1  # how the watchdog interrupts the main thread


class ScoringTimeout(ConfigError):
    """A user's code took longer than its time limit (the CLI prints one line, exit code 2)."""


class _Interrupted(BaseException):
    """Raised in the main thread by the watchdog's signal (a BaseException: user code's `except Exception`
    cannot swallow it)."""


def _stuck_in(frame) -> str:
    if frame is None:
        return ""
    while frame.f_back is not None and frame.f_code.co_filename == __file__:  # our own frames are not the culprit
        frame = frame.f_back
    return f", stuck in {frame.f_code.co_name}() at {frame.f_code.co_filename}:{frame.f_lineno}"


def _message(key: str, seconds: float, what: str, where: str) -> str:
    return (f"{key}={seconds:g}: {what} took longer than that{where}; "
            f"the finished steps and their checkpoints are kept (raise {key} if it is only slow)")


_ACTIVE = threading.Event()  # a `call` in the main thread is running its function
_INSTALLED: list = []  # the handler that was on SIGNAL before ours (ours stays: no window where a late signal kills)


def _interrupt(signum, frame) -> None:
    if _ACTIVE.is_set():
        raise _Interrupted()
    previous = _INSTALLED[0] if _INSTALLED else None
    if callable(previous):  # someone else's SIGUSR1, outside our calls
        previous(signum, frame)


def call(fn: Callable[[], T], seconds: float, what: str, key: str = "reward.timeout_s") -> T:
    """`fn()`, or a ScoringTimeout once it has run `seconds` (0 or None = no limit). Its exceptions pass through."""
    if not seconds:
        return fn()
    if threading.current_thread() is not threading.main_thread():
        return _in_thread(fn, seconds, what, key)
    if not _INSTALLED:
        _INSTALLED.append(signal.signal(SIGNAL, _interrupt))
    main = threading.main_thread().ident
    done = threading.Event()
    fired: dict = {}

    def watchdog() -> None:
        if not done.wait(seconds):
            fired["where"] = _stuck_in(sys._current_frames().get(main))
            signal.pthread_kill(main, SIGNAL)

    dog = threading.Thread(target=watchdog, daemon=True, name="gspo-scoring-watchdog")
    _ACTIVE.set()
    dog.start()
    try:
        try:
            return fn()
        finally:
            _ACTIVE.clear()  # from here on a late signal is ignored
            done.set()
    except _Interrupted:
        raise ScoringTimeout(_message(key, seconds, what, fired.get("where", ""))) from None
    finally:
        dog.join()


def _in_thread(fn: Callable[[], T], seconds: float, what: str, key: str) -> T:
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
        raise ScoringTimeout(_message(key, seconds, what, _stuck_in(sys._current_frames().get(thread.ident))))
    if "error" in box:
        raise box["error"]
    return box["value"]

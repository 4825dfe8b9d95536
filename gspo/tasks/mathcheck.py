"""math-verify in a process of its own, which gspo can kill: a completion can never hang a run.

A policy finds strings that make a math checker work for ever: `\\boxed{9^{9^{9^{9}}}}` enters one big-integer
power in sympy that holds the GIL, so neither math-verify's own SIGALRM limits nor any thread can stop it.
`MathChecker` sends the completions to a child process (`python -m gspo.tasks.mathcheck`), one batch at a
time, and reads the verdicts back one by one; a verdict that does not come within `item_timeout_s` gets the
child killed and restarted, and that completion is scored as neither correct nor well-formed, with
`timed_out` set (the trainer logs the share as `reward/verify_timeout/mean`). In the child, math-verify runs
in the main thread, so its own limits (5 s to parse, 5 s to compare) end the merely slow ones
(`\\boxed{10!!!!}`) first.

The child is a plain subprocess speaking JSON lines on its stdin / stdout (not multiprocessing's spawn, which
re-imports the parent's main module: a user's script without a `__main__` guard would start itself again).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from typing import Optional

from gspo.core.processes import die_with_parent
from gspo.tasks.base import Verdict

ITEM_TIMEOUT_S = 15.0  # above math-verify's own 5 s + 5 s: the kill is for what those cannot stop


class CheckerFailed(RuntimeError):
    """The checker process could not start or answer at all (not one completion's fault)."""


class MathChecker:
    """Verdicts of `gspo.tasks.answers.check_answer(completion, answer)` from a child that a hang cannot outlive."""

    def __init__(self, item_timeout_s: float = ITEM_TIMEOUT_S):
        self.item_timeout_s = item_timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._buf = b""

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "gspo.tasks.mathcheck"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._buf = b""
        if self._line(60.0) != "ready":  # importing math-verify and sympy: seconds, once
            self._kill()
            raise CheckerFailed("the math checker process (python -m gspo.tasks.mathcheck) did not start")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None

    def close(self) -> None:
        self._kill()

    def _line(self, timeout: float) -> Optional[str]:
        """The child's next line, or None if none comes within `timeout` (or it died)."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def verdicts(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        """One Verdict per (completion, answer), in order."""
        out: list[Verdict] = []
        while len(out) < len(pairs):
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps(pairs[len(out):]) + "\n").encode())
                self._proc.stdin.flush()
            except BrokenPipeError:
                self._kill()
                continue
            for _ in range(len(out), len(pairs)):
                line = self._line(self.item_timeout_s)
                if line is None:  # stuck (or died) on this one: kill it, score it 0, go on in a new child
                    self._kill()
                    out.append(Verdict(False, False, timed_out=True))
                    break
                correct, formed = json.loads(line)
                out.append(Verdict(bool(correct), bool(formed)))
        return out


def _root() -> str:
    """The directory gspo is imported from (the child must import the same gspo)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _serve() -> None:
    """The child: for each JSON line [[completion, answer], ...] on stdin, one line [correct, well_formed] each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    die_with_parent()
    out = os.fdopen(os.dup(1), "w")  # the protocol's own stream: anything a library prints goes elsewhere
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from gspo.tasks.answers import check_answer

    # math-verify's first check builds its LaTeX parser (1.1 s on a 2-core machine, ~300x a later check): done here,
    # under the start's 60 s, so that it never counts against a completion's item timeout (the suite on a loaded
    # 16-worker GPU machine scored every completion of the hang test 0, the likeliest cause)
    check_answer("\\boxed{1}", "1")
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        for completion, answer in json.loads(line):
            try:
                v = check_answer(completion, answer)
                verdict = [bool(v.correct), bool(v.well_formed)]
            except Exception:  # a completion math-verify chokes on is wrong, not a crash
                verdict = [False, False]
            out.write(json.dumps(verdict) + "\n")
            out.flush()


if __name__ == "__main__":
    _serve()

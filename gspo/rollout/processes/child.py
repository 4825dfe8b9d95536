"""A process gspo starts to sample for it (a rollout worker, the inference engine): the trainer's end of its socket.

The trainer's end (`Child`): a plain subprocess, `python -m <module> FD` (not multiprocessing's spawn, which
re-imports the parent's main module), on one end of a private socket pair (nothing else can connect to it),
messages pickled tuples whose first item is their kind. Its failures become one line for the run's user:
an error the child sends (its own exception, `("error", step, kind, text, users)`: a `ConfigError` when the
user's code or config caused it), its death (the socket closes: killed, crashed), its silence for longer than
the timeout (hung), or a channel beside the socket breaking (`lost`: the engine's weight group). Before raising,
`on_fail` runs (the owner kills every child it has, each with the processes it started: it runs in a session of
its own): no child outlives a failure, nor the shared memory it leaves (gspo/rollout/processes/shm.py).

What `Child` shares with the end of a connection to a process gspo did not start (gspo/rollout/processes/peer.py)
is `Link`. The child's end of the socket is gspo/rollout/processes/serve.py.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional

from gspo.core.errors import ConfigError, RunFailed
from gspo.rollout.processes.shm import group_members, held, shm_segments, unlink_orphans, wait_group_gone

# torchrun's variables: a child is no rank of the trainer's process group
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class Link(ABC):
    """The trainer's end of a connection to a process that samples for it: its messages, and its error, death or
    silence raised as the run's failure. `name` opens every line it raises ("rollout worker 0"), `stopped` ends the
    lines about its death or silence (what `on_fail` did: "; every worker was stopped"). What its death is and how
    it is stopped are each kind's own: a process gspo started (`Child`), or one it connected to
    (gspo/rollout/processes/peer.py `Peer`)."""

    def __init__(self, name: str, conn: Connection, on_fail: Callable[[], None], stopped: str = ""):
        self.name, self.conn, self.on_fail, self.stopped = name, conn, on_fail, stopped
        self.jobs: list = []  # what it was asked and has not answered yet (a worker's steps)

    def send(self, message: tuple, step: Optional[int] = None) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(message))
        except OSError:  # it is gone: its last words (an error it sent before exiting) say why, if it had any
            at = self.jobs[0] if self.jobs else step  # it died on its oldest job, not on the one being sent
            while self.conn.poll(0):
                self.recv(at)  # raises on its error message, or on the end of the stream
            raise self.fail(RunFailed(self.died(at))) from None

    def recv(self, step: Optional[int]) -> tuple:
        """The next message (blocking); its error or its death raised as the run's failure at `step`."""
        try:
            message = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self.fail(RunFailed(self.died(step))) from None
        if message[0] == "error":  # the child's own exception, in one line
            _, at, kind, text, users = message
            raise self.fail((ConfigError if users else RunFailed)(f"{self.name}{at_step(at)}: {kind}: {text}"))
        return message

    def expect(self, kind: str, step: Optional[int], timeout_s: float, hint: str = "") -> tuple:
        """The next message, which must be of `kind`, within `timeout_s` (else the child is taken as hung; `hint`
        goes in the line: the setting that bounds the wait)."""
        if not self.conn.poll(timeout_s):
            raise self.fail(RunFailed(self.silent(step, timeout_s, hint)))
        message = self.recv(step)
        if message[0] != kind:
            raise self.fail(RunFailed(f"{self.name}: expected {kind!r}, got {message[0]!r}"))
        return message

    def ask(self, message: tuple, kind: str, timeout_s: float, hint: str = "") -> tuple:
        """Send `message` (no step: start-up's exchanges) and return the answer, which must be of `kind`."""
        self.send(message)
        return self.expect(kind, None, timeout_s, hint)

    def silent(self, step: Optional[int], timeout_s: float, hint: str) -> str:
        """The line for a child that sent nothing for `timeout_s` (at `step`; `hint`: the setting that bounds it)."""
        return (f"{self.name}: nothing from it for {timeout_s:g} s{at_step(step)} (hung?{' ' + hint if hint else ''})"
                f"{self.stopped}")

    def fail(self, error: Exception) -> Exception:
        self.on_fail()
        return error

    @property
    @abstractmethod
    def pid(self) -> Optional[int]:
        """Its process's id, where the process is ours."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether it is still there."""

    @abstractmethod
    def died(self, step: Optional[int]) -> str:
        """The line for its death (at `step`)."""

    @abstractmethod
    def lost(self, step: Optional[int], timeout_s: float, hint: str = "") -> Exception:
        """The run's failure when a channel beside the connection (the engine's weight group) broke or went quiet."""

    @abstractmethod
    def stop(self, wait_s: float = 10.0) -> None:
        """Ask it to stop; end it if it has not within `wait_s`."""

    @abstractmethod
    def kill(self) -> None:
        """End it now."""


class Child(Link):
    """The trainer's end of one child process it starts, `python -m <module> FD`, sent `spec` first (`env`: added
    to its environment)."""

    def __init__(self, name: str, module: str, spec: dict, on_fail: Callable[[], None], stopped: str = "",
                 env: Optional[dict] = None):
        full = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root(), os.environ.get("PYTHONPATH")])),
                **(env or {})}
        for k in RANK_VARS:
            full.pop(k, None)
        ours, theirs = socket.socketpair()
        self.segments = shm_segments()  # the shared memory that was there before it (`kill` removes what it leaks)
        self.owned: set[str] = set()  # segments its processes were seen holding (`kill` removes these alone)
        # a session of its own: what it starts (the engine's tensor-parallel workers) is killed with it (`kill`)
        self.proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())], env=full,
                                     pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        super().__init__(name, Connection(ours.detach()), on_fail, stopped)
        self.send(("spec", spec))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """Whether its process still runs."""
        return self.proc.poll() is None

    def recv(self, step: Optional[int]) -> tuple:
        message = super().recv(step)
        if message[0] == "ready":  # started: what it made for its life is mapped now
            self.owned |= held(group_members(self.proc.pid))
        return message

    def lost(self, step: Optional[int], timeout_s: float, hint: str = "") -> Exception:
        """The run's failure when a channel beside the socket (the engine's weight group) broke or went quiet: the
        error the child sent before exiting, if any; else its death; else its silence for `timeout_s`."""
        try:
            self.proc.wait(1.0)  # a peer that broke the channel is most likely exiting
        except subprocess.TimeoutExpired:
            pass
        while self.conn.poll(0):
            self.recv(step)  # raises on its error message, or on the end of the stream
        if self.proc.poll() is not None:
            return self.fail(RunFailed(self.died(step)))
        return self.fail(RunFailed(self.silent(step, timeout_s, hint)))

    def died(self, step: Optional[int]) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exit code {code}" if code is not None else "its connection closed")
        return f"{self.name} (pid {self.pid}) died{at_step(step)} ({how}){self.stopped}"

    def stop(self, wait_s: float = 10.0) -> None:
        """Ask it to stop; kill it if it has not within `wait_s`."""
        try:
            self.send(("stop",))
        except (OSError, RunFailed, ConfigError):
            pass
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # it, or what it left behind
        self.conn.close()

    def kill(self) -> None:
        """SIGKILL to it and every process it started (its session's group), then remove the shared memory they
        left: a process killed so cannot unlink the segments it created (vLLM's tensor-parallel message queues,
        160-240 MiB each, held in RAM by /dev/shm until the machine restarts). Only segments its processes were
        seen holding (at "ready", and here, stopped, just before the kill) are removed: another program's segment,
        made meanwhile by the same user, is not, even where no process holds it (`unlink_orphans`)."""
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)  # frozen: no segment made or dropped between the look and the kill
        except (ProcessLookupError, PermissionError):
            pass  # none left
        self.owned |= held(group_members(self.proc.pid))
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # none left
        self.proc.wait()
        # its own workers are not our children: wait until the kernel has torn them down too (their mappings go
        # before they turn zombie), else their segments still look in use and stay behind
        wait_group_gone(self.proc.pid)
        unlink_orphans(self.segments, self.owned)


def at_step(step: Optional[int]) -> str:
    return f" while sampling step {step}" if step is not None else ""


def root() -> str:
    """The directory gspo is imported from (a child must import the same gspo)."""
    return str(Path(__file__).resolve().parents[3])

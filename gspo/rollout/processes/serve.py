"""The child's end of its socket (`serve`): the main loop of a process gspo started (a rollout worker, the engine).

It ignores SIGINT / SIGTERM (the trainer finishes its step and stops it), dies with the trainer (PR_SET_PDEATHSIG),
sends "ready" once its start-up is done, answers each message in order, and sends its own exception back as one
line before exiting. A shared engine serves the trainer's other ranks too (`Clients`): they connect through a
`Gate` (gspo/core/channel.py), each proving it holds a key the trainer was sent.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Callable, Optional

from gspo.core.channel import PENDING, Gate
from gspo.core.errors import ConfigError


def serve(fd: int, start: Callable[[dict], Callable[[tuple], Optional[tuple]]], syncs: tuple[str, ...] = ()) -> int:
    """The child's main loop on socket `fd`: `start(spec)` builds its state and returns the handler that answers
    each later message (a reply tuple, or None for none); ("stop",) ends it. Returns the exit code.

    A message whose second item is an int names the step it serves: an error while handling it says so.

    Other processes may be served beside the trainer (a shared engine: the trainer's other ranks): ("listen", n,
    timeout_s) opens a listener (`Clients`) and waits for `n` of them. A client's messages name the step they are
    for and wait until the trainer's last message of a kind in `syncs` (the weights' load) is for that step or a
    later one and loaded them (a reply whose fourth item is not "ok", a refused delta, loaded nothing: they wait for
    the next); then ("synced", step) is answered with that load's reply, anything else by the handler."""
    from gspo.core.processes import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C or SIGTERM reaches the trainer, which stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    conn = Connection(fd)
    send = lambda message, to=conn: to.send_bytes(pickle.dumps(message))  # noqa: E731
    step, clients, at = None, None, None  # at: the client whose message is being handled
    synced, loaded = None, None  # the step of the trainer's last sync, and its reply
    try:
        _, spec = pickle.loads(conn.recv_bytes())
        handle = start(spec)
        send(("ready",))
        while True:
            if clients is None or clients.waiting(conn, synced) is conn:
                message = pickle.loads(conn.recv_bytes())
                if message[0] == "stop":
                    return 0
                if message[0] == "listen":
                    clients = Clients(*message[1:], send)
                    continue
                step = message[1] if len(message) > 1 and isinstance(message[1], int) else None
                reply = handle(message)
                if message[0] in syncs:  # (a load that loaded nothing, a refused delta, serves no step)
                    refused = isinstance(reply, tuple) and len(reply) > 3 and reply[3] != "ok"
                    synced, loaded = (None, None) if refused else (step, reply)
                if reply is not None:
                    send(reply)
                step = None
                continue
            at, message = clients.next()
            step = message[1]
            send(loaded if message[0] == "synced" else handle(message), at)
            at = step = None
    except (EOFError, OSError, KeyboardInterrupt):  # the trainer is gone: so are we
        return 1
    except Exception as e:
        error = ("error", step, type(e).__name__, " ".join(str(e).split()), isinstance(e, ConfigError))
        for to in filter(None, (at, conn)):  # the client that asked, if one did, and the trainer
            try:
                send(error, to)
            except Exception:
                pass
        return 1


class Clients:
    """The other processes a child serves beside the trainer (`serve`): a `Gate` on a free port of `host`, announced
    to the trainer as ("listening", port, key), then `n` clients accepted within `timeout_s`, each proving it holds
    the key. A peer that does not (a stranger, a port scan, a wrong key) is dropped and `refused` gets a line about
    it (by default on stderr: the trainer's console, or the server's); the ranks still join. Their messages are
    taken in arrival order, each once the weights for its step are loaded."""

    def __init__(self, n: int, timeout_s: float, host: str, send: Callable,
                 refused: Optional[Callable[[str], None]] = None):
        refused = refused or (lambda line: print(f"gspo: the shared engine refused a connection from {line}",
                                                 file=sys.stderr, flush=True))
        key = os.urandom(16)
        gate = Gate((host, 0), key, refused, pending=PENDING + n)  # (the n ranks may all connect at once)
        send(("listening", gate.address[1], key))
        self.conns: list[Connection] = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(self.conns) < n:
                conn = gate.accept(max(0.0, deadline - time.monotonic()))
                if conn is None:
                    raise RuntimeError(f"{len(self.conns)} of the {n} other ranks connected within {timeout_s:g} s")
                self.conns.append(conn)
        finally:
            gate.close()
        self.queue: list[tuple[Connection, tuple]] = []  # received, not yet served
        self.synced: Optional[int] = None
        send(("accepted",))

    def waiting(self, trainer: Connection, synced: Optional[int]) -> Optional[Connection]:
        """The trainer's connection when it has a message and no client's can be served, else None: the queue
        then holds a client's message that can be served now (`next`). `synced`: the step of the weights loaded."""
        from multiprocessing.connection import wait

        self.synced = synced
        while not any(self._ready(message) for _, message in self.queue):
            for c in wait([trainer, *self.conns]):
                if c is trainer:
                    return trainer
                try:
                    self.queue.append((c, pickle.loads(c.recv_bytes())))
                except (EOFError, OSError):  # a rank that finished (or died: the trainer's rank 0 hears of it)
                    self.conns.remove(c)
        return None

    def _ready(self, message: tuple) -> bool:
        step = message[1]
        return step is None or (self.synced is not None and step <= self.synced)

    def next(self) -> tuple[Connection, tuple]:
        """The oldest client message that can be served now."""
        return self.queue.pop(next(i for i, (_, message) in enumerate(self.queue) if self._ready(message)))

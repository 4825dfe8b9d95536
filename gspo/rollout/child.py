"""A process gspo starts to sample for it (a rollout worker, the inference engine): both ends of its socket.

The trainer's end (`Child`): a plain subprocess, `python -m <module> FD` (not multiprocessing's spawn, which
re-imports the parent's main module), on one end of a private socket pair (nothing else can connect to it),
messages pickled tuples whose first item is their kind. Its failures become one line for the run's user:
an error the child sends (its own exception, `("error", step, kind, text, users)`: a `ConfigError` when the
user's code or config caused it), its death (the socket closes: killed, crashed), its silence for longer than
the timeout (hung), or a channel beside the socket breaking (`lost`: the engine's weight group). Before raising,
`on_fail` runs (the owner kills every child it has, each with the processes it started: it runs in a session of
its own): no child outlives a failure.

Connections over TCP (a shared engine's other ranks, `gspo vllm-serve`'s trainers, the weight group's store) are
accepted by a `Gate`: each peer proves it holds the key within `AUTH_S` on a thread of its own, so a silent or
wrong peer is dropped without holding up the next (at most `PENDING` at once: one more is closed at once, and a
thread that cannot start costs its connection only, never the listener), and every accepted connection has TCP
keepalive (`KEEPALIVE`), so a peer that vanished without closing it (power loss, a partition) ends the read
waiting on it.

The child's end (`serve`): ignores SIGINT / SIGTERM (the trainer finishes its step and stops it), dies with
the trainer (PR_SET_PDEATHSIG), sends "ready" once its start-up is done, answers each message in order, and
sends its own exception back as one line before exiting.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Callable, Optional

from gspo.config.errors import ConfigError, RunFailed

# torchrun's variables: a child is no rank of the trainer's process group
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
AUTH_S = 10.0  # how long a peer that connected has to prove the key: a handshake of four short messages
# TCP keepalive on every accepted connection: (idle seconds before the first probe, seconds between probes, probes
# unanswered). A peer that vanished without closing (power loss, a partition) is dropped after about 2 minutes, where
# a blocked read would otherwise wait for ever; a peer that is alive answers the probes from its kernel, however long
# it says nothing (a trainer between two steps).
KEEPALIVE = (60, 10, 6)
# peers a `Gate` authenticates at once, at most (each on a thread for up to AUTH_S): a real peer takes milliseconds,
# so this bounds what a flood of silent connections can hold, not the peers that may connect (a listener expecting
# n ranks at once allows n more: `Clients`)
PENDING = 64


class Child:
    """The trainer's end of one child process. `name` opens every line it raises ("rollout worker 0"), `stopped`
    ends the lines about its death or silence (what `on_fail` did: "; every worker was stopped")."""

    def __init__(self, name: str, module: str, spec: dict, on_fail: Callable[[], None], stopped: str = "",
                 env: Optional[dict] = None):
        self.name, self.on_fail, self.stopped = name, on_fail, stopped
        self.jobs: list = []  # what it was asked and has not answered yet (a worker's steps)
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
        self.conn = Connection(ours.detach())
        self.send(("spec", spec))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """Whether its process still runs."""
        return self.proc.poll() is None

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
        if message[0] == "ready" and self.proc is not None:  # started: what it made for its life is mapped now
            self.owned |= held(group_members(self.proc.pid))
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

    def silent(self, step: Optional[int], timeout_s: float, hint: str) -> str:
        """The line for a child that sent nothing for `timeout_s` (at `step`; `hint`: the setting that bounds it)."""
        return (f"{self.name}: nothing from it for {timeout_s:g} s{at_step(step)} (hung?{' ' + hint if hint else ''})"
                f"{self.stopped}")

    def died(self, step: Optional[int]) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exit code {code}" if code is not None else "its connection closed")
        return f"{self.name} (pid {self.pid}) died{at_step(step)} ({how}){self.stopped}"

    def fail(self, error: Exception) -> Exception:
        self.on_fail()
        return error

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


SHM = Path("/dev/shm")


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run (zombies, which hold no memory, left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    """Wait up to `timeout_s` for every process of group `pgid` to end (after a SIGKILL: the kernel frees a killed
    process's memory asynchronously); whether they did."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def shm_segments() -> set[str]:
    """The names of Python's shared-memory segments (`multiprocessing.shared_memory`: `psm_*`) in /dev/shm now."""
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith("psm_")}
    except OSError:  # no /dev/shm (not Linux)
        return set()


def held(pids: Optional[list[int]] = None) -> set[str]:
    """The /dev/shm segments processes `pids` (None: every process) map or hold open (/proc/PID/maps and fd)."""
    used, prefix = set(), str(SHM) + "/"
    procs = Path("/proc").glob("[0-9]*") if pids is None else (Path("/proc") / str(pid) for pid in pids)
    for proc in procs:
        try:
            maps = (proc / "maps").read_text()
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone meanwhile, or not ours to read
            continue
        used.update(line.split(prefix, 1)[1].split()[0] for line in maps.splitlines() if prefix in line)
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile (the listing's own descriptor among them)
                continue
            if target.startswith(prefix):
                used.add(target[len(prefix):])
    return used


def unlink_orphans(before: set[str], owned: Optional[set[str]] = None) -> list[str]:
    """Unlink the segments created since `before` that no living process maps or holds open (another program's live
    ones are kept) and, given `owned`, that are among those: the names removed. A child's `kill` gives the segments
    its processes were seen holding, so that a segment another program made meanwhile and holds by name alone (made,
    closed, to be opened again later) is not taken for the child's; without `owned` (a test's check that nothing
    was leaked) every such segment counts."""
    new = shm_segments() - before
    if owned is not None:
        new &= owned
    orphans = sorted(new - held()) if new else []
    for name in orphans:
        try:
            (SHM / name).unlink()
        except OSError:
            pass  # someone else removed it
    return orphans


class Peer(Child):
    """The trainer's end of a connection `conn` to a process it did not start (an engine `gspo vllm-serve` runs,
    the engine another rank started): no process of ours. Its death is its connection closing (`cause`: whose
    death that may be); killing it is closing the connection."""

    def __init__(self, name: str, conn: Connection, cause: str, on_fail: Callable[[], None] = lambda: None,
                 stopped: str = ""):
        self.name, self.conn, self.cause, self.on_fail, self.stopped = name, conn, cause, on_fail, stopped
        self.jobs, self.proc = [], None

    @property
    def pid(self) -> None:
        return None

    def alive(self) -> bool:
        return not self.conn.closed

    def died(self, step: Optional[int]) -> str:
        return f"{self.name}: its connection closed{at_step(step)} ({self.cause}){self.stopped}"

    def lost(self, step: Optional[int], timeout_s: float, hint: str = "") -> Exception:
        try:
            while self.conn.poll(0):
                self.recv(step)  # raises on its error message, or on the end of the stream
        except OSError:
            return self.fail(RunFailed(self.died(step)))
        return self.fail(RunFailed(self.silent(step, timeout_s, hint)))

    def stop(self, wait_s: float = 10.0) -> None:
        try:
            self.send(("stop",))
        except (OSError, RunFailed, ConfigError):
            pass
        self.kill()

    def kill(self) -> None:
        if not self.conn.closed:
            self.conn.close()


class RemoteChild(Peer):
    """The trainer's end of an engine `gspo vllm-serve` started on another host (gspo/rollout/engine_server.py): a
    connection to `address` (host, port), authenticated with `key`. The server says how many threads its engine
    has, and the engine is sent `spec_of(threads)`; it is told `tensor_parallel_size` before it starts. An engine
    exits when its trainer is gone (the connection closed)."""

    def __init__(self, name: str, address: tuple[str, int], key: bytes, spec_of: Callable[[int], dict],
                 tensor_parallel_size: int, on_fail: Callable[[], None], timeout_s: float, stopped: str = ""):
        where = f"rollout.vllm.server={address[0]}:{address[1]}"
        try:
            sock = socket.create_connection(address, timeout=timeout_s)
            sock.settimeout(None)  # (a blocking socket: the Connection reads it with os.read)
        except OSError as e:
            raise RunFailed(f"{where}: cannot connect ({e.strerror or e}): is `gspo vllm-serve --port "
                            f"{address[1]}` running on {address[0]}?") from None
        try:
            conn = authenticate(sock, key, timeout_s, server=False)
        except AuthenticationError:
            raise ConfigError(f"{where}: the server refused this run's GSPO_VLLM_KEY (not the one it was started "
                              "with)") from None
        except TimeoutError:
            raise RunFailed(f"{where}: the server did not authenticate this run within {timeout_s:g} s "
                            "(rollout.timeout_s)") from None
        except (EOFError, OSError) as e:
            raise RunFailed(f"{where}: the connection closed while authenticating ({e or 'closed'})") from None
        super().__init__(name, conn, "the engine or its server died", on_fail, stopped)
        if not self.conn.poll(timeout_s):
            raise self.fail(RunFailed(self.silent(None, timeout_s, "rollout.timeout_s")))
        message = self.recv(None)
        if message[0] == "busy":
            self.kill()
            raise RunFailed(f"{where}: the server is serving another run (it serves one at a time): start this run "
                            "when that one has ended, or give it a server of its own")
        if message[0] != "server":
            raise self.fail(RunFailed(f"{self.name}: expected 'server', got {message[0]!r}"))
        self.send(("start", tensor_parallel_size))
        self.send(("spec", spec_of(int(message[1]))))


def at_step(step: Optional[int]) -> str:
    return f" while sampling step {step}" if step is not None else ""


def root() -> str:
    """The directory gspo is imported from (a child must import the same gspo)."""
    return str(Path(__file__).resolve().parents[2])


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive on `sock` (`KEEPALIVE`), and the same bound on data it sent that is never acknowledged."""
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                          ("TCP_USER_TIMEOUT", 1000 * (idle + interval * count))):
        if hasattr(socket, option):  # (Linux names; elsewhere the system's keepalive defaults stand)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Gate:
    """A listening socket at `address` (host, port; port 0: a free one, then `address` says which) whose peers must
    prove they hold `key` (multiprocessing's HMAC challenge, both ways: `multiprocessing.connection.Client` passes
    it) within `auth_s` of connecting. Each peer is authenticated on a thread of its own (one, its deadline in its
    reads: `authenticate`), so one that says nothing, or the wrong thing, holds up no other: it is dropped, and
    `refused` gets one line about it (`auth_s`: AUTH_S unless given). At most `pending` peers are authenticated at
    once: one more is closed at once, with a line, rather than given a thread (a flood of silent connections would
    otherwise start threads until the process can start none); a thread that cannot start costs its connection
    only, with a line, and the gate listens on. `accept` hands out the proven connections in the order they were
    proven, with TCP keepalive on (`keepalive`)."""

    def __init__(self, address: tuple[str, int], key: bytes, refused: Callable[[str], None],
                 auth_s: Optional[float] = None, pending: int = PENDING):
        self.key, self.refused, self.auth_s = key, refused, AUTH_S if auth_s is None else auth_s
        self.pending, self.slots = pending, threading.BoundedSemaphore(pending)  # (a slot per peer being proven)
        self.sock = socket.create_server(address)
        self.address = self.sock.getsockname()[:2]
        self.proven: queue.Queue = queue.Queue()  # proven connections; None once closed
        self.closed = False
        threading.Thread(target=self._listen, name="gspo-gate", daemon=True).start()

    def accept(self, timeout: Optional[float] = None) -> Optional[Connection]:
        """The next proven connection; None after `timeout` seconds without one, or once the gate is closed."""
        try:
            conn = self.proven.get(timeout=timeout)
        except queue.Empty:
            return None
        if conn is None:
            self.proven.put(None)  # (for any other caller waiting)
        return conn

    def close(self) -> None:
        """Stop listening; the proven connections no one accepted are closed."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() (close alone does not)
        except OSError:
            pass
        self.sock.close()
        while True:
            try:
                conn = self.proven.get_nowait()
            except queue.Empty:
                break
            if conn is not None:
                conn.close()
        self.proven.put(None)

    def _say(self, line: str) -> None:
        """`refused(line)`; whatever it raises is not the listener's end."""
        try:
            self.refused(line)
        except Exception:  # noqa: BLE001  (a closed console: the line is lost, the gate is not)
            pass

    def _listen(self) -> None:
        while True:
            try:
                sock, peer = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                time.sleep(0.1)  # (a connection reset before it was accepted, no file descriptor left: try again)
                continue
            try:
                self._admit(sock, f"{peer[0]}:{peer[1]}")
            except Exception as e:  # noqa: BLE001  (one connection's trouble never ends the listener)
                sock.close()
                self._say(f"{peer[0]}:{peer[1]}: {type(e).__name__}: {e}; closed")

    def _admit(self, sock: socket.socket, where: str) -> None:
        """Prove the peer on a thread of its own, if a slot is free and a thread starts; else close it, with a line."""
        if not self.slots.acquire(blocking=False):
            sock.close()
            self._say(f"{where}: closed at once: {self.pending} connections are being authenticated already, the "
                      "most at once (a flood of connections that say nothing?)")
            return
        try:
            threading.Thread(target=self._prove, args=(sock, where), name="gspo-gate-auth", daemon=True).start()
        except RuntimeError as e:  # "can't start new thread": the process is at its limit; it may not stay there
            self.slots.release()
            sock.close()
            self._say(f"{where}: closed: no thread could be started to authenticate it ({e})")

    def _prove(self, sock: socket.socket, where: str) -> None:
        try:
            try:
                keepalive(sock)
                conn = authenticate(sock, self.key, self.auth_s, server=True)
            except (AuthenticationError, EOFError, OSError, ValueError) as e:  # a stranger, a wrong key, a silent peer
                sock.close()  # (already, where `authenticate` got it)
                self._say(f"{where}: {type(e).__name__}: {' '.join(str(e).split()) or 'closed'}")
                return
            if self.closed:
                conn.close()
            else:
                self.proven.put(conn)
        finally:
            self.slots.release()


class _Timed(Connection):
    """A Connection whose reads and writes raise TimeoutError once `deadline` (time.monotonic()) has passed: each
    waits (poll) for the socket at most until then, so a peer that says nothing, or a byte now and then, is cut off
    at the deadline by the thread reading it, with no timer thread beside it. (Connection's `_recv` / `_send` take
    the read and write functions as arguments: the hooks multiprocessing itself uses on each platform.)"""

    def __init__(self, fd: int, timeout_s: float):
        super().__init__(fd)
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s

    def _ready(self, handle: int, event: int) -> None:
        left = self.deadline - time.monotonic()
        poller = select.poll()
        poller.register(handle, event)
        if left <= 0 or not poller.poll(left * 1000):  # (POLLHUP and POLLERR come anyway: the read or write says)
            raise TimeoutError(f"did not prove the key within {self.timeout_s:g} s")

    def _recv(self, size: int, read=None):
        return super()._recv(size, read=lambda handle, n: (self._ready(handle, select.POLLIN), os.read(handle, n))[1])

    def _send(self, buf, write=None) -> None:
        super()._send(buf, write=lambda handle, data: (self._ready(handle, select.POLLOUT), os.write(handle, data))[1])


def authenticate(sock: socket.socket, key: bytes, timeout_s: float, server: bool) -> Connection:
    """`sock` as a Connection whose peer proved it holds `key` and was shown that this side does (the server's side
    challenges first, as multiprocessing's Listener; the client's answers first, as its Client), within
    `timeout_s`: else TimeoutError, AuthenticationError, EOFError or OSError. `sock` is closed either way: on success
    the (blocking) Connection holds the socket. Runs on the calling thread alone (`_Timed`)."""
    sock.setblocking(True)  # (the Connection reads with os.read: the wait is `_Timed`'s poll, not the socket's)
    timed = _Timed(os.dup(sock.fileno()), timeout_s)
    sock.close()
    try:
        if server:
            deliver_challenge(timed, key)
            answer_challenge(timed, key)
        else:
            answer_challenge(timed, key)
            deliver_challenge(timed, key)
        return Connection(os.dup(timed.fileno()))  # (a plain one: no deadline on what is read later)
    finally:
        timed.close()


def dial(address: tuple[str, int], key: bytes, timeout_s: float) -> Connection:
    """A connection to a `Gate` (or multiprocessing Listener) at `address`, authenticated with `key` within
    `timeout_s` (connecting included); raises as `authenticate`, or OSError when nothing listens there."""
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.settimeout(None)  # (a blocking socket: the Connection reads it with os.read)
    return authenticate(sock, key, timeout_s, server=False)


def serve(fd: int, start: Callable[[dict], Callable[[tuple], Optional[tuple]]], syncs: tuple[str, ...] = ()) -> int:
    """The child's main loop on socket `fd`: `start(spec)` builds its state and returns the handler that answers
    each later message (a reply tuple, or None for none); ("stop",) ends it. Returns the exit code.

    A message whose second item is an int names the step it serves: an error while handling it says so.

    Other processes may be served beside the trainer (a shared engine: the trainer's other ranks): ("listen", n,
    timeout_s) opens a listener (`Clients`) and waits for `n` of them. A client's messages name the step they are
    for and wait until the trainer's last message of a kind in `syncs` (the weights' load) is for that step or a
    later one and loaded them (a reply whose fourth item is not "ok", a refused delta, loaded nothing: they wait for
    the next); then ("synced", step) is answered with that load's reply, anything else by the handler."""
    from gspo.config.processes import die_with_parent

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

"""The authenticated channel: TCP connections whose peer proved it holds a shared key before a byte is read.

gspo's messages are pickles, so nothing is read from a peer that has not proved it holds the key: a shared engine's
other ranks, `gspo vllm-serve`'s trainers (gspo/rollout/engine/server.py) and the weight group's store
(gspo/rollout/engine/transport.py) all meet so. A `Gate` listens and accepts: each peer proves it holds the key
(multiprocessing's HMAC challenge, both ways) within `AUTH_S` on a thread of its own, so a silent or wrong peer is
dropped without holding up the next (at most `PENDING` at once: one more is closed at once, and a thread that cannot
start costs its connection only, never the listener), and every accepted connection has TCP keepalive (`KEEPALIVE`),
so a peer that vanished without closing it (power loss, a partition) ends the read waiting on it. `dial` is the
other end: connect, then prove the key (`authenticate`, its deadline in its own reads: `_Timed`).
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import Callable, Optional

AUTH_S = 10.0  # how long a peer that connected has to prove the key: a handshake of four short messages
# TCP keepalive on every accepted connection: (idle seconds before the first probe, seconds between probes, probes
# unanswered). A peer that vanished without closing (power loss, a partition) is dropped after about 2 minutes, where
# a blocked read would otherwise wait for ever; a peer that is alive answers the probes from its kernel, however long
# it says nothing (a trainer between two steps).
KEEPALIVE = (60, 10, 6)
# peers a `Gate` authenticates at once, at most (each on a thread for up to AUTH_S): a real peer takes milliseconds,
# so this bounds what a flood of silent connections can hold, not the peers that may connect (a listener expecting
# n ranks at once allows n more: gspo/rollout/processes/serve.py `Clients`)
PENDING = 64


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
            # the line first: by the time the peer sees its connection closed, it is said
            self._say(f"{where}: closed at once: {self.pending} connections are being authenticated already, the "
                      "most at once (a flood of connections that say nothing?)")
            sock.close()
            return
        try:
            threading.Thread(target=self._prove, args=(sock, where), name="gspo-gate-auth", daemon=True).start()
        except RuntimeError as e:  # "can't start new thread": the process is at its limit; it may not stay there
            self.slots.release()
            self._say(f"{where}: closed: no thread could be started to authenticate it ({e})")
            sock.close()

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


def dial(address: tuple[str, int], key: bytes, timeout_s: float,
         unreachable: Optional[Callable[[OSError], Exception]] = None) -> Connection:
    """A connection to a `Gate` (or multiprocessing Listener) at `address`, authenticated with `key` within
    `timeout_s` (connecting included); raises as `authenticate`, or where the connection cannot be made (nothing
    listens there) the OSError, or what `unreachable` makes of it where given (a caller's own line: a remote
    engine's "is `gspo vllm-serve` running?")."""
    try:
        sock = socket.create_connection(address, timeout=timeout_s)
    except OSError as e:
        if unreachable is None:
            raise
        raise unreachable(e) from None
    sock.settimeout(None)  # (a blocking socket: the Connection reads it with os.read)
    return authenticate(sock, key, timeout_s, server=False)

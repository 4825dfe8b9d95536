"""A process gspo did not start, sampling for it: the trainer's end of its connection (`Peer`).

An engine `gspo vllm-serve` runs on another host (`RemoteChild`, reached with gspo/core/channel.py `dial`), or the
engine another rank started (a shared engine: gspo/rollout/engine/client.py). Messages, errors and silence are as a
child's (gspo/rollout/processes/child.py `Link`); its death is its connection closing, and stopping it is closing
the connection: no process of ours to kill.
"""

from __future__ import annotations

from multiprocessing.connection import AuthenticationError, Connection
from typing import Callable, Optional

from gspo.core.channel import dial
from gspo.core.errors import ConfigError, RunFailed
from gspo.rollout.processes.child import Link, at_step


class Peer(Link):
    """The trainer's end of a connection `conn` to a process it did not start (an engine `gspo vllm-serve` runs,
    the engine another rank started): no process of ours. Its death is its connection closing (`cause`: whose
    death that may be); killing it is closing the connection."""

    def __init__(self, name: str, conn: Connection, cause: str, on_fail: Callable[[], None] = lambda: None,
                 stopped: str = ""):
        super().__init__(name, conn, on_fail, stopped)
        self.cause = cause

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
    """The trainer's end of an engine `gspo vllm-serve` started on another host (gspo/rollout/engine/server.py): a
    connection to `address` (host, port), authenticated with `key`. The server says how many threads its engine
    has, and the engine is sent `spec_of(threads)`; it is told `tensor_parallel_size` before it starts. An engine
    exits when its trainer is gone (the connection closed)."""

    def __init__(self, name: str, address: tuple[str, int], key: bytes, spec_of: Callable[[int], dict],
                 tensor_parallel_size: int, on_fail: Callable[[], None], timeout_s: float, stopped: str = ""):
        where = f"rollout.vllm.server={address[0]}:{address[1]}"

        def unreachable(e: OSError) -> Exception:
            return RunFailed(f"{where}: cannot connect ({e.strerror or e}): is `gspo vllm-serve --port {address[1]}` "
                             f"running on {address[0]}?")

        try:
            conn = dial(address, key, timeout_s, unreachable)
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

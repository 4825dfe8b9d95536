"""`gspo vllm-serve`: the vLLM engine for trainers on other hosts (`rollout.vllm.mode=server`). Imports no vllm.

A long-lived process on the engine's host, listening on HOST:PORT. A trainer's rank 0 connects; the connection
must prove it holds the shared secret (`GSPO_VLLM_KEY`, multiprocessing's HMAC challenge: the messages are
pickles, so nothing is read from a peer without the key) within a few seconds, on a thread of its own
(gspo/core/channel.py `Gate`): a peer that says nothing or holds another key is refused in a line and keeps no
one out. The server answers with the threads its engine will have, the trainer says how many tensor-parallel
workers it wants, and the server starts the engine process a trainer starts on its own host
(`python -m gspo.rollout.engine.vllm_engine FD`, gspo/rollout/engine/client.py), on the accepted socket itself: from
then on the trainer talks to its engine directly, as to a local one (the run's spec, "ready", weights over the weight
group, samples; the trainer's other ranks connect to it as to a shared engine). The engine ends with the run:
the trainer's "stop", or its connection closing (the trainer died), or the connection's TCP keepalive going
unanswered for about 2 minutes (the trainer's host lost power or was cut off without closing it:
`channel.KEEPALIVE`). One run at a time: a trainer that connects meanwhile is told the server is busy; then the
server waits for the next. SIGINT / SIGTERM stop the server and its engine: an engine dies with the server
(Linux PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Callable, Optional

from gspo.core.errors import ConfigError

KEY_ENV = "GSPO_VLLM_KEY"


def key() -> bytes:
    """The secret a trainer and its server share (the environment's GSPO_VLLM_KEY)."""
    value = os.environ.get(KEY_ENV, "")
    if not value:
        raise ConfigError(f"{KEY_ENV} is not set: the trainer and `gspo vllm-serve` authenticate with a secret they "
                          f"share (export {KEY_ENV}=... on both hosts; the engine reads pickled messages, so it "
                          "accepts no connection without it)")
    return value.encode()


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT as (host, port); a ConfigError naming the key otherwise."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"rollout.vllm.server={address}: expected HOST:PORT (where `gspo vllm-serve --port PORT` "
                          "listens)")
    return host, int(port)


def serve_runs(host: str, port: int, threads: int, runs: Optional[int] = None,
               say: Callable[[str], None] = print) -> None:
    """Listen on host:port and serve trainers one run at a time (`runs` of them; None: until stopped). A connection
    that does not prove the key within `channel.AUTH_S` (a port scan, a health check, a wrong key) is refused in a line
    and holds up no one (`channel.Gate`: at most `channel.PENDING` being proven at once, one more closed at once with a
    line); a trainer that connects while a run is served is told the server is busy."""
    from gspo.core.channel import Gate
    from gspo.rollout.engine.vllm_engine import environment
    from gspo.rollout.processes.child import RANK_VARS, root

    gate = Gate((host, port), key(), refused=lambda line: say(f"gspo vllm-serve: refused a connection from {line}"))
    say(f"gspo vllm-serve: listening on {host}:{gate.address[1]} ({threads} threads an engine)")
    engine: Optional[subprocess.Popen] = None

    def stop(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, stop)
    served = 0
    try:
        while runs is None or served < runs:
            conn = gate.accept(timeout=1.0)  # (a timeout: signals are handled between waits)
            if conn is None:
                continue
            try:
                tensor_parallel_size = _greet(conn, threads)
            except (EOFError, OSError, ValueError, TypeError, pickle.UnpicklingError) as e:  # it left, or is no trainer
                say(f"gspo vllm-serve: dropped a connection before its run started ({type(e).__name__}: {e})")
                conn.close()
                continue
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root(), os.environ.get("PYTHONPATH")])),
                   **environment(threads, tensor_parallel_size)}
            for k in RANK_VARS:
                env.pop(k, None)
            engine = subprocess.Popen([sys.executable, "-m", "gspo.rollout.engine.vllm_engine", str(conn.fileno())],
                                      env=env, pass_fds=(conn.fileno(),), start_new_session=True)
            conn.close()  # the engine holds the socket now (with its keepalive: a trainer that vanishes ends it)
            say(f"gspo vllm-serve: serving a run (engine pid {engine.pid})")
            while engine.poll() is None:
                _turn_away(gate.accept(timeout=0.5))
            say(f"gspo vllm-serve: the run ended (engine exit code {engine.returncode})")
            engine, served = None, served + 1
    except KeyboardInterrupt:
        say("gspo vllm-serve: stopped")
    finally:
        if engine is not None:  # it and the processes it started (its tensor-parallel workers)
            try:
                os.killpg(engine.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            engine.wait()
        gate.close()
        signal.signal(signal.SIGTERM, before)


def _turn_away(conn: Optional[Connection]) -> None:
    """Tell a trainer that connected while a run is served that the server is busy (it says so in one line)."""
    if conn is None:
        return
    try:
        conn.send_bytes(pickle.dumps(("busy",)))
    except OSError:
        pass
    conn.close()


def _greet(conn: Connection, threads: int) -> int:
    """The server's side of the handshake: its engine's threads out, the run's tensor-parallel size in."""
    conn.send_bytes(pickle.dumps(("server", threads)))
    if not conn.poll(60):
        raise ValueError("the trainer said nothing")
    kind, tensor_parallel_size = pickle.loads(conn.recv_bytes())
    if kind != "start":
        raise ValueError(f"expected 'start', got {kind!r}")
    return int(tensor_parallel_size)

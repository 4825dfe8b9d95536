"""The engine's network side, without vLLM: `gspo vllm-serve` (gspo/rollout/engine/server.py) with its engine
process replaced by a stand-in, and the listener of a shared engine (gspo/rollout/processes/serve.py `Clients`). A peer
that says nothing or holds another key is dropped without keeping real trainers or ranks out; a trainer that
connects during a run is told the server is busy; the connection an engine is handed has TCP keepalive, so an
engine whose trainer vanished without closing it ends and the server serves the next run. The listener (`Gate`)
survives a thread that cannot start and closes at once what is past its bound. And a killed engine's clean-up
removes its own shared memory only."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import AuthenticationError, Client, Connection
from types import SimpleNamespace

import pytest

from gspo.core.channel import Gate, dial
from gspo.core.errors import ConfigError, RunFailed
from gspo.rollout.engine import server as engine_server
from gspo.rollout.processes.child import root
from gspo.rollout.processes.peer import RemoteChild
from gspo.rollout.processes.serve import Clients

KEY = "the-secret"
DEADLINE_S = 60.0  # the most any of these waits: a test that reaches it has failed


class Engine:
    """Stands in for the engine process `gspo vllm-serve` starts (`python -m gspo.rollout.engine.vllm_engine FD`): takes
    the connection it is handed, notes its socket's TCP keepalive settings, reads the run's first message (its
    spec) and "runs" (a sleeping process) until the test ends it (`end`)."""

    started: list[Engine] = []

    def __init__(self, args: list[str], env=None, pass_fds=(), start_new_session=False):
        sock = socket.socket(fileno=os.dup(int(args[-1])))
        self.keepalive = {name: sock.getsockopt(level, getattr(socket, name)) for level, name in (
            (socket.SOL_SOCKET, "SO_KEEPALIVE"), (socket.IPPROTO_TCP, "TCP_KEEPIDLE"),
            (socket.IPPROTO_TCP, "TCP_KEEPINTVL"), (socket.IPPROTO_TCP, "TCP_KEEPCNT"),
            (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT"))}
        self.conn = Connection(sock.detach())  # (held open while it runs, as the engine holds it)
        self.spec = pickle.loads(self.conn.recv_bytes()) if self.conn.poll(DEADLINE_S) else None
        self.proc = subprocess.Popen(["sleep", str(int(DEADLINE_S))], start_new_session=True)
        self.pid = self.proc.pid
        Engine.started.append(self)

    def poll(self):
        return self.proc.poll()

    def wait(self, timeout=None):
        return self.proc.wait(timeout)

    @property
    def returncode(self):
        return self.proc.returncode

    def end(self) -> None:
        """The run ends: the engine exits."""
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


def trainer(port: int, key: str = KEY, timeout_s: float = 20.0) -> RemoteChild:
    """A run's rank 0 connecting to the server, as rollout.vllm.mode=server does (its spec: the threads it was
    offered)."""
    return RemoteChild("the vLLM engine", ("127.0.0.1", port), key.encode(), lambda threads: {"threads": threads},
                       1, on_fail=lambda: None, timeout_s=timeout_s)


def started(n: int) -> Engine:
    """The n-th engine the server started (1-based), once it has."""
    deadline = time.monotonic() + DEADLINE_S
    while len(Engine.started) < n:
        assert time.monotonic() < deadline, f"the server started {len(Engine.started)} engines, not {n}"
        time.sleep(0.01)
    return Engine.started[n - 1]


def serve(monkeypatch, runs: int, trainers) -> list[str]:
    """`serve_runs` on a free port of 127.0.0.1 for `runs` runs (here: it handles the signals), its engines stand-ins;
    `trainers(port, lines)` runs meanwhile on a thread of its own (`lines`: the server's, as they come), and what it
    raises is raised here. A server still serving after DEADLINE_S is stopped as by SIGTERM. The server's lines."""
    monkeypatch.setenv("GSPO_VLLM_KEY", KEY)
    monkeypatch.setattr(engine_server, "subprocess", SimpleNamespace(Popen=Engine))
    monkeypatch.setattr(Engine, "started", [])
    lines, errors, done = [], [], threading.Event()

    def side():
        try:
            deadline = time.monotonic() + DEADLINE_S
            while not any("listening on" in line for line in lines):
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.01)
            trainers(int(re.search(r"listening on 127\.0\.0\.1:(\d+)", lines[0]).group(1)), lines)
        except BaseException as e:  # noqa: BLE001  (raised in the test's thread)
            errors.append(e)
        finally:
            for engine in Engine.started:
                if engine.poll() is None:
                    engine.end()

    def watchdog():
        if not done.wait(DEADLINE_S):
            os.kill(os.getpid(), signal.SIGTERM)  # (serve_runs turns it into its stop)

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=side, daemon=True)
    thread.start()
    threading.Thread(target=watchdog, daemon=True).start()
    try:
        engine_server.serve_runs("127.0.0.1", 0, 2, runs=runs, say=lines.append)
    finally:
        done.set()
        signal.signal(signal.SIGTERM, before)
    thread.join(DEADLINE_S)
    if errors:
        raise errors[0]
    assert "gspo vllm-serve: stopped" not in lines, lines  # (the watchdog's)
    return lines


def ran(lines: list[str], n: int) -> None:
    """Wait until the server has said n runs ended."""
    deadline = time.monotonic() + DEADLINE_S
    while sum("the run ended" in line for line in lines) < n:
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)


def test_a_silent_connection_or_a_wrong_key_keeps_no_trainer_out_of_gspo_vllm_serve(monkeypatch):
    """A connection that says nothing (a port scan, a health check) stays open while a trainer connects: the trainer
    is served at once. A trainer with another key is refused in one line; the server goes on and serves the next
    run."""

    def trainers(port: int, lines: list[str]) -> None:
        silent = socket.create_connection(("127.0.0.1", port))
        try:
            first = trainer(port)
            assert started(1).spec == ("spec", {"threads": 2})
            with pytest.raises(ConfigError, match=r"^rollout.vllm.server=127.0.0.1:\d+: the server refused this "
                                                  r"run's GSPO_VLLM_KEY \(not the one it was started with\)$"):
                trainer(port, key="another")
            started(1).end()
            first.kill()
            ran(lines, 1)
            second = trainer(port)
            assert started(2).spec == ("spec", {"threads": 2})
            started(2).end()
            second.kill()
        finally:
            silent.close()

    lines = serve(monkeypatch, 2, trainers)
    assert sum(line.startswith("gspo vllm-serve: serving a run") for line in lines) == 2, lines
    assert any(re.match(r"gspo vllm-serve: refused a connection from 127.0.0.1:\d+: AuthenticationError", line)
               for line in lines), lines


def test_a_trainer_that_connects_during_a_run_is_told_the_server_is_busy(monkeypatch):
    def trainers(port: int, lines: list[str]) -> None:
        first = trainer(port)
        started(1)
        with pytest.raises(RunFailed, match=r"^rollout.vllm.server=127.0.0.1:\d+: the server is serving another run "
                                            r"\(it serves one at a time\)"):
            trainer(port)
        started(1).end()
        first.kill()

    serve(monkeypatch, 1, trainers)


def test_a_trainer_with_no_server_to_reach_or_a_wrong_key_is_told_so_in_one_line():
    """`RemoteChild` reaches the server by `dial` (gspo/core/channel.py): nothing listening is "cannot connect", with
    the command that would listen there; a server holding another key refuses the run's key (a ConfigError)."""
    with socket.socket() as probe:  # a port that was free a moment ago, and on which nothing listens now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RunFailed, match=rf"^rollout.vllm.server=127.0.0.1:{port}: cannot connect \(.+\): is `gspo "
                                        rf"vllm-serve --port {port}` running on 127.0.0.1\?$"):
        trainer(port, timeout_s=5.0)
    gate = Gate(("127.0.0.1", 0), b"the server's key", refused=lambda line: None)
    try:
        with pytest.raises(ConfigError, match=r"the server refused this run's GSPO_VLLM_KEY"):
            trainer(gate.address[1], key="another key", timeout_s=5.0)
    finally:
        gate.close()


def test_the_engine_a_server_starts_drops_a_vanished_trainer_by_tcp_keepalive(monkeypatch):
    """A trainer that vanishes without closing its connection (power loss, a partition) would leave the engine
    reading it for ever: the connection the engine is handed has TCP keepalive on, with a bound on unacknowledged
    data, so the kernel ends it after about 2 minutes of silence from the trainer's host (the engine exits, and the
    server serves the next run); a trainer that is alive answers the probes from its kernel, however long it
    trains between two steps."""
    def trainers(port: int, lines: list[str]) -> None:
        trainer(port)
        started(1).end()

    serve(monkeypatch, 1, trainers)
    assert Engine.started[0].keepalive == {"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10,
                                           "TCP_KEEPCNT": 6, "TCP_USER_TIMEOUT": 120_000}


def own_network() -> bool:
    """Whether this process may run a command in a network namespace of its own (`unshare -n`: root)."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


VANISH = """
import subprocess, time
from gspo.core import channel
channel.KEEPALIVE = (1, 1, 2)  # (the test's: 1 s idle, then 2 probes 1 s apart)
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
gate = channel.Gate(("127.0.0.1", 0), b"key", refused=print)
trainer = channel.dial(gate.address, b"key", 10)
engine = gate.accept(10)
subprocess.run(["ip", "link", "set", "lo", "down"], check=True)  # no packet passes from now on; nothing is closed
t0 = time.monotonic()
try:
    engine.recv_bytes()
except OSError as e:
    print(f"ended after {time.monotonic() - t0:.1f} s: {type(e).__name__}")
"""


@pytest.mark.skipif(not own_network(), reason="cutting a connection off needs a network namespace (unshare -n: root)")
def test_a_read_on_a_connection_whose_network_vanished_ends(tmp_path):
    """The keepalive at work, in a network namespace of its own: once a connection is proven (a `Gate`'s, as the
    engine's), the network under it goes away with neither end closing it (its loopback set down: as a power loss
    or a partition), and the engine's read on it ends with an error after the probes go unanswered (the keepalive
    shortened here to 1 s idle and 2 probes 1 s apart), where without keepalive it waits for ever."""
    script = tmp_path / "vanish.py"
    script.write_text(VANISH)
    res = subprocess.run(["unshare", "-n", sys.executable, str(script)], capture_output=True, text=True,
                         timeout=DEADLINE_S, env={**os.environ, "PYTHONPATH": root()})
    assert res.returncode == 0 and re.fullmatch(r"ended after \d+\.\d s: TimeoutError\n", res.stdout), \
        res.stdout + res.stderr[-2000:]


def test_a_wrong_key_or_a_silent_peer_keeps_no_rank_from_a_shared_engine(capsys):
    """rollout.vllm.mode=shared|server: the engine's listener for the trainer's other ranks. A peer with another key
    is dropped (a line on stderr), and so is one that says nothing; the rank still joins. Where no rank comes, the
    error says so after the wait it names, not before."""
    joined, threads = [], []

    def ranks(message: tuple) -> None:
        if message[0] != "listening":
            return
        _, port, key = message

        def connect():
            with pytest.raises(AuthenticationError):
                Client(("127.0.0.1", port), authkey=b"another key")
            silent = socket.create_connection(("127.0.0.1", port))
            joined.append(Client(("127.0.0.1", port), authkey=key))
            silent.close()

        threads.append(threading.Thread(target=connect, daemon=True))
        threads[0].start()

    clients = Clients(1, DEADLINE_S, "127.0.0.1", ranks)
    threads[0].join(DEADLINE_S)  # the engine may finish the handshake before the rank's side returns
    assert len(clients.conns) == 1 and len(joined) == 1
    joined[0].send_bytes(pickle.dumps(("sample", 3, {})))  # the rank's connection is the one the engine reads
    assert pickle.loads(clients.conns[0].recv_bytes()) == ("sample", 3, {})
    # The wrong key's line: the engine writes it after telling that peer so, and the silent peer's may come first.
    wrong = re.compile(r"gspo: the shared engine refused a connection from 127.0.0.1:\d+: AuthenticationError: ")
    refused, deadline = [], time.monotonic() + DEADLINE_S
    while not any(wrong.match(line) for line in refused) and time.monotonic() < deadline:
        refused += [line for line in capsys.readouterr().err.splitlines() if "refused a connection" in line]
        time.sleep(0.01)
    assert any(wrong.match(line) for line in refused), refused

    def wrong_key(message: tuple) -> None:
        if message[0] == "listening":
            threading.Thread(target=lambda: pytest.raises(AuthenticationError, Client, ("127.0.0.1", message[1]),
                                                          authkey=b"another key"), daemon=True).start()

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^0 of the 1 other ranks connected within 1 s$"):
        Clients(1, 1.0, "127.0.0.1", wrong_key)
    assert time.monotonic() - t0 >= 1.0


def test_a_thread_that_cannot_start_costs_its_connection_not_the_listener(monkeypatch):
    """A process that cannot start another thread (at its limit, for a moment) when a peer connects: that
    connection is closed, with a line, and the gate listens on: the next peer is authenticated. The listener used
    to end there, and `gspo vllm-serve` to stay up authenticating no one, without a word."""
    lines = []
    gate = Gate(("127.0.0.1", 0), KEY.encode(), refused=lines.append)
    start, failed = threading.Thread.start, []

    def at_its_limit_once(thread: threading.Thread) -> None:
        if thread.name == "gspo-gate-auth" and not failed:
            failed.append(thread)
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", at_its_limit_once)
    try:
        first = socket.create_connection(gate.address, timeout=DEADLINE_S)
        assert first.recv(1) == b""  # closed
        first.close()
        conn = dial(gate.address, KEY.encode(), 10.0)  # (the listener gone, this would wait out its 10 s)
        assert gate.accept(DEADLINE_S) is not None
        conn.close()
    finally:
        gate.close()
    assert failed and len(lines) == 1, lines
    assert re.fullmatch(r"127\.0\.0\.1:\d+: closed: no thread could be started to authenticate it \(can't start "
                        r"new thread\)", lines[0]), lines


def test_connections_past_the_bound_are_closed_at_once_and_the_gate_serves_when_one_is_free():
    """At most `pending` peers are being authenticated at once, each on one thread (no timer beside it): one more
    is closed at once with a line, not queued for ever nor given a thread; once a slot is free a peer with the key
    is authenticated."""
    lines = []
    gate = Gate(("127.0.0.1", 0), KEY.encode(), refused=lines.append, auth_s=DEADLINE_S, pending=2)
    silent = [socket.create_connection(gate.address, timeout=DEADLINE_S) for _ in range(2)]
    try:
        for sock in silent:  # each is sent its challenge: it holds a slot, for up to DEADLINE_S
            assert sock.recv(1)
        proving = [t for t in threading.enumerate() if t.name == "gspo-gate-auth"]
        assert len(proving) == 2 and not any(isinstance(t, threading.Timer) for t in threading.enumerate())
        t0 = time.monotonic()
        extra = socket.create_connection(gate.address, timeout=DEADLINE_S)
        assert extra.recv(1) == b"" and time.monotonic() - t0 < DEADLINE_S / 4  # closed at once, no challenge
        extra.close()
        assert len(lines) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+: closed at once: 2 connections are being "
                                                r"authenticated already, the most at once .*", lines[0]), lines
        silent.pop().close()  # dropped (EOFError): its slot is freed as its thread ends
        deadline = time.monotonic() + DEADLINE_S
        while sum(t.name == "gspo-gate-auth" for t in threading.enumerate()) > 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        conn = dial(gate.address, KEY.encode(), 10.0)
        assert gate.accept(DEADLINE_S) is not None
        conn.close()
    finally:
        for sock in silent:
            sock.close()
        gate.close()


def test_a_killed_child_leaves_another_programs_segment_made_meanwhile_alone(tmp_path):
    """`Child.kill` removes the shared memory the child's processes made and can no longer unlink (its own, made
    at start-up, and its worker's, made later), and nothing else: a segment another program of the same user made
    while the child ran, and holds by name alone (made, closed, to be opened later), survives, though it is new
    since the child started and no process maps it. The clean-up used to remove every such segment."""
    from multiprocessing import shared_memory

    from gspo.rollout.processes.child import Child
    from gspo.rollout.processes.shm import shm_segments

    (tmp_path / "standin.py").write_text(
        "import subprocess, sys\n"
        "from multiprocessing import shared_memory\n"
        "from gspo.rollout.processes.serve import serve\n"
        "def start(spec):\n"
        "    early = shared_memory.SharedMemory(create=True, size=4096)\n"  # made at start-up, kept for its life
        "    def handle(message):\n"
        "        code = 'from multiprocessing import shared_memory as s; import time; ' \\\n"
        "               'm = s.SharedMemory(create=True, size=4096); print(m.name, flush=True); time.sleep(600)'\n"
        "        worker = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)\n"
        "        handle.kept = (early, worker)\n"
        "        return ('made', [early.name, worker.stdout.readline().strip()])\n"
        "    return handle\n"
        "sys.exit(serve(int(sys.argv[1]), start))\n")
    child = Child("the stand-in", "standin", {}, on_fail=lambda: None, env={"PYTHONPATH": f"{root()}:{tmp_path}"})
    foreign = None
    try:
        child.expect("ready", None, DEADLINE_S)
        _, made = child.ask(("make",), "made", DEADLINE_S)
        foreign = shared_memory.SharedMemory(create=True, size=4096)  # another program's, after the child started
        foreign.close()  # held by name alone from here on
        assert set(made) | {foreign.name} <= shm_segments()
    finally:
        child.kill()
    try:
        assert not set(made) & shm_segments()  # the child's, its own and its worker's: removed
        assert foreign.name in shm_segments()  # not the child's: kept
    finally:
        if foreign is not None:
            foreign.unlink()

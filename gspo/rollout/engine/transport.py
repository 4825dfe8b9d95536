"""Weights as tensors over a process group (`rollout.vllm.weight_transport=tensors`): nothing here imports vllm.

The trainer (rank 0) broadcasts its weights to the engine's workers (ranks 1 .. N: one per tensor-parallel rank,
each loads every weight and keeps its shard) over a torch.distributed group of their own, apart from the
trainer's DDP group: gloo where the tensors are on a CPU (or where trainer and engine share a GPU: NCCL refuses
two ranks on one device), NCCL between distinct GPUs; the same calls either way (`backend_for`). The group meets
through a store the trainer serves (`host_store`, `KeyStore`) on a free port of loopback where the engine is on its
host, of every interface where it is not (`rollout.vllm.mode=server`): a member must prove it holds the store's
secret, fresh for each group, before it reads or writes a key (torch's TCPStore listens on every interface, admits
any peer and lists its keys to it: a stranger could join as the engine and be sent the weights). The port and the
secret travel over the engine's own channel (its socket pair, or the connection authenticated with
GSPO_VLLM_KEY). Where the store is on loopback, gloo's own connections are too; across hosts gloo listens on the
route between them alone (`Group.gloo_devices`). gloo's and NCCL's own connections carry no key: once connected,
each member proves it holds the store's secret to the others (`Group.prove`) before any weight moves.

A push is a stream of buckets (`Sender.push` / `receive`): weights packed whole, in order, into one flat byte
buffer of `bucket_bytes` (each at a 64-byte offset), sent as three broadcasts: a header (the manifest's length,
the data's length), the manifest (JSON: each weight's name, dtype, shape and offset) and the data. A header of
zeros ends the push. The receiver loads what arrives: it needs no layout beforehand. A weight larger than a
bucket travels alone (from its own storage when it is already contiguous, of the pushed dtype, on the group's
device: no copy). The sender's extra memory is one bucket, reused, or the largest weight where that is larger and
needs a cast. The receiver allocates each bucket afresh (vLLM may hold a layer's first weights until the layer is
complete, so a reused buffer would be overwritten under it): its extra memory is every bucket vLLM still holds,
at least one (how many at once is not measured).

A delta push (`rollout.vllm.weight_transport=delta`, gspo/rollout/engine/delta.py) is the same stream of buckets with
other manifest entries (`Sender.push_entries` / `receive_entries`): each entry's JSON (what it is and how it is
encoded) with the offset and length of its payload, bytes, in the bucket. `Sender.wire_bytes` counts every byte a
sender broadcast (headers, manifests, data).

A dead or silent peer does not hang the sender: each broadcast is polled, with the peer's liveness checked, up to
`timeout_s` (the group's own timeout too), and raises `PeerLost`, which the caller turns into the run's one line.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import pickle
import socket
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from gspo.core.channel import AUTH_S, Gate, dial
from gspo.core.errors import RunFailed

ALIGN = 64  # bytes: every weight starts at a multiple of this in a bucket (any dtype can view it)
MAX_ENTRIES = 4096  # a delta push's entries per bucket at most (many are empty: the manifest stays small)
HOST = "127.0.0.1"  # the engine runs on the trainer's host
EVERY = "0.0.0.0"  # every interface: an engine on another host (rollout.vllm.mode=server)


class PeerLost(RuntimeError):
    """The other side of the group died, or sent nothing for the timeout."""


def device_identity(device: torch.device) -> str:
    """What tells two processes' devices apart: "cpu", or a CUDA device's UUID (the same GPU under any
    CUDA_VISIBLE_DEVICES numbering)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def backend_for(trainer: str, engine: list[str]) -> str:
    """The group's backend, from the devices' identities (`device_identity`): NCCL where every member has a GPU of
    its own, gloo otherwise (CPUs; or a GPU shared by two members, which NCCL refuses: "Duplicate GPU detected")."""
    members = [trainer, *engine]
    if all(m.startswith("cuda:") for m in members) and len(set(members)) == len(members):
        return "nccl"
    return "gloo"


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where a member's buckets live: on its GPU for NCCL, in host memory for gloo."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


def host_store(timeout_s: float, bind: str = HOST) -> "KeyStore":
    """The trainer's store for the weight group, on a free port of `bind` (HOST: this host's loopback; EVERY: every
    interface), with a fresh secret (`KeyStore`)."""
    return KeyStore(bind, timeout_s)


class KeyStore:
    """The weight group's rendezvous, served by the trainer: keys and values in this process, on a free port
    (`port`) of `bind`, to peers that prove they hold `secret` (a fresh random one; multiprocessing's HMAC
    challenge, each peer on a thread of its own within `child.AUTH_S`). A peer without it reads and writes nothing:
    it cannot join the group. The members use it through `StoreClient`; a key read waits up to `timeout_s`."""

    # the operations of torch's Store that gloo and NCCL use to meet (each a method `_<name>` below)
    OPERATIONS = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys")

    def __init__(self, bind: str, timeout_s: float):
        self.bind, self.timeout_s, self.secret = bind, timeout_s, os.urandom(32)
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()  # (guards values, members and closed)
        self.members: list[Connection] = []
        self.routes: list[tuple[tuple, str]] = []  # each member's (address, this host's address it reached us at)
        self.closed = False
        self.gate = Gate((bind, 0), self.secret, refused=lambda line: print(
            f"gspo: the weight group's store refused a connection from {line}", file=sys.stderr, flush=True))
        self.port = self.gate.address[1]
        threading.Thread(target=self._accept, name="gspo-weight-store", daemon=True).start()

    def close(self) -> None:
        """Stop serving: no one joins any more, and a member still waiting on a key is told at once."""
        self.gate.close()
        with self.changed:
            self.closed = True
            self.changed.notify_all()
            members, self.members = self.members, []
        for conn in members:
            try:  # (wakes the member blocked reading it: it sees the connection close)
                socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while (conn := self.gate.accept()) is not None:
            try:
                here, there = ends(conn)
            except OSError:  # (gone already)
                conn.close()
                continue
            with self.changed:
                if self.closed:
                    conn.close()
                    return
                self.members.append(conn)
                self.routes.append((there, here[0]))
                self.changed.notify_all()
            try:
                threading.Thread(target=self._serve, args=(conn,), name="gspo-weight-store", daemon=True).start()
            except RuntimeError as e:  # no thread to be had: this member is dropped, the store serves on
                conn.close()
                print(f"gspo: the weight group's store dropped a member at {there[0]}:{there[1]}: {e}",
                      file=sys.stderr, flush=True)

    def reached_at(self, besides: tuple, timeout_s: float) -> str:
        """This host's address at which a member other than `besides` (the trainer's own client, on loopback)
        reached the store: the interface the engine's host reaches this one through. Waits up to `timeout_s`."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or any(p != besides for p, _ in self.routes), timeout_s)
            found = [here for p, here in self.routes if p != besides]
        if not found:
            raise TimeoutError(f"no member of the weight group reached its store within {timeout_s:g} s")
        return found[0]

    def _serve(self, conn: Connection) -> None:
        """One member's requests, (operation, arguments) each, answered in order until it leaves."""
        with conn:
            while True:
                try:
                    op, args = pickle.loads(conn.recv_bytes())  # (a proven member's pickle)
                except (EOFError, OSError):
                    return
                try:
                    if op not in self.OPERATIONS:
                        raise ValueError(f"no operation {op!r}")
                    reply = ("ok", getattr(self, f"_{op}")(*args))
                except Exception as e:  # noqa: BLE001  (raised on the member's side)
                    reply = ("error", f"{type(e).__name__}: {e}")
                try:
                    conn.send_bytes(pickle.dumps(reply))
                except OSError:
                    return

    # the operations, on this process's dict
    def _set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = bytes(value)
            self.changed.notify_all()

    def _get(self, key: str) -> bytes:
        self._wait([key])
        with self.changed:
            return self.values[key]  # (a KeyError once closed)

    def _add(self, key: str, amount: int) -> int:
        with self.changed:
            total = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(total).encode()
            self.changed.notify_all()
            return total

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.changed:  # (torch's semantics: a missing key counts as the empty value)
            current = self.values.get(key)
            if (current if current is not None else b"") == bytes(expected):
                self.values[key] = bytes(desired)
                self.changed.notify_all()
                return bytes(desired)
            return current if current is not None else bytes(expected)

    def _check(self, keys: list[str]) -> bool:
        with self.changed:
            return all(k in self.values for k in keys)

    def _wait(self, keys: list[str], timeout_s: Optional[float] = None) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: self.closed or all(k in self.values for k in keys),
                                         timeout_s or self.timeout_s):
                raise TimeoutError(f"the weight group's members did not all arrive within "
                                   f"{timeout_s or self.timeout_s:g} s (keys {keys})")

    def _delete_key(self, key: str) -> bool:
        with self.changed:
            return self.values.pop(key, None) is not None

    def _num_keys(self) -> int:
        with self.changed:
            return len(self.values)


class StoreClient(dist.Store):
    """A member's view of the trainer's `KeyStore` at host:port, authenticated with its `secret`: a torch Store
    (what gloo and NCCL meet through), each operation a request answered by the trainer. Whoever builds a process
    group on it keeps a reference to it (torch holds only its C++ half)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float):
        super().__init__()
        self.timeout_s, self.lock = timeout_s, threading.Lock()
        self.conn = dial((host, port), secret, AUTH_S)

    def _ask(self, op: str, *args):
        with self.lock:
            self.conn.send_bytes(pickle.dumps((op, args)))
            if not self.conn.poll(self.timeout_s + AUTH_S):  # (the store answers within timeout_s)
                raise TimeoutError(f"the weight group's store said nothing for {self.timeout_s + AUTH_S:g} s")
            status, value = pickle.loads(self.conn.recv_bytes())
        if status != "ok":
            raise RuntimeError(f"the weight group's store: {value}")
        return value

    def set(self, key: str, value) -> None:
        self._ask("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._ask("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._ask("add", key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._ask("compare_set", key, as_bytes(expected), as_bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", list(keys))

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        self._ask("wait", list(keys), None if timeout is None else timeout.total_seconds())

    def delete_key(self, key: str) -> bool:
        return self._ask("delete_key", key)

    def num_keys(self) -> int:
        return self._ask("num_keys")

    def close(self) -> None:
        self.conn.close()


def ends(conn: Connection) -> tuple[tuple, tuple]:
    """(this side's address, the peer's) of a connection over TCP."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        return sock.getsockname()[:2], sock.getpeername()[:2]
    finally:
        sock.close()


def member_tag(secret: bytes, rank: int) -> list[int]:
    """What member `rank` shows the others once the group is connected: an HMAC of its rank under the store's
    secret (a fresh one for each group), which a process that never had the secret cannot make."""
    return list(hmac.new(secret, f"gspo weight group member {rank}".encode(), "sha256").digest())


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this host's loopback."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class Group:
    """One member of the weight group: rank 0 sends, the others receive. `store`: the trainer's (`host_store`), or
    for a receiver None: it connects to the trainer's at `host`:`port` with the store's `secret`. Constructing it
    waits until every member has joined; with `alive` (the sender's view of its peers) it stops waiting when they
    are gone. gloo's own sockets listen on one address (`gloo_devices`): loopback where the store is on it, else the
    address the members reach each other at through the store. Once connected, every member shows the others it
    holds the store's secret (`member_tag`), or the group is left with a RunFailed naming the rank that did not:
    gloo's (and NCCL's) own connections carry no key, so this is what keeps a process that raced the engine to
    them from being sent the weights or sending its own."""

    def __init__(self, backend: str, rank: int, world: int, timeout_s: float, device: torch.device,
                 store: Optional[KeyStore] = None, port: Optional[int] = None, secret: Optional[bytes] = None,
                 alive: Optional[Callable[[], bool]] = None, host: str = HOST):
        timeout = timedelta(seconds=timeout_s)
        self.backend, self.rank, self.world, self.timeout_s = backend, rank, world, timeout_s
        self.device = buffer_device(backend, device)
        self.server, self.store, self.pg = store, None, None  # the trainer's store: stopped with the group
        local = is_loopback(host if store is None else store.bind)
        if store is not None:
            port, secret, host = store.port, store.secret, HOST  # (the trainer reaches its own store on loopback)

        def connect():
            if backend == "nccl":  # (connects at its first collective; its sockets on NCCL_SOCKET_IFNAME's)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(prefixed, rank, world, options)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = self.gloo_devices(local, timeout_s)
            return dist.ProcessGroupGloo(prefixed, rank, world, options)  # (connects every member here)

        try:
            self.store = StoreClient(host, port, secret, timeout_s)  # (kept: torch holds only its C++ half)
            prefixed = dist.PrefixStore("gspo-weights", self.store)
            self.pg = connect() if alive is None else _watched(connect, alive, timeout_s)
            self.prove(secret, alive)  # every member is connected, and is who it says, from here on
        except BaseException:
            self.close()
            raise

    def gloo_devices(self, local: bool, timeout_s: float) -> list:
        """Where gloo's sockets listen: loopback on one host; else the interfaces GLOO_SOCKET_IFNAME names, if it
        is set; else the one address through which the members reach each other: a receiver's own end of its
        connection to the store, the trainer's end of the first engine member's (`KeyStore.reached_at`). (gloo's
        default, the address this host's name resolves to, may be another interface, or one other hosts cannot
        reach; and torch reads GLOO_SOCKET_IFNAME only for groups it makes itself.)"""
        create = dist.ProcessGroupGloo.create_device
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        if local:
            return [create(hostname=HOST)]
        if names:
            return [create(interface=n) for n in names]
        mine = ends(self.store.conn)[0]
        return [create(hostname=mine[0] if self.server is None else self.server.reached_at(mine, timeout_s))]

    def prove(self, secret: bytes, alive: Optional[Callable[[], bool]] = None) -> None:
        """Every member's `member_tag`, summed into one table by an all-reduce (each adds its own row to zeros)
        and checked here: a rank whose row is not its tag is a process without the store's secret in the
        engine's place (RunFailed, naming it)."""
        tags = torch.zeros(self.world, 32, dtype=torch.int64)
        tags[self.rank] = torch.tensor(member_tag(secret, self.rank))
        tags = tags.to(self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self._finish(self.pg.allreduce([tags], options), alive)
        wrong = [r for r, row in enumerate(tags.cpu().tolist()) if row != member_tag(secret, r)]
        if wrong:
            raise RunFailed(f"the weight group: rank {', '.join(map(str, wrong))} did not prove it holds the group's "
                            "secret: a process that is not the engine's answered on the group's own connections "
                            "(gloo's or NCCL's, which carry no key); the group was left before any weight was sent")

    def broadcast(self, tensor: torch.Tensor, alive: Optional[Callable[[], bool]] = None) -> None:
        """Rank 0's `tensor` into every member's; on rank 0 polled, with `alive()` (the peer's liveness) checked."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._finish(self.pg.broadcast([tensor], options), alive)

    def _finish(self, work, alive: Optional[Callable[[], bool]]) -> None:
        """Wait for a collective's `work`: plainly, or polled with `alive()` checked (PeerLost)."""
        if alive is None:
            work.wait()
            return
        _poll(work.is_completed, alive, self.timeout_s)
        try:
            work.wait()
        except RuntimeError as e:  # the backend's own error (a connection reset by the dying peer, its timeout)
            raise PeerLost(" ".join(str(e).split())[:300]) from None

    def close(self) -> None:
        """Leave the group (its connections closed; on the trainer, the store's server stopped)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort() if self.backend == "nccl" else pg.shutdown()
            except RuntimeError:
                pass  # a backend without a shutdown: its connections close with the object
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            self.server.close()
        self.store = self.server = None


def _poll(done: Callable[[], bool], alive: Callable[[], bool], timeout_s: float) -> None:
    """Wait until `done()`, or raise PeerLost when `alive()` turns false or `timeout_s` passes."""
    deadline, pause = time.monotonic() + timeout_s, 1e-4
    while not done():
        if not alive():
            raise PeerLost("the receiving process exited")
        if time.monotonic() > deadline:
            raise PeerLost(f"nothing received for {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 0.002)  # a bucket takes milliseconds: poll fast, then settle


def _watched(fn: Callable, alive: Callable[[], bool], timeout_s: float):
    """`fn()`, which blocks until the peers take part, run in a thread so that a dead peer is noticed (`_poll`);
    its exception raised here. A thread left blocked ends at the group's timeout."""
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            result["error"] = e

    thread = threading.Thread(target=run, name="gspo-weight-group", daemon=True)
    thread.start()
    _poll(lambda: not thread.is_alive(), alive, timeout_s)
    if "error" in result:
        raise PeerLost(" ".join(str(result["error"]).split())[:300])
    return result["value"]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat bytes (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class Sender:
    """Rank 0's side: pushes (name, tensor) pairs, cast to `dtype` (None: as they are), in buckets of
    `bucket_bytes`; `alive()` says whether the receivers still run."""

    def __init__(self, group: Group, bucket_bytes: int, dtype: Optional[torch.dtype] = None,
                 alive: Optional[Callable[[], bool]] = None):
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes}: at least {ALIGN}")
        self.group, self.bucket_bytes, self.dtype, self.alive = group, bucket_bytes, dtype, alive
        self.buffer: Optional[torch.Tensor] = None  # the bucket, reused across buckets and pushes
        self.wire_bytes = 0  # every byte broadcast so far (headers, manifests and data): what crossed the group

    @torch.no_grad()
    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Every weight, then the end of the push; the bytes of weights sent."""
        manifest, used, sent = [], 0, 0
        for name, tensor in weights:
            dtype = self.dtype or tensor.dtype
            nbytes = tensor.numel() * dtype.itemsize
            entry = {"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": list(tensor.shape)}
            if nbytes > self.bucket_bytes:  # alone, after the bucket so far
                self._flush(manifest, used)
                manifest, used = [], 0
                self._send([{**entry, "offset": 0}], self._alone(tensor, dtype), nbytes)
            else:
                if _aligned(used) + nbytes > self.bucket_bytes:
                    self._flush(manifest, used)
                    manifest, used = [], 0
                if self.buffer is None:
                    self.buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
                at = _aligned(used)
                self.buffer[at : at + nbytes].view(dtype).view(tensor.shape).copy_(tensor)
                manifest.append({**entry, "offset": at})
                used = at + nbytes
            sent += nbytes
        self._flush(manifest, used)
        self._header(0, 0)
        return sent

    @torch.no_grad()
    def push_entries(self, entries: Iterable[tuple[dict, torch.Tensor]]) -> int:
        """Entries of a delta push (gspo/rollout/engine/delta.py): each a manifest entry (JSON) and its payload, flat
        bytes (uint8, possibly empty), packed into buckets as weights are; then the end of the push. The payload bytes
        sent."""
        manifest, used, sent = [], 0, 0
        for entry, payload in entries:
            nbytes = payload.numel()
            if nbytes > self.bucket_bytes:
                self._flush(manifest, used)
                manifest, used = [], 0
                self._send([{**entry, "offset": 0, "nbytes": nbytes}], self._alone(payload, torch.uint8), nbytes)
            else:
                if _aligned(used) + nbytes > self.bucket_bytes or len(manifest) >= MAX_ENTRIES:
                    self._flush(manifest, used)
                    manifest, used = [], 0
                if self.buffer is None:
                    self.buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
                at = _aligned(used)
                self.buffer[at : at + nbytes].copy_(payload)
                manifest.append({**entry, "offset": at, "nbytes": nbytes})
                used = at + nbytes
            sent += nbytes
        self._flush(manifest, used)
        self._header(0, 0)
        return sent

    def _alone(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A weight larger than a bucket, as bytes on the group's device: its own storage where it can be."""
        if tensor.dtype == dtype and tensor.device == self.group.device and tensor.is_contiguous():
            return _bytes(tensor.detach())
        return _bytes(tensor.detach().to(device=self.group.device, dtype=dtype).contiguous())

    def _flush(self, manifest: list, used: int) -> None:
        if manifest:
            self._send(manifest, self.buffer, used)

    def _header(self, meta: int, data: int) -> None:
        self.group.broadcast(torch.tensor([meta, data], dtype=torch.int64, device=self.group.device), self.alive)
        self.wire_bytes += 16

    def _send(self, manifest: list, data: torch.Tensor, nbytes: int) -> None:
        meta = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8).to(self.group.device)
        self._header(meta.numel(), nbytes)
        self.group.broadcast(meta, self.alive)
        if nbytes:
            self.group.broadcast(data[:nbytes], self.alive)
        self.wire_bytes += meta.numel() + nbytes


def receive(group: Group) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A receiver's side of one push: each bucket's weights (views of a buffer allocated for that bucket), in the
    order they were pushed, until the sender's end of the push."""
    for manifest, data in _buckets(group):
        out = []
        for e in manifest:
            dtype = _dtype(e["dtype"])
            n = int(torch.Size(e["shape"]).numel()) * dtype.itemsize
            out.append((e["name"], data[e["offset"] : e["offset"] + n].view(dtype).view(e["shape"])))
        yield out


def receive_entries(group: Group) -> Iterator[list[tuple[dict, torch.Tensor]]]:
    """A receiver's side of one delta push (`Sender.push_entries`): each bucket's entries, (manifest entry, its
    payload: a view of the bucket's bytes), in order, until the sender's end of the push."""
    for manifest, data in _buckets(group):
        yield [(e, data[e["offset"] : e["offset"] + e["nbytes"]]) for e in manifest]


def _buckets(group: Group) -> Iterator[tuple[list, torch.Tensor]]:
    """(manifest, data) of each bucket of one push, until its end."""
    while True:
        header = torch.zeros(2, dtype=torch.int64, device=group.device)
        group.broadcast(header)
        meta_bytes, data_bytes = header.tolist()
        if meta_bytes == 0:
            return
        meta = torch.empty(meta_bytes, dtype=torch.uint8, device=group.device)
        group.broadcast(meta)
        manifest = json.loads(bytes(meta.cpu().numpy()).decode())
        data = torch.empty(data_bytes, dtype=torch.uint8, device=group.device)
        if data_bytes:
            group.broadcast(data)
        yield manifest, data

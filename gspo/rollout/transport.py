"""Weights as tensors over a process group (`rollout.vllm.weight_transport=tensors`): nothing here imports vllm.

The trainer (rank 0) broadcasts its weights to the engine's workers (ranks 1 .. N: one per tensor-parallel rank,
each loads every weight and keeps its shard) over a torch.distributed group of their own, apart from the
trainer's DDP group: gloo where the tensors are on a CPU (or where trainer and engine share a GPU: NCCL refuses
two ranks on one device), NCCL between distinct GPUs; the same calls either way (`backend_for`). The group meets
through a TCP store on a free port of localhost that the trainer opens (`host_store`); the port travels over the
engine's pipe.

A push is a stream of buckets (`Sender.push` / `receive`): weights packed whole, in order, into one flat byte
buffer of `bucket_bytes` (each at a 64-byte offset), sent as three broadcasts: a header (the manifest's length,
the data's length), the manifest (JSON: each weight's name, dtype, shape and offset) and the data. A header of
zeros ends the push. The receiver loads what arrives: it needs no layout beforehand. A weight larger than a
bucket travels alone (from its own storage when it is already contiguous, of the pushed dtype, on the group's
device: no copy). The sender's extra memory is one bucket, reused, or the largest weight where that is larger and
needs a cast. The receiver allocates each bucket afresh (vLLM may hold a layer's first weights until the layer is
complete, so a reused buffer would be overwritten under it): its extra memory is every bucket vLLM still holds,
at least one (how many at once is not measured).

A dead or silent peer does not hang the sender: each broadcast is polled, with the peer's liveness checked, up to
`timeout_s` (the group's own timeout too), and raises `PeerLost`, which the caller turns into the run's one line.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

ALIGN = 64  # bytes: every weight starts at a multiple of this in a bucket (any dtype can view it)
HOST = "127.0.0.1"  # the engine runs on the trainer's host


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


def host_store(timeout_s: float) -> tuple[dist.TCPStore, int]:
    """The trainer's TCP store on a free port of localhost (the OS picks it): (the store, its port)."""
    store = dist.TCPStore(HOST, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, store.port


class Group:
    """One member of the weight group: rank 0 sends, the others receive. `store`: the trainer's (`host_store`) or,
    for a receiver, None (it connects to `port` on `host`, the trainer's). Constructing it waits until every member
    has joined; with `alive` (the sender's view of its peers) it stops waiting when they are gone."""

    def __init__(self, backend: str, rank: int, world: int, timeout_s: float, device: torch.device,
                 store: Optional[dist.Store] = None, port: Optional[int] = None,
                 alive: Optional[Callable[[], bool]] = None, host: str = HOST):
        timeout = timedelta(seconds=timeout_s)
        self.backend, self.rank, self.world, self.timeout_s = backend, rank, world, timeout_s
        self.device = buffer_device(backend, device)
        self.store = store if store is not None else dist.TCPStore(host, port, None, False, timeout)
        prefixed = dist.PrefixStore("gspo-weights", self.store)

        def connect():
            if backend == "nccl":  # (connects at its first collective)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                return dist.ProcessGroupNCCL(prefixed, rank, world, options)
            return dist.ProcessGroupGloo(prefixed, rank, world, timeout)  # (connects every member here)

        self.pg = connect() if alive is None else _watched(connect, alive, timeout_s)
        self.broadcast(torch.zeros(1, device=self.device), alive)  # every member is connected from here on

    def broadcast(self, tensor: torch.Tensor, alive: Optional[Callable[[], bool]] = None) -> None:
        """Rank 0's `tensor` into every member's; on rank 0 polled, with `alive()` (the peer's liveness) checked."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        work = self.pg.broadcast([tensor], options)
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
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None:
            try:
                pg.abort() if self.backend == "nccl" else pg.shutdown()
            except RuntimeError:
                pass  # a backend without a shutdown: its connections close with the object
        self.store = None


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

    def _send(self, manifest: list, data: torch.Tensor, nbytes: int) -> None:
        meta = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8).to(self.group.device)
        self._header(meta.numel(), nbytes)
        self.group.broadcast(meta, self.alive)
        if nbytes:
            self.group.broadcast(data[:nbytes], self.alive)


def receive(group: Group) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A receiver's side of one push: each bucket's weights (views of a buffer allocated for that bucket), in the
    order they were pushed, until the sender's end of the push."""
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
        out = []
        for e in manifest:
            dtype = _dtype(e["dtype"])
            n = int(torch.Size(e["shape"]).numel()) * dtype.itemsize
            out.append((e["name"], data[e["offset"] : e["offset"] + n].view(dtype).view(e["shape"])))
        yield out

"""Weights as tensors (gspo/rollout/engine/transport.py, `rollout.vllm.weight_transport=tensors`) over a gloo group of
two local processes, the trainer's side here and a receiver spawned: what arrives is what was pushed, bitwise (cast as
the file push casts), in buckets no larger than asked; a receiver that dies or goes silent ends the push with
`PeerLost`, never a hang; the group listens on loopback only on one host, and admits no peer without its
store's secret; across hosts gloo listens only where the members reach each other, and a member in the group
without the secret is refused before any weight."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Client

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gspo.core.errors import RunFailed
from gspo.rollout.engine import transport
from gspo.rollout.engine.transport import ALIGN, Group, PeerLost, Sender, backend_for, host_store, receive

TIMEOUT_S = 300.0  # (a spawned receiver imports torch: slow on a busy machine)


def _receiver(port: int, secret: bytes, pushes: int, out: str, stop: bool, host: str = transport.HOST) -> None:
    """Rank 1: join (through the store at `host`), receive `pushes` pushes, save every bucket (names, tensors, the
    bucket's data bytes), and where its sockets listen (`out`.listening)."""
    torch.set_num_threads(1)
    group = Group("gloo", 1, 2, TIMEOUT_S, torch.device("cpu"), port=port, secret=secret, host=host)
    with open(out + ".listening", "w") as f:
        f.write(repr(sorted(listening())))
    if stop:  # joined, then silent: stopped as by SIGSTOP
        os.kill(os.getpid(), signal.SIGSTOP)
    got = []
    for _ in range(pushes):
        got.append([[(name, t.clone(), t.untyped_storage().nbytes()) for name, t in bucket] for bucket in receive(group)])
    torch.save(got, out)
    group.close()


def start(tmp_path, pushes: int = 1, stop: bool = False, bind: str = transport.HOST):
    """A receiver process and the sender's group, its store on `bind`: (process, group, where the receiver saves
    what it got)."""
    store = host_store(TIMEOUT_S, bind)
    out = str(tmp_path / "got.pt")
    proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, store.secret, pushes, out, stop),
                                           daemon=True)
    proc.start()
    group = Group("gloo", 0, 2, TIMEOUT_S, torch.device("cpu"), store=store, alive=proc.is_alive)
    return proc, group, out


def weights():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(8, 6, generator=g)
    return [("a.weight", torch.randn(4, 3, generator=g)), ("a.bias", torch.randn(3, generator=g)),
            ("scale", torch.tensor(2.5)), ("empty", torch.zeros(0, 5)),
            ("big", torch.randn(40, 10, generator=g)),  # 1,600 bytes in float32: larger than a bucket
            ("strided", wide[:, ::2]), ("ids", torch.arange(7, dtype=torch.int64)),
            ("half", torch.randn(5, 5, generator=g).to(torch.bfloat16))]


def test_a_push_arrives_whole_and_bitwise_in_buckets_no_larger_than_asked(tmp_path):
    """Two pushes over one group: every weight arrives under its name and shape with the bytes `Tensor.copy_` casts
    it to (what the file push writes into its slot), float32 and bfloat16 targets alike; each bucket holds at most
    `bucket_bytes` (a weight larger than that alone, in a buffer of its own size), whole weights, in push order."""
    bucket = 512
    proc, group, out = start(tmp_path, pushes=2)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            assert Sender(group, bucket, dtype, alive=proc.is_alive).push(weights()) > 0
        proc.join(TIMEOUT_S)
    finally:
        group.close()
    assert proc.exitcode == 0
    got = torch.load(out)
    for dtype, buckets in zip((torch.float32, torch.bfloat16), got):
        flat = [(name, t) for b in buckets for name, t, _ in b]
        assert [name for name, _ in flat] == [name for name, _ in weights()]
        for (name, t), (_, w) in zip(flat, weights()):
            want = torch.empty(w.shape, dtype=dtype).copy_(w)
            assert t.dtype == dtype and t.shape == w.shape, name
            assert torch.equal(t.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name
        for b in buckets:
            size = b[0][2]
            assert size <= bucket or (len(b) == 1 and size == b[0][1].numel() * b[0][1].element_size())
        assert [len(b) for b in buckets] == [4, 1, 3]  # the large weight between two buckets


def _delta_receiver(port: int, secret: bytes, pushes: int, out: str) -> None:
    """Rank 1 of a delta push (rollout.vllm.weight_transport=delta): each push into a Mirror; every status and the
    weights it ends with saved to `out`."""
    from gspo.rollout.engine.delta import Mirror

    torch.set_num_threads(1)
    group = Group("gloo", 1, 2, TIMEOUT_S, torch.device("cpu"), port=port, secret=secret)
    mirror, statuses = Mirror(), []
    for _ in range(pushes):
        statuses.append(mirror.receive(transport.receive_entries(group)))
    torch.save((statuses, mirror.tensors), out)
    group.close()


def test_a_delta_push_crosses_the_group_in_buckets_and_counts_every_byte(tmp_path):
    """Delta pushes over a real group in buckets of 256 bytes (entries several to a bucket, a large payload alone,
    empty heads and trailers between): the receiver's copy is the sender's weights bitwise after each, a lost delta
    is refused there as in one process, and `wire_bytes` counts what crossed (headers, manifests, payloads)."""
    from gspo.rollout.engine.delta import Tracker, whole_regions

    store = host_store(TIMEOUT_S)
    out = str(tmp_path / "got.pt")
    proc = mp.get_context("spawn").Process(target=_delta_receiver, args=(store.port, store.secret, 4, out),
                                           daemon=True)
    proc.start()
    group = Group("gloo", 0, 2, TIMEOUT_S, torch.device("cpu"), store=store, alive=proc.is_alive)
    w = {name: t.float().contiguous() for name, t in weights() if t.is_floating_point()}
    tracker = Tracker(torch.bfloat16)
    regions = lambda: whole_regions((n, t, True) for n, t in w.items())  # noqa: E731
    try:
        sender = Sender(group, 256, alive=proc.is_alive)
        sent = [sender.push_entries(tracker.push(regions()))]
        w["big"][3, :4] += 1.0
        sent.append(sender.push_entries(tracker.push(regions())))
        w["a.weight"] += 1.0
        list(tracker.push(regions()))  # lost
        w["half"] *= 2
        sent.append(sender.push_entries(tracker.push(regions())))
        sent.append(sender.push_entries(tracker.resend()))
        proc.join(TIMEOUT_S)
    finally:
        group.close()
    assert proc.exitcode == 0
    statuses, got = torch.load(out)
    assert statuses[:2] == ["ok", "ok"] and statuses[2].startswith("stale") and statuses[3] == "ok"
    assert got.keys() == w.keys()
    assert all(torch.equal(got[n].view(torch.int16), w[n].to(torch.bfloat16).view(torch.int16)) for n in w)
    assert 0 < sent[1] < sent[0] and sender.wire_bytes > sum(sent)


def test_the_sender_reuses_one_bucket_and_sends_a_large_weight_from_its_own_storage(tmp_path, monkeypatch):
    """The sender's extra memory: one bucket, allocated once for every push; a weight larger than a bucket, already
    contiguous and of the pushed dtype, is broadcast from its own storage (no copy)."""
    proc, group, out = start(tmp_path, pushes=2)
    sent = []
    broadcast = group.broadcast
    monkeypatch.setattr(group, "broadcast", lambda t, alive=None: (sent.append(t), broadcast(t, alive))[1])
    big = torch.randn(100, 10)
    try:
        sender = Sender(group, 1024, torch.float32, alive=proc.is_alive)
        sender.push([("small", torch.ones(3)), ("big", big)])
        first = sender.buffer
        sender.push([("small", torch.ones(3)), ("big", big)])
        proc.join(TIMEOUT_S)
    finally:
        group.close()
    assert sender.buffer is first and first.numel() == 1024
    assert any(t.data_ptr() == big.data_ptr() for t in sent)


def test_a_receiver_killed_before_the_push_ends_it_with_peer_lost_at_once(tmp_path):
    proc, group, _ = start(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerLost):
            Sender(group, 256, alive=proc.is_alive).push(weights())
    finally:
        group.close()
    assert time.monotonic() - t0 < 60


def test_a_silent_receiver_ends_the_push_with_peer_lost_after_the_timeout(tmp_path):
    """A receiver that joined and stopped (SIGSTOP): the push raises after the group's timeout, not later."""
    proc, group, _ = start(tmp_path, stop=True)
    group.timeout_s = 3.0  # (joining took the spawned process's start-up: a longer wait)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerLost):
            # (larger than the sockets' buffers: a broadcast's root waits only for them)
            Sender(group, 64, alive=proc.is_alive).push([("w", torch.zeros(2**23))])
        assert time.monotonic() - t0 < 20
    finally:  # the receiver killed first: gloo's shutdown waits out its own timeout on a stopped peer
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        group.close()


def test_a_receiver_that_never_joins_ends_the_wait_for_the_group_when_it_dies(tmp_path):
    store = host_store(TIMEOUT_S)
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(0.5,), daemon=True)
    proc.start()
    t0 = time.monotonic()
    with pytest.raises(PeerLost):
        Group("gloo", 0, 2, TIMEOUT_S, torch.device("cpu"), store=store, alive=proc.is_alive)
    assert time.monotonic() - t0 < 60


def test_the_backend_is_nccl_only_between_distinct_gpus():
    a, b, c = "cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"
    assert backend_for(a, [b]) == backend_for(a, [b, c]) == "nccl"
    assert backend_for(a, [a]) == backend_for(a, [b, a]) == "gloo"  # NCCL refuses two ranks on one GPU
    assert backend_for("cpu", ["cpu"]) == backend_for("cpu", [b]) == backend_for(a, ["cpu"]) == "gloo"
    assert transport.buffer_device("gloo", torch.device("cuda", 1)) == torch.device("cpu")
    assert transport.device_identity(torch.device("cpu")) == "cpu"


def test_a_bucket_smaller_than_the_alignment_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        Sender(None, ALIGN - 1)


def listening() -> set[tuple[str, int]]:
    """The (address, port) of every listening TCP socket this process holds (Linux: /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (closed meanwhile)
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            for row in f.readlines()[1:]:
                local, state, inode = row.split()[1], row.split()[3], row.split()[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address, port = local.split(":")
                raw = bytes.fromhex(address)  # (each 32-bit word in the host's byte order)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (ip.ipv4_mapped or ip).is_loopback if ip.version == 6 else ip.is_loopback


def test_on_one_host_nothing_of_the_weight_group_listens_beyond_loopback(tmp_path):
    """The engine on the trainer's host (every layout but rollout.vllm.mode=server): the group's store and gloo's
    own sockets listen on loopback only, where no other host reaches them."""
    before = listening()
    proc, group, out = start(tmp_path)
    try:
        opened = listening() - before
        Sender(group, 1024, alive=proc.is_alive).push(weights())
        proc.join(TIMEOUT_S)
    finally:
        group.close()
    assert proc.exitcode == 0
    assert opened and all(loopback(address) for address, _ in opened), opened


def _stranger(port: int) -> list[str]:
    """What a peer without the store's secret gets at `port`: with torch's own store client (as it would join a
    group through torch's TCPStore), "joined" where it joined the group as the engine's rank, else its error; then,
    where that failed, with multiprocessing's client and a key of its own."""
    try:
        store = dist.TCPStore(transport.HOST, port, None, False, timedelta(seconds=2))
        store.list_keys()
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gspo-weights", store), 1, 2, timedelta(seconds=30))
        options = dist.BroadcastOptions()
        pg.broadcast([torch.zeros(1)], options).wait()
        return ["joined"]
    except Exception as e:  # noqa: BLE001
        outcomes = [type(e).__name__]
    try:
        Client((transport.HOST, port), authkey=b"a key of its own").close()
        outcomes.append("authenticated")
    except Exception as e:  # noqa: BLE001
        outcomes.append(type(e).__name__)
    return outcomes


def test_a_peer_without_the_stores_secret_neither_joins_the_weight_group_nor_reads_its_keys(tmp_path):
    """rollout.vllm.mode=server: the store listens on every interface, for an engine on another host. A stranger that
    reaches it while the trainer waits for its engine (torch's store client, or one with a wrong key) is refused:
    it lists no key and joins nothing; the engine then joins and is sent every weight, bitwise."""
    store = host_store(TIMEOUT_S, transport.EVERY)
    assert any(not loopback(address) for address, port in listening() if port == store.port)  # reachable from afar
    waiting, gone = {}, threading.Event()

    def trainer():
        try:
            waiting["group"] = Group("gloo", 0, 2, TIMEOUT_S, torch.device("cpu"), store=store,
                                     alive=lambda: not gone.is_set())
        except Exception as e:  # noqa: BLE001
            waiting["error"] = e

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        assert _stranger(store.port) == ["DistNetworkError", "AuthenticationError"]
        out = str(tmp_path / "got.pt")
        proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, store.secret, 1, out, False),
                                               daemon=True)
        proc.start()
        thread.join(TIMEOUT_S)
        group = waiting["group"]
        try:
            Sender(group, 512, torch.float32, alive=proc.is_alive).push(weights())
            proc.join(TIMEOUT_S)
        finally:
            group.close()
    finally:
        gone.set()
        store.close()
    assert proc.exitcode == 0
    got = [(name, t) for b in torch.load(out)[0] for name, t, _ in b]
    assert [name for name, _ in got] == [name for name, _ in weights()]
    assert all(torch.equal(t, w.float()) for (_, t), (_, w) in zip(got, weights()))


def own_address() -> str:
    """This host's address on its default route (what another host reaches it at); skips without one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.1", 9))  # (TEST-NET-2: no packet is sent; the kernel picks the route)
        address = probe.getsockname()[0]
    except OSError:
        pytest.skip("no network route: no address but loopback")
    finally:
        probe.close()
    if loopback(address):
        pytest.skip("no address but loopback")
    return address


def test_across_hosts_gloo_listens_only_where_the_members_reach_each_other(tmp_path):
    """rollout.vllm.mode=server: the store on every interface, the engine reaching the trainer at its network
    address. gloo's sockets listen on that address alone, on both sides: the trainer's where the engine reached its
    store, the engine's where it reached it from; not on the address this host's name resolves to (gloo's default,
    here loopback: another interface than the one the engine uses, or one it cannot reach at all)."""
    address = own_address()
    store = host_store(TIMEOUT_S, transport.EVERY)
    before = listening()
    out = str(tmp_path / "got.pt")
    proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, store.secret, 1, out, False, address),
                                           daemon=True)
    proc.start()
    group = Group("gloo", 0, 2, TIMEOUT_S, torch.device("cpu"), store=store, alive=proc.is_alive)
    try:
        opened = {a for a, port in listening() - before if port != store.port}
        Sender(group, 1024, alive=proc.is_alive).push(weights())
        proc.join(TIMEOUT_S)
    finally:
        group.close()
    assert proc.exitcode == 0
    assert opened == {address}, opened
    with open(out + ".listening") as f:
        assert {a for a, _ in eval(f.read())} == {address}


def _impostor(port: int, secret: bytes) -> None:
    """Rank 1, standing in for a process that took the engine's place on gloo's own connections: in the group, but
    without the store's secret to show (its tag made with another)."""
    torch.set_num_threads(1)
    transport.member_tag = lambda _, rank: list(bytes(32))
    try:
        Group("gloo", 1, 2, TIMEOUT_S, torch.device("cpu"), port=port, secret=secret)
    except RunFailed:
        pass


def test_a_member_that_cannot_show_the_groups_secret_is_refused_before_any_weight(tmp_path):
    """gloo's (and NCCL's) own connections carry no key: a process that reached them first could stand in for the
    engine's worker. Once connected, each member shows an HMAC of its rank under the store's secret; a member that
    cannot ends the group with one line naming its rank, before a weight is sent."""
    store = host_store(TIMEOUT_S)
    proc = mp.get_context("spawn").Process(target=_impostor, args=(store.port, store.secret), daemon=True)
    proc.start()
    try:
        with pytest.raises(RunFailed, match=r"^the weight group: rank 1 did not prove it holds the group's secret"):
            Group("gloo", 0, 2, TIMEOUT_S, torch.device("cpu"), store=store, alive=proc.is_alive)
    finally:
        proc.join(TIMEOUT_S)
        store.close()

"""Delta pushes (rollout.vllm.weight_transport=delta, gspo/rollout/engine/delta.py), without the engine: the trainer's
`Tracker` against the engine's `Mirror`. What holds: after every push the mirror is the trainer's weights in the
engine's dtype, bitwise; a lost, reordered or damaged delta is refused (never applied silently) and a full push
restores the trainer's weights; each encoding round-trips, and the smallest is sent."""

from __future__ import annotations

import itertools

import pytest
import torch

from gspo.rollout.engine import delta
from gspo.rollout.engine.delta import Mirror, Tracker, full_push, whole_regions
from tests.conftest import REPO


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(50, 16, generator=g) * 0.05, "norm": torch.ones(16),
            "proj": torch.randn(24, 16, generator=g) * 0.1, "head.bias": torch.zeros(3)}


def update(w: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """An Adam-like step: every value moves by about lr (its sign random), as an update with Adam does."""
    g = torch.Generator().manual_seed(seed)
    for name, t in w.items():
        if name != "head.bias":  # (one weight that does not move: sent as nothing)
            t.add_(lr * torch.randn(t.shape, generator=g).sign())


def regions(w: dict[str, torch.Tensor]):
    return whole_regions((name, t, True) for name, t in w.items())


def as_parts(stream):
    """A push's stream as the receiver sees it (buckets of entries), one entry a bucket."""
    return ([(entry, payload)] for entry, payload in stream)


def same(mirror: Mirror, w: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
    return mirror.tensors.keys() == w.keys() and all(
        torch.equal(delta.bits(mirror.tensors[n]), delta.bits(t.to(dtype))) for n, t in w.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("lr", [5e-6, 5e-5, 1e-2])
def test_after_every_push_the_mirror_is_the_trainers_weights_bitwise(dtype, lr):
    """A full push, then four deltas: the mirror equals the trainer's weights cast to the engine's dtype, bitwise,
    each time; a delta sends fewer bytes than the raw weights (or, where every value changed, no more)."""
    w, tracker, mirror = weights(), Tracker(dtype), Mirror(weights().keys())
    assert mirror.receive(as_parts(tracker.push(regions(w)))) == "ok" and tracker.stats["full"]
    assert same(mirror, w, dtype) and mirror.version == tracker.version == 1
    for step in range(4):
        update(w, lr, step)
        assert mirror.receive(as_parts(tracker.push(regions(w)))) == "ok"
        assert same(mirror, w, dtype), step
        s = tracker.stats
        assert not s["full"] and s["payload_bytes"] <= s["weight_bytes"]
        assert s["tensors"]["unchanged"] >= 1  # head.bias did not move
    if dtype == torch.bfloat16 and lr == 5e-6:  # well below half a bf16 step of these weights: few values change
        assert s["changed"] / s["values"] < 0.1 and s["payload_bytes"] < 0.3 * s["weight_bytes"], s


def test_each_encoding_round_trips_and_the_smallest_is_sent():
    """A few positions changed: sparse; every low bit changed in float32: XOR (its high byte planes are zeros);
    every bit pattern replaced by random ones: the raw values. Each applied to the old values gives the new ones
    bitwise."""
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4096, generator=g)
    few = old.clone()
    few[torch.randperm(4096, generator=g)[:20]] += 1.0
    drift = old * (1 + 1e-6 * torch.randn(4096, generator=g))
    noise = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=g).view(torch.float32)  # random bits
    for new, expected in ((few, "sparse"), (drift, "xor"), (noise, "full")):
        entry, payload, changed, sizes = delta.encode("w", (4096,), 0, new, old, every=True)
        assert entry["enc"] == expected and payload.numel() == min(sizes.values()), (expected, sizes)
        assert changed == int((delta.bits(new) != delta.bits(old)).sum())
        region = old.clone()
        delta.apply(region, entry, payload)
        assert torch.equal(delta.bits(region), delta.bits(new)), expected
    assert delta.encode("w", (4096,), 0, old.clone(), old) is None  # nothing changed: nothing sent


def test_a_lost_delta_is_refused_and_a_full_push_restores_the_weights():
    """A delta the engine never got (lost): the next one names a version the engine does not hold, and is read and
    dropped, the mirror left as it was ("stale"); the trainer's full push (`resend`) then brings it to the trainer's
    weights."""
    w, tracker, mirror = weights(), Tracker(torch.bfloat16), Mirror()
    mirror.receive(as_parts(tracker.push(regions(w))))
    before = {n: t.clone() for n, t in mirror.tensors.items()}
    update(w, 1e-2, 0)
    list(tracker.push(regions(w)))  # lost on the way
    update(w, 1e-2, 1)
    status = mirror.receive(as_parts(tracker.push(regions(w))))
    assert status.startswith("stale") and mirror.version == 1
    assert all(torch.equal(before[n], t) for n, t in mirror.tensors.items())  # nothing of it applied
    assert mirror.receive(as_parts(tracker.resend())) == "ok" and same(mirror, w, torch.bfloat16)
    assert mirror.version == tracker.version == 3
    update(w, 1e-2, 2)  # and the deltas go on from there
    assert mirror.receive(as_parts(tracker.push(regions(w)))) == "ok" and same(mirror, w, torch.bfloat16)


def test_reordered_deltas_are_refused_and_each_answered_with_a_full_push():
    """Two deltas arriving in the wrong order: the later one is refused (it needs the first), the trainer's full
    push restores its weights; the earlier one, arriving after that, is refused too (it applies to a version the
    engine no longer holds): the engine ends with the trainer's weights, never an older version."""
    w, tracker, mirror = weights(), Tracker(torch.bfloat16), Mirror()
    mirror.receive(as_parts(tracker.push(regions(w))))
    pushes = []
    for step in range(2):
        update(w, 1e-2, step)
        pushes.append(list(tracker.push(regions(w))))
    assert mirror.receive(as_parts(pushes[1])).startswith("stale")
    assert mirror.receive(as_parts(tracker.resend())) == "ok" and same(mirror, w, torch.bfloat16)
    assert mirror.receive(as_parts(pushes[0])).startswith("stale")
    assert same(mirror, w, torch.bfloat16) and mirror.version == tracker.version


def test_a_damaged_delta_fails_its_checksum_and_is_never_served():
    """A delta whose payload was changed on the way applies with the right version but leaves other weights than the
    trainer's: the checksum says so ("corrupt"), the mirror holds no version (vLLM loads nothing from it), a
    following delta is refused, and a full push restores the trainer's weights."""
    w, tracker, mirror = weights(), Tracker(torch.bfloat16), Mirror()
    mirror.receive(as_parts(tracker.push(regions(w))))
    update(w, 1e-2, 0)
    stream = list(tracker.push(regions(w)))
    entry, payload = next((e, p) for e, p in stream if e.get("enc"))
    payload[-1] ^= 1  # one bit (of a value, or of compressed bytes, which then do not decode)
    assert mirror.receive(as_parts(stream)).startswith("corrupt") and mirror.version is None
    update(w, 1e-2, 1)
    assert mirror.receive(as_parts(tracker.push(regions(w)))).startswith("stale")
    assert mirror.receive(as_parts(tracker.resend())) == "ok" and same(mirror, w, torch.bfloat16)


def test_a_push_that_leaves_a_weight_out_is_refused():
    """The trailers say which regions their senders hold: a push that covers a weight twice or not at all (a rank's
    delta missing) is refused, as is a full push without every weight of the layout."""
    w = weights()
    mirror = Mirror(w.keys())
    partial = {n: t for n, t in w.items() if n != "norm"}
    assert mirror.receive(as_parts(Tracker(torch.float32).push(regions(partial)))).startswith("corrupt")
    halves = [Tracker(torch.float32), Tracker(torch.float32)]
    streams = [list(t.push(rank_regions(w, r))) for r, t in enumerate(halves)]
    assert mirror.receive(as_parts(streams[0])).startswith("corrupt")  # one rank's half alone
    assert mirror.receive(as_parts(itertools.chain(*streams))) == "ok" and same(mirror, w, torch.float32)


def rank_regions(w: dict[str, torch.Tensor], rank: int, world: int = 2):
    """Rank `rank`'s rows of every weight (dim 0 in torch.chunk's pieces, as FSDP2 shards), as regions."""
    for name, t in w.items():
        chunk = -(-t.shape[0] // world)
        first = min(rank * chunk, t.shape[0])
        rows = t[first : first + chunk]
        if rows.numel():
            yield name, tuple(t.shape), first * (t.numel() // t.shape[0]), rows


def test_each_rank_sends_a_delta_of_its_own_shard():
    """Two ranks, each holding dim-0 shards (FSDP2's layout): a gathered full push, then each rank's delta of its
    own rows; the engine applies one delta per rank, each checked by its own checksum, and holds the whole weights
    bitwise. A rank's delta whose shard changed on the way fails its own checksum."""
    w, world = weights(), 2
    trackers, mirror = [Tracker(torch.bfloat16) for _ in range(world)], Mirror(w.keys())
    for r, t in enumerate(trackers):  # the first push: gathered whole; each rank keeps its own rows
        t.version += 1
        t.refresh(rank_regions(w, r))
    assert mirror.receive(as_parts(full_push(regions(w), torch.bfloat16, 1))) == "ok"
    for step in range(3):
        update(w, 1e-3, step)
        streams = [list(t.push(rank_regions(w, r))) for r, t in enumerate(trackers)]
        assert mirror.receive(as_parts(itertools.chain(*streams))) == "ok" and same(mirror, w, torch.bfloat16)
        assert sum(1 for s in streams for e, _ in s if e.get("head")) == world  # one delta each
    update(w, 1e-3, 9)
    streams = [list(t.push(rank_regions(w, r))) for r, t in enumerate(trackers)]
    entry, payload = next((e, p) for e, p in streams[1] if e.get("enc"))
    payload[-1] ^= 1
    assert mirror.receive(as_parts(itertools.chain(*streams))).startswith("corrupt")
    assert mirror.receive(as_parts(full_push(regions(w), torch.bfloat16, trackers[0].version))) == "ok"
    assert same(mirror, w, torch.bfloat16)


def test_the_pages_delta_push_table_is_what_its_logs_say():
    """docs/benchmarks.md's table of delta pushes on SmolLM2 is `scripts/bench_push.py --report` of the JSON logs in
    docs/data/push_delta, as it stands (bytes and shares: machine-independent)."""
    import sys

    repo = REPO
    sys.path.insert(0, str(repo / "scripts"))
    try:
        import bench_push
    finally:
        sys.path.remove(str(repo / "scripts"))
    logs = sorted((repo / "docs" / "data" / "push_delta").glob("*.json"))
    assert {p.stem for p in logs} == {"bfloat16-lr5e-06", "bfloat16-lr5e-05", "float32-lr5e-06", "float32-lr5e-05"}
    table = bench_push.delta_report(repo / "docs" / "data" / "push_delta")
    assert table.count("\n") == 5 and table in (repo / "docs" / "benchmarks.md").read_text()

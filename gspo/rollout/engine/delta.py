"""Weight pushes that send only what changed (`rollout.vllm.weight_transport=delta`): nothing here imports vllm.

After an update most of a policy's values are unchanged *in the engine's dtype*: an update of 5e-6 moves a weight by
less than half a bf16 step (2^-8 of its magnitude), so the bf16 value the engine holds stays as it was. The trainer
keeps the weights it last pushed, in the engine's dtype (`Tracker`: one copy of the weights in that dtype, on the
trainer's device), casts the new weights to that dtype and compares bit patterns; each tensor (or region of one: an
FSDP2 shard) goes as whichever of these is smallest (`encode`):

- nothing, where no value changed;
- `sparse`: the changed positions (gaps between them, int32, bytes shuffled into planes, zlib) and their new values
  (bytes shuffled, zlib where that is smaller);
- `xor`: the XOR of the old and new bit patterns, bytes shuffled into planes (the high bytes of a float's small
  change are zeros), zlib; tried only where the sparse form is above `XOR_TRY` of the raw bytes (it compresses the
  whole tensor, the cost that matters);
- `full`: the raw values.

A push is a stream of entries (gspo/rollout/engine/transport.py `Sender.push_entries`): a head (`version`, and `base`:
the version it applies to, None for a full push), the tensors' entries, and a trailer: the version, the regions the
sender covers (every region it holds, changed or not: name, first element, count) and a checksum of the resulting
weights there (CRC-32 of each region's bytes, chained: `checksum`). The engine (`Mirror`, in each of its workers)
keeps its own copy of the weights in checkpoint form (the trainer's names, the engine's dtype, host memory), applies a
delta only to the version it names, and checks the checksum before it loads anything: a delta for another version
(one lost, or reordered) is read and dropped ("stale"), a result whose checksum differs is not loaded ("corrupt"); the
trainer answers either with a full push at once (gspo/rollout/engine/client.py). The engine never serves weights that
are not the trainer's: it loads (vLLM's `reload_weights`) only a verified version.

Under FSDP2 each rank compares its own shards (`shard_regions`: positions counted from the region's first element of
the whole tensor) and sends one delta each, with its own head and trailer; a full push goes as today's gathered one.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Iterable, Iterator, Optional

import torch

XOR_TRY = 1 / 16  # try the XOR encoding where the sparse one takes more than this share of the raw bytes
LEVEL = 1  # zlib's fastest level (the trainer compresses at every push; higher levels were not tried)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bit pattern, by its width
EMPTY = torch.empty(0, dtype=torch.uint8)

Region = tuple[str, tuple, int, torch.Tensor]  # (name, the whole tensor's shape, first element, the region's values)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns: the same storage as an integer tensor of its width (compare, XOR)."""
    return t.view(BITS[t.element_size()])


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _shuffle(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes of `width`-byte values regrouped by byte position (all first bytes, then all second ...)."""
    return raw.view(-1, width).t().contiguous().view(-1) if width > 1 else raw


def _unshuffle(raw: torch.Tensor, width: int) -> torch.Tensor:
    return raw.view(width, -1).t().contiguous().view(-1) if width > 1 else raw


def _squeeze(raw: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`raw` zlib-compressed where that is smaller (and whether it is); on the CPU."""
    raw = raw.cpu()
    packed = zlib.compress(raw.numpy(), LEVEL)
    if len(packed) < raw.numel():
        return torch.frombuffer(bytearray(packed), dtype=torch.uint8), True
    return raw, False


def _unsqueeze(raw: torch.Tensor, compressed: bool, nbytes: int) -> torch.Tensor:
    """The bytes `_squeeze` packed (a new tensor on the CPU), checked to be `nbytes` long."""
    out = torch.frombuffer(bytearray(zlib.decompress(raw.cpu().numpy())), dtype=torch.uint8) if compressed \
        else raw.cpu().clone()
    if out.numel() != nbytes:
        raise ValueError(f"a delta's part holds {out.numel()} bytes where {nbytes} were expected")
    return out


def crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes."""
    return zlib.crc32(bits(t.reshape(-1)).cpu().numpy())


def checksum(listed: list) -> int:
    """One number for a sender's regions: CRC-32 of [[name, first element, count, the region's CRC-32], ...]."""
    return zlib.crc32(json.dumps(listed).encode())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _index_dtype(count: int) -> torch.dtype:
    return torch.int32 if count < 2**31 else torch.int64


def encode(name: str, shape: tuple, start: int, new: torch.Tensor, old: Optional[torch.Tensor],
           every: bool = False) -> Optional[tuple[dict, torch.Tensor, int, dict]]:
    """One region's entry: `new` (flat, contiguous, the engine's dtype) against `old` (what the engine holds; None:
    nothing, so full). (manifest entry, payload bytes, values changed, each candidate's bytes), or None where nothing
    changed. `every`: size every encoding (measurements), not only those that can win."""
    count, width = new.numel(), new.element_size()
    entry = {"name": name, "dtype": dtype_name(new.dtype), "shape": list(shape), "start": start, "count": count}
    raw_bytes = count * width
    if old is None:
        return {**entry, "enc": "full"}, _raw(new).cpu(), count, {"full": raw_bytes}
    nb, ob = bits(new), bits(old)
    pos = (nb != ob).nonzero().view(-1)
    k = pos.numel()
    if k == 0:
        return None
    gaps = torch.diff(pos, prepend=pos.new_zeros(1)).to(_index_dtype(count))
    p, pz = _squeeze(_shuffle(_raw(gaps), gaps.element_size()))
    v, vz = _squeeze(_shuffle(_raw(new[pos]), width))
    best = ({**entry, "enc": "sparse", "k": k, "parts": [[p.numel(), pz], [v.numel(), vz]]}, torch.cat([p, v]))
    sizes = {"full": raw_bytes, "sparse": best[1].numel()}
    if every or best[1].numel() > XOR_TRY * raw_bytes:
        x, xz = _squeeze(_shuffle(_raw(nb ^ ob), width))
        sizes["xor"] = x.numel()
        if x.numel() < best[1].numel():
            best = ({**entry, "enc": "xor", "z": xz}, x)
    if best[1].numel() >= raw_bytes:
        best = ({**entry, "enc": "full"}, _raw(new).cpu())
    return best[0], best[1], k, sizes


def apply(region: torch.Tensor, entry: dict, payload: torch.Tensor) -> None:
    """An entry's change into `region` (the flat view of a tensor's region that the entry addresses), in place."""
    width, enc = region.element_size(), entry["enc"]
    target = bits(region)
    if enc == "full":
        target.copy_(_unsqueeze(payload, False, region.numel() * width).view(target.dtype))
    elif enc == "sparse":
        (pn, pz), (vn, vz) = entry["parts"]
        k, index = int(entry["k"]), _index_dtype(region.numel())
        gaps = _unshuffle(_unsqueeze(payload[:pn], pz, k * index.itemsize), index.itemsize).view(index)
        values = _unshuffle(_unsqueeze(payload[pn : pn + vn], vz, k * width), width).view(target.dtype)
        positions = gaps.long().cumsum(0)
        if k and (positions[0] < 0 or positions[-1] >= region.numel() or (gaps[1:] <= 0).any()):
            raise ValueError(f"a delta of {entry['name']} names positions outside it")
        target[positions.to(region.device)] = values.to(region.device)
    elif enc == "xor":
        x = _unshuffle(_unsqueeze(payload, entry["z"], region.numel() * width), width).view(target.dtype)
        target.bitwise_xor_(x.to(region.device))
    else:
        raise ValueError(f"a delta entry of {entry['name']} encoded as {enc!r}, which this engine does not know")


class Tracker:
    """A trainer rank's side: the regions it last pushed, in the engine's `dtype` (`last`: one copy of what it pushes,
    on the device the weights are on), their CRCs, the version of the weights pushed so far (0: none yet)."""

    def __init__(self, dtype: torch.dtype, every: bool = False):
        self.dtype, self.every, self.version = dtype, every, 0
        self.last: dict[tuple[str, int], torch.Tensor] = {}
        self.crcs: dict[tuple[str, int], int] = {}
        self.shapes: dict[str, tuple] = {}  # each tensor's whole shape
        self.stats: dict = {}

    def _cast(self, values: torch.Tensor) -> torch.Tensor:
        """A copy of `values` in the engine's dtype, flat (never the trainer's own storage: it is kept)."""
        new = values.detach().to(self.dtype)
        if new.data_ptr() == values.data_ptr():
            new = new.clone()
        return new.reshape(-1).contiguous()

    def push(self, regions: Iterable[Region]) -> Iterator[tuple[dict, torch.Tensor]]:
        """The stream of the next push: a delta from what was last pushed, or a full push where nothing was (the
        first). Each region's values are cast and kept as they go (so a full push from `last` can follow at once:
        `resend`). `stats` then counts it."""
        base = self.version if self.last else None
        self.version += 1
        self.stats = {"values": 0, "changed": 0, "payload_bytes": 0, "weight_bytes": 0, "full": base is None,
                      "tensors": {"full": 0, "sparse": 0, "xor": 0, "unchanged": 0}, "candidates": {}}
        yield {"head": True, "version": self.version, "base": base}, EMPTY
        listed = []
        for name, shape, start, values in regions:
            new, key = self._cast(values), (name, start)
            self.shapes[name] = tuple(shape)
            old = self.last.get(key) if base is not None else None
            got = encode(name, shape, start, new, old, self.every)
            self.last[key] = new
            if got is not None or key not in self.crcs:
                self.crcs[key] = crc(new)
            listed.append([name, start, new.numel(), self.crcs[key]])
            s = self.stats
            s["values"] += new.numel()
            s["weight_bytes"] += new.numel() * new.element_size()
            if got is None:
                s["tensors"]["unchanged"] += 1
                continue
            entry, payload, changed, sizes = got
            s["changed"] += changed
            s["payload_bytes"] += payload.numel()
            s["tensors"][entry["enc"]] += 1
            for enc, n in sizes.items():
                s["candidates"][enc] = s["candidates"].get(enc, 0) + n
            yield entry, payload
        yield trailer(self.version, listed, self.stats), EMPTY

    def resend(self) -> Iterator[tuple[dict, torch.Tensor]]:
        """A full push of what `push` last sent (the current version), from `last`: the answer to a delta the engine
        dropped."""
        yield {"head": True, "version": self.version, "base": None}, EMPTY
        listed = []
        for (name, start), new in self.last.items():
            entry, payload, _, _ = encode(name, self.shapes[name], start, new, None)
            listed.append([name, start, new.numel(), self.crcs[(name, start)]])
            yield entry, payload
        yield trailer(self.version, listed, _full_stats(self.last.values())), EMPTY

    def refresh(self, regions: Iterable[Region]) -> None:
        """Keep `regions` as what was pushed at the current version without sending them (a rank whose shards went
        in a gathered full push)."""
        for name, shape, start, values in regions:
            new = self._cast(values)
            self.last[(name, start)], self.crcs[(name, start)] = new, crc(new)
            self.shapes[name] = tuple(shape)


def full_push(regions: Iterable[Region], dtype: torch.dtype, version: int) -> Iterator[tuple[dict, torch.Tensor]]:
    """A full push of `regions` (whole tensors, gathered) at `version`, keeping nothing (under FSDP each rank keeps
    its own shards: `Tracker.refresh`)."""
    yield {"head": True, "version": version, "base": None}, EMPTY
    listed, sent = [], []
    for name, shape, start, values in regions:
        new = values.detach().to(dtype)
        if new.data_ptr() == values.data_ptr():  # (never the trainer's own storage: FSDP frees a gathered unit's)
            new = new.clone()
        new = new.reshape(-1).contiguous()
        entry, payload, _, _ = encode(name, shape, start, new, None)
        listed.append([name, start, new.numel(), crc(new)])
        sent.append(torch.empty(1, dtype=dtype).expand(new.numel()))  # (its size, for the counts: no memory)
        yield entry, payload
    yield trailer(version, listed, _full_stats(sent)), EMPTY


def trailer(version: int, listed: list, stats: dict) -> dict:
    """A sender's last entry: the version its push leaves, the regions it holds, the checksum of the weights there
    (`checksum` of `listed`), and what it sent (counts: values, changed, weight_bytes, tensors by encoding)."""
    return {"trailer": True, "version": version, "checksum": checksum(listed), "regions": [x[:3] for x in listed],
            **{k: stats[k] for k in ("values", "changed", "weight_bytes", "tensors")}}


def _full_stats(tensors: Iterable[torch.Tensor]) -> dict:
    tensors = list(tensors)
    n = sum(t.numel() for t in tensors)
    return {"values": n, "changed": n, "weight_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "tensors": {"full": len(tensors)}}


def whole_regions(weights: Iterable[tuple[str, torch.Tensor, bool]]) -> Iterator[Region]:
    """(name, value, adapted) of `adapters.merged_parameters` (or an FSDP rank's gathered units) as whole regions."""
    for name, value, _ in weights:
        yield name, tuple(value.shape), 0, value


def shard_regions(model: torch.nn.Module, compute_dtype: torch.dtype, rank: int) -> Iterator[Region]:
    """This FSDP2 rank's own regions of the model's weights: each parameter's local shard (FSDP2 shards dim 0, so a
    rank's rows are one run of the whole tensor's elements, from its first row on), in the compute dtype FSDP gathers
    them in; a parameter held whole (not a DTensor) is rank 0's."""
    from torch.distributed.tensor import DTensor, Shard

    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            if rank == 0:
                yield name, tuple(p.shape), 0, p.detach().to(compute_dtype)
            continue
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"{name}: sharded as {p.placements} on a {p.device_mesh.ndim}-D mesh; delta pushes read "
                             "FSDP2's Shard(0) on one dimension")
        local, world = p.to_local(), p.device_mesh.size()
        me = p.device_mesh.get_local_rank()
        rows = p.shape[0]
        chunk = math.ceil(rows / world)
        first = min(me * chunk, rows)
        if local.shape[0] != max(0, min(chunk, rows - first)):
            raise ValueError(f"{name}: this rank's shard has {local.shape[0]} rows, where torch.chunk's would have "
                             f"{max(0, min(chunk, rows - first))}")
        if local.numel():
            yield name, tuple(p.shape), first * math.prod(p.shape[1:]), local.detach().to(compute_dtype)


class Mirror:
    """The engine's copy of the weights it serves, in checkpoint form (the trainer's names, the engine's dtype, host
    memory): where deltas are applied and checked before vLLM loads anything. `names`: the weights every full push
    must cover (the trainer's layout), or None."""

    def __init__(self, names: Optional[Iterable[str]] = None):
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: Optional[int] = None  # the version held, None: none (or one left half-applied)
        self.names = None if names is None else set(names)
        self.crcs: dict[str, dict[tuple[int, int], int]] = {}  # each tensor's regions' CRCs, while it is unchanged

    def receive(self, parts: Iterable[list[tuple[dict, torch.Tensor]]]) -> str:
        """Apply one push's stream (read to its end whatever happens): "ok" (the version in its trailer is held,
        checked), or why not: "stale: ..." (a delta for a version other than the one held: nothing applied),
        "corrupt: ..." (the result's checksum, or what the regions cover, is not the trainer's: nothing of it is
        to be loaded)."""
        held, status, version, touched, covered = self.version, None, None, False, {}
        for part in parts:
            for entry, payload in part:
                if status is not None:
                    continue  # (read, dropped)
                if entry.get("head"):
                    if entry["base"] is not None and entry["base"] != held:
                        status = f"stale: a delta from version {entry['base']} to {entry['version']}, and the " \
                                 f"engine holds {held}"
                    continue
                if entry.get("trailer"):
                    version = entry["version"]
                    listed = []
                    for name, start, count in entry["regions"]:
                        covered[name] = covered.get(name, 0) + count
                        listed.append([name, start, count, self._crc(name, start, count)])
                    if checksum(listed) != entry["checksum"]:
                        status = f"corrupt: the weights after the push of version {version} differ from the trainer's"
                    continue
                touched = True
                try:
                    self._apply(entry, payload)
                except (ValueError, RuntimeError, IndexError, zlib.error) as e:  # (undecodable: damaged on the way)
                    status = f"corrupt: {entry.get('name')}: {' '.join(str(e).split())[:200]}"
        if status is None:
            size = {n: t.numel() for n, t in self.tensors.items()}
            if covered != size or (self.names is not None and set(size) != self.names):
                status = "corrupt: the push's regions do not cover every weight once"
        if status is None:
            self.version = version
            return "ok"
        if touched:
            self.version = None  # half-applied: only a full push is good now
        return status

    def _apply(self, entry: dict, payload: torch.Tensor) -> None:
        name, start, count = entry["name"], int(entry["start"]), int(entry["count"])
        tensor = self.tensors.get(name)
        dtype, shape = getattr(torch, entry["dtype"]), list(entry["shape"])
        if tensor is None or list(tensor.shape) != shape or tensor.dtype != dtype:
            if entry["enc"] != "full":
                raise ValueError(f"a delta of {name}, which this engine does not hold as {shape} {entry['dtype']}")
            tensor = self.tensors[name] = torch.empty(shape, dtype=dtype)
        if start < 0 or start + count > tensor.numel():
            raise ValueError(f"a delta of {name} addresses elements {start}..{start + count} of {tensor.numel()}")
        self.crcs.pop(name, None)
        apply(tensor.view(-1)[start : start + count], entry, payload)

    def _crc(self, name: str, start: int, count: int) -> int:
        cached = self.crcs.setdefault(name, {})
        if (start, count) not in cached:
            tensor = self.tensors.get(name)
            if tensor is None or start < 0 or start + count > tensor.numel():
                return -1  # (a region it does not hold: the checksum cannot match)
            cached[(start, count)] = crc(tensor.view(-1)[start : start + count])
        return cached[(start, count)]

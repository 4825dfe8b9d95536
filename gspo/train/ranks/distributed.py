"""Multi-process training on torch.distributed: DDP or FSDP2, one process per device.

This is each rank's view of the run: joining the process group torchrun describes (gspo/train/ranks/launcher.py
starts the ranks), and `Dist`, the rank's place, collectives, wrapping and gathering weights. Checkpoints
are gspo/train/loop/checkpointer.py's, the held-out evaluation's split over ranks gspo/train/evaluation/evaluator.py's.

How the work is split, and why 2 ranks x P prompts compute what 1 rank x 2P prompts
does (tests/train/ranks/test_distributed.py checks it):

- prompts: every rank draws the step's whole prompt list from the shared seed and keeps
  its contiguous share [r P/W, (r+1) P/W). A group never straddles ranks, so group
  advantages need no communication.
- sampling noise: each prompt group samples from its own generator, seeded by (seed,
  step, draw, global prompt index), not by rank: a group's completions do not depend on
  which rank samples it, nor on what else is in the batch.
- minibatches: rows are shuffled within their group (by a generator of the group's own)
  and dealt to minibatch (global row slot mod M); rank r holds slots [r N/W, (r+1) N/W),
  so a one-process minibatch is exactly the union of the ranks' minibatches.
- gradients: DDP averages them over ranks (FSDP reduce-scatters the same average). Each
  rank's loss is scaled by W x local/global count of what the aggregation divides by
  (sequences, tokens or rows), so the average is the gradient of the one-process loss on
  the whole minibatch, whatever the ranks' completion lengths.
- metrics are reduced over ranks (mean; min/max for *_min/*_max; max for time/*; sum for
  throughput/* and for counts, `is_total`); evaluation is split over ranks and recombined; rank 0
  alone writes metrics.jsonl, heldout.jsonl, checkpoints and summary.json.
- FSDP: parameters, gradients and optimizer state are sharded (fp32 master shards,
  `hardware.dtype` compute). Sampling and evaluation run a data-dependent number of
  forward passes per rank, so they run inside `gathered()`, which all-gathers the full
  weights once instead of once per forward.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import math
import os
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as tdist

from gspo.core.errors import ConfigError
from gspo.models import adapters
from gspo.rollout.batch import COUNT
from gspo.rollout.decoding.seeds import group_generator, keyed_generator, keyed_seed  # noqa: F401  (re-exported: the loop's)
from gspo.train.run import checkpoint

# --------------------------------------------------------------------------- the process group


def in_torchrun() -> bool:
    """True inside a worker started by torchrun (it sets RANK, LOCAL_RANK and WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def check(cfg, world: Optional[int] = None) -> None:
    """Config errors a multi-process run would otherwise meet only once its workers run."""
    hw = cfg.hardware
    torchrun_world = int(os.environ["WORLD_SIZE"]) if in_torchrun() else 1
    if hw.strategy == "none":
        if torchrun_world > 1:
            raise ConfigError(f"started by torchrun with {torchrun_world} processes but hardware.strategy=none: "
                              "pick a multi-process profile, e.g. hardware=cpu-ddp, hardware=gpu-ddp or hardware=gpu-fsdp")
        return
    world = world or (torchrun_world if in_torchrun() else hw.nproc)
    if world < 1:
        raise ConfigError(f"hardware.nproc={hw.nproc}: must be at least 1")
    if hw.backend == "nccl" and hw.device == "cpu":
        raise ConfigError("hardware.backend=nccl needs CUDA devices; on the CPU use backend gloo (hardware=cpu-ddp)")
    if cfg.reward.timeout_s and cfg.reward.timeout_s >= hw.collective_timeout_s:
        raise ConfigError(f"reward.timeout_s={cfg.reward.timeout_s:g} is not below hardware.collective_timeout_s="
                          f"{hw.collective_timeout_s:g}: the other ranks wait in a collective while one rank scores, "
                          "and would give up first; raise hardware.collective_timeout_s")
    P, G, M = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.train.minibatches
    if P % world:
        raise ConfigError(f"rollout.prompts_per_step={P} does not split evenly over {world} processes (each samples "
                          f"whole prompt groups): use a multiple of {world}")
    if (P // world) * G < M:
        raise ConfigError(f"train.minibatches={M} is more than the {(P // world) * G} completions each of the {world} "
                          "processes holds: lower train.minibatches or raise rollout.prompts_per_step")


def device_of(hw) -> torch.device:
    """The device `hardware.device` names (`auto`: CUDA where one is visible, else the CPU)."""
    name = hw.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def join(hw, device: torch.device) -> torch.device:
    """Join the process group torchrun describes in the environment (once); this rank's device."""
    world = int(os.environ["WORLD_SIZE"])
    if hw.strategy == "none":
        raise ConfigError(f"started by torchrun with {world} processes but hardware.strategy=none: "
                          "pick a multi-process profile, e.g. hardware=cpu-ddp or hardware=gpu-ddp")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not tdist.is_initialized():
        # every collective has a time limit: a rank waiting for one that hung fails instead of waiting for ever
        # (gspo/train/run/failures.py); gspo's own long waits go through _LONG, a gloo group without one
        tdist.init_process_group(hw.backend, device_id=device if device.type == "cuda" else None,
                                 timeout=timedelta(seconds=float(hw.collective_timeout_s)))
        global _LONG
        _LONG = tdist.new_group(backend="gloo", timeout=timedelta(days=7))
        atexit.register(_destroy)
    return device


_LONG = None  # a gloo group for waits that may last minutes (rank 0 warm-starting, writing a checkpoint)


def _destroy() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def shutdown() -> None:
    """Leave the process group together: a rank that tears gloo down while its peer is still
    writing the checkpoint can abort at exit ("terminate called without an active exception")."""
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()


# --------------------------------------------------------------------------- the trainer's view


def setup(cfg, device: torch.device) -> "Dist":
    """This process's place in the run: one process, or a rank of the torchrun group."""
    hw = cfg.hardware
    if not in_torchrun() or (int(os.environ["WORLD_SIZE"]) == 1 and hw.strategy == "none"):
        return Dist(device=device)
    device = join(hw, device)
    check(cfg, tdist.get_world_size())
    return Dist(rank=tdist.get_rank(), world=tdist.get_world_size(), strategy=hw.strategy, device=device)


def minibatches(prompt_index: torch.Tensor, group_size: int, n: int, seed: int, step: int,
                offset: int = 0) -> list[torch.Tensor]:
    """Row indices of the minibatches of a rank's batch (rows group-contiguous).

    Rows are shuffled within their group by the group's generator, then the row in slot s
    (counted over all ranks: offset = rank x rows per rank) goes to minibatch s mod n, n =
    min(n, rows). So a one-process minibatch is the union of the ranks' minibatches, and
    every minibatch holds about the same share of every group.
    """
    N = prompt_index.numel()
    n = max(1, min(n, N))
    order = torch.cat([
        g + torch.randperm(group_size, generator=group_generator(seed, step, 0, int(prompt_index[g]), "cpu", "minibatch"))
        for g in range(0, N, group_size)
    ])
    slot = (offset + torch.arange(N)) % n
    return [order[slot == m] for m in range(n)]


def by_length(parts: list[torch.Tensor], lengths: torch.Tensor, seed: int, step: int) -> list[torch.Tensor]:
    """`train.sort_minibatches`: the rows of `parts` (this rank's minibatches) dealt again by length.

    The rows, in `parts`' shuffled order, are sorted by `lengths` (their real tokens, prompt and completion;
    stable, so equal lengths keep the shuffle) and cut into consecutive runs of `parts`' sizes: each minibatch
    holds rows of similar lengths, so less padding (`Rollout.trimmed`). The runs come in an order drawn by a
    generator keyed by (seed, step), not shortest first. What changes: which rows share a minibatch (no longer
    about the same share of every group), so the off-policy updates see other minibatches; under several ranks
    each rank sorts its own rows, so the run is no longer the one-process run's.
    """
    order = torch.cat(parts)
    order = order[torch.sort(lengths[order], stable=True).indices]
    runs = list(torch.split(order, [len(p) for p in parts]))
    shuffle = torch.randperm(len(runs), generator=keyed_generator(seed, step, purpose="minibatch-order"))
    return [runs[i] for i in shuffle.tolist()]


@dataclass
class Dist:
    """One process's place in a run: rank, world size, strategy, device (one process: 0, 1, none)."""

    rank: int = 0
    world: int = 1
    strategy: str = "none"  # none | ddp | fsdp
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share [lo, hi) of n items (n divisible by the world size)."""
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k

    def barrier(self, long: bool = False) -> None:
        """Wait for every rank; `long`: without the collective time limit (rank 0 may take minutes)."""
        if self.world > 1:
            tdist.barrier(group=_LONG if long else None)

    # -- models ----------------------------------------------------------------
    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """FSDP keeps fp32 master shards and computes in `dtype`; DDP and one process store `dtype`."""
        return torch.float32 if self.strategy == "fsdp" else dtype

    def wrap(self, model: torch.nn.Module, dtype: torch.dtype, frozen: bool = False) -> torch.nn.Module:
        """The module to train through: DDP around `model`, or `model` sharded in place by fully_shard."""
        if self.strategy == "ddp" and not frozen:
            from torch.nn.parallel import DistributedDataParallel

            # no buffer sync per forward: buffers (rotary tables) never change, and a per-forward
            # broadcast would tie every forward pass, sampling's too, to the other ranks
            sig = inspect.signature(DistributedDataParallel.__init__).parameters
            no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in sig else {"broadcast_buffers": False}
            return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                           **no_sync)
        if self.strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.device.type, (self.world,))
            mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
            blocks = set(getattr(model, "_no_split_modules", None) or ())  # HF: the decoder layer classes
            for m in [m for m in model.modules() if type(m).__name__ in blocks]:
                fully_shard(m, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    @contextlib.contextmanager
    def gathered(self, model: torch.nn.Module) -> Iterator[None]:
        """FSDP: full weights on every rank for the block (no collective per forward); else nothing.

        Every rank must enter it (the all-gather is collective); inside, ranks may run
        different numbers of forward passes (sampling stops when its batch is done).
        """
        if self.strategy != "fsdp":
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
        before = [_reshards_after_forward(m) for m in mods]
        for m in mods:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m, b in zip(mods, before):
                m.reshard()
                m.set_reshard_after_forward(b, recurse=False)

    def merged_parameters(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
        """`adapters.merged_parameters(model)` (what a separate sampler is sent), whole. Under FSDP gathered one
        unit at a time: the root's own weights (embeddings, final norm, LM head), then each decoder layer's, so a
        rank holds one unit whole beside its shards, never the model (in the compute dtype: FSDP's mixed precision
        gathers in it). Under FSDP a collective: every rank iterates it to its end, in the same order."""
        if self.strategy != "fsdp":
            yield from adapters.merged_parameters(model)
            return
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:  # (the root stays gathered after a forward): each unit yields its own weights once
            unit.reshard()
        for unit in units:
            unit.unshard()
            try:
                yield from adapters.merged_parameters(model, whole_only=True)
            finally:
                unit.reshard()

    # -- loss and metrics ------------------------------------------------------
    def loss_scale(self, denominator: torch.Tensor) -> float:
        """Factor on this rank's loss so that the DDP average is the one-process loss's gradient.

        `denominator`: what this rank's loss divides its row sum by (`losses.aggregate_denominator`:
        sequences, tokens or B x max_tokens); the factor is W x local / all ranks' denominator, 1 in
        one process. Pass the true (unclamped) count: a rank with no tokens adds 0 to the total, not
        the 1 its own loss divides by, and only the total is clamped (an all-empty minibatch).
        """
        if self.world == 1:
            return 1.0
        local = float(denominator)
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        tdist.all_reduce(total)
        return local * self.world / max(float(total.item()), 1.0)

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's rows of `x` (N_r, ...) concatenated in rank order, and where this rank's begin.

        Ranks hold contiguous shares of the step's prompts, so the concatenation is the one-process
        batch; ranks may hold different row counts. One process: (`x`, 0).
        """
        if self.world == 1:
            return x, 0
        n = torch.tensor([x.shape[0]], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        tdist.all_gather(sizes, n)
        sizes = [int(s) for s in sizes]
        width = max(sizes)
        padded = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=self.device)
        padded[: x.shape[0]] = x.to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        tdist.all_gather(parts, padded)
        whole = torch.cat([p[:s] for p, s in zip(parts, sizes)]).to(x.device)
        return whole, sum(sizes[: self.rank])

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over ranks (a new tensor, no gradient); `x` itself in one process."""
        if self.world == 1:
            return x
        out = x.detach().clone()
        tdist.all_reduce(out)
        return out

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (an all-reduce: every rank must call it, the same number of times)."""
        if self.world == 1:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
        return bool(t.item() > 0)

    def common_groups(self, n_groups: int) -> int:
        """The smallest group count over ranks (dynamic sampling may leave a rank short)."""
        if self.world == 1:
            return n_groups
        t = torch.tensor([n_groups], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
        return int(t.item())

    def gather_objects(self, obj) -> Optional[list]:
        """Every rank's picklable `obj`, in rank order, on rank 0 (a collective: every rank calls it); None elsewhere."""
        if self.world == 1:
            return [obj]
        everyone = [None] * self.world
        tdist.gather_object(obj, everyone if self.is_main else None, dst=0)
        return everyone if self.is_main else None

    def broadcast_object(self, obj):
        """Rank 0's picklable `obj` on every rank (a collective without the time limit: rank 0 may take minutes)."""
        if self.world == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0, group=_LONG)
        return box[0]

    def reduce_metrics(self, metrics: dict, rows: int) -> dict:
        """Step metrics over ranks: mean, min for *_min, max for *_max and time/*, sum for throughput/* and for
        counts (`is_total`: what a count means is the run's total, whatever the world size).

        `reward/std` is recombined from the ranks' first and second moments (`rows` each). A mean that comes
        with a count (`COUNT + key`: the rows it is over, e.g. a reward function's rows not None) is the
        count-weighted mean over ranks, a rank with count 0 (its mean NaN) left out; the counts are not logged.
        An extreme over nothing (+inf for a *_min, -inf for a *_max: the identities a rank with no tokens gives,
        `gspo.algos.losses.policy_loss`) leaves that rank out of the min / max; when no rank had any, the key is
        left out of the step's row (in one process too), rather than logged as a made-up value.
        """
        if self.world == 1:
            return _without_empty_extremes({k: v for k, v in metrics.items() if not k.startswith(COUNT)})
        m = dict(metrics)
        for k in [k for k in m if k.startswith(COUNT)]:  # sums of value x count, then divided by the summed count
            key = k[len(COUNT):]
            m[key] = m[key] * m[k] if m[k] > 0 else 0.0
        has_std = "reward/std" in m and "reward/mean" in m
        if has_std:  # E[r^2] of this rank's rows, from its unbiased std
            m["reward/_sq"] = m["reward/std"] ** 2 * (rows - 1) / max(rows, 1) + m["reward/mean"] ** 2
        keys = sorted(m)
        crc = zlib.crc32("\n".join(keys).encode())
        x = torch.tensor([float(m[k]) for k in keys] + [float(crc)], dtype=torch.float64, device=self.device)
        lo, hi, total = x.clone(), x.clone(), x.clone()
        tdist.all_reduce(lo, op=tdist.ReduceOp.MIN)
        tdist.all_reduce(hi, op=tdist.ReduceOp.MAX)
        tdist.all_reduce(total)
        if lo[-1] != hi[-1]:
            raise RuntimeError("ranks logged different metric keys; cannot reduce them")
        out = {}
        for i, k in enumerate(keys):
            if k.endswith("_min"):
                out[k] = lo[i].item()
            elif k.endswith("_max") or k.startswith("time/"):
                out[k] = hi[i].item()
            elif k.startswith("throughput/") or is_total(k):
                out[k] = total[i].item()
            else:
                out[k] = total[i].item() / self.world
        for k in [k for k in out if k.startswith(COUNT)]:
            n = out.pop(k) * self.world  # the mean over ranks back to the sum
            key = k[len(COUNT):]
            out[key] = out[key] * self.world / n if n > 0 else float("nan")
        if has_std:
            n = rows * self.world
            var = max(out.pop("reward/_sq") - out["reward/mean"] ** 2, 0.0) * n / max(n - 1, 1)
            out["reward/std"] = var ** 0.5
        return _without_empty_extremes(out)

    # -- weights for a checkpoint ----------------------------------------------
    def full_state(self, model, opt=None) -> tuple[dict, Optional[dict]]:
        """The full state dicts of `model` (without tied aliases: each tensor once) and `opt` (None: none), for a
        checkpoint: under FSDP gathered from every rank onto rank 0's CPU (a collective: every rank calls it;
        the others get empty dicts), else the module's and optimizer's own."""
        if self.strategy != "fsdp":
            tied = _tied_aliases(checkpoint.unwrap(model))
            return ({k: v for k, v in checkpoint.unwrap(model).state_dict().items() if k not in tied},
                    None if opt is None else opt.state_dict())
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0 only
        model_state = get_model_state_dict(model, options=opts)
        optim_state = None if opt is None else get_optimizer_state_dict(model, opt, options=opts)
        tied = _tied_aliases(model)  # e.g. lm_head.weight = embed_tokens.weight: saved once, as HF does
        return {k: v for k, v in model_state.items() if k not in tied}, optim_state


def is_total(key: str) -> bool:
    """Whether step metric `key` is a count, summed over ranks (each rank counts its own share): DAPO's
    `sampling/groups_*` (groups drawn, dropped, kept) and any `.../n`. Not `sampling/batches`: every rank draws
    the same number of batches (they agree after each draw), each a batch of the whole run."""
    return key.startswith("sampling/groups_") or key.endswith("/n")


def _without_empty_extremes(metrics: dict) -> dict:
    """`metrics` without a *_min at +inf or a *_max at -inf: the identity of the min / max, an extreme over no
    value at all (no rank had a token)."""
    return {k: v for k, v in metrics.items()
            if not ((k.endswith("_min") and v == math.inf) or (k.endswith("_max") and v == -math.inf))}


def _tied_aliases(model) -> set[str]:
    """Names under which an already-named parameter appears again (tied weights)."""
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def _reshards_after_forward(module) -> bool:
    """An FSDP module's reshard-after-forward setting (the root's is off by default)."""
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    return group is None or getattr(group, "post_forward_mesh_info", True) is not None


def scalar(x) -> float:
    """A Python float from a tensor or DTensor (FSDP's grad norm) or a number."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x.item() if hasattr(x, "item") else x)



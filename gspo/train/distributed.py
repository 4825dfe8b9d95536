"""Multi-process training on torch.distributed: DDP or FSDP2, one process per device.

`gspo train hardware=cpu-ddp` (or gpu-ddp, gpu-fsdp) starts `hardware.nproc` workers
with torchrun's own launcher (`torch.distributed.run`, called inside the Hydra job) and
waits for them; each worker runs `python -m gspo.train.trainer RUN_DIR`, which trains
with the run directory's resolved config.yaml. `torchrun --nproc-per-node N -m cli.main
train hardware=cpu-ddp ...` by hand works too: every rank takes rank 0's run directory.

How the work is split, and why 2 ranks x P prompts compute what 1 rank x 2P prompts
does (tests/test_distributed.py checks it):

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
  throughput/*); evaluation is split over ranks and recombined; rank 0 alone writes
  metrics.jsonl, checkpoints and summary.json.
- FSDP: parameters, gradients and optimizer state are sharded (fp32 master shards,
  `hardware.dtype` compute). Sampling and evaluation run a data-dependent number of
  forward passes per rank, so they run inside `gathered()`, which all-gathers the full
  weights once instead of once per forward.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import logging
import os
import shutil
import signal
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as tdist

from gspo.config.errors import ConfigError, RunFailed
from gspo.rollout.batch import COUNT
from gspo.rollout.seeds import group_generator, keyed_generator, keyed_seed  # noqa: F401  (re-exported: the loop's)
from gspo.train import checkpoint, failures, preemption

# --------------------------------------------------------------------------- launching


def in_torchrun() -> bool:
    """True inside a worker started by torchrun (it sets RANK, LOCAL_RANK and WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def is_main_process() -> bool:
    """Rank 0, or a plain single process; before torchrun starts the ranks of a multi-node run, the launching
    task of node 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    nodes = slurm_nodes()
    return nodes is None or nodes.index == 0


@dataclass(frozen=True)
class Nodes:
    """This task's place in a multi-node SLURM allocation: one `gspo train` task per node."""

    count: int
    index: int  # SLURM_NODEID
    master: str  # the first node's host name: torchrun's rendezvous
    port: int


def slurm_nodes() -> Optional[Nodes]:
    """The multi-node allocation this task runs in (SLURM_JOB_NUM_NODES > 1), or None (one node, or no SLURM).

    Each node runs one `gspo train` task (`srun --ntasks-per-node=1`, or the submitit launcher with
    `hydra.launcher.nodes=N`), which starts `hardware.nproc` ranks on its node with torchrun; the ranks of all
    nodes form one process group."""
    n = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    if n < 2 or "SLURM_NODEID" not in os.environ:
        return None
    tasks = int(os.environ.get("SLURM_NTASKS", n))
    if tasks != n:
        raise ConfigError(f"a {n}-node SLURM job with {tasks} tasks: run one gspo task per node (--ntasks-per-node=1, "
                          "or hydra.launcher.tasks_per_node=1); each starts hardware.nproc processes on its node")
    hosts = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "localhost")
    port = 20000 + int(os.environ.get("SLURM_JOB_ID", "0") or 0) % 20000  # the same on every node of the job
    return Nodes(n, int(os.environ["SLURM_NODEID"]), first_host(hosts), port)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[03-05,09],cpu1` -> `gpu03` (what `scontrol show hostnames` lists first)."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head[: head.index("[")], head[head.index("[") + 1 : -1]
    return prefix + ranges.split(",")[0].split("-")[0]


def needs_launch(hw) -> bool:
    """Whether this process must start workers: a multi-process profile, and not a worker yet."""
    return hw.strategy != "none" and not in_torchrun()


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


def launch(cfg, run_dir: Path) -> dict:
    """Start `hardware.nproc` workers on this machine with torchrun, wait for them; rank 0's summary.

    The workers re-enter with RUN_DIR/config.yaml (the resolved config, written here), so
    they all train the same config into the same directory.
    """
    from omegaconf import OmegaConf
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    hw, n = cfg.hardware, cfg.hardware.nproc
    check(cfg, n)
    visible = torch.cuda.device_count()
    if device_of(hw).type == "cuda" and visible < n:
        raise ConfigError(f"hardware.nproc={n} but {visible} CUDA devices are visible: set hardware.nproc={visible}"
                          if visible else f"hardware.device={hw.device} but no CUDA device is visible; use hardware=cpu-ddp")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    nodes = slurm_nodes()
    if is_main_process():
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    stop_file = run_dir / f".stop-{os.getpid()}"  # this session's: a signal to this process, passed on
    stop_file.unlink(missing_ok=True)
    env = {preemption.STOP_FILE_ENV: str(stop_file), "TORCHELASTIC_SIGNALS_TO_HANDLE": None,  # (torchrun sets it)
           failures.DIR_ENV: str(failures.clear(run_dir))}  # a rank that fails says why there
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing (and torchrun says nothing)
        env["OMP_NUM_THREADS"] = str(hw.threads or max(1, _cpu_count() // n))
    if nodes is None:
        where = ["--standalone"]
    else:  # one rendezvous for the ranks of every node; the run directory and the cache must be shared
        shared_between_nodes(run_dir, Path(cfg.cache_dir), nodes)
        where = [f"--nnodes={nodes.count}", f"--node-rank={nodes.index}", f"--master-addr={nodes.master}",
                 f"--master-port={nodes.port}"]
    args = [*where, f"--nproc-per-node={n}", "--max-restarts=0", "-m", "gspo.train.trainer", str(run_dir)]
    if is_main_process():
        print(f"gspo: starting {n} processes{f' on each of {nodes.count} nodes' if nodes else ''}: "
              f"torchrun {' '.join(args)}", flush=True)
    # torchrun would turn SIGTERM/SIGINT into killing the workers; they finish their step instead (gspo/train/preemption.py)
    args.insert(0, "--signals-to-handle=SIGHUP,SIGQUIT")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    stop = preemption.StopSignals(pass_to=stop_file).install()
    elastic = logging.getLogger("torch.distributed.elastic")
    level, elastic.level = elastic.level, logging.CRITICAL  # its failure report: ours is the one line below
    try:
        run(get_args_parser().parse_args(args))
    except SignalException:  # a second signal: torchrun killed the workers; leave as the signal would
        if stop.signum is not None:
            stop.kill()
        raise
    except ChildFailedError as e:  # one rank failed and torchrun stopped the others: say which, and why
        first = (nodes.index if nodes else 0) * n  # this node's first global rank
        codes = {first + int(f.local_rank): int(f.exitcode) for f in e.failures.values()}
        codes = {r: codes.get(r, -int(signal.SIGTERM)) for r in range(first, first + n)}  # not listed: stopped
        message, users = failures.explain(run_dir, codes, hw.collective_timeout_s)
        if is_main_process():
            _mark_failed(run_dir)
        raise (ConfigError(message) if users else RunFailed(message)) from None
    finally:
        elastic.level = level
        stop.restore()
        stop_file.unlink(missing_ok=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    stop.close()  # after a stop: the handler the signal had before (submitit's requeue)
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def shared_between_nodes(run_dir: Path, cache_dir: Path, nodes: Nodes, wait_s: float = 120.0) -> None:
    """Refuse, in one line, a run directory or warm-start cache that the nodes do not share: node 0 writes a
    token into each, every other node must see it (rank 0 alone writes metrics and checkpoints, builds the
    warm-started base; the other nodes' ranks read the base and resume from the checkpoints there)."""
    import time

    job = os.environ.get("SLURM_JOB_ID", "job")
    for key, d in (("hydra.run.dir (the run directory)", run_dir), ("cache_dir", cache_dir)):
        token = Path(d) / f".node0-{job}"
        if nodes.index == 0:
            token.parent.mkdir(parents=True, exist_ok=True)
            token.write_text(str(os.getpid()))
            continue
        deadline = time.time() + wait_s
        while not token.is_file():
            if time.time() > deadline:
                raise ConfigError(f"{key} {d} is not shared between the nodes: node {nodes.index} does not see node "
                                  f"0's files there after {wait_s:.0f} s; put it on a filesystem every node mounts")
            time.sleep(0.5)


def _mark_failed(run_dir: Path) -> None:
    """summary.json says `failed` (rank 0 may have been killed before it could write it)."""
    path = run_dir / "summary.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        data = {}
    if data.get("status") not in ("failed", *preemption.EXIT_CODES):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({**data, "status": "failed"}, indent=2))
        tmp.replace(path)


def shared_run_dir(run_dir: Path, hw) -> Path:
    """Rank 0's run directory, under torchrun started by hand (where every rank ran Hydra).

    Hydra names a run directory by the second it started, which may differ between
    ranks; the directory a rank made for nothing (only Hydra's own files) is removed.
    """
    if not in_torchrun() or (int(os.environ["WORLD_SIZE"]) == 1 and hw.strategy == "none"):
        return Path(run_dir)
    _init(hw, device_of(hw))
    box = [str(run_dir)]
    tdist.broadcast_object_list(box, src=0)
    shared = Path(box[0])
    mine = Path(run_dir)
    if mine.resolve() != shared.resolve() and mine.is_dir():
        if all(p.name == ".hydra" or p.suffix == ".log" for p in mine.iterdir()):
            shutil.rmtree(mine, ignore_errors=True)
    return shared


def device_of(hw) -> torch.device:
    """The device `hardware.device` names (`auto`: CUDA where one is visible, else the CPU)."""
    name = hw.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _init(hw, device: torch.device) -> torch.device:
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
        # (gspo/train/failures.py); gspo's own long waits go through _LONG, a gloo group without one
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
    device = _init(hw, device)
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


class NullLogger:
    """The metrics sink of ranks other than 0: nothing is written."""

    def log(self, metrics, step: int) -> None:
        pass

    def should_log_samples(self, step: int) -> bool:
        return False

    def log_samples(self, step: int, rows) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        pass


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

    def reduce_metrics(self, metrics: dict, rows: int) -> dict:
        """Step metrics over ranks: mean, min for *_min, max for *_max and time/*, sum for throughput/*.

        `reward/std` is recombined from the ranks' first and second moments (`rows` each). A mean that comes
        with a count (`COUNT + key`: the rows it is over, e.g. a reward function's rows not None) is the
        count-weighted mean over ranks, a rank with count 0 (its mean NaN) left out; the counts are not logged.
        """
        if self.world == 1:
            return {k: v for k, v in metrics.items() if not k.startswith(COUNT)}
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
            elif k.startswith("throughput/"):
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
        return out

    def evaluate(self, fn: Callable[[list], dict], problems: list, model: torch.nn.Module) -> dict:
        """`fn(problems)` on this rank's strided share of `problems`, combined over ranks (per-problem means)."""
        share = problems[self.rank :: self.world]
        with self.gathered(model):
            out = fn(share)
        if self.world == 1:
            return out
        keys = sorted(k for k, v in out.items() if isinstance(v, (int, float)))
        x = torch.tensor([out[k] * len(share) for k in keys] + [len(share)], dtype=torch.float64, device=self.device)
        tdist.all_reduce(x)
        return {k: (x[i] / x[-1].clamp(min=1)).item() for i, k in enumerate(keys)}

    # -- checkpoints -----------------------------------------------------------
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

    def save_checkpoint(self, run_dir: Path, step: int, model, tokenizer, opt, sched, keep: int = 1,
                        pending: Optional[dict] = None, files: Optional[dict] = None,
                        extra: Optional[dict] = None) -> None:
        """Rank 0 writes the checkpoint (FSDP: full tensors gathered from every rank first).

        `pending`: this rank's batches sampled ahead by older weights (rollout.staleness), gathered from
        every rank into the trainer state, which a resume needs to compute what the uninterrupted run does.
        `files`, `extra`: other components' weights ({file: state dict}) and trainer state (`full_state`)."""
        extra = dict(extra or {})
        if pending:
            everyone = [None] * self.world
            if self.world > 1:
                tdist.gather_object(pending, everyone if self.is_main else None, dst=0)
            else:
                everyone = [pending]
            extra |= {"pending": dict(enumerate(everyone)) if self.is_main else {}, "pending_world": self.world}
        model_state = optim_state = None
        if self.strategy == "fsdp":
            model_state, optim_state = self.full_state(model, opt)
        if self.is_main:
            checkpoint.save(run_dir, step, model, tokenizer, opt, sched, keep=keep, model_state=model_state,
                            optimizer_state=optim_state, extra=extra, files=files)
        self.barrier(long=True)  # writing a large checkpoint may outlast the collective time limit

    def load_optimizer_state(self, model, opt, state: dict) -> None:
        """Load a checkpoint's optimizer state, whichever strategy (and world size) wrote it.

        One process and DDP save `optimizer.state_dict()` (keyed by parameter number); FSDP
        saves the full state keyed by parameter name. Either loads into either.
        """
        names = [n for n, _ in checkpoint.unwrap(model).named_parameters()]
        by_name = any(isinstance(p, str) for g in state["param_groups"] for p in g["params"])
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            state = state if by_name else _rekey(state, dict(enumerate(names)))
            set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(_rekey(state, {n: i for i, n in enumerate(names)}) if by_name else state)


def _rekey(state: dict, key: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (number <-> name)."""
    return {"state": {key[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [key[p] for p in g["params"]]} for g in state["param_groups"]]}


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



"""Starting a multi-process run: torchrun on this node, one task per node under SLURM, the shared run directory.

`gspo train hardware=cpu-ddp` (or gpu-ddp, gpu-fsdp) starts `hardware.nproc` workers
with torchrun's own launcher (`torch.distributed.run`, called inside the Hydra job) and
waits for them; each worker runs `python -m gspo.train.loop.trainer RUN_DIR`, which trains
with the run directory's resolved config.yaml. `torchrun --nproc-per-node N -m cli.main
train hardware=cpu-ddp ...` by hand works too: every rank takes rank 0's run directory
(`shared_run_dir`). What each rank then does, and how the work is split between ranks,
is gspo/train/ranks/distributed.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as tdist

from gspo.core.errors import ConfigError, RunFailed
from gspo.core.files import replace_text
from gspo.train.ranks.distributed import check, device_of, in_torchrun, join
from gspo.train.run import failures, preemption


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
    args = [*where, f"--nproc-per-node={n}", "--max-restarts=0", "-m", "gspo.train.loop.trainer", str(run_dir)]
    if is_main_process():
        print(f"gspo: starting {n} processes{f' on each of {nodes.count} nodes' if nodes else ''}: "
              f"torchrun {' '.join(args)}", flush=True)
    # torchrun would turn SIGTERM/SIGINT into killing the workers; they finish their step instead
    # (gspo/train/run/preemption.py)
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
        replace_text(path, json.dumps({**data, "status": "failed"}, indent=2))


def shared_run_dir(run_dir: Path, hw) -> Path:
    """Rank 0's run directory, under torchrun started by hand (where every rank ran Hydra).

    Hydra names a run directory by the second it started, which may differ between
    ranks; the directory a rank made for nothing (only Hydra's own files) is removed.
    """
    if not in_torchrun() or (int(os.environ["WORLD_SIZE"]) == 1 and hw.strategy == "none"):
        return Path(run_dir)
    join(hw, device_of(hw))
    box = [str(run_dir)]
    tdist.broadcast_object_list(box, src=0)
    shared = Path(box[0])
    mine = Path(run_dir)
    if mine.resolve() != shared.resolve() and mine.is_dir():
        if all(p.name == ".hydra" or p.suffix == ".log" for p in mine.iterdir()):
            shutil.rmtree(mine, ignore_errors=True)
    return shared



def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1



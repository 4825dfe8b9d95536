"""One run per directory: a free name for every new run, and a lock held by the run that writes there.

Hydra names a run directory by the second it starts, so two `gspo train` started in the same second
would share it; `claim` takes the name atomically (mkdir) and moves on to NAME-2, NAME-3, ... when it
is taken. The run writing a directory holds RUN_DIR/.lock (pid, host, SLURM job, start time); a
second run (`hydra.run.dir=X` twice, a resume while the run is alive) is refused in one line. A lock
whose process is gone (kill -9, a node that died) is taken over: on this host when its pid no longer
exists, on another host when it is the same SLURM job requeued.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

from gspo.core.errors import ConfigError

LOCK = ".lock"
RUN_FILES = ("config.yaml", "metrics.jsonl")  # what a directory holding a run has


def claim(path: Path | str) -> Path:
    """`path`, or the first free `path-2`, `path-3`, ...: created here, so no other process gets it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        candidate = path if i == 1 else path.with_name(f"{path.name}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ConfigError(f"{path}: no free run directory name (tried {path.name}-2 .. -9999)")


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def holder(run_dir: Path | str) -> Optional[dict]:
    """Who holds the run directory's lock, if a live process does (None: free, or a stale lock)."""
    path = Path(run_dir) / LOCK
    try:
        owner = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # being written this moment (created, not yet filled), or garbage
        try:
            fresh = time.time() - path.stat().st_mtime < 5
        except OSError:
            return None
        return {"pid": "?", "host": "?", "since": "a moment ago"} if fresh else None
    requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
    if requeued and owner.get("slurm_job") and owner["slurm_job"] == os.environ.get("SLURM_JOB_ID"):
        return None  # this SLURM job, requeued (perhaps on another node): its earlier run is gone
    if owner.get("host") == socket.gethostname() and not _alive(int(owner.get("pid", 0))):
        return None
    return owner


def _refusal(run_dir: Path, owner: dict) -> str:
    return (f"{run_dir}: another gspo run is writing there (pid {owner.get('pid')} on {owner.get('host')}, since "
            f"{owner.get('since')}); one run per directory: wait for it, or stop it (kill -TERM {owner.get('pid')}; "
            f"if that process is gone, delete {Path(run_dir) / LOCK})")


def check_free(run_dir: Path | str) -> None:
    """Refuse (ConfigError) a directory a live run holds."""
    owner = holder(run_dir)
    if owner is not None and owner.get("pid") != os.getpid():
        raise ConfigError(_refusal(Path(run_dir), owner))


def check_new(run_dir: Path | str, key: str) -> None:
    """Refuse a directory that already holds a run, for a new run (`key` names where the directory came from)."""
    check_free(run_dir)
    found = [name for name in RUN_FILES if (Path(run_dir) / name).exists()]
    if found:
        raise ConfigError(f"{key}={run_dir}: already holds a run ({', '.join(found)}); continue it with "
                          f"`gspo train resume={run_dir}` or pick another directory")


@contextlib.contextmanager
def lock(run_dir: Path | str) -> Iterator[None]:
    """Hold RUN_DIR/.lock for the block; a live holder is refused in one line, a stale lock taken over."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            owner = holder(run_dir)
            if owner is not None:
                raise ConfigError(_refusal(run_dir, owner)) from None
            path.unlink(missing_ok=True)  # stale: take it over (two takers: one wins the O_EXCL, the other retries)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(_me()))
        break
    else:
        raise ConfigError(f"{run_dir}: could not take {path}; another process keeps taking it")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()


def default_dir(overrides: list[str], multirun: bool) -> Path:
    """The directory Hydra would name for these overrides (`hydra.run.dir`, or `hydra.sweep.dir` for -m)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from gspo.config.loading import _register_resolvers, sweep_combinations
    from gspo.config.schema import CONF_DIR, register_configs

    register_configs()
    _register_resolvers()
    combo = sweep_combinations(overrides)[0] if multirun else list(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=combo, return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    return Path(str(OmegaConf.select(cfg, "hydra.sweep.dir" if multirun else "hydra.run.dir")))


def run_dir_overrides(overrides: list[str], multirun: bool) -> list[str]:
    """For `gspo train`: a directory given with hydra.run.dir must not hold a run; none given, a free one is
    claimed and passed to Hydra (two runs started in the same second get NAME and NAME-2)."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == key]
    if given:
        from gspo.train.run.preemption import resume_requeued

        if not multirun and not resume_requeued(given[-1]):  # a sweep's job directories are checked by each job
            check_new(given[-1], key)
        return []
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun by hand: the ranks take rank 0's directory
        return []
    return [f"{key}={claim(default_dir(overrides, multirun))}"]

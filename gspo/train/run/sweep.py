"""A sweep that survives: the same `gspo train -m ... hydra.sweep.dir=DIR` run again continues it.

A job's directory is named by the overrides the sweep varies (`cell-grpo_R2+seed-0`: gspo.config.loading.job_name,
conf/config.yaml's hydra.sweep.subdir), so a rerun of the command finds each job's run and, job by job (`plan`):
skips it when it finished; resumes it exactly from its newest checkpoint when it did not (as `gspo train
resume=DIR`: the run's own config, with the command's overrides of keys a resume may change, e.g. `train.steps`
to train it longer); restarts it when it has no checkpoint; and starts the jobs that have no run yet. Each job
decides for itself, wherever the launcher runs it (in this process, N at a time under joblib, one SLURM job each:
a requeued SLURM job continues its run the same way).

What a rerun may not do is turn a job into another experiment (`check`, before any job runs): a job whose
directory holds a run of another config (another `train.lr`, say) is refused in one line, and so is a job that
would repeat, under another name, a run the directory already holds. SWEEP_DIR/sweep.json records the keys that
name the jobs, so that a later command may give one of them a single value (`algo=grpo seed=0,1,2` after
`algo=grpo,gspo seed=0,1` adds `algo-grpo+seed-2`), and refuses one that varies a key the names lack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gspo.config.loading import bare_key, job_name, load_run_config, swept_keys
from gspo.core.errors import ConfigError
from gspo.core.files import replace_text
from gspo.train.run.resume import experiment_key, listed, may_change, other_experiment

RECORD = "sweep.json"
EXCLUDE_KEY = "hydra.job.config.override_dirname.exclude_keys"


def _recorded(sweep_dir: Optional[Path]) -> Optional[list[str]]:
    if sweep_dir is None:
        return None
    try:
        return list(json.loads((sweep_dir / RECORD).read_text())["named_by"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _runs(sweep_dir: Optional[Path]) -> dict[str, Path]:
    """The run directories directly under the sweep directory, by name (none without one)."""
    if sweep_dir is None or not sweep_dir.is_dir():
        return {}
    return {p.name: p for p in sorted(sweep_dir.iterdir()) if (p / "config.yaml").is_file()}


def name_keys(sweep_dir: Optional[Path | str], overrides: list[str]) -> list[str]:
    """The keys that name this sweep's jobs: the ones it varies, and those its directory's earlier jobs were named by
    (`sweep_dir` None: a new directory)."""
    sweep_dir = Path(sweep_dir) if sweep_dir is not None else None
    swept, recorded = swept_keys(overrides), _recorded(sweep_dir)
    if recorded is None or not _runs(sweep_dir):
        return sorted(set(swept))
    given = {bare_key(o) for o in overrides if "=" in o}
    named = ", ".join(recorded) or "their number (that sweep varied no key)"
    new = [k for k in swept if k not in recorded]
    if new:
        raise ConfigError(f"hydra.sweep.dir={sweep_dir}: its jobs are named by {named}; this sweep also varies "
                          f"{', '.join(new)}, so its jobs could not find the runs there: run it in another directory")
    missing = [k for k in recorded if k not in given]
    if missing:
        raise ConfigError(f"hydra.sweep.dir={sweep_dir}: its jobs are named by {named}; give "
                          f"{', '.join(missing)} too (one value or several), so that each job finds its run")
    return sorted(recorded)


def exclude(overrides: list[str], keys: list[str]) -> list[str]:
    """The keys of `overrides` that do not name the jobs (Hydra's override_dirname.exclude_keys)."""
    return [k for k in dict.fromkeys(bare_key(o) for o in overrides if "=" in o) if k not in keys]


def hydra_overrides(overrides: list[str], keys: list[str]) -> list[str]:
    """What `gspo train -m` adds for Hydra: the keys that do not name the jobs, for hydra.sweep.subdir."""
    return [f"{EXCLUDE_KEY}=[{','.join(exclude(overrides, keys))}]"]


def job_names(overrides: list[str], combos: list[list[str]], keys: list[str]) -> list[str]:
    """Each job's directory name, as hydra.sweep.subdir names it."""
    skip = exclude(overrides, keys)
    return [job_name(combo, skip, i) for i, combo in enumerate(combos)]


def check(sweep_dir: Optional[Path | str], overrides: list[str], combos: list[list[str]], cfgs: list,
          keys: list[str]) -> None:
    """Refuse (ConfigError, before any job runs) a sweep whose jobs would share a directory, or that would run
    another experiment in a job directory that holds a run, or repeat a run its directory holds under another name
    (`sweep_dir` None: a new directory)."""
    sweep_dir = Path(sweep_dir) if sweep_dir is not None else None
    names = job_names(overrides, combos, keys)
    seen: dict[str, list[str]] = {}
    for name, combo in zip(names, combos):
        if name in seen:
            raise ConfigError(f"two jobs of this sweep would share the directory {name} "
                              f"({' '.join(seen[name])} and {' '.join(combo)}): give them values that differ")
        seen[name] = combo
    runs = _runs(sweep_dir)
    if not runs:
        return
    saved = {name: load_run_config(path) for name, path in runs.items()}
    elsewhere = {experiment_key(c): name for name, c in saved.items() if name not in seen}
    for name, combo, cfg in zip(names, combos, cfgs):
        if name in saved:
            bad = other_experiment(saved[name], cfg)
            if bad:
                raise ConfigError(f"hydra.sweep.dir={sweep_dir}: the job {name} is not the experiment its directory "
                                  f"holds: {listed(bad)}. Running a sweep again continues its runs (a resume may "
                                  "change train.steps, evaluation, logging, hardware); run a different sweep in "
                                  "another directory")
        elif experiment_key(cfg) in elsewhere:
            raise ConfigError(f"hydra.sweep.dir={sweep_dir}: the job {name} would repeat the run in "
                              f"{sweep_dir / elsewhere[experiment_key(cfg)]} (the same config under another name): "
                              "vary the keys that sweep varied, or run this one in another directory")


def record(sweep_dir: Path | str, keys: list[str]) -> None:
    """Write SWEEP_DIR/sweep.json: the keys that name its jobs. Through a temporary file of this call's own, renamed
    into place: two sweeps started at once in one directory never rename each other's half-written file, nor find
    their own gone."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    replace_text(sweep_dir / RECORD, json.dumps({"named_by": keys}) + "\n")


@dataclass
class Plan:
    """What a sweep job does with its directory: `start` a new run, `resume` the one there, or `skip` it."""

    action: str
    cfg: Any = None  # the config to train (resume: the run's own, with the job's may-change overrides)
    before: Any = None  # resume: the run's saved config (what resumes.jsonl records changes against)
    summary: Optional[dict] = None  # skip: the finished run's summary.json


def plan(run_dir: Path | str, cfg: Any, task_overrides: list[str]) -> Plan:
    """The job's decision: a directory with no run starts; a run of another experiment is refused (ConfigError);
    a finished run with no more steps to train is skipped; any other run resumes from its newest checkpoint
    (from step 0 without one), with the job's overrides of the keys a resume may change."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        return Plan("start", cfg)
    before = load_run_config(run_dir)
    bad = other_experiment(before, cfg)
    if bad:
        raise ConfigError(f"{run_dir} holds a run of another experiment than this job: {listed(bad)}; run a different "
                          "sweep in another directory")
    # the job's overrides a resume may make (train.steps=400, hardware.threads=1, a logger=... swap), as `resume=DIR`
    changes = [o for o in task_overrides if "=" in o and not o.startswith(("+", "~"))
               and (may_change(bare_key(o)) or may_change(bare_key(o) + "."))]
    resumed = load_run_config(run_dir, changes)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    if summary.get("status") == "finished" and int(summary.get("steps", 0)) >= resumed.train.steps:
        return Plan("skip", resumed, before, summary)
    resumed.resume = str(run_dir)
    return Plan("resume", resumed, before)

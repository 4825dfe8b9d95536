"""Reading run directories: what `gspo compare` (and any script) needs from a run on disk.

A run directory holds config.yaml, metrics.jsonl (one JSON object per step) and, once it
has taken a step, summary.json. `load_runs(paths)` finds them at or under each path (a
sweep directory, outputs/) and reads each into a `Run`; what cannot be read becomes a
`BrokenRun` with the reason. The metric names the comparison looks at are here too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gspo.core.errors import ConfigError

REWARD, REWARD_STD, LOSS, ACC = "reward/mean", "reward/std", "train/loss", "eval/accuracy"
EVAL_N = "eval/n"  # the problems one evaluation scored
CLIP, CLIP_LOW, CLIP_HIGH = "clip/frac", "clip/frac_low", "clip/frac_high"
KL_REF, KL_OLD, ENTROPY = "kl/ref", "kl/old", "policy/entropy"
LENGTH, ROUTING, STEP_S = "response/len_mean", "moe/routing_volatility", "time/step_s"
RATIO_MAX = "policy/ratio_max"
MISMATCH_KL = "rollout/mismatch_kl"  # k3 KL(sampler ‖ trainer) per token, on the steps that computed both
ROUTING_MISMATCH = "rollout/routing_mismatch"  # share of (token, layer) expert sets the sampler and trainer disagree on
# a step whose kl/old passes this is a spike: the old policy and the updated one disagree on some tokens by far more
# than a minibatch's step (the MoE study's measure of GRPO's token-level swings, docs/results/smollm2-moe.md)
KL_SPIKE = 0.1
GROUPS_DRAWN = "sampling/groups_drawn"  # groups a step sampled, where it sampled more than one batch (dynamic sampling)
# PPO's critic (algo=ppo): tabulated by `gspo compare` when a run logs them
VALUE_LOSS, EXPLAINED_VAR, VALUE_MEAN, VALUE_CLIP = ("critic/value_loss", "critic/explained_variance",
                                                     "critic/value_mean", "critic/clip_frac")
SKIP_DIRS = {"wandb", "checkpoints", "__pycache__"}
_MISSING = "<missing>"


class CompareError(ConfigError):
    """Nothing to compare (bad path, no readable run): the CLI exits with code 2."""


class _Broken(Exception):
    pass


@dataclass
class Run:
    path: Path
    config: dict
    metrics: dict[str, tuple[np.ndarray, np.ndarray]]  # key -> (steps, values), by step
    summary: dict | None = None
    notes: list[str] = field(default_factory=list)
    collapse: str | None = None  # why the run counts as collapsed; None = it did not
    collapse_step: int | None = None

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        empty = np.zeros(0)
        return self.metrics.get(key, (empty, empty))

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def last_step(self) -> int:
        return max((int(s[-1]) for s, _ in self.metrics.values() if len(s)), default=0)

    @property
    def finished(self) -> bool:
        """summary.json says finished, and metrics.jsonl does not go past the steps it says were done (a finished
        run resumed for more steps and killed keeps a stale `finished` if it was written by an older gspo)."""
        s = self.summary or {}
        return s.get("status") == "finished" and self.last_step <= int(s.get("steps", self.last_step) or 0)

    @property
    def partial(self) -> bool:
        planned = lookup(self.config, "train.steps")
        return not self.finished and isinstance(planned, int) and self.last_step < planned


@dataclass
class BrokenRun:
    path: Path
    reason: str


def lookup(config: dict, dotted: str) -> Any:
    """config["a"]["b"] for "a.b"; a group node stands for its `name`; _MISSING if absent."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node.get("name", _MISSING) if isinstance(node, dict) else node


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat


def _read_metrics(path: Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], list[str]]:
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise _Broken("metrics.jsonl is empty (no step logged yet)")
    records: dict[int, dict] = {}
    repeated: dict[int, int] = {}
    notes = []
    for idx, (lineno, line) in enumerate(lines):
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            if idx == len(lines) - 1 and idx > 0:  # cut short by a crash mid-write
                notes.append(f"{path}: ignored unreadable last line {lineno}")
                continue
            raise _Broken(f"metrics.jsonl line {lineno} is not a JSON object with a step ({e})") from None
        if step in records:
            repeated[step] = repeated.get(step, 1) + 1
        records.setdefault(step, {}).update(record)
    if repeated:  # a resume drops what it redoes: a repeated step means two runs wrote this file
        shown = ", ".join(f"{s} ({n}x)" for s, n in sorted(repeated.items())[:5]) + (", ..." if len(repeated) > 5 else "")
        raise _Broken(f"metrics.jsonl repeats steps {shown}: two runs wrote into this directory; its numbers "
                      "mix them and cannot be compared")
    series: dict[str, tuple[list, list]] = {}
    for step in sorted(records):
        for key, value in records[step].items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, ([], []))
                series[key][0].append(step)
                series[key][1].append(float(value))
    return {k: (np.asarray(s), np.asarray(v, dtype=float)) for k, (s, v) in series.items()}, notes


class _HydraOnly(Exception):
    """Only Hydra's own files (`.hydra/`, `*.log`): a resume's or a refused job's directory, not a run."""


def _load_run(path: Path) -> Run:
    has_cfg, has_metrics = (path / "config.yaml").exists(), (path / "metrics.jsonl").exists()
    if not has_cfg and not has_metrics:
        ours = [p.name for p in path.iterdir() if p.name != ".hydra" and p.suffix != ".log"]
        if not ours:
            raise _HydraOnly
        raise _Broken("no config.yaml or metrics.jsonl (not started, or crashed before its first step)")
    if not has_cfg:
        raise _Broken("no config.yaml")
    if not has_metrics:
        raise _Broken("no metrics.jsonl (not started, or crashed before its first step)")
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=False)
    except OSError:
        raise  # (no permission: said as every file that cannot be read is, by `load_runs`)
    except Exception as e:
        raise _Broken(f"config.yaml is unreadable ({e})") from None
    if not isinstance(config, dict):
        raise _Broken("config.yaml is not a mapping")
    metrics, notes = _read_metrics(path / "metrics.jsonl")
    summary = None
    if (path / "summary.json").exists():
        try:  # (an OSError, no permission, goes up: a run whose status cannot be known is not compared)
            summary = json.loads((path / "summary.json").read_text())
        except ValueError:
            notes.append(f"{path}: summary.json is unreadable; ignored")
    run = Run(path, config, metrics, summary, notes)
    if summary is not None and summary.get("status") == "finished" and not run.finished:
        notes.append(f"{path}: summary.json says finished at step {summary.get('steps')} but metrics.jsonl goes to "
                     f"step {run.last_step}: a resume that did not finish; counted as partial")
    return run


def _looks_like_run(path: Path) -> bool:
    """Whether `path` holds a run's files; True also where it cannot be looked into (no permission): reading it
    then says why it cannot be compared (`load_runs`), where passing it over would drop a run without a word."""
    try:
        return any((path / name).exists() for name in ("config.yaml", "metrics.jsonl", ".hydra"))
    except OSError:
        return True


def _natural(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def find_run_dirs(paths: Sequence[Path | str]) -> list[Path]:
    """Run directories at or under each path, in order, each once. A directory that cannot be listed (no
    permission) is among them, as a run might be: `load_runs` reports it, where os.walk alone would skip it."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        try:
            if not p.exists():
                raise CompareError(f"{p} does not exist (expected a run directory or a sweep directory)")
            if p.is_file():
                p = p.parent
        except OSError as e:  # a directory above it that this user may not enter
            raise CompareError(f"{p}: cannot be read ({e.strerror or e})") from None
        if _looks_like_run(p):
            found[p] = None
            continue
        for root, dirs, _ in os.walk(p, onerror=lambda e: found.setdefault(Path(e.filename), None)):
            here = Path(root)
            if here != p and _looks_like_run(here):
                found[here] = None
                dirs[:] = []
                continue
            dirs[:] = sorted((d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS), key=_natural)
    return list(found)


def _unreadable(path: Path, e: OSError) -> str:
    """The reason a run directory `path` cannot be compared, for an OSError reading it (no permission)."""
    inside = e.filename and Path(e.filename) != path and os.access(path, os.R_OK | os.X_OK)
    what = Path(e.filename).name if inside else "the directory"  # (a directory not to be entered: none of its files)
    return (f"cannot read {what} ({e.strerror or e}); if the run is someone else's, its owner can share it: "
            f"chmod -R a+rX {path}")


def load_runs(paths: Sequence[Path | str]) -> tuple[list[Run], list[BrokenRun]]:
    """Readable runs and the run-like dirs that could not be read (with the reason).

    A directory holding only Hydra's own files (`.hydra/`, `*.log`) is skipped quietly: every
    `gspo train resume=...` leaves one beside the run it continues. A run whose files this user may not read
    (another user's, written owner-only) is one of the broken, its reason naming the file.
    """
    runs, broken = [], []
    for path in find_run_dirs(paths):
        try:
            runs.append(_load_run(path))
        except _HydraOnly:
            continue
        except _Broken as e:
            broken.append(BrokenRun(path, str(e)))
        except OSError as e:  # no permission (a file or the directory itself)
            broken.append(BrokenRun(path, _unreadable(path, e)))
    return runs, broken

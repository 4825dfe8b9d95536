"""What a comparison computes and its report shows: groups of runs, their curves and statistics.

The data types shared by `compare` (which fills them) and `report` / `plots` (which show them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from gspo.results.runs import BrokenRun, Run
from gspo.results.stats import Bootstrap, Paired, Welch, mean_ci


@dataclass
class Stat:
    """Mean, sample std and 95% t-interval half-width over runs (std, ci None with one run; mean None with none)."""

    mean: float | None
    std: float | None
    n: int
    ci: float | None = None  # the 95% interval is mean ± ci (Student t, n - 1 degrees of freedom)
    values: tuple[float, ...] = ()  # the runs' own values (the seeds), for pairwise comparisons

    @classmethod
    def of(cls, values: Iterable[float | None]) -> "Stat":
        vals = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return cls(None, None, 0)
        mean = float(np.mean(vals))
        std = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
        ci = mean_ci(vals)[1] if len(vals) > 1 else None
        if std is not None and std < 1e-12 * max(1.0, abs(mean)):
            std = ci = 0.0  # rounding noise of equal values
        return cls(mean, std, len(vals), ci, tuple(vals))


@dataclass
class Curve:
    """A metric aggregated over a group's runs, aligned by step."""

    steps: np.ndarray
    mean: np.ndarray
    std: np.ndarray  # sample std; 0 where fewer than 2 runs have the step
    n: np.ndarray  # runs with a finite value at each step
    runs: list[tuple[np.ndarray, np.ndarray]]  # each run's own (steps, values)


@dataclass
class Group:
    label: str
    value: Any
    runs: list[Run]

    def curve(self, key: str) -> Curve | None:
        return aggregate(self.runs, key)


@dataclass
class Pairwise:
    """One group against the baseline group: a Welch interval per statistic (None: < 2 seeds on a side); the final
    accuracy's difference paired by seed where the groups share seeds (the same seed draws the same prompts in every
    arm), the probability of improvement, the smallest difference this study detects at 80% power, the seeds a
    given difference needs, and the difference on the same held-out problems."""

    group: str
    baseline: str
    stats: dict[str, Welch | None]
    paired: Paired | None = None  # final acc, group − baseline over the shared seeds (95%)
    paired_family: Paired | None = None  # the same at the Bonferroni level of the table's comparisons
    improvement: Bootstrap | None = None  # P(a seed's final acc in the group > one in the baseline), with its interval
    detectable: float | None = None  # smallest true difference detected at 80% power (Welch's design, this spread)
    detectable_paired: float | None = None  # the same for the paired comparison (the spread of the differences)
    power_delta: float | None = None  # `--power DELTA`: the difference asked about
    seeds_needed: int | None = None  # seeds per arm for DELTA at 80% power (unpaired), None: beyond the cap
    seeds_needed_paired: int | None = None  # seed pairs for DELTA (paired)
    problems: Bootstrap | None = None  # on the same held-out problems: the runs' final answers, problems resampled
    problems_n: int = 0  # the problems both groups' final evaluations answered


@dataclass
class CompareResult:
    by: str
    groups: list[Group]
    rows: list[dict[str, Any]]
    baseline: str | None
    pairwise: list[Pairwise]
    target: float | None  # the eval/accuracy level of "steps to target"
    target_note: str  # how that level was set
    figures: list[Path]
    table_path: Path | None
    broken: list[BrokenRun]
    warnings: list[str]
    out_dir: Path


def aggregate(runs: Sequence[Run], key: str) -> Curve | None:
    """Mean and sample std over runs at each step; non-finite values are left out."""
    per_run = [r.series(key) for r in runs]
    per_run = [sv for sv in per_run if len(sv[0])]
    if not per_run:
        return None
    steps = np.unique(np.concatenate([s for s, _ in per_run]))
    values = np.full((len(per_run), len(steps)), np.nan)
    for i, (s, v) in enumerate(per_run):
        values[i, np.searchsorted(steps, s)] = v
    finite = np.isfinite(values)
    n = finite.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(finite, values, 0.0).sum(axis=0) / n
        sq = np.where(finite, (values - mean) ** 2, 0.0).sum(axis=0)
        std = np.where(n > 1, np.sqrt(sq / np.maximum(n - 1, 1)), 0.0)
    return Curve(steps, np.where(n > 0, mean, np.nan), std, n, per_run)

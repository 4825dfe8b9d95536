"""`gspo compare`: read run directories, aggregate over seeds, plot, tabulate.

    result = compare(["outputs/multirun/2026-01-01/12-00-00"], by="algo")
    print_report(result)        # console table, warnings, broken run dirs

A PATH is a run directory (config.yaml + metrics.jsonl) or any directory above
run directories (a Hydra sweep dir, outputs/); `.hydra`, `wandb`, `checkpoints`
and hidden folders are not searched. Runs are grouped by a dotted config key
(`algo` means `algo.name`); the runs of a group are treated as seeds.

Aggregation: at each step, mean and sample std (ddof=1) over the group's runs
with a finite value there; partial runs stop contributing after their last
step. Per-run statistics (final and best accuracy, ...) get a 95% Student-t
interval over seeds, and each group a Welch interval for its difference from a
`baseline` group (gspo/results/stats.py). The collapse flag and the steps-to-target
level are defined in `detect_collapse` and `accuracy_target`, and explained in
docs/compare.md. The table and the console report are written by gspo/results/report.py,
the figure by gspo/results/plots.py.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gspo.results.groups import CompareResult, Group, Pairwise, Stat
from gspo.results.report import print_report, write_markdown  # noqa: F401  (print_report: part of this module's API)
from gspo.results.runs import (  # noqa: F401  (CompareError, load_runs: part of this module's API)
    _MISSING, ACC, CLIP, CLIP_HIGH, CLIP_LOW, EXPLAINED_VAR, EVAL_N, GROUPS_DRAWN, KL_OLD, KL_SPIKE, LOSS, MISMATCH_KL,
    RATIO_MAX, REWARD, REWARD_STD, ROUTING, ROUTING_MISMATCH, STEP_S, VALUE_CLIP, VALUE_LOSS, VALUE_MEAN, BrokenRun,
    CompareError,
    Run, _flatten, _looks_like_run, load_runs, lookup,
)
from gspo.results.stats import (
    LEVEL, bootstrap_problems, detectable, paired, pooled_sd, prob_improvement, seeds_needed, welch,
)
from gspo.config import keys
from gspo.core import provenance
from gspo.train.evaluation import heldout

PAIRWISE_STATS = ("final_acc", "best_acc")  # compared against the baseline group, with Welch intervals
POWER = 0.8  # the power at which compare states the smallest detectable difference and the seeds a difference needs

# Config keys whose differences make runs incomparable (unless it is the grouping key).
COMPARABILITY_KEYS = ("model.", "task.", "reward.", "rollout.", "train.steps", "train.minibatches")
# Rollout keys that are a treatment, not the rollout budget: a study compares runs that differ in them
# (the sampler's precision, where the old log-probs come from, the mismatch corrections).
TREATMENT_KEYS = ("rollout.dtype", "rollout.old_logprobs", "rollout.mismatch_every", "rollout.tis", "rollout.mask",
                  "rollout.offpolicy_mask_delta", "rollout.staleness", "rollout.keep_topk")
# Keys that never make two runs different experiments (bookkeeping, logging, diagnostics, how the same
# arithmetic is laid out on the machine): the schema's RUN keys, the seed and a preset's name (gspo/config/keys.py),
# and two names no schema has held (`run_dir`, `output_dir`). Everything else does: runs of a group differ in the
# seed alone.
IGNORED_KEYS = (*keys.prefixes(lambda k: not keys.separates_arms(k)), "run_dir", "output_dir")


# -- analysis ------------------------------------------------------------------
MIN_WINDOW = 5  # the collapse rule's smallest moving-average window (steps)
NOISE_Z = 3.0  # a collapse must exceed this many standard errors of the reward noise


def reward_noise(rewards: np.ndarray, sampling_se: float = 0.0) -> float:
    """Std of the per-step reward noise: the larger of a robust estimate from the series and the sampling floor.

    Robust: median |r_{i+1} - r_i| / (0.6745·√2). For independent noise of std σ around a slowly moving mean,
    r_{i+1} - r_i has std σ√2 and median absolute value 0.6745·σ√2; the median ignores the few steps where the
    mean itself jumps (a collapse), so the collapse does not inflate its own noise bar. But on sparse rewards
    most steps' means are equal (all 0) and that median is 0: then the floor holds, `sampling_se` = the
    standard error of a step's mean reward, √(mean over steps of reward/std²) / √(completions per step).
    """
    if len(rewards) < 2:
        return sampling_se
    return max(float(np.median(np.abs(np.diff(rewards)))) / (0.6745 * math.sqrt(2.0)), sampling_se)


def sampling_se(run: Run) -> float:
    """The standard error of one step's reward/mean from its logged reward/std and batch size (0 if unknown)."""
    _, std = run.series(REWARD_STD)
    per_step = lookup(run.config, "rollout.prompts_per_step"), lookup(run.config, "rollout.group_size")
    std = std[np.isfinite(std)]
    if not len(std) or not all(isinstance(x, int) and x > 0 for x in per_step):
        return 0.0
    return float(np.sqrt(np.mean(std**2))) / math.sqrt(per_step[0] * per_step[1])  # pooled: sparse steps' std is 0


def completions_sampled(run: Run) -> float | None:
    """The completions a run sampled over its training steps: per step its groups drawn (`sampling/groups_drawn`,
    logged where dynamic sampling draws more than one batch) or else `rollout.prompts_per_step`, times
    `rollout.group_size`; None when the config does not say the batch's size."""
    prompts, group = lookup(run.config, "rollout.prompts_per_step"), lookup(run.config, "rollout.group_size")
    if not all(isinstance(x, int) and x > 0 for x in (prompts, group)):
        return None
    steps = run.series(REWARD)[0]
    drawn = dict(zip(*(a.tolist() for a in run.series(GROUPS_DRAWN))))
    return float(group * sum(drawn.get(s, prompts) for s in steps.tolist() if s >= 1))


def detect_collapse(run: Run) -> tuple[str | None, int | None]:
    """(reason, step) when the run collapsed, else (None, None).

    Collapsed: (a) any NaN/inf in reward/mean or train/loss; or (b), with n reward/mean
    values, the window w = max(5, round(0.1·n)) and n >= 3·w (at least 15 steps: a window
    to start from, one to peak in, one to stay down in), ma their trailing moving average
    over w steps, initial = ma[0], peak = max(ma), drop = 0.5·max(peak − initial, 0.5·|peak|):
    ma < peak − drop on each of the last >= w points up to the end (after its peak the run lost
    half its gain, and at least a quarter of the peak, and never came back), and the fall from
    the peak to the highest point of that final stretch exceeds 3·σ·sqrt(2/w), the noise of a
    difference of two window means, σ = reward_noise(rewards, sampling_se(run)). The step is
    where that final stretch began. Measured false-positive rate on trendless series (binary
    rewards, 16 a step, p from 0.02 to 0.9, 30 to 200 steps): at most 0.1% (docs/compare.md,
    `python scripts/collapse_rates.py`).
    """
    for key in (REWARD, LOSS):
        steps, values = run.series(key)
        bad = ~np.isfinite(values)
        if bad.any():
            return f"non-finite {key} at step {int(steps[bad][0])}", int(steps[bad][0])
    steps, rewards = run.series(REWARD)
    n = len(rewards)
    w = max(MIN_WINDOW, round(0.1 * n))
    if n < 3 * w:
        return None, None
    ma = np.convolve(rewards, np.ones(w) / w, mode="valid")  # ma[i] ends at steps[i + w - 1]
    initial, peak = ma[0], ma.max()
    drop = 0.5 * max(peak - initial, 0.5 * abs(peak))  # half the gain, at least a quarter of the peak
    below = ma < peak - drop
    if not below[-1]:
        return None, None
    start = len(below) - int(np.argmin(below[::-1])) if not below.all() else 0
    if len(below) - start < w:
        return None, None
    # the fall, peak to the highest point of the stretch it stayed down in, beyond the noise of two window means
    if peak - ma[start:].max() <= NOISE_Z * reward_noise(rewards, sampling_se(run)) * math.sqrt(2.0 / w):
        return None, None
    step = int(steps[start + w - 1])
    return (
        f"reward/mean moving average (window {w}) fell from {peak:.3g} to {ma[-1]:.3g} "
        f"at step {step} and did not recover",
        step,
    )


def _label(key: str, value: Any) -> str:
    return str(value) if key == "name" or key.endswith(".name") else f"{key.rsplit('.', 1)[-1]}={value}"


def group_runs(runs: Sequence[Run], key: str) -> list[Group]:
    """Group runs by the value of `key` (several keys: comma-separated, e.g. "algo.name,moe.routing_replay"), then
    split each group by every other config key its runs differ in (`differing_keys`): a group is one config up
    to the seed, so what differs is never averaged as if it were seeds. A split group is named by what differs
    (`grpo eps_high=0.28`)."""
    keys = key.split(",")
    by_value: dict[str, list[Run]] = {}
    values: dict[str, Any] = {}
    for run in runs:
        parts = [lookup(run.config, k) for k in keys]
        value = parts[0] if len(keys) == 1 else " ".join(map(str, parts))
        label = " ".join(_label(k, v) for k, v in zip(keys, parts))
        by_value.setdefault(label, []).append(run)
        values[label] = value
    numeric = all(isinstance(v, (int, float)) for v in values.values())
    order = sorted(by_value, key=(lambda l: values[l]) if numeric else str)
    groups = []
    for label in order:
        members = by_value[label]
        split = differing_keys(members, keys)
        subs: dict[str, list[Run]] = {}
        for run in members:
            flat = _flatten(run.config)
            sub = " ".join(_label(k, flat.get(k, _MISSING)) for k in split)
            subs.setdefault(sub, []).append(run)
        for sub in sorted(subs):
            groups.append(Group(f"{label} {sub}".strip(), values[label], subs[sub]))
    return groups


def differing_keys(runs: Sequence[Run], group_keys: Sequence[str] = ()) -> list[str]:
    """The config keys (not ignored, not the grouping keys) whose values differ between `runs`.

    A key missing from some runs' config.yaml (written by an older gspo) counts as differing only when the
    runs that have it disagree."""
    flats = [_flatten(r.config) for r in runs]
    own = tuple(k[: -len(".name")] if k.endswith(".name") else k for k in group_keys)
    out = []
    for k in sorted({k for f in flats for k in f}):
        if k in group_keys or k in own or k.startswith(IGNORED_KEYS):
            continue
        if len({repr(f[k]) for f in flats if k in f}) > 1:
            out.append(k)
    # a preset's own keys (algo.loss, algo.eps_high, ...) follow its name: the name alone tells those runs apart
    names = [k for k in out if k.endswith(".name")]
    for name in names:
        node = name[: -len("name")]
        follows = {k for k in out if k.startswith(node) and k != name and all(
            len({repr(f.get(k, _MISSING)) for f in flats if f.get(name) == v}) == 1 for v in {f.get(name) for f in flats})}
        out = [k for k in out if k not in follows]
    return out


def _diff_text(flats: list[dict], key: str) -> str:
    counts = Counter(repr(f.get(key, _MISSING)) for f in flats)
    return f"{key} (" + ", ".join(f"{v} ×{c}" for v, c in counts.most_common()) + ")"


def comparability_warnings(groups: Sequence[Group], key: str) -> list[str]:
    """Differences other than the grouping key that make the comparison unfair."""
    group_keys = key.split(",")
    own = tuple(k[: -len(".name")] + "." if k.endswith(".name") else k for k in group_keys)

    def relevant(k: str) -> bool:
        return k not in group_keys and not k.startswith(own) and not k.startswith(IGNORED_KEYS)

    runs = [r for g in groups for r in g.runs]
    flats = [_flatten(r.config) for r in runs]
    keys = sorted({k for f in flats for k in f})
    warnings = []
    budget = lambda k: k.startswith(COMPARABILITY_KEYS) and not k.startswith(TREATMENT_KEYS)  # noqa: E731
    # a key missing from an older run's config.yaml differs only where the runs that have it disagree
    differ = [k for k in keys if relevant(k) and budget(k) and len({repr(f[k]) for f in flats if k in f}) > 1]
    if differ:
        warnings.append("runs are NOT comparable (base model, task or rollout budget differ): "
                        + "; ".join(_diff_text(flats, k) for k in differ))
    by_key: dict[str, list[Group]] = {}
    for g in groups:  # groups that group_runs split: say so once per grouping value
        by_key.setdefault(repr(g.value), []).append(g)
    for same in by_key.values():
        if len(same) > 1:
            split = differing_keys([r for g in same for r in g.runs], group_keys)
            warnings.append(f"{same[0].label.split(' ')[0]}: its runs differ in {', '.join(split)}, so they are "
                            f"{len(same)} groups, not one ({', '.join(g.label for g in same)})")
    for g in groups:
        dupes = [s for s, c in Counter(repr(r.seed) for r in g.runs).items() if c > 1]
        if dupes:
            warnings.append(f"group {g.label} has several runs with seed {', '.join(dupes)}")
    base: dict[str, dict[str, float]] = {}
    for g in groups:
        for r in g.runs:
            steps, acc = r.series(ACC)
            if len(steps) and steps[0] == 0 and math.isfinite(acc[0]):
                base.setdefault(repr(r.seed), {})[g.label] = float(acc[0])
    for seed, by_group in base.items():
        if max(by_group.values()) - min(by_group.values()) > 1e-9:
            warnings.append(f"step-0 eval/accuracy differs between groups for seed {seed} ("
                            + ", ".join(f"{k} {v:.3f}" for k, v in by_group.items())
                            + "): are the base weights and eval prompts the same?")
    return warnings


UNRECORDED = provenance.label({})


def machines(run: Run) -> list[str]:
    """The machines `run` ran on, first to last (`provenance.label`; a resume on another adds one)."""
    return list(dict.fromkeys(provenance.label(m) for m in provenance.history(run.summary or {})))


def machine_warnings(groups: Sequence[Group]) -> list[str]:
    """Where runs that a comparison treats alike ran on different machines (another CPU or package set computes
    other float sums, and the same seed's run parts from itself: docs/contracts.md, `seed`): a run continued on
    another machine, a group whose runs ran on several, a seed whose arms did."""
    warnings = []
    for g in groups:
        for r in g.runs:
            if len(machines(r)) > 1:
                warnings.append(f"run {r.path} went on on another machine: {' -> '.join(machines(r))}")
        ran = Counter(m for r in g.runs for m in machines(r))
        if len(set(ran) - {UNRECORDED}) > 1:  # (a run that recorded none may have run anywhere: not a difference)
            warnings.append(f"group {g.label}: its runs ran on {len(ran)} machines ("
                            + "; ".join(f"{m} x{c}" for m, c in ran.most_common()) + ")")
    by_seed: dict[str, dict[str, str]] = {}
    for g in groups:
        for r in g.runs:
            by_seed.setdefault(repr(r.seed), {})[g.label] = machines(r)[-1]
    for seed, arms in by_seed.items():
        if len(set(arms.values()) - {UNRECORDED}) > 1:
            warnings.append(f"seed {seed}: its arms ran on different machines ("
                            + "; ".join(f"{g} on {m}" for g, m in arms.items()) + ")")
    return warnings


def final_outcomes(run: Run) -> tuple[str, list[bool]] | None:
    """(the held-out problems' digest, which of them the run's last recorded evaluation answered right), from its
    heldout.jsonl; None for a run that recorded none (runs from before the record)."""
    records = heldout.read_records(run.path)
    if not records:
        return None
    last = max(records, key=lambda rec: rec["step"])
    return last["problems"], [c == "1" for c in last["correct"]]


def spikes(run: Run) -> float | None:
    """The training steps whose kl/old passed KL_SPIKE; None where the run logged no kl/old."""
    s, v = run.series(KL_OLD)
    v = v[(s >= 1) & np.isfinite(v)]
    return float((v > KL_SPIKE).sum()) if len(v) else None


def run_stats(run: Run, target: float | None) -> dict[str, float | None]:
    """One run's statistics, as the table shows them: base / final / best held-out accuracy (final and best
    after step 0), the first step at `target` accuracy, the reward over its last 10% of steps, and the means
    (maxima) of the clip, KL, ratio, sampler/trainer mismatch, routing and time metrics over its training steps;
    a critic's (PPO) value loss, value and value-clip fraction over its training steps and explained variance over
    its last 10% of steps; None where not logged."""
    steps, acc = run.series(ACC)
    ok = np.isfinite(acc)
    steps, acc = steps[ok], acc[ok]

    def train_mean(key: str) -> float | None:
        s, v = run.series(key)
        v = v[(s >= 1) & np.isfinite(v)]
        return float(v.mean()) if len(v) else None

    def train_max(key: str) -> float | None:
        s, v = run.series(key)
        v = v[(s >= 1) & np.isfinite(v)]
        return float(v.max()) if len(v) else None

    def tail_mean(key: str) -> float | None:  # over the last 10% of the steps that logged it
        v = run.series(key)[1]
        v = v[np.isfinite(v)]
        return float(np.mean(v[-max(1, round(0.1 * len(v))):])) if len(v) else None

    _, rewards = run.series(REWARD)
    tail = rewards[-max(1, round(0.1 * len(rewards))):] if len(rewards) else rewards
    reached = steps[(acc >= target) & (steps >= 1)] if target is not None else []
    trained = acc[steps >= 1]  # the step-0 eval is the base, not something training reached
    n_steps, n = run.series(EVAL_N)
    n_final = n[n_steps == steps[-1]] if len(trained) else []
    return {
        "base_acc": float(acc[0]) if len(acc) and steps[0] == 0 else None,
        "final_acc": float(acc[-1]) if len(trained) else None,
        "best_acc": float(trained.max()) if len(trained) else None,
        # one evaluation's own noise: the binomial standard error of the final accuracy over the problems scored
        "final_eval_se": (math.sqrt(acc[-1] * (1 - acc[-1]) / n_final[0]) if len(n_final) and n_final[0] > 0
                          else None),
        "steps_to_target": float(reached[0]) if len(reached) else None,
        "final_reward": float(np.mean(tail)) if len(tail) else None,
        "clip_frac": train_mean(CLIP),
        "clip_frac_low": train_mean(CLIP_LOW),
        "clip_frac_high": train_mean(CLIP_HIGH),
        "kl_old": train_mean(KL_OLD),
        "ratio_max": train_max(RATIO_MAX),
        "mismatch_kl": train_mean(MISMATCH_KL),
        "routing_mismatch": train_mean(ROUTING_MISMATCH),
        "routing_volatility": train_mean(ROUTING),
        "kl_spikes": spikes(run),
        "step_s": train_mean(STEP_S),
        "completions": completions_sampled(run),
        "value_loss": train_mean(VALUE_LOSS),
        "explained_variance": tail_mean(EXPLAINED_VAR),
        "value_mean": train_mean(VALUE_MEAN),
        "value_clip": train_mean(VALUE_CLIP),
    }


def accuracy_target(groups: Sequence[Group], threshold: float | None) -> tuple[float | None, str]:
    """The eval/accuracy level of "steps to target" and a sentence saying how it was set.

    `threshold` when given; else base + 0.5·(best − base), base = mean step-0
    eval/accuracy over all runs, best = the highest point of any group's mean
    eval/accuracy curve; None when no group improved on the base.
    """
    if threshold is not None:
        return float(threshold), f"Steps to target: first step with eval/accuracy >= {threshold:g} (given)."
    bases = [run_stats(r, None)["base_acc"] for g in groups for r in g.runs]
    base = Stat.of(bases).mean
    curves = [g.curve(ACC) for g in groups]
    best = max((float(np.nanmax(c.mean)) for c in curves if c is not None and np.isfinite(c.mean).any()),
               default=None)
    if base is None or best is None or best <= base:
        return None, "Steps to target: undefined (no step-0 eval/accuracy, or no group improved on it)."
    target = base + 0.5 * (best - base)
    return target, (f"Steps to target: first step with eval/accuracy >= {target:.3f} "
                    f"= base {base:.3f} + 0.5 × (best group mean {best:.3f} − base).")


def _seed_order(seed: Any) -> tuple:
    """Numeric seeds in numeric order, then any others by their text."""
    number = isinstance(seed, (int, float)) and not isinstance(seed, bool)
    return (0, seed, "") if number else (1, 0, repr(seed))


def summarize_group(group: Group, target: float | None) -> dict[str, Any]:
    stats = [run_stats(r, target) for r in group.runs]
    last = [r.last_step for r in group.runs]
    row: dict[str, Any] = {
        "group": group.label,
        "target": target,
        "runs": len(group.runs),
        "seeds": [r.seed for r in group.runs],
        "steps_min": min(last),
        "steps_max": max(last),
        "partial": sum(r.partial for r in group.runs),
        "collapsed": sum(r.collapse is not None for r in group.runs),
    }
    counted = [s["kl_spikes"] for s in stats if s["kl_spikes"] is not None]
    # runs with at least one spike, of those that logged kl/old (a count Fisher's exact test takes), and their steps
    row["spiked"] = (sum(c > 0 for c in counted), len(counted), int(sum(counted))) if counted else None
    for key in stats[0]:
        row[key] = Stat.of(s[key] for s in stats)
    row["final_by_seed"] = sorted(((r.seed, s["final_acc"]) for r, s in zip(group.runs, stats)
                                   if s["final_acc"] is not None), key=lambda pair: _seed_order(pair[0]))
    row["machine_by_seed"] = {repr(r.seed): machines(r)[-1] for r in group.runs}
    row["machines"] = Counter(m for r in group.runs for m in machines(r))
    outcomes = [final_outcomes(r) for r in group.runs]
    digests = {o[0] for o in outcomes if o is not None}
    # the share of the group's runs that answered each problem right (only where every run recorded the same problems)
    row["problem_rates"] = (None if len(digests) != 1 or None in outcomes else
                            (digests.pop(), np.mean([o[1] for o in outcomes], axis=0).tolist()))
    return row


def _pair(row: dict[str, Any], base: dict[str, Any], level: float):
    """The final accuracy of `row` − `base` paired by seed, over the seeds both have whose runs ran on the same
    machine (a seed whose arms ran on different machines is no pair: compare warns about it)."""
    def same(seed: Any) -> bool:
        here, there = row["machine_by_seed"].get(repr(seed)), base["machine_by_seed"].get(repr(seed))
        return here == there or UNRECORDED in (here, there)

    a = {s: v for s, v in row["final_by_seed"] if same(s)}
    b = {s: v for s, v in base["final_by_seed"] if same(s)}
    return paired(a, b, level)


def pairwise(rows: Sequence[dict[str, Any]], baseline: str, power_delta: float | None = None) -> list[Pairwise]:
    """Each other group against `baseline` (a group label): Welch 95% intervals for mean differences, and for
    the final accuracy also at the Bonferroni level 1 - 0.05 / m over the table's m comparisons, whose intervals
    then all hold together with 95% probability (the same as the 95% one when m = 1); where the groups share seeds,
    the final accuracy's difference paired by seed (95% and Bonferroni); the probability of improvement; the
    smallest difference this spread and these seeds detect at 80% power (unpaired and paired); with `power_delta`,
    the seeds that difference needs; where both groups recorded their runs' answers to the same held-out problems,
    the difference on those problems (problems resampled: the evaluation's noise, not the seeds')."""
    base = next(r for r in rows if r["group"] == baseline)
    others = [r for r in rows if r["group"] != baseline]
    family = 1 - (1 - LEVEL) / max(1, len(others))
    pairs = []
    for r in others:
        a, b = r["final_acc"].values, base["final_acc"].values
        pair = Pairwise(r["group"], baseline, {**{k: welch(r[k].values, base[k].values) for k in PAIRWISE_STATS},
                                               "final_acc_family": welch(a, b, family)})
        pair.paired, pair.paired_family = _pair(r, base, LEVEL), _pair(r, base, family)
        pair.improvement = prob_improvement(a, b)
        sd = pooled_sd(a, b)
        d_sd = pair.paired.sd if pair.paired is not None else None
        if sd is not None and sd > 0:
            pair.detectable = detectable(sd, min(len(a), len(b)), power=POWER)
        if d_sd is not None and d_sd > 0:
            pair.detectable_paired = detectable(d_sd, pair.paired.n, power=POWER, paired=True)
        if power_delta is not None:
            pair.power_delta = power_delta
            if sd is not None and sd > 0:
                pair.seeds_needed = seeds_needed(power_delta, sd, power=POWER)
            if d_sd is not None and d_sd > 0:
                pair.seeds_needed_paired = seeds_needed(power_delta, d_sd, power=POWER, paired=True)
        pa, pb = r["problem_rates"], base["problem_rates"]
        if pa is not None and pb is not None and pa[0] == pb[0]:
            pair.problems, pair.problems_n = bootstrap_problems(pa[1], pb[1]), len(pa[1])
        pairs.append(pair)
    return pairs


# -- output --------------------------------------------------------------------
def _pair_json(p: Pairwise) -> dict[str, Any]:
    """A comparison as compare.json holds it: each interval with its ends."""
    def interval(x: Any) -> Any:
        if x is None or isinstance(x, (int, float)):
            return x
        out = asdict(x)
        if hasattr(x, "low"):
            out |= {"low": x.low, "high": x.high}
        return out

    return {"group": p.group, "baseline": p.baseline, **{k: interval(w) for k, w in p.stats.items()},
            **{k: interval(getattr(p, k)) for k in ("paired", "paired_family", "improvement", "detectable",
                                                     "detectable_paired", "power_delta", "seeds_needed",
                                                     "seeds_needed_paired", "problems", "problems_n")}}


def _default_out(paths: Sequence[Path], runs: Sequence[Run]) -> Path:
    """The first PATH that is a sweep (not a run) dir, else the runs' common parent, + /compare."""
    for p in paths:
        if p.is_dir() and not _looks_like_run(p):
            return p / "compare"
    return Path(os.path.commonpath([r.path.resolve() for r in runs])) / "compare"


def compare(
    paths: Sequence[Path | str] | Path | str,
    by: str = "algo",
    out: Path | str | None = None,
    threshold: float | None = None,
    plot: bool = True,
    baseline: str | None = None,
    power: float | None = None,
) -> CompareResult:
    """Load, group, check, aggregate, plot and tabulate; writes OUT/compare.{png,svg,md,json}.

    `baseline`: a group label (as the table shows it, e.g. `grpo`); every other group is then
    compared with it (difference of means, Welch 95% interval, paired by seed where they share seeds) for final
    and best accuracy. `power`: a difference of final accuracy (0.05 = 5 points) whose seeds needed at 80% power
    each comparison states, from its own spread.
    """
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not paths:
        raise CompareError("give at least one run directory or sweep directory")
    key = ",".join("algo.name" if k.strip() == "algo" else k.strip() for k in by.split(","))
    if threshold is not None and not 0 <= threshold <= 1:
        raise CompareError(f"--threshold {threshold}: must be in [0, 1] (a held-out accuracy)")
    if power is not None and not 0 < power <= 1:
        raise CompareError(f"--power {power}: must be in (0, 1] (a difference of held-out accuracy: 0.05 = 5 points)")
    if power is not None and baseline is None:
        raise CompareError("--power needs --baseline: it says how many seeds a difference from the baseline needs")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise CompareError(f"--out {out}: a file is there; --out names a directory")
    runs, broken = load_runs(paths)
    if not runs:  # (one line, as every error: the first few reasons, then how many more)
        detail = "; ".join(f"{b.path}: {b.reason}" for b in broken[:3]) + (
            f"; and {len(broken) - 3} more" if len(broken) > 3 else "")
        raise CompareError(f"no readable run directory under {', '.join(map(str, paths))}"
                           + (f" ({detail})" if detail else ""))
    warnings = [note for r in runs for note in r.notes]
    for run in runs:
        run.collapse, run.collapse_step = detect_collapse(run)
    groups = group_runs(runs, key)
    labels = [g.label for g in groups]
    if baseline is not None and baseline not in labels:
        raise CompareError(f"--baseline {baseline}: no such group. Groups (by {key}): {', '.join(labels)}")
    if any(all(lookup(r.config, k) == _MISSING for r in runs) for k in key.split(",")):
        warnings.append(f"no run has the config key {key!r}: all runs form one group")
    warnings += comparability_warnings(groups, key)
    warnings += machine_warnings(groups)
    partial = [r for r in runs if r.partial]
    if partial:
        warnings.append(f"{len(partial)} run(s) are partial (still running or stopped early); "
                        "group means use the runs that reached each step")
    target, target_note = accuracy_target(groups, threshold)
    rows = [summarize_group(g, target) for g in groups]
    schedules = Counter(repr(lookup(r.config, "eval.every")) for r in runs)
    if len(schedules) > 1:  # a run evaluated more often has more chances at a high point, and reaches a target sooner
        warnings.append("best acc and steps to target are left out: they depend on how often a run is evaluated, "
                        "and eval.every differs (" + ", ".join(f"{v} ×{c}" for v, c in schedules.most_common())
                        + "); final acc is compared")
        for row in rows:
            row["best_acc"] = row["steps_to_target"] = Stat.of([])
    pairs = pairwise(rows, baseline, power) if baseline is not None else []
    out_dir = Path(out) if out is not None else _default_out(paths, runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    from gspo.results.plots import plot_groups  # matplotlib only when a figure is asked for

    figures = plot_groups(groups, out_dir) if plot else []
    result = CompareResult(key, groups, rows, baseline, pairs, target, target_note, figures,
                           out_dir / "compare.md", broken, warnings, out_dir)
    write_markdown(result, result.table_path)
    (out_dir / "compare.json").write_text(json.dumps(
        {"by": key, "target": target, "level": 0.95, "baseline": baseline,
         "rows": [{k: asdict(v) if isinstance(v, Stat) else dict(v) if isinstance(v, Counter) else v
                   for k, v in r.items() if k != "problem_rates"} for r in rows],
         "pairwise": [_pair_json(p) for p in pairs]}, indent=1))
    return result

"""gspo against itself: the time per RL step under alternative overrides, on the same work (CPU).

For choosing a default by measurement (the cheap levers: experts kernels, attention
implementations, decode engines, ...). Each `--option "NAME OVERRIDE..."` is one side (no
overrides: gspo as configured); the runs alternate side by side, each in a fresh subprocess, on
the work of `--variant` (the same variants and flags as bench_vs_trl.py). The table shows each
side's median s/step over the post-warm-up steps of every round, its rollout and update parts,
its mean completion length and reward (equal work: equal lengths), and its ratio to the first side.

Usage (repository root, in the venv):
  python scripts/bench_options.py --variant long16 --option "grouped_mm" \\
      --option "batched_mm model.experts_implementation=batched_mm" --option "eager model.experts_implementation=eager"
  python scripts/bench_options.py --variant long64 --option "fast rollout.engine=fast" --option "hf rollout.engine=hf"
"""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path

from bench_common import (
    Run,
    describe_work,
    fmt,
    gspo_overrides,
    markdown_table,
    pooled,
    ratio,
    run_benchmark,
    versions,
)
from bench_workers import gspo_side


def options(a) -> dict[str, list[str]]:
    """{side name: its extra overrides} from the `--option` flags, in order."""
    out = {}
    for text in a.option:
        name, *overrides = shlex.split(text) or [""]
        if not name or name in out:
            raise SystemExit(f"--option: every side needs a name of its own ('{name}')")
        out[name] = overrides
    if len(out) < 2:
        raise SystemExit('give at least two --option "NAME [KEY=VALUE ...]" sides')
    return out


def sides(a, model_dir: Path) -> dict:
    return {name: gspo_side({"overrides": gspo_overrides(a, model_dir) + overrides, "threads": a.threads}, a.wait_idle)
            for name, overrides in options(a).items()}


def table(results: dict[str, list[Run]], a) -> str:
    rows, first = [], None
    for name, runs in results.items():
        med = statistics.median(pooled(runs))
        first = med if first is None else first
        rows.append([name, " ".join(options(a)[name]) or "(none)", fmt(med),
                     fmt(statistics.median(pooled(runs, "rollout_s"))), fmt(statistics.median(pooled(runs, "update_s"))),
                     ", ".join(fmt(statistics.median(r.steps[1:])) for r in runs),
                     fmt(statistics.mean(pooled(runs, "len_mean")), 1), fmt(statistics.mean(pooled(runs, "reward_mean")), 3),
                     f"{max(r.rss_mib for r in runs):,.0f}", ratio(med, first)])
    header = ["side", "overrides", "median s/step", "rollout s", "update s", "per-round medians (s)",
              "mean completion length", "mean reward", "peak RSS (MiB)", "/ first"]
    extra = f"overrides added to every side: {' '.join(a.override)}" if a.override else "overrides added to every side: none"
    return "\n".join([f"Work: {describe_work(a, ', '.join(results))}.", extra + ".", "",
                      markdown_table(header, rows, right={2, 3, 4, 6, 7, 8, 9}), "", f"Versions: {versions(a.threads)}."])


def more_args(p) -> None:
    p.add_argument("--option", action="append", default=[], metavar='"NAME [KEY=VALUE ...]"',
                   help="one side: a name, then its gspo overrides (repeat; at least two sides)")


if __name__ == "__main__":
    run_benchmark(__doc__.split("\n\n")[0], sides, table, "bench-options-", more_args)

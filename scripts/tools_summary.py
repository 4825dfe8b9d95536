"""What a study with tools (docs/results/tool-use.md) measured, run by run: the base's held-out greedy accuracy
and share of correct tool calls (step 0) against the final ones, and the sampled batches' tool metrics at the start
and the end of training.

    python scripts/tools_summary.py outputs/study_tools outputs/study_tools_bases

One markdown row per run (`eval/accuracy`, `eval/correct_call`: trajectories that called the tool and got the
product back, `eval/tool_calls_mean`, each as base -> final), then the batches' `rollout/tool_calls_mean`,
`reward/correct_call/mean` and `rollout/tool_errors_frac` averaged over the first and the last 10 steps; then each
group's mean change with its range over runs. Runs are grouped by `algo.name` and `model.warm_start.seed`.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np

from gspo.results.runs import load_runs, lookup

EVAL = ("eval/accuracy", "eval/correct_call", "eval/tool_calls_mean")
BATCH = ("rollout/tool_calls_mean", "reward/correct_call/mean", "rollout/tool_errors_frac")


def ends(run, key: str, window: int = 0) -> tuple[float, float]:
    """(first, last) of a metric: its step-0 and final values, or with `window` the means of the first and last
    `window` training steps."""
    steps, values = run.series(key)
    keep = values == values
    steps, values = steps[keep], values[keep]
    if window:
        values = values[steps > 0]
        return float(np.mean(values[:window])), float(np.mean(values[-window:]))
    return float(values[steps == steps.min()][0]), float(values[-1])


def main(roots: list[str]) -> None:
    runs, _ = load_runs(roots)
    groups: dict[str, list] = {}
    print("| run | " + " | ".join(EVAL + BATCH) + " |")
    print("|---|" + "---|" * (len(EVAL) + len(BATCH)))
    for run in sorted(runs, key=lambda r: str(r.path)):
        cells = [ends(run, k) for k in EVAL] + [ends(run, k, window=10) for k in BATCH]
        group = f"{lookup(run.config, 'algo.name')} ws{lookup(run.config, 'model.warm_start.seed')}"
        groups.setdefault(group, []).append(cells)
        print(f"| {run.path} | " + " | ".join(f"{a:.3f} -> {b:.3f}" for a, b in cells) + " |")
    print("\n| group | runs | " + " | ".join(f"change in {k}" for k in EVAL + BATCH) + " |")
    print("|---|---|" + "---|" * (len(EVAL) + len(BATCH)))
    for group, rows in sorted(groups.items()):
        changes = [[b - a for a, b in (row[i] for row in rows)] for i in range(len(EVAL) + len(BATCH))]
        print(f"| {group} | {len(rows)} | " + " | ".join(
            f"{statistics.mean(c):+.3f} [{min(c):+.3f}, {max(c):+.3f}]" for c in changes) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

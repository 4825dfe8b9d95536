"""The staleness study in one figure: final held-out accuracy against K, one line per cell, 95% intervals.

    python scripts/plot_staleness.py outputs/study_staleness docs/img/staleness_vs_k.png

Runs are read as `gspo compare` reads them (gspo.results.runs); a run's cell is its `name` (+cell=...; without
the `_k<K>` suffix the study's earlier shell runner gave it), its K is its config's `rollout.staleness`. Only
finished runs count. Per (cell, K): the mean over seeds of each run's final acc (its last `eval/accuracy`
after step 0: `gspo compare`'s own per-run statistic, gspo.results.compare.run_stats) and its Student-t 95%
interval (gspo.results.stats.mean_ci); the base's accuracy (step 0) is the dashed line. Also prints the
figure's numbers as a markdown table.
"""

from __future__ import annotations

import re
import sys

from gspo.results.compare import run_stats
from gspo.results.runs import load_runs, lookup
from gspo.results.stats import mean_ci


def cells(root: str) -> tuple[dict[str, dict[int, list[float]]], list[float], set[int]]:
    """cell -> K -> final accuracy of each finished run; every run's base (step-0) accuracy; their train.steps."""
    runs, _ = load_runs([root])
    out: dict[str, dict[int, list[float]]] = {}
    bases: list[float] = []
    lengths: set[int] = set()
    for run in runs:
        stats = run_stats(run, None)
        if not run.finished or stats["final_acc"] is None:
            continue
        k = int(lookup(run.config, "rollout.staleness"))
        cell = re.sub(rf"_k{k}$", "", str(lookup(run.config, "name")))
        out.setdefault(cell, {}).setdefault(k, []).append(stats["final_acc"])
        if stats["base_acc"] is not None:
            bases.append(stats["base_acc"])
        lengths.add(int(lookup(run.config, "train.steps")))
    return out, bases, lengths


def main(root: str, png: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    data, bases, lengths = cells(root)
    ks = sorted({k for c in data.values() for k in c})
    print("| cell | " + " | ".join(f"K = {k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for i, (cell, by_k) in enumerate(sorted(data.items())):
        xs, ys, errs, row = [], [], [], []
        for k in ks:
            vals = by_k.get(k, [])
            ci = mean_ci(vals)
            row.append("—" if ci is None else f"{ci[0]:.3f} ± {ci[1]:.3f} ({len(vals)})")
            if ci is not None:
                xs.append(k + (i - (len(data) - 1) / 2) * 0.06)  # a small dodge, so that the intervals do not overlap
                ys.append(ci[0])
                errs.append(ci[1])
        print(f"| {cell} | " + " | ".join(row) + " |")
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=cell, color=f"C{i}")
    if bases:
        ax.axhline(sum(bases) / len(bases), color="grey", linestyle="--", linewidth=1, label="base (step 0)")
    ax.set_xticks(ks)
    ax.set_xlabel("rollout.staleness K (the batch of step t sampled after step t-1-K)")
    ax.set_ylabel("final held-out accuracy")
    steps = "/".join(str(n) for n in sorted(lengths))
    ax.set_title(f"after {steps} steps: mean over seeds, 95% t interval", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

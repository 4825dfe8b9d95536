"""A cell study in one figure: final held-out accuracy per cell with its 95% interval, and chosen metrics over
the training steps (mean over seeds) for chosen cells.

    python scripts/plot_cells.py outputs/em_grid_lr3e-4 docs/img/engine_mismatch.png \
        --over rollout/mismatch_kl rollout/routing_mismatch --cells grpo grpo_R3 grpo_copy

Runs are read as `gspo compare` reads them (gspo.results.runs), grouped into cells by their `name`; only
finished runs count. A cell's final accuracy is the mean over seeds of each run's last `eval/accuracy` after
step 0 (`gspo compare`'s per-run statistic, gspo.results.compare.run_stats) with its Student-t 95% interval
(gspo.results.stats.mean_ci); every seed is a faint dot, the base (step 0) the dashed line. Each `--over`
metric gets a panel: per cell, the mean over its seeds at each logged step (steps every run of the cell
logged), as a moving average over --smooth steps, on a log axis when every value is positive. Prints the
accuracy panel's numbers as a markdown table.
"""

from __future__ import annotations

import argparse

import numpy as np

from gspo.results.compare import run_stats
from gspo.results.runs import Run, load_runs, lookup
from gspo.results.stats import mean_ci


def finished_cells(root: str) -> dict[str, list[Run]]:
    """cell name -> its finished runs."""
    runs, _ = load_runs([root])
    out: dict[str, list[Run]] = {}
    for run in runs:
        if run.finished:
            out.setdefault(str(lookup(run.config, "name")), []).append(run)
    return out


def mean_curve(runs: list[Run], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The metric's mean over runs at the training steps (> 0) that every run logged it at; None if none."""
    by_step = []  # per run: step -> value, NaN left out
    for run in runs:
        steps, values = run.series(key)
        keep = ~np.isnan(values)
        by_step.append(dict(zip(steps[keep].tolist(), values[keep].tolist())))
    common = sorted(t for t in set.intersection(*(set(d) for d in by_step)) if t > 0) if by_step else []
    if not common:
        return None
    return np.array(common), np.mean([[d[t] for t in common] for d in by_step], axis=0)


def main(root: str, png: str, over: list[str], chosen: list[str] | None, smooth: int = 1) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    cells = finished_cells(root)
    names = sorted(cells)
    fig = Figure(figsize=(5.2 + 4.2 * len(over), 4.2), layout="constrained")
    axes = fig.subplots(1, 1 + len(over), squeeze=False)[0]
    ax = axes[0]
    print("| cell | seeds | final acc [95% CI] |")
    print("|---|---|---|")
    bases = []
    for i, name in enumerate(names):
        stats = [run_stats(run, None) for run in cells[name]]
        finals = [s["final_acc"] for s in stats if s["final_acc"] is not None]
        bases += [s["base_acc"] for s in stats if s["base_acc"] is not None]
        ci = mean_ci(finals)
        if ci is None:
            print(f"| {name} | {len(finals)} | — |")
            continue
        print(f"| {name} | {len(finals)} | {ci[0]:.3f} [{ci[0] - ci[1]:.3f}, {ci[0] + ci[1]:.3f}] |")
        ax.scatter([i] * len(finals), finals, color=f"C{i}", alpha=0.3, s=12)
        ax.errorbar([i], [ci[0]], yerr=[ci[1]], marker="o", capsize=4, color=f"C{i}")
    if bases:
        ax.axhline(float(np.mean(bases)), color="grey", linestyle="--", linewidth=1, label="base (step 0)")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("final held-out accuracy")
    ax.set_title("final accuracy: mean over seeds, 95% t interval", fontsize=10)
    for ax, key in zip(axes[1:], over):
        positive = True
        for i, name in enumerate(names):
            if chosen and name not in chosen:
                continue
            curve = mean_curve(cells[name], key)
            if curve is None:
                continue
            steps, values = curve
            if smooth > 1 and len(values) >= smooth:
                steps, values = steps[smooth - 1:], np.convolve(values, np.ones(smooth) / smooth, mode="valid")
            positive &= bool((values > 0).all())
            ax.plot(steps, values, color=f"C{i}", label=name, linewidth=1)
        if positive and ax.lines:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{key}\n(mean over seeds" + (f", {smooth}-step average)" if smooth > 1 else ")"), fontsize=10)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="the study's output directory (runs found below it)")
    parser.add_argument("png", help="the figure to write")
    parser.add_argument("--over", nargs="*", default=[], help="metrics to plot over the training steps")
    parser.add_argument("--cells", nargs="*", default=None, help="the cells drawn in the --over panels (all)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window of the --over curves")
    args = parser.parse_args()
    main(args.root, args.png, args.over, args.cells, args.smooth)

"""Per-cell means of any logged metrics, for a study whose runs are grouped by their `name` (a cell: +cell=...).

    python scripts/cell_means.py outputs/mm_edge rollout/routing_mismatch rollout/mismatch_kl kl/old
    python scripts/cell_means.py outputs/study_staleness rollout/mismatch_kl --by name rollout.staleness

Prints one markdown row per cell: each metric's mean over a run's training steps (step 0, the base's
evaluation, is left out), then mean ± sample std over the cell's seeds. `gspo compare` shows the headline
statistics; this is for the metrics it does not tabulate. Runs are read as `gspo compare` reads them; `--by`
names the config keys that make a cell (default `name`).
"""

from __future__ import annotations

import argparse
import statistics

from gspo.results.runs import load_runs, lookup


def main(root: str, keys: list[str], by: tuple[str, ...] = ("name",)) -> None:
    runs, _ = load_runs([root])
    cells: dict[str, list] = {}
    for run in runs:
        cells.setdefault(" ".join(str(lookup(run.config, k)) for k in by), []).append(run)
    print("| cell | seeds | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for name in sorted(cells):
        row = []
        for k in keys:
            vals = []
            for run in cells[name]:
                steps, values = run.series(k)
                values = values[(steps > 0) & (values == values)]  # training steps, NaN left out
                if len(values):
                    vals.append(float(values.mean()))
            row.append("—" if not vals else f"{vals[0]:.3g}" if len(vals) == 1
                       else f"{statistics.mean(vals):.3g} ± {statistics.stdev(vals):.2g}")
        print(f"| {name} | {len(cells[name])} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="the study's sweep directory (runs found below it)")
    parser.add_argument("metrics", nargs="+", help="logged metrics to average")
    parser.add_argument("--by", nargs="+", default=["name"], help="config keys that make a cell (default: name)")
    args = parser.parse_args()
    main(args.root, args.metrics, tuple(args.by))

"""Per-cell means of any logged metrics, for a study whose runs are grouped by their `name` (a cell).

    python scripts/cell_means.py outputs/mm_edge rollout/routing_mismatch rollout/mismatch_kl kl/old

Prints one markdown row per cell: each metric's mean over a run's training steps (step 0, the base's
evaluation, is left out), then mean ± sample std over the cell's seeds. `gspo compare` shows the headline
statistics; this is for the metrics it does not tabulate. Runs are read as `gspo compare` reads them.
"""

from __future__ import annotations

import statistics
import sys

from gspo.results.runs import load_runs, lookup


def main(root: str, keys: list[str]) -> None:
    runs, _ = load_runs([root])
    cells: dict[str, list] = {}
    for run in runs:
        cells.setdefault(str(lookup(run.config, "name")), []).append(run)
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
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])

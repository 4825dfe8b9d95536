"""Per-cell means of any logged metrics, for a study laid out as OUT/<cell>/seed<k>/metrics.jsonl.

    python scripts/cell_means.py outputs/mm_edge rollout/routing_mismatch rollout/mismatch_kl kl/old

Prints one markdown row per cell: each metric's mean over a run's training steps (step 0, the base's
evaluation, is left out), then mean ± sample std over the cell's seeds. `gspo compare` shows the headline
statistics; this is for the metrics it does not tabulate.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def run_means(path: Path, keys: list[str]) -> dict[str, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get("step", 0) > 0 and isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def main(root: str, keys: list[str]) -> None:
    print("| cell | seeds | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for cell in sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name not in ("logs", "compare")):
        runs = [run_means(m, keys) for m in sorted(cell.glob("seed*/metrics.jsonl"))]
        cells = []
        for k in keys:
            vals = [r[k] for r in runs if k in r]
            if not vals:
                cells.append("—")
            elif len(vals) == 1:
                cells.append(f"{vals[0]:.3g}")
            else:
                cells.append(f"{statistics.mean(vals):.3g} ± {statistics.stdev(vals):.2g}")
        print(f"| {cell.name} | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])

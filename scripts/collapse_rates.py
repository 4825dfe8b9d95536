"""How often `gspo compare`'s collapse flag fires: on trendless (null) reward series, and on simulated collapses.

    python scripts/collapse_rates.py [--runs 1000] [--seed 0]

Each simulated run logs, per step, the mean and std of `--samples` (16) rewards, as gspo logs reward/mean
and reward/std for a batch of that many completions; `detect_collapse` reads them as it reads a real run.
Null: binary rewards with a fixed success rate p, or Gaussian rewards, no trend. Collapse: the success rate
rises from hi/3 to hi over the first 40% of the steps, holds, then falls to `end` for the last 30%.
Prints one table: the share of runs flagged.
"""

from __future__ import annotations

import argparse

import numpy as np

from gspo.results.compare import detect_collapse
from gspo.results.runs import Run


def simulated_run(rng: np.random.Generator, p: np.ndarray, samples: int = 16, binary: bool = True) -> Run:
    """A run whose step t scores `samples` completions with success rate p[t] (binary) or mean p[t] (normal, sd 0.3)."""
    steps = len(p)
    x = (rng.random((steps, samples)) < p[:, None]).astype(float) if binary else rng.normal(p[:, None], 0.3, (steps, samples))
    st = np.arange(1, steps + 1)
    return Run(path=None, config={"rollout": {"prompts_per_step": samples // 8 or 1, "group_size": min(samples, 8)}},
               metrics={"reward/mean": (st, x.mean(1)), "reward/std": (st, x.std(1, ddof=1)),
                        "train/loss": (st, np.zeros(steps))})


def collapse_curve(steps: int, hi: float, end: float) -> np.ndarray:
    a, b = int(0.4 * steps), int(0.7 * steps)
    return np.concatenate([np.linspace(hi / 3, hi, a), np.full(b - a, hi), np.full(steps - b, end)])


def flagged(runs) -> float:
    runs = list(runs)
    return sum(detect_collapse(r)[0] is not None for r in runs) / len(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    print("| series | steps | flagged |")
    print("|---|---:|---:|")
    for steps in (30, 60, 200):
        for p in (0.02, 0.1, 0.3, 0.5, 0.9):
            rate = flagged(simulated_run(rng, np.full(steps, p)) for _ in range(args.runs))
            print(f"| null, binary p={p} | {steps} | {rate:.1%} |")
        rate = flagged(simulated_run(rng, np.full(steps, 0.5), binary=False) for _ in range(args.runs))
        print(f"| null, normal sd 0.3 | {steps} | {rate:.1%} |")
        for hi, end in ((0.6, 0.05), (0.3, 0.02), (0.1, 0.0)):
            rate = flagged(simulated_run(rng, collapse_curve(steps, hi, end)) for _ in range(args.runs))
            print(f"| collapse {hi / 3:.2g} -> {hi} -> {end} | {steps} | {rate:.1%} |")


if __name__ == "__main__":
    main()

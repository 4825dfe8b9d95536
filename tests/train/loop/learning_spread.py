"""The spread over seeds of the slow learning test, beside this file
(tests/train/loop/test_train.py::test_new_family_learns_on_the_tiny_moe).

The test's run: 60 steps of 16 prompts x 8 on the default tiny MoE and addition prompts, one thread, rewarded
1 for a completion that contains the digit 7 and 0 otherwise (`has_seven`): a reward about a quarter of the
base's completions earn, which every algorithm of the family must learn to earn more often. (The task's own
reward moves too little in 60 steps: its gain was below the spread between seeds, which is why the test
failed on another CPU.)

Another CPU rounds differently, so a run there is another draw: another warm-started base and other sampled
tokens. This script draws that spread here by varying both seeds, `model.warm_start.seed` and `seed`, and
prints, per algorithm, what the test asserts on: the batch-reward gain, the mean of the last 20 steps minus
the mean of the first 10. The test's threshold is set from this table (written beside the test). The test imports
this module for its run (ALGOS, `overrides`, the `has_seven` reward, `reward_gain`): one description of the run for
the test and for the measurement.

    python tests/train/loop/learning_spread.py        # every algorithm the test covers, 3 seeds, 2 jobs
    python tests/train/loop/learning_spread.py gpg topr --seeds 5 --jobs 1 --override reward=tinyzero
                                                      # two of them, 5 seeds, 1 job, the task's reward

Runs go to --out (default outputs/learning_spread/<algo>_s<seed>); a finished run is not run again, one cut short
is resumed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gspo.config.loading import compose
from gspo.tasks import build_task
from gspo.train.start.warm_start import base_model

ALGOS = ["dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "gpg", "topr", "reinforce_plus_plus",
         "reinforce_plus_plus_baseline", "passk", "grpo_passk", "ppo", "rloo"]
OVERRIDES = {"train.steps": 60, "rollout.prompts_per_step": 16, "eval.every": 0, "hardware.threads": 1,
             "logger.progress": False, "reward": "python", "reward.fn": f"{Path(__file__).resolve()}:has_seven"}


def has_seven(completions: list[str], **kwargs) -> list[float]:
    """1 for a completion with the digit 7 in it, else 0 (a TRL-style reward function)."""
    return [1.0 if "7" in c else 0.0 for c in completions]


def overrides(algo: str, seed: int, cache: str, extra: list[str] = ()) -> list[str]:
    """The test's overrides for ALGO, drawn at SEED (the warm start's seed too: another base, as on another CPU)."""
    keys = {**OVERRIDES, "algo": algo, "seed": seed, "model.warm_start.seed": seed, "cache_dir": cache}
    return [f"{k}={v}" for k, v in keys.items()] + list(extra)


def reward_gain(run_dir: Path) -> float:
    """The mean batch reward of a run's last 20 steps minus that of its first 10."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    return statistics.mean(rewards[-20:]) - statistics.mean(rewards[:10])


def run(algo: str, seed: int, cache: str, out: Path, extra: list[str]) -> float:
    run_dir = out / f"{algo}_s{seed}"
    summary = run_dir / "summary.json"
    if not (summary.is_file() and json.loads(summary.read_text()).get("status") == "finished"):
        cmd = [sys.executable, "-m", "cli.main", "train"]
        if (run_dir / "config.yaml").is_file():  # a run cut short: continue it
            cmd += [f"resume={run_dir}"]
        else:
            cmd += [*overrides(algo, seed, cache, extra), f"hydra.run.dir={run_dir}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return reward_gain(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("algos", nargs="*", default=ALGOS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="single-thread runs at a time")
    parser.add_argument("--out", type=Path, default=Path("outputs/learning_spread"))
    parser.add_argument("--cache", default="outputs/.cache")
    parser.add_argument("--override", action="append", default=[], help="an extra KEY=VALUE for every run")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the runs: the thread count changes float rounding, hence the base
    for seed in range(args.seeds):  # build each base once, before the runs that share it start
        cfg = compose(overrides(args.algos[0], seed, args.cache, args.override))
        base_model(cfg, build_task(cfg.task), log=lambda *a: None)
    jobs = [(a, s) for s in range(args.seeds) for a in args.algos]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(jobs, pool.map(lambda job: run(*job, args.cache, args.out, args.override), jobs)))
    print(f"{' '.join(sys.argv[1:])}\n{'algo':30s} reward gain over {args.seeds} seeds: min   mean    max")
    for algo in args.algos:
        gain = [results[algo, s] for s in range(args.seeds)]
        print(f"{algo:30s} {min(gain):+31.3f} {statistics.mean(gain):+.3f} {max(gain):+.3f}")


if __name__ == "__main__":
    main()

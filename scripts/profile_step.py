"""Where gspo's RL step spends its time: milliseconds per step of each part of the loop, one table.

Runs `gspo train` in this process, on the work of `--variant` (the benchmarks' variants and flags,
bench_vs_trl.py) or on any overrides (`--gspo "..."`), with a wall-clock timer around each part of
the loop, counted only inside the timed step (rollout + update; the held-out evaluations are not).
Each part's figure is its mean over the steps after the first (the warm-up); a part's children
are indented under it, and "(rest)" is the parent's time that no child accounts for. The step's
own mean is `time/step_s` from the run's metrics, which is rollout + update.

Usage (repository root, in the venv; nothing else running, as for every benchmark):
  python scripts/profile_step.py --variant long16
  python scripts/profile_step.py --steps 10 --gspo "+experiment=moe_long algo=grpo rollout.old_logprobs=recompute \\
      algo.beta=0 hardware.threads=1 eval.every=0"

The timers wrap functions of the loop by name (gspo/train/trainer.py, gspo/rollout/batch.py, the MoE component); a
renamed function fails this script at start, and its smoke test (tests/test_bench.py) with it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import bench_common

# (label, parent label or None, where the function lives, its attribute): the parts the table shows
PARTS = [
    ("rollout", None, "gspo.train.setup", "collect"),
    ("generate", "rollout", "gspo.rollout.batch", "generate"),
    ("decode steps (fast engine)", "generate", "gspo.rollout.fast_decode", "FastDecoder.step"),
    ("scoring (task verifier, reward)", "rollout", "gspo.rollout.batch", "timeouts.call"),
    ("update", None, "gspo.train.trainer", "_update"),
    ("forwards (token_logprobs: old policy, minibatches)", "update", "gspo.train.trainer", "token_logprobs"),
    ("backward", "update", "torch", "Tensor.backward"),
    ("optimizer step", "update", "torch.optim", "AdamW.step"),
    ("gradient clipping", "update", "torch.nn.utils", "clip_grad_norm_"),
    ("policy loss and its statistics", "update", "gspo.train.trainer", "policy_loss"),
    ("MoE: minibatch routing statistics", "update", "gspo.train.moe_step", "_Minibatch.stats"),
    ("MoE: load-balancing loss", "update", "gspo.train.moe_step", "_Minibatch.aux_loss"),
    ("MoE: routing statistics of the updated policy", "update", "gspo.train.moe_step", "_MoE.end_step"),
]
TOP = {"collect", "_update"}  # the two halves of the timed step: the other timers count only inside them


class Timers:
    """Wall-clock seconds per part and step, from wrappers installed on the loop's functions."""

    def __init__(self) -> None:
        self.step = 0  # the step being timed (0: outside the loop's steps)
        self.inside = 0  # depth of timed halves (rollout, update) currently running
        self.seconds: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))

    def wrap(self, label: str, fn: Callable, top: bool) -> Callable:
        def timed(*args, **kwargs):
            if top:
                self.step += label == "rollout"  # a step starts with its rollout
                self.inside += 1
            elif not self.inside:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label][self.step] += time.perf_counter() - t0
                if top:
                    self.inside -= 1
        return timed

    def install(self) -> None:
        import importlib

        for label, _, module, attr in PARTS:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for p in path:
                owner = getattr(owner, p)
            setattr(owner, name, self.wrap(label, getattr(owner, name), top=name in TOP))


def table(timers: Timers, step_s: list[float]) -> str:
    """The markdown table: each part's mean ms per step over steps 2.., children under their parent."""
    steps = range(2, len(step_s) + 1)

    def ms(label: str) -> float:
        return 1e3 * statistics.fmean(timers.seconds[label].get(s, 0.0) for s in steps)

    step_ms = 1e3 * statistics.fmean(step_s[1:])
    rows = [["**step** (`time/step_s`)", bench_common.fmt(step_ms, 1), "100%"]]

    def add(parent, depth: int) -> None:
        children = [label for label, p, _, _ in PARTS if p == parent]
        for label in children:
            rows.append(["&nbsp;" * 4 * depth + label, bench_common.fmt(ms(label), 1), f"{ms(label) / step_ms:.0%}"])
            add(label, depth + 1)
        if parent is not None and children:
            rest = ms(parent) - sum(ms(c) for c in children)
            rows.append(["&nbsp;" * 4 * depth + "(rest)", bench_common.fmt(rest, 1), f"{rest / step_ms:.0%}"])

    add(None, 0)
    return bench_common.markdown_table(["part", "ms / step", "of the step"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_common.add_work_args(p)
    p.add_argument("--gspo", metavar="OVERRIDES", help="profile `gspo train OVERRIDES` instead of a variant's work "
                   "(--steps still applies; the work flags do not)")
    a = p.parse_args(argv)
    bench_common.resolve_work(a)
    if a.gspo is not None:
        overrides = [*shlex.split(a.gspo), f"train.steps={a.steps}", "logger=jsonl", "logger.progress=false"]
        work = f"`gspo train {a.gspo}`, {a.steps} steps"
    else:
        overrides = bench_common.gspo_overrides(a, bench_common.prepare_model(a))
        work = (f"variant `{a.variant}`, {a.prompts} prompts x G={a.group}, max {a.max_new_tokens} new tokens, "
                f"{a.minibatches} minibatches, {a.steps} steps, {a.threads} torch threads")
    timers = Timers()
    timers.install()
    from cli.main import app

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        code = app(["train", *overrides, f"hydra.run.dir={run_dir}"], standalone_mode=False)
        if code:
            sys.exit(code)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
    if len(step_s) < 2:
        raise SystemExit("need at least 2 steps: the first is a warm-up")
    print(f"\nWhere the step goes: {work}; mean over steps 2-{len(step_s)}. {bench_common.versions()}\n")
    print(table(timers, step_s))


if __name__ == "__main__":
    main()

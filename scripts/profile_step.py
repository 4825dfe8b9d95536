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

The timers wrap functions of the loop by name (gspo/train/loop/trainer.py, gspo/rollout/batch.py, the MoE component); a
renamed function fails this script at start, and its smoke test (tests/scripts/test_bench.py) with it.
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
from typing import Callable, Optional

import bench_common
import torch

# (label, parent label or None, where the function lives, its attribute, grad): the parts the table shows. `grad`
# True / False counts a call only with autograd on / off (one function serves the old-policy pass and the update's
# forwards), None every call. A label with two parents is two rows.
PARTS = [
    ("rollout", None, "gspo.train.loop.setup", "collect", None),
    ("generate", "rollout", "gspo.rollout.decoding.decoder", "generate", None),
    ("prefill (one per prompt group)", "generate", "gspo.rollout.decoding.generate", "_prefill_once_per_group", None),
    ("decode steps (fast engine)", "generate", "gspo.rollout.decoding.fast_decode", "FastDecoder.step", None),
    ("LM head (decode)", "decode steps (fast engine)", "gspo.rollout.decoding.fast_decode", "FastDecoder.head", None),
    ("draws: softmax over V, inverse CDF", "generate", "gspo.rollout.decoding.generate", "_sample", None),
    ("scoring (task verifier, reward)", "rollout", "gspo.rollout.batch", "timeouts.call", None),
    ("update", None, "gspo.train.loop.trainer", "_update", None),
    ("no-grad passes (old policy, reference, mismatch check)", "update", "gspo.train.loop.trainer", "token_logprobs", False),
    ("LM head log-probs (no grad)", "no-grad passes (old policy, reference, mismatch check)", "gspo.models.logprobs",
     "selected_logprobs", False),
    ("minibatch forwards (with grad)", "update", "gspo.train.loop.trainer", "token_logprobs", True),
    ("LM head log-probs + entropy (forward)", "minibatch forwards (with grad)", "gspo.models.logprobs",
     "selected_logprobs", True),
    ("backward", "update", "torch", "Tensor.backward", None),
    ("LM head log-probs (backward)", "backward", "gspo.models.logprobs", "_LinearLogProbs.backward", None),
    ("optimizer step", "update", "torch.optim", "AdamW.step", None),
    ("gradient clipping", "update", "torch.nn.utils", "clip_grad_norm_", None),
    ("policy loss and its statistics", "update", "gspo.train.loop.trainer", "policy_loss", None),
    ("MoE: minibatch routing statistics", "update", "gspo.train.loop.moe_step", "_Minibatch.stats", None),
    ("MoE: load-balancing loss", "update", "gspo.train.loop.moe_step", "_Minibatch.aux_loss", None),
    ("MoE: routing statistics of the updated policy", "update", "gspo.train.loop.moe_step", "_MoE.end_step", None),
]
TOP = {"collect", "_update"}  # the two halves of the timed step: the other timers count only inside them


class Timers:
    """Wall-clock seconds per part and step, from wrappers installed on the loop's functions."""

    def __init__(self) -> None:
        self.step = 0  # the step being timed (0: outside the loop's steps)
        self.inside = 0  # depth of timed halves (rollout, update) currently running
        self.seconds: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))

    def wrap(self, label: str, fn: Callable, top: bool, grad: Optional[bool] = None) -> Callable:
        def timed(*args, **kwargs):
            if top:
                self.step += label == "rollout"  # a step starts with its rollout
                self.inside += 1
            elif not self.inside or (grad is not None and torch.is_grad_enabled() != grad):
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
        for label, _, module, attr, grad in PARTS:
            owner, name = _owner(module, attr)
            setattr(owner, name, self.wrap(label, getattr(owner, name), top=name in TOP, grad=grad))


def _owner(module: str, attr: str):
    """(the object holding `attr`, its last name): `attr` may be dotted (a class's method)."""
    import importlib

    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for p in path:
        owner = getattr(owner, p)
    return owner, name


# (label, where the function lives, its attribute): the phases whose peak RSS --memory reports, in run order
MEMORY_PARTS = [
    ("loading the model", "gspo.train.loop.setup", "load_pretrained"),
    ("held-out evaluation", "gspo.train.evaluation.evaluator", "Evaluator.run"),
    ("rollout", "gspo.train.loop.setup", "collect"),
    ("update", "gspo.train.loop.trainer", "_update"),
    ("update: backward", "torch", "Tensor.backward"),
    ("update: optimizer step", "torch.optim", "AdamW.step"),
    ("checkpoint save", "gspo.train.loop.checkpointer", "Checkpointer.save"),
]


class Memory:
    """The process's resident memory (RSS) while each phase runs: a thread reads /proc/self/statm every `every`
    seconds, and every phase running at that moment keeps the largest reading; also read at each phase's start
    and end. Memory is not a timing: other processes on the machine do not change it."""

    def __init__(self, every: float = 0.002) -> None:
        import os
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.active: dict[str, int] = defaultdict(int)
        self.peak: dict[str, float] = {}
        self.start: dict[str, float] = {}  # RSS when the phase first started
        self.setup = None  # gspo's Setup, for the inventory of what the trainer holds
        self.base = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def rss(self) -> float:
        """MiB resident now."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page / 2**20

    def sample(self) -> None:
        now = self.rss()
        for label, depth in list(self.active.items()):
            if depth:
                self.peak[label] = max(self.peak.get(label, 0.0), now)

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def wrap(self, label: str, fn: Callable) -> Callable:
        def tracked(*args, **kwargs):
            self.start.setdefault(label, self.rss())
            self.active[label] += 1
            self.sample()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sample()
                self.active[label] -= 1
        return tracked

    def install(self) -> None:
        for label, module, attr in MEMORY_PARTS:
            owner, name = _owner(module, attr)
            setattr(owner, name, self.wrap(label, getattr(owner, name)))
        import gspo.train.loop.setup as setup_module
        import gspo.train.loop.trainer as trainer_module

        build = setup_module.setup

        def keep(*args, **kwargs):  # the trainer's parts, for the inventory after the run
            self.setup = build(*args, **kwargs)
            return self.setup
        trainer_module.setup = keep

    def tables(self) -> str:
        """Peak RSS per phase, and what the trainer holds at the end of the run (weights, gradients, ...)."""
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        rows = [["before the run (imports)", bench_common.fmt(self.base, 0), ""]]
        rows += [[label, bench_common.fmt(self.peak[label], 0), bench_common.fmt(self.start[label], 0)]
                 for label, *_ in MEMORY_PARTS if label in self.peak]
        rows.append(["**the whole run** (`ru_maxrss`)", bench_common.fmt(peak, 0), ""])
        out = [bench_common.markdown_table(["phase", "peak RSS while it ran (MiB)", "RSS when it first started (MiB)"],
                                           rows), ""]
        if self.setup is not None:
            out.append(bench_common.markdown_table(["what the trainer holds after the run", "MiB"],
                                                   [[k, bench_common.fmt(v, 1)] for k, v in inventory(self.setup).items()]))
        return "\n".join(out)


def inventory(s) -> dict[str, float]:
    """MiB of the tensors the trainer keeps between steps: its weights (tied ones once), their gradients, the
    optimizer's state, and the other models it holds (a sampler copy in another precision, a reference, a critic)."""

    def mib(tensors) -> float:
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None and torch.is_tensor(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values()) / 2**20

    params = list(s.model.parameters())
    out = {"weights (all parameters)": mib(params),
           "trained weights": mib(p for p in params if p.requires_grad),
           "gradients (kept after the last step)": mib(p.grad for p in params),
           "optimizer state (AdamW: exp_avg, exp_avg_sq)": mib(v for st in s.opt.state.values() for v in st.values())}
    copy = getattr(s.sampler, "module", None)
    if copy is not None:
        out["sampler copy (rollout.dtype)"] = mib(copy.parameters())
    if s.ref is not None and hasattr(s.ref, "parameters"):
        out["reference model"] = mib(s.ref.parameters())
    return out


def table(timers: Timers, step_s: list[float]) -> str:
    """The markdown table: each part's mean ms per step over steps 2.., children under their parent."""
    steps = range(2, len(step_s) + 1)

    def ms(label: str) -> float:
        return 1e3 * statistics.fmean(timers.seconds[label].get(s, 0.0) for s in steps)

    step_ms = 1e3 * statistics.fmean(step_s[1:])
    rows = [["**step** (`time/step_s`)", bench_common.fmt(step_ms, 1), "100%"]]

    def add(parent, depth: int) -> None:
        children = [label for label, p, *_ in PARTS if p == parent]
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
    p.add_argument("--memory", action="store_true",
                   help="also the peak RSS of each phase (sampled every 2 ms) and what the trainer holds after the run")
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
    memory = Memory() if a.memory else None
    if memory is not None:
        memory.install()
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
    if memory is not None:
        memory.stop()
        print(f"\nMemory (RSS, MiB): {work}\n")
        print(memory.tables())


if __name__ == "__main__":
    main()

"""A resumed run is the run never interrupted (docs/contracts.md): stopped, then resumed, its metrics.jsonl (the clock's
and the machine's keys aside) and every weight file of its last checkpoint are the uninterrupted run's, bit for bit.
One case per part that carries state across steps and promises it: the loop itself, batches sampled ahead
(rollout.staleness; in a worker; with tools, their conversations), LoRA, the random numbers drawn beyond sampling
(Clip-Cov's pick, pass@k in evaluation, LoRA dropout), PPO's critic and TRL's reference resets.

How a case stops its first run:
- kill: `gspo train` in a process of its own, killed with -9 after a random step (2, 3 or 4) with a checkpoint every
  step; `gspo train resume=DIR` finishes it.
- stop: as SIGTERM stops it, at the boundary after step `at` (the request preemption.StopSignals sees); it is
  `preempted`, and the same config with resume=DIR finishes it.
- steps: a run of `at` steps (train.steps), resumed to the whole run's steps. The short run evaluated at its end,
  where the whole run evaluates only if due: that row's eval/ keys are compared where the whole run has them.

What a resume does besides (refusals, what it records, a stop's signals and exit codes, a sweep run again) is tested
where that part is: tests/train/run/ (test_resume, test_preemption, test_sweep), tests/rollout/test_async.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from gspo.config.loading import compose
from gspo.train.loop.critic import CRITIC_FILE
from gspo.train.loop.reference import REFERENCE_FILE
from gspo.train.loop.trainer import train
from gspo.train.run import checkpoint
from tests.conftest import child_env, tiny
from tests.contracts.test_seeds import opts as seeded
from tests.helpers.runs import assert_same_weights, metrics, steady, stop_after, weights
from tests.rollout.decoding.test_multiturn import opts as tool_opts
from tests.rollout.test_async import opts as async_opts
from tests.train.run.test_resume import opts as loop_opts


@dataclass(frozen=True)
class Part:
    """A part's case: `overrides(cache_dir)` are the whole run's; `cut` how its first run stops (kill, stop or steps)
    and `at` where (stop: the last step before it; steps: the first run's train.steps). Its checkpoint holds `files`
    (every weight file there is compared). `before_resume(run)` checks what the stopped run holds; `after(whole,
    resumed, overrides)` what else the part asserts of its runs."""

    overrides: Callable[[Path], list[str]]
    cut: str
    at: int = 0
    files: tuple[str, ...] = ("model.safetensors",)
    before_resume: Callable[[Path], None] | None = None
    after: Callable[[Path, Path, list[str]], None] | None = None


def _batches_sampled_ahead(part: Path) -> None:
    """Staleness 2, stopped after step 3: the checkpoint keeps the two batches the older weights sampled ahead (steps
    4 and 5; step 6's, sampled by the checkpoint's own weights, is sampled again)."""
    state = checkpoint.load_state(checkpoint.latest(part))
    assert state["step"] == 3 and sorted(state["pending"][0]) == [4, 5]


def _a_worker_samples_the_run_with_tools(whole: Path, resumed: Path, overrides: list[str]) -> None:
    """rollout.workers=1 samples (tools included, in the worker's own tool process) what the trainer's process
    samples."""
    w1 = whole.parent / "w1"
    train(compose([*overrides, "rollout.workers=1"]), w1)
    assert steady(w1) == steady(whole)


def _ppo_logs_the_critic_and_checkpoints_it(whole: Path, resumed: Path, overrides: list[str]) -> None:
    rows = metrics(whole)[1:]
    for key in ("critic/value_loss", "critic/explained_variance", "critic/value_mean", "critic/clip_frac",
                "critic/grad_norm", "critic/lr", "train/loss"):
        assert all(key in r for r in rows), key
    state = checkpoint.load_state(checkpoint.latest(whole))
    assert set(state["critic"]) == {"optimizer", "scheduler"}
    critic = weights(whole, CRITIC_FILE)
    assert {"score.weight", "score.bias"} <= critic.keys() and any(k.startswith("model.layers.") for k in critic)
    assert not any(k.startswith("lm_head") for k in critic)  # the backbone only: no LM head in the value model


def _the_reference_moved(whole: Path, resumed: Path, overrides: list[str]) -> None:
    """TRL's sync_ref_model every 3 optimizer updates (2 a step): the reference is mixed at updates 3 and 6 and
    checkpointed (the resume from step 2 continues with the mixed reference)."""
    from gspo.models.build import load_pretrained
    from gspo.tasks import build_task
    from gspo.train.start.warm_start import base_model

    cfg = compose(overrides)
    base = load_pretrained(base_model(cfg, build_task(cfg.task)))[0].state_dict()
    ref = weights(whole, REFERENCE_FILE)
    assert max(float((ref[k] - base[k]).abs().max()) for k in ref) > 1e-4


BASELINES = {"train.checkpoint_every": 1, "hardware.threads": 1, "train.steps": 4}
PARTS = {
    "loop": Part(loop_opts, "kill"),
    "staleness": Part(lambda cache: async_opts(cache, **{"rollout.staleness": 2, "train.steps": 6}), "stop", at=3,
                      before_resume=_batches_sampled_ahead),
    # the same with the sampling in a worker: its batches in flight at the checkpoint are waited for and kept
    "workers": Part(lambda cache: async_opts(cache, **{"rollout.staleness": 2, "rollout.workers": 1,
                                                      "train.steps": 6}), "stop", at=3),
    # a batch sampled ahead, its conversations in the checkpoint
    "tools": Part(lambda cache: [*tool_opts(cache, model="qwen3-tiny", **{
        "train.steps": 3, "rollout.staleness": 1, "rollout.worker_threads": 1, "train.checkpoint_every": 1}),
        "rollout.workers=0"], "stop", at=2, after=_a_worker_samples_the_run_with_tools),
    "lora": Part(lambda cache: tiny(cache, **{"model.lora.r": 4, "model": "qwen3-tiny", "train.lr": 0.05,
                                              "train.steps": 3}), "steps", at=2, files=("adapter_model.safetensors",)),
    # a resume starts in a fresh process, its global generator anywhere: each step reseeds from (seed, step)
    "clip_cov": Part(lambda cache: seeded(cache, **{"algo": "clip_cov", "train.steps": 3}), "steps", at=1),
    "lora_dropout": Part(lambda cache: seeded(cache, **{"model": "qwen3-tiny", "model.lora.r": 4,
                                                        "model.lora.dropout": 0.2, "train.steps": 3}), "steps", at=1,
                         files=("adapter_model.safetensors",)),
    "ppo_critic": Part(lambda cache: tiny(cache, algo="ppo", **BASELINES), "steps", at=2, files=(CRITIC_FILE,),
                       after=_ppo_logs_the_critic_and_checkpoints_it),
    "reference_resets": Part(lambda cache: tiny(cache, algo="grpo", **{
        "algo.sync_ref_model": True, "algo.ref_model_sync_steps": 3, "algo.ref_model_mixup_alpha": 0.5,
        "train.lr": 1e-2, **BASELINES}), "steps", at=2, files=(REFERENCE_FILE,), after=_the_reference_moved),
}
SLOW = {"workers"}


def kill_after_a_step(overrides: list[str], run: Path, cwd: Path) -> dict:
    """`gspo train` into `run` in a process of its own, killed with -9 once it has logged step 2, 3 or 4 (at random);
    the summary.json it leaves (`running`, with the base accuracy)."""
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "train", *overrides, f"hydra.run.dir={run}"], cwd=cwd,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_at = 2 + int.from_bytes(os.urandom(1), "little") % 3  # after step 2, 3 or 4
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        done = [r["step"] for r in metrics(run)] if (run / "metrics.jsonl").is_file() else []
        if done and done[-1] >= kill_at:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "running" and "base_accuracy" in summary and summary["steps"] >= 1
    return summary


@pytest.mark.usefixtures("tag")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PARTS])
def test_a_resumed_run_is_the_run_never_interrupted(name, tmp_path, cache_dir, monkeypatch):
    part = PARTS[name]
    overrides = part.overrides(cache_dir)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(compose(overrides), whole)

    if part.cut == "kill":
        left = kill_after_a_step(overrides, resumed, tmp_path)
        res = CliRunner().invoke(app, ["train", f"resume={resumed}"])  # (in this process: the killed one is gone)
        assert res.exit_code == 0, res.output[-3000:]
        assert "held-out accuracy: base" in res.output  # the resumed run reports the whole run's base -> trained
        final = json.loads((resumed / "summary.json").read_text())
        assert final["status"] == "finished" and final["base_accuracy"] == left["base_accuracy"]
        assert final["wall_s"] > left["wall_s"]  # both sessions counted
    else:
        if part.cut == "stop":
            with monkeypatch.context() as m:
                stop_after(m, part.at)
                assert train(compose(overrides), resumed)["status"] == "preempted"
        else:
            train(compose([*overrides, f"train.steps={part.at}"]), resumed)
        if part.before_resume:
            part.before_resume(resumed)
        torch.rand(5)  # a resume starts in a fresh process: the global generator is anywhere
        train(compose([*overrides, f"resume={resumed}"]), resumed)

    got, want = steady(resumed), steady(whole)
    if part.cut == "steps":  # the first run evaluated at its end; the whole run there only if due
        i, due = next((i, row) for i, row in enumerate(want) if row["step"] == part.at)
        got[i] = {k: v for k, v in got[i].items() if not k.startswith("eval/") or k in due}
    assert got == want
    assert_same_weights(whole, resumed)
    assert set(part.files) <= {p.name for p in checkpoint.latest(resumed).glob("*.safetensors")}
    if part.after:
        part.after(whole, resumed, overrides)

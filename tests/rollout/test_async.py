"""Asynchronous rollouts (rollout.staleness, rollout.workers): the staleness is exact, where sampling runs
changes nothing, a SIGTERM stops the trainer and its workers (that a resume computes what the uninterrupted run does:
tests/contracts/test_resume_equals_uninterrupted.py), and a worker's failure ends the run in one line with no process
left behind.

What "the same run" holds to: every sampled token, reward and metric and the final weights bitwise, with
the sampling done at the same thread count in the trainer's process and in the worker
(`hardware.threads=1 rollout.worker_threads=1`): a different thread count changes float reductions, and so
the last bits of a log-prob."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.train.loop.trainer import train
from gspo.train.preflight import check
from gspo.train.run import checkpoint
from tests.conftest import alive_of_this_test, child_env, tiny
from tests.helpers.runs import assert_same_run, steady

pytestmark = pytest.mark.usefixtures("tag")


def opts(cache_dir, **extra) -> list[str]:
    return tiny(cache_dir, **{"model": "qwen3-tiny", "train.steps": 5, "hardware.threads": 1,
                              "rollout.worker_threads": 1, "train.checkpoint_every": 1, **extra})


def gspo(*args, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def sigterm_after_steps(overrides: list[str], run: Path, cwd: Path, steps: int = 4,
                        timeout: int = 120) -> tuple[int, str]:
    """`gspo train` in a subprocess into `run`, sent SIGTERM once it has logged more than `steps` steps: its exit
    code and output."""
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "train", *overrides, f"hydra.run.dir={run}"], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not ((run / "metrics.jsonl").is_file() and len(steady(run)) > steps):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def no_worker_left() -> bool:
    """No rollout worker the running test started is alive."""
    return not alive_of_this_test("gspo.rollout.worker")


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("staleness", [0, 2])
def test_a_worker_samples_what_the_trainers_process_samples(staleness, tmp_path, cache_dir):
    """rollout.workers=1 and rollout.workers=0 give the same run at the same staleness: the same completions,
    rewards, losses at every step and the same weights, bitwise. At staleness 0 that is the synchronous loop."""
    for workers in (0, 1):
        train(compose(opts(cache_dir, **{"rollout.staleness": staleness, "rollout.workers": workers})),
              tmp_path / f"w{workers}")
    assert_same_run(tmp_path / "w0", tmp_path / "w1")
    assert no_worker_left()


def test_the_staleness_is_exact(tmp_path, cache_dir):
    """rollout.staleness=2: step t's batch is the one the policy after step t-3 samples (the initial policy
    while t-3 <= 0), whatever the timing: recomputing it from the checkpoint of that step gives the logged
    rewards and lengths exactly."""
    from gspo.models.build import load_pretrained
    from gspo.rollout.batch import Share, collect
    from gspo.rollout.decoding.params import SamplingParams
    from gspo.rollout.source import version_of
    from gspo.tasks import build_task

    cfg = compose(opts(cache_dir, **{"rollout.staleness": 2, "train.keep_checkpoints": 10, "train.steps": 6}))
    train(cfg, tmp_path)
    logged = {m["step"]: m for m in steady(tmp_path)}
    assert [logged[t]["rollout/staleness"] for t in range(1, 7)] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    task = build_task(cfg.task)
    for step in (5, 6):  # sampled by the weights after steps 2 and 3
        ckpt = tmp_path / "checkpoints" / f"step_{version_of(step, 2):06d}"
        model, tok = load_pretrained(ckpt)
        model.eval()
        with torch.no_grad():
            _, metrics = collect(cfg, step, lambda: __import__("contextlib").nullcontext(model), tok, task,
                                 Share(0, cfg.rollout.prompts_per_step), SamplingParams.of(cfg))
        for key in ("reward/mean", "reward/std", "response/len_mean"):
            assert metrics[key] == logged[step][key], (step, key)


def test_staleness_and_workers_are_checked_up_front(cache_dir):
    for bad, message in [("rollout.staleness=-1", "rollout.staleness=-1: must be >= 0"),
                         ("rollout.workers=-2", "rollout.workers=-2: must be >= 0"),
                         ("rollout.staleness=9", "rollout.staleness=9: must be at most train.steps=5"),
                         ("rollout.staleness=1.5", "rollout.staleness")]:
        with pytest.raises(ConfigError, match=message):
            check(compose(opts(cache_dir) + [bad]))
    with pytest.raises(ConfigError, match="rollout.workers needs the full weights"):
        check(compose(["hardware=gpu-fsdp", "hardware.device=cpu", "hardware.backend=gloo", "rollout.workers=1"]))
    cfg = compose(["rollout.staleness=1"])
    from gspo.rollout.decoding.sampler import old_logprobs_mode

    assert old_logprobs_mode(cfg) == "recompute"  # a stale batch: the ratio against the current weights


# --------------------------------------------------------------------------- faults

KILLER = """
import os, time
from pathlib import Path
def reward(completions, **kw):  # the trainer's start-up probe is call 0; the worker scores every batch after
    p = Path({counter!r})
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n >= 3 and MODE == "kill":
        os.kill(os.getpid(), 9)
    if n >= 3 and MODE == "hang":
        time.sleep(1000)
    if n >= 3 and MODE == "raise":
        raise ValueError("boom in the worker")
    return [float(len(c)) for c in completions]
"""


@pytest.mark.parametrize("mode, line", [
    ("kill", r"rollout worker 0 \(pid \d+\) died while sampling step 3 \(killed by SIGKILL\); every worker was stopped"),
    pytest.param("raise", r"rollout worker 0 while sampling step 3: RewardError: reward function .*reward raised "
                          r"ValueError: boom in the worker", marks=pytest.mark.slow),
    pytest.param("hang", r"rollout worker 0: step 3's batch did not come within rollout.timeout_s=5 s \(hung\?\)",
                 marks=pytest.mark.slow),
])
def test_a_worker_that_fails_ends_the_run_in_one_line(mode, line, tmp_path, cache_dir):
    """A worker killed with -9, one whose reward function raises, one that hangs: one line naming the worker and
    the step, non-zero exit within seconds, the last checkpoint intact, no worker left."""
    import re

    (tmp_path / "fns.py").write_text(KILLER.format(counter=str(tmp_path / "calls")).replace("MODE", repr(mode)))
    t0 = time.time()
    res = gspo("train", *opts(cache_dir, **{"rollout.workers": 1, "rollout.staleness": 1, "reward": "python",
                                            "reward.fn": f"{tmp_path}/fns.py:reward", "rollout.timeout_s": 5,
                                            "reward.timeout_s": 0}),
               f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode != 0 and time.time() - t0 < 120
    errors = [x for x in res.stderr.splitlines() if x.startswith("gspo: error:")]
    assert len(errors) == 1 and re.search(line, errors[0]), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert checkpoint.load_state(checkpoint.latest(tmp_path / "run"))["step"] >= 1
    assert no_worker_left()


@pytest.mark.slow
def test_sigterm_stops_trainer_and_workers_and_the_run_resumes_exactly(tmp_path, cache_dir):
    """SIGTERM mid-run (workers=1, staleness 2): exit 75, no worker left; the resumed run equals the run that
    never stopped."""
    extra = {"rollout.staleness": 2, "rollout.workers": 1, "train.steps": 40}
    train(compose(opts(cache_dir, **extra)), tmp_path / "whole")
    run = tmp_path / "run"
    code, out = sigterm_after_steps(opts(cache_dir, **extra), run, tmp_path)
    assert code == 75, out
    assert no_worker_left()
    res = gspo("train", f"resume={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert_same_run(tmp_path / "whole", run)


@pytest.mark.slow
def test_two_ranks_each_drive_their_own_worker(tmp_path, cache_dir):
    """Under torchrun (2 gloo ranks) each rank samples its share of the prompts in its own worker: the run equals
    the 2-rank run that samples in the trainers' processes."""
    extra = {"rollout.staleness": 1, "train.steps": 3}
    for workers in (0, 1):
        res = gspo("train", "hardware=cpu-ddp", *opts(cache_dir, **extra, **{"rollout.workers": workers}),
                   f"hydra.run.dir={tmp_path / f'w{workers}'}", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / "w0", tmp_path / "w1")
    assert no_worker_left()

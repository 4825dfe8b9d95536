"""Preemption: SIGTERM / SIGINT finish the step in progress, checkpoint it, say how to resume and exit
with their own code; a second signal exits at once; the resume equals a run never interrupted, in one
process and under cpu-ddp; in a submitit job, submitit's own handler (its requeue) runs after the
checkpoint, and the requeued job resumes its run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gspo.rollout.batch as trainer  # where the loop scores its rollouts
from cli.main import app
from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.train.loop.trainer import train
from gspo.train.run import checkpoint, preemption
from tests.conftest import child_env, tiny
from tests.helpers.runs import assert_same_run


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def opts(cache_dir, **extra) -> list[str]:
    # no checkpoint before the end: the one a signal leaves is the signal's own
    return tiny(cache_dir, **{"train.steps": 8, "train.checkpoint_every": 100, "hardware.threads": 1, **extra})


def start(*args, cwd: Path) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "cli.main", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def after_first_step(proc: subprocess.Popen, run_dir: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and any(m["step"] >= 1 for m in metrics(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended before its first step was logged: {proc.communicate()[0][-3000:]}")


def signal_on_step(monkeypatch, step: int, sig: int) -> None:
    """Send `sig` to this process while step `step` scores its rollouts."""
    real = trainer.score
    calls = []

    def score(*a, **k):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), sig)
        return real(*a, **k)

    monkeypatch.setattr(trainer, "score", score)


def test_sigterm_checkpoints_the_last_step_and_the_resume_is_exact(tmp_path, cache_dir):
    whole = tmp_path / "whole"
    train(compose(opts(cache_dir)), whole)

    run = tmp_path / "run"
    proc = start(*opts(cache_dir), f"hydra.run.dir={run}", cwd=tmp_path)
    after_first_step(proc, run)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == preemption.PREEMPTED_EXIT, out[-3000:]
    assert "Traceback" not in out
    done = metrics(run)[-1]["step"]
    assert 1 <= done < 8
    lines = [line for line in out.splitlines() if line.startswith("gspo: preempted")]
    assert lines == [f"gspo: preempted after step {done} of 8 (checkpoint saved); resume with: gspo train resume={run}"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps"] == done
    assert checkpoint.load_state(checkpoint.latest(run))["step"] == done  # no finished step lost

    res = CliRunner().invoke(app, ["train", f"resume={run}"])  # (in this process: the stopped one is gone)
    assert res.exit_code == 0, res.output[-3000:]
    assert_same_run(run, whole)
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_ctrl_c_stops_after_the_step_with_exit_130_and_the_resume_line(tmp_path, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    signal_on_step(monkeypatch, 2, signal.SIGINT)
    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when pytest runs in the background
    res = CliRunner().invoke(app, ["train", *opts(cache_dir), f"hydra.run.dir={run}"])
    assert res.exit_code == preemption.STOPPED_EXIT, res.output
    assert f"gspo: stopped after step 2 of 8 (checkpoint saved); resume with: gspo train resume={run}" in res.output
    assert json.loads((run / "summary.json").read_text())["status"] == "stopped"
    assert [m["step"] for m in metrics(run)] == [0, 1, 2]  # the step in progress was finished, not dropped
    assert checkpoint.load_state(checkpoint.latest(run))["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back


def test_a_second_signal_exits_at_once(tmp_path, cache_dir):
    """Once the test arms it, the reward function blocks for a minute: the first SIGTERM, sent while a step is in
    it, waits for the step; the second (2 s later) does not, and no further step is logged."""
    armed, blocked = tmp_path / "armed", tmp_path / "blocked"
    (tmp_path / "slow.py").write_text(f"""
import time
from pathlib import Path
def slow_once_armed(prompts, completions, **kw):
    if Path({str(armed)!r}).exists():
        Path({str(blocked)!r}).touch()
        time.sleep(60)
    return [0.0] * len(completions)
""")
    run = tmp_path / "run"
    proc = start(*opts(cache_dir, reward="python", **{"reward.fn": f"{tmp_path}/slow.py:slow_once_armed"}),
                 f"hydra.run.dir={run}", cwd=tmp_path)
    after_first_step(proc, run)
    armed.touch()
    while not blocked.exists() and proc.poll() is None:  # a step's scoring is in the reward function now
        time.sleep(0.05)
    logged = [m["step"] for m in metrics(run)]  # (the blocked step cannot finish before the signals)
    proc.send_signal(signal.SIGTERM)
    for line in proc.stdout:  # the first is seen; a repeat within a second would count as the same one
        if line.startswith("gspo: SIGTERM: finishing the step"):
            break
    time.sleep(2 * preemption.SAME_SIGNAL_S)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGTERM, out[-3000:]
    assert [m["step"] for m in metrics(run)] == logged and len(logged) >= 2  # the blocked step never finished
    assert json.loads((run / "summary.json").read_text())["status"] == "running"  # as after kill -9


def test_the_same_signal_twice_at_once_is_one_signal(monkeypatch):
    """Ctrl-C reaches every process and torchrun passes it on too: a worker gets it twice within a moment."""
    killed = []
    monkeypatch.setattr(preemption.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(preemption.signal, "signal", lambda sig, handler: None)
    stop = preemption.StopSignals()
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)
    assert stop.requested() == "stopped" and killed == []
    stop._at -= 2 * preemption.SAME_SIGNAL_S
    stop._handle(signal.SIGINT, None)
    assert killed == [signal.SIGINT]


def test_submitit_handler_runs_after_the_checkpoint(tmp_path, cache_dir, monkeypatch):
    """In a submitit job SIGUSR2 carries its checkpoint-and-requeue handler: gspo checkpoints first, then calls it."""
    seen = []

    def submitit_requeue(signum, frame):
        seen.append((signum, checkpoint.load_state(checkpoint.latest(tmp_path))["step"],
                     json.loads((tmp_path / "summary.json").read_text())["status"]))

    previous = signal.signal(signal.SIGUSR2, submitit_requeue)
    try:
        signal_on_step(monkeypatch, 3, signal.SIGUSR2)
        summary = train(compose(opts(cache_dir)), tmp_path)
        assert signal.getsignal(signal.SIGUSR2) is submitit_requeue
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert summary["status"] == "preempted"
    assert seen == [(signal.SIGUSR2, 3, "preempted")]


def test_a_refused_setup_puts_the_callers_signal_handlers_back(tmp_path, cache_dir, monkeypatch):
    """train() called in-process (a notebook, a test) and refused before its first step leaves SIGINT / SIGTERM
    as it found them: a stale handler would take the caller's next Ctrl-C for a training run's."""
    import gspo.train.loop.trainer as loop

    def refused(*a, **k):
        raise ConfigError("refused")

    monkeypatch.setattr(loop, "setup", refused)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError):
        train(compose(opts(cache_dir)), tmp_path / "run")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_requeued_slurm_job_resumes_its_run(tmp_path, cache_dir, monkeypatch):
    """The same job started again in its own directory with SLURM_RESTART_COUNT > 0 continues the run."""
    monkeypatch.chdir(tmp_path)
    real = trainer.score
    signal_on_step(monkeypatch, 1, signal.SIGTERM)
    run = tmp_path / "run"
    args = ["train", *opts(cache_dir, **{"train.steps": 3}), f"hydra.run.dir={run}"]
    assert CliRunner().invoke(app, args).exit_code == preemption.PREEMPTED_EXIT
    monkeypatch.setattr(trainer, "score", real)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert f"resuming {run}" in res.output
    assert [m["step"] for m in metrics(run)] == [0, 1, 2, 3]
    assert not (run / "resumes.jsonl").exists()  # the same command: nothing changed, nothing recorded


@pytest.mark.slow
def test_sigterm_under_cpu_ddp_stops_every_rank_after_the_same_step(tmp_path, cache_dir):
    """SIGTERM to `gspo train hardware=cpu-ddp` (the process waiting on torchrun): both ranks stop after the
    same step, rank 0 checkpoints it, and the resumed run equals a cpu-ddp run never interrupted."""
    ddp = opts(cache_dir, model="qwen3-tiny", hardware="cpu-ddp")
    whole, run = tmp_path / "whole", tmp_path / "run"
    res = start(*ddp, f"hydra.run.dir={whole}", cwd=tmp_path)
    assert res.wait(timeout=600) == 0, res.communicate()[0][-3000:]
    proc = start(*ddp, f"hydra.run.dir={run}", cwd=tmp_path)
    after_first_step(proc, run)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == preemption.PREEMPTED_EXIT, out[-3000:]
    assert "Traceback" not in out and out.count("gspo: preempted after step") == 1, out[-3000:]
    done = metrics(run)[-1]["step"]
    assert done < 8 and checkpoint.load_state(checkpoint.latest(run))["step"] == done
    res = start(f"resume={run}", cwd=tmp_path)
    out, _ = res.communicate(timeout=600)
    assert res.returncode == 0, out[-3000:]
    assert_same_run(run, whole)


def descendants(pid: int) -> list[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


@pytest.mark.slow
def test_submitit_requeues_a_preempted_job_and_the_requeued_job_resumes(tmp_path, cache_dir):
    """hydra/launcher=local-submitit (the SLURM launcher's code path): SIGUSR2, submitit's preemption signal,
    to the job; gspo checkpoints, submitit requeues, the requeued job resumes; the run equals one never stopped."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    whole = tmp_path / "whole"
    train(compose(opts(cache_dir)), whole)
    sweep = tmp_path / "sweep"
    proc = start("-m", "hydra/launcher=local-submitit", *opts(cache_dir), f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    run = sweep / "0"
    after_first_step(proc, run)
    tasks = [p for p in descendants(proc.pid) if "submitit.core._submit" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(tasks) == 1, tasks
    os.kill(tasks[0], signal.SIGUSR2)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    log = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.out"))
    assert "gspo: preempted after step" in log and f"gspo: continuing the run in {run}" in log, log[-3000:]
    assert_same_run(run, whole)
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"

"""A sweep that survives: the same `gspo train -m ... hydra.sweep.dir=DIR` run again skips the jobs that finished,
resumes the stopped ones exactly and starts the rest; its jobs are named by the overrides it varies; a different
sweep in the same directory is refused before any job runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

import gspo.rollout.batch as trainer  # where the loop scores its rollouts
from cli.main import app
from gspo.config.loading import compose, job_name, sweep_combinations
from gspo.core.errors import ConfigError
from gspo.results.runs import load_runs
from gspo.train.run import preemption, sweep
from tests.cli.test_cli import one_line_exit_2
from tests.conftest import child_env, tiny

runner = CliRunner()
NOISY = ("time/", "throughput/", "memory/")  # the clock's and the machine's, not the run's


def steady(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in rows]


def status(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["status"]


# --------------------------------------------------------------------------- names


def test_a_job_is_named_by_the_keys_its_sweep_varies_in_key_order():
    job = ["+experiment=moe_long", "+cell=grpo_R2", "seed=3", "train.lr=3e-4"]
    assert job_name(job, ["experiment", "train.lr"], 7) == "cell-grpo_R2+seed-3"
    assert job_name(job, [], 7) == "cell-grpo_R2+experiment-moe_long+seed-3+train.lr-3e-4"
    assert job_name(job, ["experiment", "cell", "seed", "train.lr"], 7) == "7"  # nothing varies: its number


def test_a_job_name_is_a_path_hydra_a_shell_and_any_filesystem_take_as_it_is():
    assert job_name(["task.path=data/a b.jsonl", "rollout.tools=[f.py:x,g]"], [], 0) == \
        "rollout.tools-_f.py_x_g_+task.path-data_a_b.jsonl"
    long = job_name([f"k{i}=value{i}" for i in range(30)], [], 0)
    assert len(long) == 120 and long.startswith("k0-value0+k1-value1") and long != job_name(
        [f"k{i}=value{i}" for i in range(31)], [], 0)
    # the name survives Hydra's override grammar as a resume=DIR value
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (parsed,) = OverridesParser.create().parse_overrides([f"resume=sweep/{job_name(['+cell=grpo', 'seed=0'], [], 0)}"])
    assert parsed.value() == "sweep/cell-grpo+seed-0"


def test_a_sweep_names_its_jobs_by_what_its_directory_named_them_by(tmp_path):
    assert sweep.name_keys(None, ["algo=grpo,gspo", "seed=0,1", "train.steps=3"]) == ["algo", "seed"]
    (tmp_path / "algo-grpo+seed-0").mkdir()
    (tmp_path / "algo-grpo+seed-0" / "config.yaml").write_text("seed: 0\n")
    sweep.record(tmp_path, ["algo", "seed"])
    # one value of a key the directory's jobs are named by still names the new jobs
    assert sweep.name_keys(tmp_path, ["algo=grpo", "seed=0,1,2"]) == ["algo", "seed"]
    with pytest.raises(ConfigError, match="named by algo, seed; give algo too"):
        sweep.name_keys(tmp_path, ["seed=0,1,2"])
    with pytest.raises(ConfigError, match="also varies train.lr"):
        sweep.name_keys(tmp_path, ["algo=grpo", "seed=0", "train.lr=1e-4,3e-4"])


def test_a_sweep_dry_run_prints_every_job_by_its_directory_name(tmp_path, cache_dir):
    res = runner.invoke(app, ["train", "-m", "--cfg", "job", "+cell=grpo,gspo_sampler", *tiny(cache_dir),
                              f"hydra.sweep.dir={tmp_path / 's'}"])
    assert res.exit_code == 0, res.output
    assert "# job cell-grpo: +cell=grpo" in res.output and "# job cell-gspo_sampler: +cell=gspo_sampler" in res.output
    assert "old_logprobs: sampler" in res.output and not (tmp_path / "s").exists()  # nothing written
    one_line_exit_2(runner.invoke(app, ["train", "-m", "--cfg", "hydra", "seed=0,1"]), "--cfg hydra with -m")


def _hold(run_dir: Path, cfg) -> None:
    """A run directory as a finished run leaves it, as far as the checks read it."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def test_a_different_sweep_in_the_same_directory_is_refused_before_any_job(tmp_path, cache_dir):
    first = ["seed=0,1", *tiny(cache_dir)]
    for combo, name in zip(sweep_combinations(first), ("seed-0", "seed-1")):
        _hold(tmp_path / name, compose(combo))
    sweep.record(tmp_path, ["seed"])

    def check(overrides):
        combos = sweep_combinations(overrides)
        keys = sweep.name_keys(tmp_path, overrides)
        sweep.check(tmp_path, overrides, combos, [compose(c) for c in combos], keys)

    check([*first, "train.steps=5", "eval.every=2"])  # the same sweep, trained longer: continued
    check(["seed=1,2", *tiny(cache_dir)])  # more seeds: seed-2 starts
    with pytest.raises(ConfigError, match=r"the job seed-0 is not the experiment .* train.lr=0.0003 \(it ran with 0.0001\)"):
        check([*first, "train.lr=3e-4"])
    with pytest.raises(ConfigError, match="would share the directory seed-0"):
        sweep.check(None, ["seed=0,0"], [["seed=0"], ["seed=0"]], [None, None], ["seed"])
    # a run of the same config under another name (a sweep of another gspo, named by job number) is not repeated
    numbered = tmp_path / "old"
    _hold(numbered / "0", compose(["seed=4", *tiny(cache_dir)]))
    with pytest.raises(ConfigError, match=f"the job seed-4 would repeat the run in {numbered / '0'}"):
        sweep.check(numbered, ["seed=4,5"], [["seed=4"], ["seed=5"]],
                    [compose(["seed=4", *tiny(cache_dir)]), compose(["seed=5", *tiny(cache_dir)])], ["seed"])


def test_the_cli_refuses_another_experiment_in_a_sweep_directory_in_one_line(tmp_path, cache_dir):
    for combo, name in zip(sweep_combinations(["seed=0,1", *tiny(cache_dir)]), ("seed-0", "seed-1")):
        _hold(tmp_path / name, compose(combo))
    sweep.record(tmp_path, ["seed"])
    res = runner.invoke(app, ["train", "-m", "seed=0,1", *tiny(cache_dir), "algo=grpo", f"hydra.sweep.dir={tmp_path}"])
    one_line_exit_2(res, "seed-0 is not the experiment", "algo.name=grpo (it ran with gspo)", "another directory")
    assert not (tmp_path / "seed-0" / "metrics.jsonl").exists()


def test_a_cell_is_a_treatment_applied_on_top_of_the_experiment():
    cfg = compose(["+experiment=moe_mismatch", "+cell=grpo_fp32"])  # the preset samples in bf16; the cell in float32
    assert (cfg.algo.name, cfg.rollout.dtype, cfg.name, cfg.model.name) == ("grpo", "float32", "grpo_fp32", "qwen3-moe-wide")
    assert compose(["+experiment=moe_long", "+cell=gspo_sampler"]).rollout.old_logprobs == "sampler"
    with pytest.raises(ConfigError, match=r"write \+experiment=NAME first"):
        compose(["+cell=grpo_fp32", "+experiment=moe_mismatch"])
    with pytest.raises(ConfigError, match="no such cell. Valid options: dapo, dapo_high40, grpo, grpo_R2, grpo_R3"):
        compose(["+cell=grpoo"])


# --------------------------------------------------------------------------- a sweep stopped and run again


def sigterm_on_scoring(monkeypatch, calls: int) -> None:
    """SIGTERM to this process while the `calls`-th step of the sweep (over its jobs) scores its rollouts."""
    real, seen = trainer.score, []

    def score(*a, **k):
        seen.append(1)
        if len(seen) == calls:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(trainer, "score", score)


def test_a_sweep_stopped_in_a_job_and_run_again_equals_the_sweep_never_stopped(tmp_path, cache_dir, monkeypatch):
    """Three jobs of 3 steps, SIGTERM in the second job's step 2 (the first finished, the third not started); the
    same command again, N at a time under the joblib launcher, skips the first, resumes the second from its step 2
    and starts the third: every job's metrics equal the uninterrupted sweep's, and `gspo compare` reads both alike."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "-m", "seed=0,1,2", *tiny(cache_dir, **{"train.steps": 3, "hardware.threads": 1})]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    res = runner.invoke(app, [*args, f"hydra.sweep.dir={whole}"])
    assert res.exit_code == 0, res.output
    jobs = ["seed-0", "seed-1", "seed-2"]
    assert sorted(p.name for p in whole.iterdir() if (p / "config.yaml").is_file()) == jobs

    real = trainer.score
    sigterm_on_scoring(monkeypatch, 3 + 2)  # the first job's 3 steps, then the second's step 2
    res = runner.invoke(app, [*args, f"hydra.sweep.dir={stopped}"])
    assert res.exit_code == preemption.PREEMPTED_EXIT, res.output
    assert [status(stopped / j) for j in jobs[:2]] == ["finished", "preempted"] and not (stopped / jobs[2]).exists()
    monkeypatch.setattr(trainer, "score", real)

    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    res = runner.invoke(app, [*args, f"hydra.sweep.dir={stopped}", "hydra/launcher=parallel"])
    assert res.exit_code == 0, res.output
    for job in jobs:
        assert status(stopped / job) == "finished"
        assert steady(stopped / job) == steady(whole / job), job
    assert json.loads((stopped / "seed-1" / "summary.json").read_text())["steps"] == 3
    (a, _), (b, _) = load_runs([whole]), load_runs([stopped])
    assert [r.config["seed"] for r in a] == [r.config["seed"] for r in b] == [0, 1, 2]

    again = runner.invoke(app, [*args, f"hydra.sweep.dir={stopped}"])  # all finished: nothing runs
    assert again.exit_code == 0 and again.output.count("skipped") == 3, again.output
    assert [steady(stopped / j) for j in jobs] == [steady(whole / j) for j in jobs]


def test_a_finished_sweep_run_again_with_more_steps_trains_each_run_on(tmp_path, cache_dir, monkeypatch):
    """`train.steps` is a key a resume may change: the same sweep with more steps continues every run, as
    `gspo train resume=DIR train.steps=N` does, and records it in the run's resumes.jsonl."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "-m", "seed=0,1", *tiny(cache_dir, **{"hardware.threads": 1}), f"hydra.sweep.dir={tmp_path / 's'}"]
    assert runner.invoke(app, [*args, "train.steps=1"]).exit_code == 0
    res = runner.invoke(app, [*args, "train.steps=2"])
    assert res.exit_code == 0, res.output
    for job in ("seed-0", "seed-1"):
        assert [r["step"] for r in steady(tmp_path / "s" / job)] == [0, 1, 2]
        (entry,) = [json.loads(x) for x in (tmp_path / "s" / job / "resumes.jsonl").read_text().splitlines()]
        assert entry["from_step"] == 2 and entry["changes"]["train.steps"] == {"was": 1, "now": 2}


@pytest.mark.slow
def test_a_sweep_whose_process_was_killed_continues_from_its_checkpoints(tmp_path, cache_dir):
    """kill -9 of the process running a sweep (its lock stays behind, metrics run past the last checkpoint): the
    same command again takes the stale lock over, drops what came after the checkpoint and ends as a sweep never
    killed."""
    env = child_env()
    args = [sys.executable, "-m", "cli.main", "train", "-m", "seed=0,1",
            *tiny(cache_dir, **{"train.steps": 8, "train.checkpoint_every": 2, "hardware.threads": 1})]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert subprocess.run([*args, f"hydra.sweep.dir={whole}"], env=env, cwd=tmp_path, capture_output=True).returncode == 0
    proc = subprocess.Popen([*args, f"hydra.sweep.dir={killed}"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "seed-1" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 4):  # step 3 logged
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert (killed / "seed-1" / ".lock").exists() and status(killed / "seed-1") == "running"
    res = subprocess.run([*args, f"hydra.sweep.dir={killed}"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "skipped" in res.stdout and "resuming from step" in res.stdout
    for job in ("seed-0", "seed-1"):
        assert steady(killed / job) == steady(whole / job)


def test_record_writes_through_a_temporary_file_of_its_own(tmp_path):
    """Two sweeps started at once in one directory each write sweep.json through their own temporary file: one
    never renames the other's half-written file into place, nor finds it gone. (The other's file in flight stands
    at the name a shared temporary would have.)"""
    in_flight = tmp_path / "sweep.json.tmp"
    in_flight.write_text('{"named_by": ["se')
    sweep.record(tmp_path, ["seed"])
    assert json.loads((tmp_path / "sweep.json").read_text()) == {"named_by": ["seed"]}
    assert in_flight.read_text() == '{"named_by": ["se'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json", "sweep.json.tmp"]  # none of its own left

"""One run per directory: runs started in the same second get their own directories, a directory that holds a
run is not started into again, a live run's lock refuses a second writer and a stale lock is taken over,
and `gspo compare` does not report a run whose metrics two runs wrote as clean."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from gspo.config.loading import compose
from gspo.core import files
from gspo.core.errors import ConfigError
from gspo.results.runs import load_runs
from gspo.train.loop.trainer import train
from gspo.train.run import rundir
from tests.cli.test_cli import one_line_exit_2
from tests.conftest import tiny

runner = CliRunner()


def steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_claim_takes_the_next_free_name(tmp_path):
    assert rundir.claim(tmp_path / "a" / "12-00-00") == tmp_path / "a" / "12-00-00"
    assert rundir.claim(tmp_path / "a" / "12-00-00") == tmp_path / "a" / "12-00-00-2"
    assert rundir.claim(tmp_path / "a" / "12-00-00") == tmp_path / "a" / "12-00-00-3"


@pytest.fixture
def frozen_clock(tmp_path, monkeypatch):
    """Hydra's clock stopped at 2026-01-01 12:00:00 (its run directories have one-second resolution), cwd tmp_path."""
    import hydra.core.utils

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 1, 12, 0, 0)

    monkeypatch.setattr(hydra.core.utils, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)


def test_two_runs_started_in_the_same_second_get_their_own_directories(tmp_path, cache_dir, frozen_clock):
    for seed in (0, 1):
        res = runner.invoke(app, ["train", *tiny(cache_dir, **{"train.steps": 1, "seed": seed})])
        assert res.exit_code == 0, res.output
    first, second = tmp_path / "outputs/2026-01-01/12-00-00", tmp_path / "outputs/2026-01-01/12-00-00-2"
    assert steps(first) == steps(second) == [0, 1]
    assert [(d / ".hydra" / "overrides.yaml").read_text().count("seed=") for d in (first, second)] == [1, 1]
    assert "seed: 0" in (first / "config.yaml").read_text() and "seed: 1" in (second / "config.yaml").read_text()


def test_a_directory_that_holds_a_run_is_not_started_into_again(tmp_path, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "same"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run)
    before = (run / "metrics.jsonl").read_text()
    one_line_exit_2(runner.invoke(app, ["train", *tiny(cache_dir), f"hydra.run.dir={run}"]),
                    f"hydra.run.dir={run}", "already holds a run", f"resume={run}")
    assert (run / "metrics.jsonl").read_text() == before and not (run / ".hydra").exists()


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def write_lock(run_dir, **owner) -> None:
    (run_dir / rundir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "since": "then", **owner}))


def test_a_live_runs_lock_refuses_a_resume_and_a_stale_one_is_taken_over(tmp_path, cache_dir, monkeypatch, live_pid):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run)
    write_lock(run, pid=live_pid)
    one_line_exit_2(runner.invoke(app, ["train", f"resume={run}", "train.steps=2"]),
                    str(run), f"pid {live_pid}", "one run per directory")
    with pytest.raises(ConfigError, match=f"pid {live_pid}"):
        with rundir.lock(run):
            pass

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(run, pid=dead.pid)  # a run killed with -9: its lock stays behind
    res = runner.invoke(app, ["train", f"resume={run}", "train.steps=2"])
    assert res.exit_code == 0, res.output
    assert steps(run) == [0, 1, 2] and not (run / rundir.LOCK).exists()  # released at the end


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_node(tmp_path, monkeypatch):
    write_lock(tmp_path, pid=1, host="node-that-died", slurm_job="123")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert rundir.holder(tmp_path) is not None  # the same job, not requeued: another task of it
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert rundir.holder(tmp_path) is None
    monkeypatch.setenv("SLURM_JOB_ID", "456")
    assert rundir.holder(tmp_path)["host"] == "node-that-died"  # another job's run: not ours to take


def test_compare_flags_a_run_whose_metrics_repeat_steps(tmp_path):
    run = tmp_path / "mixed"
    run.mkdir()
    (run / "config.yaml").write_text("algo:\n  name: grpo\nseed: 1\ntrain:\n  steps: 2\n")
    rows = [{"step": s, "reward/mean": r} for s, r in ((0, 0.1), (0, 0.2), (1, 0.3), (1, 0.4), (2, 0.5))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, broken = load_runs([tmp_path])
    assert runs == [] and len(broken) == 1
    assert "repeats steps 0 (2x), 1 (2x)" in broken[0].reason and "two runs" in broken[0].reason
    res = runner.invoke(app, ["compare", str(tmp_path)])
    assert res.exit_code == 2 and "repeats steps" in res.output


def test_two_sweeps_started_in_the_same_second_get_their_own_sweep_directories(tmp_path, frozen_clock):
    first, second = (rundir.run_dir_overrides(["seed=0,1"], multirun=True) for _ in range(2))
    assert first == ["hydra.sweep.dir=outputs/multirun/2026-01-01/12-00-00"]
    assert second == ["hydra.sweep.dir=outputs/multirun/2026-01-01/12-00-00-2"]
    assert rundir.run_dir_overrides(["hydra.sweep.dir=mine", "seed=0,1"], multirun=True) == []  # the user's own


def test_a_lock_being_written_counts_as_held_and_an_old_unreadable_one_as_stale(tmp_path):
    (tmp_path / rundir.LOCK).write_text("")  # created by O_EXCL, its owner not written yet
    assert rundir.holder(tmp_path) is not None
    os.utime(tmp_path / rundir.LOCK, (0, 0))
    assert rundir.holder(tmp_path) is None


@pytest.fixture
def umask():
    """Set the process's umask for the test (`umask(0o022)`); the one before restored."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def modes(root) -> dict[str, int]:
    """Each path under `root` (itself included, as ".") with its permission bits."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_files_written_whole_and_temporary_directories_get_the_mode_open_and_mkdir_give(tmp_path, umask, monkeypatch):
    """A file rewritten whole (`replace_text`: summary.json, metrics.jsonl, sweep.json, the resumes list) and a
    directory filled under a temporary name (a checkpoint, a LoRA run's merged export) get 0o666 / 0o777 less the
    umask, as open() and mkdir give, not mkstemp's and mkdtemp's owner-only 0o600 / 0o700; replacing a file
    keeps no owner-only mode of the file it replaces, and the weights safetensors writes owner-only are widened."""
    import torch
    from safetensors.torch import save_file

    from gspo.models import adapters

    class Saves:  # a merged model and its tokenizer: the weights written as transformers writes them (safetensors)
        def merge_and_unload(self):
            return self

        def save_pretrained(self, path, **_):
            save_file({"w": torch.zeros(1)}, str(Path(path) / "model.safetensors"))

    monkeypatch.setattr(adapters, "load", lambda *a, **k: (Saves(), Saves()))
    for mask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o027, 0o640, 0o750)):
        umask(mask)
        here = tmp_path / oct(mask)
        here.mkdir()
        files.replace_text(here / "summary.json", "{}")
        (here / "sweep.json").write_text("old")
        (here / "sweep.json").chmod(0o600)
        files.replace_text(here / "sweep.json", "{}")
        fd, name = files.temp_file(here, prefix=".x-")
        os.close(fd)
        files.temp_dir(here)
        adapters.export_merged(here / "adapter", here / "merged")
        found = modes(here)
        wrong = {k: oct(v) for k, v in found.items() if v != (dir_mode if (here / k).is_dir() else file_mode)}
        assert wrong == {}, oct(mask)
        assert (here / "merged" / "model.safetensors").is_file() and len(found) == 7  # no temporary file left


def test_a_runs_files_and_checkpoints_can_be_read_by_a_colleague(tmp_path, cache_dir, monkeypatch, umask):
    """Under umask 022 every file a run and its resume write is 0o644 and every directory 0o755: summary.json and
    the resumes list (rewritten through a temporary file) as config.yaml, the checkpoints (renamed from a temporary
    directory) as the run's directory. Owner-only files kept a colleague on a shared results directory from them."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run)
    res = runner.invoke(app, ["train", f"resume={run}", "train.steps=2"])
    assert res.exit_code == 0, res.output
    found = modes(run)
    assert "resumes" in json.loads((run / "summary.json").read_text())
    assert any(name.startswith("checkpoints/step_") for name in found), sorted(found)
    wrong = {name: oct(mode) for name, mode in found.items() if mode != (0o755 if (run / name).is_dir() else 0o644)}
    assert wrong == {}

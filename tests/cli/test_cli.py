"""The `gspo` command as a user meets it: errors raised inside the Hydra job or a torchrun
worker still end as one line and exit code 2, resume refuses what it would ignore (that it leaves
no stray directory: test_train), the machine is checked before work, the help keeps its examples intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import TRAIN_EXAMPLES, app
from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.train.loop.trainer import train
from tests.conftest import REPO, child_env, tiny

runner = CliRunner()
ROOT = REPO


def gspo_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def one_line_exit_2(res, *needles: str) -> str:
    """The output of a refused command: exit 2, no traceback, one `gspo: error:` line naming `needles`."""
    out = res.output if hasattr(res, "output") else res.stdout + res.stderr
    code = res.exit_code if hasattr(res, "exit_code") else res.returncode
    assert code == 2, out[-3000:]
    assert "Traceback" not in out and "Error executing job" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("gspo: error:")]
    assert len(errors) == 1, out[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the CLI in an empty directory, so a run directory Hydra makes would show."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --------------------------------------------------------------------------- errors inside the job


def test_config_error_inside_the_hydra_job_is_one_line_and_exit_2(in_tmp, monkeypatch, cache_dir):
    def refuses(cfg, run_dir):
        raise ConfigError("reward.fn=mine.py:score: raised KeyError on sample 3")

    monkeypatch.setattr("gspo.train.loop.trainer.train", refuses)
    res = runner.invoke(app, ["train", *tiny(cache_dir)])
    one_line_exit_2(res, "reward.fn=mine.py:score")


def test_config_error_in_one_job_of_a_sweep_names_the_job(in_tmp, monkeypatch, cache_dir):
    ran = []

    def refuses_seed_1(cfg, run_dir):
        ran.append(cfg.seed)
        if cfg.seed == 1:
            raise ConfigError("bad data for this seed")
        return {}

    monkeypatch.setattr("gspo.train.loop.trainer.train", refuses_seed_1)
    res = runner.invoke(app, ["train", "-m", "seed=0,1,2", *tiny(cache_dir)])
    line = one_line_exit_2(res, "bad data for this seed", "seed=1")
    assert "job 1" in line
    assert ran == [0, 1, 2]  # the other jobs of the sweep still ran


@pytest.mark.parametrize("error, code", [("config", 2), ("run", 1)])
def test_a_workers_failure_is_one_line(error, code, in_tmp, monkeypatch, cache_dir):
    """The launcher turns a worker's failure into one ConfigError (your code or data: exit 2) or RunFailed
    (exit 1) line (gspo/train/run/failures.py); the job must not turn it into Hydra's traceback."""
    from gspo.core.errors import ConfigError, RunFailed

    def launch(cfg, run_dir):
        raise (ConfigError if error == "config" else RunFailed)("rank 1, step 2: boom")

    monkeypatch.setattr("gspo.train.ranks.launcher.launch", launch)
    res = runner.invoke(app, ["train", "hardware=cpu-ddp", *tiny(cache_dir)])
    assert res.exit_code == code and "Traceback" not in res.output
    assert [x for x in res.output.splitlines() if x.strip()] == ["gspo: error: rank 1, step 2: boom"]


def test_failure_records_are_explained_in_one_line(tmp_path):
    """The launcher's reading of the ranks' failure records: the primary error wins over the secondary ones,
    a rank that left no record and died of a signal is named, a time-out names the rank that never came."""
    import json

    from gspo.train.run import failures

    def write(**recs):
        d = failures.clear(tmp_path)
        d.mkdir(exist_ok=True)
        for i, (rank, rec) in enumerate(recs.items()):
            (d / f"{rank}.json").write_text(json.dumps({"time": i, "config_error": False, **rec}))

    write(rank0={"rank": 0, "step": 3, "type": "DistBackendError", "message": "Connection closed by peer",
                 "secondary": True},
          rank1={"rank": 1, "step": 3, "type": "RewardError", "message": "f raised KeyError", "secondary": False,
                 "config_error": True})
    assert failures.explain(tmp_path, {0: 1, 1: 2}, 900) == ("rank 1, step 3: RewardError: f raised KeyError", True)
    write(rank0={"rank": 0, "step": 5, "type": "DistBackendError", "message": "Connection closed by peer",
                 "secondary": True})
    assert failures.explain(tmp_path, {0: 1, 1: -9}, 900)[0] == \
        "rank 1, step 5: killed by SIGKILL, with no error of its own; the other ranks were stopped"
    write(rank1={"rank": 1, "step": 2, "type": "DistBackendError", "secondary": True,
                 "message": "Timed out waiting 8000ms for recv operation to complete"})
    assert failures.explain(tmp_path, {0: 1, 1: 1}, 8)[0].startswith(
        "rank 1, step 2: waited more than hardware.collective_timeout_s=8 s in a collective for rank 0, which hung")


def test_hydra_launcher_errors_are_one_line(in_tmp):
    one_line_exit_2(runner.invoke(app, ["train", "hydra/launcher=nope"]), "hydra/launcher/nope", "parallel", "slurm")


BAD_REWARD = "def boom(prompts, completions, **fields):\n    raise ValueError('boom on ' + completions[0])\n"


def test_a_data_error_found_before_the_job_is_one_line_for_real(tmp_path):
    """End to end, no stand-ins: a JSONL row without an answer is refused before any work."""
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    res = gspo_cli("train", "task=jsonl", "task.path=bad.jsonl", "hardware.threads=1", cwd=tmp_path)
    one_line_exit_2(res, "bad.jsonl")


def test_a_reward_error_inside_the_job_is_one_line_for_real(tmp_path, cache_dir):
    """A user's reward function that raises while training: found inside the job, still one line and exit 2."""
    (tmp_path / "rw.py").write_text(BAD_REWARD)
    res = gspo_cli("train", "reward=python", "reward.fn=rw.py:boom", *tiny(cache_dir), cwd=tmp_path)
    one_line_exit_2(res, "boom")


def test_a_reward_error_in_a_parallel_sweep_job_is_exit_2_without_a_traceback(tmp_path, cache_dir, monkeypatch):
    """joblib runs the jobs in other processes: Hydra hands the job's ConfigError back to gspo."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    (tmp_path / "rw.py").write_text(BAD_REWARD)
    monkeypatch.chdir(tmp_path)  # gspo in this process; the jobs in joblib's
    res = runner.invoke(app, ["train", "-m", "hydra/launcher=parallel", "reward=python", "reward.fn=rw.py:boom",
                              "seed=0,1", *tiny(cache_dir, **{"hardware.threads": 1})])
    out = res.output
    assert res.exit_code == 2 and "Traceback" not in out, out[-3000:]
    assert any(line.startswith("gspo: error: job ") and "boom" in line for line in out.splitlines()), out[-3000:]


# --------------------------------------------------------------------------- the machine


def test_gpu_profile_without_cuda_is_refused_before_any_work(in_tmp, monkeypatch, cache_dir):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["hardware=gpu"], ["hardware.device=cuda"], ["hardware=gpu-ddp", "hardware.nproc=2"]):
        res = runner.invoke(app, ["train", *args, *tiny(cache_dir)])
        one_line_exit_2(res, "hardware", "CUDA")
    assert not (in_tmp / "outputs").exists()  # refused before Hydra made a run directory


def test_machine_checks_skip_what_only_prints_or_runs_elsewhere(in_tmp, monkeypatch):
    """`--cfg job` runs nothing, and a SLURM sweep's jobs run on the cluster's GPU nodes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["train", "--cfg", "job", "hardware=gpu"])
    assert res.exit_code == 0, res.output
    from cli.main import _runs_here

    assert _runs_here(["hardware=gpu"]) and _runs_here(["hydra/launcher=parallel"])
    assert not _runs_here(["hydra/launcher=slurm", "hardware=gpu-ddp"])


# --------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run_dir)
    return run_dir


def test_resume_refuses_group_swaps(in_tmp, finished_run):
    for swap in ("algo=grpo", "model=qwen3-tiny", "+experiment=x", "~seed"):
        res = runner.invoke(app, ["train", f"resume={finished_run}", swap, "train.steps=2"])
        one_line_exit_2(res, swap, "resume", "KEY=VALUE")
    assert not (in_tmp / "outputs").exists()


def test_resume_refuses_unknown_keys_and_bad_values_up_front(in_tmp, finished_run):
    one_line_exit_2(runner.invoke(app, ["train", f"resume={finished_run}", "train.stepz=2"]), "train.stepz")
    one_line_exit_2(runner.invoke(app, ["train", f"resume={finished_run}", "rollout.temperature=0"]),
                    "rollout.temperature=0")
    one_line_exit_2(runner.invoke(app, ["train", f"resume={in_tmp / 'nothing'}"]), "resume=", "config.yaml")
    one_line_exit_2(runner.invoke(app, ["train", "-m", f"resume={finished_run}", "seed=0,1"]), "resume", "-m")


def test_resume_cfg_job_prints_the_config_resume_trains(in_tmp, finished_run):
    """Hydra's `--cfg job` would print the default config, not the run's own."""
    res = runner.invoke(app, ["train", f"resume={finished_run}", "train.steps=7", "--cfg", "job"])
    assert res.exit_code == 0, res.output
    assert "steps: 7" in res.output and "group_size: 4" in res.output  # the run's tiny G=4, not the default 8
    assert f"resume: {finished_run}" in res.output and not (in_tmp / "outputs").exists()


# --------------------------------------------------------------------------- help


def test_train_help_keeps_every_example_line_intact():
    """Click rewraps help paragraphs to the terminal width; the examples must survive a narrow one."""
    for width in (60, 200):
        res = runner.invoke(app, ["train", "--help"], terminal_width=width)
        assert res.exit_code == 0
        lines = [line.strip() for line in res.output.splitlines()]
        for example in TRAIN_EXAMPLES.strip().splitlines():
            assert example.strip() in lines, (width, example)
    res = runner.invoke(app, ["--help"], terminal_width=60)
    assert any(line.strip().startswith("algo ") and "gspo_token" in line and "softmax_weighted" in line
               for line in res.output.splitlines()), res.output


# --------------------------------------------------------------------------- what a new user meets


@pytest.mark.parametrize("override, needles", [
    ("model.path=/some/checkpoint", ("model.path=/some/checkpoint would be ignored", "model=hf model.path=DIR")),
    ("task.path=data.jsonl", ("task.path=data.jsonl would be ignored", "task=data task.path=FILE")),
    ("reward.weights=[1.0]", ("reward.weights=[1.0] would be ignored", "reward=python")),
    ("algo.tau_pos=2.0", ("algo.tau_pos=2.0 would be ignored", "sapo")),
    ("logger.wandb_cfg.project=x", ("would be ignored", "logger=wandb")),
    ("rollout.tis_cap=3", ("would be ignored", "rollout.tis=token")),
])
def test_a_key_no_chosen_option_reads_is_refused(in_tmp, override, needles):
    """`model.path=DIR` without `model=hf` ran the default model and said nothing: the user believed their
    checkpoint was trained on. Every such key is refused in one line naming the group to pick."""
    one_line_exit_2(runner.invoke(app, ["train", override]), *needles)


def test_a_key_some_job_of_a_sweep_reads_is_accepted(cache_dir):
    from cli.main import _check_before_work

    cfgs = _check_before_work(["algo=grpo,sapo", "algo.tau_pos=2.0", *tiny(cache_dir)], [], multirun=True)
    assert [c.algo.name for c in cfgs] == ["grpo", "sapo"]


def test_wandb_online_without_a_login_is_one_line(in_tmp, monkeypatch, cache_dir):
    """Before: an 87-line traceback and exit 1 once W&B tried to log in."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(in_tmp / "no-netrc"))
    monkeypatch.setenv("HOME", str(in_tmp))
    res = runner.invoke(app, ["train", "logger=wandb", "logger.wandb_cfg.mode=online", *tiny(cache_dir)])
    one_line_exit_2(res, "logger.wandb_cfg.mode=online needs a W&B login", "WANDB_API_KEY", "mode=offline")
    (in_tmp / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    monkeypatch.setenv("NETRC", str(in_tmp / "netrc"))
    from gspo.config.checks import wandb_logged_in

    assert wandb_logged_in()


def test_a_sweep_over_a_presets_algorithm_says_what_the_preset_set_and_runs(tmp_path, cache_dir, monkeypatch):
    """`gspo train -m +experiment=NAME algo=grpo,gspo`: the preset's line is composed from the first job's
    overrides (composing `algo=grpo,gspo` itself once refused the sweep with a traceback)."""
    monkeypatch.chdir(tmp_path)  # (in this process: nothing of Hydra's lands in the repository)
    res = runner.invoke(app, ["train", "-m", "+experiment=moe_mismatch", "algo=grpo,gspo",
                              *tiny(cache_dir, **{"train.steps": 1, "model.warm_start.steps": 5,
                                                  "model.warm_start.target_accuracy": 0, "eval.every": 0}),
                              f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert res.exit_code == 0, res.output[-2000:]
    [line] = [x for x in res.output.splitlines() if x.startswith("gspo: +experiment=moe_mismatch sets")]
    assert "model=qwen3-moe-wide" in line and "Traceback" not in res.output
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["algo-grpo", "algo-gspo"]


def test_the_console_says_what_a_preset_switched_on(tmp_path, cache_dir, monkeypatch):
    """`+experiment=...` prints what it set beyond the defaults (one line). (Where a resume starts:
    test_train's test_cli_run_multirun_and_resume.)"""
    monkeypatch.chdir(tmp_path)  # (in this process: nothing of Hydra's lands in the repository)
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", "+experiment=moe_mismatch",
                              *tiny(cache_dir, **{"train.steps": 1, "model.warm_start.steps": 5,
                                                  "model.warm_start.target_accuracy": 0, "eval.every": 0}),
                              f"hydra.run.dir={run}"])
    assert res.exit_code == 0, res.output[-2000:]
    [line] = [x for x in res.output.splitlines() if x.startswith("gspo: +experiment=moe_mismatch sets")]
    assert "model=qwen3-moe-wide" in line and "task=chain" in line and "rollout.dtype=bfloat16" in line
    assert line.endswith("old log-probs: recompute")

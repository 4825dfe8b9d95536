"""End to end: `gspo train` on a tiny model writes what the contracts promise, resumes, and
runs every algorithm preset; `model=hf` takes a checkpoint the project saved itself."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny
from transformers import AutoModelForCausalLM

from gspo.config.loading import compose
from gspo.config.schema import group_options
from gspo.train import checkpoint
from gspo.train.trainer import train

STEP_KEYS = {
    "reward/mean", "reward/std", "reward/frac_zero_std", "reward/tinyzero/mean", "clip/frac_low", "clip/frac_high",
    "clip/frac", "clip/seq_frac", "policy/entropy", "policy/ratio_mean", "policy/ratio_min", "policy/ratio_max",
    "kl/old", "response/len_mean", "response/truncated_frac", "moe/routing_volatility", "moe/router_shift",
    "train/loss", "train/grad_norm", "train/lr", "time/rollout_s", "time/update_s", "time/step_s",
    "throughput/tokens_per_s",
}


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("run")
    summary = train(compose(tiny(cache_dir)), run_dir)
    return run_dir, summary


def test_run_directory_and_metrics(run):
    run_dir, summary = run
    assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.json").is_file()
    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert "eval/accuracy" in lines[0] and "eval/accuracy" in lines[-1]  # the start and the end are evaluated
    for m in lines[1:]:
        assert STEP_KEYS <= m.keys(), STEP_KEYS - m.keys()
        assert all(math.isfinite(v) for v in m.values())
    assert summary["status"] == "finished"
    assert summary["base_accuracy"] == lines[0]["eval/accuracy"]
    assert summary["final_accuracy"] == lines[-1]["eval/accuracy"]


def test_checkpoint_loads_back_with_from_pretrained(run):
    run_dir, _ = run
    ckpt = checkpoint.latest(run_dir)
    assert ckpt.name == "step_000002"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert checkpoint.load_state(ckpt)["step"] == 2


def test_resume_continues_the_step_count(tmp_path, cache_dir):
    cfg = compose(tiny(cache_dir, **{"train.steps": 2}))
    train(cfg, tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a step logged after the last checkpoint, then a crash
        f.write(json.dumps({"step": 3, "reward/mean": 0.0}) + "\n")
    cfg = compose(tiny(cache_dir, **{"train.steps": 4, "resume": str(tmp_path)}))
    summary = train(cfg, tmp_path)
    steps = [m["step"] for m in read_metrics(tmp_path)]
    assert steps == [0, 1, 2, 3, 4]  # no step twice, none lost
    assert checkpoint.load_state(checkpoint.latest(tmp_path))["step"] == 4
    assert summary["status"] == "finished" and "base_accuracy" in summary


def test_hf_model_from_a_checkpoint_we_saved(run, tmp_path, cache_dir):
    ckpt = checkpoint.latest(run[0])
    cfg = compose(tiny(cache_dir, **{"model": "hf", "model.path": str(ckpt), "train.steps": 1}))
    summary = train(cfg, tmp_path)
    assert summary["status"] == "finished"


@pytest.mark.parametrize("algo", group_options("algo"))
def test_every_preset_runs_with_finite_metrics(algo, tmp_path, cache_dir):
    # rollout.keep_topk: dppo_topk needs the sampler's top-k; every other preset ignores them
    train(compose(tiny(cache_dir, algo=algo, **{"train.steps": 1, "rollout.keep_topk": 3})), tmp_path)
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == 1 and math.isfinite(last["train/loss"]) and math.isfinite(last["reward/mean"])


def test_dense_model_has_no_moe_metrics(tmp_path, cache_dir):
    train(compose(tiny(cache_dir, model="qwen3-tiny", **{"train.steps": 1})), tmp_path)
    assert not any(k.startswith("moe/") for k in read_metrics(tmp_path)[-1])


def gspo_cli(*args, cwd):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_run_multirun_and_resume(tmp_path, cache_dir):
    env_cwd = tmp_path
    res = gspo_cli("train", "-m", "algo=grpo,gspo", *tiny(cache_dir, **{"train.steps": 1}), cwd=env_cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    jobs = sorted(p.parent for p in (tmp_path / "outputs" / "multirun").rglob("config.yaml") if p.parent.name != ".hydra")
    assert [json.loads((j / "summary.json").read_text())["status"] for j in jobs] == ["finished", "finished"]
    algos = sorted(read_config_algo(j) for j in jobs)
    assert algos == ["grpo", "gspo"]
    res = gspo_cli("train", f"resume={jobs[0]}", "train.steps=2", cwd=env_cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [m["step"] for m in read_metrics(jobs[0])] == [0, 1, 2]
    assert "run directory" in res.stdout and "held-out accuracy" in res.stdout


def read_config_algo(run_dir):
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["algo"]["name"]


def test_routing_replay_removes_the_update_pass_mismatch(tmp_path, cache_dir):
    """R2 forces the old policy's experts in every update pass: what the update routed equals
    the old routing exactly; without replay the second minibatch already routes differently."""
    overrides = {"train.steps": 2, "train.minibatches": 4, "train.lr": 0.05, "algo": "grpo"}
    train(compose(tiny(cache_dir, **overrides, **{"moe.routing_replay": "R2"})), tmp_path / "r2")
    assert all(m["moe/update_mismatch"] == 0.0 for m in read_metrics(tmp_path / "r2")[1:])
    train(compose(tiny(cache_dir, **overrides, **{"moe.routing_replay": "R3"})), tmp_path / "r3")
    assert all(m["moe/update_mismatch"] < 0.05 for m in read_metrics(tmp_path / "r3")[1:])
    train(compose(tiny(cache_dir, **overrides)), tmp_path / "none")
    assert any(m["moe/update_mismatch"] > 0.0 for m in read_metrics(tmp_path / "none")[1:])


def test_routing_replay_with_gradient_checkpointing(tmp_path, cache_dir):
    """Backward recomputes the forward under checkpointing: replay must still be in force there."""
    overrides = {"train.steps": 1, "moe.routing_replay": "R2", "model.gradient_checkpointing": True}
    summary = train(compose(tiny(cache_dir, **overrides)), tmp_path)
    assert summary["status"] == "finished"
    assert read_metrics(tmp_path)[-1]["moe/update_mismatch"] == 0.0


NEW_FAMILY = ["dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "gpg", "topr", "reinforce_plus_plus",
              "reinforce_plus_plus_baseline", "passk", "grpo_passk"]


@pytest.mark.slow
@pytest.mark.parametrize("algo", NEW_FAMILY)
def test_new_family_learns_on_the_tiny_moe(algo, tmp_path, cache_dir):
    """60 steps of 16 prompts x 8 on the default tiny MoE and addition task, default learning rate, one thread:
    held-out accuracy rises and the batch reward of the last 10 steps beats the first 10 (about a minute each)."""
    overrides = {"algo": algo, "train.steps": 60, "rollout.prompts_per_step": 16, "eval.every": 0,
                 "hardware.threads": 1, "logger.progress": False, "cache_dir": str(cache_dir)}
    summary = train(compose([f"{k}={v}" for k, v in overrides.items()]), tmp_path)
    rewards = [m["reward/mean"] for m in read_metrics(tmp_path) if "reward/mean" in m]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"\n{algo}: held-out accuracy {summary['base_accuracy']:.3f} -> {summary['final_accuracy']:.3f}, "
          f"reward/mean first 10 steps {first:.3f} -> last 10 {last:.3f}")
    assert summary["final_accuracy"] > summary["base_accuracy"] and last > first

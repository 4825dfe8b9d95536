"""End to end: `gspo train` on a tiny model writes what the contracts promise, resumes, and
runs every algorithm preset; `model=hf` takes a checkpoint the project saved itself."""

import json
import math
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from gspo.config.loading import compose
from gspo.config.schema import group_options
from gspo.train.loop.trainer import train
from gspo.train.run import checkpoint
from tests.conftest import tiny
from tests.train.loop import learning_spread  # the learning test's run, and the script that measures its spread

STEP_KEYS = {
    "reward/mean", "reward/std", "reward/frac_zero_std", "reward/tinyzero/mean", "clip/frac_low", "clip/frac_high",
    "clip/frac", "clip/seq_frac", "policy/entropy", "policy/ratio_mean", "policy/ratio_min", "policy/ratio_max",
    "policy/token_ratio_min", "policy/token_ratio_max",
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


def test_cli_run_multirun_and_resume(tmp_path, cache_dir, monkeypatch):
    """`gspo train -m` into Hydra's default sweep directory under the working directory, then a resume of one
    job: in place, its step said, no new directory."""
    from typer.testing import CliRunner

    from cli.main import app

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", "-m", "algo=grpo,gspo", *tiny(cache_dir, **{"train.steps": 1})])
    assert res.exit_code == 0, res.output[-2000:]
    jobs = sorted(p.parent for p in (tmp_path / "outputs" / "multirun").rglob("config.yaml") if p.parent.name != ".hydra")
    assert [json.loads((j / "summary.json").read_text())["status"] for j in jobs] == ["finished", "finished"]
    algos = sorted(read_config_algo(j) for j in jobs)
    assert algos == ["grpo", "gspo"]
    before = {p for p in tmp_path.rglob("*") if p.is_dir()}
    res = CliRunner().invoke(app, ["train", f"resume={jobs[0]}", "train.steps=2"])
    assert res.exit_code == 0, res.output[-2000:]
    assert [m["step"] for m in read_metrics(jobs[0])] == [0, 1, 2]
    assert "run directory" in res.output and "held-out accuracy" in res.output
    assert f"gspo: resuming from step 1 of 2 (checkpoint {jobs[0]}/checkpoints/step_000001)" in res.output
    # in place: no outputs/DATE/TIME, no .hydra/, the resolved config says the new length
    assert {p for p in tmp_path.rglob("*") if p.is_dir()} - before == {jobs[0] / "checkpoints" / "step_000002"}
    assert "steps: 2" in (jobs[0] / "config.yaml").read_text()


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


@pytest.mark.parametrize("algo,replay", [("grpo", "R3"), ("rspo", "R2")])
def test_trimming_each_minibatch_to_its_own_width_changes_no_number(algo, replay, tmp_path, cache_dir, monkeypatch):
    """train.trim_padding: each minibatch runs at its rows' width, not the batch's. The run is the same to float32
    rounding: losses, gradient norms, clip fractions, entropies, routing statistics (routing replayed and RSPO's
    router shift read at the same columns) and the final weights. Sorted minibatches (the same in both runs) make
    the widths differ, and the spy checks that columns were dropped."""
    import torch

    from gspo.rollout.decoding.generate import Rollout

    dropped = []
    trimmed = Rollout.trimmed

    def spy(self):
        sub, window = trimmed(self)
        dropped.append(self.input_ids.shape[1] - sub.input_ids.shape[1])
        return sub, window

    monkeypatch.setattr(Rollout, "trimmed", spy)
    runs = {}
    for trim in (False, True):
        overrides = {"algo": algo, "moe.routing_replay": replay, "train.steps": 2, "train.minibatches": 4,
                     "train.lr": 0.01, "train.sort_minibatches": True, "train.trim_padding": trim,
                     "rollout.max_new_tokens": 8}
        train(compose(tiny(cache_dir, **overrides)), tmp_path / str(trim))
        runs[trim] = read_metrics(tmp_path / str(trim))[1:]
    assert len(dropped) == 8 and sum(dropped) > 0, dropped
    for plain, cut in zip(runs[False], runs[True]):
        for key, value in plain.items():
            if not key.startswith("time/") and key != "throughput/tokens_per_s":
                assert cut[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    weights = [AutoModelForCausalLM.from_pretrained(checkpoint.latest(tmp_path / str(t))).state_dict() for t in runs]
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, atol=1e-5, rtol=1e-4)


# The measured spread of what the test asserts on: the batch reward, last 20 steps minus first 10. A seed draws
# its own warm-started base and samples, as another CPU's rounding does (2-core x86, torch 2.13.0+cpu):
#   python tests/train/loop/learning_spread.py --seeds 3 --jobs 2          (passk, grpo_passk: --seeds 5)
#   algo                          min     mean    max         algo                          min     mean    max
#   dppo_tv                       +0.679  +0.698  +0.716      topr                          +0.651  +0.689  +0.714
#   dppo_kl                       +0.676  +0.693  +0.710      reinforce_plus_plus           +0.632  +0.686  +0.718
#   clip_cov                      +0.643  +0.692  +0.718      reinforce_plus_plus_baseline  +0.675  +0.704  +0.724
#   kl_cov                        +0.649  +0.689  +0.718      passk                         +0.391  +0.514  +0.580
#   gpg                           +0.623  +0.679  +0.720      grpo_passk                    +0.194  +0.278  +0.363
#   ppo                           +0.535  +0.619  +0.685      rloo                          +0.444  +0.494  +0.527
# Pass@k rewards a group for one success, not every sample for its own: its mean reward rises least. At a fixed
# policy the difference has a standard deviation of about 0.015 (128 samples a step at p ~ 0.25); the threshold
# is half the lowest gain measured and six of those deviations. (The old test asserted on the task's own reward,
# which moves less than its spread between seeds in 60 steps: why it failed on another CPU.)
MIN_REWARD_GAIN = 0.1


@pytest.mark.slow
@pytest.mark.parametrize("algo", learning_spread.ALGOS)
def test_new_family_learns_on_the_tiny_moe(algo, tmp_path, cache_dir):
    """60 steps of 16 prompts x 8 on the default tiny MoE, default learning rate, one thread, rewarded for a
    completion that contains a 7 (about a quarter of the base's do): the batch reward of the last 20 steps
    beats the first 10 by MIN_REWARD_GAIN (about a minute each). The claim is the method's, not one
    machine's: the threshold sits far below every gain measured over seeds and far above 0."""
    overrides = learning_spread.overrides(algo, seed=0, cache=str(cache_dir))
    train(compose(overrides), tmp_path)
    gain = learning_spread.reward_gain(tmp_path)
    print(f"\n{algo}: reward/mean, last 20 steps minus first 10: {gain:+.3f}")
    assert gain > MIN_REWARD_GAIN

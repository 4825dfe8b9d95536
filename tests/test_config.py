"""Config composition and the errors people see: one line naming the problem, exit code 2."""

import pytest
from typer.testing import CliRunner

from cli.main import app
from gspo.config import GROUPS, compose, group_options, sweep_combinations

runner = CliRunner()


def test_default_config_composes_to_the_documented_keys():
    cfg = compose([])
    assert cfg.algo.name == "gspo" and cfg.model.name == "qwen3-moe" and cfg.task.name == "addition"
    for key in ("seed", "algo.eps_low", "algo.eps_high", "algo.beta", "rollout.group_size", "rollout.prompts_per_step",
                "rollout.max_new_tokens", "rollout.temperature", "train.steps", "train.minibatches", "train.lr",
                "eval.every", "moe.routing_replay", "model.path", "hardware.nproc"):
        node, *rest = key.split(".")
        assert node in cfg and (not rest or rest[0] in cfg[node]), key


@pytest.mark.parametrize("group", [g for g in GROUPS if g != "model"])
def test_every_option_of_every_group_composes(group, tmp_path):
    (tmp_path / "data.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(1000)))
    (tmp_path / "fns.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    extras = {"jsonl": [f"task.path={tmp_path / 'data.jsonl'}"], "data": [f"task.path={tmp_path / 'data.jsonl'}"],
              "python": [f"reward.fn={tmp_path / 'fns.py'}:f"]}
    for option in group_options(group):
        extra = extras.get(option, [])
        cfg = compose([f"{group}={option}", *extra])
        assert cfg[group].name == option


def test_presets_name_themselves():
    for option in group_options("algo"):
        assert compose([f"algo={option}"]).algo.name == option


def test_sweep_expansion():
    combos = sweep_combinations(["algo=grpo,gspo", "seed=0,1", "train.steps=3"])
    assert combos == [
        ["algo=grpo", "seed=0", "train.steps=3"], ["algo=grpo", "seed=1", "train.steps=3"],
        ["algo=gspo", "seed=0", "train.steps=3"], ["algo=gspo", "seed=1", "train.steps=3"],
    ]


def _error(args):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    return res.output


def test_unknown_group_option_lists_the_valid_ones():
    out = _error(["train", "algo=gspoo"])
    assert "algo=gspoo" in out and "grpo" in out and "gspo_token" in out and "dapo" in out


def test_unknown_key_names_the_key_and_the_valid_ones():
    out = _error(["train", "train.stepz=3"])
    assert "train.stepz" in out and "unknown key" in out and "minibatches" in out
    out = _error(["train", "algo.eps=0.1"])
    assert "algo.eps" in out and "eps_low" in out


def test_wrong_type_names_the_key():
    out = _error(["train", "train.steps=many"])
    assert "train.steps" in out and "many" in out


def test_missing_model_path():
    out = _error(["train", "model=hf"])
    assert "model.path" in out
    out = _error(["train", "model=hf", "model.path=/nonexistent/dir"])
    assert "/nonexistent/dir" in out


def test_bad_enumerations_and_registry_names():
    assert "R2" in _error(["train", "moe.routing_replay=R5"])
    assert "gspo_token" in _error(["train", "algo.loss=nope"])


def test_a_bad_value_inside_a_sweep_is_caught_before_any_job_runs():
    out = _error(["train", "-m", "algo=grpo,gsp"])
    assert "algo=gsp" in out


def test_help_lists_groups_and_options():
    for args in (["--help"], ["train", "--help"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0
        for g in GROUPS:
            assert g in res.output
        assert "gspo_token" in res.output and "qwen3-moe" in res.output and "countdown" in res.output


def test_hydra_flags_with_values_pass_through():
    res = runner.invoke(app, ["train", "--cfg", "job", "algo=grpo", "train.steps=7"])
    assert res.exit_code == 0, res.output
    assert "name: grpo" in res.output and "steps: 7" in res.output

"""Config composition and the errors people see: one line naming the problem, exit code 2."""

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from cli.main import app
from gspo.config.loading import compose, sweep_combinations
from gspo.config.schema import GROUPS, group_options
from gspo.core.errors import ConfigError
from gspo.train.preflight import check

runner = CliRunner()


def test_default_config_composes_to_the_documented_keys():
    cfg = compose([])
    assert cfg.algo.name == "gspo" and cfg.model.name == "qwen3-moe" and cfg.task.name == "addition"
    for key in ("seed", "algo.eps_low", "algo.eps_high", "algo.beta", "rollout.group_size", "rollout.prompts_per_step",
                "rollout.max_new_tokens", "rollout.temperature", "train.steps", "train.minibatches", "train.lr",
                "eval.every", "moe.routing_replay", "model.path", "hardware.nproc"):
        node, *rest = key.split(".")
        assert node in cfg and (not rest or rest[0] in cfg[node]), key


def test_composing_the_same_overrides_again_gives_an_equal_config_of_its_own():
    """compose keeps what Hydra composed, by overrides (a composition costs ~0.3 CPU-s): a second call gets an equal
    config that the first caller's changes did not reach, and a refused config is refused every time."""
    first = compose(["algo=grpo", "train.lr=3e-6"])
    eps_low = first.algo.eps_low
    first.train.lr, first.algo.eps_low, first.name = 1.0, 0.5, "changed"
    again = compose(["algo=grpo", "train.lr=3e-6"])
    assert (again.train.lr, again.algo.eps_low, again.algo.name) == (3e-6, eps_low, "grpo") and again.name != "changed"
    assert compose(["train.lr=3e-6"]).algo.name == "gspo"  # other overrides, another config
    for _ in range(2):
        with pytest.raises(ConfigError, match="rollout.group_size"):
            compose(["rollout.group_size=0"])


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


# --------------------------------------------------------------------------- values refused before work

# (overrides, what the one-line message must name); the default batch is 32 prompts x G=8 = 256 rows
BAD_VALUES = [
    (["rollout.group_size=1"], "rollout.group_size=1"),
    (["rollout.temperature=0"], "rollout.temperature=0"),
    (["rollout.temperature=-1"], "rollout.temperature=-1"),
    (["rollout.top_p=0"], "rollout.top_p=0"),
    (["rollout.top_p=1.5"], "rollout.top_p=1.5"),
    (["rollout.prompts_per_step=0"], "rollout.prompts_per_step=0"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens=0"),
    (["rollout.max_new_tokens=256"], "rollout.max_new_tokens=256"),  # the tiny models have 256 positions
    (["train.minibatches=257"], "train.minibatches=257"),
    (["train.minibatches=0"], "train.minibatches=0"),
    (["train.checkpoint_every=0"], "train.checkpoint_every=0"),
    (["train.steps=0"], "train.steps=0"),
    (["train.lr=-0.001"], "train.lr=-0.001"),
    (["train.lr=nan"], "train.lr=nan"),
    (["train.weight_decay=-1"], "train.weight_decay=-1"),
    (["train.grad_clip=0"], "train.grad_clip=0"),
    (["train.warmup_steps=-1"], "train.warmup_steps=-1"),
    (["task.eval_fraction=0"], "task.eval_fraction=0"),
    (["task.eval_fraction=1"], "task.eval_fraction=1"),
    (["task.eval_size=0"], "task.eval_size=0"),
    (["task.digits=0"], "task.digits=0"),
    (["task=countdown", "task.num_operands=1"], "task.num_operands=1"),
    (["task.name=sudoku"], "task.name=sudoku"),
    (["reward.name=fancy"], "reward.name=fancy"),
    (["eval.every=-1"], "eval.every=-1"),
    (["eval.pass_k=-1"], "eval.pass_k=-1"),
    (["algo.eps_low=-0.1"], "algo.eps_low=-0.1"),
    (["algo.eps_high=-0.1"], "algo.eps_high=-0.1"),
    (["algo.beta=-0.01"], "algo.beta=-0.01"),
    (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c=0.5"),
    (["algo.tau_neg=0"], "algo.tau_neg=0"),
    (["algo.router_shift_floor=2"], "algo.router_shift_floor=2"),
    (["algo=clip_cov", "algo.clip_cov_ratio=0"], "algo.clip_cov_ratio=0"),
    (["algo=kl_cov", "algo.kl_cov_ratio=1.5"], "algo.kl_cov_ratio=1.5"),
    (["algo=kl_cov", "algo.kl_cov_coef=-1"], "algo.kl_cov_coef=-1"),
    (["algo=passk", "algo.passk_k=9"], "algo.passk_k=9"),  # more than rollout.group_size=8
    (["algo=passk", "algo.passk_k=0"], "algo.passk_k=0"),
    (["algo.max_sample_batches=0"], "algo.max_sample_batches=0"),
    (["algo.overlong_buffer=-1"], "algo.overlong_buffer=-1"),
    (["algo.overlong_buffer=6"], "algo.overlong_buffer=6"),  # more than rollout.max_new_tokens=5
    (["algo.overlong_penalty=-1"], "algo.overlong_penalty=-1"),
    (["model.top_k=9"], "model.top_k=9"),  # 8 experts
    (["model.num_heads=3", "model.num_kv_heads=2"], "model.num_heads=3"),
    (["model.num_layers=0"], "model.num_layers=0"),
    (["model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef=-1"),
    (["model.warm_start.steps=-1"], "model.warm_start.steps=-1"),
    (["model.warm_start.batch_size=0"], "model.warm_start.batch_size=0"),
    (["model.warm_start.lr=0"], "model.warm_start.lr=0"),
    (["hardware.threads=-1"], "hardware.threads=-1"),
    (["hardware.nproc=0"], "hardware.nproc=0"),
    (["hardware.backend=mpi"], "hardware.backend=mpi"),
    (["logger.wandb_cfg.mode=sometimes"], "logger.wandb_cfg.mode=sometimes"),
    (["logger.wandb_cfg.samples_every=-1"], "logger.wandb_cfg.samples_every=-1"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints=0"),
    (["reward.timeout_s=-1"], "reward.timeout_s=-1"),
    (["rollout.mismatch_every=-1"], "rollout.mismatch_every=-1"),
    (["rollout.tis_cap=0"], "rollout.tis_cap=0"),
    (["moe.stats_every=-1"], "moe.stats_every=-1"),
    (["moe.stats_rows_per_group=-1"], "moe.stats_rows_per_group=-1"),
    (["model.warm_start.problems=-1"], "model.warm_start.problems=-1"),
    (["model.warm_start.target_accuracy=1.5"], "model.warm_start.target_accuracy=1.5"),
    (["model.warm_start.check_every=0"], "model.warm_start.check_every=0"),
    (["reward.correct=nan"], "reward.correct=nan"),
    (["reward.format_score=inf"], "reward.format_score=inf"),
    (["reward.ill_formed=-inf"], "reward.ill_formed=-inf"),
]


@pytest.mark.parametrize("overrides,needle", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_values_are_refused_naming_key_value_and_what_is_allowed(overrides, needle):
    with pytest.raises(ConfigError) as e:
        check(compose(overrides))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and "must be" in msg, msg


def test_bad_values_through_the_cli_are_one_line_and_exit_2():
    """`--cfg job` only prints the config: without the check these would exit 0."""
    for args in (["rollout.group_size=1"], ["rollout.temperature=0"], ["train.checkpoint_every=0"],
                 ["task.eval_fraction=0"], ["-m", "seed=0,1", "train.steps=1,0"]):
        out = _error(["train", "--cfg", "job", *args])
        assert len(out.strip().splitlines()) == 1 and out.startswith("gspo: error:"), out


def test_an_int8_sampler_with_onednn_products_is_refused_before_work():
    """rollout.dtype=int8's copy has int8 projections (Int8Linear), no float32 weight for oneDNN to reorder: the
    pair passed the checks and ended at the first rollout in an AttributeError traceback, after the warm start and
    the base evaluation. Refused when the config is composed, in one line naming both keys and what works."""
    with pytest.raises(ConfigError) as e:
        compose(["rollout.dtype=int8", "rollout.matmul=onednn"])
    msg = str(e.value)
    assert "rollout.matmul=onednn" in msg and "rollout.dtype=int8" in msg and "rollout.matmul=aten" in msg, msg
    assert "\n" not in msg
    out = _error(["train", "--cfg", "job", "rollout.dtype=int8", "rollout.matmul=onednn"])
    assert len(out.strip().splitlines()) == 1 and out.startswith("gspo: error: rollout.matmul=onednn"), out
    compose(["rollout.dtype=int8"]), compose(["rollout.matmul=onednn"])  # each alone is fine


def test_temperature_zero_says_why():
    with pytest.raises(ConfigError, match="greedy"):
        check(compose(["rollout.temperature=0"]))


def test_the_edges_of_what_is_allowed_compose():
    compose(["rollout.group_size=2", "rollout.top_p=1", "rollout.temperature=0.05", "train.minibatches=64",  # 32 x 2
             "train.lr=0", "eval.every=0", "task.eval_fraction=0.5", "algo.eps_low=0", "hardware.threads=0",
             "algo.overlong_buffer=5", "rollout.max_new_tokens=5", "model.top_k=8", "algo.clip_ratio_c=3"])


def test_eval_temperature_is_gone_and_says_where_it_went():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        check(compose(["eval.temperature=0.7"]))


def test_an_old_run_config_with_eval_temperature_still_loads(tmp_path, capsys):
    import yaml

    from gspo.config.loading import load_run_config

    saved = yaml.safe_load(OmegaConf.to_yaml(compose([]), resolve=True))
    saved["eval"]["temperature"] = 0.7  # written by gspo before eval.temperature was removed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = load_run_config(tmp_path, ["task.eval_size=50"])
    assert "temperature" not in cfg.eval and cfg.task.eval_size == 50 and cfg.rollout.temperature == 1.0
    assert "eval.temperature=0.7" in capsys.readouterr().err  # a differing old value is not dropped silently


def test_an_old_run_config_without_a_key_whose_default_changed_loads_as_it_ran(tmp_path):
    """train.shared_prefix is on by default now; a config.yaml written before the key existed ran the plain forward,
    so it resumes (and a sweep's rerun checks it) with the key false; one that names the key keeps its value; a
    resume may still not change it."""
    import yaml

    from gspo.config.loading import CHANGED_DEFAULTS, load_run_config
    from gspo.train.run.resume import other_experiment

    assert compose([]).train.shared_prefix is True and CHANGED_DEFAULTS == {"train.shared_prefix": False}
    saved = yaml.safe_load(OmegaConf.to_yaml(compose([]), resolve=True))
    del saved["train"]["shared_prefix"]  # written by gspo before the key
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    old = load_run_config(tmp_path)
    assert old.train.shared_prefix is False
    assert set(other_experiment(old, compose([]))) == {"train.shared_prefix"}  # the default now is another run
    assert load_run_config(tmp_path, ["train.shared_prefix=false"]).train.shared_prefix is False
    saved["train"]["shared_prefix"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert load_run_config(tmp_path).train.shared_prefix is True


def test_a_saved_run_config_refuses_unknown_keys(tmp_path):
    from gspo.config.loading import load_run_config

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(compose([]), resolve=True))
    with pytest.raises(ConfigError, match="train.stepz"):
        load_run_config(tmp_path, ["train.stepz=3"])
    with pytest.raises(ConfigError, match="rollout.top_p=0"):
        load_run_config(tmp_path, ["rollout.top_p=0"])


def test_cuda_is_checked_against_the_machine(monkeypatch):
    import torch

    from gspo.config.checks import check_machine

    cfg = compose(["hardware=gpu"])  # composing for another machine is fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="hardware.device=cuda"):
        check_machine(cfg)
    check_machine(compose(["hardware=cpu"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_machine(cfg)


# --------------------------------------------------------------------------- paths and targets


def hf_dir(tmp_path, *files):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    for f in files:
        (d / f).write_text("{}")
    return d


@pytest.mark.parametrize("files,needle", [
    ((), "no config.json"),
    (("config.json",), "no tokenizer there"),
    (("config.json", "tokenizer.json"), "no *.safetensors weights"),
])
def test_a_model_dir_needs_a_config_a_tokenizer_and_safetensors_weights(tmp_path, monkeypatch, files, needle):
    monkeypatch.chdir(tmp_path)
    d = hf_dir(tmp_path, *files)
    out = _error(["train", "model=hf", f"model.path={d}"])
    assert out.count("\n") == 1 and f"model.path={d}" in out and needle in out, out
    assert not (tmp_path / "outputs").exists()


def test_eval_and_compare_targets_are_checked(tmp_path):
    d = hf_dir(tmp_path, "config.json")  # a checkpoint without its tokenizer
    out = _error(["eval", str(d)])
    assert "no tokenizer there" in out and out.count("\n") == 1
    assert "neither a run directory" in _error(["eval", str(tmp_path / "nothing")])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("algo:\n  name: grpo\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    assert "--threshold 2.0: must be in [0, 1]" in _error(["compare", str(run), "--threshold", "2"])
    (tmp_path / "file").write_text("x")
    assert "--out" in _error(["compare", str(run), "--out", str(tmp_path / "file")])
    assert "does not exist" in _error(["compare", str(tmp_path / "nothing")])


def test_a_resume_target_with_an_unreadable_config_is_one_line(tmp_path):
    (tmp_path / "config.yaml").write_text("algo: [unclosed\n")
    out = _error(["train", f"resume={tmp_path}"])
    assert out.count("\n") == 1 and "config.yaml: unreadable" in out, out
    (tmp_path / "config.yaml").write_text("- a list\n")
    assert "not a gspo config" in _error(["train", f"resume={tmp_path}"])


# --------------------------------------------------------------------------- one place per key


def test_every_rule_names_a_key_of_the_schema():
    """CHOICES, RULES and USED_ONLY_WHEN (with the loss registry's part) speak of the schema's keys only: a key
    renamed in the schema cannot leave a rule behind that checks nothing."""
    from gspo.config.checks import CHOICES, RULES
    from gspo.config.schema import leaf_keys
    from gspo.train.preflight import used_only_when

    keys = leaf_keys()
    for rule in (*CHOICES, *RULES, *used_only_when()):
        prefix = rule.endswith((".", "_"))  # a rule for every key it starts
        assert (rule in keys) if not prefix else any(k.startswith(rule) for k in keys), rule


def test_the_loss_keyword_defaults_are_the_schemas():
    from gspo.algos.losses import ALGO_KEYS, Hyper
    from gspo.config.schema import AlgoConfig

    assert len(ALGO_KEYS) > 20
    assert {k: getattr(Hyper(), k) for k in ALGO_KEYS} == {k: getattr(AlgoConfig(), k) for k in ALGO_KEYS}


@pytest.mark.parametrize("key,value", [("eps_low", -0.1), ("clip_ratio_c", 0.5), ("tau_neg", 0.0), ("beta", -0.01),
                                       ("kl_estimator", "k4"), ("agg", "sum"), ("dro_beta", 0.0)])
def test_policy_loss_and_the_config_refuse_a_value_in_the_same_words(key, value):
    """One rule per key, run on a config and on `policy_loss`'s keywords alike."""
    import torch

    from gspo.algos.losses import policy_loss

    with pytest.raises(ConfigError) as from_config:
        compose([f"algo.{key}={value}"])
    x = torch.zeros(2, 3)
    with pytest.raises(ConfigError) as from_loss:
        policy_loss("grpo", x, x, torch.zeros(2), torch.ones(2, 3), max_tokens=3, **{key: value})
    assert str(from_loss.value) == str(from_config.value)


def test_what_a_loss_reads_is_asked_of_its_registry_entry(monkeypatch):
    """A new loss that reads the sampler's top-k and a setting of its own needs no name test anywhere: the checks
    ask its LossSpec for the top-k, and `gspo train` says a setting of it is ignored under another loss."""
    from gspo.algos import losses
    from gspo.config.checks import ignored_override
    from gspo.train.preflight import used_only_when

    monkeypatch.setitem(losses.LOSSES, "topk_too", losses.LossSpec(losses.LOSSES["dppo_topk"].fn, "token_mean",
                                                                   False, False, ("topk_divergence", "tau_pos"),
                                                                   topk=True))
    with pytest.raises(ConfigError, match=r"algo.loss=topk_too needs the sampler's top-k .* rollout.keep_topk=K"):
        check(compose(["algo.loss=topk_too"]))
    check(compose(["algo.loss=topk_too", "rollout.keep_topk=2"]))
    assert "only the dppo_topk, topk_too loss" in ignored_override([compose([])], "algo.topk_divergence=kl",
                                                                   used_only_when())
    assert "sapo, topk_too" in ignored_override([compose([])], "algo.tau_pos=2", used_only_when())
    assert ignored_override([compose(["algo.loss=topk_too"])], "algo.tau_pos=2", used_only_when()) is None
    with pytest.raises(ConfigError, match="algo.loss=dppo_topk needs the sampler's top-k"):
        check(compose(["algo=dppo_topk", "rollout.keep_topk=0"]))


def test_a_resume_target_is_checked_by_one_function_in_the_same_words(tmp_path):
    from gspo.config.loading import load_run_config

    with pytest.raises(ConfigError, match=f"^resume={tmp_path}: not a gspo run directory"):
        compose([f"resume={tmp_path}"])
    with pytest.raises(ConfigError, match=f"^{tmp_path}: not a gspo run directory"):
        load_run_config(tmp_path)
    assert "resume=" + str(tmp_path) + ": not a gspo run directory" in _error(["train", f"resume={tmp_path}"])

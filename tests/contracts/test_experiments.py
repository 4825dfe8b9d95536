"""Experiment presets (conf/experiment/*.yaml) and presets that must fit the task's lengths."""

import random
import statistics

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from gspo.algos.shaping import overlong_penalty
from gspo.config.loading import compose
from gspo.config.schema import group_options
from gspo.tasks import build_task
from tests.conftest import REPO, needs_real_model

runner = CliRunner()


def test_experiments_compose_and_differ_only_in_the_model():
    assert {"moe_long", "dense_long"} <= set(group_options("experiment"))
    moe, dense = compose(["+experiment=moe_long"]), compose(["+experiment=dense_long"])
    assert moe.model.arch == "qwen3_moe" and dense.model.arch == "qwen3"
    # the dense control's MLP is as wide as the MoE's active experts: similar active parameters per token
    assert dense.model.intermediate_size == moe.model.top_k * moe.model.moe_intermediate_size
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert dense.model[key] == moe.model[key], key
    for group in ("task", "rollout", "train", "eval", "reward"):
        assert dense[group] == moe[group], group
    assert dense.model.warm_start == moe.model.warm_start
    # command-line keys still win over the preset
    assert compose(["+experiment=moe_long", "algo=grpo", "train.steps=7"]).train.steps == 7


@pytest.mark.parametrize("arm", ["algo=grpo", "algo=gspo", "algo=dapo", "+cell=gspo_wide", "+cell=gspo_wide30"])
@needs_real_model
def test_the_matched_real_model_study_differs_from_smollm2_math_only_in_what_the_presets_add(arm):
    """smollm2_matched: every arm on smollm2_math's setting, with no KL penalty, no dynamic sampling and no
    overlong shaping; each keeps its objective (loss, clip range, aggregation)."""
    matched, preset = compose(["+experiment=smollm2_matched", arm]), compose(["+experiment=smollm2_math", arm])
    for group in ("model", "task", "reward", "rollout", "train", "eval"):
        assert matched[group] == preset[group], group
    assert (matched.algo.beta, matched.algo.dynamic_sampling, matched.algo.overlong_buffer) == (0.0, False, 0)
    for key in ("loss", "agg", "advantage", "eps_low", "eps_high"):
        assert matched.algo[key] == preset.algo[key], key


@pytest.mark.parametrize("cell,tis", [("grpo_bf16", "none"), ("grpo_bf16_tis", "sequence")])
@needs_real_model
def test_the_bf16_cells_are_the_matched_grpo_cell_with_a_bf16_sampler(cell, tis):
    """The real model's lower-precision arms: the matched study's GRPO cell (their float32 control) with only the
    sampler's precision changed, and the sequence-level correction in one; the old policy recomputed in float32."""
    from gspo.rollout.decoding.sampler import old_logprobs_mode

    bf16 = compose(["+experiment=smollm2_matched", f"+cell={cell}"])
    f32 = compose(["+experiment=smollm2_matched", "+cell=grpo"])
    for group in ("model", "task", "reward", "train", "eval", "algo", "moe", "hardware"):
        assert bf16[group] == f32[group], group
    assert {k for k in f32.rollout if bf16.rollout[k] != f32.rollout[k]} == {"dtype", *(["tis"] if tis != "none" else [])}
    assert (bf16.rollout.dtype, bf16.rollout.tis, old_logprobs_mode(bf16)) == ("bfloat16", tis, "recompute")


def test_moe_mismatch_is_the_wide_moe_sampled_in_bf16_and_trained_in_float32():
    from gspo.rollout.decoding.sampler import old_logprobs_mode

    cfg, long = compose(["+experiment=moe_mismatch"]), compose(["+experiment=moe_long"])
    m = cfg.model
    assert m.name == "qwen3-moe-wide" and 4 <= m.num_layers <= 8 and 32 <= m.num_experts <= 64 and 4 <= m.top_k <= 8
    assert m.top_k * m.moe_intermediate_size == long.model.top_k * long.model.moe_intermediate_size  # same active width
    assert cfg.rollout.dtype == "bfloat16" and cfg.hardware.dtype == "float32" and old_logprobs_mode(cfg) == "recompute"
    for group in ("task", "train", "eval", "reward"):
        assert cfg[group] == long[group], group
    assert compose(["+experiment=moe_mismatch", "rollout.dtype=float16"]).rollout.dtype == "float16"


def test_engine_mismatch_is_moe_mismatch_sampled_by_the_bf16_engine():
    cfg, copy = compose(["+experiment=engine_mismatch"]), compose(["+experiment=moe_mismatch"])
    assert cfg.rollout.engine == "vllm" and cfg.rollout.dtype == "bfloat16" and cfg.hardware.dtype == "float32"
    for group in ("model", "task", "train", "eval", "reward", "algo"):
        assert cfg[group] == copy[group], group
    assert {k: v for k, v in cfg.rollout.items() if k != "engine"} == {k: v for k, v in copy.rollout.items() if k != "engine"}


def test_a_sampler_copy_under_fsdp_is_refused_in_one_line():
    out = _error(["train", "hardware=cpu-ddp", "hardware.strategy=fsdp", "rollout.dtype=bfloat16"])
    assert "rollout.dtype=bfloat16" in out and "fsdp" in out


@pytest.mark.parametrize("experiment", ["moe_long", "dense_long"])
def test_experiment_completions_are_long_and_fit_the_cap(experiment):
    cfg = compose([f"+experiment={experiment}"])
    task = build_task(cfg.task)
    lengths = [len(p.answer) + 1 for p in task.sample_train(random.Random(0), 2000) + task.eval_set(200)]
    assert statistics.median(lengths) >= 32  # one token per character, + EOS
    assert max(lengths) <= cfg.rollout.max_new_tokens


def _error(args):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    return res.output


def test_unknown_experiment_is_one_line_listing_the_presets():
    out = _error(["train", "+experiment=moe_lonf"])
    assert "+experiment=moe_lonf" in out and "moe_long" in out and "dense_long" in out
    out = _error(["train", "experiment=moe_long"])  # without the +: say how
    assert "+experiment=moe_long" in out


@pytest.mark.parametrize("overrides", [[], ["+experiment=moe_long"], ["+experiment=dense_long"]])
def test_dapo_never_penalises_a_correct_answer_for_length(overrides):
    # a correct answer, at most as long as the longest reference (+ EOS), gets no overlong penalty
    cfg = compose(["algo=dapo", *overrides])
    task = build_task(cfg.task)
    longest = max(len(p.answer) + 1 for p in task.sample_train(random.Random(0), 5000))
    if cfg.task.name == "addition":
        assert longest == cfg.task.digits + 2  # 99+99 = 198: 3 digits and EOS
    pen = overlong_penalty(torch.tensor([longest]), cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer,
                           cfg.algo.overlong_penalty)
    assert pen.tolist() == [0.0]
    assert cfg.algo.overlong_buffer >= 1  # and the punishment is on


def test_help_lists_the_experiments():
    res = runner.invoke(app, ["train", "--help"])
    assert res.exit_code == 0 and "+experiment=" in res.output and "moe_long" in res.output


@pytest.mark.parametrize("arm", ["+cell=grpo", "+cell=grpo_seq_tis", "+cell=grpo_R2", "+cell=grpo_R3",
                                 "+cell=gspo_wide30", "+cell=gspo_wide100", "+cell=gspo_wide300"])
@needs_real_model
def test_the_moe_mismatch_study_is_the_moe_study_with_a_bf16_sampler(arm):
    """+experiment=smollm2_moe_mismatch: the MoE study's arm with only the sampler's precision changed (bf16, the
    old policy recomputed in float32), so R2 and R3 replay different routing; the arms differ only in the objective,
    the correction or the replay."""
    from gspo.rollout.decoding.sampler import old_logprobs_mode

    bf16, f32 = compose(["+experiment=smollm2_moe_mismatch", arm]), compose(["+experiment=smollm2_moe_matched", arm])
    for group in ("model", "task", "reward", "train", "eval", "algo", "moe", "hardware"):
        assert bf16[group] == f32[group], group
    assert {k for k in f32.rollout if bf16.rollout[k] != f32.rollout[k]} == {"dtype"}
    assert bf16.rollout.dtype == "bfloat16" and old_logprobs_mode(bf16) == "recompute"


@needs_real_model
def test_the_moe_mismatch_arms_differ_only_in_what_they_compare():
    """Each arm against GRPO: the loss and clip (GSPO), the correction (TIS) or the replay (R2, R3), nothing else."""
    from gspo.train.run.resume import changes

    grpo = compose(["+experiment=smollm2_moe_mismatch", "+cell=grpo"])
    differs = {arm: {k for k in changes(grpo, compose(["+experiment=smollm2_moe_mismatch", f"+cell={arm}"]))
                     if k != "name"}
               for arm in ("grpo_seq_tis", "grpo_R2", "grpo_R3", "gspo_wide100")}
    assert differs["grpo_seq_tis"] == {"rollout.tis"}
    assert differs["grpo_R2"] == differs["grpo_R3"] == {"moe.routing_replay"}
    assert differs["gspo_wide100"] <= {f"algo.{k}" for k in grpo.algo}
    assert {"algo.loss", "algo.eps_low", "algo.eps_high"} <= differs["gspo_wide100"]


# The study data kept in docs/data and the preset its runs were made with. Each keeps running as its kept runs ran:
# train.shared_prefix (on by default since) as they ran it. Not here: runs of the default config (readme_sweep,
# gpu_h200/job: the default task shares no prefix, tests/models/test_packing.py), and smollm2_moe/learns, one run made
# before train.shared_prefix existed, which smollm2_moe_math then switched on for its studies.
KEPT_STUDIES = {
    "smollm2_study": "smollm2_math", "gpu_h200/real_float32": "smollm2_math", "gpu_h200/real_bfloat16": "smollm2_math",
    "smollm2_matched": "smollm2_matched", "smollm2_moe/study": "smollm2_moe_matched",
    "smollm2_moe/study_first_split": "smollm2_moe_matched", "smollm2_moe/edge": "smollm2_moe_matched",
    "smollm2_moe/mismatch": "smollm2_moe_mismatch",
}
# the presets whose studies' runs are not kept in docs/data, and the forward those studies ran: pinned alike
OTHER_STUDIES = {"moe_long": False, "dense_long": False, "moe_mismatch": False, "engine_mismatch": False,
                 "staleness": False, "tools": False, "smollm2_moe_math": True}


@needs_real_model
def test_every_preset_runs_the_forward_its_kept_study_ran():
    """A new seed of a kept study composes train.shared_prefix as its kept runs recorded it (a config.yaml without
    the key ran before it existed: plain); every study preset names it, so the default moving moves none."""

    from omegaconf import OmegaConf

    from gspo.config.loading import CHANGED_DEFAULTS

    data = REPO / "docs" / "data"
    for where, preset in KEPT_STUDIES.items():
        configs = sorted((data / where).rglob("config.yaml"))
        assert configs, where
        want = compose([f"+experiment={preset}"]).train.shared_prefix
        for path in configs:
            ran = OmegaConf.select(OmegaConf.load(path), "train.shared_prefix",
                                   default=CHANGED_DEFAULTS["train.shared_prefix"])
            assert ran == want, f"{path}: ran train.shared_prefix={ran}, +experiment={preset} gives {want}"
    for preset, ran in OTHER_STUDIES.items():
        assert compose([f"+experiment={preset}"]).train.shared_prefix is ran, preset
    assert set(KEPT_STUDIES.values()) | set(OTHER_STUDIES) == set(group_options("experiment"))

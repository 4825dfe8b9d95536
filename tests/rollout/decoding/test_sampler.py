"""A sampler that is not the trainer (`rollout.dtype`, gspo/rollout/decoding/sampler.py): the copy, its sync, LoRA
merging, where the old log-probs come from, top-p, and on a MoE which routing R2 and R3 replay."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gspo.algos.mismatch import mismatch_metrics, routing_mismatch
from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.models import adapters
from gspo.models.build import build_model, char_tokenizer
from gspo.rollout.decoding.generate import generate, token_logprobs
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.sampler import Sampler, _Copy, old_logprobs_mode, separate
from gspo.train.loop.moe_step import MoEStep
from gspo.train.loop.trainer import train
from gspo.train.preflight import check
from tests.conftest import REPO, tiny

TOK = char_tokenizer("0123456789+=")
PROMPTS = ["12+34=", "7+8=", "90+1=", "5+55="]


def model_of(cfg):
    return build_model(cfg.model, len(TOK), TOK, seed=0).eval()


def gens(n: int = len(PROMPTS)):
    return [torch.Generator().manual_seed(i) for i in range(n)]


def test_the_sampler_and_the_old_logprobs_follow_the_dtypes():
    cases = {  # overrides -> (separate sampler, old log-probs under auto)
        (): (False, "sampler"),  # today's default: the float32 trainer samples, its own log-probs serve
        ("rollout.dtype=float32",): (False, "sampler"),
        ("rollout.dtype=bfloat16",): (True, "recompute"),
        ("rollout.dtype=float16",): (True, "recompute"),
        ("hardware.dtype=bfloat16",): (False, "recompute"),
        ("rollout.dtype=bfloat16", "rollout.old_logprobs=sampler"): (True, "sampler"),  # seed 003's regime
        # LoRA's merged copy in the trainer's float32: the trainer's function to rounding, its log-probs serve
        ("model.lora.r=4", "model.lora.sample_merged=true"): (True, "sampler"),
        ("model.lora.r=4", "model.lora.sample_merged=true", "rollout.dtype=bfloat16"): (True, "recompute"),
        ("model.lora.r=4",): (False, "sampler"),
    }
    for overrides, (sep, mode) in cases.items():
        cfg = compose(list(overrides))
        assert (separate(cfg), old_logprobs_mode(cfg)) == (sep, mode), overrides


def test_bad_combinations_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="rollout.dtype"):
        check(compose(["rollout.dtype=bf16"]))
    with pytest.raises(ConfigError, match="rollout.dtype=float32.*fsdp"):
        check(compose(["hardware=gpu-fsdp", "rollout.dtype=float32"]))
    with pytest.raises(ConfigError, match="model.lora.sample_merged=true needs adapters"):
        check(compose(["model.lora.sample_merged=true"]))
    with pytest.raises(ConfigError, match="model.lora.sample_merged=true: a merged sampling copy.*fsdp"):
        check(compose(["hardware=gpu-fsdp", "model.lora.r=4", "model.lora.sample_merged=true"]))
    with pytest.raises(ConfigError, match="rollout.mask=token.*recompute"):
        check(compose(["rollout.mask=token"]))  # float32 sampler = trainer: there is nothing to mask
    check(compose(["rollout.mask=token", "rollout.tis=token", "rollout.dtype=bfloat16"]))  # auto recomputes: allowed
    with pytest.raises(ConfigError, match="rollout.mask_low"):
        check(compose(["rollout.mask=geometric", "rollout.dtype=bfloat16", "rollout.mask_low=1.1", "rollout.mask_high=1.0"]))


def test_the_copy_is_cast_and_synced_from_the_trainer():
    cfg = compose(["model=qwen3-tiny", "rollout.dtype=bfloat16"])
    model = model_of(cfg)
    sampler = Sampler.for_run(model, cfg)
    copy = sampler.module
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trainer keeps its precision
    assert not any(p.requires_grad for p in copy.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # an update
    name, trained = next(iter(model.named_parameters()))
    stale = dict(copy.named_parameters())[name]
    assert not torch.equal(stale, trained.to(torch.bfloat16))
    metrics = sampler.sync(model)
    assert set(metrics) == {"time/weight_sync_s"} and metrics["time/weight_sync_s"] >= 0
    for n, p in model.named_parameters():
        assert torch.equal(dict(copy.named_parameters())[n], p.to(torch.bfloat16)), n
    with sampler.serve(model, dist=None) as m:
        assert m is copy
    plain = Sampler.for_run(model, compose(["model=qwen3-tiny"]))
    assert plain.sync(model) == {}
    with plain.serve(model, dist=None) as m:
        assert m is model


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe"])  # the MoE: adapters on the fused 3-D expert weights too
def test_a_lora_copy_carries_the_merged_adapters(model):
    cfg = compose([f"model={model}", "model.lora.r=4"])
    model = adapters.apply(model_of(cfg), cfg.model.lora, "/tmp/base", seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)  # lora_B starts at 0: make the adapters matter
    copy = _Copy(model, torch.float32)  # the precision aside, exactly what the sampler serves
    assert not adapters.is_adapted(copy.module)
    x = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(copy.module(input_ids=x).logits, model(input_ids=x).logits, rtol=1e-5, atol=1e-5)
    base = model.get_base_model()
    with model.disable_adapter():
        assert (copy.module(input_ids=x).logits - base(input_ids=x).logits).abs().max() > 1e-3  # adapters in
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.0)
    copy.sync(model)
    torch.testing.assert_close(copy.module(input_ids=x).logits, model(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_a_lora_copy_under_gradient_checkpointing_can_use_the_fast_engine():
    """peft's input-grad hook on the embeddings (gradient checkpointing) is training-only: the merged sampler
    copy does not carry it, so the fast engine takes it (before: it refused the hook and fell back quietly)."""
    from gspo.rollout.decoding import fast_decode

    cfg = compose(["model=qwen3-tiny", "model.lora.r=4"])
    base = model_of(cfg)
    base.gradient_checkpointing_enable()
    model = adapters.apply(base, cfg.model.lora, "/tmp/base", seed=0)
    assert model.get_input_embeddings()._forward_hooks  # peft's hook is on the trainer's model
    copy = _Copy(model, torch.bfloat16)
    assert fast_decode.unsupported(copy.module) is None
    assert model.get_input_embeddings()._forward_hooks  # and stays there


def test_a_lora_runs_merged_float32_copy_samples_what_the_adapters_sample(tmp_path, cache_dir):
    """model.lora.sample_merged: the merged copy in float32 draws the tokens the LoRA policy draws from the same
    uniforms, log-probs within 1e-5 (why `rollout.old_logprobs=auto` takes them), and a run with it records a
    mismatch of that size."""
    cfg = compose(["model=qwen3-tiny", "model.lora.r=4", "model.lora.sample_merged=true"])
    model = adapters.apply(model_of(cfg), cfg.model.lora, "/tmp/base", seed=0).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    sampler = Sampler.for_run(model, cfg)
    assert not adapters.is_adapted(sampler.module)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, engine="fast")
    with sampler.serve(model, dist=None) as copy:
        merged = generate(copy, TOK, PROMPTS, 4, params, generator=gens())
    adapted = generate(model, TOK, PROMPTS, 4, params, generator=gens())
    assert torch.equal(merged.input_ids, adapted.input_ids)
    torch.testing.assert_close(merged.sampler_logp, adapted.sampler_logp, rtol=0, atol=1e-5)

    opts = tiny(cache_dir, **{"model": "qwen3-tiny", "model.lora.r": 4, "model.lora.sample_merged": True,
                              "train.steps": 2, "rollout.mismatch_every": 1})
    assert train(compose(opts), tmp_path)["status"] == "finished"
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["time/weight_sync_s"] >= 0 and r["rollout/logprob_abs_diff_max"] < 1e-4 for r in steps)


def test_top_p_ratios_carry_no_kept_mass_bias():
    """top_p < 1 in float32: the sampler's log-probs are the trainer's (rho = 1), though the nucleus kept
    only part of the mass (a renormalised log-prob would give rho = kept mass, TRL #6789)."""
    cfg = compose(["model=qwen3-tiny"])
    model = model_of(cfg)
    r = generate(model, TOK, PROMPTS, 4, SamplingParams(6, top_p=0.5), generator=gens())
    m = mismatch_metrics(token_logprobs(model, r)[0], r.sampler_logp, r.completion_mask, r.kept_mass)
    assert m["rollout/ratio_min"] == pytest.approx(1.0, abs=1e-4) and m["rollout/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert 0.4 < m["rollout/top_p_kept_mass"] < 0.95
    assert generate(model, TOK, PROMPTS, 4, SamplingParams(6),
                    generator=gens()).kept_mass is None  # top_p 1: nothing cut


def _moe_setup(replay: str):
    cfg = compose(["model=qwen3-moe-wide", "rollout.dtype=bfloat16", f"moe.routing_replay={replay}",
                   "model.router_aux_loss_coef=0", "rollout.group_size=4", "moe.stats_rows_per_group=0"])
    model = model_of(cfg)
    sampler = Sampler.for_run(model, cfg)
    step = MoEStep.for_model(model, cfg, dist=None, old_pass=True)
    assert step.sample_kwargs() == {"capture_routing": True}
    with sampler.serve(model, None) as m:
        ro = generate(m, TOK, PROMPTS, 4, SamplingParams(12, **step.sample_kwargs()), generator=gens())
    with step.old_pass(model, ro):
        token_logprobs(model, ro)
    return cfg, model, step, ro


def test_r2_and_r3_replay_different_routings_under_a_bf16_sampler():
    """R3 replays the bf16 sampler's routing, R2 the float32 trainer's recomputed pass's: they differ."""
    used, trainer_routing = {}, None
    rows = torch.arange(len(PROMPTS) * 4)
    for replay in ("R2", "R3"):
        cfg, model, step, ro = _moe_setup(replay)
        positions = step.completion_positions()
        with step.minibatch(model, ro, rows) as mb:
            token_logprobs(model, ro)
            used[replay] = mb.trace.indices(len(rows))
        if replay == "R2":
            trainer_routing = step.old_idx
            stats = step.end_step(model, ro, 1)
            assert stats["rollout/routing_mismatch"] > 0
        at = positions.bool()
        sampler_sets, used_sets = ro.routing[at].sort(-1).values, used[replay][at].sort(-1).values
        if replay == "R3":  # every completion position routed as the sampler did
            assert torch.equal(used_sets, sampler_sets)
    # R2 used the trainer's own routing, which differs from the sampler's on some (token, layer)
    assert routing_mismatch(ro.routing, trainer_routing, positions) > 0
    assert routing_mismatch(used["R2"], trainer_routing, positions) == 0.0
    assert routing_mismatch(used["R2"], used["R3"], positions) > 0


def test_a_bf16_sampler_run_on_a_moe_shows_the_mismatch(tmp_path, cache_dir):
    """End to end: `rollout.dtype=bfloat16` on the wide MoE logs the weight sync, a nonzero log-prob and
    routing mismatch; the first update's ratio to the recomputed old policy is 1 (no correction needed there)."""
    opts = tiny(cache_dir, **{"model": "qwen3-moe-wide", "rollout.dtype": "bfloat16", "rollout.tis": "token",
                              "rollout.mask": "token", "train.minibatches": 1})
    summary = train(compose(opts), tmp_path)
    assert summary["status"] == "finished"
    lines = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    for m in lines[1:]:
        assert m["time/weight_sync_s"] >= 0
        assert m["rollout/mismatch_kl"] > 0 and m["rollout/logprob_abs_diff_mean"] > 0
        assert m["rollout/routing_mismatch"] > 0
        assert m["rollout/ratio_min"] < 1 < m["rollout/ratio_max"]
        assert 0 <= m["rollout/mask_token_frac"] < 1 and m["rollout/tis_weight_mean"] > 0
        assert m["policy/ratio_min"] == pytest.approx(1.0, abs=1e-5)  # one minibatch: the old policy's own pass
    assert OmegaConf.load(tmp_path / "config.yaml").rollout.dtype == "bfloat16"


def test_a_lora_run_samples_with_a_merged_bf16_copy(tmp_path, cache_dir):
    opts = tiny(cache_dir, **{"model": "qwen3-tiny", "model.lora.r": 4, "rollout.dtype": "bfloat16", "train.steps": 1})
    assert train(compose(opts), tmp_path)["status"] == "finished"
    [step] = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert step["time/weight_sync_s"] >= 0 and step["rollout/logprob_abs_diff_mean"] > 0


SCRIPTS = REPO / "scripts"
WIDE = {"model": "qwen3-moe-wide"}


def test_the_probe_sees_the_mismatch_of_a_bf16_sampler_and_not_of_the_trainer_itself(cache_dir):
    """scripts/probe_mismatch.py (docs/results/bf16-mismatch.md's table) on the tiny wide MoE: one rollout batch."""
    sys.path.insert(0, str(SCRIPTS))
    import probe_mismatch

    bf16 = probe_mismatch.probe(compose(tiny(cache_dir, **WIDE, **{"rollout.dtype": "bfloat16"})), batches=1)
    cfg = compose(tiny(cache_dir, **WIDE))
    same = probe_mismatch.probe(cfg, batches=1)
    assert (bf16["sampler"], same["sampler"]) == ("bfloat16", "float32")
    assert bf16["rollout/routing_mismatch"] > same["rollout/routing_mismatch"]
    assert bf16["rollout/logprob_abs_diff_mean"] > 100 * same["rollout/logprob_abs_diff_mean"]
    assert same["seq_outside_clip/gspo_paper"] == 0 < bf16["seq_outside_clip/gspo_paper"] <= 1
    assert bf16["sequences"] == 16 and bf16["tokens"] > 0
    # the task's verdicts: one success rate per prompt, their mean the probe's `correct`
    assert len(same["correct_by_prompt"]) * cfg.rollout.group_size == same["sequences"]
    assert sum(same["correct_by_prompt"]) / len(same["correct_by_prompt"]) == pytest.approx(same["correct"])
    assert all(0 <= c <= 1 for c in same["correct_by_prompt"]) and 0 <= same["reward"]


def test_the_probes_paired_difference_is_the_mean_per_prompt_gap_with_a_normal_95_interval():
    sys.path.insert(0, str(SCRIPTS))
    import probe_mismatch

    # per-prompt differences 0.5, 0, -0.25, 0.25: mean 0.125, squared deviations sum 0.3125, sd sqrt(0.3125 / 3)
    out = probe_mismatch.paired([0.75, 0.5, 0.0, 0.5], [0.25, 0.5, 0.25, 0.25])
    half = 1.96 * (0.3125 / 3) ** 0.5 / 2
    assert out["paired/correct_diff"] == pytest.approx(0.125) and out["paired/prompts"] == 4
    assert out["paired/ci95"] == pytest.approx([0.125 - half, 0.125 + half])
    with pytest.raises(SystemExit, match="same batches"):
        probe_mismatch.paired([0.5], [0.5, 0.5])

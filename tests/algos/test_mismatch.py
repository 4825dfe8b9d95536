"""The sampler/trainer mismatch metrics and corrections (TIS, masks), against hand-computed numbers."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from gspo.algos.losses import policy_loss
from gspo.algos.mismatch import (
    CORRECTIONS,
    MismatchBatch,
    active,
    correction_weights,
    mismatch_metrics,
    routing_mismatch,
    tis_weights,
)

# two sequences: 3 tokens and 2 tokens (+1 padding); d = trainer - sampler per token
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
SAMPLER = torch.tensor([[-1.1, -1.8, -0.5], [-1.0, -0.2, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
D = [[0.1, -0.2, 0.0], [-0.5, 0.0]]


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(TRAINER, SAMPLER, MASK)
    diffs = [0.1, 0.2, 0.0, 0.5, 0.0]
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / 5)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(0.5)
    k3 = [math.exp(d) - 1 - d for row in D for d in row]
    assert m["rollout/mismatch_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert m["rollout/seq_logratio_abs_mean"] == pytest.approx((abs(-0.1 / 3) + abs(-0.5 / 2)) / 2, rel=1e-5)
    assert m["rollout/ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-5)  # padding (d = 0) is left out
    assert m["rollout/ratio_max"] == pytest.approx(math.exp(0.1), rel=1e-5)
    assert "rollout/top_p_kept_mass" not in m
    kept = torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 0.0]])
    assert mismatch_metrics(TRAINER, SAMPLER, MASK, kept)["rollout/top_p_kept_mass"] == pytest.approx(3.5 / 5)


def test_routing_mismatch_counts_differing_topk_sets():
    # (B=1, T=3, L=2, k=2); slot order does not matter; the last token was never routed (-1) in layer 1
    sampler = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, -1]]]])
    trainer = torch.tensor([[[[1, 0], [2, 4]], [[4, 5], [6, 7]], [[1, 2], [3, 2]]]])
    mask = torch.ones(1, 3)
    # valid (token, layer): 5 of 6; differing sets: (t0, l1) {2,3} vs {2,4}, (t2, l0) {0,1} vs {1,2}
    assert routing_mismatch(sampler, trainer, mask) == pytest.approx(2 / 5)
    assert routing_mismatch(sampler, trainer, torch.tensor([[0.0, 1.0, 0.0]])) == 0.0
    assert routing_mismatch(sampler, sampler, mask) == 0.0


def _rollout_cfg(**kw):
    base = dict(tis="none", tis_cap=2.0, mask="none", mask_low=None, mask_high=None, offpolicy_mask_delta=None)
    return OmegaConf.create(base | kw)


# rho per token: [[e^0.1, e^-0.2, 1], [e^-0.5 ... ]]; wide ratios to exercise the IcePop band
TR2 = torch.tensor([[0.0, -2.0, 0.0], [-1.0, -0.2, 0.0]])
SA2 = torch.tensor([[-1.0, -0.5, 0.0], [-0.2, -0.2, 0.0]])  # log rho = [[1.0, -1.5, 0], [-0.8, 0, (pad)]]


def test_token_mask_is_icepop():
    """rho outside [0.5, 5] masked: e^1.0 = 2.72 in, e^-1.5 = 0.22 out, 1 in; e^-0.8 = 0.45 out, 1 in."""
    x = MismatchBatch(TR2, SA2, MASK, torch.tensor([1.0, -1.0]))
    w, s = CORRECTIONS["mask_token"](x, _rollout_cfg(mask="token"))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]))
    assert s == {"rollout/mask_token_frac": pytest.approx(2 / 5)}
    w, _ = CORRECTIONS["mask_token"](x, _rollout_cfg(mask="token", mask_low=0.2, mask_high=2.0))  # 2.72 now out
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))


def test_geometric_mask_drops_whole_sequences():
    # exp(mean log rho): row 0 exp((0.1 - 0.2 + 0) / 3) = 0.967, row 1 exp(-0.5 / 2) = 0.779: both outside [0.99, 1.01]
    x = MismatchBatch(TRAINER, SAMPLER, MASK, torch.tensor([1.0, -1.0]))
    w, s = CORRECTIONS["mask_geometric"](x, _rollout_cfg(mask="geometric"))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))  # padding: 1
    assert s == {"rollout/mask_geometric_frac": 1.0}
    w, s = CORRECTIONS["mask_geometric"](x, _rollout_cfg(mask="geometric", mask_low=0.9, mask_high=1.1))
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]))
    assert s == {"rollout/mask_geometric_frac": 0.5}


def test_offpolicy_mask_drops_negative_advantage_sequences_far_from_the_current_policy():
    """DeepSeek-V3.2 Eq. 9: drop where A < 0 and mean_t log(mu / pi_theta) > delta."""
    current = torch.tensor([[-1.5, -2.0, -0.5], [-1.5, -0.5, 0.0]])
    # mean log(mu/pi_theta): row 0 (0.4 + 0.2 + 0) / 3 = 0.2, row 1 (0.5 + 0.3) / 2 = 0.4
    for adv, delta, kept in (([-1.0, -1.0], 0.3, [1.0, 0.0]), ([-1.0, -1.0], 0.1, [0.0, 0.0]),
                             ([1.0, 1.0], 0.1, [1.0, 1.0]), ([1.0, -1.0], 0.5, [1.0, 1.0])):
        x = MismatchBatch(TRAINER, SAMPLER, MASK, torch.tensor(adv), current)
        w, s = CORRECTIONS["mask_offpolicy"](x, _rollout_cfg(offpolicy_mask_delta=delta))
        want = torch.tensor([[kept[0]] * 3, [kept[1], kept[1], 1.0]])
        torch.testing.assert_close(w, want)
        assert s["rollout/mask_offpolicy_frac"] == pytest.approx(kept.count(0.0) / 2)


def test_corrections_combine_by_multiplication_in_config_order():
    r = _rollout_cfg(tis="token", tis_cap=2.0, mask="token", offpolicy_mask_delta=0.3)
    assert active(r) == ["tis_token", "mask_token", "mask_offpolicy"]
    assert active(_rollout_cfg()) == [] and correction_weights([], None, r) == (None, {})
    x = MismatchBatch(TR2, SA2, MASK, torch.tensor([1.0, -1.0]), current=TR2)
    w, s = correction_weights(["tis_token", "mask_token"], x, r)
    # TIS min(rho, 2): [[2, e^-1.5, 1], [e^-0.8, 1, 1]] times the IcePop mask [[1, 0, 1], [0, 1, 1]]
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 1.0]]))
    assert set(s) == {"rollout/tis_weight_mean", "rollout/mask_token_frac"}


def test_token_tis_truncates_each_ratio():
    w = tis_weights(TRAINER, SAMPLER, MASK, "token", cap=1.05)
    expected = [[min(math.exp(0.1), 1.05), math.exp(-0.2), 1.0], [math.exp(-0.5), 1.0, 1.0]]  # padding: 1
    torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_sequence_tis_truncates_the_product():
    w = tis_weights(TRAINER, SAMPLER, MASK, "sequence", cap=2.0)
    s0, s1 = math.exp(0.1 - 0.2 + 0.0), math.exp(-0.5 + 0.0)
    torch.testing.assert_close(w, torch.tensor([[s0, s0, s0], [s1, s1, 1.0]]), rtol=1e-6, atol=1e-6)
    big = tis_weights(TRAINER + torch.tensor([[30.0, 30.0, 30.0], [0, 0, 0]]), SAMPLER, MASK, "sequence", cap=2.0)
    assert big[0].tolist() == [2.0, 2.0, 2.0]  # exp(90) would overflow float32: truncated at C


def test_a_mask_removes_the_tokens_gradient():
    """A masked token (weight 0) gets no gradient; the others keep theirs (GRPO, ratio 1)."""
    logp = TR2.clone().requires_grad_(True)
    x = MismatchBatch(TR2, SA2, MASK, torch.tensor([1.0, -1.0]))
    w, _ = CORRECTIONS["mask_token"](x, _rollout_cfg(mask="token"))
    loss, _ = policy_loss("grpo", logp, logp.detach(), x.advantages, MASK, is_weight=w)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 6, 0.0, -1 / 6], [0.0, 1 / 4, 0.0]]))


def test_tis_weights_multiply_the_policy_term():
    """With ratio 1 (logp = old), GRPO's per-token objective is A; TIS makes it w_t A, mean per sequence."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    w = torch.tensor([[0.5, 1.0, 2.0], [1.5, 1.0, 7.0]])  # the last entry sits on padding: ignored
    loss, _ = policy_loss("grpo", logp, logp.detach(), adv, MASK, is_weight=w)
    want = -((0.5 + 1.0 + 2.0) / 3 * 1.0 + (1.5 + 1.0) / 2 * -2.0) / 2
    assert loss.item() == pytest.approx(want)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -w A exp(logp - old) / |y| / B at ratio 1: -w A / |y| / B
    torch.testing.assert_close(grad, torch.tensor([[-0.5 / 6, -1 / 6, -2 / 6], [1.5 / 2, 1 / 2, 0.0]]))


def test_arealss_decoupled_ppo_is_token_tis_times_a_token_mask():
    """AReaL's decoupled objective (arXiv 2505.24298, Eq. 5): J = (pi_prox / pi_behav) min(r A, clip(r) A), r =
    pi_theta / pi_prox, the behaviour weight dropped (0) above behav_imp_weight_cap. With the proximal policy
    the trainer's recomputed one (what staleness > 0 uses), it is rollout.tis=token rollout.tis_cap=C
    rollout.mask=token rollout.mask_low=0 rollout.mask_high=C: weight rho 1[rho <= C]."""
    cap = 5.0
    r = OmegaConf.create({"tis": "token", "tis_cap": cap, "mask": "token", "mask_low": 0.0, "mask_high": cap,
                          "offpolicy_mask_delta": None})
    prox = torch.tensor([[-1.0, -0.5, 0.2], [-2.0, -1.0, 0.0]])  # log pi_prox (the recomputed old log-probs)
    behav = torch.tensor([[-1.0, -1.5, -2.0], [-1.5, -1.0, 0.0]])  # log mu: rho = e^0, e^1, e^2.2 (> 5), e^-0.5, 1
    adv = torch.tensor([1.0, -1.0])
    w, _ = correction_weights(active(r), MismatchBatch(prox, behav, MASK, adv), r)
    rho = (prox - behav).exp()
    want = torch.where(rho <= cap, rho, torch.zeros_like(rho)) * MASK + (1 - MASK)
    torch.testing.assert_close(w, want)
    assert w[0, 2] == 0 and w[0, 1] == pytest.approx(math.e)
    # in the loss: -(1/B) sum_i mean_t w_t min(r_t A, clip(r_t) A), by hand at r = 1.1 on every token
    logp = (prox + math.log(1.1)).requires_grad_()
    loss, _ = policy_loss("grpo", logp, prox, adv, MASK, is_weight=w, eps_low=0.2, eps_high=0.2)
    per = [w[0, :3].sum() / 3 * 1.1 * 1.0, w[1, :2].sum() / 2 * 1.1 * -1.0]  # r = 1.1 is inside the clip
    assert loss.item() == pytest.approx(-(per[0] + per[1]).item() / 2, rel=1e-5)


# ---------------------------------------------------------------- the peers' presets and names (issue 50)


@pytest.mark.parametrize("kind, trainer, sampler, cases", [
    # prod_t rho_t: row 0 exp(0.1 - 0.2 + 0) = 0.905, row 1 exp(-0.5) = 0.607; default [0.5, 2] keeps both, [0.7, 2]
    # drops row 1, [0, 0.9] (TRL's sequence_mask at C = 0.9) drops row 0
    ("sequence", TRAINER, SAMPLER, [(None, None, [1.0, 1.0]), (0.7, 2.0, [1.0, 0.0]), (0.0, 0.9, [0.0, 1.0])]),
    # rho: row 0 [e^1 = 2.72, e^-1.5 = 0.22, 1], row 1 [e^-0.8 = 0.45, 1]: [0.5, 5] drops both (0.22; 0.45),
    # [0.2, 5] keeps both, [0.2, 2] drops row 0 (2.72)
    ("outlier", TR2, SA2, [(None, None, [0.0, 0.0]), (0.2, 5.0, [1.0, 1.0]), (0.2, 2.0, [0.0, 1.0])]),
])
def test_sequence_and_outlier_masks_drop_whole_sequences(kind, trainer, sampler, cases):
    """mask_sequence bounds the whole ratio prod_t rho_t; mask_outlier drops a sequence with one token's rho out."""
    x = MismatchBatch(trainer, sampler, MASK, torch.tensor([1.0, -1.0]))
    for lo, hi, kept in cases:
        w, s = CORRECTIONS[f"mask_{kind}"](x, _rollout_cfg(mask=kind, mask_low=lo, mask_high=hi))
        torch.testing.assert_close(w, torch.tensor([[kept[0]] * 3, [kept[1], kept[1], 1.0]]))
        assert s == {f"rollout/mask_{kind}_frac": kept.count(0.0) / 2}


def test_nemo_rl_names_of_the_mismatch():
    """NeMo-RL's token_mult_prob_error: mean_t exp(|log mu - log pi_old|); gen_kl_error: mean_t k3 with log r =
    log pi_old - log mu, exp(log r) - 1 - log r (its calculate_kl(generation, reference=prev), k3)."""
    m = mismatch_metrics(TRAINER, SAMPLER, MASK)
    diffs = [0.1, 0.2, 0.0, 0.5, 0.0]
    assert m["rollout/token_mult_prob_error"] == pytest.approx(sum(math.exp(d) for d in diffs) / 5, rel=1e-6)
    k3 = [math.exp(d) - 1 - d for row in D for d in row]
    assert m["rollout/gen_kl_error"] == pytest.approx(sum(k3) / 5, rel=1e-5) == m["rollout/mismatch_kl"]


def trl_is_ratio(trainer, sampler, mask, mode, c_max=3.0):
    """TRL 1.16 `_generate_and_score_completions`, restated: the ratio pi_old / mu per token or per sequence (the
    masked sum of log-ratios), clamped at C_max (`*_truncate`) or set to 0 above it (`*_mask`)."""
    d = (trainer - sampler) * mask
    ratio = torch.exp(d.sum(-1, keepdim=True)) if mode.startswith("sequence") else torch.exp(d)
    ratio = ratio.clamp(max=c_max) if mode.endswith("truncate") else ratio.masked_fill(ratio > c_max, 0.0)
    return ratio.expand_as(trainer)


@pytest.mark.parametrize("mode, overrides", [
    ("token_truncate", dict(tis="token", tis_cap=3.0)),
    ("token_mask", dict(tis="token", tis_cap=3.0, mask="token", mask_low=0.0, mask_high=3.0)),
    ("sequence_truncate", dict(tis="sequence", tis_cap=3.0)),
    ("sequence_mask", dict(tis="sequence", tis_cap=3.0, mask="sequence", mask_low=0.0, mask_high=3.0)),
])
def test_trls_vllm_importance_sampling_modes_are_a_tis_and_a_mask(mode, overrides):
    """The docs/algorithms.md table: each of TRL's four vllm_importance_sampling_mode values (C = 3, its default) is
    a gspo rollout.tis with, for the *_mask ones, the mask of the same level at [0, C]: the same weights."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(6, 4, generator=g) * 3
    sampler = trainer + torch.randn(6, 4, generator=g) * 0.8
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 3, 4, 1, 4])[:, None]).float()
    r = _rollout_cfg(**overrides)
    w, _ = correction_weights(active(r), MismatchBatch(trainer, sampler, mask, torch.zeros(6)), r)
    want = trl_is_ratio(trainer, sampler, mask, mode)
    assert (want == 0).any() or mode.endswith("truncate")  # the mask does act here
    torch.testing.assert_close(w * mask, want * mask, rtol=1e-6, atol=1e-6)


def test_pg_is_is_reinforce_with_the_truncated_sequence_weight():
    """verl's bypass_pg_is loss: -sg(min(prod_t pi/pi_old, C)) A log pi, token mean. Row 0: prod = e^0.3 = 1.35,
    row 1: e^1.0 = 2.72 capped at 2."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.1, 0.2], [1.0, 0.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, stats = policy_loss("pg_is", logp, old, adv, mask, clip_ratio_c=2.0)
    w0 = math.exp(0.3)
    lp = logp.detach()
    assert loss.item() == pytest.approx(-(w0 * (lp[0, 0] + lp[0, 1]) + 2.0 * -2.0 * lp[1, 0]).item() / 3, rel=1e-12)
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, torch.tensor([[-w0 / 3, -w0 / 3], [4.0 / 3, 0.0]], dtype=torch.float64))
    assert stats["clip/frac_dual"] == pytest.approx(1 / 3)


@pytest.fixture(scope="module")
def verl_rollout_corr(verl_tree):
    """verl's core_algos and its rollout_corr_helper (1dda039: the presets' code)."""
    try:
        import verl.trainer.ppo.rollout_corr_helper as helper
    except ImportError:
        pytest.skip("the verl at VERL_SRC has no rollout_corr_helper")
    return verl_tree, helper


@pytest.mark.parametrize("preset, overrides", [
    ("decoupled_token_is", dict(tis="token", tis_cap=2.0)),
    ("decoupled_seq_is", dict(tis="sequence", tis_cap=2.0)),
    ("decoupled_seq_is_rs", dict(tis="sequence", tis_cap=2.0, mask="sequence", mask_low=0.5, mask_high=2.0)),
    ("decoupled_geo_rs", dict(mask="geometric", mask_low=0.999, mask_high=1.001)),
])
def test_verls_decoupled_presets_equal_gspos_corrections(verl_rollout_corr, preset, overrides):
    """verl's own RolloutCorrectionConfig presets through its rollout_corr_helper (compute_rollout_correction_weights,
    compute_rollout_rejection_mask): its IS weights times its rejection mask equal gspo's correction weight on every
    token (verl's k1 bounds are on the
    inverse ratio, the same set for these symmetric bounds)."""
    _, helper = verl_rollout_corr
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    c = getattr(RolloutCorrectionConfig, preset)()
    g = torch.Generator().manual_seed(1)
    trainer = -torch.rand(64, 6, generator=g) * 3
    sampler = trainer + torch.randn(64, 6, generator=g) * (0.3 if "seq" in preset else 0.002)
    mask = (torch.arange(6)[None] < torch.randint(1, 7, (64, 1), generator=g)).float()
    # the two steps of its compute_rollout_correction_and_rejection_mask (which wraps the weights in a DataProto)
    log_ratio = trainer - sampler
    theirs = mask.clone()
    if c.rollout_is is not None:
        theirs = theirs * helper.compute_rollout_correction_weights(log_ratio, mask, c.rollout_is,
                                                                    c.rollout_is_threshold)[0]
    if c.rollout_rs is not None:
        theirs = theirs * helper.compute_rollout_rejection_mask(log_ratio, mask, c.rollout_rs,
                                                                c.rollout_rs_threshold)[0]
    r = _rollout_cfg(**overrides)
    ours, _ = correction_weights(active(r), MismatchBatch(trainer, sampler, mask, torch.zeros(64)), r)
    assert 0 < float((theirs == 0).float().mean()) or "rs" not in preset  # the masks act on this batch
    torch.testing.assert_close(ours * mask, theirs, rtol=1e-5, atol=1e-6)


def test_verls_bypass_pg_is_loss_equals_pg_is(verl_rollout_corr):
    """verl's bypass_pg_is (old = the rollout's log-probs): its sequence IS weights of pi_theta / pi_rollout truncated
    at 2 (compute_rollout_correction_weights) into its compute_policy_loss_reinforce, token mean, against gspo's
    pg_is at clip_ratio_c = 2: value and gradient."""
    core, helper = verl_rollout_corr
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 5, generator=g) * 3
    logp = (old + torch.randn(8, 5, generator=g) * 0.3).requires_grad_()
    mask = (torch.arange(5)[None] < torch.randint(1, 6, (8, 1), generator=g)).float()
    adv = torch.randn(8, generator=g)
    w, _ = helper.compute_rollout_correction_weights(logp.detach() - old, mask, "sequence", 2.0)
    cfg = OmegaConf.create({"global_batch_info": {}})
    theirs, _ = core.compute_policy_loss_reinforce(old, logp, adv[:, None] * mask, mask, "token-mean", cfg, w)
    ours, _ = policy_loss("pg_is", logp, old, adv, mask, clip_ratio_c=2.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(*(torch.autograd.grad(x, logp)[0] for x in (ours, theirs)), rtol=1e-6, atol=1e-6)


def _skyrl():
    import ast
    import os
    from pathlib import Path

    src = os.environ.get("SKYRL_SRC")
    if not src:
        pytest.skip("SkyRL is not installed: set SKYRL_SRC to a checkout of github:NovaSky-AI/SkyRL (a9564572 or "
                    "later) to run its off_policy_correction functions")
    utils = Path(src) / "skyrl/backends/skyrl_train/utils"
    ns = {"torch": torch, "Optional": __import__("typing").Optional, "Tuple": tuple, "DictConfig": object}
    for file, names in (("torch_utils.py", {"safe_exp_delta", "masked_mean"}),
                        ("off_policy_correction_utils.py", {"compute_tis_ratio", "compute_outlier_token_mask",
                                                            "compute_token_mask", "compute_sequence_mask"})):
        tree = ast.parse((utils / file).read_text())
        body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert {n.name for n in body} == names
        exec(compile(ast.Module(body=body, type_ignores=[]), str(utils / file), "exec"), ns)  # noqa: S102
    return ns


@pytest.mark.parametrize("skyrl, overrides", [
    (dict(tis_ratio_type="token", token_tis_ratio_clip_high=2.0), dict(tis="token", tis_cap=2.0)),
    (dict(tis_ratio_type="sequence", sequence_tis_ratio_clip_high=5.0), dict(tis="sequence", tis_cap=5.0)),
    (dict(sequence_mask_metric="geometric", geo_mask_low=0.99, geo_mask_high=1.01), dict(mask="geometric")),
    (dict(sequence_mask_metric="product", product_mask_low=0.5, product_mask_high=2.0), dict(mask="sequence")),
    (dict(outlier_token_is_threshold_low=0.5, outlier_token_is_threshold_high=5.0), dict(mask="outlier")),
    (dict(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=5.0), dict(mask="token")),
])
def test_skyrls_off_policy_correction_equals_gspos(skyrl, overrides):
    """SkyRL's own off_policy_correction functions (exec'd from its source) against the gspo correction the
    docs/algorithms.md table maps each to, at SkyRL's defaults: the same weight on every token."""
    ns = _skyrl()
    c = OmegaConf.create(skyrl)
    g = torch.Generator().manual_seed(3)
    trainer = -torch.rand(64, 6, generator=g) * 3
    sampler = trainer + torch.randn(64, 6, generator=g) * (0.01 if "geo_mask_low" in skyrl else 0.5)
    mask = (torch.arange(6)[None] < torch.randint(1, 7, (64, 1), generator=g)).float()
    if "tis_ratio_type" in skyrl:
        theirs = ns["compute_tis_ratio"](trainer, sampler, mask, skyrl["tis_ratio_type"], c)[0].expand_as(mask)
    elif "sequence_mask_metric" in skyrl:
        theirs = ns["compute_sequence_mask"](trainer, sampler, mask, skyrl["sequence_mask_metric"], c)[0]
    elif "outlier_token_is_threshold_low" in skyrl:
        theirs = ns["compute_outlier_token_mask"](trainer, sampler, mask, c)[0]
    else:
        theirs = ns["compute_token_mask"](trainer, sampler, mask, c)[0]
    r = _rollout_cfg(**overrides)
    ours, _ = correction_weights(active(r), MismatchBatch(trainer, sampler, mask, torch.zeros(64)), r)
    if "tis_ratio_type" not in skyrl:
        assert ((theirs.expand_as(mask) == 0) & (mask > 0)).any()  # the mask acts on this batch
    torch.testing.assert_close(ours * mask, theirs.expand_as(mask) * mask, rtol=1e-6, atol=1e-6)

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

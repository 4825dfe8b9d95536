"""The 2026 objectives (issue 50): LUSPO, VESPO, DRO, M2PO and GDPO, checked by hand and by float64 per-token loops.

Each loss: a hand-worked value and gradient on a batch small enough to do on paper, then the vectorised loss
against straight-line per-token formulas (never the implementation) on unequal lengths with -inf in the padding,
values AND gradients. The peers' own functions are compared in tests/contracts/test_peers_trl.py (TRL's luspo and vespo)
and below where a fetched source tree is named (VERL_SRC: verl's dro and gdpo; AREAL_SRC: AReaL's M2PO mask).
"""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import pytest
import torch

from gspo.algos.advantages import compute_advantages, gdpo
from gspo.algos.losses import LOSSES, m2_keep, policy_loss
from tests.algos.test_losses import LENGTHS, grad, make_batch

F64 = torch.float64


def _loss_and_grad(name, logp, old, adv, mask, **hyper):
    loss, stats = policy_loss(name, logp, old, adv, mask, **hyper)
    return loss, grad(loss, logp), stats


# ---------------------------------------------------------------- LUSPO


def test_luspo_is_gspo_with_each_sequence_weighted_by_its_length_by_hand():
    """Two completions of 2 and 1 tokens. GSPO: s_i = exp(mean_t d_t), J_i = min(s A, clip(s) A); the loss is
    -(1/2) sum_i J_i for GSPO and -(1/2) sum_i |y_i| J_i for LUSPO, and so is the gradient."""
    d = torch.tensor([[0.004, -0.002], [0.01, 0.0]], dtype=F64)
    old = torch.log(torch.tensor([[0.5, 0.25], [0.4, 1.0]], dtype=F64))
    logp = (old + d).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.5, -0.5], dtype=F64)
    s1, s2 = math.exp(0.001), math.exp(0.01)  # mean log-ratios: (0.004 - 0.002)/2, 0.01
    # eps 2e-3 / 2.5e-3: s1 inside the clip, s2 = 1.01 above 1 + 2.5e-3 but A < 0 takes min(s A, clip(s) A) = s A
    j1, j2 = s1 * 1.5, s2 * -0.5
    loss, g, _ = _loss_and_grad("luspo", logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3)
    assert loss.item() == pytest.approx(-(2 * j1 + 1 * j2) / 2, abs=1e-12)
    # d loss / d logp_{1,t} = -(1/2) |y_1| * A_1 * s_1 / |y_1| = -A_1 s_1 / 2 on each of row 1's tokens
    want = torch.tensor([[-1.5 * s1 / 2, -1.5 * s1 / 2], [0.5 * s2 / 2, 0.0]], dtype=F64)
    torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    gspo_loss, _ = policy_loss("gspo", logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3)
    assert gspo_loss.item() == pytest.approx(-(j1 + j2) / 2, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_luspo_matches_per_token_loops(seed):
    logp, old, mask, adv = make_batch(seed, noise=0.05)
    loss, g, _ = _loss_and_grad("luspo", logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3)
    ref = 0.0
    for i, L in enumerate(LENGTHS):
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in range(L)) / L)
        j = torch.minimum(s * adv[i], s.clamp(1 - 2e-3, 1 + 2.5e-3) * adv[i])
        ref = ref - sum(j for _ in range(L))  # summed over the sequence's tokens
    ref = ref / len(LENGTHS)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g, grad(ref, logp), rtol=0, atol=1e-12)
    # the aggregation is the loss's only difference from GSPO: gspo under seq_mean_token_sum is the same loss
    same, _ = policy_loss("gspo", logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3, agg="seq_mean_token_sum")
    torch.testing.assert_close(same, loss, rtol=0, atol=0)


# ---------------------------------------------------------------- VESPO


def phi(w, k, lam):
    return w ** k * math.exp(lam * (1 - w))


def test_vespo_gamma_kernel_by_hand():
    """phi(W) = W^k e^{lambda (1 - W)} of the whole sequence's ratio W = prod_t pi / pi_old, a stop-gradient weight:
    J_t = phi(W) A log pi(y_t), token mean. (k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0."""
    old = torch.log(torch.tensor([[0.5, 0.5], [0.2, 1.0]], dtype=F64))
    d = torch.tensor([[0.1, 0.2], [-0.3, 0.0]], dtype=F64)
    logp = (old + d).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    w1, w2 = math.exp(0.3), math.exp(-0.3)
    p1, p2 = phi(w1, 2, 3), phi(w2, 3, 2)
    lp = logp.detach()
    want = -(p1 * 2.0 * (lp[0, 0] + lp[0, 1]) + p2 * -1.0 * lp[1, 0]) / 3
    loss, g, stats = _loss_and_grad("vespo", logp, old, adv, mask)
    assert loss.item() == pytest.approx(float(want), abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([[-p1 * 2 / 3, -p1 * 2 / 3], [p2 / 3, 0.0]], dtype=F64), rtol=0,
                               atol=1e-12)
    assert stats["policy/ratio_max"] == pytest.approx(w1) and stats["policy/ratio_min"] == pytest.approx(w2)
    assert phi(1.0, 2, 3) == 1.0 and stats["clip/frac"] == 0.0


def test_vespo_folds_the_mismatch_weight_into_its_ratio_and_keeps_the_entropy_mask_apart():
    """A correction's weight (rho_t = pi_old / mu, truncated or masked) enters W = prod_t (pi / pi_old) rho_t, in log
    space with log rho floored at log 1e-8 (TRL), instead of multiplying the loss; the entropy mask `keep` still
    multiplies. A token masked by a correction (rho 0) all but drops its sequence."""
    logp, old, mask, adv = make_batch(3, noise=0.2)
    rho = torch.full_like(mask, 1.3)
    rho[1, 0] = 0.0  # masked
    keep = torch.ones_like(mask)
    keep[0, 1] = 0.0
    loss, g, _ = _loss_and_grad("vespo", logp, old, adv, mask, is_weight=rho, keep=keep)
    ref = 0.0
    for i, L in enumerate(LENGTHS):
        log_rho = [math.log(float(rho[i, t])) if rho[i, t] > 0 else -math.inf for t in range(L)]
        log_w = sum(float((logp[i, t] - old[i, t]).detach()) + max(log_rho[t], math.log(1e-8)) for t in range(L))
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        p = phi(math.exp(max(log_w, math.log(1e-8))), k, lam)
        ref = ref - sum(float(keep[i, t]) * p * adv[i] * logp[i, t] for t in range(L))
    ref = ref / sum(LENGTHS)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g, grad(ref, logp), rtol=0, atol=1e-12)
    assert float(g[1].abs().max()) < 1e-6  # the masked token's sequence: phi(~1e-8 W) ~ 0


# ---------------------------------------------------------------- DRO


def test_dro_by_hand():
    """J_t = A log pi - (beta/2)(log pi - log pi_old)^2, token mean: dJ/dlog pi = A - beta d_t, on A = 0 tokens too."""
    old = torch.log(torch.tensor([[0.5, 0.25]], dtype=F64))
    d = torch.tensor([[0.2, -0.4]], dtype=F64)
    logp = (old + d).requires_grad_()
    mask = torch.ones(1, 2, dtype=F64)
    for a, beta in ((1.5, 0.05), (0.0, 0.5)):
        adv = torch.tensor([a], dtype=F64)
        loss, g, stats = _loss_and_grad("dro", logp, old, adv, mask, dro_beta=beta)
        lp = logp.detach()[0]
        want = -((a * lp[0] - beta / 2 * 0.04) + (a * lp[1] - beta / 2 * 0.16)) / 2
        assert loss.item() == pytest.approx(float(want), abs=1e-12)
        torch.testing.assert_close(g, -torch.tensor([[a - beta * 0.2, a + beta * 0.4]], dtype=F64) / 2, rtol=0,
                                   atol=1e-12)
    assert stats["policy/ratio_max"] == pytest.approx(math.exp(0.2))


@pytest.mark.parametrize("seed", [0, 1])
def test_dro_matches_verls_formula_on_a_batch(seed):
    """verl's own test of its `dro` (tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py at 1dda039) writes the
    loss as sum(-(log_prob * A - 0.5 beta (log_prob - old)^2) * mask) / sum(mask): the same, values and gradients."""
    logp, old, mask, adv = make_batch(seed, noise=0.4)
    loss, g, _ = _loss_and_grad("dro", logp, old, adv, mask, dro_beta=0.05)
    lp, od = torch.where(mask > 0, logp, 0.0), torch.where(mask > 0, old, 0.0)
    theirs = (-(lp * adv[:, None] - 0.5 * 0.05 * (lp - od).square()) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, theirs, rtol=0, atol=1e-12)
    torch.testing.assert_close(g, grad(theirs, logp), rtol=0, atol=1e-12)


def test_dro_beta_must_be_positive():
    logp, old, mask, adv = make_batch()
    with pytest.raises(ValueError, match="dro_beta"):
        policy_loss("dro", logp, old, adv, mask, dro_beta=0.0)


# ---------------------------------------------------------------- M2PO


def test_m2po_mask_by_hand():
    """Squared log-ratios 0.25, 0.01, 0.04, 0 (and padding): sorted down, the means of what is left after dropping
    the i largest are 0.075, 0.01667, 0.005, 0. Threshold 0.04: drop 1 (0.25); 0.01: drop 2; 1e-9: drop 3; none
    ever below 0 (all equal 0.5^2, threshold 0.1): keep one."""
    d = torch.tensor([[0.5, 0.1, 0.0], [-0.2, 0.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)  # 9.0 is padding
    # flattened tokens: 0.5 (0.25), 0.1 (0.01), 0.0 (0), -0.2 (0.04)
    assert m2_keep(d, mask, 0.04).tolist() == [[False, True, True], [True, False, False]]
    assert m2_keep(d, mask, 0.01).tolist() == [[False, True, True], [False, False, False]]
    assert m2_keep(d, mask, 1e-9).tolist() == [[False, False, True], [False, False, False]]
    assert m2_keep(torch.full((1, 4), 0.5), torch.ones(1, 4), 0.1).sum() == 1
    assert not m2_keep(d, torch.zeros_like(mask), 0.04).any()


def test_m2po_loss_by_hand():
    """J_t = M_t w_t A, token mean over every token (the dropped ones count in the denominator, as the paper's
    1 / sum |o_i|); a dropped token gets no gradient, a kept one w_t A."""
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]], dtype=F64))
    d = torch.tensor([[0.5, 0.1, 0.0]], dtype=F64)
    logp = (old + d).requires_grad_()
    mask = torch.ones(1, 3, dtype=F64)
    adv = torch.tensor([-2.0], dtype=F64)
    loss, g, stats = _loss_and_grad("m2po", logp, old, adv, mask, m2_threshold=0.04)  # means 0.0867, 0.005: drop 1
    w = [math.exp(0.1), 1.0]
    assert loss.item() == pytest.approx(-(w[0] * -2 + w[1] * -2) / 3, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([[0.0, 2 * w[0] / 3, 2 / 3]], dtype=F64), rtol=0, atol=1e-12)
    assert stats["clip/frac_low"] == pytest.approx(1 / 3) and stats["clip/frac_high"] == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_m2po_matches_per_token_loops(seed):
    logp, old, mask, adv = make_batch(seed, noise=0.4)
    loss, g, _ = _loss_and_grad("m2po", logp, old, adv, mask, m2_threshold=0.04)
    d = (logp - old).detach()
    toks = sorted(((float(d[i, t]) ** 2, i, t) for i, L in enumerate(LENGTHS) for t in range(L)), reverse=True)
    dropped = set()
    while len(dropped) < len(toks) - 1 and sum(x[0] for x in toks[len(dropped):]) / (len(toks) - len(dropped)) >= 0.04:
        dropped.add(toks[len(dropped)][1:])
    assert 0 < len(dropped) < len(toks)  # the case is not trivial
    ref = -sum(torch.exp(logp[i, t] - old[i, t]) * adv[i] for i, L in enumerate(LENGTHS) for t in range(L)
               if (i, t) not in dropped) / sum(LENGTHS)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g, grad(ref, logp), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- GDPO


def test_gdpo_by_hand():
    """Two groups of 2, two functions, weights (1, 2). Function 1 = (1, 0 | 1, 1), function 2 = (0, 1 | 0, 1):
    in a group of two values 1 apart, (r - mean) / (std + eps) is +-0.5 / (1/sqrt(2) + eps) = +-c (the unbiased std
    of two values a apart is a / sqrt(2)); function 1 is constant in group 2 (0 there). Sums: (c - 2c, -c + 2c | 0 - 2c, 0 + 2c) =
    (-c, c, -2c, 2c); batch mean 0, unbiased std sqrt((c^2 + c^2 + 4c^2 + 4c^2) / 3)."""
    eps = 1e-4
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=F64)
    c = 0.5 / (1 / math.sqrt(2) + eps)
    s = torch.tensor([-c, c, -2 * c, 2 * c], dtype=F64)
    want = s / (math.sqrt(10 * c * c / 3) + eps)
    got = compute_advantages("gdpo", comps @ torch.tensor([1.0, 2.0], dtype=F64), 2, components=comps,
                             weights=[1.0, 2.0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_gdpo_none_rewards_and_flat_groups():
    """A function's None (NaN) is left out of its group's mean and std and of the sum; a completion no function
    scored gets 0 and stays out of the batch's mean and std; a group where every function is flat gets exactly 0."""
    nan = math.nan
    comps = torch.tensor([[1.0, nan], [0.0, 1.0], [0.0, 0.0], [nan, nan], [1.0, 2.0], [1.0, 2.0]], dtype=F64)
    adv = gdpo(comps.view(3, 2, 2), torch.ones(2, dtype=F64))
    assert adv[1, 1] == 0.0 and adv[2].abs().max() == 0.0  # row 3 unscored; group 3 flat in both functions
    # row 0: function 1 alone (function 2 is None), the other function-1 value 0: z = +c; row 1: -c (f1) + 0 (f2 flat
    # in its group: only one scored value); row 2: f1 = 0 alone in group 2 (z 0), f2 = 0 alone (z 0)
    c = 0.5 / (1 / math.sqrt(2) + 1e-4)
    sums = torch.tensor([c, -c, 0.0, 0.0, 0.0], dtype=F64)  # the scored rows' sums, group 3's included
    mean, std = sums.mean(), sums.std()
    torch.testing.assert_close(adv.reshape(-1)[[0, 1, 2]], (sums[:3] - mean) / (std + 1e-4), rtol=0, atol=1e-12)


def test_gdpo_with_one_component_is_grpo_then_a_batch_normalisation():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.1, 0.1], dtype=F64)
    grpo = compute_advantages("grpo", r, 2)
    torch.testing.assert_close(compute_advantages("gdpo", r, 2), (grpo - grpo.mean()) / (grpo.std() + 1e-4), rtol=0,
                               atol=1e-12)


def test_gdpo_tokens_whitening_is_verls_masked_whiten():
    """algo.whiten=tokens, std_eps=1e-6: verl's gdpo, per-function GRPO (eps 1e-6), weighted sum, then
    masked_whiten over tokens (weights = lengths, Bessel over tokens, eps 1e-8 inside the square root)."""
    g = torch.Generator().manual_seed(0)
    comps = torch.randint(0, 3, (8, 2), generator=g).to(F64)
    lengths = torch.tensor([3, 1, 4, 2, 5, 5, 1, 2])
    w = torch.tensor([1.0, 0.5], dtype=F64)
    got = compute_advantages("gdpo", comps @ w, 4, std_eps=1e-6, whiten="tokens", lengths=lengths, components=comps,
                             weights=w)
    per = [compute_advantages("grpo", comps[:, k], 4, std_eps=1e-6) for k in range(2)]
    s = per[0] * w[0] + per[1] * w[1]
    tok = torch.repeat_interleave(s, lengths)
    want = (s - tok.mean()) * torch.rsqrt(tok.var() + 1e-8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- the registry


def test_each_new_loss_names_its_own_settings():
    assert LOSSES["luspo"].agg == "seq_mean_token_sum" and LOSSES["luspo"].seq_ratio and LOSSES["luspo"].ppo_clip
    assert LOSSES["vespo"].settings == ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    assert LOSSES["vespo"].is_weight_in_ratio and not LOSSES["grpo"].is_weight_in_ratio
    assert LOSSES["dro"].settings == ("dro_beta",) and LOSSES["m2po"].settings == ("m2_threshold",)


# ---------------------------------------------------------------- the peers' own code, from a fetched tree


def _functions_from(path: Path, names: set[str], namespace: dict) -> dict:
    """Exec only the top-level functions `names` of a peer's source file (its module imports a GPU stack)."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == names, f"{path} lacks {names - {n.name for n in body}}"
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.skipif(not os.environ.get("AREAL_SRC"), reason="AReaL is not installed: set AREAL_SRC to a checkout "
                    "(the fetched github:inclusionAI/AReaL at cbff54d or later) to run its M2PO mask")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_m2po_mask_equals_areals(seed):
    """AReaL's `_apply_m2po_masking(old_logp, prox_logp, loss_mask, m2_threshold)` (areal/trainer/ppo/actor.py)
    on the same tokens: the same kept set (continuous values: no ties)."""
    ns = _functions_from(Path(os.environ["AREAL_SRC"]) / "areal/trainer/ppo/actor.py",
                         {"_apply_m2po_masking", "_get_m2po_loss_mask"}, {"torch": torch})
    g = torch.Generator().manual_seed(seed)
    old, prox = torch.randn(6, 9, generator=g) * 0.3, torch.randn(6, 9, generator=g) * 0.3
    mask = torch.arange(9)[None] < torch.tensor([9, 3, 5, 9, 1, 7])[:, None]
    for tau in (0.01, 0.04, 0.2):
        theirs = ns["_apply_m2po_masking"](old, prox, mask, tau)
        assert torch.equal(m2_keep(old - prox, mask.float(), tau), theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dro_and_gdpo_equal_verls(verl_tree, seed):
    """verl's own `compute_policy_loss_dro` and `compute_gdpo_outcome_advantage` (1dda039) on the same tensors:
    gspo's dro, and its gdpo with verl's choices (std_eps 1e-6, whitening over tokens), agree to float32 rounding."""
    from omegaconf import OmegaConf

    verl_core = verl_tree
    if not hasattr(verl_core, "compute_policy_loss_dro"):
        pytest.skip(f"the verl at {os.environ['VERL_SRC']} has no dro loss (it came with verl #7245)")
    logp, old, mask, adv = make_batch(seed, noise=0.4)
    logp = torch.where(mask > 0, logp.detach(), -1.0).float().requires_grad_()
    old, mask, adv = torch.where(mask > 0, old, -1.0).float(), mask.float(), adv.float()
    cfg = OmegaConf.create({"policy_loss": {"dro_beta": 0.05}, "global_batch_info": {}})
    theirs, _ = verl_core.compute_policy_loss_dro(old, logp, adv[:, None] * mask, mask, "token-mean", cfg)
    ours, _ = policy_loss("dro", logp, old, adv, mask, dro_beta=0.05)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad(ours, logp), grad(theirs, logp), rtol=0, atol=1e-7)

    import numpy as np

    g = torch.Generator().manual_seed(seed)
    n, G = 12, 4
    comps = torch.randint(0, 3, (n, 2), generator=g).float()
    lengths = torch.randint(1, 6, (n,), generator=g)
    tmask = (torch.arange(5)[None] < lengths[:, None]).float()
    index = np.array([i // G for i in range(n)])
    keys = {"a": comps[:, 0].numpy(), "b": comps[:, 1].numpy()}
    batch = {"prompts": torch.zeros(n, 2), "attention_mask": torch.cat([torch.ones(n, 2), tmask], 1).long()}
    algo = OmegaConf.create({"gdpo_reward_keys": ["a", "b"], "gdpo_reward_weights": [1.0, 0.5],
                             "norm_adv_by_std_in_grpo": True})
    theirs, _ = verl_core.compute_gdpo_outcome_advantage(tmask * 0, tmask, index, config=algo, non_tensor_batch=keys,
                                                        batch=batch)
    ours = compute_advantages("gdpo", comps @ torch.tensor([1.0, 0.5]), G, std_eps=1e-6, whiten="tokens",
                              lengths=lengths, components=comps, weights=[1.0, 0.5])
    torch.testing.assert_close(ours[:, None] * tmask, theirs, rtol=0, atol=2e-5)

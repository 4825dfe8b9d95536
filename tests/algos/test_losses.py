"""The policy losses, checked against the papers' equations.

Reference values come from hand-worked numbers or from straight-line formulas
written here with per-token Python loops (never the vectorised implementation),
on small batches with unequal lengths and garbage in the padding. Values AND
gradients (torch.autograd.grad) are compared.
"""

import math

import pytest
import torch

from gspo.algos.kl import kl_penalty
from gspo.algos.losses import aggregate, policy_loss, register_loss

F64 = torch.float64
LENGTHS = [4, 2, 3]  # unequal completion lengths; T = 5 leaves padding on every row
B, T = len(LENGTHS), 5


def make_batch(seed=0, noise=0.3, adv=(0.9, -1.3, 0.4), probs=False):
    """logp (leaf, grad), old_logp, mask, advantages; padding holds -inf (log 0): -inf - -inf = nan.

    probs: keep logp <= -0.01, a probability (the losses that read pi itself, DPPO, need one).
    """
    g = torch.Generator().manual_seed(seed)
    old = -0.1 - 2.0 * torch.rand(B, T, generator=g, dtype=F64)
    logp = old + noise * torch.randn(B, T, generator=g, dtype=F64)
    if probs:
        logp = logp.clamp(max=-0.01)
    mask = torch.zeros(B, T, dtype=F64)
    for i, L in enumerate(LENGTHS):
        mask[i, :L] = 1.0
    logp[mask == 0] = -math.inf  # nan d_t if padding leaked into any sum
    old[mask == 0] = -math.inf
    return logp.requires_grad_(), old, mask, torch.tensor(adv, dtype=F64)


def clip(x, lo, hi):
    return max(min(x, hi), lo)  # python min/max on 0-dim tensors: the gradient follows the pick


def ppo(w, a, el, eh, c=None, delta=None):
    j = min((w if delta is None else min(w, delta)) * a, clip(w, 1 - el, 1 + eh) * a)
    if c is not None and a < 0:
        j = max(j, c * a)
    return j


def reduce_loops(objs, agg, max_tokens=None):
    """objs: list (per sequence) of lists (per token) of objectives -> scalar loss = -aggregate."""
    if agg == "seq_mean_token_mean":
        return -sum(sum(o) / len(o) for o in objs) / len(objs)
    if agg == "token_mean":
        return -sum(sum(o) for o in objs) / sum(len(o) for o in objs)
    if agg == "seq_mean_token_sum_norm":
        return -sum(sum(o) for o in objs) / (len(objs) * max_tokens)
    raise AssertionError(agg)


def reference(name, logp, old, adv, el=0.2, eh=0.2, agg=None, max_tokens=None, c=None,
              tau_pos=1.0, tau_neg=1.05, rs=None, floor=0.0, delta=None):
    """Straight-line per-token formulas of each paper; adv is (B,) or (B, T)."""
    def A(i, t):
        return adv[i] if adv.dim() == 1 else adv[i, t]

    objs = []
    for i, L in enumerate(LENGTHS):
        d = [logp[i, t] - old[i, t] for t in range(L)]
        if name in ("grpo", "dapo", "dr_grpo", "rspo"):
            fac = [1.0] * L if rs is None else [max(float(rs[i, t]), floor) for t in range(L)]
            o = [ppo(torch.exp(d[t]) * fac[t], A(i, t), el, eh, c, delta) for t in range(L)]
        elif name == "gspo":
            s = torch.exp(sum(d) / L)
            o = [ppo(s, A(i, t), el, eh, c, delta) for t in range(L)]
        elif name == "rloo":  # TRL's RLOO: the whole completion's ratio, not length-normalised
            s = torch.exp(sum(d))
            o = [ppo(s, A(i, t), el, eh, c, delta) for t in range(L)]
        elif name == "gspo_token":
            s = torch.exp(sum(x.detach() for x in d) / L)
            o = [ppo(s * torch.exp(logp[i, t] - logp[i, t].detach()), A(i, t), el, eh, c, delta) for t in range(L)]
        elif name == "gmpo":
            a = sum(A(i, t) for t in range(L)) / L
            if a > 0:
                dm = [min(x, clip(x, -el, eh)) for x in d]
            elif a < 0:
                dm = [max(x, clip(x, -el, eh)) for x in d]
            else:
                dm = [0.0 * x for x in d]
            o = [torch.exp(sum(dm) / L) * a] * L
        elif name == "cispo":
            r_hat = [float(clip(torch.exp(d[t].detach()), 1 - el, 1 + eh)) for t in range(L)]  # sg(clip(r))
            o = [r_hat[t] * A(i, t) * logp[i, t] for t in range(L)]
        elif name == "sapo":
            o = []
            for t in range(L):
                tau = tau_pos if A(i, t) > 0 else tau_neg
                o.append(torch.sigmoid(tau * (torch.exp(d[t]) - 1)) * 4 / tau * A(i, t))
        elif name in ("nll", "gpg"):
            o = [A(i, t) * logp[i, t] for t in range(L)]
        elif name in ("dppo_tv", "dppo_kl"):
            o = []
            for t in range(L):
                p, q = math.exp(float(logp[i, t].detach())), math.exp(float(old[i, t]))
                if name == "dppo_tv":
                    inside = p - q <= eh if A(i, t) > 0 else p - q >= -el
                else:
                    kl = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
                    inside = (kl <= eh or p <= q) if A(i, t) > 0 else (kl <= el or p >= q)
                w = math.exp(float(d[t].detach()))
                w = w if c is None else min(w, c)
                o.append(w * A(i, t) * logp[i, t] if inside else 0.0 * logp[i, t])
        elif name == "topr":
            s = math.exp(float(sum(d).detach()))  # the whole completion's ratio, a constant
            o = [(min(s, 1.0) if A(i, t) < 0 else 1.0) * A(i, t) * logp[i, t] for t in range(L)]
        else:
            raise AssertionError(name)
        objs.append(o)
    default = {"dapo": "token_mean", "cispo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm", "gpg": "token_mean",
               "dppo_tv": "seq_mean_token_sum_norm", "dppo_kl": "seq_mean_token_sum_norm",
               "topr": "seq_mean_token_sum_norm"}
    return reduce_loops(objs, agg or default.get(name, "seq_mean_token_mean"), max_tokens)


def grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def check(name, seed=0, noise=0.3, adv=(0.9, -1.3, 0.4), **hyper):
    logp, old, mask, a = make_batch(seed, noise, adv, probs=name.startswith("dppo"))
    ours, stats = policy_loss(name, logp, old, a, mask, **hyper)
    kw = {k: v for k, v in hyper.items() if k in ("agg", "max_tokens")}
    kw.update(el=hyper.get("eps_low", 0.2), eh=hyper.get("eps_high", 0.2), c=hyper.get("clip_ratio_c"),
              delta=hyper.get("delta"))
    ref = reference(name, logp, old, a, **kw)
    torch.testing.assert_close(ours, ref)
    g = grad(ours, logp)
    torch.testing.assert_close(g, grad(ref, logp))
    assert torch.isfinite(g).all()
    return stats


# ---------------------------------------------------------------- registry and arguments


def test_unknown_loss_lists_valid_names():
    logp, old, mask, a = make_batch()
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'.*gspo.*sapo"):
        policy_loss("ppo2", logp, old, a, mask)


def test_unknown_hyper_is_type_error():
    logp, old, mask, a = make_batch()
    with pytest.raises(TypeError, match="epsilon"):
        policy_loss("grpo", logp, old, a, mask, epsilon=0.2)


def test_duplicate_registration_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_loss("grpo", agg="token_mean")(lambda *a: None)


def test_bad_shapes_and_missing_max_tokens():
    logp, old, mask, a = make_batch()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss("grpo", logp, old, a[:2], mask)
    with pytest.raises(ValueError, match="max_tokens"):
        policy_loss("dr_grpo", logp, old, a, mask)


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand():
    x = torch.tensor([[1.0, 2, 3, 4], [5, 6, 99, 99], [7, 7, 7, 7]])
    m = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])  # the empty row counts only for Dr. GRPO
    assert aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx((2.5 + 5.5) / 2)
    assert aggregate(x, m, "token_mean").item() == pytest.approx(21 / 6)
    assert aggregate(x, m, "seq_mean_token_sum_norm", max_tokens=5).item() == pytest.approx(21 / (3 * 5))
    with pytest.raises(ValueError, match="valid"):
        aggregate(x, m, "sum")


# ---------------------------------------------------------------- GRPO family, hand-worked


def test_grpo_hand_worked():
    # seq 0 (A=+1): w = [1.5, 0.5] -> min(1.5, 1.2)=1.2 (clipped high), min(0.5, 0.8)=0.5; mean 0.85
    # seq 1 (A=-1): w = [0.5] -> min(-0.5, -0.8) = -0.8 (clipped low)
    # loss = -(0.85 - 0.8) / 2 = -0.025; only seq 0 token 1 has gradient: -(1/2)(1/2)(w A) = -0.125
    old = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(0.5), 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    loss, st = policy_loss("grpo", logp, old, torch.tensor([1.0, -1.0], dtype=F64), mask)
    assert loss.item() == pytest.approx(-0.025)
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[0.0, -0.125], [0.0, 0.0]], dtype=F64))
    assert st["clip/frac_high"] == pytest.approx(1 / 3) and st["clip/frac_low"] == pytest.approx(1 / 3)
    assert st["clip/frac"] == pytest.approx(2 / 3) and st["clip/seq_frac"] == 1.0
    assert (st["policy/ratio_min"], st["policy/ratio_max"]) == pytest.approx((0.5, 1.5))
    assert (st["policy/token_ratio_min"], st["policy/token_ratio_max"]) == pytest.approx((0.5, 1.5))
    assert st["policy/ratio_mean"] == pytest.approx(2.5 / 3)


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_a_minibatch_without_tokens_gives_the_identities_of_min_and_max(name):
    """No completion token (a rank whose rows the overlong filter dropped): the ratio extremes are +inf / -inf,
    which no min / max over minibatches and ranks picks (before: 1.0, which became the step's extreme when the
    other ranks' tokens all had ratios above or below 1); the loss is 0 and finite."""
    logp, old, mask, a = make_batch()
    loss, st = policy_loss(name, logp, old, a, torch.zeros_like(mask))
    assert loss.item() == 0.0
    assert (st["policy/ratio_min"], st["policy/ratio_max"]) == (math.inf, -math.inf)
    assert (st["policy/token_ratio_min"], st["policy/token_ratio_max"]) == (math.inf, -math.inf)
    assert st["policy/ratio_mean"] == 1.0 and st["clip/frac"] == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_token_ratio_losses_match_reference(seed):
    st = check("grpo", seed)
    assert 0 < st["clip/frac"] < 1  # both branches exercised
    check("grpo", seed, eps_low=0.1, eps_high=0.3)
    check("dapo", seed, eps_low=0.2, eps_high=0.28)
    check("dr_grpo", seed, max_tokens=7)
    check("grpo", seed, agg="token_mean")


def test_dual_clip():
    # A = -1, w = 5 > c = 3: PPO alone gives min(-5, -1.2) = -5 (loss 5, gradient 5);
    # dual clip floors the objective at c A = -3: loss 3, no gradient
    logp = torch.tensor([[math.log(5.0)]], dtype=F64, requires_grad=True)
    old, mask, a = torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64), torch.tensor([-1.0], dtype=F64)
    plain, _ = policy_loss("grpo", logp, old, a, mask)
    assert plain.item() == pytest.approx(5.0) and grad(plain, logp).item() == pytest.approx(5.0)
    dual, st = policy_loss("grpo", logp, old, a, mask, clip_ratio_c=3.0)
    assert dual.item() == pytest.approx(3.0) and grad(dual, logp).item() == 0.0
    assert st["clip/frac_dual"] == 1.0
    check("grpo", 0, noise=1.5, clip_ratio_c=1.5)  # mixed batch against the reference
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("grpo", logp, old, a, mask, clip_ratio_c=0.5)


def test_two_sided_clip_delta_by_hand():
    """INTELLECT-2's two-sided clip (TRL's delta = 2): the unclipped ratio capped at delta, for every sign of A.
    A = -1, w = 2.5: PPO gives min(-2.5, -1.2) = -2.5 (loss 2.5, gradient 2.5); capped: min(-2, -1.2) = -2,
    loss 2 and no gradient. A = -1, w = 1.5 < delta: untouched (loss 1.5, gradient 1.5). A = +1, w = 1.1 with
    delta = 1.05 < 1 + eps_high: min(1.05, 1.1) = 1.05, no gradient (TRL advises delta > 1 + eps_high)."""
    old, mask = torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)
    for w, a, delta, loss, g in ((2.5, -1.0, 2.0, 2.0, 0.0), (1.5, -1.0, 2.0, 1.5, 1.5), (1.1, 1.0, 1.05, -1.05, 0.0)):
        logp = torch.tensor([[math.log(w)]], dtype=F64, requires_grad=True)
        out, st = policy_loss("grpo", logp, old, torch.tensor([a], dtype=F64), mask, delta=delta)
        assert out.item() == pytest.approx(loss) and grad(out, logp).item() == pytest.approx(g)
        assert st["clip/frac_dual"] == float(a < 0 and w > delta)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gspo_token", "rloo"])
def test_delta_matches_reference(name):
    for seed in (0, 1):
        check(name, seed, noise=0.6, delta=1.5, eps_low=0.2, eps_high=0.28)


def test_delta_above_the_clip_range_is_the_dual_clip_at_c_delta():
    """With delta > 1 + eps_high only A < 0 tokens with w > delta change, to delta A: the dual clip at c = delta."""
    for seed in range(3):
        logp, old, mask, a = make_batch(seed, noise=1.5)
        two_sided, s1 = policy_loss("grpo", logp, old, a, mask, delta=1.6)
        dual, s2 = policy_loss("grpo", logp, old, a, mask, clip_ratio_c=1.6)
        torch.testing.assert_close(two_sided, dual)
        torch.testing.assert_close(grad(two_sided, logp), grad(dual, logp))
        assert s1["clip/frac_dual"] == s2["clip/frac_dual"]


def test_delta_is_refused_with_a_loss_without_ppos_clip():
    logp, old, mask, a = make_batch()
    for name in ("cispo", "gmpo", "sapo", "dppo_tv", "kl_cov", "topr", "gpg", "nll"):
        with pytest.raises(ValueError, match=f"delta .*loss '{name}' has none"):
            policy_loss(name, logp, old, a, mask, delta=2.0, max_tokens=8)
    with pytest.raises(ValueError, match="delta"):
        policy_loss("grpo", logp, old, a, mask, delta=0.9)


def test_rloo_loss_hand_worked():
    """TRL's RLOO loss: one ratio per completion, the product of its token ratios. Row 0: log-ratios 0.1 and 0.05
    -> w = e^0.15 = 1.1618 > 1.2? no: inside [0.8, 1.2], J = w A = 1.1618 x 2; row 1: log-ratio -0.3 -> w = 0.7408
    < 0.8 with A = -1: clipped, J = 0.8 x -1 and no gradient. Loss = -(2.3237 - 0.8) / 2."""
    logp = torch.tensor([[0.1, 0.05], [-0.3, 0.0]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    loss, st = policy_loss("rloo", logp, old, torch.tensor([2.0, -1.0], dtype=F64), mask)
    w = math.exp(0.15)
    assert loss.item() == pytest.approx(-(2 * w - 0.8) / 2)
    # d loss / d logp_t = -(1/2) A w on both tokens of row 0 (the ratio is their product), 0 on the clipped row
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[-w, -w], [0.0, 0.0]], dtype=F64))
    assert st["clip/seq_frac"] == 0.5 and st["clip/frac_low"] == pytest.approx(1 / 3)


def test_rloo_matches_reference():
    for seed in (0, 1):
        check("rloo", seed, noise=0.1)
        check("rloo", seed, noise=0.1, eps_low=0.1, eps_high=0.3, clip_ratio_c=3.0)


def test_dr_grpo_unchanged_when_padding_grows():
    logp, old, mask, a = make_batch()
    loss, _ = policy_loss("dr_grpo", logp, old, a, mask, max_tokens=8)
    pad = 3
    logp2 = torch.cat([logp.detach(), torch.full((B, pad), -math.inf, dtype=F64)], 1).requires_grad_()
    old2 = torch.cat([old, torch.full((B, pad), -math.inf, dtype=F64)], 1)
    mask2 = torch.cat([mask, torch.zeros(B, pad, dtype=F64)], 1)
    loss2, _ = policy_loss("dr_grpo", logp2, old2, a, mask2, max_tokens=8)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(grad(loss2, logp2)[:, :T], grad(loss, logp))


# ---------------------------------------------------------------- GSPO


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.05, 0.08), (3e-4, 4e-4)])
def test_gspo_matches_reference(eps):
    check("gspo", 0, eps_low=eps[0], eps_high=eps[1])
    check("gspo_token", 0, eps_low=eps[0], eps_high=eps[1])


def test_gspo_hand_worked_sequence_ratio():
    # one sequence, d = [0.1, -0.3, 0.5]: s = exp(0.3/3) = e^0.1; A = 2; unclipped (eps 0.2)
    # loss = -s A; d loss / d logp_t = -A s / |y| for every token
    logp = torch.tensor([[0.1, -0.3, 0.5]], dtype=F64, requires_grad=True)
    loss, st = policy_loss("gspo", logp, torch.zeros(1, 3, dtype=F64), torch.tensor([2.0], dtype=F64),
                           torch.ones(1, 3, dtype=F64))
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(-2 * s)
    torch.testing.assert_close(grad(loss, logp), torch.full((1, 3), -2 * s / 3, dtype=F64))
    assert st["policy/ratio_mean"] == pytest.approx(s) and st["clip/frac"] == 0.0
    # the sequence ratio hides its tokens' extremes; token_ratio_* report them
    assert st["policy/ratio_min"] == st["policy/ratio_max"] == pytest.approx(s)
    assert (st["policy/token_ratio_min"], st["policy/token_ratio_max"]) == pytest.approx((math.exp(-0.3), math.exp(0.5)))


def test_gspo_and_gspo_token_identical_with_sequence_advantages():
    for eps in [(0.2, 0.2), (0.02, 0.02)]:
        logp, old, mask, a = make_batch(3, noise=0.2)
        l1, s1 = policy_loss("gspo", logp, old, a, mask, eps_low=eps[0], eps_high=eps[1])
        l2, s2 = policy_loss("gspo_token", logp, old, a, mask, eps_low=eps[0], eps_high=eps[1])
        torch.testing.assert_close(l1, l2)
        torch.testing.assert_close(grad(l1, logp), grad(l2, logp))
        assert s1 == pytest.approx(s2)


def test_gspo_token_per_token_advantages():
    logp, old, mask, _ = make_batch(1)
    adv = torch.randn(B, T, generator=torch.Generator().manual_seed(5), dtype=F64)
    ours, _ = policy_loss("gspo_token", logp, old, adv, mask, eps_low=0.05, eps_high=0.05)
    ref = reference("gspo_token", logp, old, adv, el=0.05, eh=0.05)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad(ours, logp), grad(ref, logp))


def test_gspo_clipped_sequence_gets_no_gradient():
    # seq 0: every d = +0.01 -> s = e^0.01 > 1 + 4e-4 with A > 0: clipped, whole sequence silent
    # seq 1: every d = -0.01 -> s < 1 - 3e-4 with A < 0: clipped on the low side, silent
    # seq 2: every d = -0.01 with A > 0: the ratio is out of range on the harmless side -> gradient flows
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    logp = (torch.tensor([[0.01] * 4, [-0.01] * 4, [-0.01] * 4], dtype=F64) * mask).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    for name in ("gspo", "gspo_token"):
        loss, st = policy_loss(name, logp, torch.zeros(3, 4, dtype=F64), adv, mask, eps_low=3e-4, eps_high=4e-4)
        g = grad(loss, logp)
        assert (g[0] == 0).all() and (g[1] == 0).all() and (g[2] != 0).all()
        # every token of a clipped sequence counts: 3 + 2 of 9 tokens, 2 of 3 sequences
        assert st["clip/frac_high"] == pytest.approx(3 / 9) and st["clip/frac_low"] == pytest.approx(2 / 9)
        assert st["clip/seq_frac"] == pytest.approx(2 / 3)


def test_sequence_ratio_with_token_mean_warns():
    logp, old, mask, a = make_batch()
    for name in ("gspo", "gspo_token", "gmpo"):
        with pytest.warns(UserWarning, match="weights each sequence by its length"):
            policy_loss(name, logp, old, a, mask, agg="token_mean")


# ---------------------------------------------------------------- GMPO, CISPO, SAPO, RSPO, NLL


def test_gmpo_matches_reference_and_counts_log_clips():
    st = check("gmpo", 0, noise=0.6, eps_low=0.4, eps_high=0.4)
    # count by hand: tokens whose log-ratio crossed the bound on the advantage's side
    logp, old, mask, a = make_batch(0, 0.6)
    n_low = n_high = 0
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            d = float(logp[i, t].detach() - old[i, t])
            n_high += a[i] > 0 and d > 0.4
            n_low += a[i] < 0 and d < -0.4
    assert n_low + n_high > 0
    assert st["clip/frac_high"] == pytest.approx(n_high / 9) and st["clip/frac_low"] == pytest.approx(n_low / 9)


def test_gmpo_hand_worked():
    # A = +1, d = [0.6, -0.6]: the +0.6 is capped at 0.4, the -0.6 is kept (A > 0 clips the top only)
    # ratio = exp((0.4 - 0.6) / 2) = e^-0.1; loss = -e^-0.1; only token 1 has gradient: -e^-0.1 / 2
    logp = torch.tensor([[0.6, -0.6]], dtype=F64, requires_grad=True)
    loss, st = policy_loss("gmpo", logp, torch.zeros(1, 2, dtype=F64), torch.tensor([1.0], dtype=F64),
                           torch.ones(1, 2, dtype=F64), eps_low=0.4, eps_high=0.4)
    assert loss.item() == pytest.approx(-math.exp(-0.1))
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[0.0, -math.exp(-0.1) / 2]], dtype=F64))
    assert st["clip/frac_high"] == 0.5 and st["clip/frac_low"] == 0.0


def test_cispo_matches_reference_and_keeps_every_gradient():
    st = check("cispo", 0, noise=0.6, eps_low=10.0, eps_high=0.2)
    assert st["clip/frac_high"] > 0 and st["clip/frac_low"] == 0.0
    # gradient of every token = -sg(clip(w)) A / N_tokens: clipped tokens still learn
    logp, old, mask, a = make_batch(0, 0.6)
    loss, _ = policy_loss("cispo", logp, old, a, mask, eps_low=10.0, eps_high=0.2)
    g = grad(loss, logp)
    for i, L in enumerate(LENGTHS):
        for t in range(L):
            w = min(math.exp(float(logp[i, t].detach() - old[i, t])), 1.2)
            assert g[i, t].item() == pytest.approx(-w * float(a[i]) / 9)


def test_sapo_matches_reference():
    check("sapo", 0, noise=0.5)
    logp, old, mask, a = make_batch(0, 0.5)
    ours, st = policy_loss("sapo", logp, old, a, mask, tau_pos=2.0, tau_neg=3.0)
    ref = reference("sapo", logp, old, a, tau_pos=2.0, tau_neg=3.0)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad(ours, logp), grad(ref, logp))
    assert st["clip/frac"] == 0.0  # a soft gate never clips


def test_sapo_gate_by_hand():
    # A = +1, w = 2, tau_pos = 1: f = sigmoid(1) * 4; loss = -f; d/dlogp = -w * 4 sigmoid'(1) = -8 s(1)(1-s(1))
    logp = torch.tensor([[math.log(2.0)]], dtype=F64, requires_grad=True)
    loss, _ = policy_loss("sapo", logp, torch.zeros(1, 1, dtype=F64), torch.tensor([1.0], dtype=F64),
                          torch.ones(1, 1, dtype=F64), tau_pos=1.0)
    s = 1 / (1 + math.exp(-1))
    assert loss.item() == pytest.approx(-4 * s)
    assert grad(loss, logp).item() == pytest.approx(-8 * s * (1 - s))


def test_rspo_router_shift_floor_and_stop_gradient():
    logp, old, mask, a = make_batch(2)
    rs = torch.rand(B, T, generator=torch.Generator().manual_seed(9), dtype=F64).requires_grad_()
    ours, _ = policy_loss("rspo", logp, old, a, mask, router_shift=rs, router_shift_floor=0.5)
    ref = reference("rspo", logp, old, a, rs=rs.detach(), floor=0.5)
    torch.testing.assert_close(ours, ref)
    g_logp, g_rs = torch.autograd.grad(ours, [logp, rs], allow_unused=True)
    torch.testing.assert_close(g_logp, grad(ref, logp))
    assert g_rs is None or (g_rs == 0).all()  # sg(router_shift)
    # no router-shift signal: RSPO is GRPO
    l1, _ = policy_loss("rspo", logp, old, a, mask)
    l2, _ = policy_loss("grpo", logp, old, a, mask)
    torch.testing.assert_close(l1, l2)


def test_nll_is_weighted_log_likelihood():
    check("nll", 0)
    st = check("nll", 0, noise=1.0, agg="token_mean")
    assert st["clip/frac"] == 0.0


# ---------------------------------------------------------------- identities at ratio 1


def reinforce(logp, adv, agg, max_tokens=None):
    objs = [[adv[i] * logp[i, t] for t in range(L)] for i, L in enumerate(LENGTHS)]
    return reduce_loops(objs, agg, max_tokens)


@pytest.mark.parametrize("name,hyper,agg", [
    ("grpo", {}, "seq_mean_token_mean"),
    ("gspo", {"eps_low": 3e-4, "eps_high": 4e-4}, "seq_mean_token_mean"),
    ("gspo_token", {"eps_low": 3e-4, "eps_high": 4e-4}, "seq_mean_token_mean"),
    ("dapo", {"eps_high": 0.28}, "token_mean"),
    ("dr_grpo", {"max_tokens": 6}, "seq_mean_token_sum_norm"),
    ("gmpo", {"eps_low": 0.4, "eps_high": 0.4}, "seq_mean_token_mean"),
    ("cispo", {"eps_low": 10.0}, "token_mean"),
    ("sapo", {}, "seq_mean_token_mean"),
    ("rspo", {}, "seq_mean_token_mean"),
    ("nll", {}, "seq_mean_token_mean"),
    ("gpg", {}, "token_mean"),
    ("dppo_tv", {"eps_low": 0.15, "eps_high": 0.15, "max_tokens": 6}, "seq_mean_token_sum_norm"),
    ("dppo_kl", {"eps_low": 0.05, "eps_high": 0.05, "max_tokens": 6}, "seq_mean_token_sum_norm"),
    ("clip_cov", {"clip_cov_ratio": 0.5, "clip_cov_lb": -1e9, "clip_cov_ub": -1e8}, "token_mean"),  # no candidate
    ("kl_cov", {}, "token_mean"),  # |d| = 0 on-policy: the penalty has no gradient there
    ("topr", {"max_tokens": 6}, "seq_mean_token_sum_norm"),
])
def test_on_policy_gradient_is_reinforce(name, hyper, agg):
    logp, _, mask, a = make_batch(4)
    old = logp.detach().clone()
    old[mask == 0] = -math.inf
    loss, st = policy_loss(name, logp, old, a, mask, **hyper)
    torch.testing.assert_close(grad(loss, logp), grad(reinforce(logp, a, agg, hyper.get("max_tokens")), logp))
    assert st["clip/frac"] == st["clip/frac_low"] == st["clip/frac_high"] == st["clip/seq_frac"] == 0.0
    assert st["policy/ratio_min"] == st["policy/ratio_max"] == 1.0
    assert st["kl/old"] == pytest.approx(0.0)


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    lp = torch.tensor([[-1.0, -0.5]], dtype=F64)
    ref = torch.tensor([[-1.5, -0.5]], dtype=F64)
    # x = ref - logp = [-0.5, 0]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[0.5, 0.0]], dtype=F64))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[0.125, 0.0]], dtype=F64))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[math.exp(-0.5) - 0.5, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_term_added_per_token_before_aggregation(kind):
    logp, old, mask, a = make_batch(6)
    ref = old + 0.1
    loss, st = policy_loss("grpo", logp, old, a, mask, ref_logp=ref, beta=0.04, kl_estimator=kind)
    objs = []
    for i, L in enumerate(LENGTHS):
        o = []
        for t in range(L):
            x = ref[i, t] - logp[i, t]
            k = {"k1": -x, "k2": 0.5 * x * x, "k3": torch.exp(x) - x - 1}[kind]
            o.append(ppo(torch.exp(logp[i, t] - old[i, t]), a[i], 0.2, 0.2) - 0.04 * k)
        objs.append(o)
    ref_loss = reduce_loops(objs, "seq_mean_token_mean")
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad(loss, logp), grad(ref_loss, logp))
    lp = logp.detach()
    k3 = [float(torch.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1)
          for i, L in enumerate(LENGTHS) for t in range(L)]
    assert st["kl/ref"] == pytest.approx(sum(k3) / len(k3))


def test_kl_skipped_when_beta_zero():
    logp, old, mask, a = make_batch()
    l0, s0 = policy_loss("grpo", logp, old, a, mask)
    l1, s1 = policy_loss("grpo", logp, old, a, mask, ref_logp=old + 1.0, beta=0.0)
    torch.testing.assert_close(l0, l1)
    assert "kl/ref" not in s1 and s0 == s1


def test_kl_old_by_hand():
    logp, old, mask, a = make_batch(7)
    _, st = policy_loss("grpo", logp, old, a, mask)
    lp = logp.detach()
    vals = [math.exp(float(old[i, t] - lp[i, t])) - float(old[i, t] - lp[i, t]) - 1
            for i, L in enumerate(LENGTHS) for t in range(L)]
    assert st["kl/old"] == pytest.approx(sum(vals) / len(vals))
    assert all(isinstance(v, float) for v in st.values())


# ---------------------------------------------------------------- presets


def test_every_algo_preset_fits_the_schema_and_the_registries():
    from omegaconf import OmegaConf

    from gspo.algos.advantages import ADVANTAGES
    from gspo.algos.losses import HYPER_NAMES, LOSSES
    from gspo.algos.value import GAE
    from gspo.config.schema import CONF_DIR, AlgoConfig

    presets = sorted((CONF_DIR / "algo").glob("*.yaml"))
    assert {p.stem for p in presets} >= {"grpo", "gspo", "gspo_token", "dapo", "dr_grpo", "gmpo", "cispo",
                                         "sapo", "rspo", "rft", "softmax_weighted"}
    logp, old, mask, a = make_batch()
    for p in presets:
        raw = OmegaConf.load(p)
        raw = raw.algo if "algo" in raw else raw  # a global-package preset (dppo_topk: it also sets rollout keys)
        cfg = OmegaConf.merge(OmegaConf.structured(AlgoConfig), raw)  # unknown key -> error
        assert cfg.name == p.stem and cfg.loss in LOSSES and cfg.advantage in [*ADVANTAGES, GAE]
        hyper = {k: cfg[k] for k in HYPER_NAMES if k in cfg}
        if LOSSES[cfg.loss].topk:  # (dppo_topk) the sampler's top-2 and the policy's log-probs of them
            hyper |= {"topk_old_logp": torch.stack([old, old - 1.0], -1), "topk_logp": torch.stack([logp, logp - 1.0], -1)}
        loss, _ = policy_loss(cfg.loss, logp, old, a, mask, max_tokens=8, ref_logp=old, **hyper)
        assert torch.isfinite(loss)


# ---------------------------------------------------------------- DPPO, Clip-Cov, KL-Cov, GPG, TOPR


def one_token(p_old, p_new, a, dtype=F64):
    """A batch of one token: logp (leaf), old_logp, mask, advantage."""
    logp = torch.tensor([[math.log(p_new)]], dtype=dtype, requires_grad=True)
    return logp, torch.tensor([[math.log(p_old)]], dtype=dtype), torch.ones(1, 1, dtype=dtype), torch.tensor([a], dtype=dtype)


@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_and_topr_match_reference(seed):
    for name, eps in (("dppo_tv", 0.15), ("dppo_kl", 0.05)):
        st = check(name, seed, noise=0.6, eps_low=eps, eps_high=eps, max_tokens=7)
        assert 0 < st["clip/frac"] < 1  # both kept and masked tokens
        check(name, seed, noise=0.6, eps_low=eps, eps_high=eps, max_tokens=7, clip_ratio_c=1.3)
        check(name, seed, noise=0.6, eps_low=eps, eps_high=eps, agg="token_mean")
    check("topr", seed, noise=0.6, max_tokens=7)
    check("gpg", seed)


def test_dppo_tv_hand_worked():
    # pi_old = 0.5. A = +1: pi 0.6 is inside (0.1 <= 0.15), gradient -w A = -1.2 (B = max_tokens = 1);
    # pi 0.7 left the region upwards (0.2 > 0.15): masked, no value, no gradient.
    # A = -1: pi 0.3 left downwards (masked); pi 0.9 moved the harmless way: kept, gradient +1.8
    for p, a, g, low, high in ((0.6, 1.0, -1.2, 0, 0), (0.7, 1.0, 0.0, 0, 1), (0.3, -1.0, 0.0, 1, 0), (0.9, -1.0, 1.8, 0, 0)):
        logp, old, mask, adv = one_token(0.5, p, a)
        loss, st = policy_loss("dppo_tv", logp, old, adv, mask, eps_low=0.15, eps_high=0.15, max_tokens=1)
        assert loss.item() == pytest.approx(-(p / 0.5) * a * math.log(p) if g else 0.0)
        assert grad(loss, logp).item() == pytest.approx(g)
        assert (st["clip/frac_low"], st["clip/frac_high"]) == (low, high)
        assert st["policy/ratio_mean"] == pytest.approx(p / 0.5)


def test_dppo_kl_hand_worked_and_truncation():
    # pi_old = 0.5: D(0.5 || 0.6) = 0.5 ln(5/6) + 0.5 ln(5/4) = 0.0204 <= 0.05 kept;
    # D(0.5 || 0.7) = 0.5 ln(5/7) + 0.5 ln(5/3) = 0.0872 > 0.05 masked (A > 0 and pi grew)
    assert 0.5 * math.log(5 / 6) + 0.5 * math.log(5 / 4) == pytest.approx(0.0204, abs=1e-4)
    for p, g in ((0.6, -1.2), (0.7, 0.0)):
        logp, old, mask, adv = one_token(0.5, p, 1.0)
        loss, _ = policy_loss("dppo_kl", logp, old, adv, mask, eps_low=0.05, eps_high=0.05, max_tokens=1)
        assert grad(loss, logp).item() == pytest.approx(g)
    # the IS weight 5 is truncated at clip_ratio_c = 3 (a stop-gradient weight): gradient -3 A, counted in frac_dual
    logp, old, mask, adv = one_token(0.1, 0.5, 1.0)
    loss, st = policy_loss("dppo_tv", logp, old, adv, mask, eps_low=1.0, eps_high=1.0, max_tokens=1, clip_ratio_c=3.0)
    assert grad(loss, logp).item() == pytest.approx(-3.0) and st["clip/frac_dual"] == 1.0


def test_dppo_kl_finite_when_pi_reaches_one():
    # float32 rounds p to 1 near log p = 0: the binary KL is +inf there (masked on the A > 0 side), never nan
    logp = torch.tensor([[0.0, -1e-9]], requires_grad=True)
    old = torch.tensor([[-0.5, -0.5]])
    loss, st = policy_loss("dppo_kl", logp, old, torch.tensor([1.0]), torch.ones(1, 2), max_tokens=2,
                           eps_low=0.05, eps_high=0.05)
    assert torch.isfinite(loss) and torch.isfinite(grad(loss, logp)).all() and st["clip/frac_high"] == 1.0


def test_topr_hand_worked():
    # seq 0, A = -1, d = [0.2, 0.1]: pi/pi_old = e^0.3 > 1 -> weight 1 (capped): gradient +1/(B max_tokens) per token
    # seq 1, A = -1, d = [-0.5]: weight e^-0.5; seq 2, A = +2, d = [0.4]: no weight (2 per token)
    logp = torch.tensor([[0.2, 0.1], [-0.5, 0.0], [0.4, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1], [1, 0], [1, 0]], dtype=F64)
    loss, st = policy_loss("topr", logp, torch.zeros(3, 2, dtype=F64), torch.tensor([-1.0, -1.0, 2.0], dtype=F64),
                           mask, max_tokens=2)
    w = math.exp(-0.5)
    assert loss.item() == pytest.approx(-(-(0.2 + 0.1) - w * -0.5 + 2 * 0.4) / 6)
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[1 / 6, 1 / 6], [w / 6, 0], [-2 / 6, 0]], dtype=F64))
    assert st["clip/frac_low"] == pytest.approx(2 / 4) and st["clip/frac_high"] == 0.0  # seq 0's two tokens


def cov_by_hand(logp, adv, mask):
    """{(i, t): (A - mean A)(log pi - mean log pi)}, means over the batch's tokens, python floats."""
    toks = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]
    a = {k: float(adv[k[0]] if adv.dim() == 1 else adv[k]) for k in toks}
    lp = {k: float(logp[k]) for k in toks}
    ma, ml = sum(a.values()) / len(toks), sum(lp.values()) / len(toks)
    return {k: (a[k] - ma) * (lp[k] - ml) for k in toks}


def test_kl_cov_penalises_the_top_covariance_tokens():
    logp, old, mask, a = make_batch(2, noise=0.4)
    n_tok = 9
    for ratio in (0.1, 0.3):  # int(0.9) -> at least 1 token; int(2.7) = 2 tokens
        loss, st = policy_loss("kl_cov", logp, old, a, mask, kl_cov_ratio=ratio, kl_cov_coef=0.7)
        cov = cov_by_hand(logp.detach(), a, mask)
        top = sorted(cov, key=cov.get, reverse=True)[:max(int(ratio * n_tok), 1)]
        objs = [[torch.exp(logp[i, t] - old[i, t]) * a[i] - (0.7 * (logp[i, t] - old[i, t]).abs() if (i, t) in top else 0)
                 for t in range(L)] for i, L in enumerate(LENGTHS)]
        ref = reduce_loops(objs, "token_mean")
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(grad(loss, logp), grad(ref, logp))
        assert st["clip/frac_cov"] == pytest.approx(len(top) / n_tok) and st["clip/frac"] == 0.0


def test_clip_cov_cuts_exactly_the_candidate_tokens():
    # one batch of 2 sequences, all ratios 1 (no PPO clip); covariances by hand select the candidates
    logp, old, mask, a = make_batch(3, noise=0.0)
    logp = logp.detach().clone()
    logp[mask > 0] = torch.tensor([-3.0, -0.2, -0.3, -0.1, -3.5, -0.4, -2.5, -0.1, -0.2], dtype=F64)
    old = logp.clone()
    logp.requires_grad_()
    adv = torch.tensor([2.0, -2.0, 0.5], dtype=F64)
    cov = cov_by_hand(logp.detach(), adv, mask)
    cands = {k for k, v in cov.items() if 1.0 < v < 5.0}
    assert 0 < len(cands) < 9
    # ratio 1: every candidate is cut (their gradient is 0), the rest keep REINFORCE's gradient -A / #tokens
    loss, st = policy_loss("clip_cov", logp, old, adv, mask, clip_cov_ratio=1.0)
    g = grad(loss, logp)
    for (i, t) in cov:
        assert g[i, t].item() == pytest.approx(0.0 if (i, t) in cands else -float(adv[i]) / 9)
    assert st["clip/frac_cov"] == pytest.approx(len(cands) / 9) and st["clip/frac"] == 0.0
    # a small ratio cuts exactly one of them (max(1, int(ratio * 9)))
    loss, st = policy_loss("clip_cov", logp, old, adv, mask, clip_cov_ratio=1e-4)
    g = grad(loss, logp)
    cut = [k for k in cov if g[k].item() == 0.0]
    assert len(cut) == 1 and cut[0] in cands and st["clip/frac_cov"] == pytest.approx(1 / 9)


def test_cov_ratios_are_checked():
    logp, old, mask, a = make_batch()
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        policy_loss("clip_cov", logp, old, a, mask, clip_cov_ratio=0.0)


# ---------------------------------------------------------------- against verl's formulas
# verl cannot be a test dependency (it is not installed), so its functions are re-stated here, minimal
# and faithful, from verl/trainer/ppo/core_algos.py at commit 1dda039b9c6311889a9c9a26040677e1254814f9
# (github.com/verl-project/verl): compute_policy_loss_dppo_tv / _dppo_kl / _clip_cov / _kl_cov / _gpg and
# agg_loss. Differences to gspo that do not change these numbers: verl clamps the log-ratio to [-20, 20]
# (never reached here) and adds 1e-8 inside the binary KL's logs (gspo is exact, see docs/algorithms.md).


def _vmean(x, m):
    return (x * m).sum() / m.sum()


def verl_agg(loss_mat, m, mode, scale=None):
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    seq = (loss_mat * m).sum(-1)
    return seq.sum() / (m.sum(-1) > 0).float().sum() / scale  # seq-mean-token-sum-norm, loss_scale_factor


def verl_dppo(kind, old, logp, adv, m, low, high, c=20.0, mode="token-mean", scale=None):
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    tr = torch.clamp(ratio, max=c).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old)
    if kind == "tv":
        pos, neg = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        bkl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        pos, neg = (bkl <= high) | (prob <= old_prob), (bkl <= low) | (prob >= old_prob)
    valid = torch.where(adv > 0, pos, neg).detach().float()
    return verl_agg(-adv * tr * logp * valid, m, mode, scale), _vmean(1.0 - valid, m)


def verl_clip_cov(old, logp, adv, m, low, high, ratio_c, lb, ub):
    ratio = torch.exp(logp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    by_origin = (l2 > l1) & (m > 0)
    cov = (adv - _vmean(adv, m)) * (logp - _vmean(logp.detach(), m))
    cov[m == 0] = -torch.inf
    cov[by_origin] = -torch.inf
    n = max(int(ratio_c * m.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (m > 0))
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx))[: min(n, len(idx))]]
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return verl_agg(torch.maximum(l1, l2) * corr, m, "token-mean"), _vmean((corr == 0).float(), m)


def verl_kl_cov(old, logp, adv, m, ratio_k, coef):
    d = logp - old
    pg, pg_kl = -adv * torch.exp(d), -adv * torch.exp(d) + coef * d.abs()
    valid_idx = torch.nonzero((m > 0).reshape(-1), as_tuple=True)[0]
    va, vl = adv[m > 0].detach().reshape(-1), logp[m > 0].detach().reshape(-1)
    cov = (va - va.mean()) * (vl - vl.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * ratio_k)), largest=True).indices]
    rows, cols = top // adv.shape[1], top % adv.shape[1]
    pg = pg.clone()
    pg[rows, cols] = pg_kl[rows, cols]
    return verl_agg(pg, m, "token-mean")


def peer_batch(seed, noise=0.5):
    """make_batch with finite padding (verl multiplies padding by the mask: -inf would give nan) and token advantages."""
    logp, old, mask, a = make_batch(seed, noise, probs=True)
    logp = torch.where(mask > 0, logp.detach(), torch.zeros_like(mask)).requires_grad_()
    old = torch.where(mask > 0, old, torch.zeros_like(mask))
    return logp, old, mask, a.unsqueeze(1).expand(B, T).contiguous()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dppo_equals_verl(seed):
    logp, old, mask, adv = peer_batch(seed, noise=0.6)
    for kind, eps in (("tv", 0.15), ("kl", 0.05)):
        for c, mode, agg in ((20.0, "token-mean", "token_mean"), (1.2, "seq-mean-token-sum-norm", None)):
            ours, st = policy_loss(f"dppo_{kind}", logp, old, adv, mask, eps_low=eps, eps_high=eps, clip_ratio_c=c,
                                   agg=agg, max_tokens=7)
            theirs, clipfrac = verl_dppo(kind, old, logp, adv, mask, eps, eps, c, mode, scale=7)
            torch.testing.assert_close(ours, theirs)
            torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))
            assert st["clip/frac"] == pytest.approx(float(clipfrac))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_and_kl_cov_equal_verl(seed):
    logp, old, mask, adv = peer_batch(seed, noise=0.1)
    adv = adv * 4
    for ratio in (1e-4, 0.3):
        torch.manual_seed(seed)  # both draw the cut tokens from the global generator, the same way
        ours, st = policy_loss("clip_cov", logp, old, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=0.1)
        torch.manual_seed(seed)
        theirs, clipfrac = verl_clip_cov(old, logp, adv, mask, 0.2, 0.2, ratio, 0.1, 5.0)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))
        assert st["clip/frac_cov"] == pytest.approx(float(clipfrac)) and st["clip/frac_cov"] > 0
        ours, _ = policy_loss("kl_cov", logp, old, adv, mask, kl_cov_ratio=ratio, kl_cov_coef=0.5)
        theirs = verl_kl_cov(old, logp, adv, mask, ratio, 0.5)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))
    ours, _ = policy_loss("gpg", logp, old, adv, mask)  # verl compute_policy_loss_gpg: -log_prob * A, token mean
    theirs = verl_agg(-logp * adv, mask, "token-mean")
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad(ours, logp), grad(theirs, logp))


# --------------------------------------------------------------------------- DPPO-TopK


def test_topk_divergence_by_hand():
    """The sampler keeps p = (0.5, 0.3) on its top-2 (rest 0.2); the policy gives them q = (0.4, 0.4) (rest 0.2).
    TV = (|0.1| + |-0.1| + 0) / 2 = 0.1; KL(P || Q) = 0.5 ln(5/4) + 0.3 ln(3/4) + 0.2 ln 1 = 0.025268."""
    from gspo.algos.losses import topk_divergence

    old = torch.tensor([[[0.5, 0.3]]]).log()
    new = torch.tensor([[[0.4, 0.4]]]).log()
    assert topk_divergence(old, new, "tv").item() == pytest.approx(0.1, abs=1e-6)
    assert topk_divergence(old, new, "kl").item() == pytest.approx(0.5 * math.log(1.25) + 0.3 * math.log(0.75), abs=1e-6)
    # the rest bucket counts: q = (0.5, 0.1), rest 0.4 against 0.2 -> TV (0 + 0.2 + 0.2) / 2 = 0.2
    assert topk_divergence(old, torch.tensor([[[0.5, 0.1]]]).log(), "tv").item() == pytest.approx(0.2, abs=1e-6)


def test_dppo_topk_masks_where_the_topk_divergence_left_the_region():
    """One token, sampler prob 0.5 (its top-2: the token and another at 0.3). The policy moved the token to p and
    the other to 0.3: TV = |p - 0.5| (the rest takes the opposite change). A = +1: p = 0.6 stays inside (TV 0.1 <=
    0.15), gradient -w A = -1.2 as in DPPO-TV; p = 0.7 left upwards (0.2 > 0.15): masked. A = -1 and p = 0.3 left
    downwards: masked; the same with the KL divergence and a threshold between the two KLs."""
    from gspo.algos.losses import topk_divergence

    for p, a, g in ((0.6, 1.0, -1.2), (0.7, 1.0, 0.0), (0.3, -1.0, 0.0), (0.4, -1.0, 0.8 * 1.0)):
        logp = torch.tensor([[math.log(p)]], requires_grad=True)
        old = torch.tensor([[math.log(0.5)]])
        top_old, top_new = torch.tensor([[[0.5, 0.3]]]).log(), torch.tensor([[[p, 0.3]]]).log()
        loss, st = policy_loss("dppo_topk", logp, old, torch.tensor([a]), torch.ones(1, 1), eps_low=0.15,
                               eps_high=0.15, max_tokens=1, topk_old_logp=top_old, topk_logp=top_new)
        assert grad(loss, logp).item() == pytest.approx(g, abs=1e-6), p
        assert loss.item() == pytest.approx(-(p / 0.5) * a * math.log(p) if g else 0.0, abs=1e-6)
    kl_06 = topk_divergence(torch.tensor([[[0.5, 0.3]]]).log(), torch.tensor([[[0.6, 0.3]]]).log(), "kl").item()
    kl_07 = topk_divergence(torch.tensor([[[0.5, 0.3]]]).log(), torch.tensor([[[0.7, 0.3]]]).log(), "kl").item()
    for p, g in ((0.6, -1.2), (0.7, 0.0)):
        logp = torch.tensor([[math.log(p)]], requires_grad=True)
        loss, _ = policy_loss("dppo_topk", logp, torch.tensor([[math.log(0.5)]]), torch.tensor([1.0]), torch.ones(1, 1),
                              eps_low=(kl_06 + kl_07) / 2, eps_high=(kl_06 + kl_07) / 2, max_tokens=1,
                              topk_old_logp=torch.tensor([[[0.5, 0.3]]]).log(),
                              topk_logp=torch.tensor([[[p, 0.3]]]).log(), topk_divergence="kl")
        assert grad(loss, logp).item() == pytest.approx(g, abs=1e-6)


def test_the_sampler_keeps_its_topk_and_the_trainer_reads_the_same_tokens():
    """rollout.keep_topk=k: each position's k most likely tokens under the sampling distribution (temperature
    applied), the sampled token always among them; the trainer's log-probs of those tokens at the same weights
    are the sampler's (float32: to 1e-5)."""
    from gspo.models.build import build_model, char_tokenizer
    from gspo.config.loading import compose
    from gspo.rollout.decoding.generate import generate, token_logprobs
    from gspo.rollout.decoding.params import SamplingParams

    tok = char_tokenizer("0123456789+=")
    cfg = compose(["model=qwen3-tiny"])
    model = build_model(cfg.model, len(tok), tok, seed=0).eval()
    with torch.no_grad():
        r = generate(model, tok, ["12+3=", "7+8="], 4, SamplingParams(5, temperature=0.7, keep_topk=3),
                     generator=torch.Generator().manual_seed(0))
        m = r.completion_mask.bool()
        assert r.topk_ids.shape == (8, r.completion_mask.shape[1], 3)
        assert (r.topk_ids == r.completion_ids[..., None]).any(-1)[m].all()  # the sampled token is kept
        logp, _, _, top = token_logprobs(model, r, temperature=0.7, topk=True)
    torch.testing.assert_close(top[m], r.topk_logp[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(logp[m], r.sampler_logp[m], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- TRL's entropy knobs (gspo/algos/entropy.py)


def test_high_entropy_mask_by_hand():
    """Tokens' entropies 0.1 .. 0.6 (padding 9.0 ignored). rho = 0.5: threshold = the 0.5 quantile of the six,
    linearly interpolated = 0.35; kept 0.4, 0.5, 0.6. rho = 0: only the largest; rho = 1: all."""
    from gspo.algos.entropy import high_entropy_mask

    ent = torch.tensor([[0.1, 0.5, 9.0], [0.6, 0.2, 0.3], [0.4, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert high_entropy_mask(ent, mask, 0.5).tolist() == [[False, True, False], [True, False, False], [True, False, False]]
    assert high_entropy_mask(ent, mask, 0.0).sum() == 1 and high_entropy_mask(ent, mask, 0.0)[1, 0]
    assert torch.equal(high_entropy_mask(ent, mask, 1.0), mask.bool())
    assert not high_entropy_mask(ent, torch.zeros_like(mask), 0.5).any()
    # the quantile over every process's tokens: a gather that adds another rank's low entropies lowers the bar
    more = high_entropy_mask(ent, mask, 0.5, gather=lambda x: torch.cat([x, torch.zeros(6)]))
    assert more.sum() == 6


def test_entropy_bonus_is_the_mean_over_the_kept_tokens_with_its_gradient():
    from gspo.algos.entropy import entropy_bonus

    ent = torch.tensor([[1.0, 2.0, 7.0]], requires_grad=True)
    total, n = entropy_bonus(ent, torch.tensor([[1.0, 1.0, 0.0]]))
    assert total.item() == 3.0 and n.item() == 2.0
    assert grad(total / n, ent).tolist() == [[0.5, 0.5, 0.0]]


def _on_two_ranks(name: str, logp, old, adv, mask, split: int, **hyper) -> list:
    """`policy_loss` on rows [:split] and [split:] in two threads standing for two ranks, whose `gather` exchanges
    their token values as `Dist.all_gather_rows` does (concatenated in rank order, and where the caller's begin)."""
    import threading

    sent: list = [None, None]
    barrier = threading.Barrier(2)

    def gather(rank: int):
        def exchange(x):
            sent[rank] = x
            barrier.wait()
            both = torch.cat([sent[0], sent[1]])
            lo = 0 if rank == 0 else len(sent[0])
            barrier.wait()  # both have read before either sends again
            return both, lo
        return exchange

    out: list = [None, None]

    def run(rank: int) -> None:
        rows = slice(0, split) if rank == 0 else slice(split, None)
        lp = logp[rows].detach().requires_grad_()
        loss, _ = policy_loss(name, lp, old[rows], adv[rows], mask[rows], gather=gather(rank),
                              generator=torch.Generator().manual_seed(0), **hyper)
        loss.backward()
        out[rank] = (loss.detach(), lp.grad, mask[rows].sum())

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("name, hyper", [
    ("m2po", {"m2_threshold": 2e-2}),
    ("clip_cov", {"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}),
    ("kl_cov", {"kl_cov_ratio": 0.2, "kl_cov_coef": 3.0}),
])
def test_a_batch_statistic_over_two_ranks_is_the_one_process_statistic(name, hyper):
    """M2PO's second moment, Clip-Cov's and KL-Cov's covariance, token counts and picks are statistics of the
    minibatch: on two ranks each holding some of its rows, the loss (token-weighted) and every row's gradient are
    what one process computes, and they are not what each rank alone would compute."""
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(8, 6, generator=g)
    rows = torch.arange(8.0)
    old = logp + 0.05 * torch.randn(8, 6, generator=g) * (1 + rows[:, None])  # the halves' statistics differ
    adv = torch.randn(8, generator=g) + rows * 0.3
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    lp = logp.clone().requires_grad_()
    one, _ = policy_loss(name, lp, old, adv, mask, generator=torch.Generator().manual_seed(0), **hyper)
    one.backward()
    (l0, g0, n0), (l1, g1, n1) = _on_two_ranks(name, logp, old, adv, mask, 3, **hyper)
    assert float((l0 * n0 + l1 * n1) / (n0 + n1)) == pytest.approx(float(one), rel=1e-6)
    n = mask.sum()
    torch.testing.assert_close(torch.cat([g0 * n0 / n, g1 * n1 / n]), lp.grad, rtol=1e-5, atol=1e-7)
    alone = [policy_loss(name, logp[r], old[r], adv[r], mask[r], generator=torch.Generator().manual_seed(0), **hyper)[0]
             for r in (slice(0, 3), slice(3, None))]
    assert float((alone[0] * n0 + alone[1] * n1) / n) != pytest.approx(float(one), rel=1e-3)

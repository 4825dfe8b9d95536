"""Group-relative advantages, each against numbers worked by hand (two groups of G = 4)."""

import itertools
import math

import pytest
import torch

from gspo.algos.advantages import GROUP_BASELINED, compute_advantages, register_advantage

# group 0: one right answer of four; group 1: rewards 0, 0.1, 1, 1 (TinyZero-style partial credit)
R = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.1, 1.0, 1.0])
G = 4


def test_grpo_zscore_unbiased_std():
    # group 0: mean 0.25, unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
    a = compute_advantages("grpo", R, G)
    assert a[:4].tolist() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001])
    # group 1: mean 0.525, std = sqrt(sum (r - 0.525)^2 / 3)
    dev = [-0.525, -0.425, 0.475, 0.475]
    std = math.sqrt(sum(x * x for x in dev) / 3)
    assert a[4:].tolist() == pytest.approx([x / (std + 1e-4) for x in dev])


def test_grpo_equal_rewards_give_zero():
    assert compute_advantages("grpo", torch.ones(4), 4).tolist() == [0.0] * 4


def test_drgrpo_no_std():
    a = compute_advantages("drgrpo", R, G)
    assert a.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -0.525, -0.425, 0.475, 0.475])


def test_rloo_leave_one_out():
    # r_i - mean of the other three
    a = compute_advantages("rloo", R, G)
    assert a[:4].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert a[4:].tolist() == pytest.approx([0 - 2.1 / 3, 0.1 - 2.0 / 3, 1 - 1.1 / 3, 1 - 1.1 / 3])


def test_batch_std():
    # group means removed, scale = unbiased std of all 8 rewards
    m = sum(R.tolist()) / 8
    std = math.sqrt(sum((x - m) ** 2 for x in R.tolist()) / 7)
    centred = [0.75, -0.25, -0.25, -0.25, -0.525, -0.425, 0.475, 0.475]
    assert compute_advantages("batch_std", R, G).tolist() == pytest.approx([c / (std + 1e-4) for c in centred])


def test_best_of_group_marks_first_argmax():
    # group 1 has a tie at 1.0: the first (index 6) wins
    assert compute_advantages("best_of_group", R, G).tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert compute_advantages("best_of_group", torch.zeros(4), 4).tolist() == [1, 0, 0, 0]


def test_softmax_within_group():
    a = compute_advantages("softmax", R, G)
    z0 = math.e + 3
    assert a[:4].tolist() == pytest.approx([math.e / z0, 1 / z0, 1 / z0, 1 / z0])
    z1 = 1 + math.exp(0.1) + 2 * math.e
    assert a[4:].tolist() == pytest.approx([1 / z1, math.exp(0.1) / z1, math.e / z1, math.e / z1])


def test_integer_rewards_accepted():
    assert compute_advantages("drgrpo", torch.tensor([1, 0]), 2).tolist() == [0.5, -0.5]


def test_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*grpo.*rloo"):
        compute_advantages("gae", R, G)
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages("grpo", R, 3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("rloo", R, 1)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r: r)


# ---------------------------------------------------------------- REINFORCE++, GPG, pass@k

CENTRED = [0.75, -0.25, -0.25, -0.25, -0.525, -0.425, 0.475, 0.475]  # R minus its group mean


def unbiased_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_reinforce_plus_plus_batch_normalised():
    r = R.tolist()
    m, std = sum(r) / 8, unbiased_std(r)
    assert compute_advantages("reinforce_plus_plus", R, G).tolist() == pytest.approx([(x - m) / (std + 1e-4) for x in r])
    # no group needed: works with groups of one
    assert compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), 1).tolist() == pytest.approx(
        [0.5 / (unbiased_std([1, 0]) + 1e-4), -0.5 / (unbiased_std([1, 0]) + 1e-4)])


def test_reinforce_plus_plus_baseline_group_mean_then_batch_std():
    std = unbiased_std(CENTRED)  # the centred rewards have batch mean 0 already
    a = compute_advantages("reinforce_plus_plus_baseline", R, G)
    assert a.tolist() == pytest.approx([c / (std + 1e-4) for c in CENTRED])
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)


def test_gpg_rescales_by_the_informative_share():
    # both groups informative: alpha = 8 / 8 = 1; a third, all-equal group makes M = 4: alpha = 12 / 8
    assert compute_advantages("gpg", R, G).tolist() == pytest.approx(CENTRED)
    r3 = torch.cat([R, torch.ones(4)])
    assert compute_advantages("gpg", r3, G).tolist() == pytest.approx([1.5 * c for c in CENTRED] + [0.0] * 4)
    assert compute_advantages("gpg", torch.ones(8), G).tolist() == [0.0] * 8  # nothing informative: no blow-up


def test_grpo_passk_only_the_best_learns():
    # group 0: best 1 (index 0), second 0, std 0.5 -> 1 / 0.5001; group 1: best 1 == second 1 -> gap 0
    a = compute_advantages("grpo_passk", R, G)
    assert a.tolist() == pytest.approx([1 / 0.5001, 0, 0, 0, 0, 0, 0, 0])
    b = compute_advantages("grpo_passk", torch.tensor([0.0, 0.2, 1.0, 0.5]), 4)
    assert b.tolist() == pytest.approx([0, 0, 0.5 / (unbiased_std([0, 0.2, 1, 0.5]) + 1e-4), 0])


def passk_binary(rewards, k):
    """The paper's closed form for 0/1 rewards (arXiv 2508.10751): A_pos, A_neg from binomial coefficients."""
    n, n_neg = len(rewards), rewards.count(0)
    mean = 1 - math.comb(n_neg, k) / math.comb(n, k)
    sigma = math.sqrt(mean * (1 - mean))
    a_pos = (1 - mean) / (sigma + 1e-4)
    a_neg = (1 - mean - math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1)) / (sigma + 1e-4)
    return [a_pos if x == 1 else a_neg for x in rewards]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_passk_binary_rewards_match_the_paper(k):
    groups = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 1, 1]]
    a = compute_advantages("passk", torch.tensor(sum(groups, []), dtype=torch.float64), 6, passk_k=k)
    assert a.tolist() == pytest.approx(sum((passk_binary(g, k) for g in groups), []))


def test_passk_general_rewards_by_enumeration():
    # any reward: subsets score their max; E[max | i in subset] and the mean / population std, all by enumeration
    r = [0.0, 0.1, 1.0, 0.5, 0.1]
    k = 3
    subsets = list(itertools.combinations(range(5), k))
    maxes = [max(r[j] for j in s) for s in subsets]
    mean = sum(maxes) / len(maxes)
    std = math.sqrt(sum((x - mean) ** 2 for x in maxes) / len(maxes))
    expect = []
    for i in range(5):
        mine = [mx for s, mx in zip(subsets, maxes) if i in s]
        expect.append((sum(mine) / len(mine) - mean) / (std + 1e-4))
    a = compute_advantages("passk", torch.tensor(r, dtype=torch.float64), 5, passk_k=k)
    assert a.tolist() == pytest.approx(expect)
    with pytest.raises(ValueError, match="passk_k"):
        compute_advantages("passk", R, G, passk_k=5)


# ---------------------------------------------------------------- against verl
# verl is not installed: its estimators re-stated, minimal and faithful, from verl/trainer/ppo/core_algos.py at
# commit 1dda039b9c6311889a9c9a26040677e1254814f9 (github.com/verl-project/verl), on one scalar reward per
# completion (token_level_rewards with the score on one token) and response_mask of the given lengths.


def verl_masked_whiten(x, m, eps=1e-8):
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) ** 2) * m).sum() / m.sum()
    var = var * m.sum() / (m.sum() - 1)  # masked_var's Bessel correction, over tokens
    return (x - mean) * torch.rsqrt(var + eps)


def verl_rpp_baseline(scores, groups, m):
    s = scores.clone()
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        s[idx] = s[idx] - s[idx].mean()
    return verl_masked_whiten(s.unsqueeze(-1) * m, m) * m


def test_reinforce_plus_plus_vs_verl_token_whitening():
    """verl whitens over TOKENS; gspo over completions. With equal lengths L the two differ only in
    Bessel's correction (over n L tokens vs n completions) and the eps: verl = gspo_no_eps * sqrt((nL - 1) / (L (n - 1)))."""
    n, L = 8, 3
    m = torch.ones(n, L, dtype=torch.float64)
    r = R.to(torch.float64)
    theirs = verl_rpp_baseline(r, [i // G for i in range(n)], m)[:, 0]
    c = torch.tensor(CENTRED, dtype=torch.float64)
    ours_no_eps = c / c.std()
    torch.testing.assert_close(theirs, ours_no_eps * math.sqrt((n * L - 1) / (L * (n - 1))), rtol=1e-6, atol=1e-7)
    ours = compute_advantages("reinforce_plus_plus_baseline", r, G)
    torch.testing.assert_close(ours, c / (c.std() + 1e-4))
    # unequal lengths: verl weights each completion by its length, gspo does not (docs/algorithms.md)
    m2 = m.clone()
    m2[0, 1:] = 0
    assert not torch.allclose(verl_rpp_baseline(r, [i // G for i in range(n)], m2)[1:, 0], theirs[1:])


def verl_grpo_passk(scores, groups, eps):
    adv = torch.zeros_like(scores)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        rw = scores[idx]
        top, top_idx = torch.topk(rw, 2)
        adv[idx[int(top_idx[0])]] = (top[0] - top[1]) / (torch.std(rw) + eps)
    return adv


def test_grpo_passk_equals_verl_up_to_the_std_eps():
    r = torch.tensor([0.0, 0.3, 1.0, 0.5, 1.0, 0.0, 0.0, 0.1], dtype=torch.float64)
    groups = [i // 4 for i in range(8)]
    torch.testing.assert_close(compute_advantages("grpo_passk", r, 4), verl_grpo_passk(r, groups, 1e-4))


@pytest.mark.parametrize("name", sorted(GROUP_BASELINED))
def test_an_all_equal_group_gets_exactly_zero(name):
    """A float32 mean of eight 0.1s is not 0.1: without the explicit zero, GRPO gave -7.5e-5 here."""
    r = torch.tensor([0.1] * 8 + [0.3] * 8 + [0.0] * 7 + [1.0])
    adv = compute_advantages(name, r, 8, passk_k=2)
    assert adv[:16].tolist() == [0.0] * 16
    assert (adv[16:] != 0).any()


def test_verls_own_choices_are_options_whose_defaults_stay_gspos():
    """algo.whiten=tokens gives verl 0.9.1's REINFORCE++-baseline exactly, unequal lengths included (each completion
    weighted by its length); algo.std_eps=1e-6 gives verl's GRPO / grpo_passk std eps. The defaults stay gspo's."""
    torch.manual_seed(0)
    n, G = 8, 4
    r = torch.rand(n, dtype=torch.float64)
    lengths = torch.tensor([3, 1, 4, 2, 5, 2, 3, 1])
    m = (torch.arange(5)[None, :] < lengths[:, None]).double()
    groups = [i // G for i in range(n)]
    theirs = verl_rpp_baseline(r, groups, m)
    ours = compute_advantages("reinforce_plus_plus_baseline", r, G, whiten="tokens", lengths=lengths)
    torch.testing.assert_close(ours[:, None] * m, theirs)
    assert not torch.allclose(compute_advantages("reinforce_plus_plus_baseline", r, G), ours)  # the default differs
    torch.testing.assert_close(compute_advantages("grpo_passk", r, G, std_eps=1e-6), verl_grpo_passk(r, groups, 1e-6))
    g = r.view(-1, G)
    torch.testing.assert_close(compute_advantages("grpo", r, G, std_eps=1e-6),
                               ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).reshape(-1))

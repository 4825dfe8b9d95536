"""Student-t, Welch and paired intervals, McNemar, bootstraps, probability of improvement and power,
checked against closed forms and hand-worked numbers."""

import math

import pytest

from gspo.results.stats import (
    betainc,
    bootstrap_diff,
    bootstrap_paired,
    bootstrap_problems,
    detectable,
    detectable_accuracy,
    mcnemar,
    mcnemar_p,
    mean_ci,
    nct_cdf,
    paired,
    pooled_sd,
    prob_improvement,
    problems_needed,
    seeds_needed,
    t_cdf,
    t_power,
    t_quantile,
    welch,
)


def test_t_quantile_closed_forms():
    # df = 1 (Cauchy): tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p))
    for p in (0.6, 0.9, 0.975, 0.995):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764451052, rel=1e-9)  # tables
    assert t_quantile(0.975, 1e8) == pytest.approx(1.9599639845, rel=1e-6)  # the normal limit
    assert t_quantile(0.025, 3) == pytest.approx(-t_quantile(0.975, 3))
    assert t_cdf(t_quantile(0.975, 2.88), 2.88) == pytest.approx(0.975, abs=1e-12)  # non-integer df
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_incomplete_beta_by_hand():
    # I_x(1, 1) = x; I_x(2, 1) = x^2; I_x(1, 2) = 1 - (1 - x)^2
    for x in (0.1, 0.5, 0.9):
        assert betainc(1, 1, x) == pytest.approx(x)
        assert betainc(2, 1, x) == pytest.approx(x * x)
        assert betainc(1, 2, x) == pytest.approx(1 - (1 - x) ** 2)


def test_three_seeds_give_the_t_interval():
    # 0.5, 0.6, 0.7: mean 0.6, s = 0.1, t(0.975, 2) = 4.302653 -> 0.6 ± 0.248414
    mean, half = mean_ci([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and half == pytest.approx(4.3026527297 * 0.1 / math.sqrt(3), rel=1e-9)
    assert half == pytest.approx(0.248414, abs=1e-6)
    assert mean_ci([0.5]) is None


def test_welch_by_hand():
    # equal n and variances: df = 2n - 2 = 4, se = sqrt(2 * 0.01 / 3)
    w = welch([0.5, 0.6, 0.7], [0.2, 0.3, 0.4])
    assert w.diff == pytest.approx(0.3) and w.df == pytest.approx(4.0)
    assert w.half_width == pytest.approx(2.7764451052 * math.sqrt(0.02 / 3), rel=1e-9)
    # unequal: va = 0.01/3, vb = 0.005/2; df = (va + vb)^2 / (va^2/2 + vb^2/1) = 2.882353
    w = welch([0.5, 0.6, 0.7], [0.3, 0.4])
    va, vb = 0.01 / 3, 0.005 / 2
    assert w.diff == pytest.approx(0.25) and w.df == pytest.approx((va + vb) ** 2 / (va**2 / 2 + vb**2))
    assert w.df == pytest.approx(2.8823529, rel=1e-7)
    assert w.half_width == pytest.approx(t_quantile(0.975, w.df) * math.sqrt(va + vb))
    assert (w.n_a, w.n_b) == (3, 2) and w.low < w.diff < w.high
    # no spread on either side: a point, no df; fewer than 2 values: no interval
    flat = welch([0.5, 0.5], [0.4, 0.4])
    assert flat.diff == pytest.approx(0.1) and flat.half_width == 0.0 and flat.df is None
    assert welch([0.5], [0.4, 0.5]) is None


# ---------------------------------------------------------------------------------------------
# Paired t, McNemar, bootstrap, probability of improvement, power. Expected values are worked
# by hand in the comments (reference values marked "scipy" were computed once with scipy and
# written in; scipy is not used here).


Z975 = 1.959963984540054  # Φ⁻¹(0.975)


def test_paired_t_by_hand():
    # a = [0.30, 0.35, 0.40], b = [0.28, 0.30, 0.41] on seeds 0, 1, 2 (seed 3 only in a: left out)
    # d = [0.02, 0.05, -0.01]; mean 0.02; deviations [0, 0.03, -0.03]; SS = 0.0018; s² = 0.0018/2 = 0.0009
    # s = 0.03; se = 0.03/sqrt(3) = 0.017320508; half = t(0.975, 2) · se = 4.3026527297 · 0.017320508 = 0.0745241
    p = paired({0: 0.30, 1: 0.35, 2: 0.40, 3: 0.9}, {2: 0.41, 0: 0.28, 1: 0.30})
    assert p.diff == pytest.approx(0.02) and (p.n, p.df, p.seeds) == (3, 2, (0, 1, 2))
    assert p.half_width == pytest.approx(4.3026527297 * 0.03 / math.sqrt(3), rel=1e-9)
    assert p.half_width == pytest.approx(0.0745241, abs=1e-7)
    assert p.low == pytest.approx(-0.0545241, abs=1e-7) and p.high == pytest.approx(0.0945241, abs=1e-7)
    # the same shift on every seed: a point; fewer than 2 shared seeds: nothing
    flat = paired({1: 0.5, 2: 0.7}, {1: 0.4, 2: 0.6})
    assert flat.diff == pytest.approx(0.1) and flat.half_width == 0.0
    assert paired({1: 0.5, 2: 0.7}, {2: 0.6, 3: 0.1}) is None


def _outcomes(b, c, both, neither):
    """Two models' per-problem outcomes with b (a right, b wrong), c (a wrong, b right) discordant problems."""
    a = [True] * b + [False] * c + [True] * both + [False] * neither
    bb = [False] * b + [True] * c + [True] * both + [False] * neither
    return a, bb


def test_mcnemar_exact_p_by_hand():
    # b = 8, c = 2: p = 2 · (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 · (1 + 10 + 45) / 1024 = 0.109375
    assert mcnemar_p(8, 2) == pytest.approx(0.109375, abs=1e-15) and mcnemar_p(2, 8) == mcnemar_p(8, 2)
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)  # 2 · C(6,0) / 2^6 = 0.03125
    assert mcnemar_p(5, 5) == 1.0  # 2 · 638/1024 > 1, capped
    assert mcnemar_p(0, 0) == 1.0


def test_mcnemar_intervals_by_hand():
    # N = 50: b = 8, c = 2, 30 both right, 10 both wrong; diff = (8 - 2)/50 = 0.12
    a, b = _outcomes(8, 2, 30, 10)
    # Wald: se = sqrt((8 + 2) - 6²/50)/50 = sqrt(9.28)/50 = 0.0609262; half = 1.959964 · se = 0.1194131
    w = mcnemar(a, b, method="wald")
    assert (w.n, w.b, w.c, w.diff, w.p_value) == (50, 8, 2, pytest.approx(0.12), pytest.approx(0.109375))
    assert w.low == pytest.approx(0.12 - Z975 * math.sqrt(9.28) / 50, rel=1e-12)
    assert (w.low, w.high) == (pytest.approx(0.0005869, abs=1e-7), pytest.approx(0.2394131, abs=1e-7))
    # Agresti-Min: b' = 8.5, c' = 2.5, N' = 52; centre 6/52 = 0.1153846;
    # se = sqrt(11 - 36/52)/52 = sqrt(10.3076923)/52 = 0.0617415; half = 1.959964 · se = 0.1210112
    am = mcnemar(a, b)
    assert am.method == "agresti-min" and am.diff == pytest.approx(0.12)
    assert am.low == pytest.approx(6 / 52 - Z975 * math.sqrt(11 - 36 / 52) / 52, rel=1e-12)
    assert (am.low, am.high) == (pytest.approx(-0.0056266, abs=1e-7), pytest.approx(0.2363958, abs=1e-7))
    # no disagreement on 20 problems: Wald is the point 0; Agresti-Min 0 ± 1.959964 · sqrt(1)/22 = ± 0.0890893
    same = [True] * 12 + [False] * 8
    assert (mcnemar(same, same, method="wald").low, mcnemar(same, same, method="wald").high) == (0.0, 0.0)
    am0 = mcnemar(same, same)
    assert am0.p_value == 1.0 and am0.high == pytest.approx(0.0890893, abs=1e-7) and am0.low == -am0.high
    # clipped to [-1, 1]; bad input
    assert mcnemar([True] * 3, [False] * 3, method="wald").high <= 1.0
    assert mcnemar([], []) is None
    with pytest.raises(ValueError):
        mcnemar([True], [True, False])
    with pytest.raises(ValueError):
        mcnemar([True], [False], method="exact")


def test_bootstrap_problems():
    # N = 100: b = 8, c = 2 -> d = a - b is +1 eight times, -1 twice, 0 otherwise; mean 0.06.
    # The resampled mean has sd sqrt(var₀(d)/N), var₀(d) = E d² - (E d)² = 0.10 - 0.0036 = 0.0964
    # -> 0.0310484; the normal interval 0.06 ± 1.96 · 0.0310484 = [-0.0009, 0.1209], and the resampled
    # means are multiples of 0.01, so the percentile interval is [0.00, 0.12] give or take one step.
    a, b = _outcomes(8, 2, 60, 30)
    r = bootstrap_problems(a, b)
    assert r.estimate == pytest.approx(0.06) and r.resamples == 10_000 and r.level == 0.95
    assert r.low == pytest.approx(0.0, abs=0.0101) and r.high == pytest.approx(0.12, abs=0.0101)
    assert bootstrap_problems(a, b, seed=0) == r  # deterministic given the seed
    # two problems, d = [1, 0]: the resampled mean is 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4,
    # so with 10,000 resamples the 2.5% and 97.5% quantiles are 0 and 1
    two = bootstrap_problems([True, False], [False, False])
    assert (two.estimate, two.low, two.high) == (0.5, 0.0, 1.0)
    # the same answers everywhere: the point 0; pass rates are accepted too
    same = bootstrap_problems([1, 0, 1], [1, 0, 1])
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)
    assert bootstrap_problems([0.5, 0.25], [0.25, 0.25]).estimate == pytest.approx(0.125)
    assert bootstrap_problems([], []) is None
    with pytest.raises(ValueError):
        bootstrap_problems([1], [1, 0])


def test_bootstrap_over_seeds():
    # unpaired, two seeds a side: a = [0, 1], b = [0, 0]: mean(a*) is 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4
    r = bootstrap_diff([0.0, 1.0], [0.0, 0.0])
    assert (r.estimate, r.low, r.high) == (0.5, 0.0, 1.0)
    pt = bootstrap_diff([1.0, 1.0, 1.0], [0.0, 0.0])
    assert (pt.estimate, pt.low, pt.high) == (1.0, 1.0, 1.0)
    # ten seeds a side, a = 0.0, 0.1, ..., 0.9 and b = a - 0.2: diff 0.2; the resampled difference has
    # sd sqrt(2 · var₀/10) with var₀ = (10² - 1)/12 · 0.1² = 0.0825 -> 0.128452; normal interval
    # 0.2 ± 1.96 · 0.128452 = [-0.0518, 0.4518] (the percentile one moves in steps of 0.01)
    a = [i / 10 for i in range(10)]
    r = bootstrap_diff(a, [x - 0.2 for x in a], seed=1)
    assert r.estimate == pytest.approx(0.2)
    assert r.low == pytest.approx(-0.0518, abs=0.015) and r.high == pytest.approx(0.4518, abs=0.015)
    assert bootstrap_diff(a, [x - 0.2 for x in a], seed=1) == r
    assert bootstrap_diff([0.5], [0.4, 0.5]) is None
    # paired over the shared seeds 0, 1 (seed 2 only in a): d = [0.3 - 0.2, 0.5 - 0.2] = [0.1, 0.3];
    # each resample is 0.1 (1/4), 0.2 (1/2) or 0.3 (1/4) -> [0.1, 0.3]
    p = bootstrap_paired({0: 0.3, 1: 0.5, 2: 0.9}, {1: 0.2, 0: 0.2})
    assert p.estimate == pytest.approx(0.2) and p.seeds == (0, 1)
    assert (p.low, p.high) == (pytest.approx(0.1), pytest.approx(0.3))
    # a constant shift is a point even though the seeds vary a lot; the unpaired interval is wide
    sa, sb = {s: 0.1 * s + 0.05 for s in range(5)}, {s: 0.1 * s for s in range(5)}
    pp = bootstrap_paired(sa, sb)
    assert (pp.low, pp.high) == (pytest.approx(0.05), pytest.approx(0.05))
    assert bootstrap_diff(list(sa.values()), list(sb.values())).high - 0.05 > 0.05
    assert bootstrap_paired({1: 0.5}, {1: 0.4}) is None


def test_prob_improvement_by_hand():
    # a = [0.3, 0.5, 0.7], b = [0.4, 0.5]: pairs (a_i, b_j) won: 0.3 -> 0; 0.5 -> 1 (vs 0.4) + 1/2 (tie);
    # 0.7 -> 2; U = 3.5 of 3 · 2 = 6 -> 0.583333; and P(b > a) = 1 - 0.583333 = 0.416667
    r = prob_improvement([0.3, 0.5, 0.7], [0.4, 0.5])
    assert r.estimate == pytest.approx(3.5 / 6)
    assert prob_improvement([0.4, 0.5], [0.3, 0.5, 0.7]).estimate == pytest.approx(2.5 / 6)
    # a resample of a that is all 0.3 (probability 1/27 = 3.7% > 2.5%) loses every pair: P* = 0, so low = 0;
    # all 0.7 (also 1/27) wins every pair: P* = 1, so high = 1
    assert (r.low, r.high) == (0.0, 1.0)
    assert prob_improvement([0.3, 0.5, 0.7], [0.4, 0.5]) == r  # deterministic given the seed
    # every a above every b: 1, and so is every resample
    top = prob_improvement([0.9, 0.8], [0.1, 0.2, 0.3])
    assert (top.estimate, top.low, top.high) == (1.0, 1.0, 1.0)
    assert prob_improvement([0.5, 0.5], [0.5]).estimate == 0.5  # all ties
    assert prob_improvement([], [0.5]) is None


def test_noncentral_t_cdf():
    # ncp = 0 is Student's t; at t = 0 it is P(Z + ncp <= 0) = Φ(-ncp) for any df: Φ(-1.3) = 0.0968005
    for df in (1, 3, 30):
        for t in (-2.0, 0.5, 3.0):
            assert nct_cdf(t, df, 0.0) == pytest.approx(t_cdf(t, df), abs=1e-10)
    assert nct_cdf(0.0, 7, 1.3) == pytest.approx(0.0968004845856, abs=1e-10)
    # scipy.stats.nct.cdf(2, 1, 3) = 0.17956249655224, nct.cdf(1.5, 5, 1.2) = 0.58012361369721
    assert nct_cdf(2.0, 1, 3.0) == pytest.approx(0.17956249655224, abs=1e-9)
    assert nct_cdf(1.5, 5, 1.2) == pytest.approx(0.58012361369721, abs=1e-9)


def test_power_textbook():
    # Cohen (1988), power tables for the t test: d = 1, n = 16 per arm, two-sided alpha 0.05 -> power 0.78.
    # Exact: df = 30, ncp = 1 / (1 · sqrt(2/16)) = 2.828427, t_c = t(0.975, 30) = 2.042272;
    # power = P(T' > 2.042272) + P(T' < -2.042272) = 0.7813978 (scipy.stats.nct)
    assert t_power(1.0, 1.0, 16) == pytest.approx(0.7813977925, abs=1e-8)
    # paired, 10 seeds, sd of the differences 1: df = 9, ncp = sqrt(10) = 3.162278 -> 0.8030969 (scipy.stats.nct)
    assert t_power(1.0, 1.0, 10, paired=True) == pytest.approx(0.8030968566, abs=1e-8)
    assert t_power(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-9)  # no difference: the test's size


def test_detectable_and_seeds_needed():
    # n = 16, sd = 1: the ncp with exact power 0.8 at df = 30 is 2.8953583 (scipy: brentq on nct);
    # delta = 2.8953583 · sqrt(2/16) = 1.0236637. The approximation (t(0.975,30) + t(0.8,30)) · sqrt(2/16)
    # = (2.0422725 + 0.8537673) · 0.3535534 = 1.0239047 is 0.02% wide of it.
    d = detectable(1.0, 16)
    assert d == pytest.approx(1.0236637, abs=1e-6)
    assert t_power(d, 1.0, 16) == pytest.approx(0.8, abs=1e-8)
    assert detectable(2.0, 16) == pytest.approx(2 * d)  # proportional to sd
    # paired, n = 10: df = 9, ncp 3.1496329 (scipy) -> 3.1496329 / sqrt(10) = 0.9960014
    assert detectable(1.0, 10, paired=True) == pytest.approx(0.9960014, abs=1e-6)
    # paired, n = 3 (df = 2): ncp 5.6534893 (scipy) -> 5.6534893 / sqrt(3) = 3.2640437; the approximation
    # (4.3026527 + 1.0606602) / sqrt(3) = 3.0965096 is 5% too small
    assert detectable(1.0, 3, paired=True) == pytest.approx(3.2640437, abs=1e-6)
    assert detectable(0.0, 5) == 0.0
    # Cohen (1988), sample-size tables for the t test: d = 1, power 0.8, two-sided 0.05 -> 17 per arm:
    # power(16) = 0.7814 < 0.8 <= power(17) = 0.8070 (scipy.stats.nct, df = 32, ncp = sqrt(8.5))
    assert seeds_needed(1.0, 1.0) == 17
    assert t_power(1.0, 1.0, 17) == pytest.approx(0.8070367151, abs=1e-8)
    assert detectable(1.0, 17) <= 1.0 < detectable(1.0, 16)
    # paired: power(10) = 0.8031 >= 0.8 (above); power(9) < 0.8 since detectable(1, 9) > 1
    assert seeds_needed(1.0, 1.0, paired=True) == 10 and detectable(1.0, 9, paired=True) > 1.0
    assert seeds_needed(1.0, 0.0) == 2
    assert seeds_needed(0.01, 1.0, cap=100) is None  # needs ~157,000 per arm
    with pytest.raises(ValueError):
        seeds_needed(0.0, 1.0)
    with pytest.raises(ValueError):
        detectable(1.0, 1)


def test_pooled_sd_by_hand():
    # a = [0.5, 0.6, 0.7]: SS = 0.02; b = [0.3, 0.4]: SS = 0.005; sqrt(0.025 / 3) = 0.0912871
    assert pooled_sd([0.5, 0.6, 0.7], [0.3, 0.4]) == pytest.approx(math.sqrt(0.025 / 3))
    assert pooled_sd([0.5], [0.3, 0.4]) is None


def test_accuracy_power_by_hand():
    # independent, p = 0.5 -> 0.6: p̄ = 0.55; z_a sqrt(2 · 0.55 · 0.45) = 1.959964 · 0.703562 = 1.378955;
    # z_b sqrt(0.25 + 0.24) = 0.841621 · 0.7 = 0.589135; N = (1.968090 / 0.1)² = 387.3 -> 388
    assert problems_needed(0.1, 0.5) == 388
    # McNemar, discordance 0.2: z_a sqrt(0.2) = 0.876523; z_b sqrt(0.2 - 0.01) = 0.366854;
    # N = (1.243377 / 0.1)² = 154.6 -> 155
    assert problems_needed(0.1, 0.5, discordance=0.2) == 155
    # and back: the smallest gain detectable on those N is just under 0.1, on one problem fewer just over
    assert detectable_accuracy(388, 0.5) <= 0.1 < detectable_accuracy(387, 0.5)
    assert detectable_accuracy(155, 0.5, discordance=0.2) <= 0.1 < detectable_accuracy(154, 0.5, discordance=0.2)
    # 154 problems at p = 0.5, independent: delta solving sqrt(154) · delta = the numerator above -> 0.157
    assert detectable_accuracy(154, 0.5) == pytest.approx(0.15705, abs=1e-4)
    # no room above a 95% baseline on 10 problems; bad arguments
    assert detectable_accuracy(10, 0.95) is None
    with pytest.raises(ValueError):
        problems_needed(0.3, 0.5, discordance=0.2)  # a gap larger than the discordance
    with pytest.raises(ValueError):
        detectable_accuracy(100, 1.0)

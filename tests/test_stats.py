"""Student-t intervals and Welch's interval, checked against closed forms and hand-worked numbers."""

import math

import pytest

from gspo.results.stats import betainc, mean_ci, t_cdf, t_quantile, welch


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

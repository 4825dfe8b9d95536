"""Small-sample statistics for comparing runs over seeds: Student-t intervals and Welch's test.

With 3-5 seeds a normal interval (mean ± 1.96 SE) is far too narrow; the t-distribution
with n - 1 degrees of freedom is the honest one (t_{0.975, 2} = 4.30). No scipy: the
t quantile is found by bisection on its CDF, through the regularised incomplete beta
function (continued fraction, Numerical Recipes §6.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

LEVEL = 0.95  # every interval gspo compare reports


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (> 0, not necessarily integer) degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t value with P(T <= t) = p (0 < p < 1)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):  # bisection to double precision
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_ci(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """(mean, half-width) of the two-sided t interval over `values` (seeds); None with fewer than 2.

    half-width = t_{(1+level)/2, n-1} · s / sqrt(n), s the sample std (ddof = 1).
    """
    n = len(values)
    if n < 2:
        return None
    mean = math.fsum(values) / n
    s = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile((1 + level) / 2, n - 1) * s / math.sqrt(n)


@dataclass
class Welch:
    """Difference of two means (a - b) with Welch's t interval (unequal variances)."""

    diff: float
    half_width: float  # the interval is diff ± half_width; 0 when neither group varies
    df: float | None  # Welch-Satterthwaite degrees of freedom; None when neither group varies
    n_a: int
    n_b: int

    @property
    def low(self) -> float:
        return self.diff - self.half_width

    @property
    def high(self) -> float:
        return self.diff + self.half_width


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Welch | None:
    """Welch's interval for mean(a) - mean(b); None unless both have at least 2 values.

        se² = s_a²/n_a + s_b²/n_b,   df = se⁴ / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1))
        interval: diff ± t_{(1+level)/2, df} · se
    """
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return None
    ma, mb = math.fsum(a) / na, math.fsum(b) / nb
    va = math.fsum((x - ma) ** 2 for x in a) / (na - 1) / na
    vb = math.fsum((x - mb) ** 2 for x in b) / (nb - 1) / nb
    se2 = va + vb
    if se2 <= 1e-24:
        return Welch(ma - mb, 0.0, None, na, nb)
    df = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    return Welch(ma - mb, t_quantile((1 + level) / 2, df) * math.sqrt(se2), df, na, nb)

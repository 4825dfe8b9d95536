"""Small-sample statistics for comparing runs over seeds: Student-t intervals and Welch's test.

With 3-5 seeds a normal interval (mean ± 1.96 SE) is far too narrow; the t-distribution
with n - 1 degrees of freedom is the honest one (t_{0.975, 2} = 4.30). No scipy: the
t quantile is found by bisection on its CDF, through the regularised incomplete beta
function (continued fraction, Numerical Recipes §6.4).

Also, each a small pure function whose docstring gives its formula:

- over seeds: the paired t interval (`paired`), stratified and paired bootstrap intervals
  (`bootstrap_diff`, `bootstrap_paired`), the probability of improvement (`prob_improvement`);
- over the problems of one evaluation: McNemar's exact test with an interval for the paired
  accuracy difference (`mcnemar`), the paired bootstrap over problems (`bootstrap_problems`);
- power: the exact power of the t test through the noncentral t (`nct_cdf`, `t_power`), the
  smallest detectable difference and the seeds it takes (`detectable`, `seeds_needed`), and
  the same for accuracy on N problems (`detectable_accuracy`, `problems_needed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Hashable, Mapping, Sequence

import numpy as np

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


def _z(p: float) -> float:
    """The standard normal quantile Φ⁻¹(p)."""
    return NormalDist().inv_cdf(p)


# ---------------------------------------------------------------------------------------------
# Paired t interval over seeds


@dataclass
class Paired:
    """Mean of the per-seed differences a - b over the seeds both have, with its t interval."""

    diff: float
    half_width: float  # the interval is diff ± half_width; 0 when every seed differs by the same amount
    df: int  # n - 1
    n: int  # seeds paired
    seeds: tuple  # which seeds, in the order of `a`
    sd: float = 0.0  # s_d, the sample std of the differences (what a paired power calculation needs)

    @property
    def low(self) -> float:
        return self.diff - self.half_width

    @property
    def high(self) -> float:
        return self.diff + self.half_width


def paired(a: Mapping[Hashable, float], b: Mapping[Hashable, float], level: float = LEVEL) -> Paired | None:
    """Paired t interval for the mean of d_s = a[s] - b[s] over the seeds s in both; None with fewer than 2.

        d̄ = Σ d_s / n,   s_d² = Σ (d_s - d̄)² / (n - 1)
        interval: d̄ ± t_{(1+level)/2, n-1} · s_d / sqrt(n)

    Pairing removes the between-seed spread the two arms share (same seed, same data order,
    same initial rollouts), so it is narrower than Welch's when the arms are correlated.
    """
    seeds = tuple(s for s in a if s in b)
    n = len(seeds)
    if n < 2:
        return None
    d = [a[s] - b[s] for s in seeds]
    mean = math.fsum(d) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
    if sd < 1e-12 * max(1.0, abs(mean)):
        sd = 0.0  # rounding noise of equal differences
    return Paired(mean, t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n), n - 1, n, seeds, sd)


# ---------------------------------------------------------------------------------------------
# Per-problem outcomes of two models on the same N problems


@dataclass
class McNemar:
    """Two models on the same N problems: discordant counts, accuracy difference, exact test, interval."""

    n: int  # problems
    b: int  # a right, b wrong
    c: int  # a wrong, b right
    diff: float  # acc(a) - acc(b) = (b - c) / n
    p_value: float  # exact two-sided McNemar test
    low: float
    high: float
    level: float
    method: str  # "agresti-min" or "wald"


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: under H0 each discordant problem goes either way with probability 1/2,

        p = min(1, 2 · Σ_{k ≤ min(b, c)} C(b + c, k) / 2^{b+c}),   1 when b + c = 0.
    """
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**m)


def mcnemar(a: Sequence[bool], b: Sequence[bool], level: float = LEVEL, method: str = "agresti-min") -> McNemar | None:
    """McNemar's exact test and an interval for acc(a) - acc(b), `a`, `b` per-problem outcomes (same problems,
    same order); None with no problems.

        b = #(a right, b wrong),  c = #(a wrong, b right),  diff = (b - c) / N,  p = mcnemar_p(b, c)

    The interval (z = Φ⁻¹((1+level)/2)):

    - "agresti-min" (default): Agresti & Min (2005), "Simple improved confidence intervals for
      comparing matched proportions", Statistics in Medicine 24:729-740: add 1/2 to each of the
      four cells of the 2x2 table (b' = b + 1/2, c' = c + 1/2, N' = N + 2), then the Wald interval
          (b' - c')/N' ± z · sqrt((b' + c') - (b' - c')²/N') / N'.
      Its coverage is close to nominal down to small N, and it does not collapse to a point
      when b = c = 0 as Wald's does.
    - "wald": (b - c)/N ± z · sqrt((b + c) - (b - c)²/N) / N.

    Both are clipped to [-1, 1].
    """
    if len(a) != len(b):
        raise ValueError(f"mcnemar needs outcomes on the same problems, got {len(a)} and {len(b)}")
    n = len(a)
    if n == 0:
        return None
    nb = sum(1 for x, y in zip(a, b) if x and not y)
    nc = sum(1 for x, y in zip(a, b) if y and not x)
    if method == "agresti-min":
        bb, cc, nn = nb + 0.5, nc + 0.5, n + 2
    elif method == "wald":
        bb, cc, nn = float(nb), float(nc), n
    else:
        raise ValueError(f"mcnemar method must be 'agresti-min' or 'wald', got {method!r}")
    centre = (bb - cc) / nn
    half = _z((1 + level) / 2) * math.sqrt(max(0.0, (bb + cc) - (bb - cc) ** 2 / nn)) / nn
    return McNemar(n, nb, nc, (nb - nc) / n, mcnemar_p(nb, nc),
                   max(-1.0, centre - half), min(1.0, centre + half), level, method)


# ---------------------------------------------------------------------------------------------
# Bootstrap intervals (percentile), deterministic given `seed`


@dataclass
class Bootstrap:
    """A statistic on the data and its percentile bootstrap interval."""

    estimate: float  # the statistic on the data themselves
    low: float
    high: float
    level: float
    resamples: int
    seeds: tuple | None = None  # the seeds paired, for bootstrap_paired


def _percentile(stats: np.ndarray, level: float) -> tuple[float, float]:
    """The (1-level)/2 and (1+level)/2 quantiles of the resampled statistics (numpy's linear interpolation)."""
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _resampled_means(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Means of `resamples` resamples of `x` with replacement, drawn in chunks of at most ~2M indices."""
    n = len(x)
    out = np.empty(resamples)
    chunk = max(1, 2_000_000 // n)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        out[start:stop] = x[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    return out


def bootstrap_problems(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                       resamples: int = 10_000, seed: int = 0) -> Bootstrap | None:
    """Paired bootstrap over problems of acc(a) - acc(b); `a`, `b` per-problem scores (bools, or pass rates in
    [0, 1]) on the same problems in the same order; None with no problems.

        d_i = a_i - b_i;  estimate = mean(d);  for r = 1..B: draw N problem indices with replacement
        (numpy Generator `seed`), d*_r = mean of d over them;  interval: the (1-level)/2 and
        (1+level)/2 quantiles of d*_1..d*_B (percentile interval).

    Resampling problems keeps each problem's pair of answers together, so it is the bootstrap
    analogue of McNemar's interval; it treats the problems as a sample from a larger pool.
    """
    if len(a) != len(b):
        raise ValueError(f"bootstrap_problems needs scores on the same problems, got {len(a)} and {len(b)}")
    if not len(a):
        return None
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    stats = _resampled_means(d, np.random.default_rng(seed), resamples)
    return Bootstrap(float(d.mean()), *_percentile(stats, level), level, resamples)


def bootstrap_diff(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                   resamples: int = 10_000, seed: int = 0) -> Bootstrap | None:
    """Stratified bootstrap of mean(a) - mean(b), `a`, `b` two groups' values over (different) seeds; None
    unless both have at least 2.

        for r = 1..B: a* = n_a draws from a with replacement, b* = n_b draws from b, independently
        (numpy Generator `seed`);  d*_r = mean(a*) - mean(b*);  interval: percentiles of d*.

    With few seeds the bootstrap interval is too narrow (3 seeds give only 10 distinct
    resamples, and the resampled spread is the ddof=0 one): prefer `welch` there, and read
    this as a check that does not assume normality.
    """
    if len(a) < 2 or len(b) < 2:
        return None
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    stats = _resampled_means(x, rng, resamples) - _resampled_means(y, rng, resamples)
    return Bootstrap(float(x.mean() - y.mean()), *_percentile(stats, level), level, resamples)


def bootstrap_paired(a: Mapping[Hashable, float], b: Mapping[Hashable, float], level: float = LEVEL,
                     resamples: int = 10_000, seed: int = 0) -> Bootstrap | None:
    """Paired bootstrap over seeds of the mean difference a[s] - b[s], over the seeds s in both (in the
    order of `a`); None with fewer than 2 shared seeds.

        d_s = a[s] - b[s];  for r = 1..B: n seeds drawn with replacement (numpy Generator `seed`),
        d*_r = mean of d over them, each seed keeping its pair;  interval: percentiles of d*.

    The bootstrap counterpart of `paired` (same few-seed caveat as `bootstrap_diff`).
    """
    seeds = tuple(s for s in a if s in b)
    if len(seeds) < 2:
        return None
    d = np.array([a[s] - b[s] for s in seeds], dtype=float)
    stats = _resampled_means(d, np.random.default_rng(seed), resamples)
    return Bootstrap(float(d.mean()), *_percentile(stats, level), level, resamples, seeds)


def _prob_improvement(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """P(X > Y) + P(X = Y)/2 over the last axis of x (..., n_a) and y (..., n_b)."""
    gt = (x[..., :, None] > y[..., None, :]).sum(axis=(-2, -1))
    eq = (x[..., :, None] == y[..., None, :]).sum(axis=(-2, -1))
    return (gt + 0.5 * eq) / (x.shape[-1] * y.shape[-1])


def prob_improvement(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                     resamples: int = 10_000, seed: int = 0) -> Bootstrap | None:
    """Probability of improvement P(X_a > X_b) over seeds, with a stratified bootstrap interval; None when
    either group is empty.

        P̂ = U / (n_a n_b) = (1 / (n_a n_b)) Σ_i Σ_j S(a_i, b_j),  S(x, y) = 1 if x > y, 1/2 if x = y, 0 else

    (the Mann-Whitney U statistic of a against b, normalised; Agarwal et al. 2021, "Deep
    reinforcement learning at the edge of the statistical precipice", NeurIPS, §4 and its
    `rliable` library). Interval: resample a and b independently with replacement (numpy
    Generator `seed`), recompute P̂, take percentiles. 0.5 is no difference; with a single seed
    on a side the interval is degenerate in that side's values.
    """
    if not len(a) or not len(b):
        return None
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    na, nb = len(x), len(y)
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    chunk = max(1, 4_000_000 // (na * nb + na + nb))
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        xs = x[rng.integers(0, na, size=(stop - start, na))]
        ys = y[rng.integers(0, nb, size=(stop - start, nb))]
        stats[start:stop] = _prob_improvement(xs, ys)
    return Bootstrap(float(_prob_improvement(x, y)), *_percentile(stats, level), level, resamples)


# ---------------------------------------------------------------------------------------------
# Power


def _norm_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * np.frompyfunc(math.erfc, 1, 1)(-np.asarray(x, dtype=float) / math.sqrt(2.0)).astype(float)


def nct_cdf(t: float, df: float, ncp: float, points: int = 4001) -> float:
    """P(T <= t) for the noncentral t with `df` degrees of freedom (df >= 1) and noncentrality `ncp`,
    T = (Z + ncp) / sqrt(V / df), Z ~ N(0, 1), V ~ χ²_df independent. Conditioning on S = sqrt(V / df):

        P(T <= t) = ∫_0^∞ Φ(t s - ncp) f_S(s) ds,
        f_S(s) = 2 (df/2)^{df/2} / Γ(df/2) · s^{df-1} exp(-df s²/2)

    integrated by composite Simpson's rule on `points` points over [max(0, 1 - 10/sqrt(df)),
    1 + 10/sqrt(df) + 1] (S has mean ≈ 1 and sd ≈ 1/sqrt(2 df): the range holds all but ~e^-50
    of its mass). Agrees with scipy.stats.nct.cdf to ~1e-9 for integer df from 1 to 20,000.
    """
    if not df >= 1:
        raise ValueError(f"nct_cdf needs df >= 1, got {df}")
    lo, hi = max(0.0, 1.0 - 10.0 / math.sqrt(df)), 2.0 + 10.0 / math.sqrt(df)
    points += 1 - points % 2  # odd, for Simpson
    s = np.linspace(lo, hi, points)
    with np.errstate(divide="ignore"):
        power_term = (df - 1) * np.log(s) if df != 1 else 0.0  # s^0 = 1, also at s = 0
        f = np.exp(math.log(2.0) + (df / 2) * math.log(df / 2) - math.lgamma(df / 2) + power_term - df * s * s / 2)
    w = np.ones(points)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    h = (hi - lo) / (points - 1)
    return float(min(1.0, max(0.0, h / 3 * np.dot(w, _norm_cdf(t * s - ncp) * f))))


def _df_se(n: int, paired: bool) -> tuple[int, float]:
    """Degrees of freedom and the standard error per unit sd of the t test on n seeds (per arm)."""
    return (n - 1, math.sqrt(1.0 / n)) if paired else (2 * n - 2, math.sqrt(2.0 / n))


def t_power(delta: float, sd: float, n: int, level: float = LEVEL, paired: bool = False) -> float:
    """Power of the two-sided t test at significance 1 - level to detect a true difference `delta`:

        unpaired (two arms of n seeds, Student's test, pooled sd `sd`): df = 2n - 2, ncp = delta / (sd sqrt(2/n))
        paired (n seeds, sd `sd` of the per-seed differences):          df = n - 1,  ncp = delta / (sd sqrt(1/n))
        power = P(T' > t_c) + P(T' < -t_c),  T' noncentral t(df, ncp),  t_c = t_{(1+level)/2, df}

    (exact, through `nct_cdf`). With equal n and equal spreads Welch's test is close to this.
    """
    if n < 2:
        raise ValueError(f"t_power needs n >= 2, got {n}")
    df, se = _df_se(n, paired)
    if sd <= 0:
        return 1.0 if delta != 0 else 1.0 - level
    ncp = abs(delta) / (sd * se)
    tc = t_quantile((1 + level) / 2, df)
    return 1.0 - nct_cdf(tc, df, ncp) + nct_cdf(-tc, df, ncp)


def detectable(sd: float, n: int, level: float = LEVEL, power: float = 0.8, paired: bool = False) -> float:
    """The smallest true difference that the two-sided t test detects with probability `power`:

        unpaired: n seeds per arm, `sd` the pooled sd of each arm's values (`pooled_sd`); df = 2n - 2
        paired:   n seeds, `sd` the sd of the per-seed differences;                       df = n - 1
        delta = ncp* · sd · sqrt(2/n)  (unpaired)  or  ncp* · sd · sqrt(1/n)  (paired)

    with ncp* the noncentrality at which the exact power (`t_power`, noncentral t) equals `power`,
    found by bisection. The usual approximation ncp* ≈ t_{(1+level)/2, df} + t_{power, df} is too
    low for the few seeds that matter here (level 0.95, power 0.8: by 14% at df = 1, 5.1% at df = 2,
    1.2% at df = 4) and within 0.03% from df ≈ 18 (n = 16 per arm, sd 1: 1.02390 against the
    exact 1.02366).
    """
    if n < 2:
        raise ValueError(f"detectable needs n >= 2, got {n}")
    if not 0.0 < power < 1.0 or power <= 1.0 - level:
        raise ValueError(f"detectable needs 1 - level < power < 1, got power={power}, level={level}")
    df, se = _df_se(n, paired)
    if sd <= 0:
        return 0.0
    tc = t_quantile((1 + level) / 2, df)

    def pw(ncp: float) -> float:
        return 1.0 - nct_cdf(tc, df, ncp) + nct_cdf(-tc, df, ncp)

    lo, hi = 0.0, tc + t_quantile(power, df) + 1.0
    while pw(hi) < power:
        lo, hi = hi, 2.0 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if pw(mid) < power else (lo, mid)
        if hi - lo <= 1e-10 * hi:
            break
    return 0.5 * (lo + hi) * sd * se


def seeds_needed(delta: float, sd: float, level: float = LEVEL, power: float = 0.8, paired: bool = False,
                 cap: int = 10_000) -> int | None:
    """The smallest n >= 2 (seeds per arm, or seeds paired) with detectable(sd, n, level, power, paired) <= delta;
    None when even `cap` seeds do not suffice. detectable() falls as n grows, so this bisects over n.
    """
    if delta <= 0:
        raise ValueError(f"seeds_needed needs delta > 0, got {delta}")
    if detectable(sd, 2, level, power, paired) <= delta:
        return 2
    if detectable(sd, cap, level, power, paired) > delta:
        return None
    lo, hi = 2, cap  # detectable(lo) > delta >= detectable(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if detectable(sd, mid, level, power, paired) > delta else (lo, mid)
    return hi


def pooled_sd(a: Sequence[float], b: Sequence[float]) -> float | None:
    """sqrt(((n_a - 1) s_a² + (n_b - 1) s_b²) / (n_a + n_b - 2)), the sd to give `detectable` for two arms;
    None unless both have at least 2 values."""
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return None
    ma, mb = math.fsum(a) / na, math.fsum(b) / nb
    ss = math.fsum((x - ma) ** 2 for x in a) + math.fsum((x - mb) ** 2 for x in b)
    return math.sqrt(ss / (na + nb - 2))


def _accuracy_gap(delta: float, p: float, level: float, power: float, discordance: float | None) -> float:
    """sqrt(N) needed for a gap `delta` (normal approximations, see detectable_accuracy)."""
    za, zb = _z((1 + level) / 2), _z(power)
    if discordance is None:
        p2 = p + delta
        pbar = (p + p2) / 2
        return (za * math.sqrt(2 * pbar * (1 - pbar)) + zb * math.sqrt(p * (1 - p) + p2 * (1 - p2))) / delta
    return (za * math.sqrt(discordance) + zb * math.sqrt(discordance - delta * delta)) / delta


def _check_accuracy_args(p: float, level: float, power: float, discordance: float | None) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"baseline accuracy must be in [0, 1), got {p}")
    if not 0.5 <= power < 1.0 or not 0.0 < level < 1.0:
        raise ValueError(f"need 0.5 <= power < 1 and 0 < level < 1, got power={power}, level={level}")
    if discordance is not None and not 0.0 < discordance <= 1.0:
        raise ValueError(f"discordance must be in (0, 1], got {discordance}")


def problems_needed(delta: float, p: float, level: float = LEVEL, power: float = 0.8,
                    discordance: float | None = None) -> int:
    """Problems N for the two-sided test at significance 1 - level to detect an accuracy gain `delta` over a
    baseline accuracy `p` with probability `power`, by normal approximations
    (z_a = Φ⁻¹((1+level)/2), z_b = Φ⁻¹(power)):

    - two independent evaluations (`discordance` None), p₂ = p + delta, p̄ = (p + p₂)/2
      (Fleiss, Levin & Paik, Statistical Methods for Rates and Proportions, 3rd ed., ch. 4,
      without the continuity correction):
          N = [z_a sqrt(2 p̄ (1 - p̄)) + z_b sqrt(p(1-p) + p₂(1-p₂))]² / delta²
    - paired, McNemar's test, `discordance` ψ the fraction of problems the two answer differently
      (Connor 1987, "Sample size for testing differences in proportions for the paired-sample design",
      Biometrics 43:207-211):
          N = [z_a sqrt(ψ) + z_b sqrt(ψ - delta²)]² / delta²,   delta <= ψ

    rounded up.
    """
    _check_accuracy_args(p, level, power, discordance)
    if not 0.0 < delta <= 1.0 - p or (discordance is not None and delta > discordance):
        raise ValueError(f"need 0 < delta <= 1 - p (and <= discordance), got delta={delta}, p={p}")
    return math.ceil(_accuracy_gap(delta, p, level, power, discordance) ** 2 - 1e-9)


def detectable_accuracy(n_problems: int, p: float, level: float = LEVEL, power: float = 0.8,
                        discordance: float | None = None) -> float | None:
    """The smallest accuracy gain over a baseline accuracy `p` that an evaluation on `n_problems` problems detects
    (two-sided, significance 1 - level) with probability `power`: the delta solving the formulas of
    `problems_needed` for N = n_problems, by bisection on delta (the N needed falls as delta grows).
    None when no gain fits (p + delta <= 1, and delta <= discordance when paired). E.g. 154 problems
    at p = 0.5, two independent evaluations: 0.157 (15.7 points).
    """
    _check_accuracy_args(p, level, power, discordance)
    if n_problems < 1:
        raise ValueError(f"detectable_accuracy needs n_problems >= 1, got {n_problems}")
    top = 1.0 - p if discordance is None else min(1.0 - p, discordance)
    root_n = math.sqrt(n_problems)
    if _accuracy_gap(top, p, level, power, discordance) > root_n:
        return None
    lo, hi = 0.0, top  # gap(lo) > sqrt(N) >= gap(hi)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _accuracy_gap(mid, p, level, power, discordance) > root_n else (lo, mid)
        if hi - lo <= 1e-12:
            break
    return hi

"""The statistics behind ``neutreno reproduce``'s verdicts: Student-t intervals of paired differences,
the smallest effect a test of that size could detect, McNemar's exact test, and a permutation test of
mean Spearman correlations. Pure functions of numbers (no scipy at run time; tests/test_reproduce_stats.py
checks them against scipy and exact enumeration).

Why Student's t: a trained comparison has 3–5 seeds, too few for a bootstrap (with n = 3 it can only
resample 10 distinct sets), and the t interval is what a paper's "± over five runs" is read against.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

CONFIDENCE = 0.95  # every interval of a verdict
POWER = 0.80  # for the smallest detectable effect


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for numerator in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), x in [0, 1]."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=1024)  # a verdict asks for the same few levels and seed counts again and again
def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = ``p`` (bisection on :func:`t_cdf`; exact to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
        if high - low < 1e-13 * max(1.0, high):
            break
    return 0.5 * (low + high)


def percent(level: float) -> str:
    """0.95 → ``95%``, 1 − 0.05/3 → ``98.33%``."""
    return f"{100 * level:.4g}%"


@dataclass(frozen=True)
class Interval:
    """A Student-t confidence interval of the mean of ``n`` values (e.g. per-seed paired differences).

    ``detectable`` is the smallest true mean a two-sided test at this level would detect with 80%
    power given this spread and n: (t_{1−α/2} + t_{0.8}) · sd / √n; None with fewer than two values.
    """

    mean: float
    sd: float
    n: int
    low: float
    high: float
    confidence: float
    detectable: float | None

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def excludes_zero(self) -> int:
        """+1 when the whole interval is above zero, −1 when below, 0 when it holds zero."""
        return 1 if self.low > 0 else -1 if self.high < 0 else 0

    def text(self, digits: int = 3, unit: str = "") -> str:
        """``+0.62 [−0.31, +1.55] (95% t, n=3)``: ``digits`` significant digits, more where fewer would
        print the bounds and the mean alike (an interval narrower than the rounding read as zero-width:
        +0.0001 [+0.0001, +0.0001])."""
        if self.n < 2:
            return f"{self.mean:+.{digits}g}{unit} (n=1, no interval)"
        values = (self.mean, self.low, self.high)
        while digits < 17 and self.low < self.high and len({f"{v:+.{digits}g}" for v in values}) < 3:
            digits += 1
        mean, low, high = (f"{v:+.{digits}g}" for v in values)
        return f"{mean}{unit} [{low}, {high}] ({percent(self.confidence)} t, n={self.n})"

    def as_dict(self) -> dict:
        return asdict(self)


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """The Student-t interval of the mean of ``values`` (paired differences, or any sample).

    With one value the interval is unbounded (low −inf, high +inf): one seed says nothing about the
    noise. Non-finite values raise ValueError: a diverged run must be handled, not averaged.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("an interval needs at least one value")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"non-finite value among {values}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(values)
    # in units of the largest |value|: huge finite values (a diverged run's capped perplexity) would
    # overflow the sum or the squares (an inf mean, or OverflowError) before the interval says anything
    scale = max(abs(v) for v in values) or 1.0
    scaled = [v / scale for v in values]
    mean_scaled = math.fsum(scaled) / n
    mean = mean_scaled * scale
    if n == 1:
        return Interval(mean, math.nan, 1, -math.inf, math.inf, confidence, None)
    sd = math.sqrt(math.fsum((v - mean_scaled) ** 2 for v in scaled) / (n - 1)) * scale
    se = sd / math.sqrt(n)
    t = t_quantile(0.5 + confidence / 2, n - 1)
    detectable = (t + t_quantile(POWER, n - 1)) * se
    return Interval(mean, sd, n, mean - t * se, mean + t * se, confidence, detectable)


def paired_interval(
    ours: Sequence[float], baseline: Sequence[float], confidence: float = CONFIDENCE
) -> Interval:
    """The interval of the mean of ``ours[i] − baseline[i]`` (seed i of both arms, or item i)."""
    if len(ours) != len(baseline):
        raise ValueError(f"paired values need equal counts, got {len(ours)} and {len(baseline)}")
    return mean_interval([a - b for a, b in zip(ours, baseline, strict=True)], confidence)


def binomial_two_sided(k: int, n: int) -> float:
    """The exact two-sided p-value of k successes in n fair coin flips: 2·P(X ≤ min(k, n − k)), ≤ 1."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 1.0
    low = min(k, n - k)
    # Integer division of exact integers: 2.0**n overflows a float beyond n = 1023 discordant items.
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2**n
    return min(1.0, 2.0 * tail)


@dataclass(frozen=True)
class McNemar:
    """McNemar's exact test on one test set scored by two models: ``only_ours`` items only our model
    gets right, ``only_baseline`` items only the baseline gets right; ``p`` the two-sided p-value."""

    only_ours: int
    only_baseline: int
    p: float

    def text(self) -> str:
        return f"{self.only_ours} vs {self.only_baseline} discordant, p = {self.p:.3g}"


def mcnemar(ours_correct: Sequence[bool], baseline_correct: Sequence[bool]) -> McNemar:
    """McNemar's exact test of two classifiers' per-item correctness on the same items."""
    if len(ours_correct) != len(baseline_correct):
        raise ValueError("McNemar needs both models scored on the same items")
    only_ours = sum(bool(a) and not bool(b) for a, b in zip(ours_correct, baseline_correct, strict=True))
    only_base = sum(bool(b) and not bool(a) for a, b in zip(ours_correct, baseline_correct, strict=True))
    return McNemar(only_ours, only_base, binomial_two_sided(only_ours, only_ours + only_base))


# draws of the permutation null: a one-sided p near 0.0125 is then known to ±0.00025 (one standard error)
PERMUTATION_DRAWS = 200_000


@functools.lru_cache(maxsize=16)
def _spearman_null_means(points: int, seeds: int) -> tuple[float, ...]:
    """The mean over ``seeds`` seeds of Spearman's ρ between 1..m and an independent uniformly random
    ranking of m = ``points`` items, drawn PERMUTATION_DRAWS times (a fixed generator: the same verdict
    for the same numbers), ascending."""
    import torch

    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(points, dtype=torch.float64)
    means = []
    for start in range(0, PERMUTATION_DRAWS, 20_000):  # ≤ 20,000 × seeds × points at once
        count = min(20_000, PERMUTATION_DRAWS - start)
        ranks = torch.rand(count, seeds, points, generator=generator).argsort(-1)
        squared = (ranks - positions).square().sum(-1)  # Σ d², ρ = 1 − 6 Σ d² / (m (m² − 1))
        means.append((1 - 6 * squared / (points * (points**2 - 1))).mean(-1))
    return tuple(torch.cat(means).sort().values.tolist())


def spearman_mean_p(mean: float, points: int, seeds: int) -> tuple[float, float]:
    """The permutation test of a mean Spearman ρ: with no effect, each of ``seeds`` seeds ranks its
    ``points`` distinct items in an order independent of the other variable, every order equally likely.
    Returns the one-sided p-values (P(mean ≥ ``mean``), P(mean ≤ ``mean``)), each (1 + draws as extreme)
    / (1 + draws): a Monte Carlo p that is never below the exact one's chance (Phipson & Smyth 2010).

    Why not Student's t alone: over 4 points ρ takes 11 values, so a few seeds often agree by chance
    and their spread, hence the interval, comes out far too narrow (five seeds of ρ 0.4, 0.4, 0.4, 0.4,
    0.6 have a 97.5% interval above 0.3, while no effect gives a mean that high 5% of the time).
    """
    if points < 2 or seeds < 1:
        raise ValueError(f"a Spearman permutation test needs ≥ 2 points and ≥ 1 seed, got {points}, {seeds}")
    if not math.isfinite(mean):
        raise ValueError(f"the mean correlation must be finite, got {mean}")
    null = _spearman_null_means(points, seeds)
    tolerance = 1e-9 + 1e-6 * abs(mean)  # ρ of tied data, or summed in another order, rounds differently
    at_least = len(null) - bisect.bisect_left(null, mean - tolerance)
    at_most = bisect.bisect_right(null, mean + tolerance)
    return (1 + at_least) / (1 + len(null)), (1 + at_most) / (1 + len(null))


def spearman_threshold(points: int, seeds: int, alpha: float) -> float | None:
    """The smallest mean Spearman ρ over ``seeds`` seeds of ``points`` items whose :func:`spearman_mean_p`
    (P(≥)) is at most ``alpha``; None when no mean up to 1 is (too few seeds or points)."""
    null = _spearman_null_means(points, seeds)
    allowed = math.floor(alpha * (1 + len(null))) - 1  # draws that may lie at or above the threshold
    if allowed < 0:
        return None
    # attainable means: ρ moves in steps of 12 / (m (m² − 1)) (Σ d² is even), the mean in that over n
    step = 12 / (points * (points**2 - 1) * seeds)
    threshold = null[len(null) - allowed - 1] + step if allowed < len(null) else -1.0
    return threshold if threshold <= 1 + 1e-9 else None

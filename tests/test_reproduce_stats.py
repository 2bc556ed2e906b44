"""The statistics of ``neutreno reproduce`` against scipy, and the verdict rule's error rate on pure noise."""

import itertools
import math
import random
import re
import statistics

import pytest

from neutreno.reproduce.stats import (
    PERMUTATION_DRAWS,
    binomial_two_sided,
    mcnemar,
    mean_interval,
    paired_interval,
    spearman_mean_p,
    spearman_threshold,
    t_cdf,
    t_quantile,
)
from neutreno.reproduce.verdict import (
    AGREES,
    DISAGREES,
    INCONCLUSIVE,
    NOT_CONVERGED,
    Convergence,
    Part,
    judge,
    late_layers,
    layer_parts,
)

scipy_stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 30, 500])
def test_student_t_against_scipy(df):
    for p in (0.6, 0.8, 0.9, 0.975, 0.995, 0.99999, 0.025):
        assert t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-9, abs=1e-9)
    for t in (-6.0, -1.0, 0.0, 0.4, 2.5, 12.0):
        assert t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-11)


def test_mean_interval_against_scipy_and_by_hand():
    values = [0.3, 1.9, -0.4, 1.1, 0.8]
    got = mean_interval(values)
    low, high = scipy_stats.t.interval(
        0.95, len(values) - 1, loc=sum(values) / 5, scale=scipy_stats.sem(values)
    )
    assert (got.low, got.high) == (pytest.approx(low), pytest.approx(high))
    # The smallest detectable effect at 80% power: (t_.975 + t_.80) · sd / √n, written out.
    sd = math.sqrt(sum((v - 0.74) ** 2 for v in values) / 4)
    expected = (scipy_stats.t.ppf(0.975, 4) + scipy_stats.t.ppf(0.8, 4)) * sd / math.sqrt(5)
    assert got.detectable == pytest.approx(expected)
    assert got.excludes_zero() == 0 and mean_interval([1.0, 1.2, 0.9]).excludes_zero() == 1
    assert paired_interval([2.0, 3.0], [1.0, 1.5]).mean == pytest.approx(1.25)
    one = mean_interval([0.5])
    assert one.n == 1 and one.low == -math.inf and one.detectable is None
    with pytest.raises(ValueError, match="non-finite"):
        mean_interval([1.0, math.nan])
    # huge finite values (a diverged run's perplexity, capped at e^700) overflowed: an inf mean, or
    # OverflowError from the squares; the same values divided by 1e300 give the interval ÷ 1e300
    huge, small = mean_interval([1e308, 1e308, 1.5e308]), mean_interval([1e8, 1e8, 1.5e8])
    assert huge.mean / 1e300 == pytest.approx(small.mean) and huge.sd / 1e300 == pytest.approx(small.sd)
    assert huge.low / 1e300 == pytest.approx(small.low)
    spread = mean_interval([-3e305, 0.5, 0.7])
    assert spread.mean == pytest.approx(-1e305) and spread.low < 0 < spread.high
    with pytest.raises(ValueError, match="equal counts"):
        paired_interval([1.0], [1.0, 2.0])


@pytest.mark.parametrize(("k", "n"), [(600, 1300), (1450, 3000), (1500, 3000), (10, 5000)])
def test_the_binomial_test_holds_for_a_full_test_set(k, n):
    """A 10,000-image test set has thousands of discordant items; 2.0**n overflowed past 1023 (the
    medium-scale run of vit-accuracy failed on it)."""
    expected = scipy_stats.binomtest(k, n, 0.5).pvalue
    assert binomial_two_sided(k, n) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_mcnemar_is_the_exact_binomial_test_on_discordant_items():
    ours = [True] * 10 + [False] * 3 + [True] * 50 + [False] * 20
    base = [False] * 10 + [True] * 3 + [True] * 50 + [False] * 20
    test = mcnemar(ours, base)
    assert (test.only_ours, test.only_baseline) == (10, 3)
    assert test.p == pytest.approx(scipy_stats.binomtest(3, 13, 0.5).pvalue)
    assert binomial_two_sided(5, 10) == 1.0 and binomial_two_sided(0, 0) == 1.0


def _noise(rng, n, k, rho, shift=0.0):
    shared = [rng.gauss(0, 1) for _ in range(n)]
    return [
        Part(
            f"p{j}",
            [shift + math.sqrt(rho) * shared[i] + math.sqrt(1 - rho) * rng.gauss(0, 1) for i in range(n)],
        )
        for j in range(k)
    ]


@pytest.mark.parametrize(("n", "k", "rho"), [(3, 1, 0.0), (5, 1, 0.0), (3, 3, 0.7), (5, 6, 0.0), (5, 6, 0.9)])
def test_with_no_true_effect_agrees_and_disagrees_stay_within_five_percent(n, k, rho):
    """Seed noise with zero true difference, one part or several (correlated like neighbouring layers):
    ``agrees`` + ``disagrees`` together at most the nominal 5% (2,000 draws: 3 standard errors ≈ 1.5%)."""
    rng = random.Random(1234 + n + k)
    draws = 2000
    decided = sum(judge(_noise(rng, n, k, rho), "claim").verdict != INCONCLUSIVE for _ in range(draws))
    assert decided / draws <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / draws)


def test_a_real_effect_is_found_and_one_against_the_paper_disagrees():
    rng = random.Random(7)
    found = sum(judge(_noise(rng, 5, 1, 0.0, shift=2.0), "claim").verdict == AGREES for _ in range(200))
    against = sum(judge(_noise(rng, 5, 1, 0.0, shift=-2.0), "claim").verdict == DISAGREES for _ in range(200))
    assert found > 150 and against > 150  # power ≈ 0.9 at an effect of 2 sd with 5 seeds


def test_verdict_rule_on_canned_parts():
    assert judge([Part("gain", [1.0, 1.2, 0.9])], "c").verdict == AGREES
    assert judge([Part("gain", [-1.0, -1.2, -0.9])], "c").verdict == DISAGREES
    within = judge([Part("gain", [1.0, -0.5, 0.8])], "c")
    assert within.verdict == INCONCLUSIVE and "smallest effect" in within.reason
    one = judge([Part("gain", [5.0])], "c")
    assert one.verdict == INCONCLUSIVE and "one seed" in one.reason
    # Several parts: all must hold to agree; one clearly against is enough to disagree.
    mixed = [Part("a", [1.0, 1.1, 0.9]), Part("b", [0.5, -0.4, 0.2])]
    assert judge(mixed, "c").verdict == INCONCLUSIVE
    assert judge([Part("a", [1.0, 1.1, 0.9]), Part("b", [-3.0, -3.1, -2.9])], "c").verdict == DISAGREES
    # Disagreeing among k parts needs the Bonferroni level: an interval just below zero at 95% is not enough.
    weak = Part("b", [-1.0, -1.3, -0.7])
    assert weak.interval().high < 0 and weak.interval(1 - 0.05 / 6).high > 0
    assert judge([weak, *[Part(f"x{i}", [0.1, -0.1, 0.0]) for i in range(5)]], "c").verdict == INCONCLUSIVE
    assert judge([Part("a", [1.0, math.nan])], "c").verdict == INCONCLUSIVE


def test_a_tie_after_rounding_is_still_a_tie():
    """One more image right (0.05 points of 2,000) in each of 3 seeds, computed as score − score: the
    differences differ in their last bits, which passed as a spread and gave ``agrees`` at +0.05
    [+0.05, +0.05]. With 3 seeds a sign test gives p = 0.25: nothing is shown."""
    base, ours = [45.35, 50.05, 47.20], [45.40, 50.10, 47.25]
    diffs = [o - b for o, b in zip(ours, base, strict=True)]
    assert len(set(diffs)) > 1  # the rounding the old rule took for noise
    verdict = judge([Part("NeuTRENO − softmax top-1", diffs, " points")], "c")
    assert verdict.verdict == INCONCLUSIVE and "noise is not estimated" in verdict.reason
    # a real spread, however small against the values, is still a spread
    assert not Part("x", [0.05, 0.05 + 1e-6, 0.05]).tied


def test_a_tied_part_does_not_hide_another_part_against_the_paper():
    """A per-layer claim with one layer tied at 0 and another far against the paper said inconclusive
    (the tie was checked first); without the tied layer it said disagrees."""
    against = Part("layer 5", [-0.2, -0.22, -0.18])
    assert against.interval(1 - 0.05 / 3).high < 0
    parts = [Part("layer 4", [0.0, 0.0, 0.0]), against, Part("layer 6", [0.1, -0.1, 0.05])]
    assert judge(parts, "c").verdict == DISAGREES
    assert (
        judge([Part("layer 4", [0.0, 0.0, 0.0]), Part("layer 6", [1.0, 1.1, 0.9])], "c").verdict
        == INCONCLUSIVE
    )


def test_a_correlation_at_its_bound_in_every_seed_is_judged_by_its_exact_chance():
    """−ρ = 1 in every seed (perfectly monotone) was inconclusive "noise not estimated" while weaker
    evidence (1, 1, 0.8) agreed. With no effect, ρ = ±1 over m distinct points has chance 1/m! per
    seed: the exact one-sided p of n seeds there is (1/m!)ⁿ, judged at the verdict's levels."""
    assert judge([Part("−ρ", [1.0, 1.0, 1.0], points=4)], "c").verdict == AGREES  # p = 7e-5
    assert judge([Part("−ρ", [-1.0, -1.0, -1.0], points=4)], "c").verdict == DISAGREES
    # three points: 1/6 per seed, (1/6)² = 2.8% > 2.5% with 2 seeds; (1/6)³ = 0.46% with 3
    assert judge([Part("−ρ", [1.0, 1.0], points=3)], "c").verdict == INCONCLUSIVE
    assert judge([Part("−ρ", [1.0, 1.0, 1.0], points=3)], "c").verdict == AGREES
    # against among k = 2 parts needs p ≤ 2.5%/2: (1/6)² = 2.8% is not, (1/24)² = 0.17% is
    other = Part("b", [1.0, 1.2, 0.9])
    assert judge([other, Part("−ρ", [-1.0, -1.0], points=3)], "c").verdict == INCONCLUSIVE
    assert judge([other, Part("−ρ", [-1.0, -1.0], points=4)], "c").verdict == DISAGREES
    # no known chance (a top-1 difference): a tie stays unjudged
    assert judge([Part("top-1", [1.0, 1.0, 1.0])], "c").verdict == INCONCLUSIVE
    # zero is no bound: a tie at 0 says nothing
    assert judge([Part("−ρ", [0.0, 0.0, 0.0], points=4)], "c").verdict == INCONCLUSIVE


def _spearman_null(m: int) -> dict[float, float]:
    """The exact distribution of Spearman's ρ between 1..m and a uniformly random order of m items."""
    counts: dict[float, int] = {}
    for order in itertools.permutations(range(m)):
        rho = round(1 - 6 * sum((i - j) ** 2 for i, j in enumerate(order)) / (m * (m * m - 1)), 9)
        counts[rho] = counts.get(rho, 0) + 1
    return {rho: c / math.factorial(m) for rho, c in counts.items()}


def _exact_mean_p(m: int, n: int, mean: float) -> tuple[float, float]:
    """P(mean of n independent null ρ ≥ mean) and P(≤ mean), by convolving the exact distribution."""
    sums = {0.0: 1.0}
    for _ in range(n):
        grown: dict[float, float] = {}
        for total, p in sums.items():
            for rho, q in _spearman_null(m).items():
                key = round(total + rho, 9)
                grown[key] = grown.get(key, 0.0) + p * q
        sums = grown
    return (
        sum(p for s, p in sums.items() if s / n >= mean - 1e-9),
        sum(p for s, p in sums.items() if s / n <= mean + 1e-9),
    )


@pytest.mark.parametrize(
    ("m", "n", "mean"), [(4, 2, 0.4), (4, 5, 0.44), (4, 3, 1.0), (3, 2, 1.0), (5, 3, -0.3), (6, 5, 0.2)]
)
def test_the_spearman_permutation_test_against_exact_enumeration(m, n, mean):
    draws = PERMUTATION_DRAWS
    for got, exact in zip(spearman_mean_p(mean, m, n), _exact_mean_p(m, n, mean), strict=True):
        # a Monte Carlo p: (1 + hits) / (1 + draws), within 4 standard errors of the exact chance
        assert abs(got - exact) <= 4 * math.sqrt(exact * (1 - exact) / draws) + 2 / draws
    threshold = spearman_threshold(m, n, 0.025)
    exact_at = _exact_mean_p(m, n, threshold)[0] if threshold is not None else None
    if threshold is not None:  # the smallest mean beyond the noise: at most 2.5%, one step below it not
        below = threshold - 12 / (m * (m * m - 1) * n)
        assert exact_at <= 0.025 + 4 * math.sqrt(0.025 / draws) and _exact_mean_p(m, n, below)[0] > 0.02
    else:
        assert _exact_mean_p(m, n, 1.0)[0] > 0.025


def test_correlations_of_few_points_are_not_beyond_the_noise_by_chance():
    """Over 4 points ρ takes 11 values, and the verdict judged them as a continuous measurement: a
    tie at ρ = 0.4 in two seeds agreed as if it were ρ = 1 (chance (1/24)² instead of 0.21), and five
    seeds of 0.4, 0.4, 0.4, 0.4, 0.6 against the paper disagreed on a t interval far too narrow (no
    effect gives a mean that low 5% of the time)."""
    assert judge([Part("−ρ", [0.4, 0.4], points=4)], "c").verdict == INCONCLUSIVE
    against = Part("−ρ", [-0.4, -0.4, -0.4, -0.4, -0.6], points=4)
    assert against.interval(1 - 0.05 / 2).high < 0  # the interval alone would disagree
    verdict = judge([against, Part("other", [0.1, -0.2, 0.3, 0.0, 0.1])], "c")
    assert verdict.verdict == INCONCLUSIVE and "needs ≥" in verdict.reason
    # past the permutation threshold but with a t interval reaching 0: it said "needs ≥ 0.73" of a mean
    # of 0.733, and gave a "smallest effect … could detect" of 1.43, beyond any correlation
    held = judge([Part("−ρ(width)", [1.0, 1.0, 0.2], points=4)], "c")
    assert held.verdict == INCONCLUSIVE and "smallest effect" not in held.reason
    assert "−ρ(width): past that threshold, but the t interval reaches 0" in held.reason
    # a real effect still agrees: ρ 1, 0.8, 1, 0.8, 1 (exact p ≈ 4e-5)
    assert judge([Part("−ρ", [1.0, 0.8, 1.0, 0.8, 1.0], points=4)], "c").verdict == AGREES


@pytest.mark.parametrize("n", [2, 3, 5])
def test_with_no_effect_correlation_claims_stay_within_their_levels(n):
    """gradient-disproportion's shape: two parts, each −ρ over 4 points per seed. With no effect, every
    seed's ρ is that of a random order; over every outcome (exact enumeration), agrees and disagrees
    stay within their one-sided 2.5% each (they were at 10.5% disagrees with 2 seeds). The rule's
    Monte Carlo p adds at most a few draws' worth."""
    null = _spearman_null(4)
    per_part: dict[tuple[int, int], float] = {}  # (beyond at 95%, beyond at 97.5%) → probability
    for values in itertools.combinations_with_replacement(sorted(null), n):
        counts = {v: values.count(v) for v in set(values)}
        p = math.factorial(n) / math.prod(math.factorial(c) for c in counts.values())
        p *= math.prod(null[v] ** c for v, c in counts.items())
        part = Part("−ρ", list(values), points=4)
        key = (part.beyond(0.95), part.beyond(1 - 0.05 / 2))
        per_part[key] = per_part.get(key, 0.0) + p
    disagree = 1 - sum(p for (_, strict), p in per_part.items() if strict >= 0) ** 2
    agree = sum(p for (loose, strict), p in per_part.items() if loose > 0 and strict >= 0) ** 2
    assert disagree <= 0.025 + 1e-3 and agree <= 0.025 + 1e-3


def test_the_correlation_points_survive_the_measurement_record():
    from neutreno.reproduce.claim import judge_measured, parts_record

    parts = [Part("−ρ", [1.0, 1.0, 1.0], points=4)]
    assert judge_measured({"parts": parts_record(parts), "claim": "c"}).verdict == AGREES
    assert judge_measured({"parts": parts_record([Part("−ρ", [1.0, 1.0, 1.0])]), "claim": "c"}).verdict == (
        INCONCLUSIVE
    )


def test_convergence_rule_on_canned_scores():
    still_moving = Convergence("softmax", full=45.0, half=39.0, tolerance=0.84)  # +6 points from doubling
    settled = Convergence("softmax", full=45.3, half=45.0, tolerance=0.84)
    overtrained = Convergence(
        "softmax", full=43.0, half=45.0, tolerance=0.84
    )  # worse when longer: moving too
    assert not still_moving.converged and settled.converged and not overtrained.converged
    perplexity = Convergence("softmax", full=100.0, half=103.0, tolerance=1.66, relative=True)
    assert perplexity.change == pytest.approx(-3.0) and not perplexity.converged
    assert Convergence("lm", full=100.0, half=101.0, tolerance=1.66, relative=True).converged
    assert not Convergence("x", full=math.nan, half=1.0, tolerance=1.0).converged
    # An unconverged comparison is never judged, whatever its intervals say.
    strong = [Part("gain", [5.0, 5.1, 4.9])]
    verdict = judge(strong, "c", [settled, still_moving])
    assert verdict.verdict == INCONCLUSIVE and verdict.note == NOT_CONVERGED
    assert verdict.label == "inconclusive (not converged)" and "+6" in verdict.reason
    assert judge(strong, "c", [settled]).verdict == AGREES


def test_layer_parts_and_the_one_rule_for_which_layers_count():
    assert late_layers(12) == [7, 8, 9, 10, 11, 12] and late_layers(6) == [4, 5, 6]
    softmax = [{4: 0.5, 5: 0.6}, {4: 0.52, 5: 0.61}]
    neutreno = [{4: 0.4, 5: 0.62}, {4: 0.41, 5: 0.6}]
    parts = layer_parts(neutreno, softmax, [4, 5], "cosine")
    assert [p.values for p in parts] == [pytest.approx([0.1, 0.11]), pytest.approx([-0.02, 0.01])]
    # A 1e-6 difference in every layer is not "lower": the seed spread is the margin.
    tiny = layer_parts([{4: 0.5 - 1e-6}, {4: 0.5 + 2e-6}, {4: 0.5 - 1e-6}], [{4: 0.5}] * 3, [4], "cosine")
    assert judge(tiny, "c").verdict == INCONCLUSIVE


def test_an_interval_narrower_than_its_rounding_is_printed_with_the_digits_that_show_it():
    """+0.0001 [+0.0001, +0.0001] read as a zero-width interval beyond the noise, which a reader could
    not check: the bounds get the digits that set them apart, and ordinary intervals keep three."""
    narrow = mean_interval([1e-4, 1e-4, 1e-4 * (1 + 1e-8)])
    mean, low, high = re.match(r"(\S+) \[(\S+), (\S+)\]", narrow.text()).groups()
    assert len({mean, low, high}) == 3
    for shown, exact in ((mean, narrow.mean), (low, narrow.low), (high, narrow.high)):
        assert float(shown) == pytest.approx(exact, rel=1e-9)  # each printed as itself, not rounded away
    ordinary = mean_interval([0.62, 0.1, 1.1])
    assert ordinary.text() == f"{ordinary.mean:+.3g} [{ordinary.low:+.3g}, {ordinary.high:+.3g}] (95% t, n=3)"


def test_the_measurement_record_holds_the_intervals_the_verdict_read():
    """result.json held the deciding interval only as three-digit text in the reason: its bounds, n,
    the level and whether the part was a tie are numbers now, at 95% and (several parts) at the
    Bonferroni level at which a part is tested against the paper."""
    from neutreno.reproduce.claim import parts_record

    values = [1.0, 1.2, 0.9, 1.1]
    (one,) = parts_record([Part("d", values)])
    t = 3.182446305284263  # t_{0.975, 3}, from a table
    sd = statistics.stdev(values)
    assert one["interval"]["low"] == pytest.approx(statistics.mean(values) - t * sd / 2, rel=1e-9)
    assert one["interval"]["n"] == 4 and one["interval"]["confidence"] == 0.95
    assert not one["interval"]["tied"] and "interval_against" not in one
    two = parts_record([Part("d", values), Part("e", [2.0, 2.0, 2.0, 2.0]), Part("f", [1.0, math.nan])])
    assert two[0]["interval_against"]["confidence"] == pytest.approx(1 - 0.05 / 3)
    assert two[0]["interval_against"]["low"] < two[0]["interval"]["low"]
    assert two[1]["interval"]["tied"] and two[2]["interval"] is None

"""Verdicts: does a measurement agree with a paper's claim? Pure functions of numbers, so that every
rule is tested on canned values (tests/test_reproduce.py), including many draws of pure noise.

One rule serves every comparison. A claim is one or more *parts*, each a list of differences
(one per seed, or per test item) oriented so that a positive mean is the paper's direction:

- ``agrees`` when every part's 95% Student-t interval lies above zero;
- ``disagrees`` when some part's interval at the Bonferroni level 1 − 0.05/k (k parts) lies below
  zero: evidence against the paper that survives the k chances to find some;
- ``inconclusive`` otherwise, naming the smallest effect these seeds could have detected.

A part whose values are Spearman correlations over m points per seed (``Part.points``) takes few
values (11 for m = 4), so its spread can come out far too small by chance: it is beyond the noise only
where a permutation test of its mean, at the same one-sided levels, agrees with the interval (with no
effect every seed's ranking is equally likely). A part whose seeds all gave one value (to rounding:
0.05 points computed as 80.05 − 80.00 differs in its last bits) has no estimated noise: top-1 in steps
of one image is a coarse measurement, not a noiseless one. Such a part is judged by the permutation
test alone where it is a correlation (ρ = 1 over 4 points in each of 3 seeds: p = (1/24)³), and
otherwise leaves the claim ``inconclusive``, though another part may still disagree.

With no true effect, ``agrees`` needs every part to clear a one-sided 2.5% test (≤ 2.5%) and
``disagrees`` some part to clear a one-sided 2.5%/k test (≤ 2.5% by the union bound): together at
most the nominal 5%. A trained comparison is judged only when every arm converged (``Convergence``);
otherwise it is ``inconclusive (not converged)``, whatever the intervals say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from neutreno.reproduce.stats import (
    CONFIDENCE,
    Interval,
    mean_interval,
    percent,
    spearman_mean_p,
    spearman_threshold,
)

AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive"
SKIPPED = "skipped"  # the claim's data is missing: never measured, so never "agrees"
VERDICTS = (AGREES, DISAGREES, INCONCLUSIVE, SKIPPED)
NOT_CONVERGED = "not converged"
INFORMATION = ". For information only"  # how an unjudged comparison's reason introduces its intervals


@dataclass(frozen=True)
class Verdict:
    """A verdict, the sentence with the numbers that decided it, and an optional qualifier shown in
    brackets (``inconclusive (not converged)``)."""

    verdict: str  # one of VERDICTS
    reason: str
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.verdict} ({self.note})" if self.note else self.verdict


@dataclass(frozen=True)
class Part:
    """One directional comparison: ``values`` are differences whose mean the paper says is positive
    (e.g. NeuTRENO − softmax top-1 per seed, or softmax − NeuTRENO cosine at one layer)."""

    what: str
    values: Sequence[float]
    unit: str = ""
    digits: int = 3
    # values are Spearman ρ (or −ρ) of m = ``points`` distinct items per seed: a permutation test judges
    # them too (None: an ordinary measurement, its interval alone)
    points: int | None = None

    def interval(self, confidence: float = CONFIDENCE) -> Interval:
        return mean_interval(self.values, confidence)

    @property
    def tied(self) -> bool:
        """Every value the same, up to floating-point rounding of the differences they are."""
        return max(self.values) - min(self.values) <= 1e-9 * max(abs(v) for v in self.values)

    def permutation_p(self) -> tuple[float, float] | None:
        """For a correlation part: the one-sided p-values of its mean with no effect, (P(≥), P(≤))."""
        if self.points is None:
            return None
        return spearman_mean_p(self.interval().mean, self.points, len(self.values))

    def text(self, confidence: float = CONFIDENCE) -> str:
        p = self.permutation_p()
        if p is not None:
            chance = (
                f" (with no effect, a mean {'this high' if self.interval().mean > 0 else 'this low'}: "
                f"p = {min(p):.2g}, permutation test over {self.points} points)"
            )
        else:
            chance = ""
        if self.tied:
            value = f"{self.values[0]:.{self.digits}g}{self.unit}"
            return f"{self.what} {value} in each of {len(self.values)} seeds{chance}"
        return f"{self.what} {self.interval(confidence).text(self.digits, self.unit)}{chance}"

    def beyond(self, confidence: float) -> int:
        """+1 when the part is beyond the noise in the paper's direction at ``confidence`` (two-sided),
        −1 against it, 0 within it or unknown (a tie that is no correlation). A correlation part needs
        its permutation test to say so too, and a tied one that test alone."""
        by_interval = None if self.tied else self.interval(confidence).excludes_zero()
        p = self.permutation_p()
        if p is None:
            return by_interval or 0
        alpha = (1 - confidence) / 2
        by_permutation = 1 if p[0] <= alpha else -1 if p[1] <= alpha else 0
        if by_interval is None or by_interval == by_permutation:
            return by_permutation
        return 0


@dataclass(frozen=True)
class Convergence:
    """Did one arm's training converge? Its score after the full schedule and after half of it (same
    seed, everything else equal): ``change`` = full − half, in percent of ``full`` when ``relative``
    (perplexity). Converged when doubling the schedule moved the score by at most ``tolerance``, the
    paper's own effect for this metric: a score still moving by more than the effect under study
    cannot settle it. (Doubling is the test because a cosine schedule flattens the end of any curve:
    the last tenth of a run looks converged whether or not it is.)"""

    arm: str
    full: float
    half: float
    tolerance: float
    relative: bool = False
    unit: str = ""
    metric: str = ""  # the training's own metric (top-1 for every CIFAR claim, similarity ones included)
    why: str = ""  # where the tolerance comes from

    @property
    def change(self) -> float:
        if self.relative:
            return 100 * (self.full - self.half) / self.full
        return self.full - self.half

    @property
    def converged(self) -> bool:
        # at most the tolerance, with float rounding's slack: top-1 60.84 − 60.00 is 0.8400000000000034
        slack = 1e-9 * max(abs(self.tolerance), abs(self.full), abs(self.half), 1.0)
        return math.isfinite(self.change) and abs(self.change) <= self.tolerance + slack

    def text(self) -> str:
        unit = "%" if self.relative else self.unit
        return (
            f"{self.arm} {self.half:.4g} → {self.full:.4g} ({self.change:+.3g}{unit} from doubling the "
            f"schedule; tolerance ±{self.tolerance:g}{unit})"
        )


def judge(
    parts: Sequence[Part],
    claim: str,
    convergence: Sequence[Convergence] = (),
    confidence: float = CONFIDENCE,
) -> Verdict:
    """The verdict of ``claim`` (a phrase: "NeuTRENO is more accurate") from its ``parts``; see the
    module docstring. ``convergence``: one entry per trained arm (empty: nothing was trained)."""
    if not parts:
        raise ValueError("a verdict needs at least one part")
    if any(not all(math.isfinite(v) for v in p.values) for p in parts):
        return Verdict(INCONCLUSIVE, "a measurement is not a finite number (a diverged run?)")
    unconverged = [c for c in convergence if not c.converged]
    if unconverged:
        moved = "; ".join(c.text() for c in unconverged)
        alone = judge(parts, claim, (), confidence)
        return Verdict(
            INCONCLUSIVE,
            f"not judged, training has not converged: {moved}{INFORMATION}, the intervals alone would say "
            f"{alone.verdict}: {alone.reason}",
            NOT_CONVERGED,
        )
    if any(len(p.values) < 2 for p in parts):
        return Verdict(INCONCLUSIVE, f"one seed gives no interval: {'; '.join(p.text() for p in parts)}")
    k = len(parts)
    strict = 1 - (1 - confidence) / k
    against = [p for p in parts if p.beyond(strict) < 0]  # a tie elsewhere does not hide these
    if against:
        shown = "; ".join(p.text(strict) for p in against)
        return Verdict(
            DISAGREES, f"{claim}: no — against the paper beyond the noise ({percent(strict)} level): {shown}"
        )
    unknown = [p for p in parts if p.tied and p.points is None]
    if unknown:  # a zero spread is a coarse measurement (top-1 in steps of one image), not a noiseless one
        return Verdict(
            INCONCLUSIVE,
            "every seed gave the same value, so the noise is not estimated: "
            + "; ".join(p.text() for p in unknown),
        )
    if all(p.beyond(confidence) > 0 for p in parts):
        if k == 1:
            return Verdict(AGREES, f"{claim}: yes — {parts[0].text(confidence)}, beyond the noise")
        untied = [p for p in parts if not p.tied]
        weakest = min(untied, key=lambda p: p.interval(confidence).low) if untied else parts[0]
        return Verdict(
            AGREES, f"{claim}: yes in all {k} parts beyond the noise; the closest: {weakest.text(confidence)}"
        )
    open_parts = [p for p in parts if p.beyond(confidence) <= 0]
    could, n = [], len(parts[0].values)  # what these n seeds could have shown
    # (a correlation's smallest detectable mean can exceed 1: its permutation threshold says more)
    spread = [p for p in open_parts if not p.tied and p.points is None]
    units = list(dict.fromkeys(p.unit for p in spread))  # (parts in points and in %: one figure each)
    for unit in units:  # the largest of the open parts' smallest detectable effects, in each unit
        detectable = max(p.interval(confidence).detectable for p in spread if p.unit == unit)
        what = f" ({', '.join(p.what for p in spread if p.unit == unit)})" if len(units) > 1 else ""
        could.append(
            f"the smallest effect {n} values of this spread could detect: {detectable:.3g}{unit}{what}"
        )
    for points in sorted({p.points for p in open_parts if p.points is not None}):
        threshold = spearman_threshold(points, n, (1 - confidence) / 2)
        if threshold is None:
            could.append(f"no mean correlation over {points} points is beyond the noise with {n} seeds")
            continue
        could.append(
            f"a mean correlation over {points} points needs ≥ {threshold:.2g} with {n} seeds (the "
            "permutation test) and a t interval above 0"
        )
        # which test held it back, where the mean passes the permutation threshold
        passed = [
            p.what for p in open_parts if p.points == points and p.interval(confidence).mean >= threshold
        ]
        if passed:
            could.append(f"{', '.join(passed)}: past that threshold, but the t interval reaches 0")
    could = "; ".join(could)
    if k == 1:
        return Verdict(INCONCLUSIVE, f"{claim}: within the noise — {parts[0].text(confidence)}; {could}")
    return Verdict(
        INCONCLUSIVE,
        f"{claim}: beyond the noise in {k - len(open_parts)} of {k} parts; not in "
        + "; ".join(p.text(confidence) for p in open_parts)
        + f"; {could}",
    )


def late_layers(depth: int) -> list[int]:
    """The layers every per-layer claim counts: the second half of a stack of ``depth`` blocks (per-layer
    lists index 0 = the embeddings, so these are depth//2 + 1 … depth). A metric between successive
    layers (head redundancy, keyed by ℓ for the pair ℓ, ℓ + 1) counts the pairs that start there."""
    return list(range(depth // 2 + 1, depth + 1))


def layer_parts(
    ours: Sequence[dict[int, float]], baseline: Sequence[dict[int, float]], layers: Sequence[int], what: str
) -> list[Part]:
    """One part per counted layer: baseline − ours per seed (or item), positive when ours is lower."""
    if len(ours) != len(baseline):
        raise ValueError(f"need the same seeds in both arms, got {len(ours)} and {len(baseline)}")
    return [
        Part(
            f"{what} lower at layer {layer}",
            [b[layer] - o[layer] for o, b in zip(ours, baseline, strict=True)],
        )
        for layer in layers
    ]

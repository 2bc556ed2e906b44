"""Verdicts: does a measurement agree with a paper's claim? Pure functions of numbers, so that every
rule is tested on canned values (tests/test_reproduce.py), including many draws of pure noise.

One rule serves every comparison. A claim is one or more *parts*, each a list of differences
(one per seed, or per test item) oriented so that a positive mean is the paper's direction:

- ``agrees`` when every part's 95% Student-t interval lies above zero;
- ``disagrees`` when some part's interval at the Bonferroni level 1 − 0.05/k (k parts) lies below
  zero: evidence against the paper that survives the k chances to find some;
- ``inconclusive`` otherwise, naming the smallest effect these seeds could have detected.

A part whose seeds all gave one value (to rounding: 0.05 points computed as 80.05 − 80.00 differs in
its last bits) has no estimated noise: top-1 in steps of one image is a coarse measurement, not a
noiseless one. Such a part is beyond the noise only where the chance of that value with no effect is
known (``Part.tie_chance``: a Spearman ρ of ±1 over m distinct points, 1/m!) and small enough over the
seeds (an exact test at the same levels); otherwise it leaves the claim ``inconclusive``, though another
part may still disagree.

With no true effect, ``agrees`` needs every part to clear a one-sided 2.5% test (≤ 2.5%) and
``disagrees`` some part to clear a one-sided 2.5%/k test (≤ 2.5% by the union bound): together at
most the nominal 5%. A trained comparison is judged only when every arm converged (``Convergence``);
otherwise it is ``inconclusive (not converged)``, whatever the intervals say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from neutreno.reproduce.stats import CONFIDENCE, Interval, mean_interval, percent

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
    # the chance, with no effect, that one value is ±max|value| (the bound a correlation of m distinct
    # points reaches with chance 1/m! in each direction); None: unknown, so a tie leaves the part open
    tie_chance: float | None = None

    def interval(self, confidence: float = CONFIDENCE) -> Interval:
        return mean_interval(self.values, confidence)

    @property
    def tied(self) -> bool:
        """Every value the same, up to floating-point rounding of the differences they are."""
        return max(self.values) - min(self.values) <= 1e-9 * max(abs(v) for v in self.values)

    def tie_p(self) -> float | None:
        """For a tied part at a bound of known chance: the one-sided exact p of all values there."""
        if self.tie_chance is None or not self.tied or self.values[0] == 0:
            return None
        return self.tie_chance ** len(self.values)

    def text(self, confidence: float = CONFIDENCE) -> str:
        if self.tied:
            p = self.tie_p()
            chance = "" if p is None else f" (with no effect: {self.tie_chance:.3g} per seed, {p:.2g} in all)"
            value = f"{self.values[0]:.{self.digits}g}{self.unit}"
            return f"{self.what} {value} in each of {len(self.values)} seeds{chance}"
        return f"{self.what} {self.interval(confidence).text(self.digits, self.unit)}"

    def beyond(self, confidence: float) -> int:
        """+1 when the part is beyond the noise in the paper's direction at ``confidence`` (two-sided),
        −1 against it, 0 within it or unknown (a tie without a known chance)."""
        if self.tied:
            p = self.tie_p()
            if p is None or p > (1 - confidence) / 2:
                return 0
            return 1 if self.values[0] > 0 else -1
        interval = self.interval(confidence)
        return 1 if interval.low > 0 else -1 if interval.high < 0 else 0


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
        return math.isfinite(self.change) and abs(self.change) <= self.tolerance

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
    unknown = [p for p in parts if p.tied and p.tie_p() is None]
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
    spread = [p for p in open_parts if not p.tied]
    if spread:  # the largest of the open parts' smallest detectable effects: what these seeds could show
        detectable = max(p.interval(confidence).detectable for p in spread)
        could = (
            f"the smallest effect {len(parts[0].values)} values of this spread could detect: "
            f"{detectable:.3g}{spread[0].unit}"
        )
    else:  # tied at a bound, with too few seeds for its chance to be small
        could = "too few seeds for that chance to be beyond the noise"
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

"""Verdicts: does a measurement agree with a paper's claim? Pure functions of numbers, so that every
claim's rule is tested on canned values (tests/test_reproduce.py) apart from the runs that feed it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive"
SKIPPED = "skipped"  # the claim's data is missing: never measured, so never "agrees"
VERDICTS = (AGREES, DISAGREES, INCONCLUSIVE, SKIPPED)


@dataclass(frozen=True)
class Verdict:
    verdict: str  # one of VERDICTS
    reason: str  # one sentence with the numbers that decided it


def gain_beyond_noise(gain: float, noise: float, what: str) -> Verdict:
    """``gain``: how far our result moves in the paper's direction (negative: the other way); it counts
    only beyond ``noise``, the smallest difference this measurement can tell from chance."""
    if not math.isfinite(gain):
        return Verdict(INCONCLUSIVE, f"{what} is not a finite number")
    if gain > noise:
        return Verdict(
            AGREES, f"{what} is {gain:+.3g}, the paper's direction, beyond the noise (±{noise:.3g})"
        )
    if gain < -noise:
        return Verdict(
            DISAGREES, f"{what} is {gain:+.3g}, against the paper, beyond the noise (±{noise:.3g})"
        )
    return Verdict(INCONCLUSIVE, f"{what} is {gain:+.3g}, within the noise (±{noise:.3g})")


def lower_in_every_layer(
    ours: Sequence[float], baseline: Sequence[float], layers: Sequence[int], what: str
) -> Verdict:
    """The claim "NeuTRENO's ``what`` is lower than softmax's in every one of ``layers``" (indices into
    the per-layer lists): all lower agrees, fewer than half lower disagrees, anything between is mixed."""
    lower = [layer for layer in layers if ours[layer] < baseline[layer]]
    counted = f"lower in {len(lower)} of {len(layers)} layers ({', '.join(map(str, layers))})"
    if len(lower) == len(layers):
        return Verdict(AGREES, f"NeuTRENO's {what} is {counted}")
    if 2 * len(lower) < len(layers):
        return Verdict(DISAGREES, f"NeuTRENO's {what} is {counted}")
    return Verdict(INCONCLUSIVE, f"NeuTRENO's {what} is {counted}: mostly, not everywhere")


def accuracy_noise(top1_a: float, top1_b: float, count: int) -> float:
    """Two standard errors (percentage points) of the difference of two top-1 accuracies (percent), each
    on ``count`` test images: the binomial sampling noise alone, not the seed-to-seed spread."""
    p, q = top1_a / 100, top1_b / 100
    return 200 * math.sqrt((p * (1 - p) + q * (1 - q)) / count)


def late_layers(depth: int) -> list[int]:
    """The second half of a stack of ``depth`` blocks (per-layer lists index 0 = the embeddings)."""
    return list(range(depth // 2 + 1, depth + 1))

"""The NeuTRENO paper's cost claim (App. G.4): the same FLOPs, memory and time as softmax."""

from __future__ import annotations

import math

from neutreno.reproduce.claim import claim
from neutreno.reproduce.runs import Context
from neutreno.reproduce.verdict import AGREES, DISAGREES, INCONCLUSIVE, Verdict

COUNTED = ("train_flops_per_sample", "memory_bytes")
TIMED = ("inference_s_per_sample", "train_s_per_sample")
RATIOS = COUNTED + TIMED
COST_NAMES = {
    "train_flops_per_sample": "training FLOPs",
    "memory_bytes": "training memory",
    "inference_s_per_sample": "inference time",
    "train_s_per_sample": "training time",
}


@claim(
    name="efficiency",
    title="NeuTRENO costs what softmax costs",
    source="NeuTRENO, App. G.4 (Table 11)",
    paper="FLOPs, memory and time of NeuTRENO relative to softmax are ≈1 (DeiT-tiny).",
    minutes=(0.3, 1.0, 2.0),
    judge=lambda m: judge_efficiency(m),
    rule="counted FLOPs and memory: agree within 5%, disagree beyond 10%; times (95% interval over the "
    "interleaved rounds): agree when it lies within 15%, disagree when it lies wholly beyond",
)
def efficiency(ctx: Context) -> dict:
    from neutreno.studies.efficiency import measure_efficiency

    name, batch, rounds = ctx.pick(
        ("vit_tiny_patch4_32", 32, 3), ("deit_tiny_patch16_224", 16, 5), ("deit_tiny_patch16_224", 16, 5)
    )
    result = measure_efficiency(name, ["softmax", "neutreno"], batch=batch, rounds=rounds)
    neutreno = result["variants"]["neutreno"]
    # Counted costs as counted; timed ones as the geometric mean of the rounds' ratios, with its interval.
    timed = neutreno["time_ratio"]
    ratio = {k: neutreno["ratio"][k] for k in COUNTED} | {k: timed[k]["ratio"] for k in TIMED}
    interval = {k: [timed[k]["low"], timed[k]["high"]] for k in TIMED}
    shown = [f"{ratio[k]:.2f}" for k in COUNTED] + [f"{ratio[k]:.2f} {_bracket(interval[k])}" for k in TIMED]
    return {
        "setting": f"`{name}`, batch {batch}, fp32 on the CPU, {rounds} interleaved timing rounds",
        "ratio": ratio,
        "interval": interval,
        "ours": "NeuTRENO/softmax " + " / ".join(shown) + " (FLOPs / memory / infer / train)",
        "table": [
            ["NeuTRENO / softmax", *RATIOS],
            ["ratio", *(f"{ratio[k]:.3f}" for k in RATIOS)],
            ["95% interval", "", "", *(_bracket(interval[k]) for k in TIMED)],
        ],
        "plot": {
            "kind": "bars",
            "bars": {COST_NAMES[k]: ratio[k] for k in RATIOS},
            "reference": {"equal cost": 1.0},
            "ylabel": "cost ratio, NeuTRENO / softmax",
        },
    }


def _bracket(bounds: list) -> str:
    low, high = bounds
    return "[no interval]" if low is None or high is None else f"[{low:.2f}, {high:.2f}]"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def judge_efficiency(m: dict) -> Verdict:
    """Counted costs (FLOPs, memory: no noise) within 5% agree, beyond 10% disagree. A timed cost (a
    shared machine's wall clock) is judged by the 95% interval of its ratio over the interleaved rounds:
    it agrees when the interval lies within 15%, disagrees when it lies wholly beyond, and otherwise the
    noise leaves it open. NeuTRENO does all of softmax's work and more, so a ratio below those bands (or
    one not finite) is a measuring fault: inconclusive."""
    r, intervals = m["ratio"], m.get("interval") or {}
    values = [r[k] for k in RATIOS]
    if not all(_finite(v) for v in values):
        return Verdict(INCONCLUSIVE, f"a cost ratio is not a finite number ({', '.join(map(str, values))})")
    counted = max(r[k] for k in COUNTED)
    timed = max(r[k] for k in TIMED)
    said = f"FLOPs/memory ratio up to {counted:.3f}, time ratio up to {timed:.3f}"
    lowest_counted, lowest_timed = min(r[k] for k in COUNTED), min(r[k] for k in TIMED)
    if lowest_counted < 0.95 or lowest_timed < 0.85:
        return Verdict(
            INCONCLUSIVE,
            f"{said}, down to {lowest_counted:.3f} counted and {lowest_timed:.3f} timed: NeuTRENO cannot "
            "cost less than the softmax it extends; a cost was not measured (a kernel not counted?)",
        )
    if counted > 1.10:  # counted, not timed: no noise to wait for (it was inconclusive without intervals)
        return Verdict(DISAGREES, f"{said}: NeuTRENO counts more than the paper's ≈1")
    bounds = {k: intervals.get(k) or [None, None] for k in TIMED}
    if not all(_finite(b) for k in TIMED for b in bounds[k]):
        return Verdict(INCONCLUSIVE, f"{said}: a time ratio has no interval (fewer than 2 rounds?)")
    lows, highs = [bounds[k][0] for k in TIMED], [bounds[k][1] for k in TIMED]
    said += " (" + ", ".join(f"{COST_NAMES[k]} {_bracket(bounds[k])}" for k in TIMED) + ")"
    if max(lows) > 1.15:
        return Verdict(DISAGREES, f"{said}: NeuTRENO takes more time than the paper's ≈1, beyond the noise")
    # within 15% on both sides: an interval reaching below 0.85 allows NeuTRENO to be faster, a fault
    if counted <= 1.05 and min(lows) >= 0.85 and max(highs) <= 1.15:
        return Verdict(AGREES, f"{said}: ≈1, as the paper reports")
    if counted > 1.05:
        return Verdict(INCONCLUSIVE, f"{said}: slightly above 1 (allowed: 1.05 counted)")
    return Verdict(INCONCLUSIVE, f"{said}: a time ratio's interval reaches beyond 0.85–1.15 (the noise)")

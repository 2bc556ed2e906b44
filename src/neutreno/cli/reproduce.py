"""``neutreno reproduce CLAIM … | --all [--scale quick|medium|full] [--seeds N] [--jobs J]``: the papers'
claims measured and judged."""

from __future__ import annotations

import argparse
from pathlib import Path

from neutreno.cli.types import integer, seed
from neutreno.io import FolderLock, check_output_folder, first_missing, remove_if_only_lock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neutreno.reproduce.runs import DEFAULT_SEEDS, SCALES

    parser.add_argument("claims", nargs="*", metavar="CLAIM", help="claims to reproduce (--list names them)")
    parser.add_argument("--all", action="store_true", help="every claim, and an index (OUT/index.md)")
    parser.add_argument(
        "--index", action="store_true",
        help="only rewrite OUT/index.md from the reports in OUT (every scale); measures nothing",
    )  # fmt: skip
    parser.add_argument(
        "--scale", choices=SCALES, default=None,
        help="quick: minutes on 2 cores (tiny models); medium: CIFAR ViTs of 12 blocks on the full set; "
        "full: the presets in configs/ (default full)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="the same as --scale quick")
    parser.add_argument(
        "--seeds", type=integer, default=None,
        help="seeds per trained arm (default: "
        + ", ".join(f"{s} {n}" for s, n in DEFAULT_SEEDS.items()) + ")",
    )  # fmt: skip
    parser.add_argument(
        "--jobs",
        type=integer,
        default=None,
        help="trainings at a time, each on its share of the cores (default 2)",
    )
    parser.add_argument("--list", action="store_true", help="list the claims and exit")
    parser.add_argument(
        "--out", type=Path, default=Path("reproduce"), help="output folder (default: reproduce)"
    )
    parser.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="the folder of real datasets (default: the NEUTRENO_DATA environment variable)",
    )
    parser.add_argument("--seed", type=seed, default=None, help="the first seed (default 0)")


def data_root(given: Path | None) -> tuple[Path, str]:
    """--data-root, else $NEUTRENO_DATA; a ConfigError naming both when neither is set, or naming
    the one given when it is not a folder. Returns the folder and how it was named."""
    import os

    from neutreno.config import DATA_ENV, ConfigError

    if given is not None:
        root, named = given, f"--data-root {given}"
    elif os.environ.get(DATA_ENV):
        root = Path(os.environ[DATA_ENV])
        named = f"{DATA_ENV}={root}"
    else:
        raise ConfigError(f"where are the datasets? pass --data-root DIR or set {DATA_ENV}=DIR")
    return root, named


def run(args) -> int:
    from neutreno.config import ConfigError
    from neutreno.reproduce import CLAIMS, Context, expected_minutes, run_claims

    measuring = {"--all": args.all, "--scale": args.scale, "--quick": args.quick, "--seeds": args.seeds,
                 "--seed": args.seed, "--jobs": args.jobs, "--data-root": args.data_root}  # fmt: skip
    given = ["claims"] * bool(args.claims) + [
        k for k, v in measuring.items() if v is not None and v is not False
    ]
    if args.list:
        if given or args.index:
            what = ", ".join(given + ["--index"] * args.index)
            raise ValueError(f"--list lists the claims only, measuring nothing: {what} would be ignored")
        name_width = max(len(c.name) for c in CLAIMS.values())
        source_width = max(len(c.source) for c in CLAIMS.values())
        for claim in CLAIMS.values():
            print(f"{claim.name:<{name_width}}  {claim.source:<{source_width}}  {claim.title}")
        return 0
    if args.index:
        from neutreno.reproduce.report import last_run, scale_records, write_index

        if given:
            raise ValueError(
                f"--index rewrites the index only, measuring nothing: {', '.join(given)} would be ignored"
            )
        if not args.out.is_dir():
            raise ValueError(f"--out {args.out} is not a folder of reports")
        if not scale_records(args.out):  # any folder got a lock, an empty index.md and index.json
            raise ValueError(f"--out {args.out} holds no claim's report (<scale>/<claim>/result.json)")
        _lock = FolderLock(args.out)
        print(f"wrote {write_index(args.out, list(CLAIMS), last_run(args.out))[0]}")
        return 0
    if args.all and args.claims:
        named = " ".join(args.claims)
        raise ValueError(f"--all measures every claim: give it or claim names ({named}), not both")
    if not args.all and not args.claims:
        raise ValueError("give claims to reproduce or --all (see --list)")
    unknown = [name for name in args.claims if name not in CLAIMS]
    if unknown:
        raise ValueError(f"unknown claim(s) {', '.join(unknown)}; valid: {', '.join(CLAIMS)}")
    if args.quick and args.scale not in (None, "quick"):
        raise ValueError(f"--quick and --scale {args.scale} contradict each other")
    check_output_folder(args.out, "--out")
    scale = "quick" if args.quick else args.scale or "full"
    root, named = data_root(args.data_root)
    jobs, first_seed = 2 if args.jobs is None else args.jobs, args.seed or 0
    ctx = Context(args.out, root, scale, args.seeds, first_seed, jobs)  # checks the other arguments
    if not root.is_dir():  # every claim would be "skipped", each over an earlier run's verdict
        raise ConfigError(f"{named}: no such folder")
    claims = list(CLAIMS.values()) if args.all else [CLAIMS[name] for name in dict.fromkeys(args.claims)]
    minutes, todo, done = expected_minutes(claims, ctx)
    expected = f"about {minutes:.0f} min" if minutes >= 1 else "under a minute"
    print(
        f"{len(claims)} claim(s) at {ctx.scale} scale, {ctx.seeds} seed(s) per trained arm: expected "
        f"{expected} on 2 CPU cores ({todo} training(s) to run, {done} already finished and reused)",
        flush=True,
    )
    # held to the end: two reproductions into one folder mixed their reports
    created, lock = first_missing(args.out), FolderLock(args.out)
    try:
        records = run_claims(claims, ctx, index=args.all)
    except BaseException:  # refused before any work (a missing preset): no folder left of the lock alone
        lock.release()
        if created:
            remove_if_only_lock(args.out, created)
        raise
    failed = [r["claim"] for r in records if r.get("failed")]
    if args.all:
        print(f"\nwrote {args.out / 'index.md'}")
    if failed:
        print(f"neutreno reproduce: error: the measurement of {', '.join(failed)} failed (see above)")
        return 1
    return 0

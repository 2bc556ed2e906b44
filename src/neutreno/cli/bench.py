"""``neutreno bench efficiency --model NAME``: parameters, FLOPs, memory and time per sample of each
attention variant, as ratios measured in one run (paper App. G.4)."""

from __future__ import annotations

import argparse
from pathlib import Path

from neutreno.cli.types import integer
from neutreno.io import check_output_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neutreno.studies import efficiency

    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = benches.add_parser(
        "efficiency",
        help="parameters, FLOPs, memory and time per sample: softmax vs NeuTRENO and the other variants",
        description=efficiency.__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--model", default="deit_tiny_patch16_224", help="a registry model (default deit_tiny_patch16_224)"
    )
    p.add_argument(
        "--attentions",
        default="softmax,neutreno",
        help="comma list, the first is the reference; 'all': every type (default softmax,neutreno)",
    )
    p.add_argument("--batch", type=integer, default=16, help="samples per step (default 16)")
    p.add_argument("--rounds", type=integer, default=5, help="interleaved timing rounds (default 5)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    p.add_argument("--device", default="auto", help="auto: a GPU if there is one, else the CPU")
    p.add_argument("--out", type=Path, default=Path("runs/bench_efficiency"), help="output folder")


def run(args) -> int:
    import torch

    from neutreno.io import FolderLock, atomic_path, remove_report, write_json
    from neutreno.layers import ATTENTION_TYPES
    from neutreno.models import list_models
    from neutreno.studies import efficiency
    from neutreno.training.distributed import resolve_device

    attentions = list(ATTENTION_TYPES) if args.attentions == "all" else args.attentions.split(",")
    unknown = [a for a in attentions if a not in ATTENTION_TYPES]
    if unknown:
        raise ValueError(f"unknown attention(s) {unknown}; valid: {', '.join(ATTENTION_TYPES)}")
    twice = sorted({a for a in attentions if attentions.count(a) > 1})
    if twice:  # measured once, shown once: the table had fewer rows than asked for
        raise ValueError(f"--attentions names {', '.join(twice)} twice")
    if args.model not in list_models():
        raise ValueError(f"unknown model {args.model!r}; valid: {', '.join(list_models())}")
    if args.batch < 1 or args.rounds < 2:  # one round's ratio has no interval: noise printed as a ratio
        raise ValueError(f"--batch must be >= 1 and --rounds >= 2, got {args.batch} and {args.rounds}")
    check_output_folder(args.out, "--out")
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    result = efficiency.measure_efficiency(
        args.model,
        attentions,
        batch=args.batch,
        rounds=args.rounds,
        dtype=dtype,
        device=resolve_device(args.device),
    )
    table = efficiency.markdown_table(result)
    setting = f"{args.model}, batch {args.batch}, {result['dtype']} on {result['device']}"
    print(f"\n{setting}; ratios to {attentions[0]}\n")
    print(table)
    _lock = FolderLock(args.out)  # two benches into one folder left one's json beside the other's table
    remove_report(args.out, ["efficiency.json", "efficiency.md"])
    write_json(args.out / "efficiency.json", result)
    with atomic_path(args.out / "efficiency.md") as tmp:
        tmp.write_text(table + "\n")
    print(f"\nwrote {args.out / 'efficiency.json'}, {args.out / 'efficiency.md'}")
    return 0

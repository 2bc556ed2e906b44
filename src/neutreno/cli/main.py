"""The ``neutreno`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neutreno", description="NeuTRENO attention and over-smoothing tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train softmax vs NeuTRENO ViTs on the digits and compare over-smoothing per layer"
    )
    demo.add_argument(
        "--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)"
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=40, help="training epochs per model (default: 40)"
    )
    demo.add_argument("--seed", type=_non_negative_int, default=0, help="random seed (default: 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from neutreno.cli.demo import run_demo

        if args.out.exists() and not args.out.is_dir():
            print(f"neutreno demo: error: --out {args.out} exists and is not a folder", file=sys.stderr)
            return 2
        run_demo(args.out, epochs=args.epochs, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

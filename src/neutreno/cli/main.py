"""The ``neutreno`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _int_at_least(minimum: int):
    """argparse type: an integer >= ``minimum``, else a one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


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
        "--epochs", type=_int_at_least(1), default=40, help="training epochs per model (default: 40)"
    )
    demo.add_argument("--seed", type=_int_at_least(0), default=0, help="random seed (default: 0)")
    analyze = commands.add_parser(
        "analyze", help="per-layer over-smoothing metrics of one or several models on real data"
    )
    from neutreno.cli.analyze import add_arguments

    add_arguments(analyze)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from neutreno.cli.demo import run_demo

        if args.out.exists() and not args.out.is_dir():
            print(f"neutreno demo: error: --out {args.out} exists and is not a folder", file=sys.stderr)
            return 2
        run_demo(args.out, epochs=args.epochs, seed=args.seed)
    elif args.command == "analyze":
        from neutreno.cli.analyze import run

        if args.samples < 1 or args.batch_size < 1:
            print("neutreno analyze: error: --samples and --batch-size must be >= 1", file=sys.stderr)
            return 2
        try:
            return run(args)
        except (ValueError, FileNotFoundError) as error:
            print(f"neutreno analyze: error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The arguments commands share: value types that turn a bad number into one line of usage error, and
``--set key=value``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from neutreno.constants import SEED_LIMIT

INT64 = 2**63  # torch's sizes and counts are 64-bit: a larger one was a traceback ("Overflow when unpacking")


def integer(text: str) -> int:
    """An integer of 64 bits (the range the other checks of a count or size then narrow)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -INT64 <= value < INT64:
        raise argparse.ArgumentTypeError(f"expected an integer below 2**63, got {value}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= ``minimum`` (and below 2**63)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        if value >= INT64:
            raise argparse.ArgumentTypeError(f"expected an integer below 2**63, got {value}")
        return value

    return parse


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**32). PyTorch's CPU generator (a Mersenne Twister) reads only a
    seed's low 32 bits, so seeds 2**32 apart, or -1 and 2**32 - 1, gave the same samples and runs."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, 2**32), got {value}")
    return value


def finite_at_least(minimum: float) -> Callable[[str], float]:
    """A finite number >= ``minimum`` (nan and inf are refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum:g}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a finite number >= {minimum:g}, got {text}")
        return value

    return parse


def probability(text: str) -> float:
    """A number in (0, 1] (a nucleus mass: 0 would keep no token)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def add_set_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--set KEY=VALUE`` config overrides into ``args.overrides`` (``scope``: e.g. " in every run")."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value{scope}, e.g. --set train.epochs=10 (repeatable)",
    )


def refuse_blank_values(parser: argparse.ArgumentParser) -> None:
    """Make every argument of ``parser`` and its subcommands that takes plain text or a path refuse a
    blank one, as an unset shell variable gives: ``--out ""`` wrote into the current folder (``Path("")``
    is ``.``), ``train --finetune ""`` trained from scratch, ``eval --data ""`` scored the run's own data
    and ``robustness --baseline ""`` gave no mCE, each with exit 0. A path starting with ``~`` is the
    home folder's, as in a config value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                refuse_blank_values(command)
        elif action.nargs != 0 and action.choices is None and action.type in (None, str, Path):
            action.type = _not_blank(action.type or str)


def _not_blank(convert: Callable[[str], object]) -> Callable[[str], object]:
    def parse(text: str) -> object:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected a value, got {text!r} (an unset shell variable?)")
        if convert is Path:  # a shell leaves ~ in --out=~/x as it is: a folder named "~" was made
            return Path(text).expanduser()
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse names the type in its errors
    return parse

"""Progress bars that follow tqdm's conventions: a live bar on a terminal; in a log file (not a
terminal) a plain line every tenth of the work instead of carriage returns; none when
``TQDM_DISABLE=1`` or on processes other than the main one."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any


def _env_disabled() -> bool:
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


class _Lines:
    """The non-terminal stand-in for a tqdm bar: the same calls, one line per tenth of ``total``."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, unit: str, initial: int = 0):
        self.iterable, self.desc, self.unit, self.n = iterable, desc or "progress", unit, initial
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.every = max(1, (self.total or 10) // 10)
        self.postfix, self.start = "", time.perf_counter()

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()

    def __enter__(self) -> _Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        if self.n // self.every > before // self.every or (self.total and self.n == self.total):
            of = f"/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else ""
            seconds = time.perf_counter() - self.start
            print(f"{self.desc}: {self.n}{of} {self.unit}, {seconds:.0f} s{self.postfix}", file=sys.stderr)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", " + ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        pass

    @staticmethod
    def write(text: str, file: Any = None) -> None:
        print(text, file=file or sys.stderr)


class _Off(_Lines):
    def update(self, n: int = 1) -> None:
        self.n += n


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    leave: bool = True,
    initial: int = 0,
) -> Any:
    """A tqdm bar over ``iterable`` (or updated by hand with ``total``) where a person watches a
    terminal; progress lines in a log (none for a transient ``leave=False`` bar); nothing when
    ``enabled`` is false or ``TQDM_DISABLE`` is set."""
    if not enabled or _env_disabled():
        return _Off(iterable, total, desc, unit, initial)
    if not sys.stderr.isatty():  # transient (leave=False) bars print nothing in a log
        return (_Lines if leave else _Off)(iterable, total, desc, unit, initial)
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, initial=initial, dynamic_ncols=True)


def note(text: str) -> None:
    """A warning or note on stderr from code every process runs (reading data, loading weights): said by
    the main process only under ``torchrun`` (``RANK`` 0 or unset), where each would say it again."""
    if os.environ.get("RANK", "0").strip() in ("", "0"):
        print(text, file=sys.stderr)


def write(text: str) -> None:
    """A line to stderr that does not break a live bar."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stderr)

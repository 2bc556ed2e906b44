"""How results become files a person reads: Markdown tables, CSV and matplotlib PNGs, each written
atomically. Every report, study and command uses these; the numbers that go into them are computed
elsewhere."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from neutreno.io import atomic_path

# Metric keys as a reader names them (plots label axes in words, not keys).
METRIC_NAMES = {
    "top1": "top-1 accuracy (%)",
    "top5": "top-5 accuracy (%)",
    "ppl": "perplexity",
    "miou": "mIoU (%)",
    "accuracy": "accuracy (%)",
    "loss": "loss",
}


def metric_name(key: str) -> str:
    """``key`` in words (``"top1"`` → ``"top-1 accuracy (%)"``); unknown keys with ``_`` as spaces."""
    return METRIC_NAMES.get(key, key.replace("_", " "))


def markdown_table(rows: Sequence[Sequence[Any]]) -> str:
    """A header row then data rows as a Markdown table (``|`` inside a cell is escaped)."""
    rows = [list(row) for row in rows]
    lines = ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def write_csv(path: str | os.PathLike, rows: Iterable[Sequence[Any]]) -> Path:
    """A header row then data rows as CSV, written atomically. Returns ``path``."""
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    with atomic_path(path) as tmp:
        tmp.write_text(buffer.getvalue())
    return Path(path)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), imported when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG, atomically, and close it. Returns ``path``."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    pyplot().close(fig)
    return Path(path)

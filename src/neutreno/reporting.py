"""How results become files a person reads: Markdown tables, CSV and matplotlib PNGs, each written
atomically. Every report, study and command uses these; the numbers that go into them are computed
elsewhere."""

from __future__ import annotations

import csv
import functools
import io
import math
import numbers
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
    # the per-layer diagnostics (math.md §3)
    "cosine": "token cosine similarity",
    "rank_residual": "rank-collapse residual ‖res(X)‖ / ‖X‖",
    "rank_residual_l1inf": "rank-collapse residual, ℓ1,∞ norm",
    "high_frequency": "high-frequency ratio ‖res(X)‖ / ‖1x̄ᵀ‖",
    "effective_rank": "effective rank",
    "energy": "nonlocal energy J",
    "gradient_alignment": "gradient alignment cos(g_sym, g_asym)",
    "head_redundancy": "head redundancy (attention cosine, ℓ vs ℓ + 1)",
    "head_redundancy_matched": "head redundancy, head h vs head h",
    "head_redundancy_best": "head redundancy, each head vs its closest",
}
# The range a quantity can take: a value axis widened by ``readable_ylim`` stays inside it.
METRIC_RANGES: dict[str, tuple[float | None, float | None]] = {
    "cosine": (-1.0, 1.0),
    "gradient_alignment": (-1.0, 1.0),
    "head_redundancy": (0.0, 1.0),
    "head_redundancy_matched": (0.0, 1.0),
    "head_redundancy_best": (0.0, 1.0),
    "rank_residual": (0.0, 1.0),
    "rank_residual_l1inf": (0.0, None),
    "high_frequency": (0.0, None),
    "effective_rank": (1.0, None),
    "energy": (0.0, None),
    "top1": (0.0, 100.0),
    "top5": (0.0, 100.0),
    "miou": (0.0, 100.0),
    "accuracy": (0.0, 100.0),
}
LAYER_AXIS = "layer (0 = embeddings)"


def metric_name(key: str) -> str:
    """``key`` in words (``"top1"`` → ``"top-1 accuracy (%)"``); unknown keys with ``_`` as spaces."""
    return METRIC_NAMES.get(key, key.replace("_", " "))


def layer_axis(ax, label: str = LAYER_AXIS) -> None:
    """Label the x axis of a by-layer plot (layer 0 the embeddings, layer ℓ block ℓ's output, unless
    ``label`` says otherwise) and tick it at whole layers only."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def readable_ylim(
    ax, min_span: float | None = None, bounds: tuple[float | None, float | None] = (None, None)
) -> tuple[float, float]:
    """Keep matplotlib from stretching a tiny spread into a cliff: after autoscaling (which covers
    every line, error bar and reference line drawn), a y range narrower than ``min_span`` (default a
    tenth of the largest value's size) is widened to it about its centre, then moved inside
    ``bounds`` (the quantity's own range, e.g. (-1, 1) for a cosine; a 5% margin past them is kept).
    So 0.99991 … 0.99999 shows as a flat line near 1, not a drop across the whole plot. On a log axis
    the same rule holds in decades (default one decade), and ticks read 0.06, 0.1, not 6×10⁻².
    Returns the limits set."""
    from matplotlib.ticker import ScalarFormatter

    ax.autoscale_view()
    low, high = ax.get_ylim()
    log = ax.get_yscale() == "log"
    if log:
        formatter = _plain_log_formatter()
        ax.yaxis.set_major_formatter(formatter())
        ax.yaxis.set_minor_formatter(formatter(labelOnlyBase=False))
        low, high = math.log10(low), math.log10(high)
        bounds = tuple(None if b is None or b <= 0 else math.log10(b) for b in bounds)
        need = 1.0 if min_span is None else min_span
    else:
        if isinstance(ax.yaxis.get_major_formatter(), ScalarFormatter):
            ax.ticklabel_format(axis="y", useOffset=False)  # never "1e-5 + 9.999e-1"
        need = (0.1 * max(abs(low), abs(high)) if min_span is None else min_span) or 1.0
    if high - low < need:
        centre, slack = (low + high) / 2, 0.05 * need
        floor, ceiling = bounds
        # a bound the data cross (an AttnScale head's energy below 0) would move them off the axis
        floor = None if floor is not None and low < floor else floor
        ceiling = None if ceiling is not None and high > ceiling else ceiling
        low, high = centre - need / 2, centre + need / 2
        if ceiling is not None and high > ceiling + slack:
            low, high = low - (high - ceiling - slack), ceiling + slack
        if floor is not None and low < floor - slack:
            low, high = floor - slack, high + (floor - slack - low)
            if ceiling is not None:
                high = min(high, ceiling + slack)
        ax.set_ylim(*((10**low, 10**high) if log else (low, high)))
    return tuple(float(v) for v in ax.get_ylim())


def markdown_table(rows: Sequence[Sequence[Any]]) -> str:
    """A header row then data rows as a Markdown table (``|`` inside a cell is escaped, line breaks, which
    end a row, become spaces).

    Raises:
        ValueError: a row of another length than the header (its cells would stand under other columns).
    """
    rows = [list(row) for row in rows]
    ragged = [i for i, row in enumerate(rows) if len(row) != len(rows[0])]
    if ragged:
        row = rows[ragged[0]]
        raise ValueError(
            f"table row {ragged[0]} ({row[0]!r}) has {len(row)} cells, its header {len(rows[0])}"
        )
    lines = [
        "| " + " | ".join(" ".join(str(cell).splitlines()).replace("|", "\\|") for cell in row) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def _missing(value: Any) -> bool:
    """None or a float that is not finite: report.json's null, an empty CSV cell."""
    return value is None or (isinstance(value, numbers.Real) and not math.isfinite(value))


def number(value: float | None) -> str:
    """A measured value for a CSV cell, to 6 significant digits; empty for a missing or non-finite one
    (report.json's null), as every CSV writes it."""
    return "" if _missing(value) else f"{value:.6g}"


def _cell(value: Any) -> Any:
    return "" if _missing(value) else value


def write_csv(path: str | os.PathLike, rows: Iterable[Sequence[Any]]) -> Path:
    """A header row then data rows as CSV, written atomically; a float that is not finite, or None, is an
    empty cell (analyze wrote ``nan`` where its report.json has null). Returns ``path``."""
    buffer = io.StringIO()
    csv.writer(buffer).writerows([_cell(value) for value in row] for row in rows)
    with atomic_path(path) as tmp:
        tmp.write_text(buffer.getvalue())
    return Path(path)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), imported when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@functools.cache
def _plain_log_formatter():
    """A log-axis tick formatter: matplotlib's choice of which ticks to label, written as plain
    numbers (0.06, 0.1, 1e-06) rather than 6×10⁻²."""
    from matplotlib.ticker import LogFormatterSciNotation

    class PlainLogFormatter(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG, atomically, and close it. Returns ``path``."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    pyplot().close(fig)
    return Path(path)

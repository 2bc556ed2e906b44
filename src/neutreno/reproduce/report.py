"""Reports of ``neutreno reproduce``: per claim ``report.md`` (paper, ours, plot, verdict),
``result.json`` and ``plot.png``; for ``--all`` an ``index.md``/``index.json`` of every verdict."""

from __future__ import annotations

import math
from pathlib import Path

from neutreno.io import atomic_path, write_json

PLOT = "plot.png"


def markdown_table(rows: list[list]) -> str:
    """A header row and data rows as a Markdown table."""
    lines = ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def plot(spec: dict, path: Path, title: str) -> Path:
    """``spec["kind"]``: ``"lines"`` (``x`` and ``series`` {label: y values}) or ``"bars"`` (``bars``
    {label: value}); an optional ``reference`` {label: value} is drawn as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    if spec["kind"] == "lines":
        for label, values in spec["series"].items():
            ax.plot(spec["x"], values, marker="o", label=label)
        ax.set_xlabel(spec["xlabel"])
    else:
        labels = list(spec["bars"])
        ax.bar(range(len(labels)), list(spec["bars"].values()), color="tab:blue")
        ax.set_xticks(
            range(len(labels)), labels, rotation=30 if len(labels) > 3 else 0, ha="right", fontsize=8
        )
        values = [v for v in spec["bars"].values() if math.isfinite(v)]
        if values and min(values) > 0:  # zoom on the differences when every bar is far from zero
            low = min(values + list(spec.get("reference", {}).values()))
            ax.set_ylim(bottom=max(0.0, low - 0.1 * (max(values) - low + 1e-9) - 0.05 * low))
    for i, (label, value) in enumerate(spec.get("reference", {}).items()):
        ax.axhline(value, color="grey", linestyle=("--", ":")[i % 2], lw=1, label=label)
    ax.set_ylabel(spec["ylabel"])
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path


def write_claim_report(folder: Path, record: dict) -> list[Path]:
    """``report.md`` and ``result.json`` (and ``plot.png`` when measured) of one claim's record."""
    measured = record.get("measured") or {}
    written = []
    if "plot" in measured:
        written.append(plot(measured["plot"], folder / PLOT, record["title"]))
    lines = [
        f"# {record['title']}",
        "",
        f"**Verdict: {record['verdict']}** — {record['reason']}.",
        "",
        f"Claim `{record['claim']}` ({record['source']}), {record['scale']} scale: "
        f"`neutreno reproduce {record['claim']}{' --quick' if record['scale'] == 'quick' else ''}`.",
        "",
        "## The paper",
        "",
        record["paper"],
        "",
        "## Ours",
        "",
    ]
    if measured:
        setting = measured["setting"]
        lines += [f"{setting[:1].upper()}{setting[1:]}.", "", markdown_table(measured["table"]), ""]
        if "plot" in measured:
            lines += [f"![{record['claim']}]({PLOT})", ""]
        lines.append(f"Measured in {record['seconds']:.0f} s.")
    else:
        lines.append("Not measured.")
    with atomic_path(folder / "report.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    write_json(folder / "result.json", record)
    return [folder / "report.md", folder / "result.json", *written]


def index_table(records: list[dict]) -> str:
    rows = [["claim", "source", "ours", "verdict", "why"]]
    for r in records:
        rows.append(
            [
                f"[{r['claim']}]({r['claim']}/report.md)",
                r["source"],
                r.get("ours", "—"),
                f"**{r['verdict']}**",
                r["reason"],
            ]
        )
    return markdown_table(rows)


def write_index(out: Path, records: list[dict], meta: dict) -> list[Path]:
    """``index.md`` (one row per claim, linking its report) and ``index.json``."""
    counts = {}
    for r in records:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    summary = ", ".join(f"{n} {verdict}" for verdict, n in counts.items())
    text = (
        f"# neutreno reproduce --all{' --quick' if meta['scale'] == 'quick' else ''}\n\n"
        f"{len(records)} claims: {summary}. {meta['scale'].capitalize()} scale, data from "
        f"`{meta['data_root']}`, "
        f"{meta['minutes']:.1f} min on {meta['machine']}.\n\n{index_table(records)}\n"
    )
    with atomic_path(out / "index.md") as tmp:
        tmp.write_text(text)
    write_json(out / "index.json", {**meta, "claims": records})
    return [out / "index.md", out / "index.json"]

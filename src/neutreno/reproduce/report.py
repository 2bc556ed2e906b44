"""Reports of ``neutreno reproduce``: per claim and scale ``report.md`` (the paper, our scale and numbers,
the plot, the verdict with its interval), ``result.json`` and ``plot.png``; for ``--all`` an
``index.md``/``index.json`` of every claim at every scale found in the output folder, flagging claims
whose verdicts differ between scales."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from neutreno.io import atomic_path, remove_report, write_json
from neutreno.reporting import markdown_table, pyplot, readable_ylim, save_figure
from neutreno.reproduce.runs import SCALES
from neutreno.reproduce.verdict import AGREES, DISAGREES, INFORMATION, VERDICTS

PLOT = "plot.png"


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


def plot(spec: dict, path: Path, title: str) -> Path:
    """``spec["kind"]``: ``"lines"`` (``x``, ``series`` {label: y}, optional ``errors`` {label: ±y} and
    ``xs`` {label: its own x}) or
    ``"bars"`` (``bars`` {label: value}, optional ``errors`` and ``points`` {label: per-seed values});
    ``reference`` {label: value} is drawn as horizontal lines; ``logy`` a log y axis. The y range is
    kept from turning a tiny spread into a cliff (:func:`neutreno.reporting.readable_ylim`)."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    errors = spec.get("errors", {})
    if spec["kind"] == "lines":
        for label, values in spec["series"].items():
            x = spec.get("xs", {}).get(label, spec["x"])
            if errors.get(label) and any(errors[label]):
                ax.errorbar(x, values, yerr=errors[label], marker="o", capsize=3, label=label)
            else:
                ax.plot(x, values, marker="o" if len(values) < 30 else None, label=label)
        ax.set_xlabel(spec["xlabel"])
        if all(float(x).is_integer() for x in spec["x"]):  # layers, depths, grid points: whole ticks
            points = sorted(set(spec["x"]))
            if len(points) <= 13:
                ax.set_xticks(points)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    else:
        labels = list(spec["bars"])
        yerr = [errors.get(label, 0.0) for label in labels] if errors else None
        values = [v for v in spec["bars"].values() if math.isfinite(v)]
        shown = values + [p for ps in spec.get("points", {}).values() for p in ps]
        # far from zero the axis is zoomed on the differences, and a bar's length would no longer be its
        # value (60.1 against 60.6 drawn as bars of very different lengths): points with error bars there
        zoomed = bool(values) and min(shown) > 0 and not spec.get("logy")
        if zoomed:
            ax.errorbar(
                range(len(labels)), list(spec["bars"].values()), yerr=yerr, fmt="s", ms=7, capsize=4,
                color="tab:blue",
            )  # fmt: skip
        else:
            ax.bar(
                range(len(labels)), list(spec["bars"].values()), yerr=yerr, capsize=4, color="tab:blue",
                alpha=0.8,
            )  # fmt: skip
        for i, label in enumerate(labels):
            points = spec.get("points", {}).get(label, [])
            ax.plot([i] * len(points), points, "k.", ms=5)
        ax.set_xticks(
            range(len(labels)),
            [label.replace("_", " ") for label in labels],
            rotation=30 if len(labels) > 3 else 0,
            ha="right" if len(labels) > 3 else "center",
            fontsize=8,
        )
        if zoomed:  # zoom on differences far from zero
            low = min(shown + list(spec.get("reference", {}).values()))
            ax.set_ylim(bottom=max(0.0, low - 0.1 * (max(shown) - low + 1e-9) - 0.05 * low))
    for i, (label, value) in enumerate(spec.get("reference", {}).items()):
        ax.axhline(value, color="grey", linestyle=("--", ":")[i % 2], lw=1, label=label)
    if spec.get("logy"):
        ax.set_yscale("log")
    readable_ylim(ax)
    ax.set_ylabel(_wrap(spec["ylabel"], 48), fontsize=9)
    ax.set_title(_wrap(title, 72), fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # under the plot, where it hides no bar or line
        columns = min(3 if max(map(len, labels)) <= 30 else 2, len(labels))  # long labels: fewer, or cut off
        fig.legend(handles, labels, loc="outside lower center", ncol=columns, fontsize=8, frameon=False)
    save_figure(fig, path, dpi=110)
    return path


def _convergence_lines(measured: dict) -> list[str]:
    checks = measured.get("convergence") or []
    lines = []

    def group(check: dict) -> tuple[str, str]:  # its training's metric and tolerance's source
        return check.get("metric") or "score", check.get("why") or "the paper's effect"

    # one paragraph per training's metric and tolerance (a claim over two trainings has two)
    for metric, why in dict.fromkeys(map(group, checks)):
        lines += [
            "",
            f"**Convergence**: the training's validation {metric} of the first seed with half the schedule "
            f"→ the full schedule. Tolerance: {why}.",
            "",
        ]
        for c in checks:
            if group(c) != (metric, why):
                continue
            unit = "%" if c.get("relative") else ""
            state = "converged" if c["converged"] else "**not converged**"
            lines.append(
                f"- {c['arm']}: {c['half']:.4g} → {c['full']:.4g}, {c['change']:+.3g}{unit} "
                f"(tolerance ±{c['tolerance']:g}{unit}): {state}"
            )
    return lines


def write_claim_report(folder: Path, record: dict) -> list[Path]:
    """``report.md`` and ``result.json`` (and ``plot.png`` when measured) of one claim's record, the
    earlier record's removed first (an earlier run's plot would stand beside this report as if it were
    its measurement)."""
    measured = record.get("measured") or {}
    written = []
    remove_report(folder, [PLOT, "report.md", "result.json"])
    if "plot" in measured:
        written.append(
            plot(
                measured["plot"],
                folder / PLOT,
                f"{record['title']} ({record['scale']} scale)",
            )
        )
    command = f"neutreno reproduce {record['claim']} --scale {record['scale']} --seeds {record['seeds']}"
    command += f" --seed {record['seed']}" if record.get("seed") else ""
    lines = [
        f"# {record['title']}",
        "",
        f"**Verdict: {record['label']}** — {record['reason']}.",
        "",
        f"Claim `{record['claim']}` ({record['source']}), measured with `{command}`.",
        "",
        f"Rule: {record.get('rule', '')}.",
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
        lines += [f"{setting[:1].upper()}{setting[1:]}.", "", markdown_table(measured["table"])]
        lines += _convergence_lines(measured)
        lines.append("")
        if "plot" in measured:
            lines += [f"![{record['claim']}]({PLOT})", ""]
        lines.append(f"Measured in {record['seconds']:.0f} s.")
    else:
        lines.append("Not measured.")
    with atomic_path(folder / "report.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    write_json(folder / "result.json", record)
    return [folder / "report.md", folder / "result.json", *written]


def scale_records(out: Path) -> dict[str, dict[str, dict]]:
    """{claim: {scale: record}} of every ``<scale>/<claim>/result.json`` in an output folder.

    Raises:
        ValueError: a ``result.json`` that is not a claim's record (damaged, or another program's): left
            out, its verdict would vanish from the index, and with it a contradiction between scales.
    """
    found: dict[str, dict[str, dict]] = {}
    for scale in SCALES:
        for path in sorted((out / scale).glob("*/result.json")):
            try:
                record = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(
                    f"{path} is not readable JSON ({error}); rerun that claim or remove it"
                ) from None
            fields = ("claim", "verdict", "label")
            if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in fields):
                raise ValueError(
                    f"{path} is not a claim's result (no claim, verdict and label); rerun or remove it"
                )
            # a record copied or moved from elsewhere would be listed under the wrong claim or scale
            where = {"claim": path.parent.name, "scale": scale}
            for key, expected in where.items():
                if record.get(key, expected) != expected:
                    raise ValueError(
                        f"{path} is the result of {key} {record[key]!r}, not {expected!r} (copied or moved "
                        "from another folder?); rerun that claim or remove it"
                    )
            if record["verdict"] not in VERDICTS:
                raise ValueError(
                    f"{path} has verdict {record['verdict']!r}, not one of {', '.join(VERDICTS)}; "
                    "rerun that claim or remove it"
                )
            found.setdefault(record["claim"], {})[scale] = record
    return found


def agreement(records: dict[str, dict]) -> str:
    """How the verdicts of one claim at several scales relate: ``—`` (one scale), ``same``, ``differs``
    (e.g. agrees at one, inconclusive at another) or ``CONTRADICTS`` (agrees at one, disagrees at another)."""
    verdicts = {r["verdict"] for r in records.values()}
    if len(records) < 2:
        return "—"
    if {AGREES, DISAGREES} <= verdicts:
        return "**CONTRADICTS**"
    return "same" if len({r.get("label", r["verdict"]) for r in records.values()}) == 1 else "differs"


def last_run(out: Path) -> dict | None:
    """The ``last_run`` record of ``out/index.json`` (None when it has none or cannot be read)."""
    try:
        meta = json.loads((out / "index.json").read_text()).get("last_run")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    keys = ("scale", "minutes", "machine", "jobs", "data_root")
    return meta if isinstance(meta, dict) and all(k in meta for k in keys) else None


def write_index(out: Path, order: list[str], meta: dict | None = None) -> list[Path]:
    """``index.md`` and ``index.json`` of every claim report found in ``out`` at every scale: one row per
    claim (in ``order``, then any others found), its verdict at each scale linking the report, our
    figure and the reason at the largest scale measured, and whether the scales agree. ``meta``: the
    run that wrote it (scale, minutes, machine, …), when there was one."""
    everywhere = scale_records(out)
    scales = [s for s in SCALES if any(s in by for by in everywhere.values())]
    names = [n for n in order if n in everywhere] + [n for n in everywhere if n not in order]
    lines = [f"# neutreno reproduce: {out.name or out}", ""]
    for scale in scales:
        found = [everywhere[n][scale] for n in names if scale in everywhere[n]]
        counts: dict[str, int] = {}
        for r in found:
            counts[r["label"]] = counts.get(r["label"], 0) + 1
        seeds = sorted({r.get("seeds") for r in found if r.get("seeds")})
        lines.append(
            f"- **{scale}**: {len(found)} claims, {'/'.join(map(str, seeds))} seed(s) per trained arm: "
            + ", ".join(f"{n} {label}" for label, n in counts.items())
        )
    if meta:
        lines += [
            "",
            f"Last run: `--scale {meta['scale']}`, {meta['minutes']:.1f} min on {meta['machine']}, "
            f"{meta['jobs']} training job(s) at a time, data from `{meta['data_root']}`.",
        ]
    lines += [
        "",
        "Most verdicts come from the 95% Student-t interval of the per-seed (or per-item) differences "
        "(four claims use fixed thresholds, stated in their reports); trained comparisons are judged only "
        "when doubling the schedule no longer moves the score by more than the paper's effect "
        "(`inconclusive (not converged)` otherwise). The last column compares the scales.",
        "",
    ]
    rows = [["claim", "source", *(f"verdict, {s}" for s in scales), "ours (largest scale)", "why", "scales"]]
    for name in names:
        by_scale = everywhere[name]
        largest = by_scale[[s for s in SCALES if s in by_scale][-1]]
        cells = [f"[{by_scale[s]['label']}]({s}/{name}/report.md)" if s in by_scale else "—" for s in scales]
        ours = f"{largest['ours']} ({largest['scale']})" if largest.get("ours") else "—"
        why = largest["reason"].split(INFORMATION)[0]  # the index keeps what decided; the report has the rest
        rows.append([f"`{name}`", largest["source"], *cells, ours, why, agreement(by_scale)])
    remove_report(out, ["index.md", "index.json"])
    with atomic_path(out / "index.md") as tmp:
        tmp.write_text("\n".join(lines) + "\n" + markdown_table(rows) + "\n")
    write_json(out / "index.json", {"last_run": meta, "scales": everywhere})
    return [out / "index.md", out / "index.json"]

"""Rank collapse at initialisation (Noci et al., math.md §1 item 3 and §3), ``neutreno study rank-collapse``.

For every depth × block norm × residual scale α × attention (× seed), a freshly initialised
``lm_wt103_mini``-width language model (D 128, 8 heads, FFN 1024) reads real WikiText windows; we
record the token cosine similarity of every block's output and ‖∂L/∂W_Q‖, ‖∂L/∂W_K‖, ‖∂L/∂W_V‖ per
layer, L the next-token loss. Noci et al. predict that without depth scaling the tokens collapse to one
direction as depth grows (cosine → 1) and the query/key gradients vanish relative to the value ones,
and that α = 1/√L prevents both.

Their analysis assumes variance-preserving weights (entries of variance 1/D); ``init="fan_in"`` (the
default) re-draws every Linear of the blocks as N(0, 1/fan_in). ``init="model"`` keeps the model's own
GPT-2 init (N(0, 0.02²)), whose attention logits are ~20x smaller, so attention is near-uniform at any
depth.

Every finished run is appended to ``runs.jsonl`` in the output folder, so an interrupted study resumes
where it stopped; the report (``results.json``, ``rank_collapse.csv``, ``table.md``,
``rank_collapse.png``) is written at the end.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from neutreno import reporting
from neutreno.config import did_you_mean
from neutreno.data.corpus import load_corpus
from neutreno.diagnostics import capture_hidden_states, qkv_gradient_norms, token_cosine_similarity
from neutreno.io import atomic_path, json_safe, remove_report, write_json
from neutreno.layers import ATTENTION_TYPES, NORMS, resolve_lam, resolve_residual_scale
from neutreno.models import create_model
from neutreno.models.language_model import MINI_CUTOFFS
from neutreno.progress import progress
from neutreno.reporting import pyplot, save_figure

MODEL = "lm_wt103_mini"
INITS = ("fan_in", "model")
DEPTHS = (2, 4, 8, 16, 32, 64)
RESIDUAL_SCALES = ("1", "1/sqrt(L)")
ATTENTIONS = ("softmax", "neutreno")
SUMMARY_VALUES = ("last_cosine", "q_over_v", "k_over_v", "loss")
_QKV_ATTENTIONS = ("softmax", "neutreno", "kernel", "kernel_neutreno")  # separate W_Q, W_K, W_V


@dataclass(frozen=True)
class Setting:
    """One model of the grid: ``residual_scale`` is ``"1/sqrt(L)"`` or a number written as text;
    ``lam`` is NeuTRENO's λ (None for attentions without the term)."""

    depth: int
    norm: str
    residual_scale: str
    attention: str
    seed: int
    lam: float | None = None


@dataclass(frozen=True)
class StudyData:
    """What every run reads: ``windows`` (samples, length + 1) token ids of a corpus split."""

    windows: Tensor
    vocab_size: int
    source: str


def check_grid(
    depths: Sequence[int],
    norms: Sequence[str],
    scales: Sequence[str],
    attentions: Sequence[str],
    lam: float | None,
    init: str,
) -> None:
    """Raise ValueError naming the first bad grid value, before any work."""
    if not depths or any(d < 1 for d in depths):
        raise ValueError(f"depths must be integers >= 1, got {list(depths)}")
    weights, memory = 2 * max(depths) * _layer_parameters() * 8, _memory()
    if memory is not None and weights > memory / 2:  # (the windows' activations checked with the data)
        raise ValueError(
            f"--depths {max(depths)}: the float64 weights and their gradients alone need about "
            f"{weights / 2**30:.0f} GiB, more than half of this machine's {memory / 2**30:.0f} GiB"
        )
    for norm in norms:
        if norm not in NORMS:
            raise ValueError(f"unknown block norm {norm!r}; valid: {', '.join(NORMS)}")
    parsed = [parse_scale(scale) for scale in scales]
    for value in parsed:
        resolve_residual_scale(value, depth=1)
    twice = [scale for scale, value in zip(scales, parsed, strict=True) if parsed.count(value) > 1]
    if twice:  # 1 and 1.0: one model measured twice, drawn as two
        raise ValueError(f"residual scales {', '.join(twice)} are one value")
    for attention in attentions:
        if attention not in ATTENTION_TYPES:  # a typo, not a variant without W_Q, W_K, W_V
            raise ValueError(
                f"unknown attention {attention!r}{did_you_mean(attention, _QKV_ATTENTIONS)}; "
                f"valid: {', '.join(_QKV_ATTENTIONS)}"
            )
        if attention not in _QKV_ATTENTIONS:
            raise ValueError(
                f"attention {attention!r} has no separate W_Q, W_K, W_V; valid: {', '.join(_QKV_ATTENTIONS)}"
            )
        resolve_lam(attention, lam if attention.endswith("neutreno") else None)
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; valid: {', '.join(INITS)}")


def parse_scale(text: str) -> float | str:
    """``"1/sqrt(L)"`` as is, anything else as a number (ValueError naming it otherwise)."""
    if text == "1/sqrt(L)":
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"residual scale must be a number or '1/sqrt(L)', got {text!r}") from None


def load_windows(corpus: str | Path, samples: int, length: int, split: str = "valid") -> StudyData:
    """``samples`` windows of ``length + 1`` consecutive tokens, spread evenly over a corpus split."""
    vocab, streams = load_corpus(corpus)
    stream = streams[split]
    if len(stream) < length + 1:
        raise ValueError(f"{corpus} {split} has {len(stream)} tokens, fewer than length + 1 = {length + 1}")
    if samples > len(stream) - length:  # more would repeat windows: fewer inputs than the report says
        raise ValueError(
            f"--samples {samples}: {corpus} {split} has {len(stream) - length} windows of {length + 1} tokens"
        )
    starts = torch.linspace(0, len(stream) - length - 1, samples).long()
    windows = torch.stack([stream[s : s + length + 1] for s in starts.tolist()])
    return StudyData(windows, len(vocab), f"{corpus} ({split}, {samples} windows of {length + 1} tokens)")


# values a layer of MODEL's width (D 128, 8 heads, FFN 1024) keeps per token for the backward pass, about:
# q, k, v (384), the attention row (8 heads × up to 128 keys), the MLP's two (2 × 1024), norms and sums
_KEPT_PER_TOKEN = 4096


def _layer_parameters() -> int:
    """One block's parameters at the study's width, counted on the meta device."""
    with torch.device("meta"):
        counts = [sum(p.numel() for p in create_model(MODEL, depth=d).blocks.parameters()) for d in (1, 2)]
    return counts[1] - counts[0]


def _memory() -> int | None:
    """This machine's memory in bytes, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(data: StudyData, depth: int = 1) -> None:
    """ValueError when one model's measurement (all windows in one float64 batch: the logits, their
    softmax and its gradient, samples × length × vocabulary each; and the deepest model's float64
    weights, their gradients and each layer's kept activations) would need more than half of this
    machine's memory: --samples 100000 was killed by the kernel with no message, a lock left behind,
    and --depths 1000000 grew to 9 GB in 20 s and on."""
    samples, length = data.windows.shape[0], data.windows.shape[1] - 1
    needed = 3 * samples * length * data.vocab_size * 8
    needed += depth * (2 * _layer_parameters() * 8 + samples * length * _KEPT_PER_TOKEN * 8)
    memory = _memory()
    if memory is not None and needed > memory / 2:
        raise ValueError(
            f"--samples {samples} × --length {length} at depth {depth}: the float64 logits over a "
            f"vocabulary of {data.vocab_size}, weights and activations need about {needed / 2**30:.0f} GiB, "
            f"more than half of this machine's {memory / 2**30:.0f} GiB; lower --samples or --depths"
        )


def fan_in_init_(module: nn.Module) -> None:
    """Every Linear's weight ~ N(0, 1/fan_in), biases 0: the variance-preserving init Noci et al.
    analyse (W_Q, W_K, W_V entries of variance 1/D)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=m.in_features**-0.5)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def small_vocabulary_head(vocab_size: int) -> dict:
    """The model's head arguments for a corpus of ``vocab_size`` tokens: lm_wt103_mini's adaptive
    softmax, less the cutoffs at or past the vocabulary, or a plain softmax where none is left (a corpus
    of fewer than 10,000 words was refused by the model, after the study had made its folder)."""
    cutoffs = [c for c in MINI_CUTOFFS if c < vocab_size]
    return {"cutoffs": cutoffs} if cutoffs else {"adaptive_softmax": False}


def build_model(setting: Setting, vocab_size: int, init: str) -> nn.Module:
    """The setting's freshly initialised model (seeded, so variants of one seed share their weights)."""
    torch.manual_seed(setting.seed)
    model = create_model(
        MODEL,
        attention=setting.attention,
        lam=setting.lam,
        depth=setting.depth,
        block_norm=setting.norm,
        residual_scale=parse_scale(setting.residual_scale),
        drop_rate=0.0,
        vocab_size=vocab_size,
        **small_vocabulary_head(vocab_size),
        # the softmax written out: where a collapsed stack's rows are one-hot in float64 its gradient is 0,
        # and the fused kernel's backward made rounding noise of it that compounded through the layers
        # (‖∇W_V‖ 1e207 for 3e15 at 64 un-normalised layers: a Q/V ratio of 0.12 where it is 0.004)
        attn_impl="explicit",
    )
    if init == "fan_in":
        fan_in_init_(model.blocks)
    return model


def measure(model: nn.Module, windows: Tensor) -> dict:
    """Token cosine of the embeddings and each block's output, the mean next-token loss, and the
    per-layer Q/K/V gradient norms of one model on ``windows`` (B, T + 1), in float64 (the model is
    converted): in a collapsed stack ‖∇W_Q‖ falls to 1e-7 of ‖∇W_V‖ by depth 64 and on, where float32's
    rounding of the gradients is the signal (its ratio plateaued near 7e-8 where the true one is 1e-16)."""
    model.double()
    with capture_hidden_states(model.blocks) as hidden:
        loss = model(windows[:, :-1], windows[:, 1:]).mean()
    norms = qkv_gradient_norms(model.blocks, loss)
    return {
        "loss": loss.item(),
        "cosine": [token_cosine_similarity(h.float()).item() for h in hidden],
        "grad_q": norms[:, 0].tolist(),
        "grad_k": norms[:, 1].tolist(),
        "grad_v": norms[:, 2].tolist(),
    }


def stack_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """‖∇ of all layers' W_Q (or W_K)‖_F / ‖∇ of all layers' W_V‖_F: the layers' norms combined (by
    ``math.hypot``: a sum of squares overflows past 1e154, which deep unnormalised stacks reach)."""
    return math.hypot(*numerator) / math.hypot(*denominator)


def finite(record: dict) -> bool:
    values = [record["loss"], *record["cosine"], *record["grad_q"], *record["grad_k"], *record["grad_v"]]
    return all(math.isfinite(v) for v in values)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (norm, residual scale, attention, depth): the mean over seeds of the last-layer
    cosine and the geometric mean of the stack ratios ‖∇W_Q‖/‖∇W_V‖ and ‖∇W_K‖/‖∇W_V‖ (they span
    orders of magnitude); runs with a non-finite loss or gradient are counted as ``diverged``."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        s = record["setting"]
        groups.setdefault((s["norm"], s["residual_scale"], s["attention"], s["depth"]), []).append(record)
    rows = []
    for (norm, scale, attention, depth), group in groups.items():
        ok = [r for r in group if finite(r)]
        row = {"norm": norm, "residual_scale": scale, "attention": attention, "depth": depth}
        row.update(seeds=len(group), diverged=len(group) - len(ok))
        if ok:
            row["last_cosine"] = sum(r["cosine"][-1] for r in ok) / len(ok)
            for name in ("q", "k"):
                logs = [math.log(stack_ratio(r[f"grad_{name}"], r["grad_v"])) for r in ok]
                row[f"{name}_over_v"] = math.exp(sum(logs) / len(logs))
            row["loss"] = sum(r["loss"] for r in ok) / len(ok)
        else:
            row.update(dict.fromkeys(SUMMARY_VALUES))
        rows.append(row)
    return rows


def _from_json(record: dict) -> dict:
    def restore(value):
        if value is None:
            return math.nan
        return [restore(v) for v in value] if isinstance(value, list) else value

    return {k: v if k == "setting" else restore(v) for k, v in record.items()}


def _read_run(line: str, study: dict) -> tuple[Setting, dict] | None:
    """The (setting, record) of one ``runs.jsonl`` line of ``study``; None for another study's line or
    one that is not a whole run of this study (torn, damaged, edited: a cosine per block and the
    embeddings, a gradient norm per block)."""
    try:
        entry = json.loads(line)
        if not isinstance(entry, dict) or entry.get("study") != study:
            return None
        record = _from_json(entry["record"])
        setting = Setting(**record["setting"])
        depth = setting.depth
        lengths = {"cosine": depth + 1, "grad_q": depth, "grad_k": depth, "grad_v": depth}
        numbers = [record["loss"], *(v for key in lengths for v in record[key])]
        if not (
            isinstance(depth, int)
            and all(isinstance(record[key], list) and len(record[key]) == n for key, n in lengths.items())
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers)
        ):
            return None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return None
    return setting, record


def read_finished(path: Path, study: dict) -> dict[Setting, dict]:
    """Runs of ``runs.jsonl`` made with the same study settings. A line that is not a whole run (a torn
    last line, a damaged one) is left out, its setting measured again."""
    finished = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            run = _read_run(line, study)
            if run:
                finished[run[0]] = run[1]
    return finished


def run_study(settings: list[Setting], data: StudyData, out: Path, init: str) -> list[dict]:
    """Measure every setting (reusing those already in ``out/runs.jsonl``); returns the records in the
    order of ``settings``."""
    study = {"model": MODEL, "data": data.source, "init": init}
    log = out / "runs.jsonl"
    # by the model each setting builds: residual scale 1.0 is the 1 measured before (it was measured again)
    finished = {_model_of(s): record for s, record in read_finished(log, study).items()}
    todo = [s for s in settings if _model_of(s) not in finished]
    if len(todo) < len(settings) and todo:  # ("resuming: 0 of 12 runs" was said of a folder of others)
        print(f"resuming: {len(settings) - len(todo)} of {len(settings)} runs already in {log}")
    out.mkdir(parents=True, exist_ok=True)
    with log.open("a+b") as tail:  # a torn last line without its newline: the next record would join it
        if tail.seek(0, os.SEEK_END):
            tail.seek(-1, os.SEEK_END)
            if tail.read(1) != b"\n":
                tail.write(b"\n")  # (appended: "a" writes at the end)
    with log.open("a") as f:
        for setting in progress(todo, desc="rank collapse", unit="model"):
            model = build_model(setting, data.vocab_size, init)
            record = {"setting": asdict(setting), **measure(model, data.windows)}
            f.write(json.dumps(json_safe({"study": study, "record": record}), allow_nan=False) + "\n")
            f.flush()
            finished[_model_of(setting)] = record
    # each record under the setting as this study spells it (its table's rows)
    return [{**finished[_model_of(s)], "setting": asdict(s)} for s in settings]


def _model_of(setting: Setting) -> Setting:
    """``setting`` with its residual scale as the number it parses to (``1`` and ``1.0`` alike; an edited
    line's text that is no scale as it is, matching no setting of a study)."""
    try:
        return replace(setting, residual_scale=str(parse_scale(setting.residual_scale)))
    except (ValueError, TypeError):
        return setting


def _cell(row: dict) -> str:
    if row["last_cosine"] is None:
        return "diverged"
    flag = f" ({row['diverged']} diverged)" if row["diverged"] else ""
    return f"{row['last_cosine']:.3f} / {row['q_over_v']:.2g}{flag}"


# what a cell of markdown_table is (table.md's first line and the command's caption)
TABLE_CAPTION = (
    "last-layer token cosine (mean over seeds) / ‖∇W_Q‖/‖∇W_V‖ of the whole stack (geometric mean over seeds)"
)


def markdown_table(rows: list[dict]) -> str:
    """Depth × variant table: each cell 'last-layer cosine / ‖∇W_Q‖/‖∇W_V‖'."""
    depths = sorted({r["depth"] for r in rows})
    variants = list(dict.fromkeys((r["norm"], r["residual_scale"], r["attention"]) for r in rows))
    cells = {(r["norm"], r["residual_scale"], r["attention"], r["depth"]): r for r in rows}
    table = [["norm", "α", "attention", *(f"L={d}" for d in depths)]]
    for variant in variants:
        table.append(
            [*variant, *(_cell(cells[(*variant, d)]) if (*variant, d) in cells else "" for d in depths)]
        )
    return reporting.markdown_table(table)


def plot(rows: list[dict], path: Path, init: str) -> Path:
    """Last-layer cosine and ‖∇W_Q‖/‖∇W_V‖ against depth, one column per block norm."""
    from matplotlib.ticker import NullLocator

    plt = pyplot()

    norms = list(dict.fromkeys(r["norm"] for r in rows))
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(
        2, len(norms), figsize=(max(4.2 * len(norms), 7.5), 7), squeeze=False, sharex=True, sharey="row",
        layout="constrained",
    )  # fmt: skip
    colours, styles = {}, {}  # per attention, per α: the same across panels
    for col, norm in enumerate(norms):
        lines: dict[tuple, list[dict]] = {}
        for r in sorted(rows, key=lambda r: r["depth"]):
            if r["norm"] == norm and r["last_cosine"] is not None:
                lines.setdefault((r["residual_scale"], r["attention"]), []).append(r)
        for (scale, attention), line in lines.items():
            colour = colours.setdefault(attention, f"C{len(colours)}")
            dashes = styles.setdefault(scale, "-" if scale == "1" else ("--", ":", "-.")[len(styles) % 3])
            style = {"color": colour, "ls": dashes, "marker": "o", "ms": 3}  # each α its own line style
            label = f"{attention}, α = {scale}"
            line_depths = [r["depth"] for r in line]
            axes[0][col].plot(line_depths, [r["last_cosine"] for r in line], label=label, **style)
            axes[1][col].plot(line_depths, [r["q_over_v"] for r in line], label=label, **style)
        axes[0][col].set_title(f"{norm}-LN" if norm != "none" else "no LN")
        axes[0][col].set_ylim(-0.02, 1.02)
        axes[1][col].set_yscale("log")
        axes[1][col].set_xlabel("depth L (blocks)")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(depths, [str(d) for d in depths])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.grid(alpha=0.3)
    reporting.readable_ylim(axes[1][0])  # shared by the row: the norms compare at a glance
    axes[0][0].set_ylabel("last-layer token cosine similarity")
    axes[1][0].set_ylabel("query / value gradient norm\n‖∇W_Q‖ / ‖∇W_V‖")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # every line, also one missing from the first panel
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if labels:  # none when every cell diverged: the table says so
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize=8,
                   frameon=False)  # fmt: skip
    fig.suptitle(f"rank collapse at initialisation\n({MODEL} width, {init} init; missing points diverged)")
    save_figure(fig, path, dpi=110)
    return path


def write_report(out: Path, records: list[dict], rows: list[dict], meta: dict) -> list[Path]:
    """``results.json`` (every run, per layer), ``rank_collapse.csv`` (the summary rows), ``table.md``
    and ``rank_collapse.png``, each written atomically, the earlier study's removed first."""
    names = ["results.json", "rank_collapse.csv", "table.md", "rank_collapse.png"]
    remove_report(out, names)
    write_json(out / "results.json", {**meta, "summary": rows, "runs": records})
    fields = [*("norm", "residual_scale", "attention", "depth", "seeds", "diverged"), *SUMMARY_VALUES]
    table = [[("" if r[k] is None else r[k]) for k in fields] for r in rows]
    reporting.write_csv(out / "rank_collapse.csv", [fields, *table])
    with atomic_path(out / "table.md") as tmp:
        tmp.write_text(f"{TABLE_CAPTION}\n\n{markdown_table(rows)}\n")
    plot(rows, out / "rank_collapse.png", meta["init"])
    return [out / name for name in names]

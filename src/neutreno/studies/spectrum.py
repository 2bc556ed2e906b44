"""Smoothing and sharpening models, trained (Dovonon et al., math.md §1 item 2), ``neutreno study spectrum``.

One image-classification config is trained once per attention, the runs differing only in it: by
default the CPU-sized CIFAR-10 ViT (``configs/cifar10_vit_softmax.yaml``: 12 layers, D 96) with
standard softmax attention, "+" (``eigen_pos``: H = W_V W_O = +diag(ψ)², smoothing) and "−"
(``eigen_neg``: H = −diag(ψ)², sharpening) in every layer. For each trained model we report its
top-1/top-5 on the validation set, and per layer, on test images, the high-frequency ratio
‖res(X)‖/‖1x̄ᵀ‖ and token cosine of its output (math.md §3), and the regime its spectrum predicts.
Dovonon et al. predict that the "+" model's high frequencies fade with depth and the "−" model's do not.

Each run trains in ``OUT/<attention>`` with the training engine: a finished run is reused, an
interrupted one resumed. The report (``results.json``, ``layers.csv``, ``table.md``, ``spectrum_study.png``)
is written at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from neutreno import reporting
from neutreno.data.images import load_images
from neutreno.diagnostics import (
    BlockProbe,
    analyze_layers,
    layer_spectra,
    terms_beyond_the_rule,
    value_output_maps,
)
from neutreno.io import atomic_path, remove_report, write_json
from neutreno.models import load_model
from neutreno.reporting import pyplot, save_figure
from neutreno.training.checkpoint import resolve_weights

ATTENTIONS = ("softmax", "eigen_pos", "eigen_neg")
DEFAULT_CONFIG = "cifar10_vit_softmax"  # a preset (neutreno/configs/)
NAMES = {"softmax": "standard", "eigen_pos": "+ (smoothing)", "eigen_neg": "− (sharpening)"}


@dataclass
class Variant:
    """One attention's run: its typed config (which names the run folder)."""

    attention: str
    config: object  # ClassificationConfig

    @property
    def out_dir(self) -> Path:
        return Path(self.config.train.out_dir)


def variant_configs(
    config: str | Path, attentions: list[str], out: Path, overrides: list[str]
) -> list[Variant]:
    """The config of each attention (``--set`` overrides applied, then the attention and its run folder);
    ConfigError naming the key on a bad value, and ValueError for a run folder holding a run of another
    config (or damaged), before any training: the earlier variants trained, then the later one refused."""
    from neutreno.config import ConfigError, refuse_overrides_of, set_text
    from neutreno.training.tasks import finished_results, load_train_config

    owned = {
        "model.attention": "--attentions chooses it",
        "train.out_dir": "each run's folder is --out/<attention>",
    }
    refuse_overrides_of(overrides, owned)
    variants = []
    for attention in attentions:
        cfg = load_train_config(
            config, [*overrides, f"model.attention={attention}", set_text("train.out_dir", out / attention)]
        )
        if cfg.task != "classification":
            raise ConfigError(f"task: the spectrum study trains image classifiers, got {cfg.task!r}")
        variants.append(Variant(attention, cfg))
    for variant in variants:
        finished_results(variant.config)  # OtherConfigRun (a ValueError) naming the folder
    return variants


def train_variant(variant: Variant) -> dict:
    """Train one variant to its end (a finished run of the same config is reused, an interrupted one
    resumed; a finished run of another config is an error) and return its ``results.json``."""
    from neutreno.training.tasks import train_to_end

    results, happened = train_to_end(variant.config)
    verbs = {"reused": "reused the finished run", "resumed": "resumed and finished", "trained": "trained"}
    print(f"{variant.attention}: {verbs[happened]} in {variant.out_dir}")
    return results


@torch.no_grad()
def measure_variant(run_dir: Path, data: str, split: str | None, samples: int, batch_size: int = 100) -> dict:
    """Per layer (0 = embeddings) the high-frequency ratio and token cosine of a trained classifier on
    ``samples`` images spread over the classes, and per block the regime its spectrum predicts (λ_A from
    its attention on the first batch)."""
    model, meta = load_model(resolve_weights(run_dir))
    model.eval()
    pre = meta["preprocess"]
    embed = model.patch_embed
    images, _ = load_images(
        data, size=embed.img_size, channels=embed.proj.in_channels, split=split, limit=samples,
        crop_pct=pre.get("crop_pct", 1.0),
    )  # fmt: skip
    mean, std = (torch.tensor(pre[k]).view(1, -1, 1, 1) for k in ("mean", "std"))
    batches = list(((images - mean) / std).split(batch_size))
    per_layer = analyze_layers(BlockProbe(model), batches, ["high_frequency", "cosine"], desc=run_dir.name)
    probed = BlockProbe(model, attention=True)(batches[0])
    spectra = layer_spectra(value_output_maps(model), probed, terms_beyond_the_rule(model))
    return {
        "images": len(images),
        "regime_images": len(batches[0]),  # the regimes' λ_A: the first batch's attention alone
        "high_frequency": list(per_layer["high_frequency"].values()),
        "cosine": list(per_layer["cosine"].values()),
        "regime": [s.regime for s in spectra],
        "smooth_fraction": [s.smooth_fraction for s in spectra],
        "lambda_h_real_range": [
            [s.h_eigenvalues.real.min().item(), s.h_eigenvalues.real.max().item()] for s in spectra
        ],
    }


def markdown_table(report: dict) -> str:
    """One row per model: accuracy, the high-frequency ratio at chosen layers, the predicted regimes."""
    variants = report["variants"]
    depth = len(next(iter(variants.values()))["high_frequency"]) - 1
    layers = sorted({0, 1, depth // 4, depth // 2, 3 * depth // 4, depth})
    rows = [["model", "top-1 / top-5", *(f"HF ratio L{layer}" for layer in layers)]]
    # (a report of before regime_images was recorded: its first batch of up to 100)
    regime_images = next(iter(variants.values())).get("regime_images", "≤100")
    rows[0].append(f"predicted smooth / sharpen layers (from {regime_images} images)")
    for attention, v in variants.items():
        top5 = "—" if v.get("top5") is None else f"{v['top5']:.2f}"  # none over five classes or fewer
        rows.append([
            NAMES.get(attention, attention), f"{v['top1']:.2f} / {top5}",
            *(f"{v['high_frequency'][layer]:.3f}" for layer in layers),
            f"{v['regime'].count('smooth')} / {v['regime'].count('sharpen')}",
        ])  # fmt: skip
    return reporting.markdown_table(rows)


def plot(report: dict, path: Path) -> Path:
    """High-frequency ratio and token cosine by layer, one line per model (accuracy in the legend)."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")
    for attention, v in report["variants"].items():
        label = f"{NAMES.get(attention, attention)}: top-1 {v['top1']:.1f}%"
        layers = range(len(v["high_frequency"]))
        axes[0].plot(layers, v["high_frequency"], marker="o", ms=3, label=label)
        axes[1].plot(layers, v["cosine"], marker="o", ms=3, label=label)
    axes[0].set(yscale="log", ylabel=f"{reporting.metric_name('high_frequency')} (log scale)")
    axes[0].set_title("high frequencies left in the tokens", fontsize=10)
    axes[1].set(ylabel=reporting.metric_name("cosine"))
    axes[1].set_title("over-smoothing (1 = all tokens alike)", fontsize=10)
    reporting.readable_ylim(axes[0], bounds=reporting.METRIC_RANGES["high_frequency"])
    reporting.readable_ylim(axes[1], bounds=reporting.METRIC_RANGES["cosine"])
    for ax in axes:
        reporting.layer_axis(ax)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"trained models by layer, on {report['images']} images of {Path(report['data']).name}")
    save_figure(fig, path, dpi=110)
    return path


def write_report(out: Path, report: dict) -> list[Path]:
    """``results.json``, ``layers.csv`` (model, layer, high-frequency ratio, cosine, predicted regime),
    ``table.md`` and ``spectrum_study.png``, each written atomically, the earlier study's removed first."""
    names = ["results.json", "layers.csv", "table.md", "spectrum_study.png"]
    remove_report(out, names)
    write_json(out / "results.json", report)
    rows = [["attention", "layer", "high_frequency", "cosine", "regime", "smooth_fraction"]]
    for attention, v in report["variants"].items():
        for layer, (hf, cos) in enumerate(zip(v["high_frequency"], v["cosine"], strict=True)):
            # no prediction (a NeuTRENO or FeatScale layer: terms_beyond_the_rule): empty cells
            regime = (v["regime"][layer - 1] or "") if layer else ""
            fraction = v["smooth_fraction"][layer - 1] if layer else None
            smooth = "" if fraction is None else f"{fraction:.3f}"
            rows.append([attention, layer, reporting.number(hf), reporting.number(cos), regime, smooth])
    reporting.write_csv(out / "layers.csv", rows)
    with atomic_path(out / "table.md") as tmp:
        tmp.write_text(markdown_table(report) + "\n")
    plot(report, out / "spectrum_study.png")
    return [out / name for name in names]

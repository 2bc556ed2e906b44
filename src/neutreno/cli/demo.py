"""``neutreno demo``: softmax vs NeuTRENO ViTs on the real digits, accuracy and over-smoothing per layer."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from neutreno.data import load_digits_split
from neutreno.diagnostics import cosine_by_layer
from neutreno.io import remove_report, write_json
from neutreno.models import create_model, save_model
from neutreno.reporting import METRIC_RANGES, layer_axis, metric_name, pyplot, readable_ylim, save_figure
from neutreno.training import predict, train_classifier

MODEL = "vit_digits"
ATTENTIONS = ("softmax", "neutreno")


def run_demo(out: Path, epochs: int = 40, seed: int = 0) -> dict:
    """Train a softmax and a NeuTRENO ``vit_digits`` with the same seed, data order and budget;
    write ``results.json``, ``cosine_by_layer.png`` and both models' weights to ``out``."""
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = load_digits_split(seed=seed)
    print(
        f"digits: {len(y_train)} train / {len(y_test)} test images, 8x8; model {MODEL}, {epochs} epochs, "
        f"seed {seed}"
    )
    results = {"model": MODEL, "epochs": epochs, "seed": seed, "n_train": len(y_train), "n_test": len(y_test)}
    results["runs"], models = {}, {}
    for attention in ATTENTIONS:
        torch.manual_seed(seed)  # same initial weights: both variants have the same parameters
        model = create_model(MODEL, attention=attention)
        start = time.perf_counter()
        losses = train_classifier(model, x_train, y_train, epochs=epochs, seed=seed, desc=attention)
        seconds = time.perf_counter() - start
        accuracy = (predict(model, x_test) == y_test).sum().item() / len(y_test)
        models[attention] = model
        results["runs"][attention] = {
            "lam": model.blocks[0].attn.lam,
            "test_accuracy": accuracy,
            "cosine_by_layer": cosine_by_layer(model, x_test),
            "final_train_loss": losses[-1],
            "train_seconds": round(seconds, 1),
        }
        print(f"  {attention:<9} test accuracy {accuracy:.4f}  ({seconds:.0f} s)")
    print_table(results)
    # the files of one demo, written once both models are trained: an interrupted demo wrote its first
    # model beside an earlier demo's second and results.json; and the earlier report is removed first,
    # so that it never describes what an interruption while writing leaves
    remove_report(out, ["results.json", "cosine_by_layer.png"])
    for attention, model in models.items():
        save_model(out / f"{attention}.safetensors", model)  # `neutreno analyze --model FILE` rebuilds it
    write_json(out / "results.json", results)
    plot_cosine(results, out / "cosine_by_layer.png")
    print(f"wrote {out / 'results.json'}, {out / 'cosine_by_layer.png'} and the weights (*.safetensors)")
    return results


def print_table(results: dict) -> None:
    runs = results["runs"]
    print("\ntoken cosine similarity per layer (test set; 0 = embeddings, lower = less over-smoothing)")
    print(f"{'layer':>5}  " + "  ".join(f"{name:>9}" for name in runs))
    for layer, values in enumerate(zip(*(r["cosine_by_layer"] for r in runs.values()), strict=True)):
        print(f"{layer:>5}  " + "  ".join(f"{v:9.4f}" for v in values))
    print(f"{'acc':>5}  " + "  ".join(f"{r['test_accuracy']:9.4f}" for r in runs.values()))
    print(
        f"one seed ({results['seed']}) of one small model: an illustration, not evidence; "
        "`neutreno reproduce` judges the claims over several seeds\n"
    )


def plot_cosine(results: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4.4), layout="constrained")
    for name, run in results["runs"].items():
        label = (
            f"{name} (λ={run['lam']:g}), test accuracy {100 * run['test_accuracy']:.1f}%"
            if run["lam"]
            else f"{name}, test accuracy {100 * run['test_accuracy']:.1f}%"
        )
        ax.plot(range(len(run["cosine_by_layer"])), run["cosine_by_layer"], marker="o", label=label)
    ax.set_ylabel(metric_name("cosine"))
    ax.set_title(
        f"{results['model']} on the digits test set, after {results['epochs']} epochs (one seed, "
        f"{results['seed']})\n"
        "token cosine similarity by layer (lower: less over-smoothing)",
        fontsize=10,
    )
    layer_axis(ax)
    readable_ylim(ax, bounds=METRIC_RANGES["cosine"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    save_figure(fig, path, dpi=120)

"""Evaluate saved models: a classifier on an image dataset (preprocessing as the checkpoint records),
a language model's sliding-window perplexity on a corpus, a Segmenter's single- and multi-scale mIoU
(math.md §4 protocols)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from neutreno.data.augment import normalize
from neutreno.data.datasets import collate_images, open_image_dataset
from neutreno.models import load_model
from neutreno.progress import progress as progress_bar
from neutreno.reporting import pyplot, save_figure
from neutreno.training.checkpoint import resolve_weights
from neutreno.training.classification import classification_sums, summarize_classification
from neutreno.training.distributed import resolve_device
from neutreno.training.segmentation import (
    MS_SCALES,
    confusion_matrix,
    segment_probabilities,
    segmentation_scores,
)


@dataclass
class Classifier:
    """A saved classifier ready to score a dataset: its model (on ``device``), the preprocessing it
    records, the dataset, and ``class_index`` when the dataset's classes are a subset of the model's
    (ImageNet-A/R: 200 of ImageNet's 1000 classes), else None."""

    weights: Path
    model: nn.Module
    preprocess: dict
    dataset: Dataset
    class_index: Tensor | None
    device: torch.device

    def logits(self, images: Tensor) -> Tensor:
        """uint8 images (B, C, S, S) as the dataset gives them → logits over the dataset's classes."""
        pre = self.preprocess
        logits = self.model(normalize(images.to(self.device), pre["mean"], pre["std"]))
        return logits if self.class_index is None else logits[:, self.class_index.to(logits.device)]


def open_classifier(checkpoint: str | Path, data: str, split: str, device: str = "auto") -> Classifier:
    """Load a checkpoint and open ``data``/``split`` with the preprocessing it records (size, crop,
    channels). A dataset whose classes are neither the model's nor a subset of them is refused rather
    than scored against the wrong labels; a subset is scored over its own classes only."""
    weights = resolve_weights(checkpoint)
    model, meta = load_model(weights)
    pre = meta.get("preprocess")
    if pre is None:
        raise ValueError(f"{weights} records no preprocessing (not written by neutreno train)")
    dataset = open_image_dataset(
        data, split, size=pre["image_size"], train=False, crop_pct=pre["crop_pct"], channels=pre["channels"]
    )
    classes, trained = list(dataset.classes), list(meta.get("classes") or [])
    class_index = None
    if trained and classes != trained:
        if not set(classes) <= set(trained):
            raise ValueError(
                f"{data} ({split}) has classes {classes[:4]}…, the checkpoint was trained on {trained[:4]}… "
                "(a subset of its classes is scored over the subset)"
            )
        class_index = torch.tensor([trained.index(name) for name in classes])
    if len(classes) < 2:  # scored over its own classes, one class is 100% whatever the model does
        raise ValueError(f"{data} ({split}) has only the class {classes}; top-1 over one class means nothing")
    target = resolve_device(device)
    return Classifier(weights, model.eval().to(target), pre, dataset, class_index, target)


@torch.no_grad()
def evaluate_checkpoint(
    checkpoint: str | Path,
    data: str,
    *,
    split: str = "val",
    batch_size: int = 256,
    num_workers: int = 2,
    device: str = "auto",
) -> dict:
    """Top-1/top-5 accuracy (percent), mean loss and image count of a checkpoint on ``data``/``split``
    (see :func:`open_classifier`); ``classes_scored`` says how many classes the scores range over."""
    classifier = open_classifier(checkpoint, data, split, device)
    loader = DataLoader(
        classifier.dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_images
    )
    sums: dict[str, float] = {}
    for images, labels, _ in progress_bar(loader, desc="eval", unit="batch", leave=False):
        logits = classifier.logits(images)
        for key, value in classification_sums(logits, labels.to(logits.device)).items():
            sums[key] = sums.get(key, 0.0) + value.item()
    return {
        "checkpoint": str(classifier.weights),
        "data": str(data),
        "split": split,
        **summarize_classification(sums),
        "classes_scored": len(classifier.dataset.classes),
    }


@torch.no_grad()
def sliding_window_nll(
    model: nn.Module, stream: Tensor, *, stride: int = 1, batch_size: int = 32, progress: bool = True
) -> tuple[float, int]:
    """Summed negative log-likelihood of every token of ``stream`` after the first, and their count.

    The paper's protocol (math.md §4): windows of the model's ``context_length`` L slide by ``stride``;
    the first window scores all its positions, each later one only its last ``stride`` (the tokens not
    scored yet), so every token is predicted once, with as much left context as fits (stride 1: L
    tokens). A larger stride is the faster approximation. Windows are batched.

    Args:
        model: a causal LM whose ``forward(idx, targets)`` returns per-token NLL (B, T).
        stream: token ids (T,).
    Returns:
        (total NLL in nats, number of tokens scored = T − 1).
    """
    if stride < 1 or batch_size < 1:
        raise ValueError(f"stride and batch_size must be >= 1, got {stride} and {batch_size}")
    length = min(model.context_length, stream.numel() - 1)
    if length < 1:
        raise ValueError("a stream of fewer than 2 tokens has nothing to score")
    last = stream.numel() - 1  # index of the last target
    ends = torch.arange(length, last + stride, stride).clamp(max=last).unique_consecutive()
    scored = torch.diff(ends, prepend=torch.tensor([0]))  # new targets per window: L, then ≤ stride
    windows = stream.unfold(0, length + 1, 1)  # (T − L, L + 1) view: inputs and targets of every start
    device = next(model.parameters()).device
    positions = torch.arange(length, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    batches = range(0, len(ends), batch_size)
    for i in progress_bar(batches, desc="windows", unit="batch", leave=False, enabled=progress):
        batch = windows[ends[i : i + batch_size] - length].to(device)
        nll = model(batch[:, :-1], batch[:, 1:])
        keep = positions >= length - scored[i : i + batch_size, None].to(device)
        total += nll.double().masked_fill(~keep, 0).sum()
    return total.item(), last


@torch.no_grad()
def evaluate_language_model(
    checkpoint: str | Path,
    corpus: str | Path | None = None,
    *,
    splits: tuple[str, ...] = ("valid", "test"),
    stride: int = 1,
    batch_size: int = 32,
    device: str = "auto",
) -> dict:
    """Sliding-window perplexity (:func:`sliding_window_nll`) of a trained language model on the
    ``splits`` of ``corpus`` (default: the corpus it was trained on), tokenized with the checkpoint's
    own tokenizer. Returns ``{split: {"ppl", "loss", "tokens"}}`` with the settings used."""
    from neutreno.data.corpus import encode_file, split_file
    from neutreno.training.language_model import load_language_model

    weights = resolve_weights(checkpoint)
    model, tokenizer, meta = load_language_model(weights)
    corpus = Path(corpus or meta["corpus"])
    model.to(resolve_device(device))
    results = {"checkpoint": str(weights), "corpus": str(corpus), "stride": stride,
               "context_length": model.context_length}  # fmt: skip
    for split in splits:
        ids = encode_file(split_file(corpus, split), tokenizer)
        nll, count = sliding_window_nll(model, ids, stride=stride, batch_size=batch_size)
        results[split] = {"ppl": math.exp(nll / count), "loss": nll / count, "tokens": count}
    return results


@torch.no_grad()
def evaluate_segmentation(
    checkpoint: str | Path,
    data: str | Path | None = None,
    *,
    split: str = "val",
    scales: tuple[float, ...] = MS_SCALES,
    device: str = "auto",
    overlay: Path | None = None,
    overlay_count: int = 4,
) -> dict:
    """Single-scale (SS) and multi-scale + flip (MS) mIoU, pixel accuracy and per-class IoU of a trained
    Segmenter on ``data``/``split`` (default: the dataset it was trained on), with the inference settings
    its metadata records (math.md §4 protocol); also the mean last-layer token cosine similarity of the
    encoder (math.md §3, over CLS and patch tokens) on the same images at scale 1.

    ``overlay``: a PNG of ``overlay_count`` images spread evenly over the split (video datasets such as
    CamVid have near-identical neighbours), their labels and the MS predictions.
    """
    from neutreno.data.segmentation import open_segmentation_dataset
    from neutreno.diagnostics import capture_hidden_states, token_cosine_similarity

    weights = resolve_weights(checkpoint)
    model, meta = load_model(weights)
    seg = meta.get("segmentation")
    if seg is None:
        raise ValueError(f"{weights} is not a segmentation model trained by neutreno (no label metadata)")
    labels = {k: seg[k] for k in ("num_classes", "ignore_index", "label_offset", "void_label")}
    data = Path(data or seg["root"])
    dataset = open_segmentation_dataset(data, split, **labels)
    target = resolve_device(device)
    model.to(target)
    infer = {k: seg[k] for k in ("mean", "std", "window", "stride", "eval_size")}
    num_classes, ignore = seg["num_classes"], seg["ignore_index"]
    confusion = {name: torch.zeros(num_classes, num_classes, dtype=torch.int64) for name in ("ss", "ms")}
    cosines, shown = [], []
    to_show = set(
        torch.linspace(0, len(dataset) - 1, min(overlay_count, len(dataset))).round().long().tolist()
    )
    for index in progress_bar(range(len(dataset)), desc="segment", unit="image", leave=False):
        image, truth = dataset[index]
        image = image.to(target)
        ss = segment_probabilities(model, image, **infer).argmax(0).cpu()
        ms = segment_probabilities(model, image, **infer, scales=scales, flip=True).argmax(0).cpu()
        confusion["ss"] += confusion_matrix(ss, truth, num_classes, ignore)
        confusion["ms"] += confusion_matrix(ms, truth, num_classes, ignore)
        with capture_hidden_states(model.encoder.blocks) as hidden:
            model.forward_features(normalize(image[None], seg["mean"], seg["std"]))
        cosines.append(token_cosine_similarity(hidden[-1]).item())
        if index in to_show:
            shown.append((image.cpu(), truth, ms))
    results: dict = {"checkpoint": str(weights), "data": str(data), "split": split}
    results |= {"images": len(dataset), "scales": list(scales)}
    for name, matrix in confusion.items():
        scores = segmentation_scores(matrix)
        per_class = dict(zip(seg["class_names"], scores.pop("iou"), strict=True))
        results[name] = {**scores, "iou": per_class}
    results["last_layer_token_cosine"] = sum(cosines) / len(cosines)
    if overlay is not None:
        save_overlays(shown, overlay, num_classes, ignore)
    return results


def save_overlays(
    samples: list[tuple[Tensor, Tensor, Tensor]], path: Path, num_classes: int, ignore: int
) -> None:
    """A PNG with one row per (image uint8 (3, H, W), labels (H, W), prediction (H, W)): the image, then
    labels and prediction coloured over it (ignored pixels left uncoloured)."""
    plt = pyplot()

    palette = torch.tensor(plt.get_cmap("tab20").colors)[torch.arange(num_classes) % 20]
    fig, axes = plt.subplots(len(samples), 3, figsize=(9, 2.6 * len(samples)), squeeze=False)
    for row, (image, truth, pred) in zip(axes, samples, strict=True):
        rgb = image.permute(1, 2, 0).float() / 255
        for ax, mask, title in zip(
            row, (None, truth, pred), ("image", "labels", "prediction (MS)"), strict=True
        ):
            shown = rgb
            if mask is not None:
                valid = (mask != ignore)[..., None]
                colours = palette[mask.clamp(0, num_classes - 1)]
                shown = torch.where(valid, 0.35 * rgb + 0.65 * colours, rgb)
            ax.imshow(shown.numpy())
            ax.set_title(title, fontsize=9)
            ax.axis("off")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)

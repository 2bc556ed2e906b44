"""Image classification scores (math.md §4's top-1/top-5 rows): the per-batch sums the trainer's
validation and the evaluators share, their summary, and a saved classifier scored on a dataset with
the preprocessing its checkpoint records (``neutreno eval``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from neutreno.data.augment import normalize
from neutreno.data.datasets import class_difference, collate_images, open_image_dataset
from neutreno.evaluation.metric import MetricSums
from neutreno.models import load_model
from neutreno.models.checkpoint import checkpoint_kind
from neutreno.progress import progress as progress_bar


def classification_sums(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Summed cross-entropy and top-1/top-5 hits of a batch: logits (B, K), labels (B,), and
    ``top5_scored``, the items top-5 means something for: none when K ≤ 5, where every label is among
    the five best (a 3-class subset was reported at top-5 100.0).

    Tied logits rank by class index, as ``argmax`` does (its first maximum), so top-1 counts the items
    ``argmax`` gets right (McNemar's per-item test reads those): ``topk`` orders ties unspecified,
    and differently on a CPU and a GPU."""
    if (
        logits.ndim != 2
        or labels.shape != logits.shape[:1]
        or labels.is_floating_point()
        or labels.is_complex()
    ):
        raise ValueError(
            f"classification_sums needs logits (B, K) and integer class ids (B,), got {tuple(logits.shape)} "
            f"and {labels.dtype} {tuple(labels.shape)} (soft or mixed targets are a training loss's, "
            "not a score's)"
        )
    if len(labels) and not (int(labels.min()) >= 0 and int(labels.max()) < logits.shape[1]):
        raise ValueError(
            f"class ids must be in [0, {logits.shape[1]}) for {logits.shape[1]} logits, got "
            f"{int(labels.min())}..{int(labels.max())} (an ignore label such as -100 is not scored here)"
        )
    target = logits.gather(1, labels[:, None])
    earlier = torch.arange(logits.shape[-1], device=logits.device) < labels[:, None]
    rank = (logits > target).sum(-1) + ((logits == target) & earlier).sum(-1)  # classes ranked before y
    return {
        "loss": F.cross_entropy(logits.float(), labels, reduction="sum"),
        "top1": (rank == 0).sum(),
        "top5": (rank < 5).sum(),
        "top5_scored": torch.tensor(len(labels) if logits.shape[-1] > 5 else 0),
        "count": torch.tensor(len(labels)),
    }


CLASSIFICATION_SUMS = ("loss", "top1", "top5", "top5_scored", "count")  # classification_sums' keys


def summarize_classification(sums: Mapping[str, float | Tensor]) -> dict[str, float]:
    """Top-1 / top-5 accuracy in percent and the mean loss, from summed counts; no ``top5`` where five
    or fewer classes were scored (every label is among the five best). ValueError for no items (it gave
    accuracy 0 at loss 0)."""
    if sums["count"] <= 0:
        raise ValueError("no items were scored: accuracy and loss are undefined")
    count = sums["count"]
    # sums of before top5_scored: top-5 over every item
    top5_scored = sums.get("top5_scored", count)
    return {
        "top1": 100 * sums["top1"] / count,
        **({"top5": 100 * sums["top5"] / top5_scored} if top5_scored > 0 else {}),
        "loss": sums["loss"] / count,
        "count": int(sums["count"]),
    }


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
    from neutreno.training.checkpoint import resolve_weights
    from neutreno.training.distributed import resolve_device

    weights = resolve_weights(checkpoint)
    model, meta = load_model(weights)
    pre = meta.get("preprocess")
    kind = checkpoint_kind(meta)
    if kind != "classifier":  # (it said: "not written by neutreno train")
        what = "a Hugging Face text classifier" if kind == "text classifier" else f"a {kind}"
        raise ValueError(f"{weights} is {what}, not an image classifier")
    if pre is None:
        raise ValueError(f"{weights} records no preprocessing (not written by neutreno train)")
    dataset = open_image_dataset(
        data, split, size=pre["image_size"], train=False, crop_pct=pre["crop_pct"], channels=pre["channels"]
    )
    classes, trained = list(dataset.classes), list(meta.get("classes") or [])
    outputs = getattr(model, "num_classes", None)
    # names that cannot say which output scores which class: of another count than the head's (scored
    # over every output, or an IndexError mid-evaluation), repeated, or not names (a TypeError)
    if trained and (
        not all(isinstance(name, str) for name in trained)
        or len(set(trained)) != len(trained)
        or (outputs is not None and len(trained) != outputs)
    ):
        raise ValueError(
            f"{weights} records {len(trained)} class names for a head of {outputs} outputs "
            f"({trained[:5]}{', …' if len(trained) > 5 else ''}): one distinct name (a string) per output "
            "is needed"
        )
    if not trained and outputs is not None and outputs != len(classes):
        # scored by position, the data's class k at the head's row k: a 1000-way head on 10 classes
        raise ValueError(
            f"{weights} records no class names and its head has {outputs} outputs, the data {len(classes)} "
            "classes: which output scores which class is not known (save it with extra={'classes': [...]})"
        )
    class_index = None
    if trained and classes != trained:
        if not set(classes) <= set(trained):
            raise ValueError(
                f"{data} ({split}) has classes the checkpoint was not trained on ("
                + class_difference(classes, trained, ("the data", "the checkpoint"))
                + "); a subset of its classes is scored over the subset"
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
    (see :func:`open_classifier`); ``classes_scored`` says how many classes the scores range over,
    ``head_classes`` how many the model's head has (more where the data hold a subset of them)."""
    classifier = open_classifier(checkpoint, data, split, device)
    head_classes = getattr(classifier.model, "num_classes", None)
    loader = DataLoader(
        classifier.dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_images
    )
    metric = MetricSums(summarize_classification, device=classifier.device)
    for images, labels, _ in progress_bar(loader, desc="eval", unit="batch", leave=False):
        logits = classifier.logits(images)
        metric.update(classification_sums(logits, labels.to(logits.device)))
    return {
        "checkpoint": str(classifier.weights),
        "data": str(data),
        "split": split,
        **metric.compute(),
        "classes_scored": len(classifier.dataset.classes),
        "head_classes": head_classes if isinstance(head_classes, int) else len(classifier.dataset.classes),
    }

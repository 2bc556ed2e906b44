"""Semantic segmentation (SPEC §4 Segmenter): its metrics. (The task and its config follow: issue 6.)

mIoU and pixel accuracy come from a confusion matrix accumulated over the whole evaluation set (and
summed over processes), as mmseg computes them: a class absent from both the labels and the
predictions has no IoU and is left out of the mean.
"""

from __future__ import annotations

import torch
from torch import Tensor


def confusion_matrix(pred: Tensor, target: Tensor, num_classes: int, ignore_index: int = 255) -> Tensor:
    """Counts (K, K) int64 of (true class, predicted class) over the pixels whose target is not ignored.

    Args:
        pred: predicted classes, any shape. target: true classes, same shape; ``ignore_index`` skips.
    Raises:
        ValueError: a target or prediction outside ``0 … K − 1`` (other than the ignore index).
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    keep = target != ignore_index
    pred, target = pred[keep].long(), target[keep].long()
    if pred.numel() and (min(pred.min(), target.min()) < 0 or max(pred.max(), target.max()) >= num_classes):
        raise ValueError(f"classes must be in 0…{num_classes - 1} (or the ignore index {ignore_index})")
    counts = torch.bincount(target * num_classes + pred, minlength=num_classes * num_classes)
    return counts.view(num_classes, num_classes)


def segmentation_scores(confusion: Tensor) -> dict[str, float | list[float]]:
    """mIoU and pixel accuracy (percent) and per-class IoU (percent, NaN for a class absent from both
    labels and predictions) from a confusion matrix (K, K), rows true, columns predicted."""
    confusion = confusion.double()
    hits = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - hits
    iou = torch.where(union > 0, hits / union.clamp_min(1), torch.full_like(hits, float("nan")))
    present = ~iou.isnan()
    return {
        "miou": 100 * iou[present].mean().item() if present.any() else float("nan"),
        "pixel_acc": 100 * (hits.sum() / confusion.sum().clamp_min(1)).item(),
        "iou": (100 * iou).tolist(),
    }

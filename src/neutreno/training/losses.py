"""Classification losses on soft targets: label smoothing and the mixed targets of Mixup/CutMix (SPEC §4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def smooth_one_hot(labels: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """Label-smoothed one-hot targets, as timm's ``mixup_target``.

    Args:
        labels: (B,) int64 class indices in [0, num_classes).
        num_classes: K.
        smoothing: the probability mass spread uniformly over all K classes, in [0, 1).
    Returns:
        (B, K) float32 on ``labels``' device: ``smoothing / K`` everywhere and
        ``1 - smoothing + smoothing / K`` at the label, so every row sums to 1.
    """
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    off = smoothing / num_classes
    targets = torch.full((len(labels), num_classes), off, dtype=torch.float32, device=labels.device)
    return targets.scatter_(1, labels.long()[:, None], 1 - smoothing + off)


def soft_target_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy against a target distribution: ``mean_b -Σ_k targets[b, k] · log_softmax(logits)[b, k]``.

    With ``targets = smooth_one_hot(y, K, s)`` this equals ``F.cross_entropy(logits, y, label_smoothing=s)``.

    Args:
        logits: (B, K), any float dtype; computed in float32 (a low-precision log-softmax loses small terms).
        targets: (B, K) rows summing to 1.
    Returns:
        The scalar mean loss, float32.
    """
    return torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()

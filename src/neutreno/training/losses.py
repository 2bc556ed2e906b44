"""Classification losses on soft targets: label smoothing and the mixed targets of Mixup/CutMix
(math.md §4, DeiT recipe)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from neutreno.data.augment import smooth_one_hot  # targets are built with the batch

__all__ = ["smooth_one_hot", "soft_target_cross_entropy"]


def soft_target_cross_entropy(
    logits: Tensor, targets: Tensor, reduction: Literal["mean", "sum"] = "mean"
) -> Tensor:
    """Cross-entropy against a target distribution: ``mean_b -Σ_k targets[b, k] · log_softmax(logits)[b, k]``
    (``reduction="sum"``: the sum over b).

    With ``targets = smooth_one_hot(y, K, s)`` this equals ``F.cross_entropy(logits, y, label_smoothing=s)``.

    Args:
        logits: (B, K), any float dtype; computed in float32 (a low-precision log-softmax loses small terms).
        targets: (B, K) rows summing to 1.
    Returns:
        The scalar mean (or sum) loss, float32.
    """
    per_item = torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1)
    return per_item.sum() if reduction == "sum" else per_item.mean()

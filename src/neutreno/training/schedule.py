"""The per-step learning rate: linear warm-up, then cosine decay or polynomial decay (mmseg/Segmenter's
PolyLR).

The cosine is timm's ``CosineLRScheduler`` with ``warmup_prefix=True`` (the cosine starts where the
warm-up ends, at base_lr), stepped every optimizer step. DeiT runs it with timm's default
``warmup_prefix=False`` (the cosine counted from epoch 0) and steps it once per epoch, after the epoch
(``lr_scheduler.step(epoch)`` in its ``main.py``), so that epochs 0 and 1 both train at ``warmup_lr``
and epoch e at the rate of e − 1. Over DeiT's 300 epochs with 5 of warm-up the two differ by up to 40%
of base_lr within the warm-up, 20% in the epoch after it (DeiT's epoch 5 runs at 0.8 base_lr), and at
most 1.1% from then on."""

from __future__ import annotations

import math
from typing import Literal


def scheduled_lr(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int,
    warmup_lr: float = 0.0,
    min_lr: float = 0.0,
    schedule: Literal["cosine", "poly"] = "cosine",
    power: float = 0.9,
) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    Steps ``0 … warmup_steps-1`` rise linearly from ``warmup_lr`` towards ``base_lr`` (step ``warmup_steps``
    reaches it); the rest decay from ``base_lr`` to ``min_lr`` as ``t`` goes from 0 at the end of warm-up
    to 1 at ``total_steps``: ``min_lr + (base_lr - min_lr)(1 + cos(π t))/2`` (cosine) or
    ``min_lr + (base_lr - min_lr)(1 − t)^power`` (poly).
    """
    if step < warmup_steps:
        return warmup_lr + (base_lr - warmup_lr) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else (1 - progress) ** power
    return min_lr + (base_lr - min_lr) * decay

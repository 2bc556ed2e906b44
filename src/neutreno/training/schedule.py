"""Per-step learning-rate schedules: linear warm-up, then cosine decay (timm's CosineLRScheduler, per step)
or polynomial decay (mmseg/Segmenter's PolyLR)."""

from __future__ import annotations

import math


def cosine_lr(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int,
    warmup_lr: float = 0.0,
    min_lr: float = 0.0,
) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    Steps ``0 … warmup_steps-1`` rise linearly from ``warmup_lr`` towards ``base_lr`` (step ``warmup_steps``
    reaches it); the rest follow ``min_lr + (base_lr - min_lr)(1 + cos(π t))/2`` with ``t`` going from 0
    at the end of warm-up to 1 at ``total_steps``.
    """
    if step < warmup_steps:
        return warmup_lr + (base_lr - warmup_lr) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


def poly_lr(
    step: int,
    *,
    base_lr: float,
    total_steps: int,
    warmup_steps: int,
    warmup_lr: float = 0.0,
    min_lr: float = 0.0,
    power: float = 0.9,
) -> float:
    """As :func:`cosine_lr`, but after the warm-up ``min_lr + (base_lr - min_lr)(1 − t)^power``."""
    if step < warmup_steps:
        return warmup_lr + (base_lr - warmup_lr) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (base_lr - min_lr) * (1 - progress) ** power

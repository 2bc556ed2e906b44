"""Exponential moving average of a model's weights (timm's ModelEmaV3 with ``exclude_buffers=True``:
parameters averaged, buffers copied; ModelEmaV2 averages buffers too)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class ModelEma(nn.Module):
    """``ema ← decay · ema + (1 − decay) · weights`` after each optimizer step; buffers are copied.

    The averaged copy lives on the model's device, in eval mode, without gradients.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_params = list(self.module.parameters())
        torch._foreach_lerp_(ema_params, [p.detach() for p in model.parameters()], 1.0 - self.decay)
        for ema_buffer, buffer in zip(self.module.buffers(), model.buffers(), strict=True):
            ema_buffer.copy_(buffer)

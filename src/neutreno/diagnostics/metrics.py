"""Over-smoothing measurements: pure functions on tensors (SPEC §3)."""

from __future__ import annotations

import torch
from torch import Tensor


def token_cosine_similarity(x: Tensor, mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """Mean cosine similarity between distinct tokens, (1/(N(N−1))) Σ_{i≠j} cos(x_i, x_j)
    (SPEC §3; paper App. E.3, Fig. 1). All tokens count, CLS included; padding does not.

    Computed in O(N·D) from ‖Σ_i x̂_i‖² = Σ_{i,j} cos(x_i, x_j) with x̂ the unit-normalised tokens,
    minus the diagonal. A zero token has cosine 0 with every token.

    Args:
        x: tokens (..., N, D).
        mask: (..., N) bool, True for real tokens; each sequence needs at least two.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``x.shape[:-2]``).
    Returns:
        A float32 tensor.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    unit = torch.nn.functional.normalize(x.float(), dim=-1)
    if mask is not None:
        if mask.shape != x.shape[:-1]:
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match tokens {tuple(x.shape[:-1])}")
        unit = unit * mask[..., None]
        n = mask.sum(-1).float()
    else:
        n = torch.full(x.shape[:-2], float(x.shape[-2]), device=x.device)
    if (n < 2).any():
        raise ValueError("token_cosine_similarity needs at least two (unmasked) tokens per sequence")
    all_pairs = unit.sum(-2).square().sum(-1)
    diagonal = unit.square().sum((-2, -1))
    per_sequence = (all_pairs - diagonal) / (n * (n - 1))
    return per_sequence.mean() if reduction == "mean" else per_sequence

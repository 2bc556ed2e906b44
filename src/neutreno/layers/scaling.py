"""FeatScale and AttnScale (math.md §2, Wang et al. 2022): learnable rescalings of an attention layer's
output frequencies and of its attention weights. Both start at 0, the identity."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from neutreno.layers.functional import _check_key_padding_mask, attnscale_weights


class FeatScale(nn.Module):
    """``y + s_dc ⊙ DC + s_hc ⊙ HC`` on an attention branch's output y (B, N, D): DC is the token mean
    (over real tokens; causal: the running mean, so no token sees the future), HC = y − DC. Gains
    ``dc``, ``hc``: (D,)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dc = nn.Parameter(torch.zeros(dim))
        self.hc = nn.Parameter(torch.zeros(dim))

    def forward(self, y: Tensor, key_padding_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """y: (B, N, D); key_padding_mask: (B, N) bool, True for real tokens (another batch's broadcast)."""
        if y.ndim != 3 or y.shape[-1] != self.dc.numel():
            raise ValueError(f"y must be (B, N, {self.dc.numel()}), got {tuple(y.shape)}")
        if key_padding_mask is not None:
            _check_key_padding_mask(key_padding_mask, y.shape[1], y.shape[0])
        if key_padding_mask is None and not is_causal:
            dc = y.mean(dim=1, keepdim=True)
        else:
            w = (
                torch.ones_like(y[..., :1])
                if key_padding_mask is None
                else key_padding_mask[..., None].to(y.dtype)
            )
            # sums and counts in float32 at least: a bf16 count stops at 256 (CUDA's cumsum keeps bf16
            # partial sums), and the mean of the first 300 tokens would divide by 256
            wide = torch.promote_types(y.dtype, torch.float32)
            # where, not times 0: a padded row holding inf or NaN gave 0 · inf = NaN in every real token
            yw = (y if key_padding_mask is None else torch.where(key_padding_mask[..., None], y, 0.0)).to(
                wide
            )
            w = w.to(wide)
            if is_causal:
                dc = (yw.cumsum(1) / w.cumsum(1).clamp_min(1)).to(y.dtype)
            else:
                dc = (yw.sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)).to(y.dtype)
        return y + self.dc * dc + self.hc * (y - dc)


class AttnScale(nn.Module):
    """``A' = U + (1 + ω)(A − U)`` per head, U uniform over the allowed keys; ``omega``: (H,).

    Called on weights (B, H, N, N) with the "may attend" mask; the attention functions take ``omega``
    directly (``attnscale_omega=``), since on the fused path it applies exactly after ``A V``."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.omega = nn.Parameter(torch.zeros(num_heads))

    def forward(self, weights: Tensor, mask: Tensor | None = None) -> Tensor:
        """weights: (B, H, N, N); mask: bool, broadcastable to them without enlarging them (a mask of
        another batch made weights of that batch)."""
        if weights.ndim != 4 or weights.shape[1] != self.omega.numel():
            raise ValueError(f"weights must be (B, {self.omega.numel()}, N, N), got {tuple(weights.shape)}")
        if mask is not None:
            try:
                fits = torch.broadcast_shapes(mask.shape, weights.shape) == weights.shape
            except RuntimeError:
                fits = False
            if mask.dtype != torch.bool or not fits:
                raise ValueError(
                    f"mask must be bool and broadcast to the weights {tuple(weights.shape)}, "
                    f"got {mask.dtype} {tuple(mask.shape)}"
                )
        return attnscale_weights(weights, mask, self.omega)

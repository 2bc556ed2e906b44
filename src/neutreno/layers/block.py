"""The transformer block and its parts, with timm's module names (math.md §4): pre-norm (ViT/DeiT),
post-norm (the paper's language model) or no norm, with depth-scaled residual branches (math.md §2)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from neutreno.layers.attention import Attention, KVCache
from neutreno.layers.dropout import Dropout

NORMS = ("pre", "post", "none")


def resolve_residual_scale(residual_scale: float | str, depth: int | None = None) -> float:
    """The residual-branch factor α (math.md §2, Noci et al.): a number > 0, or ``"1/sqrt(L)"`` for
    1/√depth (only where the stack's depth is known, i.e. in a model, not in a single block). Every
    model calls it with its depth, which must be >= 1."""
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    if residual_scale == "1/sqrt(L)" and depth is not None:
        return depth**-0.5
    valid = isinstance(residual_scale, (int, float)) and not isinstance(residual_scale, bool)
    if not valid or not 0 < residual_scale < math.inf:  # NaN fails too
        allowed = "a finite number > 0" + (" or '1/sqrt(L)'" if depth is not None else "")
        raise ValueError(f"residual_scale must be {allowed}, got {residual_scale!r}")
    return float(residual_scale)


class Mlp(nn.Module):
    """Two-layer feed-forward: fc1 → activation (GELU; ReLU in Transformer-XL's LM) → dropout → fc2 →
    dropout. Input/output (B, N, D)."""

    def __init__(
        self, dim: int, hidden_dim: int, drop: float = 0.0, act_layer: type[nn.Module] = nn.GELU
    ) -> None:
        super().__init__()
        if hidden_dim < 1:
            raise ValueError(f"the MLP's hidden width must be >= 1 (mlp_ratio × dim), got {hidden_dim}")
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act_layer()
        self.drop1 = Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drops a sample's whole residual branch with probability ``p`` in training,
    scaling kept branches by 1/(1 − p)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = torch.empty(x.shape[0], *([1] * (x.ndim - 1)), dtype=x.dtype, device=x.device)
        return x * keep.bernoulli_(1 - self.p) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """One transformer layer; ``norm`` places its LayerNorms (eps ``norm_eps``: DeiT 1e-6, PyTorch's
    1e-5 for the LM) and α = ``residual_scale`` scales both residual branches (math.md §2):

    - ``"pre"`` (ViT/DeiT): ``x + α·Attn(LN(x))``, then ``x + α·MLP(LN(x))``;
    - ``"post"`` (the original Transformer, the paper's WikiText-103 model): ``LN(x + α·Attn(x))``,
      then ``LN(x + α·MLP(x))``;
    - ``"none"``: ``x + α·Attn(x)``, then ``x + α·MLP(x)`` (``norm1``/``norm2`` are identities).

    ``attention_kwargs`` go to :class:`~neutreno.layers.attention.Attention` (``attention``,
    ``lam``, ``featscale``, ``attnscale``, ``impl``, ...).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        *,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        norm: str = "pre",
        norm_eps: float = 1e-6,
        residual_scale: float = 1.0,
        act_layer: type[nn.Module] = nn.GELU,
        **attention_kwargs,
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be a number > 0, got {mlp_ratio!r}")  # NaN fails > 0 too
        if not 1 <= dim * mlp_ratio < 2**31:  # int(dim * inf) raised OverflowError, a traceback
            raise ValueError(f"mlp_ratio {mlp_ratio} gives an MLP of {dim * mlp_ratio:g} units at dim {dim}")
        self.norm = norm
        self.residual_scale = resolve_residual_scale(residual_scale)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps) if norm != "none" else nn.Identity()
        self.attn = Attention(dim, num_heads, attn_drop=attn_drop, proj_drop=drop, **attention_kwargs)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps) if norm != "none" else nn.Identity()
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop, act_layer=act_layer)
        self.drop_path2 = DropPath(drop_path)

    def forward(
        self,
        x: Tensor,
        v0: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Args: x (B, N, D); v0, the stack's first-layer values (B, H, N, d) or None; ``cache``, this
        layer's keys and values of earlier positions (incremental decoding, see :class:`KVCache`).
        Returns: (x, v), the block output (B, N, D) and this block's values (B, H, N, d)."""
        mask_args = {"key_padding_mask": key_padding_mask, "is_causal": is_causal, "cache": cache}
        if self.norm == "post":
            y, v = self.attn(x, v0, **mask_args)
            x = self.norm1(x + self._scaled(self.drop_path1(y)))
            return self.norm2(x + self._scaled(self.drop_path2(self.mlp(x)))), v
        y, v = self.attn(self.norm1(x), v0, **mask_args)  # "pre", or "none" (identity norms)
        x = x + self._scaled(self.drop_path1(y))
        return x + self._scaled(self.drop_path2(self.mlp(self.norm2(x)))), v

    def _scaled(self, branch: Tensor) -> Tensor:
        return branch if self.residual_scale == 1 else branch * self.residual_scale

    def extra_repr(self) -> str:
        scale = f", residual_scale={self.residual_scale:g}" if self.residual_scale != 1 else ""
        return f"norm={self.norm!r}{scale}"


class BlockStack(nn.ModuleList):
    """Blocks run in order, each given NeuTRENO's V⁰: the first block's values, kept in the graph
    (math.md §2). The one place a stack threads V⁰; every model's ``blocks`` is one (timm's key names:
    ``blocks.0.…``). A model with two stacks (Segmenter's encoder and decoder) gives each its own V⁰."""

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        """Tokens (B, N, D) → the last block's output (B, N, D); keyword arguments as :meth:`outputs`."""
        for x in self.outputs(x, **kwargs):  # noqa: B007, B020  (keeps the last block's output)
            pass
        return x

    def outputs(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        caches: list[KVCache] | None = None,
        checkpoint: bool = False,
    ) -> Iterator[Tensor]:
        """Yield each block's output tokens (B, N, D).

        Args:
            key_padding_mask: (B, N) bool, True for real tokens. is_causal: causal masking.
            caches: one :class:`KVCache` per block, for incremental decoding.
            checkpoint: recompute each block in backward (activation checkpointing) when grad is on.
        """
        if caches is not None and (not isinstance(caches, (list, tuple)) or len(caches) != len(self)):
            # [] decoded without a cache (each step saw only itself), a short list failed half-way with
            # the first blocks' caches already extended
            shown = f"{len(caches)}" if isinstance(caches, (list, tuple)) else type(caches).__name__
            raise ValueError(f"caches must hold one KVCache per block ({len(self)}), got {shown}")
        if checkpoint and caches:  # recomputing a block in backward would append to its cache again
            raise ValueError("activation checkpointing is for training, KV caches for decoding: not both")
        v0 = None
        for i, block in enumerate(self):
            kwargs = {"key_padding_mask": key_padding_mask, "is_causal": is_causal}
            if caches is not None:
                kwargs["cache"] = caches[i]
            if checkpoint and torch.is_grad_enabled():
                # V⁰ is an explicit input, so its gradient survives the recomputation.
                x, v = torch.utils.checkpoint.checkpoint(block, x, v0, use_reentrant=False, **kwargs)
            else:
                x, v = block(x, v0, **kwargs)
            if v0 is None:
                v0 = v
            yield x


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) → patch tokens (B, N, D) with a stride-``patch_size`` convolution.

    With ``dynamic_img_size`` any H, W divisible by the patch size is accepted (timm's flag of that
    name); otherwise only ``img_size``², so a wrong input size is an error rather than a silent resize.
    """

    def __init__(
        self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, dynamic_img_size: bool = False
    ) -> None:
        super().__init__()
        self.dynamic_img_size = dynamic_img_size
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 4:  # an unbatched (C, H, W) image failed later, "Sizes of tensors must match"
            raise ValueError(
                f"expected images (B, C, H, W), got shape {tuple(x.shape)} (unsqueeze(0) for one)"
            )
        if self.dynamic_img_size:
            if x.shape[-2] % self.patch_size or x.shape[-1] % self.patch_size:
                raise ValueError(f"image size {tuple(x.shape[-2:])} is not divisible by {self.patch_size}")
        elif x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(
                f"expected {self.img_size}x{self.img_size} images, got {tuple(x.shape[-2:])}; "
                "create the model with img_size=... for other sizes"
            )
        return self.proj(x).flatten(2).transpose(1, 2)

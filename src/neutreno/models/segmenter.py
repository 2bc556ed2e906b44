"""Segmenter (Strudel et al., ICCV 2021; math.md §4): a ViT encoder and a linear or mask-transformer decoder.

Module and parameter names follow the reference code (``encoder`` is our timm-named ViT; ``decoder``
holds ``head`` or ``proj_dec``, ``cls_emb``, ``blocks``, ``decoder_norm``, ``proj_patch``,
``proj_classes``, ``mask_norm``). The mask transformer is a stack of its own: with a NeuTRENO
attention, its V⁰ is the values of the decoder's first layer, not the encoder's (math.md §2).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.layers import Block, BlockStack, resolve_residual_scale
from neutreno.layers.attention import KernelAttention, attention_class
from neutreno.models.registry import check_rates, check_sizes, register_model
from neutreno.models.vision_transformer import VisionTransformer, load_vit_weights, resample_pos_embed


class LinearDecoder(nn.Module):
    """Patch tokens (B, N, D) → class logits per patch (B, K, h, w) with one linear layer."""

    class_parameters = ("head.weight", "head.bias")  # shaped by the class count

    def __init__(self, num_classes: int, encoder_dim: int) -> None:
        super().__init__()
        self.head = nn.Linear(encoder_dim, num_classes)

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        return self.head(x).transpose(1, 2).unflatten(2, grid)


class MaskTransformer(nn.Module):
    """Segmenter's mask transformer: K learned class embeddings join the projected patch tokens in
    ``depth`` transformer blocks; each class's mask is the scalar product of L2-normalised patch and
    class features, then LayerNorm over classes.

    Input (B, N, D_encoder) patch tokens and the patch grid (h, w) with h·w = N; output (B, K, h, w).
    """

    class_parameters = ("cls_emb", "mask_norm.weight", "mask_norm.bias")  # shaped by the class count

    def __init__(
        self,
        num_classes: int,
        encoder_dim: int,
        *,
        embed_dim: int,
        depth: int = 2,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        residual_scale: float | str = 1.0,
        **attention_kwargs,
    ) -> None:
        super().__init__()
        attention = attention_kwargs.get("attention", "softmax")
        self.num_classes = num_classes
        drop_paths = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()
        alpha = resolve_residual_scale(residual_scale, depth)  # the decoder's own depth
        self.blocks = BlockStack(
            Block(
                embed_dim,
                num_heads,
                mlp_ratio,
                drop=drop_rate,
                # Segmenter's blocks drop attention probabilities at the same rate; kernel attention has none
                attn_drop=0.0 if issubclass(attention_class(attention), KernelAttention) else drop_rate,
                drop_path=p,
                residual_scale=alpha,
                **{**attention_kwargs, "learn_lam": attention_kwargs.get("learn_lam") if i else None},
            )
            for i, p in enumerate(drop_paths)  # block 0's λ multiplies V⁰ − V⁰ = 0: nothing to learn
        )
        self.cls_emb = nn.Parameter(torch.zeros(1, num_classes, embed_dim))
        self.proj_dec = nn.Linear(encoder_dim, embed_dim)
        scale = embed_dim**-0.5
        self.proj_patch = nn.Parameter(scale * torch.randn(embed_dim, embed_dim))
        self.proj_classes = nn.Parameter(scale * torch.randn(embed_dim, embed_dim))
        self.decoder_norm = nn.LayerNorm(embed_dim)
        self.mask_norm = nn.LayerNorm(num_classes)
        for m in self.modules():  # the reference's init_weights
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:  # qkv_bias=False
                    nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.cls_emb, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """The class embeddings, as Segmenter's own MaskTransformer exempts them from weight decay."""
        return {"cls_emb"}

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        x = self.proj_dec(x)
        x = torch.cat([x, self.cls_emb.expand(x.shape[0], -1, -1)], dim=1)
        x = self.decoder_norm(self.blocks(x))  # the decoder's own V⁰ (math.md §2: a stack of its own)
        patches, classes = x[:, : -self.num_classes], x[:, -self.num_classes :]
        patches = F.normalize(patches @ self.proj_patch, dim=-1)
        classes = F.normalize(classes @ self.proj_classes, dim=-1)
        masks = self.mask_norm(patches @ classes.transpose(1, 2))  # (B, N, K)
        return masks.transpose(1, 2).unflatten(2, grid)


class Segmenter(nn.Module):
    """Images (B, 3, H, W) of any size → class logits (B, K, H, W).

    The image is zero-padded to a multiple of the patch size (position embeddings are resampled to its
    patch grid, bicubic as timm does, where Segmenter's code is bilinear), the encoder's patch tokens
    (CLS dropped) go through the decoder, and the patch-level masks are upsampled bilinearly to the
    padded size, then cropped back to H × W.
    """

    def __init__(self, encoder: VisionTransformer, decoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder, self.decoder, self.num_classes = encoder, decoder, num_classes
        self.patch_size = encoder.patch_embed.patch_size

    def load_backbone(
        self, state_dict: dict[str, Tensor], source: str | os.PathLike = "the backbone"
    ) -> list[str]:
        """Initialise the encoder from a classification ViT's state dict (ours, or timm/DeiT keys):
        the classifier head is dropped and ``pos_embed`` resampled to the crop grid (bicubic with
        antialiasing, timm's ``resample_abs_pos_embed``; Segmenter's own code resizes bilinearly, which
        differs by ~1.5% on smooth embeddings). ``source`` (its file) names it in errors.

        Raises:
            ValueError: non-finite weights, a distilled DeiT (``dist_token``), or keys/shapes that do not
                fit, listed.
        """
        from neutreno.models.checkpoint import refuse_nonfinite, refuse_other_kinds  # (imports the registry)

        refuse_nonfinite(state_dict.items(), source)
        refuse_other_kinds(self.encoder.state_dict(), state_dict, source)  # integers would be cast silently
        # the encoder has no head: the classifier's is dropped
        try:
            return load_vit_weights(self.encoder, state_dict)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    def fit_for_finetuning(self, state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
        """A Segmenter's state dict fitted to this model to fine-tune from, as a ViT is
        (:func:`~neutreno.models.vision_transformer.load_vit_weights`): ``encoder.pos_embed`` resampled to
        this model's patch grid (trained at another crop size), and the decoder's class parameters
        (class embeddings and mask norm, or a linear head) this model's own when the class count
        differs. Other keys and shapes are left for the strict load to judge.

        Returns:
            The fitted state, and the keys given this model's initial values.
        """
        state, own = dict(state), self.state_dict()
        key, grid = "encoder.pos_embed", (self.encoder.patch_embed.grid_size,) * 2
        if key in state and key in own and state[key].shape != own[key].shape:
            state[key] = resample_pos_embed(state[key], grid)
        per_class = [f"decoder.{name}" for name in getattr(self.decoder, "class_parameters", ())]
        if any(k in state and k in own and state[k].shape != own[k].shape for k in per_class):
            state |= {k: own[k] for k in per_class}
            return state, per_class
        return state, []

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW should not decay (timm's interface): the encoder's token and position
        embeddings, and a mask decoder's class embeddings."""
        names = {f"encoder.{name}" for name in self.encoder.no_weight_decay()}
        decoder = getattr(self.decoder, "no_weight_decay", None)
        return names | ({f"decoder.{name}" for name in decoder()} if callable(decoder) else set())

    def forward_features(self, images: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images (B, 3, H, W), zero-padded to a patch multiple → the encoder's final-norm tokens
        (B, 1 + h·w, D) with CLS first, and the patch grid (h, w)."""
        p = self.patch_size
        padded = F.pad(images, (0, -images.shape[-1] % p, 0, -images.shape[-2] % p))
        return self.encoder.forward_features(padded), (padded.shape[-2] // p, padded.shape[-1] // p)

    def forward(self, images: Tensor) -> Tensor:
        """Images (B, 3, H, W) → per-pixel class logits (B, K, H, W): the masks on the patch grid,
        upsampled bilinearly to the padded size and cropped to the input's."""
        height, width = images.shape[-2:]
        tokens, grid = self.forward_features(images)
        masks = self.decoder(tokens[:, 1:], grid)
        size = (grid[0] * self.patch_size, grid[1] * self.patch_size)
        masks = F.interpolate(masks, size=size, mode="bilinear", align_corners=False)
        return masks[..., :height, :width]


# featscale, attnscale, learn_lam, residual_scale, mlp_ratio and block_norm reach the decoder as well
_ENCODER_ARGS = {
    "depth",
    "drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "qkv_bias",
    "featscale",
    "attnscale",
    "learn_lam",
    "residual_scale",
    "spectral_layers",
    "mlp_ratio",
    "block_norm",
}
_DECODER_ARGS = {"decoder_depth", "decoder_drop_rate", "decoder_drop_path_rate"}
_ARGS = {"num_classes", "img_size", "decoder", "attn_impl"} | _ENCODER_ARGS | _DECODER_ARGS


def _segmenter(
    embed_dim: int,
    num_heads: int,
    attention: str,
    lam: float | None,
    *,
    num_classes: int = 150,
    img_size: int = 512,
    depth: int = 12,
    decoder: str = "mask_transformer",
    decoder_depth: int = 2,
    decoder_drop_rate: float = 0.0,
    decoder_drop_path_rate: float = 0.0,
    attn_impl: str = "auto",
    **encoder_args,
) -> Segmenter:
    if decoder not in ("linear", "mask_transformer"):
        raise ValueError(f"unknown decoder {decoder!r}; one of linear, mask_transformer")
    check_sizes(num_classes=num_classes, decoder_depth=decoder_depth)
    check_rates(decoder_drop_rate=decoder_drop_rate, decoder_drop_path_rate=decoder_drop_path_rate)
    given = {"decoder_depth": (decoder_depth, 2), "decoder_drop_rate": (decoder_drop_rate, 0.0),
             "decoder_drop_path_rate": (decoder_drop_path_rate, 0.0)}  # fmt: skip
    set_here = [f"{k} {v}" for k, (v, default) in given.items() if v != default]
    if decoder == "linear" and set_here:
        raise ValueError(
            f"{', '.join(set_here)}: the mask transformer's, and the linear decoder has no layers"
        )
    encoder = VisionTransformer(
        img_size=img_size,
        patch_size=16,
        num_classes=0,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        attention=attention,
        lam=lam,
        attn_impl=attn_impl,
        dynamic_img_size=True,
        **encoder_args,
    )
    if decoder == "linear":
        head: nn.Module = LinearDecoder(num_classes, embed_dim)
    else:  # Segmenter's mask transformer: the encoder's width and heads, 2 layers
        head = MaskTransformer(
            num_classes,
            embed_dim,
            embed_dim=embed_dim,
            depth=decoder_depth,
            num_heads=num_heads,
            drop_rate=decoder_drop_rate,
            drop_path_rate=decoder_drop_path_rate,
            attention=attention,
            lam=lam,
            featscale=encoder_args.get("featscale", False),
            attnscale=encoder_args.get("attnscale", False),
            learn_lam=encoder_args.get("learn_lam"),
            residual_scale=encoder_args.get("residual_scale", 1.0),
            mlp_ratio=encoder_args.get("mlp_ratio", 4.0),
            norm=encoder_args.get("block_norm", "pre"),
            impl=attn_impl,
        )
    return Segmenter(encoder, head, num_classes)


def _check_args(kw: dict) -> None:
    unknown = sorted(set(kw) - _ARGS)
    if unknown:
        raise ValueError(f"unknown model argument(s) {unknown}; valid: {', '.join(sorted(_ARGS))}")


@register_model
def segmenter_tiny(attention: str = "softmax", lam: float | None = None, **kw) -> Segmenter:
    """Seg-T/16: DeiT-tiny encoder (D 192, 12 layers, 3 heads, patch 16) and, by default, the 2-layer
    mask transformer (``decoder="linear"`` for the linear one); 150 classes, 512² crops unless given."""
    _check_args(kw)
    return _segmenter(192, 3, attention, lam, **kw)


@register_model
def segmenter_small(attention: str = "softmax", lam: float | None = None, **kw) -> Segmenter:
    """Seg-S/16: DeiT-small encoder (D 384, 12 layers, 6 heads, patch 16) and a decoder as in
    :func:`segmenter_tiny`."""
    _check_args(kw)
    return _segmenter(384, 6, attention, lam, **kw)

"""Vision Transformer / DeiT with any attention variant (math.md §2, §4).

State-dict keys and shapes are timm's ``VisionTransformer`` ones (``cls_token``, ``pos_embed``,
``patch_embed.proj``, ``blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``, ``norm``,
``head``), so timm/DeiT checkpoints load; NeuTRENO adds no parameter.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import Tensor, nn

from neutreno.constants import IMAGENET_MEAN, IMAGENET_STD
from neutreno.layers import (
    Block,
    BlockStack,
    Dropout,
    PatchEmbed,
    layer_attentions,
    resolve_lam,
    resolve_residual_scale,
)
from neutreno.layers.attention import check_flags, upgrade_attention_keys
from neutreno.models.registry import check_rates, check_sizes, register_model


def _check_num_classes(num_classes: int) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(f"num_classes must be an integer >= 0 (0: no head), got {num_classes!r}")


class VisionTransformer(nn.Module):
    """ViT with a CLS token and learned position embeddings.

    ``forward_features`` returns the final-norm tokens (B, 1 + N, D); ``forward`` the logits of the
    CLS token (B, num_classes). The first block's values V⁰ are handed to every later block.

    Beyond timm's arguments: ``attention``/``lam`` (math.md §2); ``block_norm`` ``"pre"`` (DeiT, with a
    final LayerNorm), ``"post"`` or ``"none"`` (no final norm); ``residual_scale`` α on every residual
    branch, a number or ``"1/sqrt(L)"`` (Noci et al.); ``spectral_layers`` k: an ``eigen_*`` attention
    in the first k blocks only, the rest without the reparameterisation (Dovonon et al. used the
    first half on ImageNet).
    """

    def __init__(
        self,
        *,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        attention: str = "softmax",
        lam: float | None = None,
        featscale: bool = False,
        attnscale: bool = False,
        learn_lam: str | None = None,
        attn_impl: str = "auto",
        dynamic_img_size: bool = False,
        block_norm: str = "pre",
        residual_scale: float | str = 1.0,
        spectral_layers: int | None = None,
    ) -> None:
        super().__init__()
        check_sizes(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                    depth=depth, num_heads=num_heads)  # fmt: skip
        _check_num_classes(num_classes)
        check_flags(
            qkv_bias=qkv_bias, featscale=featscale, attnscale=attnscale, dynamic_img_size=dynamic_img_size
        )
        check_rates(drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        resolve_lam(attention, lam, learn_lam)  # fail before building anything
        attentions = layer_attentions(attention, depth, spectral_layers)
        alpha = resolve_residual_scale(residual_scale, depth)
        self.num_classes = num_classes
        self.num_features = self.embed_dim = embed_dim
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, dynamic_img_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = Dropout(drop_rate)
        # stochastic depth decay rule (on the CPU: a model built on the meta device reads the values)
        drop_paths = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()
        self.blocks = BlockStack(
            Block(
                embed_dim,
                num_heads,
                mlp_ratio,
                drop=drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=drop_paths[i],
                norm=block_norm,
                residual_scale=alpha,
                attention=attentions[i],
                lam=lam,
                qkv_bias=qkv_bias,
                featscale=featscale,
                attnscale=attnscale,
                learn_lam=learn_lam if i else None,  # block 0's term is λ(V⁰ − V⁰) = 0
                impl=attn_impl,
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if block_norm == "pre" else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.grad_checkpointing = False
        # timm's pretrained_cfg: what the model expects as input (the registry presets set their own).
        self.pretrained_cfg = {
            "input_size": (in_chans, img_size, img_size),
            "mean": IMAGENET_MEAN if in_chans == 3 else (0.5,) * in_chans,
            "std": IMAGENET_STD if in_chans == 3 else (0.5,) * in_chans,
            "interpolation": "bicubic",
            "crop_pct": 0.875,
            "num_classes": num_classes,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
        }
        self._init_weights()

    def _init_weights(self) -> None:
        # DeiT: truncated normal(0.02) for tokens and linear weights, zero biases, unit LayerNorm.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def embed(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) → tokens with CLS and positions (B, 1 + N, D), the first block's input.

        With ``dynamic_img_size``, ``pos_embed`` is resampled to the input's patch grid when it differs.
        """
        grid = (x.shape[-2] // self.patch_embed.patch_size, x.shape[-1] // self.patch_embed.patch_size)
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos_embed = self.pos_embed
        if grid != (self.patch_embed.grid_size,) * 2:
            pos_embed = resample_pos_embed(pos_embed, grid)
        return self.pos_drop(x + pos_embed)

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) → final-norm tokens (B, 1 + N, D)."""
        return self.norm(self.blocks(self.embed(x), checkpoint=self.grad_checkpointing))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Final-norm tokens (B, 1 + N, D) → logits from the CLS token (B, num_classes), or with
        ``pre_logits`` the CLS features (B, D) the head reads (timm's interface)."""
        x = x[:, 0]
        return x if pre_logits else self.head(x)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        return_prefix_tokens: bool = False,
    ):
        """timm's ``forward_intermediates``: the outputs of chosen blocks beside the final features.

        Args:
            indices: the last n blocks (an int), block indices (a list; negative counts from the end),
                or None for every block.
            norm: apply the final norm to each intermediate.
            output_fmt: ``"NCHW"`` — patch tokens as a (B, D, h, w) map — or ``"NLC"`` (B, N, D).
            return_prefix_tokens: also give each intermediate's CLS token (B, 1, D).
        Returns:
            (final-norm tokens (B, 1 + N, D), intermediates), or only the intermediates.
        """
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be NCHW or NLC, got {output_fmt!r}")
        depth = len(self.blocks)
        if indices is None:
            indices = list(range(depth))
        elif isinstance(indices, int):
            indices = list(range(depth - indices, depth)) if 1 <= indices <= depth else [depth]
        if not indices or any(not -depth <= i < depth for i in indices):
            raise ValueError(f"indices do not name blocks of a {depth}-block model")
        wanted = [i % depth for i in indices]
        h, w = x.shape[-2] // self.patch_embed.patch_size, x.shape[-1] // self.patch_embed.patch_size
        intermediates = []
        for i, out in enumerate(self.blocks.outputs(self.embed(x), checkpoint=self.grad_checkpointing)):
            x = out
            if i in wanted:
                y = self.norm(out) if norm else out
                prefix, patches = y[:, :1], y[:, 1:]
                if output_fmt == "NCHW":
                    patches = patches.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous()
                intermediates.append((patches, prefix) if return_prefix_tokens else patches)
            if intermediates_only and i == max(wanted):
                return intermediates
        return self.norm(x), intermediates

    def get_classifier(self) -> nn.Module:
        return self.head

    @property
    def default_cfg(self) -> dict:
        """timm's older name of :attr:`pretrained_cfg`."""
        return self.pretrained_cfg

    @property
    def head_hidden_size(self) -> int:
        """The width of the features the head reads (timm's interface): D."""
        return self.embed_dim

    global_pool = "token"  # the head reads the CLS token (timm's name for it); the only pooling here

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups, by layer (its layer-wise learning-rate decay reads them): the stem
        (tokens, positions, patch embedding), then block i whole (attention and norms with its MLP),
        the final norm last. Without it, timm's fallback put a block's attention a layer below its MLP."""
        return {
            "stem": r"^cls_token|pos_embed|patch_embed",
            "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh head for ``num_classes`` (0: no head, forward gives the CLS features)."""
        if global_pool not in (None, "token"):
            raise ValueError(f"only CLS-token pooling ('token') is supported, got {global_pool!r}")
        _check_num_classes(num_classes)
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.pretrained_cfg = {**self.pretrained_cfg, "num_classes": num_classes}
        spec = getattr(self, "model_spec", None)
        if spec is not None:  # save_model records the model it describes: one with this head
            spec["args"] = {**spec["args"], "num_classes": num_classes}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass instead of keeping its activations."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameters AdamW should not decay (timm's interface; the trainer also exempts all 1-D ones)."""
        return {"pos_embed", "cls_token"}

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) → logits (B, num_classes)."""
        return self.forward_head(self.forward_features(x))


@dataclasses.dataclass(frozen=True)
class _Preset:
    img_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    in_chans: int = 3
    num_classes: int = 1000
    mlp_ratio: float = 4.0
    # the input it expects (timm's pretrained_cfg), not constructor arguments
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # DeiT's own evaluation crop (its main.py, --eval-crop-ratio 0.875), behind the paper's figures;
    # timm's deit configs say 0.9 (resize to 248, not 256, before the centre crop to 224)
    crop_pct: float = 0.875


_CIFAR10 = {"mean": (0.4914, 0.4822, 0.4465), "std": (0.2470, 0.2435, 0.2616), "crop_pct": 1.0}


_VIT_ARGS = set(inspect.signature(VisionTransformer.__init__).parameters) - {"self"}


def _vit(preset: _Preset, attention: str, lam: float | None, overrides: dict) -> VisionTransformer:
    unknown = sorted(set(overrides) - _VIT_ARGS)
    if unknown:
        raise ValueError(f"unknown model argument(s) {unknown}; valid: {', '.join(sorted(_VIT_ARGS))}")
    args = dataclasses.asdict(preset)
    cfg = {key: args.pop(key) for key in ("mean", "std", "crop_pct")}
    model = VisionTransformer(**{**args, **overrides}, attention=attention, lam=lam)
    model.pretrained_cfg["crop_pct"] = cfg.pop("crop_pct")  # of the image size, whatever the channels
    if cfg["mean"] is not None and len(cfg["mean"]) == model.pretrained_cfg["input_size"][0]:
        model.pretrained_cfg |= cfg  # the preset's normalisation, unless the channels were overridden
    return model


@register_model
def deit_tiny_patch16_224(attention: str = "softmax", lam: float | None = None, **kw) -> VisionTransformer:
    """DeiT-tiny: 224², patch 16, D 192, 12 layers, 3 heads (5.7M parameters)."""
    return _vit(_Preset(224, 16, 192, 12, 3), attention, lam, kw)


@register_model
def deit_small_patch16_224(attention: str = "softmax", lam: float | None = None, **kw) -> VisionTransformer:
    """DeiT-small: 224², patch 16, D 384, 12 layers, 6 heads (22M parameters)."""
    return _vit(_Preset(224, 16, 384, 12, 6), attention, lam, kw)


@register_model
def deit_base_patch16_224(attention: str = "softmax", lam: float | None = None, **kw) -> VisionTransformer:
    """DeiT-base: 224², patch 16, D 768, 12 layers, 12 heads (86M parameters)."""
    return _vit(_Preset(224, 16, 768, 12, 12), attention, lam, kw)


@register_model
def vit_tiny_patch4_32(attention: str = "softmax", lam: float | None = None, **kw) -> VisionTransformer:
    """CIFAR-sized ViT-tiny: 32², patch 4 (64 patches + CLS), D 192, 12 layers, 3 heads, 10 classes."""
    return _vit(_Preset(32, 4, 192, 12, 3, num_classes=10, **_CIFAR10), attention, lam, kw)


@register_model
def vit_digits(attention: str = "softmax", lam: float | None = None, **kw) -> VisionTransformer:
    """For scikit-learn's 8×8 grayscale digits: patch 2 (16 patches + CLS), D 64, 12 layers,
    4 heads, MLP ratio 2, 10 classes; deep enough to over-smooth, trains in about a minute on a CPU."""
    return _vit(_Preset(8, 2, 64, 12, 4, 1, 10, 2.0, (0.3,), (0.4,), 1.0), attention, lam, kw)


def resample_pos_embed(pos_embed: Tensor, grid: tuple[int, int], num_prefix_tokens: int = 1) -> Tensor:
    """Position embeddings (1, prefix + h·w, D) → (1, prefix + grid[0]·grid[1], D), as timm does.

    The patch positions are resized as a (D, h, w) image with antialiased bicubic interpolation, as
    timm's ``resample_abs_pos_embed`` does (PIL's cubic, a = −0.5; the source grid is assumed square);
    the prefix (CLS) embeddings are kept.
    """
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    side = round(patches.shape[1] ** 0.5)
    if side * side != patches.shape[1]:
        whole = pos_embed.shape[1]
        if num_prefix_tokens and round(whole**0.5) ** 2 == whole:  # timm's class_token=False, no_embed_class
            raise ValueError(
                f"pos_embed has {whole} positions, a square grid with none for a class token: weights of "
                "a ViT without one (timm's class_token=False or no_embed_class), which this ViT is not"
            )
        raise ValueError(f"pos_embed has {patches.shape[1]} patch positions, not a square grid")
    if (side, side) == tuple(grid):
        return pos_embed
    # at least float32 (bicubic in half precision), float64 kept
    exact = torch.promote_types(pos_embed.dtype, torch.float32)
    image = patches.reshape(1, side, side, -1).permute(0, 3, 1, 2).to(exact)
    image = torch.nn.functional.interpolate(
        image, size=grid, mode="bicubic", align_corners=False, antialias=True
    )
    patches = image.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1).to(pos_embed.dtype)
    return torch.cat([prefix, patches], dim=1)


def _resamples_to(theirs: Tensor, own: Tensor, model: VisionTransformer) -> bool:
    """Whether a ``pos_embed`` resamples to this model's (another grid alone, not another layout)."""
    try:
        return resample_pos_embed(theirs, (model.patch_embed.grid_size,) * 2).shape == own.shape
    except ValueError:
        return False


def load_vit_weights(model: VisionTransformer, state_dict: dict[str, Tensor]) -> list[str]:
    """Load a ViT state dict with our (= timm's) key names into ``model``, strictly, as timm does for
    fine-tuning: ``pos_embed`` is resampled to the model's patch grid, RGB patch weights into a
    one-channel model are summed over the colours (timm's ``adapt_input_conv``), and the classifier head
    is left as initialised when the class count differs or the model has none (``num_classes=0``).

    A learned λ, FeatScale and AttnScale that the file has none of (softmax weights, as the paper's
    adaptation starts from) are left at their start: λ itself, and the identity.

    Returns:
        The model's keys left at their initial values: the head's and those additions, or none.
    Raises:
        ValueError: a distilled DeiT (``dist_token``: this ViT has no distillation token), or keys
            and shapes that do not fit, listed.
    """
    if "dist_token" in state_dict or "head_dist.weight" in state_dict:
        raise ValueError(
            "a distilled DeiT checkpoint (dist_token/head_dist): this ViT has no distillation token; "
            "use the non-distilled DeiT weights"
        )
    state = upgrade_attention_keys(dict(state_dict))
    own = model.state_dict()
    width = ("cls_token", "patch_embed.proj.bias")
    theirs_width = next((state[k].shape[-1] for k in width if k in state and k in own), None)
    if theirs_width is not None and theirs_width != model.embed_dim:  # every block's shapes listed as wrong
        raise ValueError(
            f"weights of a D {theirs_width} model do not fit this model's width D {model.embed_dim}"
        )
    # RGB weights into a one-channel model: summed over the colours, as timm's adapt_input_conv does
    # (a gray image is its three channels alike, so the first layer computes what it did on them)
    conv = "patch_embed.proj.weight"
    if conv in state and conv in own and state[conv].shape[1] == 3 and own[conv].shape[1] == 1:
        state[conv] = state[conv].sum(dim=1, keepdim=True)
    # Keys of another architecture (DeiT-III's LayerScale ls1/ls2, no_embed_class's pos_embed without the
    # CLS position) are the error to name, not the pos_embed grid that then fails to resample.
    foreign = any(k not in own and not k.startswith("head.") for k in state)
    if "pos_embed" in state and not foreign:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], (model.patch_embed.grid_size,) * 2)
    head = ("head.weight", "head.bias")
    theirs = [k for k in head if k in state]
    # another class count (or no head on one side) leaves the head fresh; a head of this shape that
    # lacks its bias is missing a key like any other (its weight was thrown away)
    another_head = not isinstance(model.head, nn.Linear) or not theirs
    another_head = another_head or any(state[k].shape != own[k].shape for k in theirs)
    if another_head:
        state = {k: v for k, v in state.items() if not k.startswith("head.")}
    # Parameters a softmax checkpoint lacks by design (a learned λ, FeatScale, AttnScale) start where
    # they leave the model as it was: at λ, or at the identity. Some but not all present: another model.
    from neutreno.models.checkpoint import (  # (it imports this module's registry)
        additions_missing,
        fresh_additions,
        is_addition,
    )

    fresh = fresh_additions(own, state)
    missing = sorted(set(own) - set(state) - fresh - (set(head) if another_head else set()))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if foreign and "pos_embed" in wrong and _resamples_to(state["pos_embed"], own["pos_embed"], model):
        wrong.remove("pos_embed")  # only its grid differs: left for the foreign keys to be named
    if wrong == [conv] and not missing and not unexpected:  # timm adapts these; here it is said which
        theirs, ours = tuple(state[conv].shape), tuple(own[conv].shape)
        raise ValueError(
            f"patch_embed.proj.weight is {theirs} in the weights, {ours} here: they load into the same "
            f"patch size ({theirs[-1]}) and {theirs[1]} input channels, or 1 from RGB (summed over the "
            "colours); not another patch size or channel count"
        )
    if unexpected and not missing and not wrong and all(is_addition(k) for k in unexpected):
        # as check_fits says it (fine-tuning said only "unexpected [...]")
        raise additions_missing("the file", type(model).__name__, ", ".join(unexpected[:3]))
    lam_shapes = [k for k in wrong if ".learned_lam." in k]
    if lam_shapes and not missing and not unexpected and lam_shapes == wrong:
        theirs = "per head" if state[lam_shapes[0]].ndim else "per layer"
        raise ValueError(
            f"the weights hold a λ learned {theirs}, this model learns one per "
            f"{'layer' if theirs == 'per head' else 'head'}: build it with learn_lam "
            f"{theirs.removeprefix('per ')!r}"
        )
    if missing or unexpected or wrong:
        raise ValueError(
            f"weights do not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}, "
            f"wrong shape {[(k, tuple(state[k].shape), tuple(own[k].shape)) for k in wrong[:6]]}"
        )
    model.load_state_dict(state, strict=False)
    return sorted(set(own) - set(state))

"""Attention and transformer layers shared by every model in the project."""

from neutreno.deprecation import moved_names
from neutreno.layers.attention import (
    ATTENTION_CLASSES,
    ATTENTION_TYPES,
    Attention,
    KernelAttention,
    KVCache,
    SpectralAttention,
    SpectralValueOutput,
    SymmetricAttention,
    attention_class,
    has_learned_lam,
    lam_by_layer,
    layer_attentions,
    resolve_lam,
    set_lam_scale,
    without_spectral,
)
from neutreno.layers.block import NORMS, Block, BlockStack, DropPath, Mlp, PatchEmbed, resolve_residual_scale
from neutreno.layers.cross_entropy import linear_cross_entropy
from neutreno.layers.dropout import Dropout, dropout
from neutreno.layers.functional import kernel_attention, softmax_attention
from neutreno.layers.neutreno import (
    DEFAULT_LAM,
    LEARN_LAM,
    LM_DEFAULT_LAM,
    LearnedLam,
    add_neutreno_term,
    neutreno_projection,
    runs_as_linear,
)
from neutreno.layers.scaling import AttnScale, FeatScale

__all__ = [
    "ATTENTION_CLASSES",
    "ATTENTION_TYPES",
    "DEFAULT_LAM",
    "LEARN_LAM",
    "LM_DEFAULT_LAM",
    "NORMS",
    "Attention",
    "AttnScale",
    "Block",
    "BlockStack",
    "DropPath",
    "Dropout",
    "FeatScale",
    "KVCache",
    "KernelAttention",
    "LearnedLam",
    "Mlp",
    "PatchEmbed",
    "SpectralAttention",
    "SpectralValueOutput",
    "SymmetricAttention",
    "add_neutreno_term",
    "attention_class",
    "dropout",
    "has_learned_lam",
    "kernel_attention",
    "lam_by_layer",
    "layer_attentions",
    "linear_cross_entropy",
    "neutreno_projection",
    "resolve_lam",
    "resolve_residual_scale",
    "runs_as_linear",
    "set_lam_scale",
    "softmax_attention",
    "without_spectral",
]


# Earlier releases' resolve_attention still imports, with a DeprecationWarning.
__getattr__ = moved_names(
    __name__,
    {"resolve_attention": "neutreno.layers.attention:_resolve_attention"},
    instead={"resolve_attention": "neutreno.layers.resolve_lam and ATTENTION_CLASSES"},
)

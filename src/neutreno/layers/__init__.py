"""Attention and transformer layers shared by every model in the project."""

from neutreno.layers.attention import (
    ATTENTION_TYPES,
    DEFAULT_LAM,
    Attention,
    SpectralValueOutput,
    add_neutreno_term,
    kernel_attention,
    layer_attentions,
    resolve_attention,
    softmax_attention,
    without_spectral,
)
from neutreno.layers.block import NORMS, Block, DropPath, Mlp, PatchEmbed, resolve_residual_scale

__all__ = [
    "ATTENTION_TYPES",
    "DEFAULT_LAM",
    "NORMS",
    "Attention",
    "Block",
    "DropPath",
    "Mlp",
    "PatchEmbed",
    "SpectralValueOutput",
    "add_neutreno_term",
    "kernel_attention",
    "layer_attentions",
    "resolve_attention",
    "resolve_residual_scale",
    "softmax_attention",
    "without_spectral",
]

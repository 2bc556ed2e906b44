"""Attention and transformer layers shared by every model in the project."""

from neutreno.layers.attention import (
    ATTENTION_TYPES,
    DEFAULT_LAM,
    Attention,
    add_neutreno_term,
    kernel_attention,
    resolve_attention,
    softmax_attention,
)
from neutreno.layers.block import Block, DropPath, Mlp, PatchEmbed

__all__ = [
    "ATTENTION_TYPES",
    "DEFAULT_LAM",
    "Attention",
    "Block",
    "DropPath",
    "Mlp",
    "PatchEmbed",
    "add_neutreno_term",
    "kernel_attention",
    "resolve_attention",
    "softmax_attention",
]

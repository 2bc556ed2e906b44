"""NeuTRENO put into a pretrained Hugging Face encoder with forward hooks, weights untouched
(paper App. G.9: NeuTRENO in a pretrained BERT without fine-tuning).

A minimal insertion for analysis: each layer's self-attention output A V (heads concatenated, before
the output projection) gets ``+ λ (V⁰ − V)`` with V⁰ the first layer's values for the same input.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from neutreno.diagnostics.collect import hf_encoder_layers, hf_qkv_projections
from neutreno.layers.attention import add_neutreno_term


def _self_attention(layer: nn.Module) -> nn.Module:
    """The module of ``layer`` that owns the query/key/value projections."""
    _, _, value = hf_qkv_projections(layer)
    for module in layer.modules():
        if any(child is value for child in module.children()):
            return module
    raise ValueError(f"no self-attention module found in {type(layer).__name__}")


@contextmanager
def neutreno_hooks(model: nn.Module, lam: float) -> Iterator[nn.Module]:
    """Within the context, ``model`` (BERT family or ViT encoder) computes NeuTRENO attention
    (SPEC §2, Eq. 26) with weight ``lam``; the hooks are removed on exit."""
    values: dict[int, Tensor] = {}  # this forward call's values, by layer index
    layers = hf_encoder_layers(model)

    def keep_values(index):
        def hook(module, args, output):
            values[index] = output

        return hook

    def add_term(index):
        def hook(module, args, output):
            attn_output, *rest = output
            return (add_neutreno_term(attn_output, values[index], values[0], lam), *rest)

        return hook

    handles = []
    for index, layer in enumerate(layers):
        handles.append(hf_qkv_projections(layer)[2].register_forward_hook(keep_values(index)))
        if index > 0:
            handles.append(_self_attention(layer).register_forward_hook(add_term(index)))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        values.clear()

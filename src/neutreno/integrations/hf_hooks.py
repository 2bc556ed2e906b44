"""NeuTRENO put into a pretrained Hugging Face encoder with forward hooks, weights untouched
(paper App. G.9: NeuTRENO in a pretrained BERT without fine-tuning).

A minimal insertion for analysis: the input of each layer's output projection W_O — the attention
output A V with heads concatenated — gets ``+ λ (V⁰ − V)`` (SPEC §2), with V⁰ the first layer's
values for the same input.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from neutreno.diagnostics.collect import hf_attention_projections, hf_encoder_layers
from neutreno.layers.attention import add_neutreno_term


@contextmanager
def neutreno_hooks(model: nn.Module, lam: float) -> Iterator[nn.Module]:
    """Within the context, ``model`` (a BERT-family or ViT encoder) computes NeuTRENO attention
    (SPEC §2, Eq. 26) with weight ``lam``; the hooks are removed on exit."""
    values: dict[int, Tensor] = {}  # this forward call's values (B, N, D), by layer index

    def keep_values(index):
        def hook(module, args, output):
            values[index] = output

        return hook

    def add_term(index):
        def hook(module, args):
            return (add_neutreno_term(args[0], values[index], values[0], lam), *args[1:])

        return hook

    handles = []
    for index, layer in enumerate(hf_encoder_layers(model)):
        _, _, value, output = hf_attention_projections(layer)
        handles.append(value.register_forward_hook(keep_values(index)))
        if index > 0:
            handles.append(output.register_forward_pre_hook(add_term(index)))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        values.clear()

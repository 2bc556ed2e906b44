"""Collecting per-layer tensors from a model, separate from the math on them.

A *probe* runs one batch through a model and returns :class:`LayerTensors`:

- :class:`BlockProbe`: any ``nn.Module`` given the list of its blocks (forward hooks); for the
  project's own models it also gives attention maps and queries/keys/values.
- :class:`HFProbe`: Hugging Face encoders (BERT family, ViT), through their
  ``output_hidden_states``/``output_attentions`` and hooks on the query/key/value projections.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class LayerTensors:
    """Per-layer tensors of one batch.

    Attributes:
        hidden: L + 1 tensors (B, N, D): the embeddings (input of the first block), then every
            block's output.
        mask: (B, N) bool, True for real tokens; None when every token is real.
        attn: L tensors (B, H, N, N), each layer's attention matrix; None unless asked for.
        q, k, v: L tensors (B, H, N, d) each; None unless asked for.
    """

    hidden: list[Tensor]
    mask: Tensor | None = None
    attn: list[Tensor] | None = None
    q: list[Tensor] | None = None
    k: list[Tensor] | None = None
    v: list[Tensor] | None = None


def _first(value):
    return value[0] if isinstance(value, (tuple, list)) else value


@contextmanager
def capture_hidden_states(blocks: Sequence[nn.Module], detach: bool = True) -> Iterator[list[Tensor]]:
    """Record the input of the first block and the output of every block, per forward call.

    Like Hugging Face's ``output_hidden_states``: after ``model(x)`` inside the context the list
    holds L + 1 tensors (B, N, D) — the embeddings, then each block's output (the first element
    of a tuple output). A second forward call inside the context starts the list afresh.

    Example::

        with capture_hidden_states(model.blocks) as hidden:
            model(images)
        cos = [token_cosine_similarity(h) for h in hidden]
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("capture_hidden_states needs at least one block")
    hidden: list[Tensor] = []

    def on_input(module, args, kwargs):
        hidden.clear()
        x = _first(args) if args else _first(next(iter(kwargs.values())))
        hidden.append(x.detach() if detach else x)

    def on_output(module, args, output):
        x = _first(output)
        hidden.append(x.detach() if detach else x)

    handles = [blocks[0].register_forward_pre_hook(on_input, with_kwargs=True)]
    handles += [b.register_forward_hook(on_output) for b in blocks]
    try:
        yield hidden
    finally:
        for handle in handles:
            handle.remove()


class BlockProbe:
    """Per-layer tensors from any model whose blocks are listed (default ``model.blocks``).

    With ``attention=True`` the blocks' ``attn`` modules must be :class:`neutreno.layers.Attention`:
    their inputs are recorded during the forward pass, and q/k/v and the attention matrices computed
    from them afterwards (``Attention.project``, ``Attention.weights_from_qk``).
    """

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module] | None = None, attention: bool = False):
        self.model = model
        self.blocks = list(model.blocks if blocks is None else blocks)
        self.attention = attention
        if attention:
            missing = [
                i
                for i, b in enumerate(self.blocks)
                if not hasattr(getattr(b, "attn", None), "weights_from_qk")
            ]
            if missing:
                raise ValueError(
                    "attention maps need neutreno Attention modules as block.attn; "
                    f"blocks {missing} have none"
                )

    @torch.no_grad()
    def __call__(self, inputs: Tensor) -> LayerTensors:
        # From the forward pass itself: each attention's input and mask arguments.
        masks: list[dict] = []
        inputs_seen: list[Tensor] = []

        def record(module, args, kwargs):
            inputs_seen.append(args[0] if args else kwargs["x"])
            masks.append({k: kwargs[k] for k in ("key_padding_mask", "is_causal") if k in kwargs})

        handles = []
        if self.attention:
            for block in self.blocks:
                handles.append(block.attn.register_forward_pre_hook(record, with_kwargs=True))
        try:
            with capture_hidden_states(self.blocks) as hidden:
                self.model(inputs)
        finally:
            for handle in handles:
                handle.remove()
        layers = LayerTensors(hidden=list(hidden), mask=masks[0].get("key_padding_mask") if masks else None)
        if self.attention:
            layers.attn, layers.q, layers.k, layers.v = [], [], [], []
            for block, x, kwargs in zip(self.blocks, inputs_seen, masks, strict=True):
                q, k, v = block.attn.project(x)
                layers.attn.append(block.attn.weights_from_qk(q, k, **kwargs))
                layers.q.append(q)
                layers.k.append(k)
                layers.v.append(v)
        return layers


def hf_encoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of a Hugging Face encoder (``encoder.layer`` or ``layers``)."""
    base = getattr(model, "base_model", model)
    layers = getattr(getattr(base, "encoder", None), "layer", None) or getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} is not supported: no encoder.layer or layers list")
    return list(layers)


_PROJECTION_NAMES = {
    "q": ("query", "q_proj"),
    "k": ("key", "k_proj"),
    "v": ("value", "v_proj"),
    "o": ("o_proj", "out_proj"),
}


def hf_attention_projections(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """The query, key, value and output (W_O) ``nn.Linear`` modules of one Hugging Face encoder
    layer: BERT family (``query``/``key``/``value``, ``attention.output.dense``) or the
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` layout."""
    found = {}
    for name, module in layer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        role = next((r for r, names in _PROJECTION_NAMES.items() if leaf in names), None)
        if role is None and name.endswith("attention.output.dense"):
            role = "o"
        if role is not None:
            found.setdefault(role, module)
    if len(found) != 4:
        raise ValueError(f"{type(layer).__name__}: attention projections not found (have {sorted(found)})")
    return found["q"], found["k"], found["v"], found["o"]


class HFProbe:
    """Per-layer tensors from a Hugging Face encoder called with ``**batch``.

    Hidden states and attention maps come from the model's own outputs; with ``attention=True``
    the model is switched to eager attention (the fused kernels return no maps; a model patched with
    :func:`neutreno.hf.apply_neutreno` keeps NeuTRENO on top) and q/k/v are
    read from its projections by hooks. ``batch["attention_mask"]`` gives the padding mask.
    """

    def __init__(self, model: nn.Module, attention: bool = False):
        self.model = model
        self.layers = hf_encoder_layers(model)
        self.attention = attention
        self.num_heads = model.config.num_attention_heads
        self.qkv = [hf_attention_projections(layer)[:3] for layer in self.layers] if attention else []
        if attention and not model.config._attn_implementation.endswith("eager"):
            from neutreno.integrations.hf import set_inner_attention

            set_inner_attention(model, "eager")  # under NeuTRENO, if it was put in

    @torch.no_grad()
    def __call__(self, batch: dict) -> LayerTensors:
        projections: dict[nn.Module, Tensor] = {}
        handles = []
        if self.attention:
            for layer_qkv in self.qkv:
                for proj in layer_qkv:
                    handles.append(
                        proj.register_forward_hook(lambda m, a, out: projections.__setitem__(m, out))
                    )
        try:
            out = self.model(**batch, output_hidden_states=True, output_attentions=self.attention)
        finally:
            for handle in handles:
                handle.remove()
        mask = batch.get("attention_mask")
        layers = LayerTensors(hidden=list(out.hidden_states), mask=None if mask is None else mask.bool())
        if self.attention:
            layers.attn = list(out.attentions)

            def heads(t: Tensor) -> Tensor:
                return t.view(*t.shape[:2], self.num_heads, -1).transpose(1, 2)

            qkv = [[heads(projections[p]) for p in layer_qkv] for layer_qkv in self.qkv]
            layers.q, layers.k, layers.v = ([row[i] for row in qkv] for i in range(3))
        return layers


def qkv_gradient_norms(blocks: Sequence[nn.Module], loss: Tensor) -> Tensor:
    """Frobenius norms of ∂loss/∂W_Q, ∂loss/∂W_K and ∂loss/∂W_V of each block's attention (math.md §3,
    Noci et al.): (L, 3). The blocks' ``attn.qkv`` weights hold [W_Q; W_K; W_V] row-wise (timm's layout).
    ``torch.autograd.grad`` is used, so parameters' ``.grad`` are left as they were."""
    blocks = list(blocks)
    missing = [i for i, b in enumerate(blocks) if not hasattr(getattr(b, "attn", None), "qkv")]
    if missing:
        raise ValueError(
            f"blocks {missing} have no fused attn.qkv with separate W_Q, W_K, W_V "
            "(symmetric and eigen_* attentions share or reparameterise them)"
        )
    grads = torch.autograd.grad(loss, [b.attn.qkv.weight for b in blocks])
    return torch.stack([torch.linalg.vector_norm(g.detach().view(3, -1), dim=1) for g in grads])

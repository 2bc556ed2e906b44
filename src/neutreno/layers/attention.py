"""Multi-head self-attention: softmax, NeuTRENO and their relatives (math.md §2).

One module, :class:`Attention`, serves every model in the project. Variants differ in two
independent choices, named by the ``attention`` string:

================== ====================== ==========================
attention          scores                 NeuTRENO term λ(V⁰ − V)
================== ====================== ==========================
softmax            softmax(Q Kᵀ/√d)       no
neutreno           softmax(Q Kᵀ/√d)       yes (paper Eq. 26)
symmetric          softmax(K Kᵀ/√d)       no (paper Eq. 14, no W_Q)
sym_neutreno       softmax(K Kᵀ/√d)       yes (paper Eq. 24)
kernel             φ(Q)φ(K)ᵀ, φ = elu+1   no (paper App. F.2, linear cost)
kernel_neutreno    φ(Q)φ(K)ᵀ, φ = elu+1   yes
eigen_neg          softmax(Q Kᵀ/√d)       no; W_V, W_O reparameterised so H = −diag(ψ)² (sharpening)
eigen_neg_neutreno softmax(Q Kᵀ/√d)       yes; the same
eigen_pos          softmax(Q Kᵀ/√d)       no; H = +diag(ψ)² (smoothing)
eigen_pos_neutreno softmax(Q Kᵀ/√d)       yes; the same
================== ====================== ==========================

The ``eigen_*`` variants are Dovonon et al.'s spectral reparameterisation (math.md §2,
:class:`SpectralValueOutput`).

V⁰ (the first attention layer's values, per head, not detached) is passed explicitly by the model
that owns the stack; there is no global state. Incremental decoding keeps each layer's keys and values
in a :class:`KVCache`; the first layer's cached values are V⁰ of every earlier position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# attention name → (scores, sign of the spectral reparameterisation: 0 for ordinary W_V, W_O)
_VARIANTS = {
    "softmax": ("softmax", 0),
    "neutreno": ("softmax", 0),
    "symmetric": ("symmetric", 0),
    "sym_neutreno": ("symmetric", 0),
    "kernel": ("kernel", 0),
    "kernel_neutreno": ("kernel", 0),
    "eigen_neg": ("softmax", -1),
    "eigen_neg_neutreno": ("softmax", -1),
    "eigen_pos": ("softmax", 1),
    "eigen_pos_neutreno": ("softmax", 1),
}
ATTENTION_TYPES = tuple(_VARIANTS)
ATTENTION_IMPLS = ("auto", "fused", "explicit")
DEFAULT_LAM = 0.6  # the paper's λ for vision (math.md §2)
LM_DEFAULT_LAM = 0.4  # the paper's λ for language modelling

# On CPU in bf16/fp16 the explicit product beats the fused kernel for a training step up to about
# this many tokens (2-4x at 65-577 tokens, even at 1025; measured with bench/attention_paths.py).
# In fp32 and on CUDA the fused kernel wins.
_CPU_LOW_PRECISION_EXPLICIT_MAX_TOKENS = 1024


def resolve_attention(attention: str, lam: float | None) -> tuple[str, float]:
    """Split an ``attention`` name into its score kind and λ.

    Returns:
        (scores, lam): ``scores`` is one of ``"softmax"``, ``"symmetric"``, ``"kernel"``; ``lam`` is
        the NeuTRENO weight (0.0 for the variants without the term; :data:`DEFAULT_LAM` if not given).

    Raises:
        ValueError: unknown name, λ given to a variant without the NeuTRENO term, or a bad λ.
    """
    if attention not in ATTENTION_TYPES:
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION_TYPES)}")
    scores = _VARIANTS[attention][0]
    if not attention.endswith("neutreno"):
        if lam is not None:
            raise ValueError(
                f"lam={lam} was given but attention {attention!r} has no NeuTRENO term; "
                f"use one of: {', '.join(a for a in ATTENTION_TYPES if a.endswith('neutreno'))}"
            )
        return scores, 0.0
    lam = DEFAULT_LAM if lam is None else lam
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be a finite number >= 0, got {lam!r}")
    return scores, float(lam)


def without_spectral(attention: str) -> str:
    """The same variant with ordinary W_V, W_O: ``eigen_neg`` → ``softmax``, ``eigen_pos_neutreno`` →
    ``neutreno``; other names unchanged (for stacks that reparameterise only their first layers)."""
    if _VARIANTS[attention][1] == 0:
        return attention
    return "neutreno" if attention.endswith("neutreno") else "softmax"


def layer_attentions(attention: str, depth: int, spectral_layers: int | None) -> list[str]:
    """Each layer's attention: ``attention`` in the first ``spectral_layers`` (all if None), and the
    same variant without the spectral reparameterisation after them."""
    if spectral_layers is None:
        return [attention] * depth
    if not 0 <= spectral_layers <= depth or attention == without_spectral(attention):
        raise ValueError(
            f"spectral_layers needs an eigen_* attention and 0..{depth} layers, got {spectral_layers} "
            f"with {attention!r}"
        )
    return [attention] * spectral_layers + [without_spectral(attention)] * (depth - spectral_layers)


class SpectralValueOutput(nn.Module):
    """Dovonon et al.'s spectral reparameterisation of the value and output projections (math.md §2).

    A free matrix Θ (D×D, Kaiming-uniform) and gains ψ (D, ~U(0, 1)); each forward, Q_o is the
    orthogonal factor of QR(Θ). Values are ``v = x Q_oᵀ`` (head h takes columns h·d … (h+1)·d) and the
    concatenated head outputs map to ``z Q_o Λ`` with ``Λ = sign · diag(ψ)²``; no biases. Then
    H = W_V W_O summed over heads is exactly Λ: eigenvalues −ψ² ∈ (−1, 0] ("−", sharpening) or +ψ²
    ("+", smoothing).
    """

    def __init__(self, dim: int, sign: int) -> None:
        super().__init__()
        if sign not in (-1, 1):
            raise ValueError(f"sign must be -1 or +1, got {sign}")
        self.sign = sign
        self.theta = nn.Parameter(torch.empty(dim, dim))
        nn.init.kaiming_uniform_(self.theta, a=math.sqrt(5))  # nn.Linear's default
        self.psi = nn.Parameter(torch.rand(dim))

    def orthogonal(self) -> Tensor:
        """Q_o (D, D), the orthogonal factor of QR(Θ) (computed in float32 or wider)."""
        theta = self.theta if self.theta.dtype in (torch.float32, torch.float64) else self.theta.float()
        return torch.linalg.qr(theta).Q

    def eigenvalues(self) -> Tensor:
        """The diagonal of Λ = sign · diag(ψ)² (D,): the eigenvalues of H."""
        return self.sign * self.psi**2

    def weights(self) -> tuple[Tensor, Tensor]:
        """(w_v, w_o), each (D, D), in ``nn.Linear``'s convention: ``v = x w_vᵀ`` (w_v = Q_o) and
        ``y = z w_oᵀ`` (w_o = Λ Q_oᵀ)."""
        q = self.orthogonal()
        return q, self.eigenvalues()[:, None] * q.T

    def output(self, z: Tensor, orthogonal: Tensor) -> Tensor:
        """``z Q_o Λ`` for concatenated head outputs z (B, N, D), given this forward's Q_o."""
        return (z @ orthogonal.to(z.dtype)) * self.eigenvalues().to(z.dtype)

    def extra_repr(self) -> str:
        return f"sign={self.sign:+d}"


def add_neutreno_term(u: Tensor, v: Tensor, v0: Tensor, lam: float) -> Tensor:
    """NeuTRENO's fidelity term: ``u + λ (v0 − v)`` (math.md §2, paper Eq. 26).

    Args:
        u: attention output A V, (B, H, N, d) (or any layout, the same for all three).
        v: this layer's values, same shape.
        v0: the first attention layer's values for the same input, same shape; not detached.
        lam: λ.
    """
    return torch.add(u, v0 - v, alpha=lam)


class _NeutrenoProjection(torch.autograd.Function):
    """``(u + λ(v0 − v)) W_Oᵀ + b`` that saves u, v, v0 instead of the sum.

    After the fused kernel, which keeps u and v (and, in the first layer, v0) for its own backward,
    saving them costs nothing, while a plain ``linear`` would save the sum: one more (B, N, D)
    tensor per layer, ~6% of a ViT's activations. Backward rebuilds the sum, one cheap add. (After
    the explicit product, which saves a copy of v rather than v, plain ``linear`` is the leaner.)
    Computes in the dtype autocast gives ``linear``; gradients return in the inputs' dtypes.
    """

    @staticmethod
    def forward(ctx, u, v, v0, lam, weight, bias):
        ctx.save_for_backward(u, v, v0, weight)
        ctx.lam, ctx.has_bias = lam, bias is not None
        return F.linear(add_neutreno_term(u, v, v0, lam), weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        u, v, v0, weight = ctx.saved_tensors
        z = add_neutreno_term(u, v, v0, ctx.lam).to(grad_y.dtype)
        grad_z = (grad_y @ weight.to(grad_y.dtype)).to(u.dtype)
        grad_rows = grad_y.reshape(-1, grad_y.shape[-1])
        grad_weight = (grad_rows.T @ z.reshape(-1, z.shape[-1])).to(weight.dtype)
        grad_bias = grad_rows.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_z, -ctx.lam * grad_z, ctx.lam * grad_z, None, grad_weight, grad_bias


def neutreno_projection(u: Tensor, v: Tensor, v0: Tensor, lam: float, proj: nn.Linear) -> Tensor:
    """``proj(u + λ(v0 − v))`` (math.md §2, Eq. 26, then W_O) without storing the sum for backward.

    Args:
        u, v, v0: (B, N, D) — the attention output, this layer's values and the first layer's values
            with heads concatenated.
        lam: λ. proj: the output projection W_O.
    Returns:
        (B, N, D).
    """
    return _NeutrenoProjection.apply(u, v, v0, lam, proj.weight, proj.bias)


def allowed_keys(
    key_padding_mask: Tensor | None, is_causal: bool, n: int, device: torch.device
) -> Tensor | None:
    """Boolean mask of the keys each query may use, True where query i may look at key j.

    Args:
        key_padding_mask: (B, N) bool, True for real tokens, False for padding.
        is_causal: forbid keys after the query.
    Returns:
        (B or 1, 1, N, N) bool, or None when nothing is masked.
    """
    if key_padding_mask is None and not is_causal:
        return None
    mask = torch.ones(n, n, dtype=torch.bool, device=device)
    if is_causal:
        mask = mask.tril()
    mask = mask[None, None]
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, n)
        mask = mask & key_padding_mask[:, None, None, :]
    return mask


def _check_key_padding_mask(key_padding_mask: Tensor, n: int) -> None:
    if key_padding_mask.dtype != torch.bool or key_padding_mask.ndim != 2 or key_padding_mask.shape[-1] != n:
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape (B, {n}), "
            f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )


def attention_mask(
    key_padding_mask: Tensor | None, is_causal: bool, n: int, device: torch.device
) -> Tensor | None:
    """:func:`allowed_keys` for softmax scores, where each query may also attend to itself, so a
    padded query never has an empty row (that would give NaN, which leaks into the next layer
    through 0·NaN). Outputs at padded positions are unspecified."""
    mask = allowed_keys(key_padding_mask, is_causal, n, device)
    if key_padding_mask is not None:
        mask = mask | torch.eye(n, dtype=torch.bool, device=device)
    return mask


def choose_softmax_impl(device: torch.device, dtype: torch.dtype, tokens: int) -> str:
    """The faster exact softmax path, ``"fused"`` or ``"explicit"``, for this device, dtype and length."""
    low_precision = dtype in (torch.bfloat16, torch.float16)
    if device.type == "cpu" and low_precision and tokens <= _CPU_LOW_PRECISION_EXPLICIT_MAX_TOKENS:
        return "explicit"
    return "fused"


def softmax_weights(
    q: Tensor, k: Tensor, mask: Tensor | None = None, attnscale_omega: Tensor | None = None
) -> Tensor:
    """Attention probabilities ``softmax(Q Kᵀ/√d)`` (B, H, N, N), with AttnScale if ω is given.

    Args:
        q, k: (B, H, N, d). mask: bool "may attend" mask from :func:`attention_mask`, or None.
        attnscale_omega: (H,) AttnScale ω (math.md §2).
    """
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    return probs if attnscale_omega is None else _attnscale_weights(probs, mask, attnscale_omega)


def kernel_weights(
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    attnscale_omega: Tensor | None = None,
) -> Tensor:
    """The N×N weights that :func:`kernel_attention` applies implicitly, ``φ(q_i)·φ(k_j)`` over
    the allowed keys, row-normalised (B, H, N, N). O(N²): for analysis, not for the forward pass."""
    mask = allowed_keys(key_padding_mask, is_causal, q.shape[-2], q.device)
    return masked_kernel_weights(q, k, mask, attnscale_omega)


def masked_kernel_weights(
    q: Tensor, k: Tensor, mask: Tensor | None, attnscale_omega: Tensor | None = None
) -> Tensor:
    """``φ(q_i)·φ(k_j)`` over the keys ``mask`` allows (bool, broadcastable to (B, H, Nq, Nk)),
    row-normalised: (B, H, Nq, Nk), q (B, H, Nq, d), k (B, H, Nk, d)."""
    weights = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-2, -1)
    if mask is not None:
        weights = weights * mask
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-6)
    return weights if attnscale_omega is None else _attnscale_weights(weights, mask, attnscale_omega)


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    attnscale_omega: Tensor | None = None,
    impl: str = "auto",
) -> Tensor:
    """``softmax(Q Kᵀ/√d) V`` per head (math.md §2), optionally with AttnScale.

    Args:
        q, k, v: (B, H, N, d).
        key_padding_mask: (B, N) bool, True for real tokens.
        is_causal: each query sees only keys at or before its position.
        dropout_p: attention dropout on the probabilities.
        attnscale_omega: (H,) AttnScale ω: A' = U + (1 + ω)(A − U), U uniform over the allowed keys.
        impl: ``"fused"`` (``scaled_dot_product_attention``), ``"explicit"`` (materialised
            probabilities), or ``"auto"`` (the faster one for this device, dtype and length).
    Returns:
        (B, H, N, d).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; valid: {', '.join(ATTENTION_IMPLS)}")
    if impl == "auto":
        impl = choose_softmax_impl(q.device, q.dtype, q.shape[-2])
    # AttnScale acts on the probabilities before dropout, so with dropout it needs them explicitly.
    explicit = impl == "explicit" or (attnscale_omega is not None and dropout_p > 0)
    # The fused kernel takes a causal flag; a mask tensor is needed only for padding or explicit use.
    needs_mask = key_padding_mask is not None or (is_causal and (explicit or attnscale_omega is not None))
    mask = attention_mask(key_padding_mask, is_causal, q.shape[-2], q.device) if needs_mask else None
    if explicit:
        probs = softmax_weights(q, k, mask, attnscale_omega)
        if dropout_p > 0:
            probs = F.dropout(probs, dropout_p)
        return probs @ v
    # Without padding, pass the causal flag rather than a mask: the fused kernels skip masked blocks.
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=None if key_padding_mask is None else mask,
        dropout_p=dropout_p,
        is_causal=is_causal and key_padding_mask is None,
    )
    if attnscale_omega is not None:
        out = _attnscale_output(out, v, mask, attnscale_omega)
    return out


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    attnscale_omega: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Linear-cost kernel attention ``U_i = Σ_j κ(q_i,k_j) v_j / Σ_j κ(q_i,k_j)`` with
    ``κ(q, k) = φ(q)·φ(k)``, ``φ = elu + 1`` (math.md §2, paper App. F.2).

    Computed as ``φ(Q) (φ(K)ᵀ V)`` in O(N d²) (causal: prefix sums), never forming the N×N matrix.

    Args:
        q, k, v: (B, H, N, d).
        key_padding_mask: (B, N) bool, True for real tokens; padded keys get zero weight.
        is_causal: each query sees only keys at or before its position.
        attnscale_omega: (H,) AttnScale ω (the kernel weights are row-stochastic too).
        eps: floor of the normaliser (a padded query may see no key).
    Returns:
        (B, H, N, d).
    """
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, q.shape[-2])
        phi_k = phi_k * key_padding_mask[:, None, :, None].to(phi_k.dtype)
    if is_causal:
        kv = torch.einsum("bhnd,bhne->bhnde", phi_k, v).cumsum(dim=2)
        numerator = torch.einsum("bhnd,bhnde->bhne", phi_q, kv)
        normaliser = (phi_q * phi_k.cumsum(dim=2)).sum(-1, keepdim=True)
    else:
        numerator = phi_q @ (phi_k.transpose(-2, -1) @ v)
        normaliser = phi_q @ phi_k.sum(dim=2).unsqueeze(-1)
    out = numerator / normaliser.clamp_min(eps)
    if attnscale_omega is not None:
        mask = allowed_keys(key_padding_mask, is_causal, q.shape[-2], q.device)
        out = _attnscale_output(out, v, mask, attnscale_omega)
    return out


def _uniform_weights(mask: Tensor | None, like: Tensor) -> Tensor:
    """Uniform attention over the allowed keys, (…, N, N), or the scalar 1/N without a mask;
    N and the dtype are taken from ``like`` (…, N, ·)."""
    if mask is None:
        return torch.tensor(1.0 / like.shape[-2], dtype=like.dtype, device=like.device)
    allowed = mask.to(like.dtype)
    return allowed / allowed.sum(-1, keepdim=True).clamp_min(1)


def _attnscale_weights(weights: Tensor, mask: Tensor | None, omega: Tensor) -> Tensor:
    """AttnScale on attention weights (math.md §2): A' = U + (1 + ω)(A − U), U uniform over allowed keys."""
    uniform = _uniform_weights(mask, weights)
    return uniform + (1 + omega.view(-1, 1, 1)) * (weights - uniform)


def _attnscale_output(out: Tensor, v: Tensor, mask: Tensor | None, omega: Tensor) -> Tensor:
    """AttnScale applied after ``A V``: A' V = U V + (1 + ω)(A V − U V), exact because A' is
    linear in A (math.md §2). ``U V`` is the mean of the allowed values."""
    uniform_out = v.mean(dim=-2, keepdim=True) if mask is None else _uniform_weights(mask, v) @ v
    return uniform_out + (1 + omega.view(-1, 1, 1)) * (out - uniform_out)


class KVCache:
    """One attention layer's keys and values of the positions decoded so far (each (B, H, T, d)).

    For NeuTRENO the first layer's cache holds V⁰ of every earlier position; a decoding step needs V⁰
    only at its new positions, which the first layer computes in the same step and hands on, so
    cached decoding gives the same logits as recomputing the whole prefix (math.md §2, causal LM).
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Add the new positions' keys and values (B, H, N, d); returns all of them (B, H, T + N, d)."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        self.keys, self.values = keys, values
        return keys, values


class Attention(nn.Module):
    """Multi-head self-attention with every math.md §2 variant; timm's ``Attention`` key names.

    Parameters: ``qkv`` (3D×D; ``kv``, 2D×D, for the symmetric variants, which have no W_Q) and
    ``proj`` (W_O). The ``eigen_*`` variants have ``qk`` (2D×D) and ``value_output``
    (:class:`SpectralValueOutput`, which replaces W_V and W_O). NeuTRENO adds no parameter, so
    ``softmax`` and ``neutreno`` share checkpoints.
    Options: ``featscale`` (learnable per-channel DC/HC gains ``featscale_dc``, ``featscale_hc`` on
    the output, math.md §2) and ``attnscale`` (per-head ``attnscale_omega``); both start at 0, the
    identity.

    Args:
        dim: D. num_heads: H (D must be divisible by H).
        attention: one of :data:`ATTENTION_TYPES`. lam: λ for the NeuTRENO variants.
        qkv_bias: biases on the input projections.
        attn_drop: dropout on attention probabilities (not on the NeuTRENO term).
        proj_drop: dropout after W_O.
        impl: softmax path, ``"auto"`` | ``"fused"`` | ``"explicit"`` (same numbers; speed only).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        attention: str = "softmax",
        lam: float | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        featscale: bool = False,
        attnscale: bool = False,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        if dim < 1 or num_heads < 1:
            raise ValueError(f"dim and num_heads must be >= 1, got dim {dim}, num_heads {num_heads}")
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; valid: {', '.join(ATTENTION_IMPLS)}")
        self.scores, self.lam = resolve_attention(attention, lam)
        sign = _VARIANTS[attention][1]
        if self.scores == "kernel" and attn_drop > 0:
            raise ValueError("attn_drop > 0 is not defined for kernel attention (no attention matrix)")
        self.attention = attention
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.impl = impl
        self.value_output = SpectralValueOutput(dim, sign) if sign else None
        if self.scores == "symmetric":
            self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        elif sign:
            self.qk = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = None if sign else nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.attnscale_omega = nn.Parameter(torch.zeros(num_heads)) if attnscale else None
        if featscale:
            self.featscale_dc = nn.Parameter(torch.zeros(dim))
            self.featscale_hc = nn.Parameter(torch.zeros(dim))
        else:
            self.featscale_dc = self.featscale_hc = None

    def forward(
        self,
        x: Tensor,
        v0: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Args:
            x: tokens (B, N, D).
            v0: the stack's first-layer values (B, H, N, d); None in the first layer (where the
                NeuTRENO term is zero) and for variants without the term.
            key_padding_mask: (B, N) bool, True for real tokens.
            is_causal: causal (language-model) masking.
            cache: incremental causal decoding: x are the N positions after the cache's; their keys
                and values are appended to it and each attends to every earlier position and itself.
        Returns:
            (y, v): the branch output (B, N, D), and this layer's values (B, H, N, d), which the
            first layer's caller passes on as ``v0``.
        """
        B, N, D = x.shape
        orthogonal = None if self.value_output is None else self.value_output.orthogonal()  # once per call
        q, k, v = self.project(x, orthogonal)
        fused = False
        if cache is not None:
            u = self._cached_attention(q, k, v, cache, key_padding_mask, is_causal)
        elif self.scores == "kernel":
            u = kernel_attention(
                q, k, v,
                key_padding_mask=key_padding_mask, is_causal=is_causal, attnscale_omega=self.attnscale_omega,
            )  # fmt: skip
        else:
            impl = choose_softmax_impl(q.device, q.dtype, N) if self.impl == "auto" else self.impl
            u = softmax_attention(
                q, k, v,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                dropout_p=self.attn_drop if self.training else 0.0,
                attnscale_omega=self.attnscale_omega,
                impl=impl,
            )  # fmt: skip
            fused = impl == "fused" and self.attnscale_omega is None  # u is the kernel's own output
        # Heads back to (B, N, D); the fused kernel's output already has that memory layout.
        u = u.transpose(1, 2).reshape(B, N, D)
        if v0 is not None and self.lam:
            v_tokens, v0_tokens = (t.transpose(1, 2).reshape(B, N, D) for t in (v, v0))
            if fused and self.proj is not None:  # the kernel keeps u and v for backward: not their sum too
                y = neutreno_projection(u, v_tokens, v0_tokens, self.lam, self.proj)
                return self._finish(y, key_padding_mask, is_causal), v
            u = add_neutreno_term(u, v_tokens, v0_tokens, self.lam)
        y = self.proj(u) if self.proj is not None else self.value_output.output(u, orthogonal)
        return self._finish(y, key_padding_mask, is_causal), v

    def _finish(self, y: Tensor, key_padding_mask: Tensor | None, is_causal: bool) -> Tensor:
        """FeatScale (if on) and dropout on the branch output (B, N, D)."""
        if self.featscale_dc is not None:
            y = self._featscale(y, key_padding_mask, is_causal)
        return self.proj_drop(y)

    def _cached_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        key_padding_mask: Tensor | None,
        is_causal: bool,
    ) -> Tensor:
        """Attention of N new queries over the cached and new keys, with explicit weights (decoding
        is one or a few queries at a time; no dropout). Query i sees keys 0 … T + i (T cached)."""
        if not is_causal or key_padding_mask is not None or self.featscale_dc is not None:
            raise ValueError("a KV cache is for causal decoding without padding or FeatScale")
        keys, values = cache.append(k, v)
        n, total = q.shape[-2], keys.shape[-2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
        if self.scores == "kernel":
            weights = masked_kernel_weights(q, keys, mask, self.attnscale_omega)
        else:
            weights = softmax_weights(q, keys, mask, self.attnscale_omega)
        return weights @ values

    @property
    def input_projection(self) -> nn.Linear:
        """The fused input projection: ``qkv`` (3D×D), ``kv`` (2D×D) for the symmetric variants, ``qk``
        (2D×D) for the spectral ones (their values come from :class:`SpectralValueOutput`)."""
        if self.scores == "symmetric":
            return self.kv
        return self.qkv if self.value_output is None else self.qk

    def project(self, x: Tensor, orthogonal: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values (each (B, H, N, d)) of tokens x (B, N, D); for the symmetric variants
        the queries are the keys (Eq. 14); for the spectral ones the values are ``x Q_oᵀ`` (Q_o given,
        or computed)."""
        projected = self.input_projection(x)
        if self.value_output is not None:
            q_o = self.value_output.orthogonal() if orthogonal is None else orthogonal
            projected = torch.cat([projected, x @ q_o.T.to(x.dtype)], dim=-1)
        return self.split_heads(projected)

    def split_heads(self, projected: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Projected tokens (B, N, 3D; 2D for the symmetric variants) → q, k, v (each (B, H, N, d))."""
        B, N, _ = projected.shape
        parts = projected.view(B, N, -1, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return (parts[0], parts[0], parts[1]) if self.scores == "symmetric" else tuple(parts)

    def value_output_weights(self) -> tuple[Tensor, Tensor]:
        """(w_v, w_o), each (D, D), in ``nn.Linear``'s convention (``v = x w_vᵀ``, ``y = z w_oᵀ``),
        heads concatenated: head h owns rows h·d … (h+1)·d of w_v and columns h·d … (h+1)·d of w_o.
        What :func:`neutreno.diagnostics.value_projection_spectrum` takes."""
        if self.value_output is not None:
            return self.value_output.weights()
        return self.input_projection.weight[-self.proj.in_features :], self.proj.weight

    def attention_weights(
        self, x: Tensor, *, key_padding_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        """The attention matrix this layer applies to its values for tokens x (B, N, D):
        (B, H, N, N), rows summing to 1 (AttnScale included, dropout excluded). For analysis."""
        q, k, _ = self.project(x)
        return self.weights_from_qk(q, k, key_padding_mask=key_padding_mask, is_causal=is_causal)

    def weights_from_qk(
        self, q: Tensor, k: Tensor, *, key_padding_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        """:meth:`attention_weights` from this layer's queries and keys (B, H, N, d)."""
        if self.scores == "kernel":
            return kernel_weights(q, k, key_padding_mask, is_causal, self.attnscale_omega)
        mask = attention_mask(key_padding_mask, is_causal, q.shape[-2], q.device)
        return softmax_weights(q, k, mask, self.attnscale_omega)

    def _featscale(self, y: Tensor, key_padding_mask: Tensor | None, is_causal: bool) -> Tensor:
        """FeatScale (math.md §2): y + s₁⊙DC + s₂⊙HC, DC the token mean (over real tokens; causal:
        the running mean, so no token sees the future), HC = y − DC. Added once."""
        if key_padding_mask is None and not is_causal:
            dc = y.mean(dim=1, keepdim=True)
        else:
            w = (
                torch.ones_like(y[..., :1])
                if key_padding_mask is None
                else key_padding_mask[..., None].to(y.dtype)
            )
            if is_causal:
                dc = (y * w).cumsum(1) / w.cumsum(1).clamp_min(1)
            else:
                dc = (y * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)
        return y + self.featscale_dc * dc + self.featscale_hc * (y - dc)

    def extra_repr(self) -> str:
        lam = f", lam={self.lam}" if self.lam else ""
        return f"attention={self.attention!r}{lam}, num_heads={self.num_heads}, impl={self.impl!r}"

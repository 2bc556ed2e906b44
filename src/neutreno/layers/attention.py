"""Multi-head self-attention: softmax, NeuTRENO and their relatives (math.md §2), timm's key names.

:class:`Attention` is softmax attention, with NeuTRENO's term λ(V⁰ − V) when λ > 0 (paper Eq. 26).
The relatives change one part of it each, as small subclasses; :data:`ATTENTION_CLASSES` maps every
``attention`` name to its class:

================== ======================= ====================================================
attention          class                   what changes
================== ======================= ====================================================
softmax            Attention               — (λ = 0)
neutreno           Attention               adds λ(V⁰ − V) (Eq. 26)
symmetric          SymmetricAttention      scores softmax(K Kᵀ/√d), no W_Q (Eq. 14)
sym_neutreno       SymmetricAttention      the same, with λ(V⁰ − V) (Eq. 24)
kernel             KernelAttention         φ(Q)φ(K)ᵀ, φ = elu + 1, linear cost (App. F.2)
kernel_neutreno    KernelAttention         the same, with λ(V⁰ − V)
eigen_neg          SpectralAttention       W_V, W_O reparameterised: H = −diag(ψ)² (sharpening)
eigen_neg_neutreno SpectralAttention       the same, with λ(V⁰ − V)
eigen_pos          SpectralAttention       H = +diag(ψ)² (smoothing)
eigen_pos_neutreno SpectralAttention       the same, with λ(V⁰ − V)
================== ======================= ====================================================

``Attention(dim, num_heads, attention=name)`` builds the class the name maps to. V⁰ (the first
attention layer's values, per head, not detached) is passed explicitly by whoever owns the stack
(:class:`neutreno.layers.block.BlockStack`); there is no global state. Incremental decoding keeps each
layer's keys and values in a :class:`KVCache`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from neutreno.deprecation import moved_names
from neutreno.layers.dropout import Dropout
from neutreno.layers.functional import (
    ATTENTION_IMPLS,
    attention_mask,
    choose_softmax_impl,
    kernel_attention,
    kernel_weights,
    masked_kernel_weights,
    softmax_attention,
    softmax_weights,
)
from neutreno.layers.neutreno import (
    DEFAULT_LAM,
    HF_LEARNED_LAM,
    LEARN_LAM,
    LearnedLam,
    add_neutreno_term,
    eager_inference,
    neutreno_projection,
    runs_as_linear,
)
from neutreno.layers.scaling import AttnScale, FeatScale


class Attention(nn.Module):
    """Softmax multi-head self-attention with NeuTRENO's term (math.md §2, paper Eq. 26)::

        q, k, v = split_heads(qkv(x))
        u = softmax(q kᵀ/√d) v                      # per head
        y = proj(u + λ (v0 − v))                    # heads concatenated; no term in the first layer

    Parameters ``qkv`` (3D×D) and ``proj`` (W_O), as in timm; NeuTRENO adds none, so ``softmax`` and
    ``neutreno`` share checkpoints. Options: ``featscale`` (:class:`FeatScale` on the output) and
    ``attnscale`` (:class:`AttnScale` on the weights).

    Args:
        dim: D. num_heads: H (D must be divisible by H).
        attention: a name in :data:`ATTENTION_CLASSES`; ``Attention(...)`` builds that name's class.
        lam: λ for the ``*neutreno`` names (default :data:`DEFAULT_LAM`); not allowed for the others.
        qkv_bias: biases on the input projection.
        attn_drop: dropout on the attention probabilities (not on the NeuTRENO term).
        proj_drop: dropout after W_O.
        impl: softmax path, ``"auto"`` | ``"fused"`` | ``"explicit"`` (same numbers; speed only: both keep
            16-bit scores in float32). A second derivative (``create_graph=True``, a gradient penalty) or
            forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``) needs ``"explicit"``: PyTorch's
            fused kernels have none, and ``"auto"`` may choose them. Where a row is one-hot (one key, or
            a collapsed stack) ∂Q and ∂K are exactly 0 only on ``"explicit"``: the fused backward leaves
            rounding noise there (~1e-7 relative in float32), which compounds through a deep stack.
        learn_lam: ``"layer"`` or ``"head"``: λ is learned (:class:`LearnedLam`, starting at ``lam``), one
            per layer or per head; None: λ is fixed.
    """

    default_attention = "softmax"  # the name a class is built with when none is given

    def __new__(cls, *args, attention: str | None = None, **kwargs):
        if cls is Attention and attention is not None:  # Attention(attention="kernel"): a KernelAttention
            cls = attention_class(attention)
        return super().__new__(cls)

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        attention: str | None = None,
        lam: float | None = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        featscale: bool = False,
        attnscale: bool = False,
        impl: str = "auto",
        learn_lam: str | None = None,
    ) -> None:
        super().__init__()
        check_flags(qkv_bias=qkv_bias, featscale=featscale, attnscale=attnscale)  # "false" was taken as on
        if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (dim, num_heads)):
            raise TypeError(f"dim and num_heads must be integers, got dim {dim!r}, num_heads {num_heads!r}")
        if dim < 1 or num_heads < 1:
            raise ValueError(f"dim and num_heads must be >= 1, got dim {dim}, num_heads {num_heads}")
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; valid: {', '.join(ATTENTION_IMPLS)}")
        if isinstance(attn_drop, bool) or not isinstance(attn_drop, numbers.Real) or not 0 <= attn_drop <= 1:
            # (NaN or < 0 turned dropout off without a word on the explicit path)
            raise ValueError(f"attn_drop must be a probability in [0, 1], got {attn_drop!r}")
        attention = attention or self.default_attention
        # the registered class this one is (a user's subclass of Attention counts as Attention): a
        # SpectralAttention named "neutreno" would be labelled as one attention and compute another
        registered = next(c for c in type(self).__mro__ if c in ATTENTION_CLASSES.values())
        if registered is not attention_class(attention):
            kind = attention_class(attention).__name__
            raise ValueError(f"attention {attention!r} is built by {kind}, not by {type(self).__name__}")
        self.attention = attention
        self.lam = resolve_lam(attention, lam, learn_lam)
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.impl = impl
        # a module, as timm's: loops that set every nn.Dropout's p (to turn dropout off) reach it too, and
        # attn.attn_drop.p reads as in timm (no state: checkpoints unchanged). Applied by the attention
        # paths to the probabilities, not called.
        self.attn_drop = Dropout(attn_drop)
        # Registered before the projections: the parameter order (which optimizer states follow) and
        # the initial weights of a seed are those of earlier releases.
        self.attnscale = AttnScale(num_heads) if attnscale else None
        self.featscale = FeatScale(dim) if featscale else None
        self.build_projections(dim, qkv_bias)
        self.proj_drop = Dropout(proj_drop)
        self.learned_lam = LearnedLam(self.lam, num_heads, learn_lam) if learn_lam is not None else None
        self.lam_scale = 1.0  # a λ schedule's factor (neutreno.layers.set_lam_scale); not saved

    def build_projections(self, dim: int, qkv_bias: bool) -> None:
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script (deprecated by PyTorch) failed deep in TorchScript's parser on keyword-only args
        raise TypeError(
            "neutreno's attention layers are not scriptable by torch.jit.script: use torch.compile, "
            "torch.export or torch.jit.trace, which are tested"
        )

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
            key_padding_mask: (B, N) bool, True for real tokens (Hugging Face's ``attention_mask``, as
                bool; the inverse of ``nn.MultiheadAttention``'s ``key_padding_mask``).
            is_causal: causal (language-model) masking.
            cache: incremental causal decoding: x are the N positions after the cache's; their keys
                and values are appended to it and each attends to every earlier position and itself.
        Returns:
            (y, v): the branch output (B, N, D), and this layer's values (B, H, N, d), which the
            first layer's caller passes on as ``v0``.
        """
        self.check_inputs(x, v0, key_padding_mask, is_causal)
        q, k, v = self.project(x)
        if cache is None:
            u, fused_saved_v = self.attend(q, k, v, key_padding_mask, is_causal)
        else:
            u, fused_saved_v = self.attend_cached(q, k, v, cache, key_padding_mask, is_causal), False
        y = self.output(merge_heads(u), v, v0, fused_saved_v)
        if self.featscale is not None:
            y = self.featscale(y, key_padding_mask, is_causal)
        return self.proj_drop(y), v

    def check_inputs(
        self, x: Tensor, v0: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool = False
    ) -> None:
        """Refuse what would broadcast silently: a V⁰ of other samples or positions (math.md §2: the first
        layer's values for the same input) or a mask of another batch would give outputs of the wrong
        numbers, or of another shape, without an error."""
        if x.ndim != 3 or x.shape[-1] != self.num_heads * self.head_dim:
            raise ValueError(
                f"x must be tokens (B, N, {self.num_heads * self.head_dim}), got {tuple(x.shape)}"
            )
        B, N, _ = x.shape
        if v0 is not None and v0.shape != (B, self.num_heads, N, self.head_dim):
            raise ValueError(
                f"v0 must be the first layer's values for this input, (B, H, N, d) = "
                f"{(B, self.num_heads, N, self.head_dim)}, got {tuple(v0.shape)}"
            )
        # another device, or (outside autocast, where V⁰ is in the compute dtype) another dtype: torch's
        # error named neither V⁰ nor the layer, and without grad a float64 V⁰ was cast silently
        if v0 is not None and (
            v0.device != x.device or (v0.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type))
        ):
            raise ValueError(
                f"v0 must be the first layer's values for this input, {x.dtype} on {x.device}, got "
                f"{v0.dtype} on {v0.device}"
            )
        if not isinstance(is_causal, bool):  # None was non-causal on one path, a TypeError on another
            raise ValueError(f"is_causal must be True or False, got {is_causal!r}")
        if key_padding_mask is not None and key_padding_mask.shape[:1] != (B,):
            raise ValueError(
                f"key_padding_mask must be (B, N) = {(B, N)} for x {tuple(x.shape)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values (each (B, H, N, d)) of tokens x (B, N, D)."""
        return self.split_heads(self.qkv(x))

    def split_heads(self, projected: Tensor) -> tuple[Tensor, ...]:
        """(B, N, P·D) → P tensors (B, H, N, d), views of ``projected``."""
        B, N, _ = projected.shape
        # split, not a (B, N, P, H, d) permute + unbind: backward joins the P gradients with one cat
        # instead of a stack and a transposing copy (≈2% of a DeiT-tiny fp32 step, bench/train_step.py)
        parts = projected.split(self.num_heads * self.head_dim, dim=-1)
        return tuple(p.view(B, N, self.num_heads, self.head_dim).transpose(1, 2) for p in parts)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool
    ) -> tuple[Tensor, bool]:
        """``A V`` per head (B, H, N, d), and whether it is the fused kernel's output (which keeps u
        and v for its own backward)."""
        impl = self.impl
        if impl == "auto":  # measured per device, dtype, length and mode (training: with a backward)
            impl = choose_softmax_impl(q.device, q.dtype, q.shape[-2], training=q.requires_grad)
        omega = self.attnscale_omega
        u = softmax_attention(
            q, k, v,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            dropout_p=self.attn_drop.p if self.training else 0.0,
            attnscale_omega=omega,
            impl=impl,
        )  # fmt: skip
        return u, impl == "fused" and omega is None

    def attend_cached(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        key_padding_mask: Tensor | None,
        is_causal: bool,
    ) -> Tensor:
        """N new queries over the cached and new keys, with explicit weights (decoding is one or a
        few queries at a time; no dropout). Query i sees keys 0 … T + i (T cached)."""
        if not is_causal or key_padding_mask is not None or self.featscale is not None:
            raise ValueError("a KV cache is for causal decoding without padding or FeatScale")
        keys, values = cache.append(k, v)
        n, total = q.shape[-2], keys.shape[-2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
        return self.masked_weights(q, keys, mask) @ values

    def output(self, u: Tensor, v: Tensor, v0: Tensor | None, fused_saved_v: bool) -> Tensor:
        """W_O of ``u + λ(v0 − v)`` (math.md §2, Eq. 26): u (B, N, D), v and v0 (B, H, N, d);
        ``fused_saved_v``: u is the fused kernel's output, which saved u and v for its backward."""
        lam = self.neutreno_weight()
        if v0 is None or lam is None:
            return self.proj(u)
        v, v0 = merge_heads(v), merge_heads(v0)
        if eager_inference():  # the sum into attend's own fresh u, no new tensor
            # (DeiT-tiny batch-64 inference, NeuTRENO/softmax time: 1.047 → 1.029 fp32, 1.092 → 1.076 bf16)
            return self.proj(add_neutreno_term(u, v, v0, lam, inplace=True, kept=fused_saved_v))
        # saving u, v, v0 is free; the sum is not. A W_O that is more than F.linear (LoRA, hooks) runs itself.
        if fused_saved_v and runs_as_linear(self.proj):
            return neutreno_projection(u, v, v0, lam, self.proj)
        return self.proj(add_neutreno_term(u, v, v0, lam))

    def current_lam(self) -> float | Tensor:
        """λ as applied now, the schedule's ``lam_scale`` included: a number, or a learned λ's tensor
        (() per layer, (H,) per head)."""
        if self.learned_lam is None:
            return self.lam * self.lam_scale
        return self.learned_lam() * self.lam_scale

    def neutreno_weight(self) -> float | Tensor | None:
        """:meth:`current_lam` for heads-concatenated tokens (a per-head λ repeated over each head's d
        channels: (D,)), or None when there is no term to add (a fixed λ of 0)."""
        lam = self.current_lam()
        if not isinstance(lam, Tensor):
            return lam or None
        return lam.repeat_interleave(self.head_dim) if lam.ndim else lam

    def masked_weights(self, q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
        """Attention weights over the keys ``mask`` allows (bool, broadcastable to (B, H, Nq, Nk);
        each query may see itself), AttnScale included: (B, H, Nq, Nk)."""
        omega = self.attnscale_omega
        return softmax_weights(q, k, mask, omega)

    def weights_from_qk(
        self, q: Tensor, k: Tensor, *, key_padding_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        """:meth:`attention_weights` from this layer's queries and keys (B, H, N, d)."""
        mask = attention_mask(key_padding_mask, is_causal, q.shape[-2], q.device, q.shape[0])
        return self.masked_weights(q, k, mask)

    def attention_weights(
        self, x: Tensor, *, key_padding_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        """The attention matrix this layer applies to its values for tokens x (B, N, D):
        (B, H, N, N), rows summing to 1 (AttnScale included, dropout excluded). For analysis."""
        q, k, _ = self.project(x)
        return self.weights_from_qk(q, k, key_padding_mask=key_padding_mask, is_causal=is_causal)

    @property
    def attnscale_omega(self) -> Tensor | None:
        """AttnScale's per-head ω (H,), or None without AttnScale."""
        return None if self.attnscale is None else self.attnscale.omega

    @property
    def input_projection(self) -> nn.Linear:
        """The fused input projection whose rows are q, k (then v) for :mod:`neutreno.diagnostics`."""
        return self.qkv

    def value_output_weights(self) -> tuple[Tensor, Tensor]:
        """(w_v, w_o), each (D, D), in ``nn.Linear``'s convention (``v = x w_vᵀ``, ``y = z w_oᵀ``),
        heads concatenated: head h owns rows h·d … (h+1)·d of w_v and columns h·d … (h+1)·d of w_o.
        What :func:`neutreno.diagnostics.value_projection_spectrum` takes."""
        return self.input_projection.weight[-self.proj.in_features :], self.proj.weight

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        upgrade_attention_keys(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        lam = f", lam={self.lam}" if self.lam else ""
        lam += ", learned" if self.learned_lam is not None else ""
        return f"attention={self.attention!r}{lam}, num_heads={self.num_heads}, impl={self.impl!r}"


class SymmetricAttention(Attention):
    """Symmetric attention (math.md §2, Eq. 14; with NeuTRENO Eq. 24): queries are the keys, so the
    scores softmax(K Kᵀ/√d) are symmetric; the input projection is ``kv`` (2D×D), no W_Q."""

    default_attention = "symmetric"

    def build_projections(self, dim: int, qkv_bias: bool) -> None:
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k, v = self.split_heads(self.kv(x))
        return k, k, v

    @property
    def input_projection(self) -> nn.Linear:
        return self.kv


class KernelAttention(Attention):
    """Kernel attention (math.md §2, paper App. F.2): weights φ(q)·φ(k) with φ = elu + 1, row-normalised,
    computed as φ(Q)(φ(K)ᵀV) at linear cost; the N×N weights are formed only for analysis."""

    default_attention = "kernel"

    def __init__(self, dim: int, num_heads: int = 8, *, attn_drop: float = 0.0, **kwargs) -> None:
        if isinstance(attn_drop, numbers.Real) and not isinstance(attn_drop, bool) and attn_drop > 0:
            raise ValueError("attn_drop > 0 is not defined for kernel attention (no attention matrix)")
        super().__init__(dim, num_heads, attn_drop=attn_drop, **kwargs)  # (−1, NaN, None: refused there)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, is_causal: bool
    ) -> tuple[Tensor, bool]:
        omega = self.attnscale_omega
        u = kernel_attention(
            q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, attnscale_omega=omega
        )
        return u, False

    def masked_weights(self, q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
        omega = self.attnscale_omega
        return masked_kernel_weights(q, k, mask, omega)

    def weights_from_qk(
        self, q: Tensor, k: Tensor, *, key_padding_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        omega = self.attnscale_omega
        return kernel_weights(q, k, key_padding_mask, is_causal, omega)


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
        self._orthogonal: Tensor | None = None  # set within orthogonal_once()

    def orthogonal(self) -> Tensor:
        """Q_o (D, D), the orthogonal factor of QR(Θ) (computed in float32 or wider)."""
        if self._orthogonal is not None:
            return self._orthogonal
        theta = self.theta if self.theta.dtype in (torch.float32, torch.float64) else self.theta.float()
        return torch.linalg.qr(theta).Q

    @contextlib.contextmanager
    def orthogonal_once(self) -> Iterator[None]:
        """Within the block, :meth:`orthogonal` computes Q_o once and returns that same tensor."""
        self._orthogonal = None
        self._orthogonal = self.orthogonal()
        try:
            yield
        finally:
            self._orthogonal = None

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


class SpectralAttention(Attention):
    """Softmax attention with Dovonon et al.'s spectral value/output maps (math.md §2): the input
    projection is ``qk`` (2D×D), and :class:`SpectralValueOutput` (``value_output``) replaces W_V and
    W_O, so H = W_V W_O summed over heads has eigenvalues −ψ² (``eigen_neg*``) or +ψ² (``eigen_pos*``)."""

    default_attention = "eigen_neg"

    def build_projections(self, dim: int, qkv_bias: bool) -> None:
        self.value_output = SpectralValueOutput(dim, -1 if self.attention.startswith("eigen_neg") else 1)
        self.qk = nn.Linear(dim, 2 * dim, bias=qkv_bias)

    def forward(self, x: Tensor, v0: Tensor | None = None, **kwargs) -> tuple[Tensor, Tensor]:
        with self.value_output.orthogonal_once():  # Q_o = QR(Θ).Q once per call, for v and for the output
            return super().forward(x, v0, **kwargs)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q_o = self.value_output.orthogonal()
        return self.split_heads(torch.cat([self.qk(x), x @ q_o.T.to(x.dtype)], dim=-1))

    def output(self, u: Tensor, v: Tensor, v0: Tensor | None, fused_saved_v: bool) -> Tensor:
        lam = self.neutreno_weight()
        if v0 is not None and lam is not None:  # (in place in inference, as in Attention.output)
            u = add_neutreno_term(u, merge_heads(v), merge_heads(v0), lam, inplace=eager_inference())
        return self.value_output.output(u, self.value_output.orthogonal())

    @property
    def input_projection(self) -> nn.Linear:
        return self.qk

    def value_output_weights(self) -> tuple[Tensor, Tensor]:
        return self.value_output.weights()


# attention name → class (the NeuTRENO term is on for the names ending in "neutreno")
ATTENTION_CLASSES: dict[str, type[Attention]] = {
    "softmax": Attention,
    "neutreno": Attention,
    "symmetric": SymmetricAttention,
    "sym_neutreno": SymmetricAttention,
    "kernel": KernelAttention,
    "kernel_neutreno": KernelAttention,
    "eigen_neg": SpectralAttention,
    "eigen_neg_neutreno": SpectralAttention,
    "eigen_pos": SpectralAttention,
    "eigen_pos_neutreno": SpectralAttention,
}
ATTENTION_TYPES = tuple(ATTENTION_CLASSES)


def attention_class(attention: str) -> type[Attention]:
    """The class an ``attention`` name maps to; ValueError naming the valid names otherwise."""
    if attention not in ATTENTION_CLASSES:
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION_TYPES)}")
    return ATTENTION_CLASSES[attention]


_FLOAT32_MAX = torch.finfo(torch.float32).max


def check_flags(**flags: object) -> None:
    """On/off model arguments must be booleans: a quoted ``"false"`` from a YAML file is a string, and
    truthy (``qkv_bias: "false"`` kept the biases)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")


def resolve_lam(attention: str, lam: float | None, learn_lam: str | None = None) -> float:
    """λ of an ``attention`` name: 0.0 without the NeuTRENO term, else ``lam`` (:data:`DEFAULT_LAM`
    if None). The one check of λ.

    ``learn_lam`` (``"layer"``/``"head"``, a learned λ) needs a NeuTRENO variant and λ > 0.

    Raises:
        ValueError: unknown name, λ given to a variant without the NeuTRENO term, a bad λ, or a learned
            λ that cannot be.
    """
    attention_class(attention)
    if learn_lam is not None and not attention.endswith("neutreno"):
        raise ValueError(f"learn_lam={learn_lam!r} needs a NeuTRENO attention, not {attention!r}")
    if learn_lam is not None and learn_lam not in LEARN_LAM:
        raise ValueError(f"learn_lam must be one of {', '.join(LEARN_LAM)}, got {learn_lam!r}")
    if not attention.endswith("neutreno"):
        if lam is not None:
            raise ValueError(
                f"lam={lam} was given but attention {attention!r} has no NeuTRENO term; "
                f"use one of: {', '.join(a for a in ATTENTION_TYPES if a.endswith('neutreno'))}"
            )
        return 0.0
    lam = DEFAULT_LAM if lam is None else lam
    # at most float32's largest: a λ beyond it passed here, then failed deep in the first forward
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not 0 <= lam <= _FLOAT32_MAX:
        raise ValueError(f"lam must be a finite number >= 0 (at most {_FLOAT32_MAX:.4g}), got {lam!r}")
    if learn_lam is not None and not lam > 0:
        raise ValueError(
            f"lam must be > 0 for a learned λ, which starts at lam (softplus never reaches 0), got {lam}"
        )
    return float(lam)


def without_spectral(attention: str) -> str:
    """The same variant with ordinary W_V, W_O: ``eigen_neg`` → ``softmax``, ``eigen_pos_neutreno`` →
    ``neutreno``; other names unchanged (for stacks that reparameterise only their first layers)."""
    if attention_class(attention) is not SpectralAttention:
        return attention
    return "neutreno" if attention.endswith("neutreno") else "softmax"


def layer_attentions(attention: str, depth: int, spectral_layers: int | None) -> list[str]:
    """Each layer's attention: ``attention`` in the first ``spectral_layers`` (all if None), and the
    same variant without the spectral reparameterisation after them."""
    if spectral_layers is None:
        return [attention] * depth
    if isinstance(spectral_layers, bool) or not isinstance(spectral_layers, int):
        raise ValueError(f"spectral_layers must be an integer, got {spectral_layers!r}")
    if not 0 <= spectral_layers <= depth or attention == without_spectral(attention):
        raise ValueError(
            f"spectral_layers needs an eigen_* attention and 0..{depth} layers, got {spectral_layers} "
            f"with {attention!r}"
        )
    return [attention] * spectral_layers + [without_spectral(attention)] * (depth - spectral_layers)


def set_lam_scale(model: nn.Module, scale: float) -> None:
    """Multiply every NeuTRENO λ in ``model`` by ``scale`` from the next forward on: a λ schedule (e.g.
    a warm-up from 0) that a trainer sets from the step, so a resumed run gets the same factors. Our
    attention layers and any module carrying a λ factor (a layer :func:`neutreno.hf.apply_neutreno`
    patched: it has ``lam_scale``) take it."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 <= scale <= _FLOAT32_MAX:
        raise ValueError(f"the λ scale must be a finite number >= 0, got {scale!r}")  # as λ itself
    for module in model.modules():
        if isinstance(module, Attention) or hasattr(module, "lam_scale"):
            module.lam_scale = float(scale)


def has_learned_lam(model: nn.Module) -> bool:
    """Whether any attention layer of ``model`` learns its λ (ours, or a Hugging Face layer patched with
    a learned λ)."""
    return any(isinstance(m, LearnedLam) for m in model.modules())


def lam_by_layer(model: nn.Module) -> list[float | list[float]]:
    """Each NeuTRENO attention layer's λ as applied now (schedule included): a number, or a list per
    head for a per-head learned λ, in module order (Hugging Face layers patched by
    :func:`neutreno.hf.apply_neutreno` too). A stack's first layer is listed too, though it adds no
    term (its V⁰ is its own V), so that entry i is layer i. For logging and ``analyze``; learned values
    are read in one device transfer."""
    lams: list[float | Tensor] = []
    for module in model.modules():
        setting = getattr(module, "neutreno", None)  # a layer neutreno.hf patched: λ, fixed or learned
        if not isinstance(module, Attention) and isinstance(getattr(setting, "lam", None), float):
            learned = module._modules.get(HF_LEARNED_LAM)
            lams.append((setting.lam if learned is None else learned()) * getattr(module, "lam_scale", 1.0))
        elif isinstance(module, Attention) and module.attention.endswith("neutreno"):
            lams.append(module.current_lam())
    learned = [lam.detach().float().reshape(-1) for lam in lams if isinstance(lam, Tensor)]
    values = iter(torch.cat(learned).tolist() if learned else [])
    return [
        lam if not isinstance(lam, Tensor) else next(values) if lam.ndim == 0 else [next(values) for _ in lam]
        for lam in lams
    ]


def _resolve_attention(attention: str, lam: float | None) -> tuple[str, float]:
    """Earlier releases' ``resolve_attention``: (score kind, λ); today :func:`resolve_lam` and the class."""
    kinds = {SymmetricAttention: "symmetric", KernelAttention: "kernel"}
    kind = kinds.get(attention_class(attention), "softmax")
    return kind, resolve_lam(attention, lam)


# Names this module had in earlier releases: they still import, with a DeprecationWarning.
__getattr__ = moved_names(
    __name__,
    {
        "resolve_attention": "neutreno.layers.attention:_resolve_attention",
        "allowed_keys": "neutreno.layers.functional:allowed_keys",
        "LM_DEFAULT_LAM": "neutreno.layers.neutreno:LM_DEFAULT_LAM",
    },
    instead={"resolve_attention": "neutreno.layers.resolve_lam and ATTENTION_CLASSES"},
)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, N, d) → (B, N, H·d); the fused kernel's output already has that memory layout."""
    B, H, N, d = x.shape
    return x.transpose(1, 2).reshape(B, N, H * d)


# Keys written before FeatScale and AttnScale became modules (their gains sat on the attention layer).
_RENAMED_KEYS = {
    "featscale_dc": "featscale.dc",
    "featscale_hc": "featscale.hc",
    "attnscale_omega": "attnscale.omega",
}


def upgrade_attention_keys(state_dict: dict, prefix: str = "") -> dict:
    """Rename, in place, an attention layer's keys of earlier releases (``<prefix>featscale_dc`` →
    ``<prefix>featscale.dc``, …); ``prefix`` "" renames them under every prefix. Returns the dict."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        head, dot, name = key.rpartition(".")
        if name in _RENAMED_KEYS:
            state_dict[head + dot + _RENAMED_KEYS[name]] = state_dict.pop(key)
    return state_dict


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

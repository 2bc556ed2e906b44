"""Attention as functions of per-head queries, keys and values (math.md §2): the softmax and kernel
products, their N×N weights for analysis, the masks, and AttnScale's rescaling. Every attention class
(:mod:`neutreno.layers.attention`) computes with these."""

from __future__ import annotations

import itertools
import json
import numbers
from collections.abc import Callable
from importlib import resources

import torch
import torch.nn.functional as F
from torch import Tensor

from neutreno.layers.dropout import dropout

ATTENTION_IMPLS = ("auto", "fused", "explicit")
PATHS_TABLE = "attention_paths.json"  # explicit/fused speed-ups per CPU profile (bench/attention_paths.py)
_EXPLICIT_MARGIN = 1.1  # the explicit product (N×N memory) only where it was measured clearly faster


def allowed_keys(
    key_padding_mask: Tensor | None, is_causal: bool, n: int, device: torch.device, batch: int | None = None
) -> Tensor | None:
    """Boolean mask of the keys each query may use, True where query i may look at key j.

    Args:
        key_padding_mask: (B, N) bool, True for real tokens, False for padding.
        is_causal: forbid keys after the query.
        batch: the queries' batch size, which the mask's B must equal (checked when given).
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
        _check_key_padding_mask(key_padding_mask, n, batch)
        mask = mask & key_padding_mask[:, None, None, :]
    return mask


def _check_key_padding_mask(key_padding_mask: Tensor, n: int, batch: int | None = None) -> None:
    """(B, n) bool; with ``batch``, B must be it (another batch broadcast: outputs of another shape)."""
    shape = tuple(key_padding_mask.shape)
    if (
        key_padding_mask.dtype != torch.bool
        or len(shape) != 2
        or shape[-1] != n
        or (batch is not None and shape[0] != batch)
    ):
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape ({'B' if batch is None else batch}, {n}), True "
            "for real tokens (Hugging Face's attention_mask.bool(); the inverse of nn.MultiheadAttention's "
            f"key_padding_mask), got {key_padding_mask.dtype} {shape}"
        )


def attention_mask(
    key_padding_mask: Tensor | None, is_causal: bool, n: int, device: torch.device, batch: int | None = None
) -> Tensor | None:
    """:func:`allowed_keys` for softmax scores, where each query may also attend to itself, so a
    padded query never has an empty row (that would give NaN, which leaks into the next layer
    through 0·NaN). Outputs at padded positions are unspecified."""
    mask = allowed_keys(key_padding_mask, is_causal, n, device, batch)
    if key_padding_mask is not None:
        mask = mask | torch.eye(n, dtype=torch.bool, device=device)
    return mask


def choose_softmax_impl(device: torch.device, dtype: torch.dtype, tokens: int, training: bool = True) -> str:
    """The faster exact softmax path, ``"fused"`` or ``"explicit"``, for this device, dtype, length and
    mode (training: forward + backward), from measurements: on a CPU, the explicit/fused speed-ups
    ``bench/attention_paths.py`` measured on CPUs of this one's profile (:func:`cpu_profile`), at the
    measured length nearest ``tokens`` (on a log scale); the explicit product where it was more than
    10% faster there. The fused kernel on CUDA, and wherever nothing was measured (another CPU
    profile, another dtype or mode). Both paths compute the same numbers (to rounding)."""
    if device.type != "cpu" or tokens < 1:
        return "fused"
    runs = MEASURED_PATHS.get(CPU_PROFILE, {}).get("cases", {}).get(case_key(dtype, training))
    if not runs:
        return "fused"
    # the nearest on a log scale (runs by length): the shorter of two neighbours up to their geometric
    # mean, in integers, so that a compiler tracing a symbolic length guards on it (min(key=log) broke
    # the graph)
    pairs = itertools.pairwise(runs)
    nearest = next(
        (low for low, high in pairs if tokens * tokens <= low["tokens"] * high["tokens"]), runs[-1]
    )
    return "explicit" if nearest["explicit_speedup"] > _EXPLICIT_MARGIN else "fused"


def case_key(dtype: torch.dtype, training: bool) -> str:
    """A measured case's key in the table, e.g. ``"bfloat16/train"`` (``bench/attention_paths.py``)."""
    return f"{str(dtype).removeprefix('torch.')}/{'train' if training else 'infer'}"


def measured_paths() -> dict:
    """The shipped table's profiles: {profile: {"measured_on": …, "cases": {"bfloat16/train": [runs]}}};
    empty (every choice fused) when the table cannot be read."""
    try:
        profiles = json.loads(resources.files("neutreno.layers").joinpath(PATHS_TABLE).read_text())[
            "profiles"
        ]
        for entry in profiles.values():  # each case's runs by length, as choose_softmax_impl reads them
            for runs in entry["cases"].values():
                runs.sort(key=lambda run: run["tokens"])
        return profiles
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


MATRIX_UNITS = ("amx_bf16", "avx512_bf16")  # the CPU flags that decide which attention path is faster


def cpu_flags() -> list[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def cpu_profile() -> str:
    """This CPU's matrix units, which decide which attention path is faster: ``"amx_bf16"`` (Intel AMX),
    ``"avx512_bf16"``, or ``"other"``."""
    flags = cpu_flags()
    return next((unit for unit in MATRIX_UNITS if unit in flags), "other")


# Read once, at import: module constants that torch.compile folds into the graph.
MEASURED_PATHS, CPU_PROFILE = measured_paths(), cpu_profile()


def _below_float32(q: Tensor) -> bool:
    """Whether attention weights from ``q`` would be computed below float32: a 16-bit q, or autocast on."""
    return torch.finfo(q.dtype).bits < 32 or torch.is_autocast_enabled(q.device.type)


def _weights_in_float32(
    weights_of: Callable, q: Tensor, k: Tensor, mask: Tensor | None, omega: Tensor | None
) -> Tensor:
    """``weights_of(q, k, mask, omega)`` in float32 at least (autocast off), returned in q's dtype. Rounded to
    bfloat16, a score of 40 moves by up to 0.125 and its weight by 13%: the explicit path's error grew
    with the scores (5.7e-2 of the output at scores near 32, the fused kernels' 2e-3, which keep them in
    float32), and float16 scores past 65,504 were inf, the outputs NaN."""
    with torch.autocast(q.device.type, enabled=False):
        q32, k32, omega = (
            t if t is None or torch.finfo(t.dtype).bits >= 32 else t.float() for t in (q, k, omega)
        )
        return weights_of(q32, k32, mask, omega).to(q.dtype)


def softmax_weights(
    q: Tensor, k: Tensor, mask: Tensor | None = None, attnscale_omega: Tensor | None = None
) -> Tensor:
    """Attention probabilities ``softmax(Q Kᵀ/√d)`` (B, H, N, N), with AttnScale if ω is given.

    Scores and softmax are computed in float32 (:func:`_weights_in_float32`), as the fused kernels
    compute them, and returned in q's dtype.

    Args:
        q, k: (B, H, N, d). mask: bool "may attend" mask from :func:`attention_mask`, or None.
        attnscale_omega: (H,) AttnScale ω (math.md §2).
    """
    if _below_float32(q):
        return _weights_in_float32(softmax_weights, q, k, mask, attnscale_omega)
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    return probs if attnscale_omega is None else attnscale_weights(probs, mask, attnscale_omega)


def kernel_weights(
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    attnscale_omega: Tensor | None = None,
) -> Tensor:
    """The N×N weights that :func:`kernel_attention` applies implicitly, ``φ(q_i)·φ(k_j)`` over
    the allowed keys, row-normalised (B, H, N, N). O(N²): for analysis, not for the forward pass."""
    mask = allowed_keys(key_padding_mask, is_causal, q.shape[-2], q.device, q.shape[0])
    return masked_kernel_weights(q, k, mask, attnscale_omega)


def masked_kernel_weights(
    q: Tensor, k: Tensor, mask: Tensor | None, attnscale_omega: Tensor | None = None
) -> Tensor:
    """``φ(q_i)·φ(k_j)`` over the keys ``mask`` allows (bool, broadcastable to (B, H, Nq, Nk)),
    row-normalised: (B, H, Nq, Nk), q (B, H, Nq, d), k (B, H, Nk, d); computed in float32 as
    :func:`kernel_attention` is."""
    if _below_float32(q):
        return _weights_in_float32(masked_kernel_weights, q, k, mask, attnscale_omega)
    weights = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-2, -1)
    if mask is not None:
        weights = weights * mask
    weights = weights / _nonzero(weights.sum(-1, keepdim=True))
    return weights if attnscale_omega is None else attnscale_weights(weights, mask, attnscale_omega)


def _check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, is_causal: object, dropout_p: object, omega: Tensor | None
) -> None:
    """The functional attentions' arguments, named where they are wrong: a truthy "false" was a causal
    mask, a dropout of −1 or NaN no dropout, and other shapes or integer tensors internal errors."""
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be True or False, got {is_causal!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p <= 1:
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.ndim != 4 or not t.is_floating_point():
            shown = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating-point tensor (B, H, N, d), got {shown}")
    if omega is not None and tuple(omega.shape) != (q.shape[1],):
        raise ValueError(
            f"attnscale_omega must have one value per head, shape ({q.shape[1]},), got {tuple(omega.shape)}"
        )


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
            probabilities), or ``"auto"`` (the faster one for this device, dtype, length and mode,
            :func:`choose_softmax_impl`).
    Returns:
        (B, H, N, d).
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; valid: {', '.join(ATTENTION_IMPLS)}")
    _check_attention_inputs(q, k, v, is_causal, dropout_p, attnscale_omega)
    if impl == "auto":
        impl = choose_softmax_impl(q.device, q.dtype, q.shape[-2], training=q.requires_grad)
    # AttnScale acts on the probabilities before dropout, so with dropout it needs them explicitly.
    explicit = impl == "explicit" or (attnscale_omega is not None and dropout_p > 0)
    # The fused kernel takes a causal flag; a mask tensor is needed only for padding or explicit use.
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, q.shape[-2], q.shape[0])
    needs_mask = key_padding_mask is not None or (is_causal and (explicit or attnscale_omega is not None))
    mask = attention_mask(key_padding_mask, is_causal, q.shape[-2], q.device) if needs_mask else None
    if explicit:
        probs = softmax_weights(q, k, mask, attnscale_omega)
        if dropout_p > 0:
            probs = dropout(probs, dropout_p)
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
        out = attnscale_output(out, v, mask, attnscale_omega)
    return out


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    attnscale_omega: Tensor | None = None,
) -> Tensor:
    """Linear-cost kernel attention ``U_i = Σ_j κ(q_i,k_j) v_j / Σ_j κ(q_i,k_j)`` with
    ``κ(q, k) = φ(q)·φ(k)``, ``φ = elu + 1`` (math.md §2, paper App. F.2).

    Computed as ``φ(Q) (φ(K)ᵀ V)`` in O(N d²) (causal: prefix sums), never forming the N×N matrix.
    Half-precision inputs are computed in float32 (autocast off) and the result cast back: the
    normaliser grows as d·N and passed float16's 65,504 from about N = 600 at d = 64, which made the
    output rows exactly 0.

    Args:
        q, k, v: (B, H, N, d).
        key_padding_mask: (B, N) bool, True for real tokens; padded keys get zero weight.
        is_causal: each query sees only keys at or before its position.
        attnscale_omega: (H,) AttnScale ω (the kernel weights are row-stochastic too).
    Returns:
        (B, H, N, d).
    """
    _check_attention_inputs(q, k, v, is_causal, 0.0, attnscale_omega)
    out_dtype = v.dtype
    autocast = q.device.type != "meta" and torch.is_autocast_enabled(q.device.type)  # (meta has none)
    if torch.finfo(q.dtype).bits < 32 or autocast:
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = (t.float() if torch.finfo(t.dtype).bits < 32 else t for t in (q, k, v))
            out = kernel_attention(
                q,
                k,
                v,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                attnscale_omega=attnscale_omega,
            )
        return out.to(out_dtype)
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, q.shape[-2], q.shape[0])
        phi_k = phi_k * key_padding_mask[:, None, :, None].to(phi_k.dtype)
    if is_causal:
        kv = torch.einsum("bhnd,bhne->bhnde", phi_k, v).cumsum(dim=2)
        numerator = torch.einsum("bhnd,bhnde->bhne", phi_q, kv)
        normaliser = (phi_q * phi_k.cumsum(dim=2)).sum(-1, keepdim=True)
    else:
        numerator = phi_q @ (phi_k.transpose(-2, -1) @ v)
        normaliser = phi_q @ phi_k.sum(dim=2).unsqueeze(-1)
    out = numerator / _nonzero(normaliser)
    if attnscale_omega is not None:
        mask = allowed_keys(key_padding_mask, is_causal, q.shape[-2], q.device)
        out = attnscale_output(out, v, mask, attnscale_omega)
    return out


def _nonzero(normaliser: Tensor) -> Tensor:
    """A kernel's row sums with 1 where a row is 0 (a padded query that sees no key: its numerator is
    0 too). Only there: a floor (1e-6) shrank every row whose kernel sum was below it towards 0, where
    the normalised weights do not depend on the kernel's scale."""
    return torch.where(normaliser > 0, normaliser, 1.0)


def _uniform_weights(mask: Tensor | None, like: Tensor) -> Tensor:
    """Uniform attention over the allowed keys, (…, Nq, Nk), or the scalar 1/Nk without a mask (then
    ``like`` is the weights (…, Nq, Nk): 1/Nq gave rows not summing to 1 where Nq ≠ Nk); the dtype
    and device are ``like``'s."""
    if mask is None:
        return torch.tensor(1.0 / max(like.shape[-1], 1), dtype=like.dtype, device=like.device)
    allowed = mask.to(like.dtype)
    return allowed / allowed.sum(-1, keepdim=True).clamp_min(1)


def attnscale_weights(weights: Tensor, mask: Tensor | None, omega: Tensor) -> Tensor:
    """AttnScale on attention weights (math.md §2): A' = U + (1 + ω)(A − U), U uniform over allowed keys."""
    uniform = _uniform_weights(mask, weights)
    return uniform + (1 + omega.view(-1, 1, 1)) * (weights - uniform)


def attnscale_output(out: Tensor, v: Tensor, mask: Tensor | None, omega: Tensor) -> Tensor:
    """AttnScale applied after ``A V``: A' V = U V + (1 + ω)(A V − U V), exact because A' is
    linear in A (math.md §2). ``U V`` is the mean of the allowed values."""
    uniform_out = v.mean(dim=-2, keepdim=True) if mask is None else _uniform_weights(mask, v) @ v
    return uniform_out + (1 + omega.view(-1, 1, 1)) * (out - uniform_out)

"""Over-smoothing measurements: pure functions on tensors (math.md §3)."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor


def token_cosine_similarity(x: Tensor, mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """Mean cosine similarity between distinct tokens, (1/(N(N−1))) Σ_{i≠j} cos(x_i, x_j)
    (math.md §3; paper App. E.3, Fig. 1). All tokens count, CLS included; padding does not.

    Computed in O(N·D) from ‖Σ_i x̂_i‖² = Σ_{i,j} cos(x_i, x_j) with x̂ the unit-normalised tokens,
    minus the diagonal (1 for each nonzero token). A zero token has cosine 0 with every token.

    Args:
        x: tokens (..., N, D).
        mask: (..., N) bool, True for real tokens; each sequence needs at least two.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``x.shape[:-2]``).
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    x, _, n = _real_tokens(x, mask)
    if (n < 2).any():
        raise ValueError("token_cosine_similarity needs at least two (unmasked) tokens per sequence")
    x, norms = _rows_and_norms(x)  # padded rows are zero, so they add nothing
    nonzero = norms != 0  # a NaN norm stays NaN below; the where keeps 1/0 out of the gradient
    inverse = nonzero / torch.where(nonzero, norms, 1.0)
    all_pairs = (x * inverse[..., None]).sum(-2).square().sum(-1)  # ‖Σ_i x_i / ‖x_i‖‖²
    diagonal = nonzero.sum(-1)
    # at most 1, as a mean of cosines is: identical tokens read 1.0000002 (a plot of log(1 − cos) got NaN)
    return _reduce(((all_pairs - diagonal) / (n * (n - 1))).clamp(max=1.0), reduction)


def _rows_and_norms(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows (..., N, D) in x's directions and their norms (..., N), exact to float32 rounding: see
    :func:`_with_exact_norms` (row norms in [1e-10, 1e18] are; the squares that underflow weigh below
    1e-15 of the norm)."""
    return _with_exact_norms(x, (-1,), 1e-10, 1e18)


def _with_exact_norms(x: Tensor, dims: tuple[int, ...], low: float, high: float) -> tuple[Tensor, Tensor]:
    """x and its norms over ``dims``, or, unless every nonzero norm lies in [low, high], x divided over
    ``dims`` by its largest |entry| and those norms. A float32 norm overflows to inf above ~1.8e19, and the
    squares of entries below ~1e-19 underflow, which turned cosines and ratios of norms into 0
    (``normalize``'s eps floor did the same below 1e-12); both are scale-free, so the division changes
    nothing else. Within the range (most calls) it costs one pass."""
    norms = torch.linalg.vector_norm(x, dim=dims)
    zero = norms == 0  # all zeros, or squares that all underflowed
    in_range = ((norms >= low) & (norms <= high)) | zero
    if not bool(in_range.all()) or (zero.any() and x[zero].any()):
        scale = x.abs().amax(dims, keepdim=True)
        x = x / torch.where(scale > 0, scale, 1.0)
        norms = torch.linalg.vector_norm(x, dim=dims)
    return x, norms


def _row_cosines(a: Tensor, b: Tensor) -> Tensor:
    """cos(a_i, b_i) of matching rows of a, b (..., N, D): (..., N); 0 where either row is zero, NaN
    where either holds a NaN. Scale-safe for any finite float32 rows (see :func:`_rows_and_norms`)."""
    (a, norm_a), (b, norm_b) = _rows_and_norms(a), _rows_and_norms(b)
    norms = norm_a * norm_b  # NaN where either row holds a NaN, even if the other is zero
    # a zero row's dot product is 0; dividing it by 1 keeps 0/0 out of the values and the gradient
    return torch.linalg.vecdot(a, b) / torch.where(norms == 0, 1.0, norms)


def _unit_rows(x: Tensor) -> Tensor:
    """x (..., D) with each row scaled to norm 1, zero rows left zero; scale-safe (``normalize`` squared
    entries past 1.8e19 to inf and floored norms below 1e-12, turning cosines into 0)."""
    x, norms = _rows_and_norms(x)
    return x / torch.where(norms == 0, 1.0, norms)[..., None]


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")


def _reduce(per_sequence: Tensor, reduction: str) -> Tensor:
    return (per_sequence.mean() if reduction == "mean" else per_sequence).float()


def _working_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 where any input is (its small residuals would floor at float32's ~1e-7 of the norm, and
    values past 3.4e38 become inf), otherwise float32 (half precision is upcast). The metrics return
    float32 either way."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_mask(mask: Tensor, expected: tuple[int, ...], name: str) -> Tensor:
    """Validated bool mask; every sequence must keep at least one token. A 0/1 mask of another dtype
    (Hugging Face's ``attention_mask``) is taken as bool; any other value is refused: an additive mask
    (0 keep, −inf or −1e9 pad) would otherwise become its inverse."""
    if tuple(mask.shape) != tuple(expected):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match {name} {tuple(expected)}")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                "mask must be bool (True for real tokens) or 0/1 like Hugging Face's attention_mask; "
                "got other values (an additive mask? pass mask == 0 for it)"
            )
        mask = mask.bool()
    if not mask.any(-1).all():
        raise ValueError("every sequence needs at least one unmasked token")
    return mask


def _real_tokens(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Tokens (..., N, D) in the working dtype with padded rows zeroed, the bool mask and the real-token
    count (...)."""
    if x.ndim < 2 or not x.shape[-2] or not x.shape[-1]:
        raise ValueError(f"need tokens (..., N, D) with N, D ≥ 1, got shape {tuple(x.shape)}")
    x = x.to(_working_dtype(x))
    if mask is None:
        return x, None, torch.full(x.shape[:-2], float(x.shape[-2]), device=x.device)
    mask = _check_mask(mask, x.shape[:-1], "tokens")
    # where, not multiply: junk in padded rows may be inf/nan
    return torch.where(mask[..., None], x, 0.0), mask, mask.sum(-1).float()


def _scaled_sequences(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., N, D), or x divided per sequence by its largest |entry|, and its Frobenius norms (...), as
    :func:`_with_exact_norms` gives them: sequence norms in [1e-2, 1e15] are taken as they are (no square
    overflows, and the parts of a residual down to 1e-15 of the norm stay above float32's underflow)."""
    return _with_exact_norms(x, (-2, -1), 1e-2, 1e15)


def _residual(x: Tensor, mask: Tensor | None, n: Tensor) -> tuple[Tensor, Tensor]:
    """res(X) = X − 1 x̄ᵀ on real rows (zero on padded ones) and the token mean x̄ (..., D)."""
    mean = x.sum(-2) / n[..., None]
    res = x - mean[..., None, :]
    if mask is not None:
        res = torch.where(mask[..., None], res, 0.0)
    return res, mean


def _minus_a_real_token(values: Tensor, mask: Tensor | None) -> Tensor:
    """values (..., H, N, d) minus each sequence and head's first real token. The attention metrics are
    unchanged by a vector taken from every value (A's rows sum to 1; J sums differences), and taking a
    token rather than the mean makes equal tokens exactly 0: a float32 mean of N equal rows is not that
    row, and what was left gave a gradient of rounding noise with a direction (cosine ±1) and J < 0."""
    if mask is None:
        return values - values[..., :1, :]
    first = mask.int().argmax(-1)[..., None, None, None]  # (..., 1, 1, 1)
    return values - values.gather(-2, first.expand(*values.shape[:-2], 1, values.shape[-1]))


def rank_residual(
    x: Tensor, mask: Tensor | None = None, norm: str = "fro", reduction: str = "mean"
) -> Tensor:
    """Rank-collapse residual ‖res(X)‖ / ‖X‖ with res(X) = X − 1 x̄ᵀ (math.md §3 "Rank-collapse residual";
    Dong et al. 2021). x̄ is the mean over real tokens; padded tokens are treated as absent rows.

    ``norm="fro"``: Frobenius norms. ``norm="l1_inf"``: Dong et al.'s ‖M‖_{1,∞} = √(‖M‖₁ ‖M‖_∞) with
    ‖M‖₁ the largest column (feature) abs-sum and ‖M‖_∞ the largest row (token) abs-sum.
    0 for a rank-one X = 1 xᵀ; NaN for X = 0.

    Args:
        x: tokens (..., N, D).
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
        norm: ``"fro"`` or ``"l1_inf"``.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``x.shape[:-2]``).
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    if norm not in ("fro", "l1_inf"):
        raise ValueError(f"norm must be 'fro' or 'l1_inf', got {norm!r}")
    x, mask, n = _real_tokens(x, mask)
    x, x_norm = _scaled_sequences(x)
    res, _ = _residual(x, mask, n)
    if norm == "fro":
        ratio = torch.linalg.matrix_norm(res) / x_norm
    else:

        def l1_inf_squared(m: Tensor) -> Tensor:
            return m.abs().sum(-2).amax(-1) * m.abs().sum(-1).amax(-1)

        ratio = (l1_inf_squared(res) / l1_inf_squared(x)).sqrt()
    return _reduce(ratio, reduction)


def high_frequency_ratio(x: Tensor, mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """High- over low-frequency energy ‖res(X)‖_F / ‖1 x̄ᵀ‖_F (math.md §3 "Frequency split"; FeatScale,
    Dovonon et al.): the DC part 1 x̄ᵀ against the rest. Padded tokens are absent (x̄ and 1 count
    real tokens only). 0 when all tokens are equal; inf when x̄ = 0.

    Args:
        x: tokens (..., N, D).
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``x.shape[:-2]``).
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    x, mask, n = _real_tokens(x, mask)
    res, mean = _residual(_scaled_sequences(x)[0], mask, n)
    dc_norm = n.sqrt() * torch.linalg.vector_norm(mean, dim=-1)
    return _reduce(torch.linalg.matrix_norm(res) / dc_norm, reduction)


def effective_rank(x: Tensor, mask: Tensor | None = None, reduction: str = "mean") -> Tensor:
    """Effective rank exp(−Σ_i p_i log p_i), p_i = σ_i / Σ_j σ_j over the singular values of X
    (math.md §3 "Effective rank"; Roy & Vetterli 2007). No centring; 0·log 0 = 0. Between 1 (rank one)
    and min(N, D); N for orthonormal tokens. Padded rows are zeroed, which only adds zero singular
    values, so the result is that of the real tokens alone. NaN for X = 0. Differentiable: singular
    values at the eigensolver's rounding floor (σ² ≤ m·ε·σ²_max) count as 0 with gradient 0, so padding
    adds nothing to the gradient either, and a rank-deficient X gets the gradient of its nonzero
    singular values (along a zero one the derivative is infinite: −log p at p = 0).

    Args:
        x: tokens (..., N, D).
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``x.shape[:-2]``).
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    gram, broken = _gram_matrices(x, mask)
    return _reduce(_rank_of(batched_eigvalsh(gram), broken), reduction)


def effective_ranks(layers: Iterable[Tensor], mask: Tensor | None = None) -> list[Tensor]:
    """``effective_rank(x, mask, reduction="none")`` of each x in ``layers`` (a model's hidden states, say).
    On a CPU, the eigenvalue problems of several layers are solved as one batch (up to 32 MiB of Gram
    matrices): each matrix is solved alone, so the values are those of separate calls bit for bit, but
    the solver threads get the work once, not once a layer (on 50 CIFAR images through a 12-layer ViT,
    ~25% less time). Elsewhere (CUDA's solver picks its algorithm by the batch size), or for layers
    unlike each other, one layer at a time.

    Args:
        layers: tensors (..., N, D), each with the shape ``mask`` describes.
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
    Returns:
        One float32 tensor (...) per layer.
    """
    layers = list(layers)
    if not layers or any(x.ndim < 2 for x in layers):
        raise ValueError(f"need one or more tensors (..., N, D), got {[tuple(x.shape) for x in layers]}")
    if len({(x.shape, x.device, x.requires_grad) for x in layers}) != 1 or layers[0].device.type != "cpu":
        return [effective_rank(x, mask, "none") for x in layers]
    *batch, n, d = layers[0].shape
    per_group = max(1, _GRAM_BYTES // (math.prod(batch) * min(n, d) ** 2 * 8 or 1))
    ranks = []
    for start in range(0, len(layers), per_group):
        group = layers[start : start + per_group]
        solved, broken = None, []
        for i, x in enumerate(group):
            gram, nan = _gram_matrices(x, mask)
            if solved is None:  # the group's matrices in one tensor, filled as they come (no second copy)
                solved = gram.new_empty(len(group), *gram.shape)
            solved[i] = gram
            broken.append(nan)
        ranks += [_rank_of(values, nan) for values, nan in zip(batched_eigvalsh(solved), broken, strict=True)]
    return ranks


_GRAM_BYTES = 32 << 20  # effective_ranks' Gram matrices solved at once, at most (one layer's if larger)


def _rank_of(eigenvalues: Tensor, broken: Tensor) -> Tensor:
    """exp(entropy of σ / Σσ), σ = √ of a Gram matrix's eigenvalues (..., m); NaN where ``broken``.
    Eigenvalues at the solver's rounding floor are 0, and the where()s keep √ and log off 0 so that
    their gradient is 0, not inf · 0 = NaN."""
    floor = eigenvalues.amax(-1, keepdim=True) * (eigenvalues.shape[-1] * torch.finfo(eigenvalues.dtype).eps)
    positive = eigenvalues > floor
    sigma = torch.where(positive, eigenvalues.where(positive, 1.0).sqrt(), 0.0)
    p = sigma / sigma.sum(-1, keepdim=True)
    entropy = torch.where(positive, -p * p.where(positive, 1.0).log(), 0.0).sum(-1)
    return entropy.exp().masked_fill(broken | ~positive.any(-1), torch.nan).float()  # X = 0: NaN


def _gram_matrices(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """The float64 Gram matrices of the real tokens (..., m, m), m = min(N, D), whose eigenvalues are
    the σ² of X (as exact as an SVD to float32 output precision, and several times faster for these
    batched small matrices), and which sequences are not finite (...): their matrices are those of X = 0."""
    x, _, _ = _real_tokens(x, mask)
    if x.dtype == torch.float64:  # float64's squares leave its range past ~1e±154 (float32 entries' cannot)
        # by a constant (detached): the rank is scale-free, and a non-finite sequence's scale gets no gradient
        scale = x.detach().abs().amax((-2, -1), keepdim=True)
        x = x / torch.where(scale.isfinite() & (scale > 0), scale, 1.0)
    x = x.double()

    def gram_of(x: Tensor) -> Tensor:
        return x @ x.transpose(-2, -1) if x.shape[-2] <= x.shape[-1] else x.transpose(-2, -1) @ x

    gram = gram_of(x)
    # eigvalsh fails to converge on a NaN or inf: those sequences are NaN, as in the other metrics. The
    # trace, ‖X‖_F², is non-finite exactly when an entry is (float32 entries cannot overflow it in float64)
    broken = ~torch.isfinite(gram.diagonal(dim1=-2, dim2=-1).sum(-1))
    if broken.any():  # rare: X = 0 there instead, so that no NaN reaches the other sequences' gradients
        gram = gram_of(torch.where(broken[..., None, None], 0.0, x))
    return gram, broken


def _one_thread() -> None:
    """A solver thread's setup: ATen sets a thread's OpenMP and MKL thread counts from the process's
    when the thread first runs parallel work, so that comes first and the count set after stays."""
    torch.get_num_threads()
    torch.set_num_threads(1)


_solvers_lock = threading.Lock()
_solvers: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, thread count, pool)


def _solver_threads(count: int) -> ThreadPoolExecutor:
    """At least ``count`` threads, each running torch on one thread of its own: one pool per process (a
    forked child has its parent's pool object but none of its threads), replaced by a larger one when
    more threads are asked for. The caller holds ``_solvers_lock`` until it has submitted its work: one
    pool is built at a time (its threads' setup changes the process's thread count), and a pool is not
    shut down while another caller is still handing it work."""
    global _solvers
    if _solvers is not None and _solvers[0] == os.getpid() and _solvers[1] >= count:
        return _solvers[2]
    if _solvers is not None and _solvers[0] == os.getpid():
        _solvers[2].shutdown(wait=False)  # its idle threads end once the work given to it is done
    own = torch.get_num_threads()
    pool = ThreadPoolExecutor(count, thread_name_prefix="neutreno-eigvalsh", initializer=_one_thread)
    started = threading.Barrier(count)
    for job in [pool.submit(started.wait) for _ in range(count)]:
        job.result()
    # torch.set_num_threads also sets the count new threads start with, and clears oneDNN's cache:
    # restored once here, not around every call
    torch.set_num_threads(own)
    _solvers = (os.getpid(), count, pool)
    return pool


_CHUNK_BYTES = 4 << 20


def batched_eigvalsh(matrices: Tensor, threads: int | None = None) -> Tensor:
    """``torch.linalg.eigvalsh`` of a batch of symmetric matrices (..., n, n), the batch split over
    ``threads`` (default: torch's intra-op thread count) solver threads, each on one thread of its own.

    On a CPU, ATen hands LAPACK one matrix after another, and these small solves are most of
    :func:`effective_rank`'s time: split over two threads they take about half as long. MKL's own
    threads barely help below n ≈ 500 and change the rounding with their count; solved on one thread
    each, the values depend neither on the split nor on ``torch.get_num_threads()``.

    Returns:
        Eigenvalues (..., n), ascending, as ``eigvalsh``.
    """
    if matrices.device.type != "cpu" or (matrices.requires_grad and torch.is_grad_enabled()):
        return torch.linalg.eigvalsh(matrices)  # a device's own batched solver; a graph to record
    threads = max(1, torch.get_num_threads() if threads is None else threads)
    flat = matrices.flatten(0, -3) if matrices.ndim > 2 else matrices[None]
    # one part per thread, of at least two matrices (a hand-off costs ~50 µs, a 65 × 65 solve ~200 µs),
    # solved in chunks of ≤ 4 MiB: eigvalsh copies what it solves, and a thread's heap keeps the most it held
    parts = flat.tensor_split(max(1, min(threads, len(flat) // 2)))
    per_chunk = max(1, _CHUNK_BYTES // max(1, flat[0].nbytes if len(flat) else 0))

    def solve(part: Tensor) -> Tensor:
        return torch.cat([torch.linalg.eigvalsh(chunk) for chunk in part.split(per_chunk)])

    with _solvers_lock:
        solvers = _solver_threads(len(parts))
        jobs = [solvers.submit(solve, part) for part in parts]
    return torch.cat([job.result() for job in jobs]).reshape(matrices.shape[:-1])


def all_finite(x: Tensor) -> bool:
    """Whether every entry of x is finite (no NaN, no ±inf), in one min/max pass: NaN propagates to
    both and an infinity is one of them (``isfinite(x).all()`` costs ~20× more on a CPU)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def nonlocal_energy(
    attn: Tensor, values: Tensor, mask: Tensor | None = None, reduction: str = "mean"
) -> Tensor:
    """Nonlocal energy J = (1/(2N)) Σ_{i,j} A_ij ‖v_i − v_j‖², mean over heads (math.md §3 "Nonlocal
    energy"; paper App. E.2, Fig. 3): the attention as the kernel, the values as u. ≥ 0 for weights
    ≥ 0 (rounding below 0 is clipped there); a head with negative weights (AttnScale's) may give J < 0.

    Uses ‖v_i − v_j‖² = ‖v_i‖² + ‖v_j‖² − 2 v_i·v_j, so memory is O(N² + N·d) (no (N, N, d) tensor);
    the values are first centred on their token mean, which leaves every difference unchanged and
    keeps the cancellation small, and the diagonal (‖v_i − v_i‖² = 0) is left out of the sum: where A
    is nearly one-hot on it, its three large terms cancelled to rounding noise 10³ times J. With a mask,
    i and j range over real tokens only and N counts them;
    the attention is used as given (not renormalised over the real keys).

    Args:
        attn: attention weights (..., H, N, N), rows = queries.
        values: (..., H, N, d).
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``attn.shape[:-3]``).
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    if attn.ndim < 3 or attn.shape[-1] != attn.shape[-2] or values.shape[:-1] != attn.shape[:-1]:
        raise ValueError(
            f"need attn (..., H, N, N) and values (..., H, N, d), got "
            f"{tuple(attn.shape)}, {tuple(values.shape)}"
        )
    if mask is not None:
        mask = _check_mask(mask, (*attn.shape[:-3], attn.shape[-1]), "attention tokens")
    dtype = _working_dtype(attn, values)
    per_sequence = _nonlocal_energy(attn, values, mask, dtype)
    # ‖v‖² past float32's 3.4e38 made inf − inf = NaN where J itself is inf (or, with large norms
    # cancelling, finite): float64 holds it, and its cast gives inf only where J is past float32
    # (non-finite inputs stay non-finite in float64; a padded entry's junk is never read, so it must
    # not keep the fallback from the real tokens)
    if dtype != torch.float64 and not bool(per_sequence.isfinite().all()):
        per_sequence = _nonlocal_energy(attn, values, mask, torch.float64)
    return _reduce(per_sequence, reduction)


def _nonlocal_energy(attn: Tensor, values: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """:func:`nonlocal_energy` per sequence (shape ``attn.shape[:-3]``), computed in ``dtype``."""
    values = values.to(dtype)
    if mask is None:
        n = torch.full(attn.shape[:-3], float(attn.shape[-1]), device=attn.device, dtype=dtype)
        attn = attn.to(dtype, copy=True)  # its diagonal is zeroed below
    else:
        n = mask.sum(-1).to(dtype)
        heads_mask = mask[..., None, :]  # (..., 1, N)
        attn = torch.where(heads_mask[..., :, None] & heads_mask[..., None, :], attn.to(dtype), 0.0)
        values = torch.where(heads_mask[..., None], values, 0.0)
    attn.diagonal(dim1=-2, dim2=-1).mul_(0)  # times 0, not set to 0: a NaN weight stays a NaN J
    # padded rows/columns of attn are zero now, so the padded (shifted) values never count
    values = _minus_a_real_token(values, mask)
    sq_norms = values.square().sum(-1)  # (..., H, N)
    twice_j = (
        (attn.sum(-1) * sq_norms).sum(-1)
        + (attn.sum(-2) * sq_norms).sum(-1)
        - 2 * (values * (attn @ values)).sum((-2, -1))
    )
    # With weights ≥ 0, J is a sum of squares: rounding below 0 (~1e-21 on near-equal tokens) would break
    # a log scale. A head with a negative weight (AttnScale's A' = 1/N + (1 + ω)(A − 1/N)) may have J < 0
    # itself, which is kept: clipped, such heads counted 0 in the mean (0.358 for 0.318).
    j = twice_j / (2 * n[..., None])
    nonnegative = attn.flatten(-2).amin(-1) >= 0  # (..., H)
    return torch.where(nonnegative, j.clamp_min(0), j).mean(-1)


def gradient_alignment(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    reduction: str = "mean",
    attn: Tensor | None = None,
) -> Tensor:
    """Mean over real tokens and heads of cos(g_i^sym, g_i^asym) (math.md §3 "Gradient alignment";
    paper App. E.1, Table 4), with g^asym_i = v_i − (A V)_i, A = softmax(Q Kᵀ/√d) and
    g^sym_i = v_i − (A_sym V)_i, A_sym = softmax(K Kᵀ/√d). Padded keys get zero attention and padded
    queries are left out of the mean. A zero gradient has cosine 0 (so constant values give 0).

    Args:
        q, k, v: per-head queries, keys, values (..., H, N, d).
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``q.shape[:-3]``).
        attn: A itself (..., H, N, N), where the caller has it (a probe's maps, when they are
            softmax(Q Kᵀ/√d) over the real keys): A V is then one product instead of a second
            attention pass (~a third of this function's time at N 65).
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    if attn is not None and attn.shape != (*q.shape[:-1], q.shape[-2]):
        raise ValueError(f"attn must be (..., H, N, N) for q {tuple(q.shape)}, got {tuple(attn.shape)}")
    if q.ndim < 3 or q.shape != k.shape or v.shape[:-1] != k.shape[:-1] or not q.shape[-1]:
        raise ValueError(
            f"need q, k (..., H, N, d) of one shape, d ≥ 1, and v (..., H, N, d_v), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if mask is not None:
        mask = _check_mask(mask, (*q.shape[:-3], q.shape[-2]), "tokens")
    dtype = _working_dtype(q, k, v)
    per_sequence = _gradient_alignment(q, k, v, mask, attn, dtype)
    # Q Kᵀ past float32's range (inf scores, NaN weights) from finite inputs: float64 holds it
    if dtype != torch.float64 and not bool(per_sequence.isfinite().all()):
        per_sequence = _gradient_alignment(q, k, v, mask, attn, torch.float64)
    return _reduce(per_sequence, reduction)


def _gradient_alignment(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, attn: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """:func:`gradient_alignment` per sequence (shape ``q.shape[:-3]``), computed in ``dtype``."""
    # g_i = Σ_{j≠i} A_ij (v_i − v_j), not v − A V: where A is nearly one-hot on its diagonal (K Kᵀ often
    # is) g is ~1e-6 of v, below the rounding of v − A V (2e-3 off on MiniLM). And g_i up to a positive
    # factor of its own: a cosine does not see it, so the weights are those of the other tokens,
    # renormalised, w_ij = A_ij / Σ_{l≠i} A_il = softmax over j ≠ i. A_ij itself underflows to 0 in
    # float32 where the diagonal's score leads by ~90 (keys of norm 40 at d 64): g was 0, cosine 0.
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if mask is None:
        n = torch.full(q.shape[:-3], float(q.shape[-2]), device=q.device)
    else:
        n = mask.sum(-1).float()
        v = torch.where(mask[..., None, :, None], v, 0.0)
    alone = (n == 1)[..., None, None, None]  # one real token: no other to weigh, g = 0 (cosine 0)
    # constant values give exactly g = 0 (cosine 0), not rounding noise with a direction
    # (contiguous: a probe's v is a permuted view of one projection, and the products below run in place)
    v = _minus_a_real_token(v, mask).contiguous()

    def gradient(weights: Tensor) -> Tensor:  # rows of weights over j ≠ i (read, not changed)
        g = weights.sum(-1, keepdim=True) * v
        matrices = (v.shape[:-2].numel(), *v.shape[-2:])  # view, not reshape: a copy would lose the product
        g.view(matrices).baddbmm_(weights.flatten(0, -3), v.view(matrices), alpha=-1)  # g −= weights @ v
        return g

    def weights_of(queries: Tensor) -> Tensor:
        scores = (queries @ k.transpose(-2, -1)).mul_(k.shape[-1] ** -0.5)
        if mask is not None:  # padded keys get no attention
            scores.masked_fill_(~mask[..., None, None, :], -torch.inf)
        scores.diagonal(dim1=-2, dim2=-1).fill_(-torch.inf)  # (a NaN in q or k still makes rows NaN)
        weights = scores.softmax(-1)
        return weights.masked_fill(alone, 0.0) if bool(alone.any()) else weights  # (a row of −inf: NaN)

    def weights_given(maps: Tensor) -> Tensor | None:
        """The given maps' weights over j ≠ i, or None where a real row's are too small to renormalise
        (they underflowed too: computed from q then)."""
        weights = maps.to(dtype, copy=True)
        weights.diagonal(dim1=-2, dim2=-1).mul_(0)  # times 0, not set to 0: a NaN stays
        total = weights.sum(-1, keepdim=True)
        real_rows = ~alone if mask is None else mask[..., None, :, None] & ~alone
        if bool((real_rows & (total < _RENORMALISABLE[dtype])).any()):
            return None
        return weights / torch.where(total > 0, total, 1.0)

    symmetric = gradient(weights_of(k))
    given = None if attn is None else weights_given(attn)
    asymmetric = gradient(weights_of(q) if given is None else given)
    cos = _row_cosines(symmetric, asymmetric)  # (..., H, N)
    if mask is None:
        return cos.mean((-2, -1))
    return torch.where(mask[..., None, :], cos, 0.0).sum((-2, -1)) / (n * cos.shape[-2])


# below it, a given map's off-diagonal weights may have underflowed or lost their precision (subnormal)
_RENORMALISABLE = {torch.float32: 1e-30, torch.float64: 1e-290}


HEAD_REDUNDANCY_FORMS = ("mean", "matched", "best")


def head_redundancy(
    attn_l: Tensor, attn_next: Tensor, reduction: str = "mean", form: str = "mean", mask: Tensor | None = None
) -> Tensor:
    """Cosine similarity of the N×N attention maps of layers ℓ and ℓ+1 (math.md §3 "Head redundancy";
    paper App. G.2, Fig. 5), flattened. Head order means nothing across layers, so the primary form
    compares what the layers do as a whole; a zero map has cosine 0. With a mask only the real
    query × real key entries count: a padded query's row is whatever the model computed for it.

    Args:
        attn_l, attn_next: attention weights (..., H, N, N), same shape.
        reduction: ``"mean"`` over the batch dims (a scalar) or ``"none"`` (shape ``attn_l.shape[:-3]``).
        form: ``"mean"`` (primary): the head-averaged maps of ℓ and ℓ+1; ``"matched"``: head h of ℓ
            with head h of ℓ+1, mean over heads; ``"best"``: each head of ℓ+1 with its most similar
            head of ℓ, mean over the heads of ℓ+1.
        mask: (..., N) bool, True for real tokens; each sequence needs at least one.
    Returns:
        A float32 tensor.
    """
    _check_reduction(reduction)
    if form not in HEAD_REDUNDANCY_FORMS:
        raise ValueError(f"unknown head-redundancy form {form!r}; one of {', '.join(HEAD_REDUNDANCY_FORMS)}")
    if attn_l.shape != attn_next.shape or attn_l.ndim < 3:
        raise ValueError(
            f"need two attention tensors (..., H, N, N) of one shape, got "
            f"{tuple(attn_l.shape)} and {tuple(attn_next.shape)}"
        )
    dtype = _working_dtype(attn_l, attn_next)
    a, b = attn_l.to(dtype), attn_next.to(dtype)
    if mask is not None:
        mask = _check_mask(mask, (*a.shape[:-3], a.shape[-1]), "attention tokens")
        real = (mask[..., :, None] & mask[..., None, :])[..., None, :, :]  # (..., 1, N, N)
        a, b = torch.where(real, a, 0.0), torch.where(real, b, 0.0)
    a, b = a.flatten(-2), b.flatten(-2)  # (..., H, N²)
    if form == "mean":
        a, b = a.mean(-2, keepdim=True), b.mean(-2, keepdim=True)
    a, b = _unit_rows(a), _unit_rows(b)
    if form == "best":  # (..., H_next, H): each head of ℓ + 1 against its closest head of ℓ
        return _reduce((b @ a.transpose(-2, -1)).amax(-1).mean(-1), reduction)
    per_sequence = (a * b).sum(-1).mean(-1)
    return _reduce(per_sequence, reduction)


def _by_descending_real(eigenvalues: Tensor) -> Tensor:
    return eigenvalues[torch.argsort(eigenvalues.real, descending=True, stable=True)]


def value_projection_spectrum(w_v: Tensor, w_o: Tensor, gamma: Tensor | None = None) -> Tensor:
    """Eigenvalues of H_eff = diag(γ) W_V W_O, the value-output map of a layer in the row-vector form
    X ← X + A X H (math.md §3 "Spectral regime"; Dovonon et al.).

    With nn.Linear weights (v = x @ w_vᵀ, head h owning output rows h·d … (h+1)·d; out = u @ w_oᵀ with
    u the concatenated heads), head h contributes H_h = w_v[h rows]ᵀ @ w_o[:, h cols]ᵀ. Summed over
    heads these blocks make up the full product, Σ_h H_h = w_vᵀ @ w_oᵀ, so the head count is not
    needed. γ, the pre-attention LayerNorm gain, scales the rows: H_eff = diag(γ) H.

    Args:
        w_v: value projection weight (D, D).
        w_o: output projection weight (D, D).
        gamma: LayerNorm gain (D,), or None for γ = 1.
    Returns:
        complex64 eigenvalues (D,), by descending real part (computed in float64).
    """
    d_model = w_v.shape[-1]
    if w_v.shape != (d_model, d_model) or w_o.shape != (d_model, d_model):
        raise ValueError(f"need square w_v, w_o (D, D), got {tuple(w_v.shape)}, {tuple(w_o.shape)}")
    h = w_v.double().T @ w_o.double().T
    if gamma is not None:
        if gamma.shape != (d_model,):
            raise ValueError(f"gamma must have shape ({d_model},), got {tuple(gamma.shape)}")
        h = gamma.double()[:, None] * h
    if not bool(h.isfinite().all()):  # LAPACK's eigvals on NaN or inf ends the process (a segfault)
        raise ValueError("W_V, W_O or the LayerNorm gain hold NaN or inf: H_eff has no eigenvalues")
    return _by_descending_real(torch.linalg.eigvals(h)).to(torch.complex64)


def attention_eigenvalues(attn: Tensor) -> Tensor:
    """Eigenvalues λ_A of the head-averaged attention (math.md §3 "Spectral regime").

    The rows are renormalised to sum to 1 in float64 first, so that float32 softmax rounding does not
    move the eigenvalue 1 (on the constant vector) past the 1e-6 tolerance of `spectral_regime`;
    rows must already sum to 1 within 1e-3.

    Args:
        attn: row-stochastic attention (N, N), or (H, N, N) averaged over heads.
    Returns:
        complex64 eigenvalues (N,), by descending real part (computed in float64).
    """
    if attn.ndim not in (2, 3) or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"need attention (N, N) or (H, N, N), got {tuple(attn.shape)}")
    a = attn.double()
    if a.ndim == 3:
        a = a.mean(0)
    if not bool(torch.isfinite(a).all()):  # (a NaN failed the row sums, "must sum to 1")
        raise ValueError("attention holds a NaN or an infinity (the model's outputs overflowed?)")
    row_sums = a.sum(-1)
    if not torch.allclose(row_sums, torch.ones_like(row_sums), rtol=0, atol=1e-3):
        raise ValueError("attention rows must sum to 1 (row-stochastic)")
    return _by_descending_real(torch.linalg.eigvals(a / row_sums[:, None])).to(torch.complex64)


def spectral_regime(attn_eigenvalues: Tensor, h_eigenvalues: Tensor) -> dict[str, str | complex | float]:
    """Whether a layer X ← X + A X H smooths or sharpens (math.md §3 "Spectral regime"; Dovonon et al.).

    Each joint mode is multiplied by 1 + λ_A λ_H. The dominant pair maximises |1 + λ_A λ_H|; the
    layer *smooths* when that maximum is reached at λ_A = 1 (|λ_A − 1| ≤ 1e-6, the constant mode)
    and *sharpens* otherwise. Gains are compared through |1 + t|² − 1 = 2 Re t + |t|², t = λ_A λ_H
    (exact where every |t| is tiny), and pairs within 1e-9 of the maximum, relative to the largest
    |t|, count as tied; a tie goes to λ_A = 1 (a tolerance relative to the gain ≈ 1 tied every pair
    once all |λ_H| < 5e-10, whatever their sign). So H = cI, c > 0, smooths, and H with all
    eigenvalues in [−1, 0) sharpens (given some λ_A ≠ 1).

    Args:
        attn_eigenvalues: λ_A (N,), e.g. from `attention_eigenvalues`; includes 1 for a row-stochastic A.
        h_eigenvalues: λ_H (D,), e.g. from `value_projection_spectrum`.
    Returns:
        ``{"regime": "smooth" | "sharpen", "lambda_a": complex, "lambda_h": complex, "gain": float}``,
        the dominant pair and its |1 + λ_A λ_H|.
    """
    if any(t.ndim != 1 or t.numel() == 0 for t in (attn_eigenvalues, h_eigenvalues)):
        raise ValueError("need non-empty 1-D eigenvalue tensors")
    if not all(bool(torch.isfinite(t).all()) for t in (attn_eigenvalues, h_eigenvalues)):
        raise ValueError("eigenvalues must be finite (a NaN made every gain comparison false)")
    lam_a = attn_eigenvalues.to(torch.complex128)
    lam_h = h_eigenvalues.to(torch.complex128)
    term = lam_a[:, None] * lam_h[None, :]  # (N, D)
    growth = 2 * term.real + term.abs().square()  # |1 + t|² − 1, without the 1 that hid small terms
    near_max = growth >= growth.max() - 1e-9 * term.abs().max()
    gain = (1 + growth).clamp_min(0).sqrt()
    at_one = near_max & ((lam_a - 1).abs() <= 1e-6)[:, None]
    smooth = bool(at_one.any())
    flat = int(torch.where(at_one if smooth else near_max, gain, -1.0).argmax())
    i, j = divmod(flat, lam_h.numel())
    return {
        "regime": "smooth" if smooth else "sharpen",
        "lambda_a": lam_a[i].item(),
        "lambda_h": lam_h[j].item(),
        "gain": gain[i, j].item(),
    }


def spearman_correlation(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two score vectors (N,): the Pearson correlation of their
    ranks, tied scores sharing their average rank. NaN where either vector is constant (no ranks to
    correlate, as scipy's ``spearmanr``; a verdict given a NaN is inconclusive)."""
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(
            f"need two score vectors of one length >= 2, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # unique() ranks each NaN apart
        raise ValueError("spearman_correlation needs finite scores; got NaN or inf")
    ra, rb = _average_ranks(a.double()), _average_ranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def _average_ranks(x: Tensor) -> Tensor:
    """Ranks 1..N of x, ties given the mean of the ranks they span."""
    _, inverse, counts = torch.unique(x, sorted=True, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()  # rank of each distinct value's last occurrence
    return (last - (counts.double() - 1) / 2)[inverse]

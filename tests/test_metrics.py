"""math.md §3 metric functions against slow references written independently: NumPy float64, loops over
tokens and heads, softmax by hand, per-head weight slices."""

import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from neutreno.diagnostics.metrics import (
    all_finite,
    attention_eigenvalues,
    batched_eigvalsh,
    effective_rank,
    effective_ranks,
    gradient_alignment,
    head_redundancy,
    high_frequency_ratio,
    nonlocal_energy,
    rank_residual,
    spectral_regime,
    token_cosine_similarity,
    value_projection_spectrum,
)

B, N, D, H = 3, 7, 5, 2


def gen(seed):
    return torch.Generator().manual_seed(seed)


def padding_mask():
    """(B, N) masks: none padded, trailing padding, leading padding."""
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, :2] = False
    return mask


def with_junk(t, keep, seed):
    """``t`` with every entry outside ``keep`` replaced by large random junk."""
    return torch.where(keep, t, 1e3 * torch.randn(t.shape, generator=gen(seed)))


def real_rows(t, mask, b):
    """Sequence ``b`` of ``t`` (B, N, ...) without its padded tokens, as float64 NumPy."""
    return t[b][mask[b]].double().numpy()


# ---- slow references (one sequence, float64 NumPy) ----


def ref_residual(x):
    mean = sum(x[i] for i in range(len(x))) / len(x)
    return x - mean, mean


def ref_rank_residual(x, norm):
    res, _ = ref_residual(x)
    if norm == "fro":
        return np.linalg.norm(res, "fro") / np.linalg.norm(x, "fro")
    # NumPy's induced 1-norm is the max column abs-sum, its inf-norm the max row abs-sum
    return math.sqrt(
        np.linalg.norm(res, 1)
        * np.linalg.norm(res, np.inf)
        / (np.linalg.norm(x, 1) * np.linalg.norm(x, np.inf))
    )


def ref_high_frequency_ratio(x):
    res, mean = ref_residual(x)
    return np.linalg.norm(res) / np.linalg.norm(np.outer(np.ones(len(x)), mean))


def ref_effective_rank(x):
    s = np.linalg.svd(x, compute_uv=False)
    p = s / s.sum()
    return math.exp(-sum(pi * math.log(pi) for pi in p if pi > 0))


def ref_nonlocal_energy(a, v):
    """a (H, n, n), v (H, n, d)."""
    heads, n = a.shape[0], a.shape[1]
    total = 0.0
    for h in range(heads):
        for i in range(n):
            for j in range(n):
                total += a[h, i, j] * np.sum((v[h, i] - v[h, j]) ** 2) / (2 * n)
    return total / heads


def ref_gradient_alignment(q, k, v):
    """q, k, v (H, n, d); g_i = Σ_j A_ij (v_i − v_j) with A built by exp / sum. Only g_i's direction
    enters a cosine, so g_i is taken times e^{lse_i − m_i}, m_i = max_{j≠i} s_ij: the term j = i is 0
    anyway, and the other weights e^{s_ij − m_i} never all underflow, as A_ij do where the diagonal's
    score leads by ~745 (float64) — scores of 1e38 below."""
    heads, n, d = q.shape
    total = 0.0
    for h in range(heads):
        for i in range(n):

            def gradient(query, h=h, i=i):
                others = [j for j in range(n) if j != i]
                if not others:
                    return np.zeros_like(v[h, i])
                scores = {j: query @ k[h, j] / math.sqrt(d) for j in others}
                top = max(scores.values())
                return sum(math.exp(scores[j] - top) * (v[h, i] - v[h, j]) for j in others)

            g_sym, g_asym = gradient(k[h, i]), gradient(q[h, i])
            denom = np.linalg.norm(g_sym) * np.linalg.norm(g_asym)
            total += g_sym @ g_asym / denom if denom > 0 else 0.0
    return total / (heads * n)


def ref_head_redundancy(a, b, form="matched"):
    """a, b (H, n, n): the matched, head-averaged ("mean") or best-matching form, written out."""

    def cos(x, y):
        x, y = x.ravel(), y.ravel()
        return x @ y / (np.linalg.norm(x) * np.linalg.norm(y))

    heads = a.shape[0]
    if form == "mean":
        return cos(sum(a[h] for h in range(heads)) / heads, sum(b[h] for h in range(heads)) / heads)
    if form == "best":
        return sum(max(cos(a[g], b[h]) for g in range(heads)) for h in range(heads)) / heads
    return sum(cos(a[h], b[h]) for h in range(heads)) / heads


def ref_regime_gain(lam_a, lam_h):
    return max(abs(1 + a * h) for a in lam_a for h in lam_h)


# ---- token metrics: reference, padding, reduction ----


TOKEN_METRICS = [
    (lambda x, m=None, r="mean": rank_residual(x, m, "fro", r), lambda x: ref_rank_residual(x, "fro")),
    (lambda x, m=None, r="mean": rank_residual(x, m, "l1_inf", r), lambda x: ref_rank_residual(x, "l1_inf")),
    (high_frequency_ratio, ref_high_frequency_ratio),
    (effective_rank, ref_effective_rank),
]


@pytest.mark.parametrize(("metric", "reference"), TOKEN_METRICS, ids=["fro", "l1_inf", "hfr", "erank"])
def test_token_metrics_match_reference_with_and_without_padding(metric, reference):
    x = torch.randn(B, N, D, generator=gen(0)) + 0.3
    mask = padding_mask()
    padded = with_junk(x, mask[..., None], seed=1)
    full = metric(x, None, "none")
    masked = metric(padded, mask, "none")
    assert full.shape == masked.shape == (B,) and masked.dtype == torch.float32
    for b in range(B):
        assert math.isclose(full[b].item(), reference(x[b].double().numpy()), rel_tol=1e-5)
        assert math.isclose(masked[b].item(), reference(real_rows(x, mask, b)), rel_tol=1e-5)
        unpadded = metric(x[b][mask[b]][None], None, "none")
        assert math.isclose(masked[b].item(), unpadded.item(), rel_tol=1e-5)
    assert math.isclose(metric(padded, mask).item(), masked.mean().item(), rel_tol=1e-6)


def test_token_metric_invariants():
    row = torch.randn(1, 1, D, generator=gen(2))
    same = row.expand(2, N, D)  # 1 xᵀ: rank one, all tokens identical
    assert rank_residual(same, norm="fro").item() == pytest.approx(0, abs=1e-6)
    assert rank_residual(same, norm="l1_inf").item() == pytest.approx(0, abs=1e-6)
    assert high_frequency_ratio(same).item() == pytest.approx(0, abs=1e-6)
    assert effective_rank(same).item() == pytest.approx(1, abs=1e-4)
    assert effective_rank(torch.eye(4, D)[None]).item() == pytest.approx(4, abs=1e-5)
    assert effective_rank(torch.eye(D)[None]).item() == pytest.approx(D, abs=1e-5)
    # a rank-one matrix that is not 1 xᵀ: effective rank 1, rank residual not 0
    outer = torch.outer(torch.arange(1.0, N + 1), row[0, 0])[None]
    assert effective_rank(outer).item() == pytest.approx(1, abs=1e-4)
    assert rank_residual(outer).item() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_finds_every_nan_and_infinity(dtype):
    x = torch.randn(3, 5, 4, generator=gen(6)).to(dtype)
    assert all_finite(x) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for flat_index in (0, 17, x.numel() - 1):
            y = x.clone()
            y.view(-1)[flat_index] = bad
            assert not all_finite(y), (bad, flat_index)
            assert not all_finite(y.transpose(0, 2))  # any layout
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # finite however large
    assert all_finite(big) and all_finite(-big)


# ---- attention metrics ----


def masked_softmax_attention(mask, seed):
    """(B, H, N, N) row-stochastic weights over each sequence's real keys."""
    scores = torch.randn(B, H, N, N, generator=gen(seed))
    return scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)


def test_nonlocal_energy_matches_loop_with_and_without_padding():
    mask = padding_mask()
    v = torch.randn(B, H, N, 4, generator=gen(3)) + 2.0
    attn_full = torch.randn(B, H, N, N, generator=gen(4)).softmax(-1)
    full = nonlocal_energy(attn_full, v, reduction="none")
    attn = masked_softmax_attention(mask, seed=5)
    pair = (mask[:, :, None] & mask[:, None, :])[:, None]
    masked = nonlocal_energy(
        with_junk(attn, pair, seed=6), with_junk(v, mask[:, None, :, None], seed=7), mask, "none"
    )
    assert full.shape == masked.shape == (B,)
    for b in range(B):
        assert math.isclose(
            full[b].item(),
            ref_nonlocal_energy(attn_full[b].double().numpy(), v[b].double().numpy()),
            rel_tol=1e-5,
        )
        real = mask[b]
        a_real, v_real = attn[b][:, real][:, :, real], v[b][:, real]
        assert math.isclose(
            masked[b].item(),
            ref_nonlocal_energy(a_real.double().numpy(), v_real.double().numpy()),
            rel_tol=1e-5,
        )
        assert math.isclose(
            masked[b].item(), nonlocal_energy(a_real[None], v_real[None]).item(), rel_tol=1e-5
        )
    assert math.isclose(nonlocal_energy(attn_full, v).item(), full.mean().item(), rel_tol=1e-6)


def test_nonlocal_energy_keeps_a_negative_head_of_attnscale_weights():
    """Found in review: each head's J was clipped at 0 before the mean over heads, meant for rounding
    (~1e-21), so an AttnScale head, whose A' = 1/N + (1 + ω)(A − 1/N) has negative weights and may
    have J < 0, counted 0: 0.358 reported for 0.318."""
    n, omega = 6, 4.0
    sharp = (torch.randn(3, n, n, generator=gen(8)) * 6).softmax(-1)
    scaled = 1 / n + (1 + omega) * (sharp - 1 / n)
    v = torch.randn(3, n, 4, generator=gen(9), dtype=torch.float64)
    per_head = [
        ref_nonlocal_energy(scaled[h : h + 1].double().numpy(), v[h : h + 1].numpy()) for h in range(3)
    ]
    assert scaled.min() < 0 and min(per_head) < 0 < max(per_head)  # the case: a head below 0
    got = nonlocal_energy(scaled[None].double(), v[None]).item()
    assert math.isclose(got, ref_nonlocal_energy(scaled.double().numpy(), v.numpy()), rel_tol=1e-6)
    assert math.isclose(got, sum(per_head) / 3, rel_tol=1e-6)  # (a float32 result)
    # with weights ≥ 0, rounding below 0 is still clipped: equal values give 0, not −1e-21
    assert nonlocal_energy(sharp[None], torch.ones(1, 3, n, 4)).item() == 0.0


def test_nonlocal_energy_past_float32_is_inf_not_nan():
    """Finite float32 values whose squared norms pass 3.4e38: ‖v_i‖² + ‖v_j‖² − 2 v_i·v_j gave
    inf − inf = NaN, a J no input made. Below, the loop's float64 J, cast to float32 (inf beyond it);
    with a padding mask too."""
    mask = padding_mask()
    attn = masked_softmax_attention(mask, seed=5)
    for scale in (1e17, 1e20, 1e30):
        v = torch.randn(B, H, N, 4, generator=gen(3)) * scale
        got = nonlocal_energy(attn, v, mask, "none")
        for b in range(B):
            real = mask[b]
            a_real, v_real = attn[b][:, real][:, :, real], v[b][:, real]
            with np.errstate(over="ignore"):  # inf past float32, as the metric returns
                want = np.float32(ref_nonlocal_energy(a_real.double().numpy(), v_real.double().numpy()))
            assert got[b].item() == pytest.approx(float(want), rel=1e-5), (scale, b)
    assert nonlocal_energy(attn, v, mask).item() == math.inf  # the mean of infs
    assert nonlocal_energy(attn, torch.full_like(v, math.nan), mask).isnan()  # a NaN input stays NaN


def test_float32_overflow_falls_back_to_float64_whatever_the_padding_holds():
    """nonlocal_energy's float64 fallback needed every entry finite, the padded ones it never reads
    too: inf junk in a padded value row left the overflow's inf for every sequence of the batch. And
    gradient_alignment had no fallback: finite float32 q, k whose scores pass 3.4e38 gave NaN (inf
    scores). Both now give the float64 loops' values over the real tokens."""
    mask = padding_mask()
    attn = masked_softmax_attention(mask, seed=5)
    v = torch.randn(B, H, N, 4, generator=gen(3)) * 5e18  # ‖v‖² past float32, J not
    junk = torch.where(mask[:, None, :, None], v, math.inf)
    got = nonlocal_energy(attn, junk, mask, "none")
    q, k = (torch.randn(B, H, N, 4, generator=gen(s)) * 1e19 for s in (20, 21))
    q, k = (torch.where(mask[:, None, :, None], t, math.nan) for t in (q, k))  # junk where padded
    alignment = gradient_alignment(q, k, v / 5e18, mask, "none")
    for b in range(B):
        real = mask[b]
        a_real, v_real = attn[b][:, real][:, :, real], v[b][:, real]
        want = ref_nonlocal_energy(a_real.double().numpy(), v_real.double().numpy())
        assert math.isfinite(want) and got[b].item() == pytest.approx(want, rel=1e-5), b
        q_real, k_real, v_real = (t[b][:, real].double().numpy() for t in (q, k, v / 5e18))
        want = ref_gradient_alignment(q_real, k_real, v_real)
        assert alignment[b].item() == pytest.approx(want, rel=1e-5, abs=1e-6), b


def test_nonlocal_energy_is_zero_for_equal_values():
    attn = torch.randn(2, H, N, N, generator=gen(8)).softmax(-1)
    v = (100 * torch.randn(1, 1, 1, 4, generator=gen(9))).expand(2, H, N, 4)
    assert nonlocal_energy(attn, v).item() == pytest.approx(0, abs=1e-6)


def test_equal_values_give_exactly_zero_gradients_and_energy_in_float32():
    """Equal value vectors (fully over-smoothed): g_i = Σ_j A_ij (v_i − v_j) = 0, so every cosine is
    0, and J = 0, exactly. The float32 mean of N equal random rows is not that row: what centring on it
    left gave gradients of rounding noise with a direction (cosine ±1: alignments up to ±0.19 where the
    reference is 0, in 184 of 200 seeds) and J slightly below 0 (77 of 200)."""
    mask = padding_mask()  # the first real token is not token 0 in the last sequence
    for seed in range(20):
        q, k = (torch.randn(B, H, N, 16, generator=gen(100 + 2 * seed + i)) for i in (0, 1))
        v = torch.randn(B, H, 1, 16, generator=gen(300 + seed)).expand(B, H, N, 16)
        v = with_junk(v, mask[:, None, :, None], seed)  # padded tokens' values are not equal
        assert gradient_alignment(q, k, v, mask, reduction="none").tolist() == [0.0] * B
        attn = (q @ k.transpose(-2, -1)).softmax(-1)
        assert nonlocal_energy(attn, v, mask, reduction="none").tolist() == [0.0] * B


def test_identical_tokens_have_a_cosine_of_exactly_one():
    """Float32 rounding of ‖Σ x_i/‖x_i‖‖² put identical tokens' cosine at 1.0000002, above its bound."""
    for seed in range(20):
        x = torch.randn(4, 1, 8, generator=gen(500 + seed)).expand(4, 6, 8)
        values = token_cosine_similarity(x, reduction="none")
        assert (values <= 1).all() and values == pytest.approx([1.0] * 4, abs=1e-6), seed


def test_gradient_alignment_matches_loop_with_and_without_padding():
    mask = padding_mask()
    q, k, v = (torch.randn(B, H, N, 4, generator=gen(s)) for s in (10, 11, 12))
    full = gradient_alignment(q, k, v, reduction="none")
    token_keep = mask[:, None, :, None]
    masked = gradient_alignment(
        *(with_junk(t, token_keep, seed=s) for s, t in enumerate((q, k, v), 13)), mask, "none"
    )
    assert full.shape == masked.shape == (B,)
    for b in range(B):
        numpy_heads = [t[b].double().numpy() for t in (q, k, v)]
        assert math.isclose(full[b].item(), ref_gradient_alignment(*numpy_heads), rel_tol=1e-5)
        real = [t[b][:, mask[b]] for t in (q, k, v)]
        expected = ref_gradient_alignment(*(t.double().numpy() for t in real))
        assert math.isclose(masked[b].item(), expected, rel_tol=1e-5)
        assert math.isclose(
            masked[b].item(), gradient_alignment(*(t[None] for t in real)).item(), rel_tol=1e-5
        )
    assert math.isclose(gradient_alignment(q, k, v).item(), full.mean().item(), rel_tol=1e-6)


def test_gradient_alignment_from_given_maps_is_the_loop():
    """Given the maps (a probe's: softmax(q kᵀ/√d) over the real keys, a padded query's row junk),
    A V is their product: the reference loop's values over the real tokens."""
    mask = padding_mask()
    q, k, v = (
        with_junk(torch.randn(B, H, N, 4, generator=gen(s)), mask[:, None, :, None], seed=s + 3)
        for s in (40, 41, 42)
    )
    scores = (q.double() @ k.double().transpose(-2, -1) / 2).masked_fill(~mask[:, None, None, :], -math.inf)
    weights = (scores - scores.amax(-1, keepdim=True)).exp()  # √d = 2; exp(−inf) = 0 for padded keys
    attn = weights / weights.sum(-1, keepdim=True)
    attn = torch.where(mask[:, None, :, None], attn, torch.rand(B, H, N, N, generator=gen(43)))
    given = attn.float()
    got = gradient_alignment(q, k, v, mask, "none", attn=given)
    assert torch.equal(given, attn.float())  # the probe's maps, which other metrics read after: untouched
    for b in range(B):
        real = [t[b][:, mask[b]].double().numpy() for t in (q, k, v)]
        assert math.isclose(got[b].item(), ref_gradient_alignment(*real), rel_tol=1e-5)
    with pytest.raises(ValueError, match="attn must be"):
        gradient_alignment(q, k, v, attn=attn[..., :-1])


def test_gradient_alignment_resolves_a_symmetric_map_whose_other_weights_underflow_float32():
    """Keys of norm 40 at d 64: each token's own score K Kᵀ/√d leads the others by ~100-200, so in float32
    every other weight A_ij (j ≠ i) underflowed to 0: g_sym was exactly 0, each cosine 0, and the
    alignment 0.0 where the float64 loop gives ~0.6. A cosine does not see g's scale, so the weights of
    the other tokens are renormalised; given float32 maps that underflowed too, they are recomputed."""
    q, k, v = (torch.randn(1, 2, 12, 64, generator=gen(s)) for s in (60, 61, 62))
    k = 40 * k / k.norm(dim=-1, keepdim=True)
    reference = ref_gradient_alignment(*(t[0].double().numpy() for t in (q, k, v)))
    assert reference > 0.3
    assert gradient_alignment(q, k, v).item() == pytest.approx(reference, rel=1e-4)
    maps = (q @ k.transpose(-2, -1) / 8).softmax(-1)  # the probe's float32 maps, for the asymmetric side
    big = k + 0.5 * q  # ... and queries near the keys: their maps underflow too
    reference_big = ref_gradient_alignment(*(t[0].double().numpy() for t in (big, k, v)))
    big_maps = (big @ k.transpose(-2, -1) / 8).softmax(-1)
    assert (big_maps.diagonal(dim1=-2, dim2=-1) == 1).any()  # rows with no other weight left
    assert gradient_alignment(q, k, v, attn=maps).item() == pytest.approx(reference, rel=1e-4)
    assert gradient_alignment(big, k, v, attn=big_maps).item() == pytest.approx(reference_big, rel=1e-4)


def test_gradient_alignment_has_the_gradient_of_its_formula():
    """Backward through q, k and v (the metric may be used as a loss): the same gradients as the formula
    written out in float64 with autograd. (Its in-place diagonal once overwrote what softmax's backward
    reads: backward raised.)"""
    q, k, v = (torch.randn(2, H, N, 4, generator=gen(s), dtype=torch.float64) for s in (50, 51, 52))

    def by_formula(q, k, v):
        def g(a):  # g_i = Σ_j A_ij (v_i − v_j), the j = i term zero by itself
            return (a[..., :, :, None] * (v[..., :, None, :] - v[..., None, :, :])).sum(-2)

        asym, sym = g((q @ k.mT / 2).softmax(-1)), g((k @ k.mT / 2).softmax(-1))
        return ((asym * sym).sum(-1) / (asym.norm(dim=-1) * sym.norm(dim=-1))).mean((-2, -1)).sum()

    expected = torch.autograd.grad(by_formula(*(t.requires_grad_() for t in (q, k, v))), (q, k, v))
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    got = torch.autograd.grad(gradient_alignment(q32, k32, v32, reduction="none").sum(), (q32, k32, v32))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-6)


def test_effective_rank_has_the_gradient_of_the_real_tokens_alone():
    """Padding's zeroed rows add zero singular values, whose √ and log have infinite derivatives: every
    real token of a padded sequence got a NaN gradient. Now the gradient is that of the real tokens
    through an SVD written in float64, and a rank-deficient X (a repeated token) gets a finite one."""
    x = torch.randn(3, 6, 8, generator=gen(60), dtype=torch.float64)
    x[2, 3] = x[2, 1]  # rank 5 of 6, unpadded
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)

    def by_svd(tokens):
        s = torch.linalg.svdvals(tokens)
        p = s / s.sum()
        return torch.exp(-(p * p.log()).sum())

    x32 = x.float().requires_grad_()
    (got,) = torch.autograd.grad(effective_rank(x32, mask, reduction="none").sum(), x32)
    assert torch.isfinite(got).all() and (got[0, 4:] == 0).all()
    for b, n in ((0, 4), (1, 6)):
        real = x[b, :n].clone().requires_grad_()
        (expected,) = torch.autograd.grad(by_svd(real), real)
        torch.testing.assert_close(got[b, :n].double(), expected, rtol=1e-3, atol=1e-5)
    assert got[2].abs().max() > 0


def test_gradient_alignment_invariants():
    k, v = (torch.randn(2, H, N, 4, generator=gen(s)) for s in (16, 17))
    assert gradient_alignment(k, k, v).item() == pytest.approx(1, abs=1e-6)
    q = torch.randn(2, H, N, 4, generator=gen(18))
    assert gradient_alignment(q, k, v).item() < 0.999
    # constant values: both gradients vanish, and a zero gradient counts as cosine 0
    assert gradient_alignment(q, k, torch.ones(2, H, N, 4)).item() == 0


@pytest.mark.parametrize("form", ["mean", "matched", "best"])
def test_head_redundancy_matches_loop(form):
    a, b = (torch.randn(B, H, N, N, generator=gen(s)).softmax(-1) for s in (19, 20))
    got = head_redundancy(a, b, reduction="none", form=form)
    assert got.shape == (B,)
    for i in range(B):
        expected = ref_head_redundancy(a[i].double().numpy(), b[i].double().numpy(), form)
        assert math.isclose(got[i].item(), expected, rel_tol=1e-5)
    assert math.isclose(head_redundancy(a, b, form=form).item(), got.mean().item(), rel_tol=1e-6)
    assert head_redundancy(a, a, form=form).item() == pytest.approx(1, abs=1e-6)
    assert head_redundancy(a, 3 * a, form=form).item() == pytest.approx(1, abs=1e-6)  # scale-free
    # a cosine at any scale: F.normalize's float32 squares overflowed at 1e20 (0), its floor swamped 1e-20
    for scale in (1e-20, 1e20):
        scaled = head_redundancy(scale * a, b, reduction="none", form=form)
        torch.testing.assert_close(scaled, got, rtol=1e-5, atol=0)


def test_head_redundancy_primary_form_ignores_head_order():
    # Head order carries no meaning across layers (math.md §3): permuting layer ℓ+1's heads leaves the
    # primary and best-matching forms unchanged, while the same-index form changes.
    a, b = (torch.randn(B, H, N, N, generator=gen(s)).softmax(-1) for s in (21, 22))
    shuffled = b[:, torch.tensor([2, 0, 1])] if H == 3 else b.flip(1)
    for form in ("mean", "best"):
        assert torch.allclose(head_redundancy(a, b, form=form), head_redundancy(a, shuffled, form=form))
    assert not torch.allclose(
        head_redundancy(a, b, form="matched"), head_redundancy(a, shuffled, form="matched")
    )
    with pytest.raises(ValueError, match="unknown head-redundancy form"):
        head_redundancy(a, b, form="per_head")


# ---- spectra ----


def test_value_projection_spectrum_matches_per_head_products():
    heads, d_model = 2, 8
    d = d_model // heads
    w_v, w_o = (torch.randn(d_model, d_model, generator=gen(s), dtype=torch.float64) for s in (21, 22))
    gamma = torch.randn(d_model, generator=gen(23), dtype=torch.float64)
    h_ref = np.zeros((d_model, d_model))
    for h in range(heads):
        cols = slice(h * d, (h + 1) * d)
        h_ref += w_v[cols].numpy().T @ w_o[:, cols].numpy().T
    h_eff = np.diag(gamma.numpy()) @ h_ref

    # the reference's layout: multi-head attention with one A shared by all heads is A (X diag γ) H_eff
    x = torch.randn(5, d_model, generator=gen(24), dtype=torch.float64)
    a = torch.randn(5, 5, generator=gen(25), dtype=torch.float64).softmax(-1)
    v = (x * gamma) @ w_v.T
    u = torch.cat([a @ v[:, h * d : (h + 1) * d] for h in range(heads)], dim=-1)
    np.testing.assert_allclose((u @ w_o.T).numpy(), a.numpy() @ x.numpy() @ h_eff, atol=1e-10)

    got = value_projection_spectrum(w_v.float(), w_o.float(), gamma.float())
    assert got.dtype == torch.complex64 and got.shape == (d_model,)
    assert (np.diff(got.real.numpy()) <= 0).all()
    expected = np.linalg.eigvals(h_eff)
    np.testing.assert_allclose(np.sort_complex(got.numpy()), np.sort_complex(expected), atol=1e-4)

    no_gain = value_projection_spectrum(w_v, w_o)
    np.testing.assert_allclose(
        np.sort_complex(no_gain.numpy()), np.sort_complex(np.linalg.eigvals(h_ref)), atol=1e-4
    )


def test_attention_eigenvalues_of_known_matrices():
    n = 4
    uniform = torch.full((n, n), 1 / n)
    np.testing.assert_allclose(attention_eigenvalues(uniform).numpy(), [1, 0, 0, 0], atol=1e-6)
    # random walk on a 4-cycle, ½(P + Pᵀ): eigenvalues cos(2πk/4) = 1, 0, 0, −1
    shift = torch.roll(torch.eye(n), 1, dims=1)
    cycle = (shift + shift.T) / 2
    got = attention_eigenvalues(torch.stack([cycle, cycle]))
    assert got.dtype == torch.complex64
    np.testing.assert_allclose(got.numpy(), [1, 0, 0, -1], atol=1e-6)
    # heads are averaged before the eigen-decomposition
    heads = torch.randn(3, 5, 5, generator=gen(26)).softmax(-1)
    expected = np.linalg.eigvals(heads.double().numpy().mean(0))
    np.testing.assert_allclose(
        np.sort_complex(attention_eigenvalues(heads).numpy()), np.sort_complex(expected), atol=1e-5
    )


def test_non_finite_attention_is_named_as_such_not_as_unnormalised():
    attn = torch.full((3, 3), 1 / 3)
    attn[0, 1] = torch.nan
    with pytest.raises(ValueError, match="attention holds a NaN or an infinity"):
        attention_eigenvalues(attn)


def test_spectral_regime_known_cases():
    n, d_model = 4, 6
    uniform = attention_eigenvalues(torch.full((n, n), 1 / n))  # {1, 0, 0, 0}
    shift = torch.roll(torch.eye(n), 1, dims=1)
    cycle = attention_eigenvalues((shift + shift.T) / 2)  # {1, 0, 0, −1}
    identity = torch.eye(d_model)

    smooth = spectral_regime(uniform, value_projection_spectrum(2 * identity, identity))  # H = 2I
    assert smooth["regime"] == "smooth"
    assert smooth["lambda_a"] == pytest.approx(1) and smooth["lambda_h"] == pytest.approx(2)
    assert smooth["gain"] == pytest.approx(3)
    assert spectral_regime(cycle, value_projection_spectrum(0.3 * identity, identity))["regime"] == "smooth"

    half = spectral_regime(uniform, value_projection_spectrum(-0.5 * identity, identity))  # H = −½I
    assert half["regime"] == "sharpen"
    assert abs(half["lambda_a"]) < 1e-6 and half["gain"] == pytest.approx(1)
    on_cycle = spectral_regime(cycle, value_projection_spectrum(-0.5 * identity, identity))
    assert on_cycle["regime"] == "sharpen"
    assert on_cycle["lambda_a"] == pytest.approx(-1) and on_cycle["gain"] == pytest.approx(1.5)

    # non-symmetric H with eigenvalues in [−1, 0); H = w_vᵀ w_oᵀ, so w_v = Hᵀ with w_o = I
    basis = torch.randn(d_model, d_model, generator=gen(27), dtype=torch.float64)
    eigenvalues = torch.tensor([-1.0, -0.8, -0.5, -0.3, -0.1, -0.01], dtype=torch.float64)
    h = basis @ torch.diag(eigenvalues) @ torch.linalg.inv(basis)
    lam_h = value_projection_spectrum(h.T, torch.eye(d_model, dtype=torch.float64))
    np.testing.assert_allclose(np.sort(lam_h.real.numpy()), eigenvalues.numpy(), atol=1e-5)
    for lam_a in (uniform, cycle):
        result = spectral_regime(lam_a, lam_h)
        assert result["regime"] == "sharpen"
        assert result["gain"] == pytest.approx(ref_regime_gain(lam_a.numpy(), lam_h.numpy()))


def test_spectral_regime_complex_modes_and_ties():
    # 3-cycle permutation: λ_A are the cube roots of unity; with H = −½I the complex ones dominate
    perm = torch.roll(torch.eye(3), 1, dims=1)
    lam_a = attention_eigenvalues(perm)
    result = spectral_regime(lam_a, torch.full((2,), -0.5, dtype=torch.complex64))
    assert result["regime"] == "sharpen"
    assert isinstance(result["lambda_a"], complex) and abs(result["lambda_a"].imag) == pytest.approx(
        3**0.5 / 2
    )
    assert result["gain"] == pytest.approx(ref_regime_gain(lam_a.numpy(), [-0.5]))
    # λ_H = 0: every pair has gain 1, and the tie goes to λ_A = 1 wherever it is listed
    for order in ([-1.0, 1.0], [1.0, -1.0]):
        tie = spectral_regime(
            torch.tensor(order, dtype=torch.complex64), torch.zeros(3, dtype=torch.complex64)
        )
        assert tie["regime"] == "smooth" and tie["lambda_a"] == 1 and tie["gain"] == 1
    # every λ_H tiny: the tie tolerance, relative to the gain ≈ 1, tied every pair once |λ_H| < 5e-10 and
    # called a sharpening H (−1e-10·I, whose largest |1 + λ_A λ_H| is at a complex λ_A) smooth
    a = torch.randn(6, 6, generator=gen(31), dtype=torch.float64).softmax(-1)
    lam_a = attention_eigenvalues(a).to(torch.complex128)
    for scale in (-1e-9, -1e-10, -1e-14):
        lam_h = torch.full((3,), scale, dtype=torch.complex128)
        exact = max(range(6), key=lambda i: abs(1 + complex(lam_a[i]) * scale) ** 2)  # brute force, per mode
        tiny = spectral_regime(lam_a, lam_h)
        assert tiny["regime"] == ("smooth" if abs(complex(lam_a[exact]) - 1) < 1e-6 else "sharpen"), scale
        assert tiny["regime"] == "sharpen"
    # random spectra: the reported gain is the brute-force maximum
    lam_a = torch.randn(5, generator=gen(28), dtype=torch.float64) / 3 + 0j
    lam_h = torch.complex(*(torch.randn(4, generator=gen(s), dtype=torch.float64) for s in (29, 30)))
    assert spectral_regime(lam_a, lam_h)["gain"] == pytest.approx(
        ref_regime_gain(lam_a.numpy(), lam_h.numpy())
    )


# ---- bad arguments ----


def test_bad_arguments_raise():
    x = torch.randn(2, N, D)
    attn = torch.randn(2, H, N, N).softmax(-1)
    v = torch.randn(2, H, N, 4)
    for call in (
        lambda r: rank_residual(x, reduction=r),
        lambda r: high_frequency_ratio(x, reduction=r),
        lambda r: effective_rank(x, reduction=r),
        lambda r: nonlocal_energy(attn, v, reduction=r),
        lambda r: gradient_alignment(v, v, v, reduction=r),
        lambda r: head_redundancy(attn, attn, reduction=r),
    ):
        with pytest.raises(ValueError, match="reduction"):
            call("sum")
    with pytest.raises(ValueError, match="'fro' or 'l1_inf'"):
        rank_residual(x, norm="nuc")
    bad_mask = torch.ones(2, N + 1, dtype=torch.bool)
    for call in (
        lambda: rank_residual(x, bad_mask),
        lambda: high_frequency_ratio(x, bad_mask),
        lambda: effective_rank(x, bad_mask),
        lambda: nonlocal_energy(attn, v, bad_mask),
        lambda: gradient_alignment(v, v, v, bad_mask),
    ):
        with pytest.raises(ValueError, match="mask shape"):
            call()
    empty = torch.ones(2, N, dtype=torch.bool)
    empty[1] = False
    with pytest.raises(ValueError, match="at least one"):
        rank_residual(x, empty)
    with pytest.raises(ValueError, match="one shape"):
        head_redundancy(attn, attn[..., :-1, :-1])
    with pytest.raises(ValueError, match="values"):
        nonlocal_energy(attn, v[..., :-1, :])
    with pytest.raises(ValueError, match="d ≥ 1"):  # was a ZeroDivisionError from the 1/√d scale
        gradient_alignment(v[..., :0], v[..., :0], v)
    with pytest.raises(ValueError, match="row-stochastic"):
        attention_eigenvalues(2 * torch.eye(3))
    with pytest.raises(ValueError, match="square"):
        value_projection_spectrum(torch.randn(4, 6), torch.randn(4, 4))
    # no token or no feature: an IndexError, an error from amax, or a NaN without a word
    for metric in (token_cosine_similarity, rank_residual, high_frequency_ratio, effective_rank):
        for shape in ((8,), (2, 0, 8), (2, 8, 0)):
            with pytest.raises(ValueError, match=r"N, D ≥ 1, got shape"):
                metric(torch.randn(shape))
    for layers in ([torch.randn(8)], []):  # "not enough values to unpack", an IndexError
        with pytest.raises(ValueError, match=r"need one or more tensors \(\.\.\., N, D\)"):
            effective_ranks(layers)


def test_spearman_correlation_matches_scipy_with_ties():
    from scipy.stats import spearmanr

    from neutreno.diagnostics import spearman_correlation

    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, generator=g)
    b = a + 0.7 * torch.randn(50, generator=g)
    tied_a, tied_b = a.round(decimals=0), b.round(decimals=0)  # many ties
    for x, y in ((a, b), (tied_a, tied_b), (a, tied_b)):
        assert spearman_correlation(x, y) == pytest.approx(
            spearmanr(x.numpy(), y.numpy()).statistic, abs=1e-12
        )
    assert spearman_correlation(a, a * 3 + 1) == pytest.approx(1.0)
    assert spearman_correlation(a, -a) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="two score vectors"):
        spearman_correlation(a, b[:3])


def test_cosines_hold_for_token_norms_a_float32_norm_cannot_take():
    """A float32 ‖x‖ overflows above ~1.8e19 and normalize's eps floor shrinks rows below 1e-12: token
    cosine and gradient alignment read 0 there (no over-smoothing) where the directions say otherwise.
    Scaled by 1e20 or 1e-30, the tokens' cosine and the alignment are the unscaled ones."""
    from reference import cosine_loop

    x = torch.randn(B, N, D, generator=gen(30)) + 1.0
    expected = cosine_loop(x).mean().item()
    for scale in (1e20, 1e-30):
        assert token_cosine_similarity(x * scale).item() == pytest.approx(expected, rel=1e-5), scale
    q, k, v = (torch.randn(1, H, N, 4, generator=gen(s)) for s in (31, 32, 33))
    reference = ref_gradient_alignment(*(t[0].double().numpy() for t in (q, k, v)))
    for scale in (1e20, 1e-15):
        assert gradient_alignment(q, k, v * scale).item() == pytest.approx(reference, rel=1e-4), scale


def test_cosines_of_rows_of_mixed_norms_in_one_batch():
    """Most rows have float32 norms without overflow or underflow and take the one-pass path; a row at
    1e20 or 1e-30 (whose squares underflow to a norm of exactly 0, like a zero row's) in the same
    batch needs the scaled one, and a zero row must stay a zero row (cosine 0), a NaN row NaN."""
    from reference import cosine_loop

    x = torch.randn(4, N, D, generator=gen(34)) + 0.5
    x[0, 2] = 0.0
    x[1, 3] *= 1e-30
    x[2, 1] *= 1e20
    expected = cosine_loop(x[:3])
    got = token_cosine_similarity(x, reduction="none")
    torch.testing.assert_close(got[:3].double(), expected, rtol=1e-5, atol=0)
    x[3, 4, 0] = math.nan
    with_nan = token_cosine_similarity(x, reduction="none")
    assert with_nan[3].isnan() and torch.equal(with_nan[:3], got[:3])
    # gradient alignment: per head, v scaled by 1e20 and 1e-15 scales both gradients, not their cosine
    q, k, v = (torch.randn(1, H, N, 4, generator=gen(s)) for s in (35, 36, 37))
    reference = ref_gradient_alignment(*(t[0].double().numpy() for t in (q, k, v)))
    scaled = v * torch.tensor([1e20, 1e-15])[:, None, None]
    assert gradient_alignment(q, k, scaled).item() == pytest.approx(reference, rel=1e-4)


def test_degenerate_rows_keep_nan_values_and_finite_gradients():
    """A zero row (a sequence with one real token, constant values, a one-hot symmetric map) has
    cosine 0, but a NaN beside it stays NaN; and its 0/0 must not reach the gradients (the metrics may
    be used as losses), nor may a non-finite sequence's NaN reach the other sequences' gradients.
    (Review: NaN gave 0.0, and these gradients were NaN.)"""
    q, k = torch.randn(2, 1, 1, 2, 1, generator=gen(60)).unbind(0)
    q[0, 0, 0, 0] = math.nan  # the symmetric gradient is zero (constant v), the asymmetric one NaN
    assert math.isnan(gradient_alignment(q, k, torch.ones(1, 1, 2, 1)).item())
    q, k, v = (torch.randn(2, H, 5, 4, generator=gen(s)).requires_grad_() for s in (61, 62, 63))
    one_real = torch.tensor([[True] * 5, [True] + [False] * 4])
    got = gradient_alignment(q, k, v, one_real, "none")
    assert got[1] == 0
    got.sum().backward()
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    x = torch.randn(2, 4, 3, generator=gen(64))
    x[0, 1] = 0.0  # a zero token, not padding
    x.requires_grad_()
    token_cosine_similarity(x).backward()
    assert x.grad.isfinite().all()
    x = torch.randn(2, 5, 3, generator=gen(65), dtype=torch.float64)
    x[1, 0, 0] = math.inf
    x.requires_grad_()
    ranks = effective_rank(x, reduction="none")
    assert ranks[1].isnan()
    ranks[0].backward()
    assert x.grad.isfinite().all()


def test_gradient_alignment_of_permuted_views_is_the_loop():
    """A probe's q, k, v are permuted views of one projection (B, N, 3, H, d): the in-place products
    need them laid out as (B, H, N, d) first."""
    qkv = torch.randn(B, N, 3, H, 4, generator=gen(38))
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    assert not v.is_contiguous()
    got = gradient_alignment(q, k, v, reduction="none")
    for b in range(B):
        expected = ref_gradient_alignment(*(t[b].double().numpy() for t in (q, k, v)))
        assert math.isclose(got[b].item(), expected, rel_tol=1e-5)


def test_spearman_refuses_non_finite_scores():
    """unique() ranks each NaN apart, so NaN scores gave a confident correlation (1.0 for all-NaN)."""
    from neutreno.diagnostics.metrics import spearman_correlation

    for a in (torch.full((4,), float("nan")), torch.tensor([1.0, float("nan"), 3.0, 4.0])):
        with pytest.raises(ValueError, match="finite"):
            spearman_correlation(a, torch.arange(4.0))
    assert spearman_correlation(torch.tensor([1.0, 3.0, 2.0, 4.0]), torch.arange(4.0)) == pytest.approx(0.8)


def test_gradient_alignment_is_resolved_where_symmetric_attention_is_nearly_one_hot():
    """Keys of large norm make softmax(K Kᵀ/√d) nearly one-hot on its diagonal: g^sym is then ~1e-9 of
    v, below float32's rounding of v − A V, and the metric was rounding noise (2e-3 off on MiniLM).
    Reference: per token, weights relative to the diagonal's, g_i = Σ_{j≠i} w_ij (v_i − v_j) / Σ_j w_ij."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=generator) for _ in range(3))
    k = k * 5.0  # diagonal scores ≫ off-diagonal ones: A_sym's off-diagonal weights ~1e-9
    qd, kd, vd = (t[0].double().numpy() for t in (q, k, v))

    def gradient(queries, h, i):
        scores = [float(queries[h, i] @ kd[h, j]) / 2.0 for j in range(6)]  # √d = 2
        top = max(scores)
        w = [math.exp(s - top) for s in scores]
        return sum(w[j] * (vd[h, i] - vd[h, j]) for j in range(6) if j != i) / sum(w)

    cosines = []
    for h in range(2):
        for i in range(6):
            g_sym, g_asym = gradient(kd, h, i), gradient(qd, h, i)
            cosines.append(float(g_sym @ g_asym) / (np.linalg.norm(g_sym) * np.linalg.norm(g_asym)))
    relative = [
        np.linalg.norm(gradient(kd, h, i)) / np.linalg.norm(vd[h, i]) for h in (0, 1) for i in range(6)
    ]
    assert min(relative) < 1e-7  # the regime float32 could not resolve
    assert math.isclose(gradient_alignment(q, k, v).item(), sum(cosines) / 12, abs_tol=5e-5)  # float32
    assert math.isnan(gradient_alignment(q.index_put((torch.tensor([0]),) * 4, torch.tensor(math.nan)), k, v))


def test_norm_ratios_of_huge_but_finite_tokens_and_effective_rank_of_broken_ones():
    """Entries near 3e19 overflowed float32's ‖X‖ to inf, so rank_residual and high_frequency_ratio gave
    a finite 0 for a true 0.029; effective_rank raised eigvalsh's convergence error on a NaN sequence
    instead of giving it NaN."""
    generator = torch.Generator().manual_seed(0)
    small = 3.0 + 0.1 * torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    huge = (small * 1e19).float()
    for norm in ("fro", "l1_inf"):
        got, expected = (rank_residual(x, norm=norm, reduction="none") for x in (huge, small))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)
    expected = high_frequency_ratio(small, reduction="none")
    torch.testing.assert_close(high_frequency_ratio(huge, reduction="none"), expected, rtol=1e-4, atol=0)
    broken = small.clone()
    broken[1, 2, 3] = math.nan
    ranks = effective_rank(broken, reduction="none")
    assert ranks[1].isnan() and ranks[0] == effective_rank(small[:1]).item()


def test_norm_ratios_of_sequences_of_mixed_scales_in_one_batch():
    """A batch whose sequences' norms lie in [1e-2, 1e15] is measured as it is; one sequence at 1e19 or
    1e-30 (whose float32 squares overflow to inf or underflow to 0) sends the batch through the scaled
    path, and every sequence keeps its own value."""
    x = torch.randn(3, N, D, generator=gen(12)) + 0.3
    x[1] *= 1e-30
    x[2] *= 1e19
    unscaled = x / torch.tensor([1.0, 1e-30, 1e19])[:, None, None]
    for norm in ("fro", "l1_inf"):
        got = rank_residual(x, norm=norm, reduction="none")
        for b in range(3):
            expected = ref_rank_residual(unscaled[b].double().numpy(), norm)
            assert math.isclose(got[b].item(), expected, rel_tol=1e-5), (norm, b)
    got = high_frequency_ratio(x, reduction="none")
    for b in range(3):
        expected = ref_high_frequency_ratio(unscaled[b].double().numpy())
        assert math.isclose(got[b].item(), expected, rel_tol=1e-5), b


def test_effective_rank_of_an_infinite_sequence_is_nan_and_the_others_are_kept():
    """A sequence with inf (or inf and −inf, whose sum is NaN) is found broken from its float64 sum."""
    x = torch.randn(4, 6, 9, generator=gen(11))
    x[1, 0, 0], x[2, 3, 1], x[2, 4, 1] = math.inf, math.inf, -math.inf
    ranks = effective_rank(x, reduction="none")
    assert ranks.isnan().tolist() == [False, True, True, False]
    assert ranks[3] == effective_rank(x[3:]).item() and ranks[0] == effective_rank(x[:1]).item()


def test_effective_ranks_of_many_layers_are_those_of_one_layer_at_a_time():
    """One batch of eigenvalue solves for all layers gives each layer's values bit for bit: with padding
    (junk in it), a NaN sequence, and layers whose Gram matrices differ in size (solved apart)."""
    mask = padding_mask()
    layers = [
        with_junk(torch.randn(B, N, D, generator=gen(s)), mask[..., None], seed=s + 10) for s in (70, 71, 72)
    ]
    layers[1][2, 3, 0] = math.nan  # a real token's entry: that sequence is NaN, the others are kept
    for group in (layers, [*layers, torch.randn(B, N, 2 * N, generator=gen(73))]):  # N × N Gram matrices
        got = effective_ranks(group, mask)
        expected = [effective_rank(x, mask, "none") for x in group]
        assert len(got) == len(group)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert effective_ranks(layers, mask)[1].isnan().tolist() == [False, False, True]
    assert effective_ranks(iter(layers), mask)[0].equal(
        effective_rank(layers[0], mask, "none")
    )  # a generator


def test_effective_ranks_in_groups_bounded_in_memory_are_the_same(monkeypatch):
    """Layers whose Gram matrices would exceed the budget are solved in groups: the same values."""
    from neutreno.diagnostics import metrics

    layers = [torch.randn(B, N, D, generator=gen(s)) for s in range(80, 85)]
    expected = effective_ranks(layers)
    monkeypatch.setattr(metrics, "_GRAM_BYTES", 2 * B * D * D * 8)  # two layers a group: 2 + 2 + 1
    solved = []
    monkeypatch.setattr(metrics, "batched_eigvalsh", lambda m: solved.append(len(m)) or batched_eigvalsh(m))
    got = effective_ranks(layers)
    assert solved == [2, 2, 1] and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_solve_asked_for_one_thread_runs_on_one_even_beside_a_larger_pool(two_torch_threads, monkeypatch):
    """Several chunks a part, but one part a thread: a call asking for one thread never ran two solves at
    once on the two-thread pool an earlier call built (values unchanged either way)."""
    x = torch.randn(400, 65, 65, generator=gen(90), dtype=torch.float64)
    gram = x @ x.mT  # 13.5 MB: four chunks a part
    expected = batched_eigvalsh(gram, threads=2)  # builds (or keeps) a pool of at least two
    solve, lock, running, most = torch.linalg.eigvalsh, threading.Lock(), [0], [0]

    def counted(chunk):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.01)
            return solve(chunk)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(torch.linalg, "eigvalsh", counted)
    assert torch.equal(batched_eigvalsh(gram, threads=1), expected) and most[0] == 1
    most[0] = 0
    assert torch.equal(batched_eigvalsh(gram, threads=2), expected) and most[0] == 2


@pytest.fixture
def two_torch_threads():
    """torch on two intra-op threads for the test (the suite runs on one), restored after."""
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(own)


def test_eigenvalues_split_over_solver_threads_are_those_of_one_solve_on_one_thread(
    two_torch_threads, monkeypatch
):
    """batched_eigvalsh gives, bit for bit, torch.linalg.eigvalsh's values on a single thread, whatever
    the split and the caller's thread count (MKL's own threads round n ≥ 128 differently). Building
    its solver threads leaves the caller's thread count, and the count a new thread starts with, as
    they were; a larger pool replaces a smaller one, whose threads end."""
    from neutreno.diagnostics import metrics

    monkeypatch.setattr(metrics, "_solvers", None)  # the pool is built in this test
    earlier = set(threading.enumerate())  # an earlier test's pool, left running
    x = torch.randn(13, 6, 140, 150, generator=gen(12), dtype=torch.float64)
    gram = x @ x.mT
    torch.set_num_threads(1)
    expected = torch.linalg.eigvalsh(gram)
    torch.set_num_threads(2)
    for threads in (None, 1, 2, 3, 5):
        assert torch.equal(batched_eigvalsh(gram, threads=threads), expected), threads
    assert torch.equal(batched_eigvalsh(gram[0, 0]), expected[0, 0])  # one matrix, no batch dims
    assert batched_eigvalsh(gram[:0], threads=3).shape == (0, 6, 140)
    assert batched_eigvalsh(torch.zeros(3, 0, 0, dtype=torch.float64)).shape == (3, 0)
    started_with = []
    thread = threading.Thread(target=lambda: started_with.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == 2 and started_with == [2]
    solvers = [t for t in set(threading.enumerate()) - earlier if t.name.startswith("neutreno-eigvalsh")]
    deadline = time.monotonic() + 10  # a replaced pool's threads end once they see it shut down
    while sum(t.is_alive() for t in solvers) > 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(t.is_alive() for t in solvers) == 5  # the pool of 5; the smaller ones ended


def test_effective_rank_split_over_two_threads_is_the_reference(two_torch_threads):
    x = torch.randn(9, 65, 48, generator=gen(13))
    ranks = effective_rank(x, reduction="none")
    for b in range(len(x)):
        assert math.isclose(ranks[b].item(), ref_effective_rank(x[b].double().numpy()), rel_tol=1e-5)


FORKED_CHILD = """
import multiprocessing, torch
from neutreno.diagnostics.metrics import effective_rank
x = torch.randn(6, 20, 30, generator=torch.Generator().manual_seed(0))
expected = effective_rank(x, reduction="none")  # this process's solver threads exist now
def child(queue):
    queue.put(effective_rank(x, reduction="none").tolist())
context = multiprocessing.get_context("fork")
queue = context.Queue()
process = context.Process(target=child, args=(queue,))
process.start()
process.join(timeout=60)
if process.is_alive():
    process.kill()
    raise SystemExit("the forked child hung")
assert process.exitcode == 0 and queue.get(timeout=5) == expected.tolist()
print("ok")
"""


def test_effective_rank_runs_in_a_forked_child_of_a_process_whose_solver_threads_ran():
    """A forked child inherits the parent's thread pool object but none of its threads: it needs a pool
    of its own, or it waits forever on work no thread takes. (In a fresh process on one OpenMP thread:
    GNU OpenMP itself hangs a forked child after the parent ran a team of several.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_nonlocal_energy_is_resolved_where_attention_is_nearly_one_hot_on_its_diagonal():
    """‖v_i‖² + ‖v_j‖² − 2 v_i·v_j over every pair cancelled to float32 rounding noise where A is nearly
    one-hot on its diagonal: J 2e-5 for a true 9e-9, and negative values (J ≥ 0 by definition). The
    diagonal's distances are 0, so leaving it out keeps the relative precision of the off-diagonal
    weights. Reference: the loop of SPEC's sum, float64."""
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(2, H, N, 4, generator=generator)
    for boost in (20.0, 30.0, 40.0):
        scores = torch.randn(2, H, N, N, generator=generator) + boost * torch.eye(N)
        attn = scores.double().softmax(-1)
        values = nonlocal_energy(attn.float(), v, reduction="none")
        for b in range(2):
            expected = ref_nonlocal_energy(attn[b].numpy(), v[b].double().numpy())
            assert expected < 1e-3
            assert math.isclose(values[b].item(), expected, rel_tol=1e-4)


def test_float64_tokens_keep_their_precision():
    """The metrics computed float64 inputs in float32: a residual of 3e-13 of the norm came out 1e-7
    (float32's rounding of the mean), and tokens of 1e40 came out NaN. Reference: the float64 NumPy
    loops above."""
    generator = torch.Generator().manual_seed(1)
    base = torch.randn(1, 1, D, generator=generator, dtype=torch.float64).expand(B, N, D)
    for eps in (1e-9, 1e-12):
        x = base + eps * torch.randn(B, N, D, generator=generator, dtype=torch.float64)
        for b in range(B):
            xb = x[b].numpy()
            assert math.isclose(
                rank_residual(x, reduction="none")[b].item(), ref_rank_residual(xb, "fro"), rel_tol=1e-5
            )
            assert math.isclose(
                high_frequency_ratio(x, reduction="none")[b].item(),
                ref_high_frequency_ratio(xb),
                rel_tol=1e-5,
            )
    huge = 1e40 * torch.randn(B, N, D, generator=generator, dtype=torch.float64)
    assert rank_residual(huge).dtype == torch.float32
    assert math.isclose(
        rank_residual(huge, reduction="none")[0].item(),
        ref_rank_residual(huge[0].numpy(), "fro"),
        rel_tol=1e-6,
    )
    cos = token_cosine_similarity(huge, reduction="none")[0].item()
    assert math.isclose(cos, token_cosine_similarity(huge / 1e40, reduction="none")[0].item(), rel_tol=1e-6)
    # float64 entries whose squares leave float64's range: the Gram matrices were inf or 0, the rank NaN
    for scale in (1e160, 1e-170):
        ranks = effective_rank(scale * x, reduction="none")
        for b in range(B):
            assert math.isclose(ranks[b].item(), ref_effective_rank(x[b].numpy()), rel_tol=1e-5)


def test_masks_are_bool_or_zero_one_and_an_additive_mask_is_refused():
    """``mask.bool()`` turned an additive mask (0 keep, −1e9 pad) into its inverse: the metric was
    computed over the padding alone (cosine 0.9999 where the real tokens give 0.03), with no error."""
    x = torch.randn(B, N, D, generator=gen(2))
    mask = padding_mask()
    expected = token_cosine_similarity(x, mask)
    assert token_cosine_similarity(x, mask.long()) == expected  # Hugging Face's attention_mask
    assert token_cosine_similarity(x, mask.float()) == expected
    additive = torch.where(mask, 0.0, -1e9)
    for metric in (token_cosine_similarity, rank_residual, high_frequency_ratio, effective_rank):
        with pytest.raises(ValueError, match="mask must be bool"):
            metric(x, additive)
    attn = masked_softmax_attention(mask, seed=3)
    with pytest.raises(ValueError, match="mask must be bool"):
        nonlocal_energy(attn, torch.randn(B, H, N, 4), torch.where(mask, 0.0, -torch.inf))


def test_spectral_regime_refuses_non_finite_eigenvalues():
    """A NaN λ_H made every comparison with the maximum gain false: 'sharpen', with a dominant pair at
    λ_A = 1, which by the rule itself is 'smooth'."""
    lam_a = torch.tensor([1.0, 0.3], dtype=torch.complex64)
    for lam_h in ([0.5, math.nan], [math.inf, 0.5]):
        with pytest.raises(ValueError, match="finite"):
            spectral_regime(lam_a, torch.tensor(lam_h, dtype=torch.complex64))
    with pytest.raises(ValueError, match="finite"):
        spectral_regime(torch.tensor([1.0, math.nan]), torch.tensor([0.5]))

"""The attention family (math.md §2) against the explicit references in reference.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from neutreno import layers
from neutreno.layers import ATTENTION_TYPES, Attention, neutreno_projection
from neutreno.layers import attention as attention_class_module
from neutreno.layers import functional as attention_functional

from reference import heads_to_tensor, reference_attention

B, N, D, H = 2, 7, 24, 3


def make(attention="softmax", seed=0, **kw):
    torch.manual_seed(seed)
    attn = Attention(D, H, attention=attention, **kw)
    with torch.no_grad():  # non-trivial biases so a bias bug cannot hide
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return attn.eval()


def tokens(seed=1, n=N, batch=B):
    return torch.randn(batch, n, D, generator=torch.Generator().manual_seed(seed))


def first_layer_values(seed=2, n=N, batch=B):
    return torch.randn(batch, H, n, D // H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ATTENTION_TYPES)
@pytest.mark.parametrize("impl", ["fused", "explicit"])
def test_every_variant_matches_the_explicit_formula(attention, impl):
    attn = make(attention, impl=impl)
    x, v0 = tokens(), first_layer_values()
    y, v = attn(x, v0)
    y_ref, v_ref = reference_attention(attn, x, v0_heads=v0.double().unbind(1))
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v.double(), heads_to_tensor(v_ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", [a for a in ATTENTION_TYPES if a.endswith("neutreno")])
@pytest.mark.parametrize("learn_lam", [None, "head"])
def test_inference_adds_the_term_in_place_with_the_same_numbers(attention, learn_lam):
    """Without autograd the term is written into attend's output; the numbers are those of the
    out-of-place sum that training computes, and the inputs (x, V⁰) are left as they were."""
    attn = make(attention, learn_lam=learn_lam, lam=0.4 if learn_lam else None)
    x, v0 = tokens(), first_layer_values()
    kept = x.clone(), v0.clone()
    with torch.no_grad():
        y, _ = attn(x, v0)
    y_grad, _ = attn(x, v0)  # grad on (the parameters require it): the out-of-place path
    assert y_grad.requires_grad and torch.equal(y, y_grad)
    assert torch.equal(x, kept[0]) and torch.equal(v0, kept[1])


def test_neutreno_is_attention_output_plus_lambda_times_value_gap():
    """U = A V + λ(V⁰ − V), checked on the per-head output before W_O (paper Eq. 26)."""
    soft, neu = make("softmax"), make("neutreno", lam=0.37)
    x, v0 = tokens(), first_layer_values()
    y_soft, v = soft(x)
    y_neu, _ = neu(x, v0)
    # W_O is linear: the difference of the outputs is W_O applied to λ(V⁰ − V), without bias.
    gap = (0.37 * (v0 - v)).transpose(1, 2).reshape(B, N, D)
    torch.testing.assert_close(y_neu - y_soft, gap @ neu.proj.weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "pair", [("softmax", "neutreno"), ("symmetric", "sym_neutreno"), ("kernel", "kernel_neutreno")]
)
def test_lambda_zero_equals_the_plain_variant(pair):
    plain, neu = make(pair[0]), make(pair[1], lam=0.0)
    x, v0 = tokens(), first_layer_values()
    torch.testing.assert_close(neu(x, v0)[0], plain(x, v0)[0], atol=0, rtol=0)


def test_first_layer_has_no_term_and_defaults_are_the_papers():
    neu, soft = make("neutreno"), make("softmax")
    assert neu.lam == 0.6 and soft.lam == 0.0
    x = tokens()
    torch.testing.assert_close(neu(x)[0], soft(x)[0], atol=0, rtol=0)


def test_v0_is_not_detached_gradient_reaches_first_layer_value_projection():
    first, second = make("neutreno", seed=0), make("neutreno", seed=1)
    x1, x2 = tokens(1), tokens(3)  # second layer's input independent of the first layer
    _, v0 = first(x1)
    y, _ = second(x2, v0)
    y.square().sum().backward()
    grad = first.qkv.weight.grad
    assert grad[2 * D :].abs().sum() > 0, "no gradient reached W_V of the first layer through V⁰"
    # Through V⁰ alone, only the value rows of the first layer's qkv get a gradient.
    assert grad[: 2 * D].abs().sum() == 0


def test_symmetric_has_no_query_projection_and_scores_are_key_key():
    attn = make("symmetric")
    assert not hasattr(attn, "qkv") and attn.kv.weight.shape == (2 * D, D)
    x = tokens()
    with torch.no_grad():
        k = (x @ attn.kv.weight[:D].T + attn.kv.bias[:D]).view(B, N, H, D // H).transpose(1, 2)
        scores = k @ k.transpose(-2, -1)
    assert torch.allclose(scores, scores.transpose(-2, -1))  # K Kᵀ is symmetric before the softmax
    # and changing the would-be query rows cannot matter: there are none; the output is Eq. 14.
    y_ref, _ = reference_attention(attn, x)
    torch.testing.assert_close(attn(x)[0].double(), y_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_attention_equals_its_quadratic_formula(causal, padded):
    attn = make("kernel")
    x = tokens()
    mask = torch.tensor([[True] * N, [True] * (N - 3) + [False] * 3]) if padded else None
    y, _ = attn(x, key_padding_mask=mask, is_causal=causal)
    y_ref, _ = reference_attention(attn, x, key_padding_mask=mask, causal=causal)
    keep = mask if mask is not None else torch.ones(B, N, dtype=torch.bool)
    torch.testing.assert_close(y.double()[keep], y_ref[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_attention_of_small_kernel_values_is_still_a_weighted_average(causal):
    """The normaliser was floored at 1e-6 on every row: where q and k are strongly negative the kernel
    sums fall below it, and the outputs shrank towards 0 (to 0.1% of the right ones at biases −12),
    and the weights no longer summed to 1. Normalised weights do not depend on the kernel's scale."""
    from neutreno.layers.functional import kernel_attention, kernel_weights

    attn = make("kernel").double()
    with torch.no_grad():
        attn.qkv.bias[: 2 * D] = -12.0  # q and k: φ = exp(t) ≈ 6e-6 per dimension
    x = tokens().double()
    y_ref, _ = reference_attention(attn, x, causal=causal)
    torch.testing.assert_close(attn(x, is_causal=causal)[0], y_ref, atol=1e-9, rtol=1e-7)
    q, k = (torch.randn(B, H, N, D // H, dtype=torch.float64) - 12 for _ in range(2))
    weights = kernel_weights(q, k, is_causal=causal)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, N, dtype=torch.float64))
    v = torch.randn(B, H, N, D // H, dtype=torch.float64)
    torch.testing.assert_close(kernel_attention(q, k, v, is_causal=causal), weights @ v)
    # a query that sees no key (all keys padded): 0, not NaN
    none = kernel_attention(q, k, v, key_padding_mask=torch.zeros(B, N, dtype=torch.bool))
    assert not none.isnan().any() and not none.any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_attention_in_half_precision_does_not_overflow_at_length(causal, dtype):
    """The normaliser φ(q_i)·Σ_j φ(k_j) grows as d·N: in float16 it passed 65,504 at N = 1,024, d = 64,
    and every output row came out exactly 0 (finite, no error). Against the float64 weights of
    reference.py, as float16 inputs and as a float32 layer under autocast."""
    from neutreno.layers.functional import kernel_attention

    from reference import allowed, kernel_weights

    torch.manual_seed(0)
    n, d = 1024, 64
    q, k, v = (torch.randn(1, 1, n, d) for _ in range(3))
    expected = kernel_weights(q.double(), k.double(), allowed(n, causal=causal)) @ v.double()
    out = kernel_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=causal)
    assert out.dtype == dtype
    tolerance = 4 * torch.finfo(dtype).eps * expected.abs().max()
    assert (out.double() - expected).abs().max() < tolerance
    attn = Attention(3 * d, 3, attention="kernel").eval()
    x = torch.randn(1, n, 3 * d) * 3
    with torch.no_grad():
        y32, _ = attn(x, is_causal=causal)
        with torch.autocast("cpu", dtype=dtype):
            y, _ = attn(x, is_causal=causal)
    assert (y.float() - y32).abs().max() < 8 * torch.finfo(dtype).eps * y32.abs().max()


MASKS = {
    "none": (None, False),
    "causal": (None, True),
    "padding": (torch.tensor([[True] * N, [True] * 4 + [False] * (N - 4)]), False),
    "padding+causal": (torch.tensor([[True] * N, [True] * 4 + [False] * (N - 4)]), True),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("attention", ["softmax", "neutreno", "sym_neutreno"])
@pytest.mark.parametrize("attnscale", [False, True])
def test_fused_and_explicit_paths_agree(mask_name, attention, attnscale):
    """Tolerances: fp32 paths within 2e-6 of each other and 1e-5 of the float64 reference; each bf16
    path within 1.5e-2 relative (Frobenius) error of fp32 (bf16 keeps 8 mantissa bits, ~4e-3 per
    rounding, and the inputs, weights, scores and outputs are each rounded once)."""
    key_padding_mask, causal = MASKS[mask_name]
    fused = make(attention, impl="fused", attnscale=attnscale)
    explicit = make(attention, impl="explicit", attnscale=attnscale)
    if attnscale:
        with torch.no_grad():
            fused.attnscale.omega.copy_(torch.tensor([0.5, -0.3, 1.2]))
            explicit.attnscale.omega.copy_(fused.attnscale.omega)
    x, v0 = tokens(), first_layer_values()
    keep = key_padding_mask if key_padding_mask is not None else torch.ones(B, N, dtype=torch.bool)
    kw = dict(key_padding_mask=key_padding_mask, is_causal=causal)
    y_fused, y_explicit = fused(x, v0, **kw)[0], explicit(x, v0, **kw)[0]
    torch.testing.assert_close(y_fused[keep], y_explicit[keep], atol=2e-6, rtol=2e-6)
    y_ref, _ = reference_attention(
        fused, x, v0.double().unbind(1), key_padding_mask, causal,
        fused.attnscale.omega.detach() if attnscale else None,
    )  # fmt: skip
    torch.testing.assert_close(y_fused.double()[keep], y_ref[keep], atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b_fused, b_explicit = fused(x, v0, **kw)[0], explicit(x, v0, **kw)[0]
    assert b_fused.dtype == b_explicit.dtype == torch.bfloat16
    for low in (b_fused, b_explicit):
        error = (low.float()[keep] - y_fused[keep]).norm() / y_fused[keep].norm()
        assert error < 1.5e-2, f"bf16 relative error {error:.2e}"


def test_the_explicit_path_takes_16_bit_scores_in_float32_as_the_fused_kernel_does():
    """Rounded to bfloat16, a score near 32 moves by up to 0.125 and its weight by 13%: the explicit
    path's error grew with the scores (5.7e-2 of the output, the fused kernel's 2e-3), and auto takes it
    for bf16 training on CPUs; float16 scores past 65,504 were inf, the outputs NaN. Against the float64
    reference on the same 16-bit inputs, forward and gradients."""
    from neutreno.layers.functional import softmax_attention

    from reference import softmax_weights as reference_weights

    torch.manual_seed(0)
    d, n = 64, 197
    shift = torch.zeros(d)
    shift[0] = (32 * d**0.5) ** 0.5  # every score moved by ~32, which softmax ignores
    q, k = ((shift + torch.randn(2, 3, n, d)).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, n, d).bfloat16().requires_grad_()
    grad = torch.randn(2, 3, n, d)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference_weights(*exact[:2], 1.0) @ exact[2]
    expected_grads = torch.autograd.grad(expected, exact, grad.double())
    errors = {}
    for impl in ("fused", "explicit"):
        out = softmax_attention(q, k, v, impl=impl)
        grads = torch.autograd.grad(out, (q, k, v), grad.bfloat16())
        errors[impl] = [
            ((got.double() - want).norm() / want.norm()).item()
            for got, want in zip((out, *grads), (expected, *expected_grads), strict=True)
        ]
    assert max(errors["explicit"]) < 5e-3, errors  # output, dq, dk, dv: each ~3e-3, bf16's own rounding
    assert max(errors["explicit"]) < 1.5 * max(errors["fused"]), errors
    big = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    big[..., 0] = 2000.0 + torch.arange(4)  # scores of 5e5: past float16's range, not its inputs'
    values = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    expected = reference_weights(big, big, 1.0) @ values
    for impl in ("fused", "explicit"):
        out = softmax_attention(big.half(), big.half(), values.half(), impl=impl)
        torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2e-3)


def test_paths_agree_on_gradients():
    fused, explicit = make("neutreno", impl="fused"), make("neutreno", impl="explicit")
    x = tokens().requires_grad_()
    for attn in (fused, explicit):
        y, _v = attn(x, first_layer_values())
        y.square().sum().backward()
    g_fused, g_explicit = fused.qkv.weight.grad, explicit.qkv.weight.grad
    assert (g_fused - g_explicit).norm() / g_fused.norm() < 1e-5  # fp32 summation-order noise


def test_auto_uses_the_explicit_product_for_cpu_bf16_and_fused_for_fp32(monkeypatch):
    """On a CPU of a measured profile (Intel AMX; the table says the explicit product is faster in bf16
    training at this length, the fused kernel in fp32): pinned, so that the test does not depend on the
    CPU it runs on (an AVX2 CPU has no entry and is fused throughout)."""
    monkeypatch.setattr(attention_functional, "CPU_PROFILE", "amx_bf16")
    calls = []
    real = F.scaled_dot_product_attention
    counted = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(attention_functional.F, "scaled_dot_product_attention", counted)
    attn = make("neutreno")
    attn(tokens())
    assert calls == [1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(tokens())
    assert calls == [1]


@pytest.mark.parametrize("attention", ATTENTION_TYPES)
def test_padding_does_not_change_real_tokens(attention):
    """Outputs on real tokens equal those of the unpadded sequence, whatever the padding holds."""
    attn = make(attention)
    real = 4
    x = tokens(n=real, batch=1)
    v0 = first_layer_values(n=real, batch=1)
    y_short, _ = attn(x, v0)
    mask = torch.tensor([[True] * real + [False] * (N - real)])
    for junk_seed in (5, 6):
        junk = torch.randn(1, N - real, D, generator=torch.Generator().manual_seed(junk_seed)) * 100
        x_pad = torch.cat([x, junk], dim=1)
        v0_pad = torch.cat([v0, first_layer_values(seed=junk_seed, n=N - real, batch=1)], dim=2)
        y_pad, _ = attn(x_pad, v0_pad, key_padding_mask=mask)
        assert torch.isfinite(y_pad).all()
        torch.testing.assert_close(y_pad[:, :real], y_short, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ATTENTION_TYPES)
@pytest.mark.parametrize("impl", ["fused", "explicit"])
def test_causal_mask_blocks_the_future(attention, impl):
    attn = make(attention, impl=impl, featscale=True)
    with torch.no_grad():
        attn.featscale.dc.fill_(0.5)  # FeatScale's DC must be a running mean under a causal mask
    x, v0 = tokens(), first_layer_values()
    y, _ = attn(x, v0, is_causal=True)
    x2, v02 = x.clone(), v0.clone()
    x2[:, 4:] += 10.0
    v02[:, :, 4:] -= 10.0
    y2, _ = attn(x2, v02, is_causal=True)
    torch.testing.assert_close(y2[:, :4], y[:, :4], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y2[:, 4:], y[:, 4:])


def test_padded_and_causal_rows_stay_finite():
    attn = make("neutreno")
    mask = torch.tensor([[False, False] + [True] * (N - 2)] * B)  # left padding: first rows see nothing
    y, _ = attn(tokens(), first_layer_values(), key_padding_mask=mask, is_causal=True)
    assert torch.isfinite(y).all()


def test_featscale_and_attnscale_are_the_identity_at_init():
    plain = make("neutreno", seed=0)
    scaled = Attention(D, H, attention="neutreno", featscale=True, attnscale=True).eval()
    scaled.load_state_dict(plain.state_dict(), strict=False)
    for p in (scaled.featscale.dc, scaled.featscale.hc, scaled.attnscale.omega):
        assert p.requires_grad and (p == 0).all()
    x, v0 = tokens(), first_layer_values()
    torch.testing.assert_close(scaled(x, v0)[0], plain(x, v0)[0], atol=1e-6, rtol=1e-6)


def test_featscale_adds_scaled_dc_and_hc_once():
    plain = make("softmax", seed=0)
    scaled = Attention(D, H, featscale=True).eval()
    scaled.load_state_dict(plain.state_dict(), strict=False)
    s1, s2 = torch.linspace(-1, 1, D), torch.linspace(0.5, -0.2, D)
    with torch.no_grad():
        scaled.featscale.dc.copy_(s1)
        scaled.featscale.hc.copy_(s2)
    x = tokens()
    y = plain(x)[0]
    dc = y.sum(dim=1, keepdim=True) / N
    expected = y + s1 * dc + s2 * (y - dc)
    torch.testing.assert_close(scaled(x)[0], expected, atol=1e-5, rtol=1e-5)


def test_attention_dropout_leaves_the_neutreno_term_alone():
    """With every attention weight dropped, only λ(V⁰ − V) reaches W_O."""
    attn = make("neutreno", impl="explicit", attn_drop=1.0).train()
    x, v0 = tokens(), first_layer_values()
    y, v = attn(x, v0)
    u = (0.6 * (v0 - v)).transpose(1, 2).reshape(B, N, D)
    torch.testing.assert_close(y, attn.proj(u), atol=1e-6, rtol=1e-6)


def test_attention_dropout_is_an_nn_dropout_that_loops_over_dropouts_reach():
    """Attention dropout was a float on the layer: setting every nn.Dropout's p to 0 (timm's and
    PyTorch users' way to turn dropout off) left it on, and timm's attn.attn_drop.p raised. It is a
    Dropout module now, on both paths, with no state (a softmax model's keys are unchanged)."""
    from neutreno import create_model

    for impl in ("fused", "explicit"):
        model = create_model("vit_digits", attention="neutreno", attn_drop_rate=0.3, attn_impl=impl).train()
        images = torch.rand(2, 1, 8, 8)
        assert not torch.equal(model(images), model(images))  # dropout is on
        assert {m.attn.attn_drop.p for m in model.blocks} == {0.3}
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        assert torch.equal(model(images), model(images)), impl
    assert set(create_model("vit_digits").state_dict()) == set(
        create_model("vit_digits", attn_drop_rate=0.3).state_dict()
    )


def test_bad_arguments_are_clear_errors():
    with pytest.raises(
        ValueError, match="valid: softmax, neutreno, symmetric, sym_neutreno, kernel, kernel_neutreno"
    ):
        Attention(D, H, attention="linear")
    with pytest.raises(ValueError, match="has no NeuTRENO term"):
        Attention(D, H, attention="softmax", lam=0.5)
    with pytest.raises(ValueError, match="lam must be a finite number >= 0"):
        Attention(D, H, attention="neutreno", lam=-1)
    # beyond float32 (a checkpoint's metadata, --set model.lam=1e300): accepted, then a forward's traceback
    for lam in (1e300, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"lam must be a finite number >= 0 \(at most 3.403e\+38\)"):
            Attention(D, H, attention="neutreno", lam=lam)
    with pytest.raises(ValueError, match="not divisible"):
        Attention(25, H)
    with pytest.raises(ValueError, match="impl"):
        Attention(D, H, impl="flash")
    with pytest.raises(ValueError, match="kernel attention"):
        Attention(D, H, attention="kernel", attn_drop=0.1)
    for attention in ("softmax", "kernel"):
        with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
            make(attention)(tokens(), key_padding_mask=torch.ones(B, N))
    # the functional forms: an (N, N) mask for a batch of 1 broadcast to a batch of N (explicit, kernel)
    q = torch.randn(1, H, N, D // H)
    wrong = torch.ones(N, N, dtype=torch.bool)
    for attend in (
        lambda: attention_functional.softmax_attention(q, q, q, key_padding_mask=wrong, impl="explicit"),
        lambda: attention_functional.kernel_attention(q, q, q, key_padding_mask=wrong),
        # the weights for analysis: (N, N, N) weights for a batch of 1, no error
        lambda: attention_functional.kernel_weights(q, q, key_padding_mask=wrong),
        lambda: make("softmax").weights_from_qk(q, q, key_padding_mask=wrong),
        lambda: make("kernel").weights_from_qk(q, q, key_padding_mask=wrong),
        lambda: make("softmax").attention_weights(tokens()[:1], key_padding_mask=wrong),
        lambda: make("kernel").attention_weights(tokens()[:1], key_padding_mask=wrong),
    ):
        with pytest.raises(ValueError, match=rf"key_padding_mask must be a bool tensor of shape \(1, {N}\)"):
            attend()
    # the public FeatScale and AttnScale modules broadcast another batch's mask into outputs of that batch
    from neutreno.layers import AttnScale, FeatScale

    mask = torch.ones(3, N, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"key_padding_mask must be a bool tensor of shape \(1, {N}\)"):
        FeatScale(D)(tokens()[:1], mask)
    weights = torch.rand(1, H, N, N).softmax(-1)
    for bad in (mask[:, None, None, :], mask[:, None, None, :].float()):
        with pytest.raises(
            ValueError, match=r"mask must be bool and broadcast to the weights \(1, 3, 7, 7\)"
        ):
            AttnScale(H)(weights, bad)
    assert AttnScale(H)(weights, mask[:1, None, None, :]).shape == weights.shape


def test_neutreno_projection_matches_plain_autograd():
    """The memory-saving W_O(U + λ(V⁰ − V)) gives the plain formula's values and gradients."""
    g = torch.Generator().manual_seed(0)
    u, v, v0 = (torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    proj = torch.nn.Linear(6, 4).double()
    torch.autograd.gradcheck(lambda *t: neutreno_projection(*t, 0.7, proj), (u, v, v0))
    upstream = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    ours = neutreno_projection(u, v, v0, 0.7, proj)
    grads_ours = torch.autograd.grad(ours, (u, v, v0, proj.weight, proj.bias), upstream)
    plain = (u + 0.7 * (v0 - v)) @ proj.weight.T + proj.bias
    grads_plain = torch.autograd.grad(plain, (u, v, v0, proj.weight, proj.bias), upstream)
    torch.testing.assert_close(ours, plain)
    for a, b in zip(grads_ours, grads_plain, strict=True):
        torch.testing.assert_close(a, b)


def test_a_rebuilt_input_is_refused_to_a_layer_that_is_not_a_plain_linear():
    # its backward is a plain linear's: a subclass with other arithmetic would get wrong gradients
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    u, v, v0 = (torch.randn(2, 5, 6) for _ in range(3))
    with pytest.raises(TypeError, match=r"Scaled is not an nn\.Linear"):
        neutreno_projection(u, v, v0, 0.7, Scaled(6, 4))


class LoRA(torch.nn.Module):
    """A low-rank adapter around a linear layer, as PEFT puts one."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(D, 2, bias=False, dtype=base.weight.dtype)
        self.up = torch.nn.Linear(2, D, bias=False, dtype=base.weight.dtype)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _global_forward_hook(attn, calls):
    def record(module, args, output):
        if module is attn.proj:
            calls.append("forward")

    return torch.nn.modules.module.register_module_forward_hook(record)


# Each makes W_O more than F.linear of its weights; returns a handle to remove, if any.
W_O_CHANGES = {
    "LoRA wrapper": lambda attn, calls: setattr(attn, "proj", LoRA(attn.proj)),
    "weight norm": lambda attn, calls: torch.nn.utils.parametrizations.weight_norm(attn.proj) and None,
    "forward hook": lambda attn, calls: attn.proj.register_forward_hook(lambda *_: calls.append("forward")),
    "backward hook": lambda attn, calls: attn.proj.register_full_backward_hook(
        lambda *_: calls.append("backward")
    ),
    "global forward hook": _global_forward_hook,
}
HOOK_CALLS = {"forward hook": ["forward"], "backward hook": ["backward"], "global forward hook": ["forward"]}


@pytest.mark.parametrize("change", list(W_O_CHANGES))
def test_a_w_o_that_is_more_than_a_linear_is_called_as_itself(change):
    """The memory-saving W_O computes F.linear from the weights, which is right for a bare nn.Linear
    only. A LoRA wrapper or weight norm on W_O made NeuTRENO training fail (TypeError), and hooks
    (pruning's mask, recorded activations or gradients) were skipped without a word: now such a W_O
    is called, with the formula's values and gradients, and its hooks run."""
    attn = make("neutreno", impl="fused").train().double()  # float64: the two sums round alike
    calls = []
    handle = W_O_CHANGES[change](attn, calls)
    try:
        with torch.no_grad():  # LoRA's up-projection off zero, so that it counts
            for p in attn.proj.parameters():
                p.add_(0.1)
        x, v0 = tokens().double().requires_grad_(), first_layer_values().double().requires_grad_()
        y, _ = attn(x, v0)
        y.square().sum().backward()
        assert calls == HOOK_CALLS.get(change, [])
        params = [x, v0, *attn.parameters()]
        ours = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        # the formula by hand, W_O called as a module: proj(U + λ(V⁰ − V))
        q, k, v = attn.project(x)
        u = F.scaled_dot_product_attention(q, k, v)
        merge = layers.attention.merge_heads
        expected = attn.proj(merge(u) + attn.lam * (merge(v0) - merge(v)))
        expected.square().sum().backward()
    finally:
        if handle is not None:
            handle.remove()
    torch.testing.assert_close(y, expected)
    for a, p in zip(ours, params, strict=True):
        torch.testing.assert_close(a, p.grad)


@pytest.mark.parametrize("attention", ["neutreno", "sym_neutreno"])
def test_a_gradient_penalty_through_the_memory_saving_w_o_has_its_second_derivative(attention):
    """A penalty on W_O's weight gradient (create_graph=True, as in a gradient-penalty or
    meta-learning loss): the memory-saving W_O's backward was once-differentiable, so g_W came back
    without a graph and the penalty's term in every other gradient was silently dropped (qkv's
    gradient 19 instead of 905 in the audit's case). Reference: W_O called on the sum by hand."""
    attn = make(attention, impl="fused").train().double()
    x, v0 = tokens().double().requires_grad_(), first_layer_values().double().requires_grad_()
    readout = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    params = [x, v0, *attn.parameters()]

    def penalized_gradients(y: torch.Tensor) -> list[torch.Tensor]:
        loss = (y * readout).sum()
        (g_w,) = torch.autograd.grad(loss, attn.proj.weight, create_graph=True)
        return torch.autograd.grad(loss + g_w.square().sum(), params)

    y, _ = attn(x, v0)
    ours = penalized_gradients(y)
    # the formula by hand: proj(U + λ(V⁰ − V)), W_O a plain module call
    q, k, v = attn.project(x)
    u = F.scaled_dot_product_attention(q, k, v)
    merge = layers.attention.merge_heads
    expected = penalized_gradients(attn.proj(merge(u) + attn.lam * (merge(v0) - merge(v))))
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("attention", ["softmax", "neutreno", "symmetric", "kernel_neutreno"])
def test_explicit_attention_has_a_second_derivative_through_its_inputs(attention):
    """A penalty on the input gradient differentiates the attention's backward itself; PyTorch's fused
    kernels have no such derivative, so the layer's docs send it to ``impl="explicit"``. gradgradcheck
    against finite differences, float64."""
    attn = make(attention, impl="explicit").double()
    v0 = first_layer_values().double()[:1, :, :4]
    x = tokens().double()[:1, :4].requires_grad_()

    def forward(x):
        return attn(x, v0)[0] if attn.lam else attn(x)[0]

    assert torch.autograd.gradgradcheck(forward, (x,))


def test_neutreno_projection_under_bf16_autocast(monkeypatch):
    def plain(u, v, v0, lam, proj):
        return proj(u + lam * (v0 - v))

    grads = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(attention_class_module, "neutreno_projection", plain)
        attn = make("neutreno", impl="fused")
        x, v0 = tokens(), first_layer_values().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = attn(x, v0)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        assert attn.proj.weight.grad.dtype == torch.float32
        grads.append([attn.proj.weight.grad, attn.proj.bias.grad, attn.qkv.weight.grad, v0.grad])
    for ours, ref in zip(*grads, strict=True):
        assert (ours - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("attention", ATTENTION_TYPES)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_attention_weights_reproduce_the_forward(attention, mask_name):
    """W_O(A V + λ(V⁰ − V)) with the returned A equals the layer's output; rows of A sum to 1."""
    key_padding_mask, causal = MASKS[mask_name]
    attn = make(attention, attnscale=True)
    with torch.no_grad():
        attn.attnscale.omega.copy_(torch.tensor([0.5, -0.3, 1.2]))
    x, v0 = tokens(), first_layer_values()
    kw = dict(key_padding_mask=key_padding_mask, is_causal=causal)
    weights = attn.attention_weights(x, **kw)
    _, _, v = attn.project(x)
    u = weights @ v + attn.lam * (v0 - v)
    _, w_o = attn.value_output_weights()  # nn.Linear convention (spectral variants: Λ Q_oᵀ, no bias)
    bias = attn.proj.bias if hasattr(attn, "proj") else 0
    expected = u.transpose(1, 2).reshape(B, N, D) @ w_o.T + bias
    keep = key_padding_mask if key_padding_mask is not None else torch.ones(B, N, dtype=torch.bool)
    torch.testing.assert_close(attn(x, v0, **kw)[0][keep], expected[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, N), atol=1e-5, rtol=0)


def test_each_name_builds_its_class_and_the_class_alone_builds_the_same_layer():
    """Attention(..., attention=name) is the class of the explicit table; built directly, that class
    gives the same parameters and outputs; a name of another class is refused."""
    expected = {
        "softmax": "Attention",
        "neutreno": "Attention",
        "symmetric": "SymmetricAttention",
        "sym_neutreno": "SymmetricAttention",
        "kernel": "KernelAttention",
        "kernel_neutreno": "KernelAttention",
        "eigen_neg": "SpectralAttention",
        "eigen_neg_neutreno": "SpectralAttention",
        "eigen_pos": "SpectralAttention",
        "eigen_pos_neutreno": "SpectralAttention",
    }
    assert set(ATTENTION_TYPES) == set(expected)
    x, v0 = tokens(), first_layer_values()
    for name, cls_name in expected.items():
        via_name = make(name)
        assert type(via_name).__name__ == cls_name
        torch.manual_seed(0)
        direct = getattr(layers, cls_name)(D, H, attention=name)
        direct.load_state_dict(via_name.state_dict())
        torch.testing.assert_close(direct.eval()(x, v0)[0], via_name(x, v0)[0])
        assert via_name.lam == (0.6 if name.endswith("neutreno") else 0.0)
    with pytest.raises(ValueError, match="built by KernelAttention, not by SymmetricAttention"):
        layers.SymmetricAttention(D, H, attention="kernel")
    # a subclass named after its base's attention (every class is an Attention: these were built, the
    # spectral one computing eigen_pos attention labelled "neutreno")
    for cls, name in ((layers.SpectralAttention, "neutreno"), (layers.SymmetricAttention, "softmax")):
        with pytest.raises(ValueError, match=f"built by Attention, not by {cls.__name__}"):
            cls(D, H, attention=name)
    with pytest.raises(ValueError, match="unknown attention 'neutrino'"):
        Attention(D, H, attention="neutrino")


def test_checkpoints_from_before_featscale_and_attnscale_were_modules_still_load(tmp_path):
    """Earlier releases stored the gains as ``…attn.featscale_dc`` / ``featscale_hc`` /
    ``attnscale_omega``; such a file loads into today's model with the same outputs."""
    from neutreno.models import create_model, load_model, save_model
    from neutreno.models.checkpoint import load_state_dict_checked

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_32", attention="neutreno", featscale=True, attnscale=True).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "scale" in name:
                p.normal_(0, 0.5)
    new_to_old = {
        ".featscale.dc": ".featscale_dc",
        ".featscale.hc": ".featscale_hc",
        ".attnscale.omega": ".attnscale_omega",
    }
    old_state = {}
    for key, value in model.state_dict().items():
        for new, old in new_to_old.items():
            key = key.replace(new, old)
        old_state[key] = value
    assert "blocks.0.attn.featscale_dc" in old_state and "blocks.0.attn.featscale.dc" not in old_state
    save_model(tmp_path / "new.safetensors", model)
    fresh, _ = load_model(tmp_path / "new.safetensors")
    load_state_dict_checked(fresh, old_state, "old.safetensors")
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(fresh.eval()(images), model(images))
    fresh2 = create_model("vit_tiny_patch4_32", attention="neutreno", featscale=True, attnscale=True).eval()
    fresh2.load_state_dict(dict(old_state))  # plain load_state_dict renames them too
    torch.testing.assert_close(fresh2(images), model(images))


def test_parameter_order_and_seeded_weights_are_those_of_earlier_releases():
    """Optimizer states are matched to parameters by position, so a run resumed from an earlier
    release's checkpoint needs the same order: AttnScale's ω and FeatScale's gains first (they were
    the layer's own parameters), and the spectral value/output map before ``qk`` (which also makes a
    seed give the weights it gave)."""
    names = [n for n, _ in make("neutreno", featscale=True, attnscale=True).named_parameters()]
    earlier = [
        "attnscale_omega",
        "featscale_dc",
        "featscale_hc",
        "qkv.weight",
        "qkv.bias",
        "proj.weight",
        "proj.bias",
    ]
    assert [n.replace(".", "_", 1) if "scale" in n else n for n in names] == earlier
    names = [n for n, _ in make("eigen_neg_neutreno").named_parameters()]
    assert names == ["value_output.theta", "value_output.psi", "qk.weight", "qk.bias"]
    torch.manual_seed(0)
    spectral = Attention(D, H, attention="eigen_pos")
    torch.manual_seed(0)
    alone = layers.SpectralValueOutput(D, 1)  # what the seed gave the first parameters before
    torch.testing.assert_close(spectral.value_output.theta, alone.theta, rtol=0, atol=0)
    torch.testing.assert_close(spectral.value_output.psi, alone.psi, rtol=0, atol=0)


def test_attention_subclasses_build_with_their_own_default_name():
    class Mine(Attention):  # a user's subclass is softmax attention unless told otherwise
        pass

    assert Mine(D, H).attention == "softmax" and type(Attention(D, H)) is Attention
    assert Mine(D, H, attention="neutreno").lam == 0.6  # a subclass of Attention takes its names
    assert layers.SymmetricAttention(D, H).attention == "symmetric"
    assert layers.KernelAttention(D, H).attention == "kernel"
    assert layers.SpectralAttention(D, H, attention="eigen_pos_neutreno").lam == 0.6


def test_spectral_attention_computes_its_orthogonal_factor_once_per_call(monkeypatch):
    attn = make("eigen_neg_neutreno")
    calls = []
    real = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, v0 = tokens(), first_layer_values()
    attn(x, v0)
    assert len(calls) == 1 and attn.value_output._orthogonal is None


def test_names_of_earlier_releases_still_import_with_a_deprecation_warning():
    with pytest.deprecated_call():
        from neutreno.layers import resolve_attention
    assert resolve_attention("sym_neutreno", None) == ("symmetric", 0.6)
    assert resolve_attention("kernel", None) == ("kernel", 0.0)
    assert resolve_attention("eigen_pos_neutreno", 0.3) == ("softmax", 0.3)
    with pytest.deprecated_call():
        from neutreno.layers.attention import LM_DEFAULT_LAM
    assert LM_DEFAULT_LAM == 0.4
    with pytest.raises(ImportError):
        from neutreno.layers import resolve_nothing  # noqa: F401


# ------------------------------------------------------------- impl="auto": the path measured faster

FAKE_TABLE = {  # a made-up CPU profile: explicit 3× faster for short bf16 training, slower elsewhere
    "fake": {
        "cases": {
            "bfloat16/train": [
                {"tokens": 64, "explicit_speedup": 3.0},
                {"tokens": 1024, "explicit_speedup": 0.7},
            ],
            "bfloat16/infer": [
                {"tokens": 64, "explicit_speedup": 1.05},
                {"tokens": 1024, "explicit_speedup": 0.3},
            ],
        }
    }
}


@pytest.fixture
def fake_cpu(monkeypatch):
    from neutreno.layers import functional

    monkeypatch.setattr(functional, "CPU_PROFILE", "fake")
    monkeypatch.setattr(functional, "MEASURED_PATHS", FAKE_TABLE)


def test_auto_picks_the_path_measured_faster_at_the_nearest_length(fake_cpu):
    from neutreno.layers.functional import choose_softmax_impl

    cpu = torch.device("cpu")
    picks = [
        choose_softmax_impl(cpu, torch.bfloat16, n, training=True) for n in (17, 64, 200, 300, 1024, 4096)
    ]
    assert picks == [
        "explicit",
        "explicit",
        "explicit",
        "fused",
        "fused",
        "fused",
    ]  # 256 = the crossing on a log scale
    assert choose_softmax_impl(cpu, torch.bfloat16, 64, training=False) == "fused"  # 1.05×: within the margin
    assert choose_softmax_impl(cpu, torch.float32, 64, training=True) == "fused"  # not measured: fused
    assert choose_softmax_impl(torch.device("meta"), torch.bfloat16, 64) == "fused"  # not a CPU: fused


def test_auto_picks_the_log_nearest_run_of_the_shipped_table_and_compiles_at_any_length(monkeypatch):
    """The pick is the measured run nearest on a log scale (checked against min(|log(t/n)|) at every
    length to 5,000, for every shipped case), written so that a compiler can trace it with a symbolic
    length: min(key=log) failed under torch.compile(fullgraph=True) at the second length and under
    torch.export, and broke the graph otherwise."""
    import math

    from neutreno.layers import functional

    cpu = torch.device("cpu")
    for profile, entry in functional.measured_paths().items():
        monkeypatch.setattr(functional, "CPU_PROFILE", profile)
        for case, runs in entry["cases"].items():
            dtype, training = getattr(torch, case.split("/")[0]), case.endswith("/train")
            for n in range(1, 5001):
                nearest = min(runs, key=lambda run: abs(math.log(run["tokens"] / n)))
                expected = (
                    "explicit" if nearest["explicit_speedup"] > functional._EXPLICIT_MARGIN else "fused"
                )
                assert functional.choose_softmax_impl(cpu, dtype, n, training) == expected, (profile, case, n)
    monkeypatch.setattr(functional, "CPU_PROFILE", "amx_bf16")  # a profile the table measured
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Attention(32, 4, attention="neutreno") for _ in range(2)])

    def forward(x: torch.Tensor) -> torch.Tensor:
        y, v0 = layers[0](x)
        return layers[1](x + y, v0)[0]

    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend="eager")
    for n in (5, 9, 300):  # lengths on both sides of a measured run
        x = torch.randn(2, n, 32)
        torch.testing.assert_close(compiled(x), forward(x), rtol=0, atol=0)


def test_the_shipped_table_covers_this_profile_and_names_its_source():
    from neutreno.layers.functional import measured_paths

    assert {"amx_bf16", "avx512_bf16"} <= set(measured_paths())  # an unreadable table reads as {}
    for profile, entry in measured_paths().items():
        assert entry["measured_on"] and entry["cases"], profile
        for runs in entry["cases"].values():
            assert all(run["tokens"] > 0 and run["explicit_speedup"] > 0 for run in runs)


@pytest.mark.parametrize("training", [True, False])
def test_auto_is_exactly_the_path_it_picks(fake_cpu, monkeypatch, training):
    """A bf16 NeuTRENO layer with impl="auto" gives bit for bit the output (and gradient) of the path
    the rule picks for its mode, and that path agrees with the other one to bf16 rounding."""
    from neutreno.layers import attention as attention_module

    picked = []
    choose = attention_module.choose_softmax_impl
    monkeypatch.setattr(
        attention_module, "choose_softmax_impl", lambda *a, **k: picked.append(choose(*a, **k)) or picked[-1]
    )
    x, v0 = torch.randn(B, N, D), torch.randn(B, H, N, D // H)
    layers = {impl: make("neutreno", impl=impl).to(torch.bfloat16) for impl in ("auto", "fused", "explicit")}
    outputs = {}
    for impl, layer in layers.items():
        inputs = x.to(torch.bfloat16).requires_grad_(training)
        with torch.set_grad_enabled(training):
            y = layer(inputs, v0.to(torch.bfloat16))[0]
            if training:
                y.float().square().sum().backward()
        outputs[impl] = (y.detach(), inputs.grad)
    assert picked == ["explicit" if training else "fused"]  # N = 7 tokens, nearest 64: by mode
    chosen = outputs[picked[0]]
    assert torch.equal(outputs["auto"][0], chosen[0])
    if training:
        assert torch.equal(outputs["auto"][1], chosen[1])
    torch.testing.assert_close(outputs["fused"][0], outputs["explicit"][0], atol=3e-2, rtol=3e-2)


def test_auto_takes_an_empty_sequence_like_the_paths_do():
    from neutreno.layers.functional import softmax_attention

    q = torch.randn(1, 2, 0, 8, dtype=torch.bfloat16)
    for impl in ("auto", "fused", "explicit"):
        assert softmax_attention(q, q, q, impl=impl).shape == (1, 2, 0, 8)


@pytest.mark.parametrize("attention", ["neutreno", "sym_neutreno", "kernel_neutreno", "eigen_neg_neutreno"])
def test_inputs_that_would_broadcast_silently_are_refused(attention):
    """A V⁰ of one sample reused for a batch of 4, a stale V⁰ of 6 positions for 1 token, a V⁰ of 1
    position for 6, and an (N, N) mask given as a batch's padding mask all broadcast without an error:
    outputs off by up to 1.4, or of another shape (y (4, 6, 12) from x (4, 1, 12))."""
    torch.manual_seed(0)
    cls = layers.attention_class(attention)
    layer = cls(12, 3, attention=attention, lam=0.6)
    x = torch.randn(4, 6, 12)
    _, v0 = layer(x)
    _, v0_one = layer(x[:1])
    for bad_x, bad_v0 in [(x, v0_one), (x[:, :1], v0), (x, v0[:, :, :1])]:
        with pytest.raises(ValueError, match=r"v0 must be the first layer's values for this input"):
            layer(bad_x, bad_v0)
    with pytest.raises(ValueError, match=r"v0 must be .*got \(4, 6, 12\)"):
        layer(x, x)  # heads merged: it failed with "not enough values to unpack"
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, N\) = \(1, 4\)"):
        layer(torch.randn(1, 4, 12), key_padding_mask=torch.ones(4, 4, dtype=torch.bool))
    for bad in (torch.randn(6, 12), torch.randn(1, 4, 6, 12), torch.randn(4, 6, 13)):
        with pytest.raises(ValueError, match=r"x must be tokens \(B, N, 12\)"):
            layer(bad)
    y, _ = layer(x, v0)  # the right V⁰ still runs
    assert y.shape == x.shape


def test_attention_dropout_and_the_lambda_scale_are_checked():
    """attn_drop -0.1 or NaN built a layer whose explicit path trained without dropout (and whose fused
    path failed in SDPA); set_lam_scale took -1 (λ -0.6 everywhere) and NaN; a NumPy λ was refused as not
    a finite number."""
    import math

    import numpy as np

    for bad in (-0.1, math.nan, 1.5, True):
        with pytest.raises(ValueError, match=r"attn_drop must be a probability in \[0, 1\]"):
            Attention(12, 3, attention="neutreno", attn_drop=bad)
    model = Attention(12, 3, attention="neutreno", lam=np.float32(0.5))
    assert model.lam == 0.5 and isinstance(model.lam, float)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="the λ scale must be a finite number >= 0"):
            layers.set_lam_scale(model, bad)
    layers.set_lam_scale(model, np.float64(0.5))
    assert model.current_lam() == 0.25


def test_attnscale_of_fewer_queries_than_keys_is_uniform_over_the_keys():
    """Found in review: without a mask AttnScale's uniform part was 1/Nq, so weights of 2 queries over
    5 keys summed to 0.25 and 1.30 per row; it is 1/Nk (math.md §2: U uniform over the keys)."""
    from neutreno.layers import AttnScale
    from neutreno.layers.functional import softmax_weights

    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 2, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    omega = torch.tensor([0.5, -0.2], dtype=torch.float64)
    plain = torch.softmax(q @ k.transpose(-2, -1) / 2.0, -1)
    expected = 1 / 5 + (1 + omega.view(-1, 1, 1)) * (plain - 1 / 5)  # written out, not the library's
    got = softmax_weights(q, k, None, omega)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 2, 2, dtype=torch.float64))
    scale = AttnScale(2).double()
    with torch.no_grad():
        scale.omega.copy_(omega)
    torch.testing.assert_close(scale(plain), expected)  # the module, called on (B, H, Nq, Nk) weights


def test_featscale_counts_tokens_exactly_in_a_bf16_model(monkeypatch):
    """CUDA's cumsum keeps bf16 partial sums (pytorch/pytorch#180150): in a bf16 model the causal count of
    tokens stopped at 256, and every running mean after it divided by 256. Here a cumsum that adds in
    bf16 as that one does stands in for it; the running mean must still be the float64 one, to bf16's
    rounding of the output."""
    from neutreno.layers.scaling import FeatScale

    real_cumsum = torch.Tensor.cumsum

    def bf16_accumulating(self, dim, *args, **kwargs):
        if self.dtype != torch.bfloat16:
            return real_cumsum(self, dim, *args, **kwargs)
        out, total = torch.empty_like(self), torch.zeros_like(self.select(dim, 0))
        for i in range(self.shape[dim]):
            total = total + self.select(dim, i)  # rounded to bf16 at every step
            out.select(dim, i).copy_(total)
        return out

    monkeypatch.setattr(torch.Tensor, "cumsum", bf16_accumulating)
    torch.manual_seed(0)
    featscale = FeatScale(4)
    with torch.no_grad():
        featscale.dc.fill_(1.0)  # y + DC: the running mean itself shows
    y = torch.randn(1, 400, 4).to(torch.bfloat16)
    mask = torch.ones(1, 400, dtype=torch.bool)
    mask[0, 100:110] = False
    out = featscale.to(torch.bfloat16)(y, mask, is_causal=True)
    y64, kept = y.double()[0], mask[0]
    expected = torch.stack([y64[: i + 1][kept[: i + 1]].mean(0) for i in range(400)]) + y64
    torch.testing.assert_close(out[0].double(), expected, rtol=2e-2, atol=2e-2)


def test_featscale_never_reads_a_padded_row():
    """The masked token mean multiplied padded rows by 0: an inf or NaN there (a padded query's output,
    whatever the model computed for it) made 0 · inf = NaN in the mean, so in every real token. Real
    tokens' outputs must equal those of the sequence without its padding (SPEC §3: padding excluded)."""
    from neutreno.layers.scaling import FeatScale

    torch.manual_seed(0)
    featscale = FeatScale(4)
    with torch.no_grad():
        featscale.dc.fill_(0.5), featscale.hc.fill_(-0.3)
    y = torch.randn(2, 5, 4)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    for junk in (math.inf, -math.inf, math.nan, 1e30):
        padded = y.clone()
        padded[0, 3:] = junk
        for causal in (False, True):
            out = featscale(padded, mask, is_causal=causal)
            alone = featscale(y[:1, :3], is_causal=causal)
            torch.testing.assert_close(out[0, :3], alone[0], rtol=1e-6, atol=1e-6)
            assert out[1].isfinite().all()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # functorch's fallback for the kernel
def test_per_sample_gradients_of_a_neutreno_stack_through_torch_func():
    """torch.func.grad and vmap (per-sample gradients, DP-SGD) raised "must override the setup_context
    staticmethod" for NeuTRENO on the fused path: the projection that keeps u, V, V⁰ instead of their
    sum is an autograd.Function they cannot run, and is left out while they do. Checked against one
    backward per sample."""
    from torch.func import functional_call, grad, vmap

    from neutreno.layers import Block, BlockStack

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    stack = BlockStack(Block(8, 2, attention="neutreno", impl="fused") for _ in range(2))
    params = {k: v.detach() for k, v in stack.named_parameters()}

    def loss(p: dict, sample: torch.Tensor) -> torch.Tensor:
        return functional_call(stack, (p,), (sample[None],)).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(len(x)):
        stack.zero_grad()
        stack(x[i : i + 1]).square().sum().backward()
        for name, param in stack.named_parameters():
            torch.testing.assert_close(per_sample[name][i], param.grad, rtol=1e-4, atol=1e-5)


def test_misused_inputs_name_v0_is_causal_and_caches():
    """V⁰ of another dtype was cast silently without grad and failed in torch's words with it; one on
    another device failed in torch's words; the public helpers broadcast a V⁰ of one sample over the
    batch; is_causal=None was non-causal on one path and a TypeError on the other; a BlockStack given
    caches=[] decoded without a cache (each new position saw only itself), a short list failed half-way
    with the first blocks' caches extended; LearnedLam started at an infinite λ."""
    from neutreno.layers import Block, BlockStack, LearnedLam, add_neutreno_term, neutreno_projection
    from neutreno.layers.attention import KVCache

    layer = Attention(8, 2, attention="neutreno", lam=0.4)
    x = torch.randn(2, 5, 8)
    for v0, grad in (
        (torch.randn(2, 2, 5, 4, dtype=torch.float64), False),
        (torch.randn(2, 2, 5, 4, device="meta"), True),
    ):
        with (
            torch.set_grad_enabled(grad),
            pytest.raises(
                ValueError, match=r"v0 must be the first layer's values for this input, torch\.float32 on cpu"
            ),
        ):
            layer(x, v0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # V⁰ in the compute dtype: as the stack passes it
        layer(x, layer(x)[1])
    with pytest.raises(ValueError, match="is_causal must be True or False, got None"):
        layer(x, is_causal=None)
    u, v = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    with pytest.raises(ValueError, match=r"v and v0 must have one shape, got \(3, 5, 8\) and \(1, 5, 8\)"):
        add_neutreno_term(u, v, torch.randn(1, 5, 8), 0.4)
    with pytest.raises(ValueError, match="v and v0 must have one shape"):
        neutreno_projection(u, v, torch.randn(1, 5, 8), 0.4, torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="a learned λ starts at a finite λ > 0"):
        LearnedLam(float("inf"), 2)

    stack = BlockStack(Block(8, 2, attention="neutreno") for _ in range(3)).eval()
    for caches, shown in (([], "0"), ([KVCache(), KVCache()], "2"), ([KVCache()] * 4, "4")):
        with pytest.raises(ValueError, match=rf"caches must hold one KVCache per block \(3\), got {shown}"):
            stack(x, is_causal=True, caches=caches)
        assert all(cache.keys is None for cache in caches)  # refused before any block ran


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # shape checks read as constants
@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")  # (torch 2.13) still used, tested
@pytest.mark.parametrize("attention", ["neutreno", "eigen_neg_neutreno"])
def test_a_neutreno_model_traced_or_exported_without_grad_trains_and_traces_with_its_check(attention):
    """The in-place sum of inference was kept in a graph traced or exported under no_grad, where the fused
    kernel's backward reads the output it had saved: backward raised "modified by an inplace operation"
    (softmax's trained). And torch.jit.trace's own check (rerun under no_grad) failed on every NeuTRENO
    model: the graphs differed. Traced, exported and eager give the same outputs and gradients."""
    from neutreno.models import create_model

    torch.manual_seed(0)
    model = create_model("vit_digits", attention=attention, depth=3, attn_impl="fused").eval()
    x = torch.randn(2, 1, 8, 8)
    traced = torch.jit.trace(model, x)  # check_trace on: a second run under no_grad
    torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)

    def grads(run) -> list[torch.Tensor]:
        model.zero_grad()
        run(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads(model)
    with torch.no_grad():
        traced = torch.jit.trace(model, x)
        exported = torch.export.export(model, (x,)).module()
    for run in (traced, exported):
        for got, want in zip(grads(run), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_arguments_of_the_public_layers_and_functions_are_named_not_taken():
    """Found in review: "false" switched featscale and qkv_bias on, is_causal="false" ran causal
    attention, dropout_p −1 or NaN ran none, a u of one sample was broadcast over the batch, and other
    inputs failed deep inside torch without naming the argument."""
    from neutreno.layers import Block
    from neutreno.layers.attention import KernelAttention
    from neutreno.layers.neutreno import add_neutreno_term

    for make, message in (
        (lambda: Attention(16, 4, featscale="false"), "featscale must be true or false, got 'false'"),
        (lambda: Attention(16, 4, attnscale="no"), "attnscale must be true or false"),
        (lambda: Block(16, 4, qkv_bias="false"), "qkv_bias must be true or false"),
        (
            lambda: KernelAttention(16, 4, attn_drop=-1.0),
            r"attn_drop must be a probability in \[0, 1\], got -1.0",
        ),
        (lambda: KernelAttention(16, 4, attn_drop=None), "attn_drop must be a probability"),
    ):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(TypeError, match="dim and num_heads must be integers, got dim '64'"):
        Attention("64", 4)
    q = k = v = torch.randn(1, 2, 4, 3)
    for function in (attention_functional.softmax_attention, attention_functional.kernel_attention):
        for bad, message in (
            ({"is_causal": "false"}, "is_causal must be True or False, got 'false'"),
            ({"is_causal": None}, "is_causal must be True or False, got None"),
            ({"attnscale_omega": torch.zeros(5)}, r"one value per head, shape \(2,\), got \(5,\)"),
        ):
            with pytest.raises(ValueError, match=message):
                function(q, k, v, **bad)
        for args, message in (
            (
                (q[0], k[0], v[0]),
                r"q must be a floating-point tensor \(B, H, N, d\), got torch.float32 \(2, 4, 3\)",
            ),
            ((q.long(), k, v), "q must be a floating-point tensor"),
        ):
            with pytest.raises(ValueError, match=message):
                function(*args)
    for p, impl in ((-1.0, "explicit"), (float("nan"), "explicit"), (-1.0, "fused"), (True, "explicit")):
        with pytest.raises(ValueError, match="dropout_p must be a probability in"):
            attention_functional.softmax_attention(q, k, v, dropout_p=p, impl=impl)
    meta = torch.empty(1, 2, 4, 3, device="meta")  # shapes only (an AttributeError of autocast before)
    assert attention_functional.kernel_attention(meta, meta, meta).shape == (1, 2, 4, 3)
    u = torch.randn(2, 2, 4, 3)
    with pytest.raises(ValueError, match=r"must have u's shape \(1, 2, 4, 3\) or broadcast to it"):
        add_neutreno_term(u[:1], u, u, 0.6)
    for lam in (None, "0.6", True):
        with pytest.raises(TypeError, match="lam must be a number or a tensor"):
            add_neutreno_term(u, u, u, lam)
    shared = u[:, :1]  # a value head shared by the query heads: broadcast, as before
    torch.testing.assert_close(add_neutreno_term(u, shared, 2 * shared, 0.5), u + 0.5 * shared)

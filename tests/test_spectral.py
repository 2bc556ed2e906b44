"""Spectral control (Dovonon et al.) and depth-scaled residuals (Noci et al.), math.md §2."""

import pytest
import torch
import torch.nn.functional as F

from neutreno import create_model
from neutreno.layers import Attention, Block


def measured_h(attn: Attention) -> torch.Tensor:
    """H = W_V W_O summed over heads, read off the forward pass: with a single token the attention
    matrix is [1], so the branch output of token x is exactly x H (D, D)."""
    dim = attn.num_heads * attn.head_dim
    with torch.no_grad():
        y, _ = attn(torch.eye(dim).unsqueeze(1))  # D one-token sequences e_i → e_i H
    return y[:, 0]


@pytest.mark.parametrize("attention, sign", [("eigen_neg", -1), ("eigen_pos", 1), ("eigen_neg_neutreno", -1)])
def test_reparameterised_h_has_eigenvalues_sign_psi_squared(attention, sign):
    torch.manual_seed(0)
    attn = Attention(24, 4, attention=attention).eval()
    h = measured_h(attn)
    psi = attn.value_output.psi.detach()
    torch.testing.assert_close(h, torch.diag(sign * psi**2), atol=1e-5, rtol=1e-5)  # H = Λ exactly
    eigenvalues = torch.linalg.eigvals(h.double())
    assert eigenvalues.imag.abs().max() < 1e-6
    got = eigenvalues.real.sort().values
    torch.testing.assert_close(got, (sign * psi.double() ** 2).sort().values, atol=1e-5, rtol=0)
    if sign < 0:
        assert got.min() >= -1 and got.max() <= 0  # ψ ~ U(0, 1): "−" sharpens within [−1, 0]
    # W_V = Q_oᵀ is orthogonal: the values of the basis vectors are orthonormal.
    _, _, v = attn.project(torch.eye(24)[None])
    w_v = v.transpose(1, 2).reshape(24, 24)
    torch.testing.assert_close(w_v @ w_v.T, torch.eye(24), atol=1e-5, rtol=0)
    assert not any(name.endswith("bias") and "value_output" in name for name, _ in attn.named_parameters())


def test_ordinary_attention_h_is_w_v_w_o():
    """The same single-token measurement on softmax attention gives W_V W_O from the weights (with
    the biases' contribution removed)."""
    torch.manual_seed(1)
    attn = Attention(12, 3).eval()
    w = attn.qkv.weight.detach()
    bias_out = attn.qkv.bias.detach()[24:] @ attn.proj.weight.detach().T + attn.proj.bias.detach()
    expected = w[24:].T @ attn.proj.weight.detach().T
    torch.testing.assert_close(measured_h(attn) - bias_out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
def test_block_residual_scale_and_norm_placement_follow_the_formula(norm):
    torch.manual_seed(2)
    block = Block(16, 4, 2.0, norm=norm, residual_scale=0.25).eval()
    x = torch.randn(2, 5, 16)
    y, _ = block(x)

    def ln(t, module):
        return t if norm == "none" else F.layer_norm(t, (16,), module.weight, module.bias, module.eps)

    def attn(t):
        return block.attn(t)[0]

    with torch.no_grad():
        if norm == "post":
            h = ln(x + 0.25 * attn(x), block.norm1)
            expected = ln(h + 0.25 * block.mlp(h), block.norm2)
        else:
            h = x + 0.25 * attn(ln(x, block.norm1))
            expected = h + 0.25 * block.mlp(ln(h, block.norm2))
    torch.testing.assert_close(y, expected)
    if norm == "none":
        assert not any("norm" in name for name, _ in block.named_parameters())


def test_models_take_residual_scale_norm_and_spectral_layers():
    vit = create_model(
        "vit_digits", attention="eigen_neg_neutreno", residual_scale="1/sqrt(L)", spectral_layers=6
    )
    assert all(b.residual_scale == pytest.approx(12**-0.5) for b in vit.blocks)
    kinds = [b.attn.attention for b in vit.blocks]
    assert kinds == ["eigen_neg_neutreno"] * 6 + ["neutreno"] * 6
    assert all(b.attn.lam == 0.6 for b in vit.blocks)
    lm = create_model("lm_wt103_mini", attention="eigen_pos", block_norm="none", residual_scale=0.5, depth=4,
                      vocab_size=100, cutoffs=[50])  # fmt: skip
    assert [b.norm for b in lm.blocks] == ["none"] * 4 and isinstance(lm.norm, torch.nn.Identity)
    assert all(b.residual_scale == 0.5 and b.attn.value_output is not None for b in lm.blocks)
    seg = create_model("segmenter_tiny", num_classes=3, img_size=32, depth=4, residual_scale="1/sqrt(L)")
    assert seg.encoder.blocks[0].residual_scale == pytest.approx(0.5)
    assert seg.decoder.blocks[0].residual_scale == pytest.approx(2**-0.5)  # the decoder's own depth
    # NeuTRENO's V⁰ comes from the first (spectral) layer: the later plain layers are handed it.
    seen = {}

    def first_values(module, args, out):
        seen["v"] = out[1]

    def later_v0(module, args):
        seen["v0"] = args[1]

    handles = [vit.blocks[0].attn.register_forward_hook(first_values)]
    handles.append(vit.blocks[8].attn.register_forward_pre_hook(later_v0))
    with torch.no_grad():
        out = vit(torch.rand(2, 1, 8, 8))
    for handle in handles:
        handle.remove()
    assert seen["v0"] is seen["v"] and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="residual_scale"):
        create_model("vit_digits", residual_scale=0)
    with pytest.raises(ValueError, match="spectral_layers needs an eigen"):
        create_model("vit_digits", attention="neutreno", spectral_layers=3)
    with pytest.raises(ValueError, match="norm must be one of"):
        create_model("vit_digits", block_norm="sandwich")


# ---- spectral analysis (neutreno analyze --metrics spectrum) --------------------------------------------


def spectra_of(model, images):
    from neutreno.diagnostics import BlockProbe
    from neutreno.diagnostics.spectral import layer_spectra, value_output_maps

    return layer_spectra(value_output_maps(model), BlockProbe(model, attention=True)(images))


@pytest.mark.parametrize("attention, regime", [("eigen_neg", "sharpen"), ("eigen_pos", "smooth")])
def test_reparameterised_models_are_predicted_and_measured_in_their_regime(attention, regime):
    """H = ∓diag(ψ²) scaled by the LayerNorm gains γ: eigenvalues ∓γ_i ψ_i² exactly; "−" layers are
    predicted to sharpen and "+" to smooth, and at initialisation the measured high-frequency ratio
    moves the same way through the first layer."""
    torch.manual_seed(3)
    model = create_model("vit_digits", attention=attention, depth=4).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.norm1.weight.uniform_(0.5, 1.5)
    images = torch.rand(6, 1, 8, 8)
    spectra = spectra_of(model, images)
    for block, s in zip(model.blocks, spectra, strict=True):
        vo = block.attn.value_output
        expected = (vo.sign * block.norm1.weight * vo.psi**2).detach().double().sort().values
        torch.testing.assert_close(
            s.h_eigenvalues.real.double().sort().values, expected, atol=1e-5, rtol=1e-5
        )
        assert s.regime == regime and s.smooth_fraction == (1.0 if regime == "smooth" else 0.0)
    first = spectra[0]
    sharpened = first.high_frequency_out > first.high_frequency_in
    assert sharpened == (regime == "sharpen")


def test_layers_that_add_a_term_to_x_plus_axh_get_no_predicted_regime(tmp_path, capsys):
    """The rule (math.md §3) is for X ← X + A X H. A NeuTRENO layer adds λ(V⁰ − V) W_O, a pull towards
    the first layer's values that no pair λ_A, λ_H describes, and was given the softmax layer's
    prediction ("smooth" in every layer of a NeuTRENO ViT). Now such layers get none, and keep λ_H and
    the measurements; the first layer, whose V⁰ is its own V (a term of 0), is predicted as softmax's.
    FeatScale's layers get none either; a patched Hugging Face model is read the same way."""
    from neutreno.cli.main import main
    from neutreno.diagnostics import BlockProbe, layer_spectra, terms_beyond_the_rule, value_output_maps

    def spectra(model, images):
        probed = BlockProbe(model, attention=True)(images)
        return layer_spectra(value_output_maps(model), probed, terms_beyond_the_rule(model))

    torch.manual_seed(0)
    images = torch.rand(4, 1, 8, 8)
    softmax = create_model("vit_digits", attention="softmax", depth=3).eval()
    neutreno = create_model("vit_digits", attention="neutreno", depth=3).eval()
    neutreno.load_state_dict(softmax.state_dict())
    plain, patched = spectra(softmax, images), spectra(neutreno, images)
    assert [s.regime for s in plain] == ["smooth"] * 3 and {s.beyond_rule for s in plain} == {None}
    assert patched[0].as_dict() == plain[0].as_dict()  # layer 1: no term, the same prediction
    for p, s in zip(patched[1:], plain[1:], strict=True):
        assert (p.regime, p.smooth_fraction, p.gain) == (None, None, None)
        assert p.beyond_rule == "NeuTRENO's λ(V⁰ − V)" and torch.equal(p.h_eigenvalues, s.h_eigenvalues)
    featscale = create_model("vit_digits", attention="softmax", depth=2, featscale=True).eval()
    assert terms_beyond_the_rule(featscale) == ["FeatScale", "FeatScale"]
    assert [s.regime for s in spectra(featscale, images)] == [None, None]

    transformers = pytest.importorskip("transformers")
    from neutreno.hf import apply_neutreno

    sizes = dict(hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=30, **sizes))
    assert terms_beyond_the_rule(bert) == [None, None, None]
    apply_neutreno(bert, 0.6)
    assert terms_beyond_the_rule(bert) == [None, "NeuTRENO's λ(V⁰ − V)", "NeuTRENO's λ(V⁰ − V)"]

    out = tmp_path / "spec"
    code = main(["analyze", "--model", "vit_digits", "--attention", "neutreno", "--metrics", "spectrum",
                 "--samples", "8", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "no prediction where a layer adds NeuTRENO's λ(V⁰ − V)" in printed
    layers = next(iter(__import__("json").loads((out / "report.json").read_text())["spectrum"].values()))
    assert [s["regime"] for s in layers] == ["smooth"] + [None] * 11
    rows = (out / "layers.csv").read_text().splitlines()
    assert sum("spectrum_smooth_fraction" in row for row in rows) == 1


def test_the_residual_scale_is_part_of_h():
    """X ← X + α A X H: α scales every λ_H. A "−" model at α = 1/√12 with ψ² = 3.61 (λ_H = −3.61 at
    γ = 1) was predicted to smooth as if α were 1 (|1 − 3.61| at λ_A = 1 the largest gain); its λ_H is
    −1.04, and |1 − 1.04 λ_A| is largest away from λ_A = 1: it sharpens."""
    torch.manual_seed(0)
    model = create_model("vit_digits", attention="eigen_neg", depth=12, residual_scale="1/sqrt(L)").eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.value_output.psi.fill_(1.9)
    spectra = spectra_of(model, torch.rand(4, 1, 8, 8))
    for block, s in zip(model.blocks, spectra, strict=True):
        expected = -(12**-0.5) * 1.9**2 * block.norm1.weight.detach().double()
        torch.testing.assert_close(
            s.h_eigenvalues.real.double().sort().values, expected.sort().values, rtol=1e-5, atol=1e-6
        )
        assert s.regime == "sharpen" and s.smooth_fraction == 0.0


def test_spectra_of_layers_with_a_norm_on_the_attention_output_and_flips_of_neutreno_are_refused():
    """OLMo-2 and Gemma-2 update X ← X + γ ⊙ norm(A X H): negating γ negates the update, which the rule,
    reading H alone, cannot see (it predicted "smooth" for both signs). Such layers get no prediction;
    Llama's post_attention_layernorm, after the residual add, is the feed-forward's. And a LayerNorm
    sign flip in a NeuTRENO model changes more than H: λ(V⁰ − V) reads the values it negates (block 3
    on the same input moved by 12 with block 1 flipped), so the experiment is refused there."""
    transformers = pytest.importorskip("transformers")
    from neutreno.diagnostics import terms_beyond_the_rule
    from neutreno.diagnostics.spectral import flipped_layer_norm_signs

    sizes = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=0)  # fmt: skip
    for config, norm in (
        (transformers.Olmo2Config, "post_attention_layernorm"),
        (transformers.Gemma2Config, "post_attention_layernorm"),
        (transformers.Glm4Config, "post_self_attn_layernorm"),
        (transformers.LlamaConfig, None),
    ):
        model = transformers.AutoModel.from_config(config(**sizes))
        term = None if norm is None else f"{norm} on the attention's output"
        assert terms_beyond_the_rule(model) == [term, term], config.__name__
    flip = flipped_layer_norm_signs(create_model("vit_digits", attention="neutreno"), [2])
    with pytest.raises(ValueError, match="only H in a model without NeuTRENO"):
        flip.__enter__()


def test_a_layer_scale_on_the_attention_output_is_part_of_h():
    """DINOv2 (layer_scale1) and BEiT (lambda_1) scale the attention's output per channel before the
    residual add: X ← X + A·LN(X)·W_Vᵀ W_Oᵀ diag(s). λ_H left s out (DINOv2 starts it at 1e-5...1),
    as it had α. Against numpy's eigenvalues of diag(γ) W_Vᵀ W_Oᵀ diag(s) in float64."""
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from neutreno.diagnostics import terms_beyond_the_rule, value_output_maps, value_projection_spectrum
    from neutreno.diagnostics.collect import hf_layers

    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                 image_size=8, patch_size=4)  # fmt: skip
    torch.manual_seed(0)
    dinov2 = transformers.Dinov2Model(transformers.Dinov2Config(**sizes))
    beit = transformers.BeitModel(transformers.BeitConfig(**sizes, layer_scale_init_value=0.1))
    for model, norm_name, scale_of in (
        (dinov2, "norm1", lambda layer: layer.layer_scale1.lambda1),
        (beit, "layernorm_before", lambda layer: layer.lambda_1),
    ):
        layers = hf_layers(model)
        with torch.no_grad():
            for layer in layers:
                scale_of(layer).uniform_(-2, 2)
                getattr(layer, norm_name).weight.uniform_(0.5, 1.5)
        assert terms_beyond_the_rule(model) == [None, None]
        for layer, (w_v, w_o, gamma) in zip(layers, value_output_maps(model), strict=True):
            v, o, g, s = (t.detach().double().numpy() for t in (
                layer.attention.v_proj.weight, layer.attention.o_proj.weight,
                getattr(layer, norm_name).weight, scale_of(layer)))  # fmt: skip
            expected = np.sort(np.linalg.eigvals(np.diag(g) @ v.T @ o.T @ np.diag(s)).real)
            got = np.sort(value_projection_spectrum(w_v, w_o, gamma).real.double().numpy())
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_what_hugging_face_layers_do_around_their_attention_is_read_into_h_or_withholds_it():
    """Read from each layer's forward, against numpy's eigenvalues: Granite's residual_multiplier on the
    add's line is an α (left out of H: a −4 read for −0.8, smooth predicted for sharpen); LFM2's pre-norm,
    called in the attention call's arguments, is its γ (read as none: post-norm); BEiT without LayerScale
    multiplies by nothing (called a module on the output: prediction withheld); BitNet's attn_sub_norm,
    inside the attention before W_O, normalises what H maps (predicted as if it did not)."""
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from neutreno.diagnostics import terms_beyond_the_rule, value_output_maps, value_projection_spectrum
    from neutreno.diagnostics.collect import hf_layers

    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    granite = transformers.AutoModel.from_config(transformers.GraniteConfig(**sizes, residual_multiplier=0.2))
    lfm2 = transformers.AutoModel.from_config(
        transformers.Lfm2Config(**sizes, layer_types=["full_attention"] * 2)
    )
    for model, norm_name, alpha in ((granite, "input_layernorm", 0.2), (lfm2, "operator_norm", 1.0)):
        assert terms_beyond_the_rule(model) == [None, None]
        layers = hf_layers(model)
        with torch.no_grad():
            for layer in layers:
                getattr(layer, norm_name).weight.uniform_(0.5, 1.5)  # both apply weight · x / rms(x)
        for layer, maps in zip(layers, value_output_maps(model), strict=True):
            attention, norm = layer.self_attn, getattr(layer, norm_name)
            out = attention.o_proj if hasattr(attention, "o_proj") else attention.out_proj  # LFM2's name
            v, o, g = (
                t.detach().double().numpy() for t in (attention.v_proj.weight, out.weight, norm.weight)
            )
            expected = np.sort(np.linalg.eigvals(alpha * np.diag(g) @ v.T @ o.T).real)
            got = np.sort(value_projection_spectrum(*maps).real.double().numpy())
            np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5)  # γ measured, to 1/√(1 + ε)
    sizes_vit = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     image_size=8, patch_size=4)  # fmt: skip
    beit = transformers.BeitModel(transformers.BeitConfig(**sizes_vit, layer_scale_init_value=0.0))
    assert terms_beyond_the_rule(beit) == [None, None]
    bitnet = transformers.AutoModel.from_config(transformers.BitNetConfig(**sizes))
    assert terms_beyond_the_rule(bitnet) == ["attn_sub_norm inside the attention"] * 2
    # pre-LN BERTs keep their pre-norm inside the attention module (γ was left out, the prediction
    # withheld as if the norm were a term); OpenAI GPT's ln_1, pre-norm GPT-2's name, is post-norm there
    bert_sizes = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                      intermediate_size=64)  # fmt: skip
    preln = transformers.RobertaPreLayerNormModel(transformers.RobertaPreLayerNormConfig(**bert_sizes))
    with torch.no_grad():
        for layer in hf_layers(preln):
            layer.attention.LayerNorm.weight.uniform_(-1.5, 1.5)
    assert terms_beyond_the_rule(preln) == [None, None]
    for layer, (_, _, gamma) in zip(hf_layers(preln), value_output_maps(preln), strict=True):
        torch.testing.assert_close(gamma, layer.attention.LayerNorm.weight.detach())
    gpt = transformers.OpenAIGPTModel(
        transformers.OpenAIGPTConfig(vocab_size=96, n_embd=32, n_head=4, n_layer=2)
    )
    assert [gamma for _, _, gamma in value_output_maps(gpt)] == [None, None]
    # Doge scales the residual itself (X ← s ⊙ X + …), not the rule's update; Swin has heads per stage
    doge_sizes = {**sizes, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4}
    doge = transformers.DogeModel(transformers.DogeConfig(**doge_sizes))
    assert terms_beyond_the_rule(doge) == ["input_residual on the residual"] * 2
    swin_sizes = dict(image_size=8, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2)
    swin = transformers.SwinModel(transformers.SwinConfig(**swin_sizes))
    with pytest.raises(ValueError, match=r"SwinModel has heads per stage \(\[2, 2\]\)"):
        value_output_maps(swin)
    # a residual add written as a call (Beam's depth_scaled_residual_add) ended the reading without an
    # add, which dropped the norm found before it; PatchTST calls its attention in a pre-norm branch and a
    # post-norm one, and the first branch's γ was taken for both
    beam = transformers.AutoModel.from_config(transformers.AutoConfig.for_model("beam", **sizes))
    assert terms_beyond_the_rule(beam)[0] == (
        "post_attention_layernorm on the attention's output, depth_scaled_residual_add on the residual"
    )
    patch = dict(d_model=16, num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, num_input_channels=2,
                 context_length=32, pre_norm=False)  # fmt: skip
    with pytest.raises(ValueError, match="PatchTSTEncoderLayer calls its attention in more than one place"):
        value_output_maps(transformers.PatchTSTModel(transformers.PatchTSTConfig(**patch)))
    # MPT's layer list is called `blocks`, as ours is: it was read as ours (an AttributeError)
    mpt = transformers.AutoModel.from_config(
        transformers.MptConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=32)
    )
    with pytest.raises(
        ValueError, match="MptBlock: the spectrum needs the layer's separate value and output"
    ):
        value_output_maps(mpt)


def test_flipping_layer_norm_signs_negates_h_and_keeps_the_attention():
    from neutreno.diagnostics import BlockProbe
    from neutreno.diagnostics.spectral import flipped_layer_norm_signs

    torch.manual_seed(4)
    model = create_model("vit_digits", attention="eigen_pos", depth=3).eval()
    images = torch.rand(4, 1, 8, 8)
    before = spectra_of(model, images)
    attn_before = BlockProbe(model, attention=True)(images).attn
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with flipped_layer_norm_signs(model, [2]):
        flipped = spectra_of(model, images)
        attn_flipped = BlockProbe(model, attention=True)(images).attn
    torch.testing.assert_close(attn_flipped[1], attn_before[1], atol=1e-6, rtol=0)  # W_Q, W_K compensate
    torch.testing.assert_close(flipped[1].h_eigenvalues.real.sort().values,
                               (-before[1].h_eigenvalues.real).sort().values)  # fmt: skip
    assert (before[1].regime, flipped[1].regime) == ("smooth", "sharpen")
    torch.testing.assert_close(flipped[0].h_eigenvalues, before[0].h_eigenvalues)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # restored
    with (
        pytest.raises(ValueError, match="pre-norm"),
        flipped_layer_norm_signs(create_model("vit_digits", block_norm="post"), [1]),
    ):
        pass


@pytest.mark.parametrize("attention", ["eigen_pos", "softmax"])
def test_sign_flip_changes_equal_whole_passes_with_each_layer_flipped(attention):
    """The flip experiment stops each flipped pass at block ℓ and reuses the unflipped block inputs: the
    same numbers as a whole pass per layer and per setting (NeuTRENO is refused: see above)."""
    from neutreno.diagnostics import BlockProbe
    from neutreno.diagnostics.metrics import high_frequency_ratio
    from neutreno.diagnostics.spectral import flipped_layer_norm_signs, sign_flip_changes

    torch.manual_seed(5)
    model = create_model("vit_digits", attention=attention, depth=4).eval()
    images = torch.rand(6, 1, 8, 8)

    def change(layer: int, flip: bool) -> list[float]:  # per image, each image on its own
        with flipped_layer_norm_signs(model, [layer] if flip else []):
            hidden = [BlockProbe(model)(image[None]).hidden for image in images]
        return [(high_frequency_ratio(h[layer]) - high_frequency_ratio(h[layer - 1])).item() for h in hidden]

    expected = [(k, change(k, False), change(k, True)) for k in range(1, 5)]
    rows = sign_flip_changes(model, images)
    assert [k for k, _, _ in rows] == [1, 2, 3, 4]

    def flat(table: list) -> list[float]:
        return [value for _, before, after in table for values in (before, after) for value in values]

    assert len(flat(rows)) == 4 * 2 * 6
    assert flat(rows) == pytest.approx(flat(expected), abs=1e-6)
    assert any((sum(b) < 0) != (sum(a) < 0) for _, b, a in rows)  # the flip does flip something
    # in training mode (dropout on) the two passes drew other masks: the paired changes were noise
    noisy = create_model("vit_digits", attention=attention, depth=4, drop_rate=0.1, drop_path_rate=0.2)
    noisy.load_state_dict(model.state_dict())
    noisy.train()
    assert flat(sign_flip_changes(noisy, images)) == pytest.approx(flat(rows), abs=1e-6)
    assert noisy.training and all(m.training for m in noisy.modules())  # modes restored


def test_a_layers_dominant_pair_is_that_of_a_sample_predicted_in_its_regime():
    """The pair reported was the first sample's: λ_A = 1 (a smoothing pair) beside regime "sharpen"."""
    from neutreno.diagnostics import LayerTensors
    from neutreno.diagnostics.spectral import layer_spectra

    n, d = 4, 3
    identity = torch.eye(n)
    mixed = 0.5 * torch.full((n, n), 1 / n) + 0.5 * identity  # λ_A = 1, ½, ½, ½
    attn = torch.stack([identity, mixed, mixed])[:, None]  # (3 samples, 1 head, n, n)
    hidden = [torch.randn(3, n, d), torch.randn(3, n, d)]
    maps = [(-0.5 * torch.eye(d, dtype=torch.float64), torch.eye(d, dtype=torch.float64), None)]  # H = −½I
    (spectrum,) = layer_spectra(maps, LayerTensors(hidden=hidden, mask=None, attn=[attn]))
    assert spectrum.regime == "sharpen" and spectrum.smooth_fraction == pytest.approx(1 / 3)
    assert spectrum.lambda_a == pytest.approx(0.5) and spectrum.gain == pytest.approx(0.75)


def test_a_post_norm_layers_prediction_does_not_take_the_previous_layer_norms_gain():
    """A post-norm block updates the residual stream X ← X + A X W_V W_O (SPEC §3): no gain between X and
    the attention. Negating the previous LayerNorm's gain and bias (and W_Q, W_K after it, so the maps
    stay) sends X to −X: the update and its measured smoothing are the same, so must the prediction be.
    With that γ in H_eff, λ_H changed sign and the predicted regime flipped."""
    from neutreno.diagnostics.metrics import high_frequency_ratio

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_32", depth=2, block_norm="post", attention="eigen_pos").eval()
    images = torch.randn(4, 3, 32, 32)

    def layer_two():
        from neutreno.diagnostics import BlockProbe
        from neutreno.diagnostics.spectral import layer_spectra, value_output_maps

        seen = BlockProbe(model, attention=True)(images)
        spectrum = layer_spectra(value_output_maps(model), seen)[1]
        x = seen.hidden[1]
        with torch.no_grad():
            update = x + model.blocks[1].attn(x)[0]
        change = (high_frequency_ratio(update) - high_frequency_ratio(x)).item()
        return spectrum, change, seen.attn[1]

    before, change, maps = layer_two()
    with torch.no_grad():
        model.blocks[0].norm2.weight.neg_()
        model.blocks[0].norm2.bias.neg_()
        model.blocks[1].attn.qk.weight.neg_()
    after, change_after, maps_after = layer_two()
    torch.testing.assert_close(maps_after, maps, atol=1e-6, rtol=1e-5)
    assert change_after == pytest.approx(change, abs=1e-6)
    torch.testing.assert_close(after.h_eigenvalues, before.h_eigenvalues)
    assert after.regime == before.regime and after.smooth_fraction == before.smooth_fraction


def test_hf_encoders_give_the_layer_norm_that_feeds_attention():
    transformers = pytest.importorskip("transformers")
    from neutreno.diagnostics.spectral import value_output_maps

    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=30, **sizes))
    maps = value_output_maps(bert)
    # post-norm: the attention reads the residual stream, no norm in between (the test below shows why)
    assert maps[0][2] is None and maps[1][2] is None
    assert torch.equal(maps[1][0], bert.encoder.layer[1].attention.self.value.weight)
    vit = transformers.ViTModel(transformers.ViTConfig(image_size=8, patch_size=4, **sizes))
    assert torch.equal(value_output_maps(vit)[1][2], vit.layers[1].layernorm_before.weight)


def test_analyze_spectrum_cli(tmp_path, capsys):
    from neutreno.cli.main import main

    out = tmp_path / "spec"
    code = main(["analyze", "--model", "vit_digits", "--attention", "eigen_neg", "--metrics", "spectrum",
                 "--samples", "8", "--flip-ln", "1", "--out", str(out)])  # fmt: skip
    assert code == 0 and "spectrum: vit_digits eigen_neg" in capsys.readouterr().out
    report = __import__("json").loads((out / "report.json").read_text())
    assert list(report["spectrum"]) == ["vit_digits eigen_neg", "vit_digits eigen_neg, LN sign flipped at 1"]
    plain, flipped = report["spectrum"].values()
    assert [s["regime"] for s in plain] == ["sharpen"] * 12
    assert flipped[0]["regime"] == "smooth" and (out / "spectrum.png").stat().st_size > 0
    assert main(["analyze", "--model", "vit_digits", "--flip-ln", "1", "--out", str(out)]) == 2


def test_hf_gain_is_the_one_each_norm_applies():
    """γ is the per-channel gain the pre-attention norm multiplies by: an nn.LayerNorm's weight exactly;
    Llama's RMSNorm its weight w; Gemma's RMSNorm 1 + w (w = 0 at initialisation: γ = 1, not 0);
    Cohere's mean-centring LayerNorm its weight (a vector of ones would give 0 there); OLMo's
    parameter-free LayerNorm 1. Norm weights are drawn at random, some negative."""
    transformers = pytest.importorskip("transformers")
    from neutreno.diagnostics.spectral import value_output_maps

    sizes = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
    torch.manual_seed(5)
    models = {
        "llama": transformers.LlamaForCausalLM(
            transformers.LlamaConfig(hidden_size=32, num_key_value_heads=2, **sizes)
        ),
        "gemma": transformers.GemmaForCausalLM(
            transformers.GemmaConfig(hidden_size=32, num_key_value_heads=2, head_dim=8, **sizes)
        ),
        "cohere": transformers.CohereForCausalLM(  # an odd width: x = ±1 − 1/33
            transformers.CohereConfig(**{**sizes, "num_attention_heads": 3}, hidden_size=33)
        ),
        "olmo": transformers.OlmoForCausalLM(transformers.OlmoConfig(hidden_size=32, **sizes)),
        "phi": transformers.PhiForCausalLM(transformers.PhiConfig(hidden_size=32, **sizes)),  # nn.LayerNorm
    }
    gemma_at_init = value_output_maps(models["gemma"])
    assert all(torch.allclose(g, torch.ones(32)) for _, _, g in gemma_at_init)
    with torch.no_grad():
        for model in models.values():
            for layer in model.model.layers:
                for p in layer.input_layernorm.parameters():
                    p.uniform_(-1.5, 1.5)
    for kind, model in models.items():
        for layer, (_, _, gamma) in zip(model.model.layers, value_output_maps(model), strict=True):
            w = layer.input_layernorm.weight if kind != "olmo" else torch.zeros(32)
            if kind == "phi":
                assert torch.equal(gamma, w)
                continue
            expected = 1 + w if kind in ("gemma", "olmo") else w
            torch.testing.assert_close(gamma, expected.detach(), atol=2e-5, rtol=1e-5, msg=kind)


@pytest.mark.parametrize("pre_norm", [True, False])
def test_hf_opt_gain_is_the_layer_norm_before_its_attention(pre_norm):
    """OPT names its pre-attention LayerNorm self_attn_layer_norm; OPT-350m-style configs
    (do_layer_norm_before=False) apply it after the attention: post-norm, so no γ."""
    transformers = pytest.importorskip("transformers")
    from neutreno.diagnostics.spectral import value_output_maps

    config = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                    ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64,
                                    do_layer_norm_before=pre_norm)  # fmt: skip
    torch.manual_seed(6)
    opt = transformers.OPTForCausalLM(config)
    with torch.no_grad():
        for name, p in opt.named_parameters():
            if "layer_norm.weight" in name:
                p.uniform_(-1.5, 1.5)
    layers = opt.model.decoder.layers
    gammas = [g for _, _, g in value_output_maps(opt)]
    if pre_norm:
        assert all(
            torch.equal(g, layer.self_attn_layer_norm.weight) for g, layer in zip(gammas, layers, strict=True)
        )
    else:
        assert gammas == [None] * 3


def test_hf_pre_norms_of_other_names_give_their_own_gain_and_an_unknown_one_is_refused(monkeypatch):
    """CLIP/SigLIP's ``layer_norm1`` and DINOv2's ``norm1`` feed the attention, but were not known: γ was
    the previous layer's ``layer_norm2`` (none for the first layer), so a layer with γ = −1 and
    W_V W_O = ½I was predicted to smooth (λ_H = +½) though it sharpens (−½)."""
    transformers = pytest.importorskip("transformers")
    from neutreno.diagnostics import spectral

    sizes = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    vision = dict(image_size=16, patch_size=8, **sizes)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(vocab_size=50, **sizes))
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**vision))
    dinov2 = transformers.Dinov2Model(transformers.Dinov2Config(**vision))
    torch.manual_seed(0)
    for model, name in ((clip, "layer_norm1"), (siglip, "layer_norm1"), (dinov2, "norm1")):
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.uniform_(-2.0, 2.0)
        layers = spectral.hf_layers(model)
        gammas = [g for _, _, g in spectral.value_output_maps(model)]
        for gamma, layer in zip(gammas, layers, strict=True):
            assert torch.equal(gamma, getattr(layer, name).weight), name
    with torch.no_grad():
        for layer in spectral.hf_layers(siglip):
            layer.layer_norm1.weight.fill_(-1.0)
            layer.self_attn.v_proj.weight.copy_(0.5 * torch.eye(16))
            layer.self_attn.out_proj.weight.copy_(torch.eye(16))
    w_v, w_o, gamma = spectral.value_output_maps(siglip)[1]
    eigenvalues = spectral.value_projection_spectrum(w_v, w_o, gamma)
    torch.testing.assert_close(eigenvalues.real, torch.full((16,), -0.5))  # sharpens: H = diag(γ) W_V W_O
    # A pre-norm whose name is not known is refused, not replaced by the previous layer's norm.
    monkeypatch.setattr(spectral, "_HF_PRE_NORMS", ("layernorm_before",))
    with pytest.raises(ValueError, match=r"calls self\.norm1 before its attention self\.attention"):
        spectral.value_output_maps(dinov2)


def test_layer_norm_flip_refuses_a_layer_named_twice_and_spectra_refuse_non_finite_weights(tmp_path, capsys):
    """A layer flipped twice is not flipped, and was reported as "LN sign flipped". NaN or inf in W_V, W_O
    or γ went to LAPACK's eigvals, which ended the whole process (a segfault)."""
    from neutreno.cli.main import main
    from neutreno.diagnostics.metrics import value_projection_spectrum
    from neutreno.diagnostics.spectral import flipped_layer_norm_signs

    model = create_model("vit_digits")
    with pytest.raises(ValueError, match="layer 1 given twice"), flipped_layer_norm_signs(model, [1, 2, 1]):
        pass
    code = main(["analyze", "--model", "vit_digits", "--metrics", "spectrum", "--samples", "4",
                 "--flip-ln", "1,1", "--out", str(tmp_path / "o")])  # fmt: skip
    assert code == 2 and "--flip-ln names a layer twice (1,1)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    w = torch.eye(4)
    for bad in (w.clone().fill_(float("nan")), w * float("inf")):
        with pytest.raises(ValueError, match="hold NaN or inf"):
            value_projection_spectrum(bad, w)
    with pytest.raises(ValueError, match="hold NaN or inf"):
        value_projection_spectrum(w, w, torch.tensor([1.0, float("inf"), 1.0, 1.0]))


def test_a_layer_norm_flip_the_model_cannot_take_is_refused_before_the_data_are_read(
    tmp_path, capsys, monkeypatch
):
    """Found in review: a post-norm model given --flip-ln was refused only once its inputs were read
    (a language model's whole text, with its warnings first)."""
    from neutreno.cli import analyze
    from neutreno.cli.main import main
    from neutreno.models import save_model

    post = create_model("vit_digits", depth=2, block_norm="post")
    preprocess = {"mean": [0.3], "std": [0.4], "image_size": 8, "crop_pct": 1.0, "channels": 1}
    save_model(
        tmp_path / "post.safetensors", post, extra={"preprocess": preprocess, "classes": list("0123456789")}
    )
    monkeypatch.setattr(analyze, "_inputs", lambda *a: pytest.fail("the data were read"))
    code = main(["analyze", "--model", str(tmp_path / "post.safetensors"), "--metrics", "spectrum",
                 "--flip-ln", "1", "--out", str(tmp_path / "o")])  # fmt: skip
    assert code == 2 and "needs one of our models with pre-norm blocks" in capsys.readouterr().err

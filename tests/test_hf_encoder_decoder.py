"""neutreno.hf in encoder–decoders (BART, Marian, T5, Whisper) and in models holding several towers
(CLIP, EncoderDecoderModel), on tiny random models: each self-attention stack against a forward written
here with plain hooks, cross-attention untouched, cached generation (dynamic and static caches) equal
to uncached, and refusals."""

import copy

import pytest
import torch

from neutreno.hf import apply_neutreno, from_pretrained, is_patched, neutreno_lambda, remove_neutreno

from reference import kv_cache, with_cache

transformers = pytest.importorskip("transformers")

VOCAB = 64
LAM = 0.6
TOL = dict(atol=2e-5, rtol=1e-4)


def bart_like(model_class, config_class):
    """BART and its copies (Marian, Pegasus, mBART, …): 3 encoder and 3 decoder layers. A large init_std
    (0.3) gives logits far from uniform, so that λ changes the greedy tokens."""
    config = config_class(
        vocab_size=VOCAB, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, init_std=0.3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, forced_eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class(config).eval()


def tiny_t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4, dropout_rate=0.0,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def tiny_whisper():
    """8 mel bins × 16 frames; the encoder sees 8 positions (its convolution has stride 2)."""
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
        max_source_positions=8, max_target_positions=32, init_std=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(config).eval()


def bart_stacks(model):
    """Hand-named: (encoder self-attentions, decoder self-attentions), decoder cross-attentions."""
    encoder, decoder = model.model.encoder, model.model.decoder
    return (
        ([layer.self_attn for layer in encoder.layers], [layer.self_attn for layer in decoder.layers]),
        [layer.encoder_attn for layer in decoder.layers],
    )


def t5_stacks(model):
    return (
        (
            [block.layer[0].SelfAttention for block in model.encoder.block],
            [block.layer[0].SelfAttention for block in model.decoder.block],
        ),
        [block.layer[1].EncDecAttention for block in model.decoder.block],
    )


def token_inputs(length=7):
    return {"input_ids": torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))}


def audio_inputs():
    return {"input_features": torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))}


FAMILIES = {  # build, inputs, stacks
    "bart": (lambda: bart_like(transformers.BartForConditionalGeneration, transformers.BartConfig),
             token_inputs, bart_stacks),
    "marian": (lambda: bart_like(transformers.MarianMTModel, transformers.MarianConfig),
               token_inputs, bart_stacks),
    "t5": (tiny_t5, token_inputs, t5_stacks),
    "whisper": (tiny_whisper, audio_inputs, bart_stacks),
}  # fmt: skip

DECODER_IDS = torch.tensor([[1, 5, 9, 14, 3], [1, 33, 7, 7, 20]])  # 5 positions: the encoders see 7 or 8


def projections(attention):
    """(value projection, output projection W_O) of an attention module."""
    if hasattr(attention, "v_proj"):
        return attention.v_proj, getattr(attention, "out_proj", None) or attention.o_proj
    return attention.v, attention.o  # T5


def with_neutreno_hooks(stacks, lam):
    """An unpatched model made NeuTRENO by plain hooks (math.md §2, Eq. 26): each self-attention's value
    projection output V (B, N, H·d, heads side by side) is kept, and the input of each later layer's W_O
    gets λ (V⁰ − V), V⁰ the first layer's of the *same* stack. Returns the hook handles."""
    handles = []
    for stack in stacks:
        values = {}
        for index, attention in enumerate(stack):
            value, output = projections(attention)

            def keep(module, args, out, index=index, values=values):
                values[index] = out

            def add_term(module, args, index=index, values=values):
                return (args[0] + lam * (values[0] - values[index]),)

            handles.append(value.register_forward_hook(keep))
            if index:
                handles.append(output.register_forward_pre_hook(add_term))
    return handles


def hooked_and_plain(plain, inputs, stacks):
    """``forward`` of the unpatched ``plain`` made NeuTRENO by hooks on its ``stacks(plain)`` self-attention
    stacks (the reference), and without them."""
    handles = with_neutreno_hooks(stacks(plain)[0], LAM)
    expected = forward(plain, inputs)
    for handle in handles:
        handle.remove()
    return expected, forward(plain, inputs)


def forward(model, inputs):
    with torch.no_grad():
        out = model(**inputs, decoder_input_ids=DECODER_IDS, use_cache=False)
    return out.encoder_last_hidden_state, out.logits


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_stack_equals_a_hand_written_forward_with_its_own_v0(name):
    build, inputs, stacks = FAMILIES[name]
    model, x = build(), inputs()
    expected, unpatched = hooked_and_plain(copy.deepcopy(model), x, stacks)
    apply_neutreno(model, lam=LAM)
    assert is_patched(model) and neutreno_lambda(model) == LAM
    got = forward(model, x)
    for g, e, u in zip(got, expected, unpatched, strict=True):  # encoder output, decoder logits
        torch.testing.assert_close(g, e, **TOL)
        assert (g - u).abs().max() > 1e-2  # the term is not vacuous in either stack
    # The library found the same stacks as named by hand: λ on every self-attention, the first of each
    # stack marked first, nothing on cross-attention.
    self_stacks, cross = stacks(model)
    for stack in self_stacks:
        assert [a.neutreno.first for a in stack] == [True, False, False]
    assert not any(hasattr(a, "neutreno") for a in cross)
    patched = {id(m) for m in model.modules() if hasattr(m, "neutreno")}
    assert patched == {id(a) for stack in self_stacks for a in stack}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cross_attention_gives_what_the_unpatched_module_gives_for_its_inputs(name):
    build, inputs, stacks = FAMILIES[name]
    model, x = build(), inputs()
    plain = copy.deepcopy(model)
    apply_neutreno(model, lam=1.0)
    calls = []
    handles = [
        attention.register_forward_hook(
            lambda module, args, kwargs, out, index=index: calls.append((index, args, dict(kwargs), out[0])),
            with_kwargs=True,
        )
        for index, attention in enumerate(stacks(model)[1])
    ]
    forward(model, x)
    for handle in handles:
        handle.remove()
    assert [index for index, *_ in calls] == [0, 1, 2]
    plain_cross = stacks(plain)[1]
    for index, args, kwargs, out in calls:
        assert args[0].shape[1] == DECODER_IDS.shape[1]  # queries: the decoder's positions
        kwargs.pop("neutreno_call_state", None)  # the V⁰ holder, passed down to every attention
        with torch.no_grad():
            again = plain_cross[index](*args, **kwargs)[0]
        torch.testing.assert_close(out, again, atol=0, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cached_generation_gives_the_tokens_of_uncached(name):
    build, inputs, _ = FAMILIES[name]
    model, x = build(), inputs()
    settings = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8)
    plain = model.generate(**x, **settings)
    apply_neutreno(model, lam=1.0)
    cached = model.generate(**x, use_cache=True, **settings)
    uncached = model.generate(**x, use_cache=False, **settings)
    assert torch.equal(cached, uncached)
    assert not torch.equal(cached, plain)  # NeuTRENO changed the tokens: the comparison can fail
    # the decoder's self-attention on a static cache (the cross-attention's is not read)
    assert torch.equal(model.generate(**x, cache_implementation="static", **settings), uncached)
    # Step by step: each new position's logits through the cache equal a full forward's.
    with torch.no_grad():
        full = model(**x, decoder_input_ids=DECODER_IDS, use_cache=False).logits
        out = model(**x, decoder_input_ids=DECODER_IDS[:, :1], use_cache=True)
        for t in range(1, DECODER_IDS.shape[1]):
            out = model(**x, decoder_input_ids=DECODER_IDS[:, t : t + 1], **with_cache(model, kv_cache(out)))
            torch.testing.assert_close(out.logits[:, 0], full[:, t], **TOL)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lambda_zero_remove_and_save_pretrained(name, tmp_path):
    build, inputs, _ = FAMILIES[name]
    model, x = build(), inputs()
    plain = forward(model, x)
    kernels = {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}
    apply_neutreno(model, lam=0.0)
    assert all(torch.equal(a, b) for a, b in zip(forward(model, x), plain, strict=True))
    apply_neutreno(model, lam=LAM)
    patched = forward(model, x)
    model.save_pretrained(tmp_path)
    reloaded = from_pretrained(type(model), str(tmp_path)).eval()
    assert neutreno_lambda(reloaded) == LAM
    assert all(torch.equal(a, b) for a, b in zip(forward(reloaded, x), patched, strict=True))
    remove_neutreno(model)
    assert all(torch.equal(a, b) for a, b in zip(forward(model, x), plain, strict=True))
    assert not any(hasattr(m, "neutreno") for m in model.modules())
    assert {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")} == kernels


# ---- models holding several towers --------------------------------------------------------------------


def tiny_clip():
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           image_size=16, patch_size=4),
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.CLIPModel(config).eval()


def test_each_clip_tower_has_its_own_v0():
    """Text (2 layers, 7 tokens) and vision (3 layers, 17 positions): each against the hooks above."""
    model = tiny_clip()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    x = {**token_inputs(), "pixel_values": pixels}

    def embeds(m):
        with torch.no_grad():
            out = m(**x)
        return out.text_embeds, out.image_embeds

    def towers(m):
        return [[layer.self_attn for layer in t.encoder.layers] for t in (m.text_model, m.vision_model)]

    plain = copy.deepcopy(model)
    unpatched = embeds(plain)
    with_neutreno_hooks(towers(plain), LAM)
    expected = embeds(plain)
    apply_neutreno(model, lam=LAM)
    assert [[a.neutreno.first for a in t] for t in towers(model)] == [[True, False], [True, False, False]]
    for g, e, u in zip(embeds(model), expected, unpatched, strict=True):
        torch.testing.assert_close(g, e, **TOL)
        assert (g - u).abs().max() > 1e-2


def test_an_encoder_decoder_model_of_two_towers_generates_the_same_cached_and_uncached():
    """EncoderDecoderModel: a BERT encoder and a GPT-2 decoder with cross-attention, each its own config."""
    encoder = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.3,
    )  # fmt: skip
    decoder = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, 0, 2
    torch.manual_seed(0)
    model = transformers.EncoderDecoderModel(config=config).eval()
    x = token_inputs()
    settings = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8)
    plain = model.generate(**x, **settings)
    apply_neutreno(model, lam=1.0)
    self_attention = [layer.attention.self for layer in model.encoder.encoder.layer] + [
        block.attn for block in model.decoder.transformer.h
    ]
    patched = [m for m in model.modules() if hasattr(m, "neutreno")]
    assert [id(m) for m in patched] == [id(m) for m in self_attention]
    assert [m.neutreno.first for m in patched] == [True, False, True, False, False]
    cached = model.generate(**x, use_cache=True, **settings)
    assert torch.equal(cached, model.generate(**x, use_cache=False, **settings))
    assert not torch.equal(cached, plain)


def test_blip2_patches_the_self_attention_of_each_tower_and_no_q_former_cross_attention():
    """BLIP-2: a vision encoder, a Q-Former (self-attention over its queries, cross-attention to the
    image) and an OPT decoder; the Q-Former's wrapper passes encoder_hidden_states down to both."""
    config = transformers.Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4),
        qformer_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, encoder_hidden_size=32, cross_attention_frequency=1),
        text_config=dict(model_type="opt", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                         num_attention_heads=4, word_embed_proj_dim=32),
        num_query_tokens=4,
    )  # fmt: skip
    model = apply_neutreno(transformers.Blip2ForConditionalGeneration(config).eval(), LAM)
    qformer = model.qformer.encoder.layer
    expected = (
        [layer.self_attn for layer in model.vision_model.encoder.layers]
        + [layer.attention.attention for layer in qformer]
        + [layer.self_attn for layer in model.language_model.model.decoder.layers]
    )
    patched = [m for m in model.modules() if hasattr(m, "neutreno")]
    assert [id(m) for m in patched] == [id(m) for m in expected]
    assert [m.neutreno.first for m in patched] == [True, False] * 3
    assert not any(hasattr(m, "neutreno") for layer in qformer for m in layer.crossattention.modules())


# ---- what is refused ----------------------------------------------------------------------------------


def test_what_cannot_be_supported_is_refused_naming_the_class_and_why():
    led = transformers.LEDConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, attention_window=4,
        max_encoder_position_embeddings=32, max_decoder_position_embeddings=32,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"LEDModel is not supported: the layers of LEDEncoder attend"):
        apply_neutreno(transformers.LEDModel(led))  # Longformer attention: only the decoder would be patched

    whisper = tiny_whisper().train()  # LayerDrop draws in training mode only
    whisper.config.encoder_layerdrop = 0.1
    with pytest.raises(
        ValueError, match=r"LayerDrop can skip the first layer.*model\.config\.encoder_layerdrop = 0\.1"
    ):
        apply_neutreno(whisper)

    # LayerDrop in one tower's own config is found too.
    bert = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64
    )
    bart = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
        decoder_layerdrop=0.2,
    )  # fmt: skip
    two_towers = transformers.EncoderDecoderModel(
        config=transformers.EncoderDecoderConfig.from_encoder_decoder_configs(bert, bart)
    )
    with pytest.raises(ValueError, match=r"set model\.decoder\.config\.decoder_layerdrop = 0"):
        apply_neutreno(two_towers)

    # A stack that copied its rate when built (BART's encoder) keeps LayerDrop on after the config's field
    # is set to 0, and SeamlessM4T's speech encoder has a field of its own: both were accepted, and the
    # first training step whose draw skipped layer 0 raised "no V⁰".
    built = transformers.BartModel(
        transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layerdrop=0.3,
        )
    )  # fmt: skip
    built.config.encoder_layerdrop = 0.0
    with pytest.raises(ValueError, match=r"set model\.encoder\.layerdrop = 0\.3 to 0 first"):
        apply_neutreno(built)
    built.encoder.layerdrop = 0.0
    apply_neutreno(built)
    built.encoder.layerdrop = 0.3  # turned on since: refused at the next training step, not run
    with pytest.raises(ValueError, match=r"layerdrop = 0\.3 can skip the first layer"):
        built.train()(input_ids=torch.tensor([[5, 6, 7]]), decoder_input_ids=torch.tensor([[5, 6]]))
    seamless = transformers.SeamlessM4TConfig(
        vocab_size=96, t2u_vocab_size=96, hidden_size=32, encoder_layers=1, decoder_layers=1,
        speech_encoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        speech_encoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        speech_encoder_intermediate_size=64, feature_projection_input_dim=16, t2u_encoder_layers=1,
        t2u_decoder_layers=1, t2u_encoder_ffn_dim=32, t2u_decoder_ffn_dim=32, t2u_num_langs=2,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, max_position_embeddings=64,
        t2u_max_position_embeddings=64,
    )  # fmt: skip
    assert seamless.speech_encoder_layerdrop > 0  # its default
    with pytest.raises(ValueError, match=r"model\.config\.speech_encoder_layerdrop = 0\.1"):
        apply_neutreno(transformers.SeamlessM4TForSpeechToText(seamless))


def test_layerdrop_is_refused_in_training_mode_only():
    """M2M-100's default LayerDrop (0.05, as in its pretrained configs) was refused at apply_neutreno
    for a model in eval mode, which runs every layer: the README's M2M-100 could not be patched for
    inference. In training mode it is refused, at apply and at a forward (without a gradient too:
    LayerDrop draws whenever the model is in training mode)."""
    config = transformers.M2M100Config(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    )  # fmt: skip
    assert config.encoder_layerdrop == config.decoder_layerdrop == 0.05  # transformers' default
    torch.manual_seed(0)
    model = transformers.M2M100Model(config).eval()
    x, y = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[2, 5, 6]])
    plain = model(input_ids=x, decoder_input_ids=y).last_hidden_state
    apply_neutreno(model, lam=0.0)  # accepted in eval mode; λ = 0 is the model's own output
    assert torch.equal(model(input_ids=x, decoder_input_ids=y).last_hidden_state, plain)
    apply_neutreno(model, lam=0.6)
    patched = model(input_ids=x, decoder_input_ids=y).last_hidden_state
    assert not torch.allclose(patched, plain)
    for _ in range(3):  # every layer runs: the same output each call
        assert torch.equal(model(input_ids=x, decoder_input_ids=y).last_hidden_state, patched)
    model.train()
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"layerdrop = 0\.05 can skip"):
            model(input_ids=x, decoder_input_ids=y)
    remove_neutreno(model)
    with pytest.raises(ValueError, match=r"model\.config\.encoder_layerdrop = 0\.05"):
        apply_neutreno(model)


def test_a_cross_attention_handed_the_encoder_states_by_position_is_told_apart():
    """A decoder layer handing the encoder's states to its cross-attention positionally
    (``self.encoder_attn(x, encoder_hidden_states)``, as Dia's layers do): Python binds the second
    argument to BartAttention's ``key_value_states``, so the call says which attention is which, read
    through the callee's signature. It was refused; it is patched now, its cross-attention plain, equal to
    the forward written with hooks. Handing it ``None`` there hands nothing: then neither call says, and
    the model is refused instead of guessed."""
    from transformers.models.bart.modeling_bart import BartDecoderLayer

    class Positional(BartDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
            residual = hidden_states
            hidden_states, _ = self.self_attn(hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states = self.self_attn_layer_norm(residual + hidden_states)
            residual = hidden_states
            hidden_states, _ = self.encoder_attn(hidden_states, encoder_hidden_states, **kwargs)
            return self.encoder_attn_layer_norm(residual + hidden_states)

    class PositionalNone(BartDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
            hidden_states, _ = self.self_attn(hidden_states, attention_mask=attention_mask, **kwargs)
            hidden_states, _ = self.encoder_attn(hidden_states, None, **kwargs)
            return hidden_states

    build, inputs, stacks = FAMILIES["bart"]
    model, x = build(), inputs()
    decoder = model.model.decoder
    decoder.layers = torch.nn.ModuleList(Positional(model.config, i) for i in range(len(decoder.layers)))
    expected, unpatched = hooked_and_plain(copy.deepcopy(model), x, stacks)
    apply_neutreno(model, lam=LAM)
    assert sorted(n for n, m in model.named_modules() if hasattr(m, "neutreno")) == sorted(
        n for n, m in model.named_modules() if n.endswith("self_attn")
    )
    for g, e, u in zip(forward(model, x), expected, unpatched, strict=True):
        torch.testing.assert_close(g, e, **TOL)
        assert (g - u).abs().max() > 1e-3
    model = build()
    decoder = model.model.decoder
    decoder.layers = torch.nn.ModuleList(PositionalNone(model.config, i) for i in range(len(decoder.layers)))
    with pytest.raises(
        ValueError,
        match=r"not one self-attention module per layer .*BartDecoder \(found \[2, 2, 2\]; layers\.0, "
        r"layers\.1, layers\.2 hold several self-attentions each, in an order of V⁰ that is not known\)",
    ):
        apply_neutreno(model)
    assert not is_patched(model)


def test_two_stacks_run_by_one_module_each_have_their_own_v0():
    """VideoPrism's vision model runs its spatial and its temporal layers itself: two stacks under one
    module, each with the V⁰ of its own first layer. 4 frames × 4 patches make the two stacks' values
    the same shape, so one V⁰ shared between them would pass silently."""
    config = transformers.VideoPrismVisionConfig(
        image_size=8, num_frames=4, tubelet_size=(1, 4, 4), hidden_size=32, num_attention_heads=4,
        intermediate_size=64, num_spatial_layers=2, num_temporal_layers=2, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.VideoPrismVisionModel(config).eval()
    video = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    stacks = [
        [layer.attention for layer in plain.spatial_layers],
        [layer.attention for layer in plain.temporal_layers],
    ]
    handles = with_neutreno_hooks(stacks, LAM)
    with torch.no_grad():
        expected = plain(video).last_hidden_state
        for handle in handles:
            handle.remove()
        unpatched = plain(video).last_hidden_state
        got = apply_neutreno(model, LAM)(video).last_hidden_state
    torch.testing.assert_close(got, expected, **TOL)
    assert (got - unpatched).abs().max() > 1e-2


def test_a_decoder_whose_attention_is_handed_the_encoders_states_is_refused_not_left_softmax():
    """T5Gemma2's decoder layers call one merged self- and cross-attention with the encoder's states:
    it cannot be patched as a self-attention, and leaving it softmax under a patched encoder would make
    a model only partly NeuTRENO."""
    text = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["full_attention"] * 2, sliding_window=8,
    )  # fmt: skip
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
    )
    config = transformers.T5Gemma2Config(encoder=dict(text_config=text, vision_config=vision), decoder=text)
    model = transformers.T5Gemma2ForConditionalGeneration(config)
    with pytest.raises(ValueError, match="cannot be told from cross-attention"):
        apply_neutreno(model.model.decoder, LAM)
    assert not is_patched(model.model.decoder)
    with pytest.raises(ValueError, match=r"^T5Gemma2ForConditionalGeneration"):  # (its SigLIP tower, first)
        apply_neutreno(model, LAM)
    assert not is_patched(model)


def test_towers_with_different_kernels_are_refused():
    """One kernel under NeuTRENO would replace a tower's own (λ = 0 no longer exact), and removing it
    could not restore both."""
    model = tiny_clip()
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    with pytest.raises(ValueError, match=r"different attention kernels \(eager, sdpa\)"):
        apply_neutreno(model, LAM)


def test_blt_lists_of_cross_attentions_are_left_plain():
    """BLT's local encoder and decoder hold their cross-attentions (bytes ↔ patches) in lists of their
    own, called as ``self.cross_attn_layers[i](…, cross_attention_states=…)``. Such a list was taken for
    a self-attention stack: in the default config the forward failed; with the encoder's cross-attention
    in every layer it ran, the last bytes' values standing in as patches' V (0.41 off). Each self-attention
    stack against hooks written here (λ(V⁰ − V) at W_O's input, V⁰ its own first layer's values)."""
    if not hasattr(transformers, "BltModel"):
        pytest.skip("transformers has no BltModel")
    sub = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, vocab_size=260
    )
    for encoder_all, decoder_all in ((False, True), (True, False)):
        config = transformers.BltConfig(
            vocab_size=260, patch_in_forward=False, patching_mode="static", patch_size=4, cross_attn_k=2,
            encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3],
            encoder_hash_byte_group_nb_functions=1,
            patcher_config=dict(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
            ),
            encoder_config=dict(
                **sub, num_hidden_layers=2, hidden_size_global=32, cross_attn_all_layers=encoder_all
            ),
            decoder_config=dict(
                **sub, num_hidden_layers=3, hidden_size_global=32, cross_attn_all_layers=decoder_all
            ),
            global_config=dict(
                hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                num_hidden_layers=2,
            ),
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.BltModel(config).eval().double()
        inputs = dict(
            input_ids=torch.randint(3, 250, (2, 12)), patch_lengths=torch.full((2, 3), 4), use_cache=False
        )
        patched = apply_neutreno(copy.deepcopy(model), LAM)
        assert sorted(n for n, m in patched.named_modules() if hasattr(m, "neutreno")) == sorted(
            n for n, m in model.named_modules() if type(m).__name__ == "BltSelfAttention"
        )
        values, handles = {}, []
        for name, module in model.named_modules():
            if type(module).__name__ != "BltSelfAttention":
                continue
            stack, index = name.split(".layers.")[0], int(name.split(".layers.")[1].split(".")[0])

            def keep(_, __, out, key=(stack, index), values=values):
                values[key] = out

            def add_term(_, args, key=(stack, index), values=values):
                return None if key[1] == 0 else (args[0] + LAM * (values[(key[0], 0)] - values[key]),)

            handles += [
                module.v_proj.register_forward_hook(keep),
                module.o_proj.register_forward_pre_hook(add_term),
            ]
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state
            for handle in handles:
                handle.remove()
            plain = model(**inputs).last_hidden_state
            got = patched(**inputs).last_hidden_state
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
        assert (got - plain).abs().max() > 1e-2


def test_dia_decoder_layers_hand_their_cross_attention_the_encoder_states_by_position():
    """Dia's decoder layers call ``self.cross_attention(x, encoder_hidden_states, …)``: it was refused
    ("not one self-attention module per layer"). Each stack now against hooks written here."""
    if not hasattr(transformers, "DiaModel"):
        pytest.skip("transformers has no DiaModel")
    encoder = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        intermediate_size=64, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    decoder = dict(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, cross_num_attention_heads=4, cross_head_dim=8,
        cross_num_key_value_heads=4, cross_hidden_size=32, vocab_size=64, num_channels=2,
        max_position_embeddings=64, pad_token_id=61, eos_token_id=60, bos_token_id=62,
    )  # fmt: skip
    config = transformers.DiaConfig(encoder_config=encoder, decoder_config=decoder, delay_pattern=[0, 1])
    torch.manual_seed(0)
    model = transformers.DiaModel(config).eval().double()
    for weight in (p for p in model.parameters() if p.dim() > 1):
        torch.nn.init.normal_(weight, std=0.3)  # far from the init's near-identity: λ changes the outputs
    inputs = dict(
        input_ids=torch.randint(0, 60, (2, 7)),
        decoder_input_ids=torch.randint(0, 60, (2, 5, 2)),
        use_cache=False,
    )
    stacks = [[layer.self_attention for layer in stack.layers] for stack in (model.encoder, model.decoder)]
    handles = with_neutreno_hooks(stacks, LAM)
    with torch.no_grad():
        expected = model(**inputs)
    for handle in handles:
        handle.remove()
    patched = apply_neutreno(copy.deepcopy(model), LAM)
    assert sorted(n for n, m in patched.named_modules() if hasattr(m, "neutreno")) == sorted(
        n for n, m in patched.named_modules() if n.endswith("self_attention")
    )
    with torch.no_grad():
        got, plain = patched(**inputs), model(**inputs)
    for name in ("last_hidden_state", "encoder_last_hidden_state"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), atol=1e-10, rtol=1e-10)
        assert (getattr(got, name) - getattr(plain, name)).abs().max() > 1e-2

"""neutreno.hf: NeuTRENO put into Hugging Face models through the attention interface, checked
against models written out by hand (tests/reference.py) on tiny random BERT, GPT-2 and Llama."""

import copy
import re
import threading

import pytest
import torch

from neutreno.hf import apply_neutreno, is_patched, neutreno_lambda, remove_neutreno

from reference import (
    albert_forward,
    bert_forward,
    gpt2_logits,
    kv_cache,
    llama_logits,
    saved_bytes,
    with_cache,
)

transformers = pytest.importorskip("transformers")

VOCAB = 50


def tiny_bert(attn="sdpa"):
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    model.set_attn_implementation(attn)
    return model


def tiny_gpt2(attn="sdpa"):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=3, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation(attn)
    return model


def tiny_llama(attn="sdpa"):
    """Grouped-query attention: 4 query heads share 2 key/value heads."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model


def ids(batch=2, length=7, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, input_ids, attention_mask=None):
    """The model's main output: last hidden states for BERT, logits for the causal LMs."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


CASES = {
    "bert": (tiny_bert, lambda m, x, lam: bert_forward(m, x, torch.ones_like(x), lam)[-1]),
    "gpt2": (tiny_gpt2, gpt2_logits),
    "llama": (tiny_llama, llama_logits),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CASES))
def test_patched_model_equals_a_hand_written_neutreno_forward(name, attn):
    build, reference = CASES[name]
    model, x = build(attn), ids()
    plain = run(model, x)
    torch.testing.assert_close(
        plain, reference(model, x, 0.0), atol=2e-5, rtol=1e-4
    )  # the reference is right
    apply_neutreno(model, lam=0.6)
    assert is_patched(model) and neutreno_lambda(model) == 0.6
    patched = run(model, x)
    torch.testing.assert_close(patched, reference(model, x, 0.6), atol=2e-5, rtol=1e-4)
    assert (patched - plain).abs().max() > 1e-2  # the term is not vacuous
    remove_neutreno(model)
    assert not is_patched(model) and model.config._attn_implementation == attn
    torch.testing.assert_close(run(model, x), plain, atol=0, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_lambda_zero_leaves_every_output_unchanged(name):
    model, x = CASES[name][0](), ids()
    plain = run(model, x)
    apply_neutreno(model, lam=0.0)
    torch.testing.assert_close(run(model, x), plain, atol=0, rtol=0)


def test_padding_does_not_leak_into_real_tokens():
    """BERT with padded sentences: each sentence's real tokens equal its own unpadded run, and the
    hand-written forward with the padding mask."""
    model = apply_neutreno(tiny_bert(), lam=0.6)
    x = ids(batch=2, length=8)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    batched = run(model, x, mask)
    alone = run(model, x[1:, :5])
    torch.testing.assert_close(batched[1, :5], alone[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        batched[:, :5], bert_forward(model, x, mask, 0.6)[-1][:, :5], atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generation_with_the_kv_cache_matches_without(name):
    model = apply_neutreno(CASES[name][0](), lam=0.6)
    prompt = ids(batch=2, length=5, seed=3)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **settings)
    uncached = model.generate(prompt, use_cache=False, **settings)
    assert cached.shape == (2, 13)
    assert torch.equal(cached, uncached)
    # Step by step: the logits of each new position through the cache equal a full forward's.
    full = run(model, cached)
    with torch.no_grad():
        out = model(input_ids=cached[:, :5], use_cache=True)
        for t in range(5, 12):
            out = model(input_ids=cached[:, t : t + 1], **with_cache(model, kv_cache(out)), use_cache=True)
            torch.testing.assert_close(out.logits[:, 0], full[:, t], atol=2e-5, rtol=1e-4)


def generate_with_logits(model, prompt, mask, **settings):
    out = model.generate(
        prompt, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True, **settings,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_static_cache_gives_what_the_dynamic_cache_gives(name):
    """A static KV cache (what compiled generation runs on) writes each call's values into a preallocated
    buffer at its positions, not at the end: the term read the buffer's unfilled tail (off by 0.5–2), so
    it was refused. Now each step's logits equal the dynamic cache's (itself checked against uncached
    forwards above), a left-padded row included, and differ from the unpatched model's."""
    plain = CASES[name][0]()
    model = apply_neutreno(copy.deepcopy(plain), lam=0.6)
    prompt, mask = ids(batch=2, length=5, seed=3), torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    tokens, logits = generate_with_logits(model, prompt, mask)
    static_tokens, static_logits = generate_with_logits(model, prompt, mask, cache_implementation="static")
    assert torch.equal(static_tokens, tokens)
    torch.testing.assert_close(static_logits, logits, atol=2e-5, rtol=1e-4)
    _, plain_logits = generate_with_logits(plain, prompt, mask, cache_implementation="static")
    assert (static_logits[:, 0] - plain_logits[:, 0]).abs().max() > 1e-3  # the term is not vacuous


def test_a_static_cache_given_by_position_gives_a_full_forwards_outputs():
    """GPT-2 takes its cache second, a Llama fourth: a static cache given by position, filled over two
    calls, gives each position the hidden states of one uncached forward over the whole sequence."""
    from transformers import StaticCache

    x = ids(length=6)
    for model, args in ((tiny_gpt2(), ()), (tiny_llama(), (None, None))):
        apply_neutreno(model, lam=0.6)
        with torch.no_grad():
            full = model.base_model(x).last_hidden_state
            cache = StaticCache(config=model.config, max_cache_len=16)
            first = model.base_model(x[:, :4], *args, cache).last_hidden_state
            rest = model.base_model(x[:, 4:], *args, cache).last_hidden_state
        torch.testing.assert_close(torch.cat([first, rest], 1), full, atol=2e-5, rtol=1e-4)


def test_compiled_generation_on_a_static_cache_gives_eager_tokens():
    """The point of a static cache: generate with the forward compiled as one graph (fullgraph; the eager
    backend, to check tracing without the compiler's minutes) gives the tokens and logits of eager
    generation with the dynamic cache."""
    model = apply_neutreno(tiny_llama(), lam=0.6)
    prompt, mask = ids(batch=2, length=5, seed=3), torch.ones(2, 5, dtype=torch.long)
    tokens, logits = generate_with_logits(model, prompt, mask)
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    compiled = generate_with_logits(model, prompt, mask, cache_implementation="static")
    assert torch.equal(compiled[0], tokens)
    torch.testing.assert_close(compiled[1], logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [4, 16])
def test_a_sliding_window_static_cache_gives_what_the_dynamic_cache_gives(window):
    """A static sliding-window layer (Mistral's, Gemma's local layers) writes in place until its window
    fills, then returns its rolled buffer or its states concatenated, this call's values last: each step's
    logits equal the dynamic cache's, with the window filled by the prompt (4) and never filled (16)."""
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=window, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.MistralForCausalLM(config).eval()
    model = apply_neutreno(copy.deepcopy(plain), lam=0.6)
    prompt, mask = ids(batch=2, length=5, seed=3), torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    for m in (plain, model):  # (the unpatched model first: the reference holds for it)
        tokens, logits = generate_with_logits(m, prompt, mask)
        static_tokens, static_logits = generate_with_logits(m, prompt, mask, cache_implementation="static")
        assert torch.equal(static_tokens, tokens)
        torch.testing.assert_close(static_logits, logits, atol=2e-5, rtol=1e-4)


def test_a_cache_layer_of_another_kind_is_refused():
    """A layer class the positions of whose values are not known (here a subclass of StaticLayer, which
    may write elsewhere) is refused, not read as if it were a static layer."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    class OtherLayer(StaticLayer):
        pass

    model = apply_neutreno(tiny_llama(), lam=0.6)
    cache = StaticCache(config=model.config, max_cache_len=16)
    cache.layers[1] = OtherLayer(max_cache_len=16)
    with pytest.raises(ValueError, match=r"or a static one, got StaticCache with OtherLayer"):
        model(ids(length=4), None, None, cache)  # (by position: the keyword was renamed in 5.24)
    from neutreno.integrations.hf import _dummy_cache_layer, _static_layers

    if _dummy_cache_layer() is not None:  # the note on shared layers only where the rest is static
        cache.layers[1] = _dummy_cache_layer()()
        with pytest.raises(ValueError, match=r"\(DummyLayer: layers that share another's keys"):
            _static_layers(cache)
        cache.layers[0] = OtherLayer(max_cache_len=16)
        with pytest.raises(ValueError, match=r"with DummyLayer and OtherLayer and StaticLayer$"):
            _static_layers(cache)


def test_a_quantized_cache_deriving_from_the_dynamic_one_is_refused():
    """The quantized cache layers (and an indexed one, the linear-attention hybrids') derive from
    DynamicLayer and passed for it: a quantized cache was accepted, though said to be refused."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, QuantizedCache

    model = apply_neutreno(tiny_llama(), lam=0.6)
    with pytest.raises(ValueError, match=r"got QuantizedCache with Fp8QuantizedLayer"):
        model(ids(length=4), None, None, QuantizedCache("fp8", model.config))

    class OtherLayer(DynamicLayer):
        pass

    cache = DynamicCache(config=model.config)
    cache.layers[0] = OtherLayer()
    with pytest.raises(ValueError, match=r"got DynamicCache with DynamicLayer and OtherLayer"):
        model(ids(length=4), None, None, cache)


def test_a_compiled_model_is_repatched_and_unpatched():
    """torch.compile's wrapper forwards getattr to the model: it counted as a second holder of the one
    patch, and replacing or removing it raised an AttributeError, leaving the model unpatched."""
    compiled = torch.compile(tiny_llama(), backend="eager")
    apply_neutreno(compiled, lam=0.6)
    apply_neutreno(compiled, lam=0.3)
    assert is_patched(compiled) and neutreno_lambda(compiled) == 0.3
    remove_neutreno(compiled)
    assert not is_patched(compiled)


def test_a_learned_lambda_only_where_a_layer_adds_the_term():
    """A genuine one-layer stack (a BART decoder of one layer) got a learned λ as if it were ALBERT's
    shared layer; its only call gives V⁰, so the λ never had a gradient (an error under DDP)."""
    bart = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    )  # fmt: skip
    model = apply_neutreno(transformers.BartModel(bart), lam=0.6, learn_lam="head")
    learned = [n for n, _ in model.named_parameters() if "neutreno_lam" in n]
    assert learned and all(n.startswith("encoder.layers.1.") for n in learned), learned
    albert = apply_neutreno(tiny_albert(1), lam=0.6, learn_lam="head")  # one layer, called 4 times
    assert any("neutreno_lam" in n for n, _ in albert.named_parameters())


def test_two_models_with_different_lambda_do_not_interfere():
    a = tiny_bert()
    b = copy.deepcopy(a)
    apply_neutreno(a, lam=0.2)
    apply_neutreno(b, lam=0.6)
    x = ids()
    ones = torch.ones_like(x)
    for _ in range(2):  # interleaved calls
        torch.testing.assert_close(run(a, x), bert_forward(a, x, ones, 0.2)[-1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(run(b, x), bert_forward(b, x, ones, 0.6)[-1], atol=2e-5, rtol=1e-4)
    apply_neutreno(a, lam=0.6)  # applying again replaces λ
    torch.testing.assert_close(run(a, x), run(b, x), atol=0, rtol=0)


def test_a_submodule_patched_is_reported_replaced_and_removed_through_the_model_holding_it():
    """apply_neutreno(llm.model): the wrapping model runs NeuTRENO, and says so (it said unpatched, λ 0)."""
    llm, x = tiny_llama(), ids()
    plain = run(llm, x)
    apply_neutreno(llm.model, lam=0.6)
    torch.testing.assert_close(run(llm, x), llama_logits(llm, x, 0.6), atol=2e-5, rtol=1e-4)
    assert is_patched(llm) and neutreno_lambda(llm) == 0.6
    apply_neutreno(llm, lam=0.2)  # replaces the submodule's patch, not on top of it
    torch.testing.assert_close(run(llm, x), llama_logits(llm, x, 0.2), atol=2e-5, rtol=1e-4)
    assert is_patched(llm.model) and neutreno_lambda(llm.model) == 0.2  # it runs llm's patch
    for change in (apply_neutreno, remove_neutreno):  # patching inside a patch would hook layers twice
        with pytest.raises(
            ValueError, match=r"LlamaModel is patched through a model holding it \(LlamaForCausalLM\)"
        ):
            change(llm.model)
    remove_neutreno(llm)
    apply_neutreno(llm.model, lam=0.6)
    from neutreno.hf import set_inner_attention

    set_inner_attention(llm, "eager")  # reaches the submodule's patch
    torch.testing.assert_close(run(llm, x), llama_logits(llm, x, 0.6), atol=2e-5, rtol=1e-4)
    remove_neutreno(llm)
    assert not is_patched(llm) and neutreno_lambda(llm) == 0.0
    torch.testing.assert_close(run(llm, x), plain, atol=1e-6, rtol=0)  # eager now, sdpa before
    pair = torch.nn.ModuleList([tiny_llama(), tiny_llama()])  # two towers, two λ: no one answer
    apply_neutreno(pair[0], lam=0.2)
    apply_neutreno(pair[1], lam=0.6)
    with pytest.raises(ValueError, match=r"λ \[0.2, 0.6\] in different submodules"):
        neutreno_lambda(pair)


def test_concurrent_forward_calls_keep_their_own_first_layer_values():
    model = apply_neutreno(tiny_gpt2(), lam=0.6)
    inputs = [ids(seed=s) for s in range(4)]
    expected = [run(model, x) for x in inputs]
    results = [None] * len(inputs)
    barrier = threading.Barrier(len(inputs))

    def work(i):
        barrier.wait()
        for _ in range(5):
            results[i] = run(model, inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_unsupported_models_are_named():
    config = transformers.LEDConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, attention_window=4,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"LEDModel is not supported: .*LEDEncoderAttention"):
        apply_neutreno(transformers.LEDModel(config))  # its encoder's local attention bypasses it
    config = transformers.LongT5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1)
    with pytest.raises(ValueError, match=r"^LongT5Model"):  # its encoder bypasses the interface too
        apply_neutreno(transformers.LongT5Model(config))
    with pytest.raises(ValueError, match="Linear is not a Hugging Face transformers model"):
        apply_neutreno(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="lam must be"):
        apply_neutreno(tiny_bert(), lam=-1)
    with pytest.raises(ValueError, match="no NeuTRENO attention to remove"):
        remove_neutreno(tiny_bert())


def test_roberta_is_patched_like_bert():
    """RoBERTa shares BERT's layers: λ = 0 changes nothing, λ > 0 leaves the first layer's output as it
    was and changes the later ones."""
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.RobertaModel(config, add_pooling_layer=False).eval()
    x = ids() % (VOCAB - 3) + 3  # past RoBERTa's special ids

    def hidden():
        with torch.no_grad():
            return model(input_ids=x, output_hidden_states=True).hidden_states

    plain = hidden()
    apply_neutreno(model, lam=0.0)
    assert all(torch.equal(a, b) for a, b in zip(hidden(), plain, strict=True))
    apply_neutreno(model, lam=0.6)
    patched = hidden()
    assert torch.equal(patched[1], plain[1])
    assert (patched[3] - plain[3]).abs().max() > 1e-2


# ---- issue 19: architectures and training paths that once went silently wrong --------------------------


def tiny_albert(groups: int, inner: int = 1):
    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=64, num_hidden_groups=groups, inner_group_num=inner, hidden_act="gelu",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AlbertModel(config, add_pooling_layer=False).eval()


@pytest.mark.parametrize("groups", [1, 2])
def test_albert_shared_layers_take_v0_from_their_first_call(groups):
    model, x = tiny_albert(groups), ids()
    plain = run(model, x)
    torch.testing.assert_close(plain, albert_forward(model, x, 0.0), atol=2e-5, rtol=1e-4)
    apply_neutreno(model, lam=0.6)
    patched = run(model, x)
    torch.testing.assert_close(patched, albert_forward(model, x, 0.6), atol=2e-5, rtol=1e-4)
    assert (patched - plain).abs().max() > 1e-2  # once bit-identical to the unpatched model


def test_a_model_folder_with_non_finite_weights_is_refused_naming_the_weights(tmp_path):
    """A saved model with one NaN weight loaded, and analyze blamed the input ("hidden state 4 … the model
    overflows on this input"); our own checkpoints were refused naming the weights. So are these now,
    through every loader (from_pretrained, analyze's, the text-classification task's)."""
    from neutreno.integrations.hf import from_pretrained, load_hf

    model = tiny_bert()
    with torch.no_grad():
        model.encoder.layer[2].attention.self.query.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    match = r"the Hugging Face model '.*nan' holds non-finite weights \(encoder\.layer\.2\.attention\.self\."
    for load in (load_hf, from_pretrained):
        with pytest.raises(ValueError, match=match):
            load(transformers.AutoModel, str(tmp_path / "nan"))
    with pytest.raises(ValueError, match=match):  # (model, loading info)
        load_hf(transformers.AutoModel, str(tmp_path / "nan"), output_loading_info=True)
    tiny_bert().save_pretrained(tmp_path / "fine")
    assert isinstance(load_hf(transformers.AutoModel, str(tmp_path / "fine")), torch.nn.Module)
    # a path to nothing: "Repo id must use alphanumeric chars" (read as a hub id) once
    for name in ("./no_such_folder", str(tmp_path / "absent"), "../absent"):
        with pytest.raises(FileNotFoundError, match=f"no such Hugging Face model folder: {re.escape(name)}$"):
            load_hf(transformers.AutoModel, name)


def test_what_cannot_be_patched_is_refused_when_applied_not_at_forward():
    swin = transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4
    )
    with pytest.raises(ValueError, match="differ in width"):  # once silently left unpatched
        apply_neutreno(transformers.SwinModel(swin))
    for depths, heads in (([2, 2], [2, 4]), ([3], [2])):  # once "in an order of V⁰ that is not known"
        model = transformers.SwinModel(
            transformers.SwinConfig(
                image_size=32, patch_size=4, embed_dim=16, depths=depths, num_heads=heads, window_size=4
            )
        )
        with pytest.raises(
            ValueError, match=r"\(layers\.0[^)]*\) are stages.*shifted windows.*rolled tokens"
        ):
            apply_neutreno(model)
        assert not is_patched(model)
    stablelm = transformers.StableLmConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    with pytest.raises(ValueError, match=r"StableLmDecoderLayer\.forward calls self\.self_attn"):
        apply_neutreno(transformers.StableLmModel(stablelm))  # once: accepted, then every forward raised
    opt = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
        word_embed_proj_dim=32, layerdrop=0.5,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"LayerDrop can skip the first layer.*model\.config\.layerdrop = 0\.5"
    ):
        apply_neutreno(transformers.OPTModel(opt))  # once: KeyError 'v0' when layer 0 was dropped
    # "found [2]" alone said neither why nor which setting
    with pytest.raises(ValueError, match=r"found \[2\]; albert_layer_groups\.0 hold several self-attentions.*"
                       r"ALBERT with inner_group_num > 1"):  # fmt: skip
        apply_neutreno(tiny_albert(1, inner=2))
    hybrid = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
    )  # fmt: skip
    # its convolution layers were said to "hold cross-attention only"
    with pytest.raises(ValueError, match=r"found \[0, 1, 0, 1\]; layers\.0, layers\.2 hold no attention\)"):
        apply_neutreno(transformers.Lfm2Model(hybrid))


def informer(**options):
    config = transformers.InformerConfig(
        prediction_length=4, context_length=8, input_size=1, lags_sequence=[1, 2], num_time_features=1,
        d_model=32, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layerdrop=0.0, decoder_layerdrop=0.0, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.InformerModel(config).eval()


def test_a_stack_whose_layers_shorten_the_sequence_is_refused_when_applied():
    """Wav2Vec2-BERT's adapter layers pool the sequence by a strided convolution before their attention,
    so the second layer's values are half as long as V⁰: two of them were accepted, said patched, and
    every forward failed. Informer's default (distil=True) halves it between its encoder layers by
    convolutions in a list beside them, which ends in None: apply_neutreno failed with an AttributeError.
    Both are refused when applied now; one adapter layer (V⁰ is its own values), and Informer without
    distilling, are patched and run."""

    def w2v_bert(adapter_layers):
        config = transformers.Wav2Vec2BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            feature_projection_input_dim=16, layerdrop=0.0, add_adapter=True, adapter_stride=2,
            num_adapter_layers=adapter_layers, adapter_kernel_size=3, output_hidden_size=32,
            conv_depthwise_kernel_size=3,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.Wav2Vec2BertModel(config).eval()

    with pytest.raises(
        ValueError, match=r"Wav2Vec2BertAdapter shortens the sequence .*Conv1d layers\.0\.residual"
    ):
        apply_neutreno(w2v_bert(2))
    features = torch.randn(2, 24, 16)
    one = w2v_bert(1)
    with torch.no_grad():
        plain = one(input_features=features).last_hidden_state
        patched = apply_neutreno(copy.deepcopy(one))(input_features=features).last_hidden_state
    assert plain.shape == patched.shape and (patched - plain).abs().max() > 1e-3
    with pytest.raises(
        ValueError, match=r"InformerEncoder shortens the sequence .*MaxPool1d conv_layers\.0\."
    ):
        apply_neutreno(informer(attention_type="full"))  # distil=True, the default
    assert is_patched(apply_neutreno(informer(attention_type="full", distil=False)))
    # its ProbSparse self-attention bypasses the interface: the reason given, not the decoder's
    # cross-attention being the only attention in sight
    with pytest.raises(ValueError, match="attend through InformerProbSparseAttention, which does not call"):
        apply_neutreno(informer(attention_type="prob", distil=False))


def test_a_model_whose_backbone_takes_no_attention_kernel_is_refused_and_left_as_it_was():
    """DETR with transformers' ResNet backbone: setting any attention implementation fails in the
    backbone. The refusal was transformers' own message about ResNetBackbone, the model kept its patch
    record, and remove_neutreno failed the same way. Now the refusal names the model and the cause, and
    the model is left as it was."""
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"]
    )
    config = transformers.DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_queries=5, encoder_layerdrop=0.0, decoder_layerdrop=0.0, use_pretrained_backbone=False,
    )  # fmt: skip
    torch.manual_seed(0)
    detr = transformers.DetrModel(config).eval()
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        before = detr(pixel_values=pixels).last_hidden_state
    with pytest.raises(
        ValueError,
        match=r"^DetrModel does not let transformers set its attention implementation \(ResNetBackbone",
    ):
        apply_neutreno(detr)
    assert not is_patched(detr) and "_neutreno_patch" not in detr.__dict__
    assert detr.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="has no NeuTRENO attention to remove"):
        remove_neutreno(detr)
    with torch.no_grad():
        assert torch.equal(detr(pixel_values=pixels).last_hidden_state, before)


def test_generation_with_kv_shared_layers_matches_without_the_cache():
    """Gemma3n's last layers share an earlier layer's keys and values, and its dynamic cache holds a
    DummyLayer for them: generate() was refused at forward time ("NeuTRENO needs transformers' dynamic
    KV cache") after apply_neutreno had accepted the model. The cached logits equal the uncached ones,
    which the term changes."""
    layers = 4
    config = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=64, sliding_window=4, num_kv_shared_layers=2, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"] * 2, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * layers, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.Gemma3nForCausalLM(config).eval()
    patched = apply_neutreno(copy.deepcopy(plain))
    prompt = ids(batch=1, length=7)

    def logits(model, **settings):
        with torch.no_grad():
            out = model.generate(
                prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0, **settings,
            )  # fmt: skip
        return torch.stack(out.logits, 1)

    cached, uncached = logits(patched), logits(patched, use_cache=False)
    assert (cached - uncached).abs().max() < 1e-5 * uncached.abs().max()
    assert (uncached - logits(plain, use_cache=False)).abs().max() > 1e-2
    # a static cache puts a shared layer's values where its own layer index does not say: refused, saying so
    with pytest.raises(ValueError, match=r"DummyLayer: layers that share another's keys and values"):
        logits(patched, cache_implementation="static")


def test_a_layer_stack_run_in_a_loop_is_refused():
    """HRM runs its two layer stacks H_cycles × L_cycles times per forward. It was accepted, and every
    run started a V⁰ of its own (its first layer plain softmax): neither the paper's model nor one V⁰
    per forward, while the model said it was patched."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "hrm_text" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no HRM (hrm_text)")
    config = transformers.AutoConfig.for_model(
        "hrm_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, H_cycles=2, L_cycles=3,
        max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"HrmTextModel\.forward runs self\.L_module\(…\), .* in a loop"):
        apply_neutreno(model, lam=0.6)
    assert not is_patched(model)


def test_an_attention_calling_the_interface_more_than_once_is_refused():
    """DiffLlama's attention calls the interface twice (once per half of V); Qwen2-VL's vision attention
    once per image. Both were patched: each call took its own V as the layer's, against the first call's
    V⁰, so the second half (or image) got λ(V⁰ of the first − its own V), mixing images in a batch."""
    diffllama = transformers.DiffLlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"DiffLlamaAttention\.forward must call .* more than one call"):
        apply_neutreno(transformers.DiffLlamaModel(diffllama))
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision = transformers.Qwen2VLConfig(
        vision_config=dict(
            depth=2, embed_dim=32, num_heads=4, hidden_size=32, mlp_ratio=2, patch_size=2,
            temporal_patch_size=1, spatial_merge_size=1,
        )
    ).vision_config  # fmt: skip
    tower = Qwen2VisionTransformerPretrainedModel._from_config(vision, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"VisionAttention\.forward must call .* or one in a loop"):
        apply_neutreno(tower)
    assert not is_patched(tower)


def test_a_stack_or_attention_dropping_its_keyword_arguments_is_refused_when_patched():
    """V⁰'s holder rides in the keyword arguments from the stack's owner to the attention interface.
    DPT's encoder calls each layer with the hidden states only, and AIMv2's attention takes **kwargs
    but does not hand them to the interface: both were patched, then failed at their first forward."""
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    dpt = transformers.DPTModel(transformers.DPTConfig(image_size=32, patch_size=8, **small))
    with pytest.raises(ValueError, match=r"DPTViTEncoder\.forward does not pass keyword arguments on to its"):
        apply_neutreno(dpt)
    assert not is_patched(dpt)
    if not hasattr(transformers, "Aimv2VisionModel"):  # transformers < 4.54
        return
    config = transformers.Aimv2VisionConfig(image_size=32, patch_size=8, **small)
    aimv2 = transformers.Aimv2VisionModel(config)
    with pytest.raises(ValueError, match=r"Aimv2Attention\.forward calls the attention interface without"):
        apply_neutreno(aimv2)
    assert not is_patched(aimv2)


def test_a_stack_mixing_windowed_and_global_layers_is_refused_when_patched():
    """SAM3's ViT attends within windows in some layers (values (B·windows, H, w², d)) and globally in
    others ((B, H, N, d)): it was patched, then stopped at its first global layer."""
    if not hasattr(transformers, "Sam3ViTModel"):
        pytest.skip("transformers has no Sam3ViTModel")
    config = transformers.Sam3ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=64,
        patch_size=8, window_size=4, global_attn_indexes=[1], pretrain_image_size=64,
    )  # fmt: skip
    model = transformers.Sam3ViTModel(config)
    with pytest.raises(ValueError, match=r"Sam3ViTModel: the layers of .*\(window_size \[0, 4\]"):
        apply_neutreno(model)
    assert not is_patched(model)
    # LW-DETR's ViT says so by a flag, `window`: it was accepted, then failed at its first global layer
    # ("values of shape (2, 4, 64, 8) cannot take V⁰ of shape (8, 4, 16, 8)")
    if hasattr(transformers, "LwDetrViTBackbone"):
        config = transformers.LwDetrViTConfig(
            hidden_size=32, num_hidden_layers=3, num_attention_heads=4, mlp_ratio=2, image_size=64,
            pretrain_image_size=64, patch_size=8, num_windows=4, window_block_indices=[0, 2],
            out_indices=[1, 3],
        )  # fmt: skip
        with pytest.raises(ValueError, match=r"LwDetrViTEncoder attend .*\(window \[False, True\]\)"):
            apply_neutreno(transformers.LwDetrViTBackbone(config))


class _OwnValuesLast(torch.nn.Module):
    def forward(self, hidden_states, past_value, **kwargs):
        value = self.v_proj(hidden_states)
        value = torch.cat([past_value, value], dim=2)  # a cache of its own: this call's values last
        return self.attention_interface(self, hidden_states, value, value, None, **kwargs)


class _EntriesAppended(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        kv = self.kv_proj(hidden_states)
        kv = torch.cat([kv, self.compressor(hidden_states)], dim=2)
        return self.attention_interface(self, hidden_states, kv, kv, None, **kwargs)


class _EntriesAppendedAnnotated(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        value_states = self.v_proj(hidden_states)
        value_states: torch.Tensor = torch.cat([value_states, self.memory], dim=2)
        return self.attention_interface(self, hidden_states, value_states, value_states, None, **kwargs)


class _EntriesAppendedInATuple(torch.nn.Module):
    def forward(self, hidden_states, **kwargs):
        key_states, value_states = self.k_proj(hidden_states), self.v_proj(hidden_states)
        key_states, value_states = (
            torch.cat([key_states, self.mk], 2),
            torch.cat([value_states, self.mv], 2),
        )
        return self.attention_interface(self, hidden_states, key_states, value_states, None, **kwargs)


class _LambdaForward(torch.nn.Module):  # no def to read the arguments from: it crashed (StopIteration)
    forward = lambda self, x, **kwargs: self.attention_interface(self, x, x, x, None, **kwargs)  # noqa: E731


class _ContextBeforeOwn(torch.nn.Module):  # DFlash's drafter: context states joined before its own
    def forward(self, hidden_states, context, **kwargs):
        joined = torch.cat([context, hidden_states], dim=1)
        value_states = self.v_proj(joined)
        key_states = torch.cat((self.rotate(self.k_proj(joined)), self.k_proj(joined)), dim=-1)
        return self.attention_interface(self, hidden_states, key_states, value_states, None, **kwargs)


def test_an_attention_joining_entries_after_its_own_values_is_refused():
    """DeepSeek-V4's compressed layers append compressed keys and values after their own: the term took
    the last N positions as the layer's V (compressed entries in, its first own tokens out), a silently
    different model. Its class is refused when applied, read from the source as the other checks are;
    and a forward that gets more values than queries with no KV cache is refused at the attention."""
    from neutreno.integrations.hf import (
        _CALL_STATE,
        _CallState,
        _joined_values,
        _LayerSetting,
        neutreno_attention,
    )

    for appended in (_EntriesAppended, _EntriesAppendedAnnotated, _EntriesAppendedInATuple):
        assert _joined_values(appended) == "first", appended  # the annotated and tuple ones were missed
    assert _joined_values(_OwnValuesLast) == "last" and _joined_values(_ContextBeforeOwn) == "last"
    assert _joined_values(transformers.models.llama.modeling_llama.LlamaAttention) is None
    assert _joined_values(_LambdaForward) is None
    # a partial rotary embedding joins the halves of the keys' features (dim=-1), not positions
    assert _joined_values(transformers.models.phi.modeling_phi.PhiAttention) is None
    if hasattr(transformers, "DeepseekV4Model"):
        with torch.device("meta"):
            model = transformers.DeepseekV4Model(transformers.DeepseekV4Config(num_hidden_layers=2))
        with pytest.raises(
            ValueError, match=r"DeepseekV4Attention\.forward joins other entries after its own"
        ):
            apply_neutreno(model)
        assert not is_patched(model)
    module = torch.nn.Module()
    module.neutreno = _LayerSetting(0.6, first=False)
    query, value = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)

    def plain(module, query, key, value, mask, **kwargs):
        return torch.zeros(1, 4, 2, 8), None

    state = _CallState()
    state.values[0] = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="6 values for 4 queries without a KV cache"):
        neutreno_attention(module, query, value, value, None, inner=plain, **{_CALL_STATE: state})
    expected = 0.6 * (state.values[0] - value[:, :, 2:]).transpose(1, 2)
    # an attention whose source joins other states before its own (DFlash's drafter) was stopped too,
    # though its own values are the last 4, as after a cache
    drafter = _ContextBeforeOwn()
    drafter.neutreno = module.neutreno
    out, _ = neutreno_attention(drafter, query, value, value, None, inner=plain, **{_CALL_STATE: state})
    torch.testing.assert_close(out, expected)
    state.cached = True  # with a cache, earlier positions come first: this call's values are the last 4
    out, _ = neutreno_attention(module, query, value, value, None, inner=plain, **{_CALL_STATE: state})
    torch.testing.assert_close(out, expected)


def test_reentrant_checkpointing_is_refused_and_the_default_keeps_the_v0_gradient():
    model = tiny_bert()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="reentrant gradient checkpointing"):
        apply_neutreno(model)
    model = apply_neutreno(tiny_bert(), lam=0.6)
    with pytest.raises(ValueError, match="reentrant gradient checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5's name
        with pytest.raises(ValueError, match="reentrant gradient checkpointing"):
            model.activation_checkpointing_enable({"use_reentrant": True})
    # transformers' signature, which PEFT reads to pass gradient_checkpointing_kwargs (found in review:
    # "(*args, **kwargs)", and PEFT dropped the user's options, warning of an old transformers)
    import inspect

    plain = tiny_bert()
    for method in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        if hasattr(plain, method):
            assert inspect.signature(getattr(model, method)) == inspect.signature(getattr(plain, method))
    assert (
        "gradient_checkpointing_kwargs" in inspect.signature(model.gradient_checkpointing_enable).parameters
    )

    def layer0_value_grad(checkpointing: bool):
        model = apply_neutreno(tiny_bert(), lam=0.6).train()
        if checkpointing:
            model.gradient_checkpointing_enable()  # non-reentrant: exact
        model(input_ids=ids()).last_hidden_state.square().sum().backward()
        return model.encoder.layer[0].attention.self.value.weight.grad

    torch.testing.assert_close(layer0_value_grad(True), layer0_value_grad(False), atol=1e-6, rtol=1e-5)


def test_switching_the_attention_implementation_after_apply_is_refused_at_the_next_forward():
    """set_attn_implementation (or the config's field) after apply_neutreno swapped NeuTRENO out for
    the model's own attention while is_patched and neutreno_lambda still said λ 0.6: the next forward
    refuses, naming set_inner_attention, which keeps NeuTRENO over the kernel asked for."""
    from neutreno.hf import set_inner_attention

    x = ids()
    for build in (tiny_bert, tiny_llama):
        model = apply_neutreno(build(), lam=0.6)
        patched = model(input_ids=x)[0]
        model.set_attn_implementation("eager")
        with pytest.raises(RuntimeError, match=r"NeuTRENO is off.*set_inner_attention"):
            model(input_ids=x)
        set_inner_attention(model, "eager")
        torch.testing.assert_close(model(input_ids=x)[0], patched, atol=2e-6, rtol=1e-5)
        model.config._attn_implementation = "sdpa"
        with pytest.raises(RuntimeError, match="NeuTRENO is off"):
            model(input_ids=x)
    # a kernel NeuTRENO cannot run over: the advice was set_inner_attention(model, 'flex_attention'),
    # which refuses it
    model.set_attn_implementation("flex_attention")
    with pytest.raises(RuntimeError, match=r"set_inner_attention\(model, 'sdpa' or 'eager'\) to run"):
        model(input_ids=x)
    set_inner_attention(model, "sdpa")
    torch.testing.assert_close(model(input_ids=x)[0], patched, atol=2e-6, rtol=1e-5)


def test_reentrant_checkpointing_enabled_on_a_submodule_after_apply_is_refused_in_training():
    """The top-level model's checkpointing methods refuse the reentrant kind; a submodule's own (the
    LlamaModel inside LlamaForCausalLM) bypassed them, and V⁰'s gradient was silently lost."""
    model = apply_neutreno(tiny_llama(), lam=0.6).train()
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="reentrant gradient checkpointing"):
        model(input_ids=ids()).logits.sum().backward()
    with torch.no_grad():  # no gradient, nothing lost: inference runs
        model(input_ids=ids())


def test_save_pretrained_keeps_neutreno_and_leaves_the_config_it_was_built_from(tmp_path):
    from neutreno.hf import from_pretrained

    model, x = tiny_bert(), ids()
    config = model.config
    apply_neutreno(model, lam=0.6)
    patched = run(model, x)
    assert config._attn_implementation == "sdpa"  # the caller's config object is untouched
    second = transformers.BertModel(config, add_pooling_layer=False).eval()  # once refused
    second.load_state_dict(model.state_dict())
    torch.testing.assert_close(run(second, x), bert_forward(model, x, torch.ones_like(x), 0.0)[-1],
                               atol=2e-5, rtol=1e-4)  # fmt: skip
    model.save_pretrained(tmp_path / "saved")
    reloaded = from_pretrained(transformers.BertModel, str(tmp_path / "saved"), add_pooling_layer=False)
    assert is_patched(reloaded.eval()) and neutreno_lambda(reloaded) == 0.6
    torch.testing.assert_close(run(reloaded, x), patched, atol=0, rtol=0)
    # A model built from the patched model's own config (it names NeuTRENO's kernel and records λ) was
    # never patched: it ran plain attention silently, and saved and loaded with from_pretrained it would
    # have run NeuTRENO. It refuses to run now; so does a kernel name set by hand on an unpatched model.
    by_hand = tiny_bert()
    by_hand.set_attn_implementation("neutreno_sdpa")
    for unpatched in (
        transformers.BertModel(model.config, add_pooling_layer=False).eval(),
        transformers.AutoModel.from_config(model.config).eval(),
        by_hand,
    ):
        assert not is_patched(unpatched)
        with pytest.raises(
            RuntimeError, match=r"runs under NeuTRENO's kernel .* but its model was never patched"
        ):
            run(unpatched, x)
    assert torch.equal(run(model, x), patched)  # the patched model itself, and its copies, run
    assert torch.equal(run(copy.deepcopy(model), x), patched)
    remove_neutreno(model)
    assert not hasattr(model.config, "neutreno_lambda")


def test_a_patched_model_whose_config_asks_for_attention_maps_saves(tmp_path):
    """An eager model loaded with output_attentions=True ran patched and returned its maps, but
    save_pretrained refused: transformers' check accepts only 'eager' there, not 'neutreno_eager'."""
    from neutreno.hf import from_pretrained

    model, x = tiny_bert("eager"), ids()
    model.config.output_attentions = True
    apply_neutreno(model, lam=0.6)
    out = model(input_ids=x)
    assert len(out.attentions) == 3
    model.save_pretrained(tmp_path / "saved")
    assert model.config._attn_implementation == "neutreno_eager"  # still patched after the save
    assert torch.equal(model(input_ids=x)[0], out[0])
    reloaded = from_pretrained(
        transformers.BertModel, str(tmp_path / "saved"), add_pooling_layer=False, attn_implementation="eager"
    )
    assert is_patched(reloaded.eval()) and neutreno_lambda(reloaded) == 0.6
    assert reloaded.config.output_attentions and reloaded.config._attn_implementation == "neutreno_eager"
    again = reloaded(input_ids=x)
    assert torch.equal(again[0], out[0]) and len(again.attentions) == 3
    remove_neutreno(model)
    assert "save_pretrained" not in vars(model)
    # a Hugging Face model inside the patched one (a classifier's encoder) saves too
    classifier = transformers.BertForSequenceClassification(tiny_bert("eager").config).eval()
    classifier.config.output_attentions = True
    apply_neutreno(classifier, lam=0.6)
    classifier.bert.save_pretrained(tmp_path / "encoder")
    assert classifier.bert.config._attn_implementation == "neutreno_eager"
    remove_neutreno(classifier)
    assert not any("save_pretrained" in vars(m) for m in classifier.modules())


def test_a_lambda_schedule_scales_a_patched_model():
    """set_lam_scale (what train.lam_warmup_steps calls) scales the λ of every patched layer: factor
    0.5 on λ 0.6 gives the outputs of λ 0.3; lam_by_layer reports it; removing the patch removes it."""
    from neutreno.layers import lam_by_layer, set_lam_scale

    ids = torch.randint(0, VOCAB, (2, 9))
    half = apply_neutreno(tiny_bert(), 0.3)
    expected = half(ids).last_hidden_state
    model = apply_neutreno(tiny_bert(), 0.6)
    set_lam_scale(model, 0.5)
    torch.testing.assert_close(model(ids).last_hidden_state, expected)
    assert lam_by_layer(model) == pytest.approx([0.3, 0.3, 0.3])
    set_lam_scale(model, 0.0)
    torch.testing.assert_close(model(ids).last_hidden_state, tiny_bert()(ids).last_hidden_state)
    remove_neutreno(model)
    assert lam_by_layer(model) == [] and not any(hasattr(m, "lam_scale") for m in model.modules())


TINY = {"bert": tiny_bert, "gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.mark.parametrize("name", TINY)
def test_the_output_projection_keeps_no_sum_beyond_what_softmax_attention_keeps(name):
    # W_O's input u + λ(V⁰ − V) was kept for its backward, one more tensor per layer than softmax
    # (the fused kernel's output u is what W_O keeps there); now W_O keeps u, V, V⁰, kept anyway
    model, x = TINY[name]().train(), ids(4, 16)
    plain = saved_bytes(lambda: model(input_ids=x))
    activations = saved_bytes(lambda: model(input_ids=x), model)  # without the weights
    apply_neutreno(model, lam=0.6)
    assert saved_bytes(lambda: model(input_ids=x)) == plain
    # a learned λ: its values (a few floats a layer), not λ(V⁰ − V)'s difference V⁰ − V, one (B, N, D) a
    # layer (8 kB here), which it kept for λ's gradient until the term became λV⁰ − λV
    one_sum = x.numel() * model.config.hidden_size * 4
    for learn_lam in ("layer", "head"):
        apply_neutreno(model, lam=0.6, learn_lam=learn_lam)
        assert saved_bytes(lambda: model(input_ids=x), model) < activations + one_sum // 4, learn_lam
    apply_neutreno(model, lam=0.6)
    if name == "bert":  # attention dropout: the math path returns a fresh u, which W_O alone keeps
        config = transformers.BertConfig(**{**model.config.to_dict(), "attention_probs_dropout_prob": 0.1})
        dropout = transformers.BertModel(config, add_pooling_layer=False).train()
        plain = saved_bytes(lambda: dropout(input_ids=x))
        apply_neutreno(dropout, lam=0.6)
        assert saved_bytes(lambda: dropout(input_ids=x)) == plain
    remove_neutreno(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not any(type(m).__name__.startswith("SumRebuilding") for m in model.modules())


@pytest.mark.parametrize("name", TINY)
def test_under_autocast_the_output_projection_keeps_no_sum_and_outputs_are_unchanged(name, monkeypatch):
    # Values could reach the attention function in float32 under autocast (a cache's concatenation
    # promotes a Llama's bf16 values), so the kernel kept its own cast copy and W_O the sum (+2.4% saved
    # bytes); the function now casts them as autocast would, and the kernel keeps that copy
    import neutreno.integrations.hf as hf

    model, x = TINY[name]().train(), ids(4, 16)

    def forward(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    plain = saved_bytes(lambda: forward(model), model)
    apply_neutreno(model, lam=0.6)
    # less: W_O keeps its float32 weight, not the bf16 copy a plain linear keeps, where the sum is rebuilt
    # (every layer after the first)
    w_o = [
        m
        for m in model.modules()
        if type(m).__name__ in ("BertSelfOutput", "GPT2Attention", "LlamaAttention")
    ]
    w_o = [getattr(m, "dense", None) or getattr(m, "c_proj", None) or m.o_proj for m in w_o]
    copies = sum(2 * linear.weight.numel() for linear in w_o[1:])
    assert saved_bytes(lambda: forward(model), model) == plain - copies
    cast = forward(model)
    monkeypatch.setattr(hf, "_cast_as_autocast_would", lambda value: value)
    torch.testing.assert_close(forward(model), cast, atol=0, rtol=0)  # the cast autocast made before


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("learn_lam", [None, "head"])
def test_gradients_with_the_rebuilt_sum_equal_those_with_the_sum_kept(name, learn_lam, monkeypatch):
    import neutreno.integrations.hf as hf

    x, rebuilds = ids(2, 9), []
    linear = hf.linear_of_rebuilt_input

    def gradients(keep_sum: bool, dtype=None):
        model = apply_neutreno(TINY[name]().train(), lam=0.6, learn_lam=learn_lam)
        rebuilds.clear()
        monkeypatch.setattr(hf, "linear_of_rebuilt_input", lambda *a: rebuilds.append(1) or linear(*a))
        if keep_sum:  # as before: W_O keeps its input
            monkeypatch.setattr(hf, "_kept_by_fused_kernel", lambda *tensors: False)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            out = model(input_ids=x)
        main = (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()
        # a fixed random readout: BERT's mean square after its LayerNorm would have almost no gradient
        (main * torch.randn(main.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        monkeypatch.undo()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    for dtype, tolerance in ((None, 1e-5), (torch.bfloat16, 2e-2)):
        rebuilt = gradients(False, dtype)
        assert rebuilds  # the rebuilt path ran
        kept = gradients(True, dtype)
        assert not rebuilds
        assert rebuilt.keys() == kept.keys() and any("neutreno_lam" in n for n in rebuilt) == bool(learn_lam)
        for n in kept:
            torch.testing.assert_close(rebuilt[n], kept[n], atol=tolerance, rtol=tolerance, msg=n)


W_O_WEIGHT = {
    "bert": "attention.output.dense.weight", "gpt2": "attn.c_proj.weight", "llama": "self_attn.o_proj.weight"
}  # fmt: skip


@pytest.mark.parametrize("name", TINY)
def test_a_gradient_penalty_through_a_rebuilt_sum_w_o_has_its_second_derivative(name, monkeypatch):
    """create_graph=True through W_O's rebuilt-sum backward: it was once-differentiable, so a penalty
    on W_O's weight gradient silently lost its term in every other gradient. Reference: W_O keeping
    its input (a plain module call)."""
    import neutreno.integrations.hf as hf

    x = ids(2, 9)

    def penalized_gradients(keep_sum: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = apply_neutreno(TINY[name]().double().train(), lam=0.6)
        if keep_sum:
            monkeypatch.setattr(hf, "_kept_by_fused_kernel", lambda *tensors: False)
        out = model(input_ids=x)
        main = out.logits if hasattr(out, "logits") else out.last_hidden_state
        readout = torch.randn(main.shape, generator=torch.Generator().manual_seed(2), dtype=main.dtype)
        loss = (main * readout).sum()
        # the last layer's W_O: an earlier one's gradient passes through later fused attention, which
        # has no second derivative (torch raises there, loudly)
        w_o = [p for n, p in model.named_parameters() if n.endswith(W_O_WEIGHT[name])][-1]
        (g_w,) = torch.autograd.grad(loss, w_o, create_graph=True)
        penalty = g_w.square().sum()
        (loss + penalty).backward()
        monkeypatch.undo()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    rebuilt, kept = penalized_gradients(False), penalized_gradients(True)
    assert rebuilt.keys() == kept.keys()
    for n in kept:
        torch.testing.assert_close(rebuilt[n], kept[n], msg=n)


@pytest.mark.parametrize("tiny", [tiny_llama, tiny_gpt2], ids=["linear", "conv1d"])
def test_a_patched_model_pickles_and_deep_copies_with_its_projection_layers(tmp_path, tiny):
    # the forwards once set on W_O's instances were bound methods, which pickle could write but not read;
    # the classes they are now are found by name, in a fresh process too (made on first use)
    import subprocess
    import sys

    model, x = apply_neutreno(tiny(), lam=0.6), ids()
    torch.save(model, tmp_path / "model.pt")
    for other in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)):
        kinds = {type(m).__name__ for m in other.modules() if type(m).__name__.startswith("SumRebuilding")}
        assert kinds == {"SumRebuildingLinear" if tiny is tiny_llama else "SumRebuildingConv1D"}
        torch.testing.assert_close(run(other, x), run(model, x), atol=0, rtol=0)
    # and it runs there: unpickling registers its attention function (it once named one unknown there)
    torch.save(x, tmp_path / "x.pt")
    expected = run(model, x)
    torch.save(expected, tmp_path / "expected.pt")
    load = (
        "import torch; m = torch.load({!r}, weights_only=False); x = torch.load({!r});"
        "out = m(input_ids=x); out = out.logits if hasattr(out, 'logits') else out.last_hidden_state;"
        "torch.testing.assert_close(out, torch.load({!r}), atol=0, rtol=0)"
    ).format(*(str(tmp_path / name) for name in ("model.pt", "x.pt", "expected.pt")))
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_part_copied_or_saved_out_of_a_patched_model_runs_and_can_be_undone(tmp_path):
    """From a review: copy.deepcopy(clf.bert) of a patched classifier said it was patched and ran
    NeuTRENO, but remove_neutreno, apply_neutreno and set_inner_attention all refused it ("patched
    through a model holding it", which no model did); saved alone and loaded in another process, its
    forward failed with "NeuTRENO is off … set by set_attn_implementation?"."""
    import subprocess
    import sys

    from neutreno.hf import set_inner_attention

    config = tiny_bert().config
    torch.manual_seed(0)
    clf = apply_neutreno(transformers.BertForSequenceClassification(config).eval(), lam=0.6)
    x = ids()
    expected = run(clf.bert, x)
    backbone = copy.deepcopy(clf.bert)
    whole = copy.deepcopy(clf)  # a copy of the whole model still holds its part's patch
    with pytest.raises(ValueError, match="patched through a model holding it"):
        remove_neutreno(clf.bert)
    with pytest.raises(ValueError, match="patched through a model holding it"):
        remove_neutreno(whole.bert)
    assert is_patched(backbone) and neutreno_lambda(backbone) == 0.6
    torch.testing.assert_close(run(backbone, x), expected, atol=0, rtol=0)
    set_inner_attention(backbone, "eager")
    torch.testing.assert_close(run(backbone, x), expected, atol=1e-5, rtol=1e-5)
    apply_neutreno(backbone, 0.3)
    assert neutreno_lambda(backbone) == 0.3 and neutreno_lambda(clf) == 0.6
    remove_neutreno(backbone)
    remove_neutreno(clf)
    assert not is_patched(backbone) and not is_patched(clf)
    torch.testing.assert_close(run(backbone, x), run(clf.bert, x), atol=1e-5, rtol=1e-5)
    clf = apply_neutreno(transformers.BertForSequenceClassification(config).eval(), lam=0.6)
    torch.save(clf.bert, tmp_path / "bert.pt")
    torch.save(x, tmp_path / "x.pt")
    torch.save(run(clf.bert, x), tmp_path / "expected.pt")
    load = (
        "import torch; m = torch.load({!r}, weights_only=False); x = torch.load({!r});"
        "torch.testing.assert_close(m(input_ids=x).last_hidden_state, torch.load({!r}), atol=0, rtol=0)"
    ).format(*(str(tmp_path / name) for name in ("bert.pt", "x.pt", "expected.pt")))
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_model_saved_patched_at_lambda_zero_comes_back_patched(tmp_path):
    """restore_neutreno took a recorded λ of 0.0 for none: reloaded, the model said it was unpatched."""
    from neutreno.hf import from_pretrained

    model = apply_neutreno(tiny_bert(), lam=0.0)
    model.save_pretrained(tmp_path / "m")
    loaded = from_pretrained(transformers.AutoModel, tmp_path / "m")
    assert is_patched(loaded) and neutreno_lambda(loaded) == 0.0
    torch.testing.assert_close(run(loaded, ids()), run(tiny_bert(), ids()), atol=0, rtol=0)
    remove_neutreno(loaded)


def test_the_kernel_switched_away_error_quotes_the_name_to_pass():
    model = apply_neutreno(tiny_bert(), lam=0.6)
    model.set_attn_implementation("eager")
    with pytest.raises(RuntimeError, match=r"set_inner_attention\(model, 'eager'\)"):
        run(model, ids())


def test_a_forward_kept_from_before_remove_neutreno_runs_the_plain_layer():
    """A tool that wraps a layer's forward on the instance (accelerate's hooks keep ``module.forward``
    and call it) and outlives remove_neutreno: the kept forward runs the now plain layer."""
    plain, x = run(tiny_llama(), ids()), ids()
    model = apply_neutreno(tiny_llama(), lam=0.6)
    for layer in model.model.layers:
        kept = layer.self_attn.o_proj.forward
        layer.self_attn.o_proj.forward = lambda h, kept=kept: kept(h)
    remove_neutreno(model)
    torch.testing.assert_close(run(model, x), plain, atol=0, rtol=0)


def test_a_patched_models_layers_keep_no_forward_of_their_own():
    """torch.compile guards every call on a forward set on an instance (~15 guards per linear layer; with
    them a compiled tiny-GPT-2 decoding call cost ~40 µs more host time, bench/host_bound.py): the linear
    layers beside each attention become a subclass instead, which computes what the plain layer does."""
    from transformers.pytorch_utils import Conv1D

    from neutreno.integrations.hf import SumRebuildingConv1D

    model = apply_neutreno(tiny_gpt2(), lam=0.6)
    assert not any("forward" in m.__dict__ for m in model.modules())
    block = model.transformer.h[0]
    assert type(block.attn.c_proj) is SumRebuildingConv1D and type(block.mlp.c_fc) is SumRebuildingConv1D
    assert isinstance(block.attn.c_proj, Conv1D)  # for code that checks the kind of layer
    x = torch.randn(2, 5, block.mlp.c_fc.nx)
    out = block.mlp.c_fc(x)
    torch.testing.assert_close(out, x @ block.mlp.c_fc.weight + block.mlp.c_fc.bias)
    torch.testing.assert_close(out, Conv1D.forward(block.mlp.c_fc, x), atol=0, rtol=0)


def test_gradient_checkpointing_frees_what_the_rebuilt_sum_is_made_of(monkeypatch):
    # W_O's backward once held u, V, V⁰ directly (not as saved tensors), which checkpointing could not free
    import gc
    import weakref

    import neutreno.integrations.hf as hf

    made_of, rebuilt = [], []
    sum_of, linear = hf._neutreno_sum, hf.linear_of_rebuilt_input

    def recording_sum(out, *args, **kwargs):
        made_of.append(weakref.ref(out))
        return sum_of(out, *args, **kwargs)

    monkeypatch.setattr(hf, "_neutreno_sum", recording_sum)
    monkeypatch.setattr(hf, "linear_of_rebuilt_input", lambda *a: rebuilt.append(1) or linear(*a))
    model = apply_neutreno(tiny_bert().train(), lam=0.6)
    model.gradient_checkpointing_enable()
    loss = model(input_ids=ids(2, 9)).last_hidden_state.square().sum()
    gc.collect()
    assert rebuilt and made_of and all(ref() is None for ref in made_of)
    loss.backward()
    assert model.encoder.layer[0].attention.self.value.weight.grad.abs().sum() > 0


def test_a_sum_changed_in_place_before_w_o_is_kept_not_rebuilt(monkeypatch):
    # rebuilt from u, V, V⁰ it would be the sum before the change: W_O's weight gradient silently wrong
    import neutreno.integrations.hf as hf

    def w_o_gradient(keep_sum: bool):
        model = apply_neutreno(tiny_bert().train(), lam=0.6)
        if keep_sum:
            monkeypatch.setattr(hf, "_kept_by_fused_kernel", lambda *tensors: False)
        dense = model.encoder.layer[1].attention.output.dense

        def triple_in_place(module, args):
            args[0].mul_(3.0)

        dense.register_forward_pre_hook(triple_in_place)
        hidden = model(input_ids=ids(2, 9)).last_hidden_state
        (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        monkeypatch.undo()
        return dense.weight.grad

    torch.testing.assert_close(w_o_gradient(False), w_o_gradient(True), atol=1e-5, rtol=1e-5)


def test_a_w_o_parametrized_after_patching_runs_as_itself(monkeypatch):
    # weight norm turns the layer into a ParametrizedLinear: no plain linear, whose gradients the
    # memory-saving W_O computes; NeuTRENO training failed there with a TypeError
    import neutreno.integrations.hf as hf

    def gradients(keep_sum: bool):
        model = apply_neutreno(tiny_bert().train(), lam=0.6)
        if keep_sum:  # the reference: the sum kept, W_O autograd's own
            monkeypatch.setattr(hf, "_kept_by_fused_kernel", lambda *tensors: False)
        dense = model.encoder.layer[1].attention.output.dense
        torch.nn.utils.parametrizations.weight_norm(dense)
        hidden = model(input_ids=ids(2, 9)).last_hidden_state
        (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        monkeypatch.undo()
        return [p.grad for p in dense.parameters()]

    for ours, kept in zip(gradients(False), gradients(True), strict=True):
        torch.testing.assert_close(ours, kept, atol=1e-5, rtol=1e-5)


# Decoders beyond Llama's and GPT-2's layout: fused QKV (GPT-NeoX, Phi-3), partial rotary (Phi), multi-head
# latent attention whose values are narrower than its queries and keys (DeepSeek-V2), a norm after the
# attention (BitNet), QK norms (OLMo-2), a learned-position OPT, Qwen2's biases, Mistral's sliding window.
ARCHITECTURES = ["gpt_neox", "phi", "phi3", "deepseek_v2", "bitnet", "olmo2", "opt", "qwen2", "mistral"]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_decoder_architectures_equal_neutreno_written_at_their_attention_interface(model_type):
    from reference import neutreno_through_eager_attention

    # multi-head latent attention has a key and a value per query head (its own eager kernel would repeat
    # them by num_attention_heads // num_key_value_heads)
    kv_heads = 4 if model_type == "deepseek_v2" else 2
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, ffn_dim=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
        max_position_embeddings=64, word_embed_proj_dim=32, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
        sliding_window=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    x = ids(2, 9)
    plain = run(model, x)
    reference = neutreno_through_eager_attention(model, 0.6, input_ids=x).logits
    torch.testing.assert_close(neutreno_through_eager_attention(model, 0.0, input_ids=x).logits, plain)
    apply_neutreno(model, lam=0.6)
    patched = run(model, x)
    torch.testing.assert_close(patched, reference, atol=2e-5, rtol=1e-4)
    assert (patched - plain).abs().max() > 1e-3  # the term is not vacuous


def test_a_wrapper_that_is_not_a_hugging_face_model_is_refused_before_any_change():
    """A custom head holding a BERT and exposing its config (or a SentenceTransformer): apply_neutreno
    set every layer's setting and hook, then failed on set_attn_implementation, leaving a model that said
    it was patched, whose forward raised and which neither remove_neutreno nor a patch of the backbone
    could mend. It is refused now with nothing changed; the backbone itself patches."""

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = tiny_bert()
            self.config = self.backbone.config
            self.head = torch.nn.Linear(self.config.hidden_size, 2)

        def forward(self, input_ids):
            return self.head(self.backbone(input_ids=input_ids).last_hidden_state[:, 0])

    model = Classifier().eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        before = model(ids)
    with pytest.raises(ValueError, match=r"not a Hugging Face transformers model.*inside it"):
        apply_neutreno(model, 0.6)
    assert not is_patched(model) and not is_patched(model.backbone)
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    apply_neutreno(model.backbone, 0.6)
    assert is_patched(model.backbone)
    with torch.no_grad():
        assert not torch.allclose(model(ids), before)


def test_a_model_declining_the_kernel_switch_is_refused_and_left_unpatched(monkeypatch):
    """transformers declines ``set_attn_implementation`` for some types and only logs it (Falcon). The
    refusal must leave nothing behind: no hooks, no layer settings, the model's own outputs."""
    import transformers

    model = tiny_bert().eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
    monkeypatch.setattr(transformers.PreTrainedModel, "set_attn_implementation", lambda self, name: None)
    with pytest.raises(ValueError, match="does not let transformers set its attention implementation"):
        apply_neutreno(model, 0.6)
    assert not is_patched(model) and not any(hasattr(m, "neutreno") for m in model.modules())
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, before)
    apply_neutreno(model, 0.6)  # the model is whole: it patches
    assert is_patched(model)


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_dispatched_by_accelerate_layer_by_layer_equals_the_hand_written_forward(name, tmp_path):
    """accelerate's device hooks (device_map, offloading) copy each dict among a layer's arguments: the
    first layer's V⁰ never reached the others, and every forward raised "no V⁰"."""
    accelerate = pytest.importorskip("accelerate")
    build, reference = CASES[name]
    model, x = build(), ids()
    apply_neutreno(model, lam=0.6)
    want = reference(model, x, 0.6)
    stack = next(name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    layers = [f"{stack}.{i}" for i in range(len(model.get_submodule(stack)))]
    # each layer its own hooked module, the middle one offloaded to disk (loaded at its forward)
    device_map = {layer: "disk" if i == 1 else "cpu" for i, layer in enumerate(layers)}
    for child, _ in model.named_modules():
        inside = any(child == k or child.startswith(k + ".") or k.startswith(child + ".") for k in device_map)
        if child and not inside and not any(child.startswith(k + ".") for k in device_map):
            device_map[child] = "cpu"
    dispatched = accelerate.dispatch_model(model, device_map=device_map, offload_dir=tmp_path)
    assert sum(hasattr(dispatched.get_submodule(layer), "_hf_hook") for layer in layers) == len(layers)
    torch.testing.assert_close(run(dispatched, x), want, atol=2e-5, rtol=1e-4)
    if name != "bert":  # generation through the cache, with its hooks
        settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        cached = dispatched.generate(x[:, :5], use_cache=True, **settings)
        assert torch.equal(cached, dispatched.generate(x[:, :5], use_cache=False, **settings))


def test_a_learned_lambda_beside_offloaded_or_empty_weights_is_refused(tmp_path):
    """A learned λ created beside attention weights on the meta device (accelerate's offloading, or a
    model built under init_empty_weights) had no value: the forward raised a device error, or, after
    to_empty and a load of the weights, the model ran with λ from uninitialised memory while it said
    it was patched at λ. It is refused in one line, before anything is changed; a fixed λ still works."""
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        empty = transformers.LlamaForCausalLM(tiny_llama().config)
    with pytest.raises(
        ValueError, match=r"a learned λ needs the attention weights in memory, and 3 attention"
    ):
        apply_neutreno(empty, 0.3, learn_lam="head")
    assert not is_patched(empty)
    model = tiny_llama()
    layers = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    device_map = {
        "model.embed_tokens": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    device_map |= {layer: "disk" if i == 1 else "cpu" for i, layer in enumerate(layers)}
    dispatched = accelerate.dispatch_model(model, device_map=device_map, offload_dir=tmp_path)
    with pytest.raises(ValueError, match=r"and 1 attention layers have theirs on the meta device"):
        apply_neutreno(dispatched, 0.3, learn_lam="layer")
    apply_neutreno(dispatched, 0.3)  # a fixed λ has nothing to hold
    assert is_patched(dispatched) and neutreno_lambda(dispatched) == 0.3


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames, called by PEFT too
def test_a_peft_model_is_patched_on_its_model_and_stays_patched_through_merge_and_unload():
    """apply_neutreno on a PeftModel recorded the patch on the wrapper: its gradient_checkpointing_enable
    (its model's, through __getattr__) raised AttributeError, and merge_and_unload returned a model
    patched through a holder gone, which remove_neutreno refused."""
    peft = pytest.importorskip("peft")
    x = ids()
    lora = peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=4, init_lora_weights=False)  # B ≠ 0
    model = peft.get_peft_model(tiny_llama(), lora)
    apply_neutreno(model, lam=0.6)
    assert is_patched(model) and neutreno_lambda(model) == 0.6
    logits = run(model, x)
    model.train()
    plain_loss = model(input_ids=x, labels=x).loss
    model.gradient_checkpointing_enable()  # non-reentrant, transformers' default
    checkpointed = model(input_ids=x, labels=x).loss
    checkpointed.backward()
    torch.testing.assert_close(checkpointed, plain_loss)
    lora_grads = [p.grad for name, p in model.named_parameters() if "lora_B" in name]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    with pytest.raises(ValueError, match="reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    merged = model.merge_and_unload().eval()
    assert is_patched(merged)
    torch.testing.assert_close(run(merged, x), logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(run(merged, x), llama_logits(merged, x, 0.6), atol=2e-5, rtol=1e-4)
    remove_neutreno(merged)
    assert not is_patched(merged)
    torch.testing.assert_close(run(merged, x), llama_logits(merged, x, 0.0), atol=2e-5, rtol=1e-4)

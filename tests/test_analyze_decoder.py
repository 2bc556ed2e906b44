"""`neutreno analyze` on Hugging Face decoders (GPT-2, Llama-style): per-layer measurements over real
tokens under causal attention, and the next-token log-likelihood cost of NeuTRENO, checked against
explicit computations on tiny random models loaded from local folders (`from_pretrained`)."""

import json
import math

import pytest
import torch

from neutreno.cli.main import main
from neutreno.diagnostics import LayerwiseMetrics
from neutreno.diagnostics.analysis import (
    build_variants,
    log_likelihood_change,
    per_sample_layers,
    probe_for,
    run_analysis,
    text_batches,
)
from neutreno.diagnostics.collect import hf_value_output_weights
from neutreno.models.checkpoint import read_metadata

from reference import kv_cache

transformers = pytest.importorskip("transformers")

# Short sentences of different lengths, so that batches are padded.
SENTENCES = [
    "the lobster is a species of clawed lobster from the eastern atlantic ocean",
    "it may grow to a length of sixty cm",
    "in life the lobsters are blue only becoming red on cooking",
    "mating occurs in the summer producing eggs which are carried by the females",
    "the species is closely related to the american lobster",
    "lobsters are caught using lobster pots",
]
EOS = "<|endoftext|>"


def word_tokenizer(sentences):
    """A word-level tokenizer with no pad token (as GPT-2's): analyze must pad with its eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for s in sentences for w in s.split()})
    vocab = {EOS: 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # token_type_ids too, all 0, as the README's recipe's BERT tokenizer gives: GPT-2 embeds them (as
    # word 0's embedding, added at every position) where analyze once passed them on
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, unk_token="[UNK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )  # fmt: skip


def tiny_decoder(kind, vocab):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=128, n_embd=32, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(  # grouped-query attention: 4 query heads share 2 value heads
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "sentences.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def folder(request, tmp_path_factory):
    """A tiny random decoder and its tokenizer, saved where `hf:<folder>` loads them from."""
    path = tmp_path_factory.mktemp(request.param)
    tokenizer = word_tokenizer(SENTENCES)
    tiny_decoder(request.param, len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def alone(model, tokenizer, sentence):
    """One sentence through the model, no padding: its ids, every block's output (a hook on each
    layer, not output_hidden_states: a decoder's last one there has the final norm applied), the
    attention maps and the logits."""
    ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    outputs = []

    def keep(module, args, out):
        outputs.append(out[0] if isinstance(out, tuple) else out)

    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    hidden = [out.hidden_states[0][0], *(h[0] for h in outputs)]
    return ids[0], hidden, [a[0] for a in out.attentions], out.logits[0]


def cosine_by_hand(x):
    """Mean of cos(x_i, x_j) over ordered pairs i ≠ j (math.md §3: the diagonal left out)."""
    n, total = len(x), 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                total += (x[i] @ x[j] / (x[i].norm() * x[j].norm())).item()
    return total / (n * (n - 1))


def values_by_hand(model, layer_index, hidden_in):
    """Per query head, the values (H, N, d) block ``layer_index`` computes from its input (N, D)."""
    heads = model.config.num_attention_heads
    if hasattr(model, "transformer"):  # GPT-2: Conv1D c_attn = x @ W + b, W = [W_Q W_K W_V]
        block = model.transformer.h[layer_index]
        width = hidden_in.shape[-1]
        v = block.attn.c_attn(block.ln_1(hidden_in))[:, 2 * width :]
        return v.view(len(v), heads, -1).transpose(0, 1)
    block = model.model.layers[layer_index]
    v = block.self_attn.v_proj(block.input_layernorm(hidden_in))
    kv_heads = model.config.num_key_value_heads
    v = v.view(len(v), kv_heads, -1).transpose(0, 1)
    return torch.stack([v[h * kv_heads // heads] for h in range(heads)])  # query head h reads h // groups


def energy_by_hand(attn, v):
    """J = (1/(2N)) Σ_{i,j} A_ij ‖v_i − v_j‖², mean over heads (math.md §3)."""
    heads, n = attn.shape[0], attn.shape[-1]
    total = 0.0
    for h in range(heads):
        for i in range(n):
            for j in range(n):
                total += (attn[h, i, j] * (v[h, i] - v[h, j]).square().sum()).item()
    return total / (2 * n) / heads


def test_decoder_layers_against_an_explicit_computation_and_padding_changes_nothing(folder, text):
    """Per-layer cosine and nonlocal energy of a decoder equal a hand computation on each sentence alone
    (no padding); the padded batches give every sentence its lone values; the attention is causal."""
    (variant,) = build_variants(f"hf:{folder}", [], [0.0], seed=0)
    assert variant.causal and type(variant.model).__name__.endswith(("LMHeadModel", "ForCausalLM"))
    batches = text_batches(variant, str(text), samples=6, batch_size=3)
    assert all(not b["attention_mask"].all() for b in batches)  # padded, on the right, with the eos
    assert all((b["input_ids"][b["attention_mask"] == 0] == 0).all() for b in batches)
    got = run_analysis(variant, batches, ["cosine", "energy"])
    per_sample = per_sample_layers(variant, batches, "cosine")

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    lone = [alone(variant.model, tokenizer, s) for s in SENTENCES]
    depth = len(lone[0][1]) - 1
    for layer in range(depth + 1):
        cosines = [cosine_by_hand(hidden[layer]) for _, hidden, _, _ in lone]
        assert per_sample[layer].tolist() == pytest.approx(cosines, abs=1e-5), layer
        assert got["cosine"][layer] == pytest.approx(sum(cosines) / len(cosines), abs=1e-5)
    for layer in range(1, depth + 1):
        energies = []
        for _, hidden, attn, _ in lone:
            a = attn[layer - 1]
            assert torch.equal(a, a.tril()), "causal attention is lower-triangular"
            energies.append(energy_by_hand(a, values_by_hand(variant.model, layer - 1, hidden[layer - 1])))
        assert got["energy"][layer] == pytest.approx(sum(energies) / len(energies), rel=1e-4, abs=1e-6)


def test_decoder_attention_metrics_ignore_padding_and_gradient_alignment_is_refused(folder, text):
    """Every attention metric of a sentence in a padded batch equals its value alone; the gradient
    alignment, whose symmetric kernel sees future tokens, is refused for a causal model."""
    (variant,) = build_variants(f"hf:{folder}", [], [0.3], seed=0)
    (batch,) = text_batches(variant, str(text), samples=6, batch_size=6)
    probe = probe_for(variant, attention=True)
    metrics = ["cosine", "effective_rank", "energy", "head_redundancy", "head_redundancy_best"]
    padded = probe(batch)
    assert padded.causal and padded.q is None
    for index in range(len(SENTENCES)):
        real = batch["attention_mask"][index].bool()
        single = {k: v[index : index + 1, real] for k, v in batch.items()}
        one, mine = LayerwiseMetrics(metrics), LayerwiseMetrics(metrics)
        one.update(probe(single))
        sliced = type(padded)(
            hidden=[h[index : index + 1] for h in padded.hidden], mask=padded.mask[index : index + 1],
            attn=[a[index : index + 1] for a in padded.attn], v=[v[index : index + 1] for v in padded.v],
            causal=True,
        )  # fmt: skip
        mine.update(sliced)
        for metric, by_layer in one.compute().items():
            assert mine.compute()[metric] == pytest.approx(by_layer, rel=1e-4, abs=1e-5), metric
    with pytest.raises(ValueError, match=r"gradient_alignment.*causal attention never sees"):
        LayerwiseMetrics(["gradient_alignment"]).update(padded)


def test_log_likelihood_change_against_an_explicit_computation(folder, text):
    """Mean log p(x_{t+1} | x_≤t) over every real predicted token, pooled over the text, by hand
    (log_softmax and a gather per position, each sentence alone), at λ = 0 and λ = 0.4."""
    from neutreno.hf import apply_neutreno

    variants = build_variants(f"hf:{folder}", [], [0.0, 0.4], seed=0)
    batches = text_batches(variants[0], str(text), samples=6, batch_size=4)
    cost = log_likelihood_change(variants, {("text", variants[0].model.config._name_or_path): batches})

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)

    def by_hand(lam):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        if lam:
            apply_neutreno(model, lam)
        total, count = 0.0, 0
        for sentence in SENTENCES:
            ids, _, _, logits = alone(model, tokenizer, sentence)
            for t in range(len(ids) - 1):
                total += torch.log_softmax(logits[t].double(), -1)[ids[t + 1]].item()
                count += 1
        return total / count, count

    (base, tokens), (neutreno, _) = by_hand(0.0), by_hand(0.4)
    plain, patched = (v.label for v in variants)
    assert cost["reference"] == plain and cost["tokens"] == tokens
    assert cost["nats_per_token"][plain] == pytest.approx(base, abs=1e-5)
    assert cost["nats_per_token"][patched] == pytest.approx(neutreno, abs=1e-5)
    assert cost["change"][patched] == pytest.approx(neutreno - base, abs=1e-5)
    assert cost["perplexity_ratio"][patched] == pytest.approx(math.exp(base - neutreno), rel=1e-5)
    assert cost["change"][plain] == 0 and abs(neutreno - base) > 1e-6  # NeuTRENO does move the predictions


def test_value_output_weights_of_fused_and_grouped_attention(folder):
    """W_V in nn.Linear's convention from GPT-2's fused Conv1D, and Llama's value heads repeated per
    group: W_V x equals each query head's values as the model computes them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    w_v, w_o = hf_value_output_weights(layers[1], model.config.num_attention_heads)
    assert w_v.shape == w_o.shape == (32, 32)
    if hasattr(model, "transformer"):
        bias = layers[1].attn.c_attn.bias[64:]
        expected = layers[1].attn.c_attn(x)[:, 64:] - bias
        torch.testing.assert_close(w_o, layers[1].attn.c_proj.weight.T)
    else:
        v = layers[1].self_attn.v_proj(x).view(5, 2, 8)
        expected = torch.cat([v[:, h // 2] for h in range(4)], dim=-1)
    torch.testing.assert_close(x @ w_v.T, expected, atol=1e-6, rtol=1e-5)
    # patched, GPT-2's Conv1D is apply_neutreno's subclass of it: the same weights (the spectrum once
    # refused a patched GPT-2, as if its projections were of another layout)
    from neutreno.hf import apply_neutreno

    patched = apply_neutreno(model, lam=0.4)
    layers = patched.transformer.h if hasattr(patched, "transformer") else patched.model.layers
    got = hf_value_output_weights(layers[1], model.config.num_attention_heads)
    torch.testing.assert_close(got, (w_v, w_o), atol=0, rtol=0)


def test_analyze_a_decoder_folder_end_to_end(folder, tmp_path, capsys, shared_data):
    """`neutreno analyze --model hf:<folder> --compare-lambda` on real WikiText: the default metrics
    less the gradient alignment, the per-layer similarity per λ, the log-likelihood cost printed, in
    report.json and plotted; the spectrum works on a decoder too."""
    out = tmp_path / "an"
    wiki = shared_data / "wikitext103-mini" / "wiki.valid.tokens"
    code = main(["analyze", "--model", f"hf:{folder}", "--data", str(wiki), "--compare-lambda", "0,0.4",
                 "--samples", "6", "--out", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "gradient_alignment left out" in printed and "next-token log-likelihood vs" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"] == ["cosine", "rank_residual", "high_frequency", "effective_rank", "energy"]
    labels = [f"{folder.name} λ=0", f"{folder.name} λ=0.4"]
    assert list(report["results"]) == labels and "sentence_ranking" not in report
    assert all(report["models"][label]["causal"] for label in labels)
    cost = report["log_likelihood"]
    assert list(cost["change"]) == labels and cost["lam"] == {labels[0]: 0.0, labels[1]: 0.4}
    assert (out / "log_likelihood.png").is_file() and (out / "cosine.png").is_file()
    # without λ = 0 there is no cost to report: it was left out without a word
    code = main(["analyze", "--model", f"hf:{folder}", "--data", str(wiki), "--compare-lambda", "0.2,0.4",
                 "--samples", "4", "--metrics", "cosine", "--out", str(tmp_path / "no_zero")])  # fmt: skip
    assert code == 0 and "note: no cost against λ = 0" in capsys.readouterr().out
    assert main(["analyze", "--model", f"hf:{folder}", "--data", str(wiki), "--samples", "4",
                 "--compare-lambda", "0,0.4", "--metrics", "spectrum",
                 "--out", str(tmp_path / "sp")]) == 0  # fmt: skip
    spectrum = json.loads((tmp_path / "sp" / "report.json").read_text())["spectrum"]
    assert len(spectrum[labels[0]]) == len(spectrum[labels[1]]) == 3  # the patched model's too


def test_decoder_refusals_are_one_line(folder, text, tmp_path, capsys):
    """Asking a decoder for the gradient alignment, an encoder-decoder, a decoder saved without its
    language-model head under --compare-lambda, a tokenizer beyond the model's vocabulary: each a
    one-line error, exit 2."""
    t5, t5_encoder = tmp_path / "t5", tmp_path / "t5_encoder"
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    transformers.T5Model(config).save_pretrained(t5)
    # its encoder alone saves is_encoder_decoder false: it loaded as a T5Model with a random decoder
    # (every weight listed MISSING), then "T5Model is not supported: none of encoder.layer, …"
    transformers.T5EncoderModel(config).save_pretrained(t5_encoder)
    # ALBERT's shared group: "AlbertModel is not supported: none of encoder.layer, … is a layer list"
    albert = tmp_path / "albert"
    transformers.AlbertModel(transformers.AlbertConfig(
        vocab_size=len(word_tokenizer(SENTENCES)), embedding_size=8, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32,
    )).save_pretrained(albert)  # fmt: skip
    word_tokenizer(SENTENCES).save_pretrained(albert)
    base, small = tmp_path / "llama_base", tmp_path / "small_vocab"
    for path, vocab in ((base, len(word_tokenizer(SENTENCES))), (small, 16)):
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
        transformers.LlamaModel(config).save_pretrained(path)
        word_tokenizer(SENTENCES).save_pretrained(path)
    cases = [
        (folder, ["--metrics", "cosine,gradient_alignment"], "not defined for a causal (decoder) model"),
        (t5, [], "t5 is an encoder-decoder model"),
        (t5_encoder, [], "t5 is an encoder-decoder model (here its encoder alone)"),
        (albert, ["--metrics", "cosine"], "ALBERT calls one shared layer group for every layer"),
        (base, ["--compare-lambda", "0,0.4", "--metrics", "cosine"], "no trained language-model head (rand"),
        # whether it was refused depended on the text's words (ids that fit ran): refused before reading
        (
            small,
            ["--metrics", "cosine"],
            f"has {len(word_tokenizer(SENTENCES))} tokens, the model's embedding 16 rows",
        ),
    ]
    # a decoder alone of such a family, saved without is_decoder (WhisperForCausalLM), is a decoder
    from neutreno.diagnostics.collect import hf_is_decoder

    whisper = tmp_path / "whisper_decoder"
    transformers.WhisperForCausalLM(transformers.WhisperConfig(
        vocab_size=32, d_model=16, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32,
        encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, max_target_positions=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )).save_pretrained(whisper)  # fmt: skip
    assert hf_is_decoder(transformers.AutoConfig.from_pretrained(whisper))
    for model, args, message in cases:
        code = main(["analyze", "--model", f"hf:{model}", "--data", str(text), "--samples", "2", *args,
                     "--out", str(tmp_path / "out")])  # fmt: skip
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and message in lines[-1], lines
        assert lines[-1].startswith("neutreno analyze: error:")
    assert not (tmp_path / "out" / "report.json").exists()
    # A model that reads no text: "hf models need a text file" for images, a five-line tokenizer error
    # for a text file (the README said ViT encoders were analysed)
    vit = tmp_path / "vit"
    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32
    )
    transformers.ViTModel(config).save_pretrained(vit)
    capsys.readouterr()  # its progress bar
    for data in (str(text), "random"):
        code = main(["analyze", "--model", f"hf:{vit}", "--data", data, "--out", str(tmp_path / "out")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert "is a vit model, which reads pixel_values, not text" in lines[0]


def test_head_redundancy_and_energy_leave_padded_queries_and_keys_out():
    """Junk in a padded query's row (a decoder's pad query attends to the real keys before it) changes
    neither metric: each equals its value on the real tokens alone."""
    from neutreno.diagnostics import head_redundancy, nonlocal_energy

    g = torch.Generator().manual_seed(0)
    causal = torch.ones(7, 7).tril().bool()
    a, b = (torch.randn(1, 3, 7, 7, generator=g).masked_fill(~causal, -torch.inf).softmax(-1) for _ in "ab")
    v = torch.randn(1, 3, 7, 4, generator=g)
    mask = torch.tensor([[True] * 5 + [False] * 2])
    a[..., 5:, :5], b[..., 5:, :5] = 0.5, 0.1  # pad queries: rows the model computed, not ours to count
    for form in ("mean", "matched", "best"):
        alone = head_redundancy(a[..., :5, :5], b[..., :5, :5], form=form)
        assert head_redundancy(a, b, form=form, mask=mask) == pytest.approx(alone.item(), abs=1e-6)
        assert head_redundancy(a, b, form=form) != pytest.approx(alone.item(), abs=1e-3)
    alone = nonlocal_energy(a[..., :5, :5], v[..., :5, :])
    assert nonlocal_energy(a, v, mask) == pytest.approx(alone.item(), rel=1e-5)


def test_is_decoder_follows_the_flag_the_model_honours():
    """bert-generation (causal-LM mapping only) builds BertGenerationEncoder, which attends both ways
    unless config.is_decoder; XLMWithLMHeadModel is a masked LM despite its name; BertLMHeadModel
    without is_decoder is bidirectional too. GPT-2, Llama, GPT-NeoX (whose config declares an
    is_decoder it ignores) stay decoders, BERT an encoder."""
    from neutreno.diagnostics import HFProbe
    from neutreno.diagnostics.collect import hf_is_decoder

    sizes = dict(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    torch.manual_seed(0)
    encoder = transformers.BertGenerationEncoder(transformers.BertGenerationConfig(**sizes)).eval()
    probe = HFProbe(encoder, attention=True)
    layers = probe({"input_ids": torch.randint(0, 32, (1, 6))})
    later = torch.ones(6, 6).triu(1).bool()
    assert not layers.causal and layers.attn[0][0][:, later].min() > 0  # it does see later tokens
    encoders = [
        transformers.BertGenerationConfig(**sizes),
        transformers.XLMConfig(architectures=["XLMWithLMHeadModel"]),
        transformers.BertConfig(architectures=["BertLMHeadModel"]),
        transformers.BertConfig(architectures=["BertForMaskedLM"]),
        transformers.BertConfig(),
    ]
    decoders = [
        transformers.BertGenerationConfig(is_decoder=True, **sizes),
        transformers.XLMConfig(causal=True, architectures=["XLMWithLMHeadModel"]),
        transformers.BertConfig(is_decoder=True),
        transformers.GPT2Config(),
        transformers.GPT2Config(architectures=["GPT2LMHeadModel"]),
        transformers.LlamaConfig(),
        transformers.LlamaConfig(architectures=["LlamaForCausalLM"]),
        transformers.GPTNeoXConfig(),
    ]
    assert [hf_is_decoder(c) for c in encoders] == [False] * len(encoders)
    assert [hf_is_decoder(c) for c in decoders] == [True] * len(decoders)


def test_value_output_weights_of_phi_gpt_neox_and_bloom_and_one_line_refusals():
    """Phi's output projection is self_attn.dense; GPT-NeoX's and Bloom's fused query_key_value holds
    each head's q, k, v rows in turn, so head h's values are rows 3dh + 2d … 3dh + 3d: W_V x equals the
    values each model keeps in its KV cache (bias aside), and W_O is the dense weight. A fused layout not
    read (Falcon's, GPT-BigCode's) is refused in one line naming the layer class."""
    from neutreno.diagnostics.spectral import value_output_maps

    sizes = dict(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    models = {
        "phi": transformers.PhiForCausalLM(transformers.PhiConfig(num_key_value_heads=2, **sizes)),
        "neox": transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**sizes)),
        "bloom": transformers.BloomForCausalLM(
            transformers.BloomConfig(vocab_size=32, hidden_size=32, n_layer=2, n_head=4)
        ),
    }
    ids = torch.randint(0, 32, (1, 5))
    for kind, model in models.items():
        layers = model.base_model.layers if kind != "bloom" else model.base_model.h
        normed = []  # each layer's attention input: its input_layernorm's output

        def keep(module, args, out, normed=normed):
            normed.append(out[0])

        handles = [layer.input_layernorm.register_forward_hook(keep) for layer in layers]
        with torch.no_grad():
            cache = kv_cache(model.eval()(input_ids=ids, use_cache=True))
        for handle in handles:
            handle.remove()
        for index, (layer, (w_v, w_o, _)) in enumerate(zip(layers, value_output_maps(model), strict=True)):
            if kind == "phi":  # 2 value heads of 8 rows, each read by 2 query heads
                rows = [r for h in range(4) for r in range(8 * (h // 2), 8 * (h // 2) + 8)]
                fused, bias, dense = (
                    layer.self_attn.v_proj.weight,
                    layer.self_attn.v_proj.bias,
                    layer.self_attn.dense,
                )
            else:
                attn = layer.attention if kind == "neox" else layer.self_attention
                fused, bias, dense = attn.query_key_value.weight, attn.query_key_value.bias, attn.dense
                rows = [r for h in range(4) for r in range(24 * h + 16, 24 * h + 24)]
            assert torch.equal(w_v, fused[rows]) and torch.equal(w_o, dense.weight)
            values = cache.layers[index].values[0]  # (H_kv, N, d)
            values = values.repeat_interleave(4 // values.shape[0], 0).transpose(0, 1).flatten(1)
            torch.testing.assert_close(
                normed[index] @ w_v.T + bias[rows], values, atol=1e-5, rtol=1e-5, msg=kind
            )
    refused = {
        "FalconDecoderLayer": transformers.FalconForCausalLM(transformers.FalconConfig(**sizes)),
        "GPTBigCodeBlock": transformers.GPTBigCodeForCausalLM(
            transformers.GPTBigCodeConfig(vocab_size=32, n_embd=32, n_layer=1, n_head=4)
        ),
    }
    for name, model in refused.items():
        with pytest.raises(ValueError) as error:
            value_output_maps(model)
        message = str(error.value)
        assert "\n" not in message and message.startswith(
            f"{name}: the spectrum needs the layer's separate value"
        )


def test_a_model_transformers_cannot_switch_to_eager_is_loaded_on_it_or_refused(text, tmp_path, capsys):
    """Falcon: transformers 5 declines ``set_attn_implementation`` after loading (it only logs), and its
    sdpa path drops the causal mask once attention maps are asked for. analyze's attention metrics ran
    it so, and every layer's cosine from block 1 on was wrong (0.337 for 0.286). analyze now loads
    Hugging Face models on the eager kernel where maps are read, and the probe refuses a model that
    stayed on another. Reference: each sentence alone through the model's own forward (no maps),
    hooks on its blocks, the cosine by hand."""
    from neutreno.diagnostics.collect import HFProbe

    torch.manual_seed(0)
    tokenizer = word_tokenizer(SENTENCES)
    config = transformers.FalconConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.FalconForCausalLM(config)
    with torch.no_grad():  # sharper attention than the tiny init gives, so that causality shows
        for block in model.transformer.h:
            block.self_attention.query_key_value.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "falcon")
    tokenizer.save_pretrained(tmp_path / "falcon")
    model = transformers.FalconForCausalLM.from_pretrained(tmp_path / "falcon").eval()
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="did not switch FalconForCausalLM"):
        HFProbe(model, attention=True)

    expected = {layer: 0.0 for layer in range(4)}
    for sentence in SENTENCES:
        ids = tokenizer(sentence, return_tensors="pt")["input_ids"]
        outputs = []
        handles = [
            b.register_forward_hook(lambda m, a, out, kept=outputs: kept.append(out[0]))
            for b in model.transformer.h
        ]
        with torch.no_grad():
            embedded = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
        for handle in handles:
            handle.remove()
        for layer, hidden in enumerate([embedded, *outputs]):
            expected[layer] += cosine_by_hand(hidden[0]) / len(SENTENCES)
    out = tmp_path / "an"
    assert main(["analyze", "--model", f"hf:{tmp_path / 'falcon'}", "--data", str(text), "--samples", "6",
                 "--batch-size", "3", "--metrics", "cosine,energy", "--out", str(out)]) == 0  # fmt: skip
    (cosine,) = (r["cosine"] for r in json.loads((out / "report.json").read_text())["results"].values())
    assert [cosine[str(layer)] for layer in range(4)] == pytest.approx(list(expected.values()), abs=1e-5)


def test_an_encoder_with_positions_after_its_padding_index_gets_sentences_it_can_run(tmp_path, text):
    """RoBERTa numbers positions from its padding index + 1, so 12 positions hold 10 tokens: analyze cut
    sentences to max_position_embeddings (12) and the forward failed on the longer ones."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="[UNK]"
    )
    config = transformers.RobertaConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=12, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.RobertaModel(config).eval()
    with torch.no_grad():  # the model's own bound, found by running it: 10 tokens run, 11 do not
        model(torch.full((1, 10), 5))
        with pytest.raises((IndexError, RuntimeError), match="out of"):
            model(torch.full((1, 11), 5))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (variant,) = build_variants(f"hf:{tmp_path}", [], [0.0], seed=0)
    batches = text_batches(variant, str(text), samples=6, batch_size=3)
    assert max(b["input_ids"].shape[1] for b in batches) == 10  # the longest sentence has 14 words
    assert set(run_analysis(variant, batches, ["cosine"])["cosine"]) == {0, 1, 2}


# ---- our own language models: a checkpoint of `neutreno train` ------------------------------------------


@pytest.fixture
def lm_checkpoint(shared_data, tmp_path):
    """A tiny NeuTRENO language model saved as `neutreno train` saves one: with its word vocabulary (of
    the first 200 real WikiText lines) and its corpus (those lines, as train and valid splits)."""
    from neutreno.data.corpus import EOS, Vocabulary
    from neutreno.models import create_model
    from neutreno.models.checkpoint import save_model

    lines = (shared_data / "wikitext103-mini" / "wiki.valid.tokens").read_text().splitlines()[:200]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid"):
        (corpus / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n")
    vocab = Vocabulary(sorted({w for line in lines for w in line.split()} | {EOS, "<unk>"}))
    torch.manual_seed(0)
    args = {"vocab_size": len(vocab), "embed_dim": 32, "depth": 3, "num_heads": 4, "mlp_ratio": 2.0,
            "context_length": 16, "cutoffs": [50, 200]}  # fmt: skip
    model = create_model("lm_wt103_mini", attention="neutreno", lam=0.4, **args).eval()
    path = tmp_path / "lm.safetensors"
    save_model(path, model, extra={"tokenizer": vocab.metadata(), "corpus": str(corpus)})
    return path, model, vocab, corpus / "wiki.valid.tokens"


def test_analyze_our_language_model_against_an_explicit_computation(lm_checkpoint, tmp_path, capsys):
    """`neutreno analyze --model <our LM checkpoint>` (it was refused: "analyze reads images into our
    ViTs"): by default on its corpus's valid split, tokenised with its own vocabulary, in consecutive
    windows of its context length; each layer's token similarity is a hand computation on each window
    alone (every block's output by a hook), and the attention is causal. The report names the
    vocabulary by size and digest, not word by word."""
    path, model, vocab, valid = lm_checkpoint
    out = tmp_path / "an"
    code = main(["analyze", "--model", str(path), "--samples", "3", "--batch-size", "2",
                 "--metrics", "cosine,energy", "--attn-layer", "2", "--out", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    (label,) = report["results"]
    assert report["samples"] == report["models"][label]["samples"] == 3 and report["data"] == str(valid)
    info = report["models"][label]
    assert info["causal"] and info["tokenizer"].startswith(f"{len(vocab)} words, sha256 ")
    assert (out / "attention_layer2.png").is_file()

    words = [w for line in valid.read_text().splitlines() for w in [*line.split(), "<eos>"]]
    ids = torch.tensor([vocab.words.index(w) for w in words[:48]])
    outputs = []
    handles = [block.register_forward_hook(lambda m, a, o: outputs.append(o[0])) for block in model.blocks]
    handles.append(model.blocks[0].register_forward_pre_hook(lambda m, a: outputs.append(a[0])))
    cosines = {layer: [] for layer in range(4)}
    try:
        for window in ids.view(3, 16):
            outputs.clear()
            with torch.no_grad():
                model.forward_features(window[None])
            for layer, h in enumerate(outputs):  # the embeddings (block 1's input), each block's output
                cosines[layer].append(cosine_by_hand(h[0]))
    finally:
        for handle in handles:
            handle.remove()
    for layer, values in cosines.items():
        assert report["results"][label]["cosine"][str(layer)] == pytest.approx(sum(values) / 3, abs=1e-5)
    # more windows than the text holds: said, as for images (found in review: only recorded)
    assert "note:" not in capsys.readouterr().err
    code = main(
        ["analyze", "--model", str(path), "--samples", "100000", "--metrics", "cosine", "--out", str(out)]
    )
    assert code == 0
    windows = json.loads((out / "report.json").read_text())["samples"]
    assert (
        f"holds {windows} windows of 16 tokens; analysed {windows}, not --samples 100000"
        in capsys.readouterr().err
    )


def test_our_language_model_reads_text_through_its_body_and_refusals_are_one_line(
    lm_checkpoint, tmp_path, capsys
):
    """The probe runs the model's body, not its log-probabilities over the whole vocabulary (WikiText-103's
    267,735 words × 256 positions × 32 windows: 8.8 GB); a text file shorter than one window is one
    shorter window. Images for a language model, a language model beside a ViT, gradient alignment, a
    registry language model (no tokenizer): each a one-line error, exit 2, no report."""
    path, _, vocab, _ = lm_checkpoint
    (variant,) = build_variants(str(path), [], [None], seed=0)
    assert variant.causal and variant.tokenizer is not None

    def no_head(*args, **kwargs):
        raise AssertionError("the head ran")

    variant.model.log_probs = no_head
    short = tmp_path / "short.txt"
    short.write_text("the zyzzyvas is blue\n")  # 5 tokens with <eos>, "zyzzyvas" unknown
    from neutreno.diagnostics.analysis import token_windows

    (batch,) = token_windows(variant, str(short), samples=4, batch_size=2)
    words = ["the", "zyzzyvas", "is", "blue", "<eos>"]
    assert batch.tolist() == [[vocab.ids.get(w, vocab.unk) for w in words]]
    assert "1 of 5 tokens (20.0%) are text the model's tokenizer does not know" in capsys.readouterr().err
    assert run_analysis(variant, [batch], ["cosine"])["cosine"].keys() == {0, 1, 2, 3}
    cases = [
        ([str(path), "--data", "digits"], "is a language model: --data must be a text file or a corpus"),
        ([str(path), "--compare", "vit_digits"], "images (our ViTs) or text (our language models, hf: mod"),
        ([str(path), "--metrics", "gradient_alignment"], "not defined for a causal (decoder) model"),
        (["lm_wt103_mini"], "a checkpoint of neutreno train: it records the tokenizer"),
    ]
    for model, message in cases:
        code = main(["analyze", "--model", *model, "--samples", "2", "--out", str(tmp_path / "out")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_our_language_models_text_what_it_drops_their_own_counts_and_a_moved_corpus(
    lm_checkpoint, tmp_path, capsys
):
    """A BPE without an unknown token drops characters it has no token for: analyze read what was left
    without a word (eval warned). Models of other context lengths read other numbers of windows:
    report.json's one `samples` was the last model's. A checkpoint whose corpus has moved, or a --data
    that is not there, was "--data must be a text file or a corpus folder", a flag never given."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from neutreno.data.corpus import SubwordTokenizer
    from neutreno.diagnostics.analysis import token_windows
    from neutreno.models import create_model
    from neutreno.models.checkpoint import save_model

    path, _, _, valid = lm_checkpoint
    bpe = Tokenizer(models.BPE())  # no unknown token: a character outside its alphabet is dropped
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(valid.read_text().splitlines(), trainers.BpeTrainer(vocab_size=300))
    tokenizer = SubwordTokenizer(bpe)
    model = create_model("lm_wt103_mini", vocab_size=len(tokenizer), embed_dim=32, depth=1, num_heads=4,
                         context_length=8, cutoffs=[50, 200])  # fmt: skip
    subword = tmp_path / "bpe.safetensors"
    save_model(subword, model, extra={"tokenizer": tokenizer.metadata()})
    (variant,) = build_variants(str(subword), [], [None], seed=0)
    text = tmp_path / "mixed.txt"
    text.write_text("the river 日本 flows\n")
    (batch,) = token_windows(variant, str(text), samples=4, batch_size=4)
    assert "".join(tokenizer.tokenizer.decode(batch[0].tolist()).split()) == "theriverflows"  # (no decoder)
    assert "the model's tokenizer drops 2 characters" in capsys.readouterr().err

    short = tmp_path / "short.safetensors"  # the fixture's model at context 8: twice its windows
    model = create_model("lm_wt103_mini", **{**read_metadata(path)["args"], "context_length": 8})
    save_model(short, model, extra={"tokenizer": read_metadata(path)["tokenizer"]})
    out = tmp_path / "two"
    code = main(["analyze", "--model", str(path), "--compare", str(short), "--data", str(valid),
                 "--samples", "100000", "--metrics", "cosine", "--out", str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    counts = [info["samples"] for info in report["models"].values()]
    assert report["samples"] is None and counts[1] // 2 == counts[0] > 500, counts  # all of the text
    assert f"holds {counts[0]} windows of " in capsys.readouterr().err  # fewer than --samples: said

    for args, message in (
        (["--data", str(tmp_path / "nowhere.txt")], f"no such text file or corpus folder: {tmp_path}"),
        ([], f"was trained on {valid.parent}, which is not there: give the text to analyse with --data"),
    ):
        if not args:
            valid.parent.rename(tmp_path / "moved")
        code = main(["analyze", "--model", str(path), *args, "--out", str(tmp_path / "out")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_analyze_says_what_of_the_text_it_cut_skipped_or_could_not_read(tmp_path, capsys):
    """From a review: texts cut to 128 tokens, lines under 5 words skipped and text read as [UNK] were
    all measured without a word (a line of emoji: identical [UNK] tokens, cosine 0.6 at every layer);
    a tokenizer of another, smaller vocabulary whose ids fit ran silently."""
    words = [*SENTENCES, "zebra " * 200, "too short line"]
    tokenizer = word_tokenizer([*SENTENCES, "zebra"])
    path = tmp_path / "gpt2"
    tiny_decoder("gpt2", len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = tmp_path / "text.txt"
    data.write_text("\n".join([*words, "an unknown sentence of many novel words"]) + "\n")
    out = ["--out", str(tmp_path / "out"), "--metrics", "cosine"]
    assert main(["analyze", "--model", f"hf:{path}", "--data", str(data), *out]) == 0
    err = capsys.readouterr().err
    assert f"note: {data}: 1 line(s) of fewer than 5 words skipped" in err
    assert f"note: {data}: 1 of 8 texts are longer than 128 tokens" in err and "cut to their first 128" in err
    novel = "an unknown sentence of many novel words"
    unknown = sum(word not in tokenizer.get_vocab() for word in novel.split(" "))
    assert unknown and f"warning: {data}: {unknown} of " in err and "read as [UNK]" in err
    big = tmp_path / "big"
    tiny_decoder("gpt2", 10 * len(tokenizer)).save_pretrained(big)
    tokenizer.save_pretrained(big)
    assert main(["analyze", "--model", f"hf:{big}", "--data", str(data), *out]) == 0
    assert f"has {len(tokenizer)} tokens, the model's embedding {10 * len(tokenizer)} rows: is it" in (
        capsys.readouterr().err
    )


def test_the_probe_refuses_a_left_padded_batch(tmp_path):
    """Left padding shifted GPT-2's absolute positions: each text's per-layer cosine changed (-0.0134
    where alone and right-padded it is -0.001), silently."""
    from neutreno.diagnostics import HFProbe

    model = tiny_decoder("gpt2", 40).eval()
    ids = torch.randint(3, 40, (2, 6))
    right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    HFProbe(model)({"input_ids": ids, "attention_mask": right})
    with pytest.raises(ValueError, match=r"attention_mask pads on the left .* pad on the right"):
        HFProbe(model)({"input_ids": ids, "attention_mask": right.flip(-1)})
    positions = (right.flip(-1).cumsum(-1) - 1).clamp_min(0)  # the caller's own positions: its choice
    HFProbe(model)({"input_ids": ids, "attention_mask": right.flip(-1), "position_ids": positions})

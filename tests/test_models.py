"""ViT/DeiT models: timm key layout, registry, NeuTRENO wiring through the stack."""

import re

import pytest
import torch

from neutreno import ATTENTION_TYPES, create_model, list_models
from neutreno.diagnostics import capture_hidden_states

from reference import saved_bytes


def timm_vit_keys(depth, dim, patch, in_chans, num_patches, num_classes, mlp_hidden):
    """timm ``VisionTransformer`` state-dict layout (class token, no register tokens, qkv bias)."""
    keys = {
        "cls_token": (1, 1, dim),
        "pos_embed": (1, num_patches + 1, dim),
        "patch_embed.proj.weight": (dim, in_chans, patch, patch),
        "patch_embed.proj.bias": (dim,),
    }
    for i in range(depth):
        p = f"blocks.{i}."
        keys |= {
            p + "norm1.weight": (dim,), p + "norm1.bias": (dim,),
            p + "attn.qkv.weight": (3 * dim, dim), p + "attn.qkv.bias": (3 * dim,),
            p + "attn.proj.weight": (dim, dim), p + "attn.proj.bias": (dim,),
            p + "norm2.weight": (dim,), p + "norm2.bias": (dim,),
            p + "mlp.fc1.weight": (mlp_hidden, dim), p + "mlp.fc1.bias": (mlp_hidden,),
            p + "mlp.fc2.weight": (dim, mlp_hidden), p + "mlp.fc2.bias": (dim,),
        }  # fmt: skip
    keys |= {"norm.weight": (dim,), "norm.bias": (dim,)}
    keys |= {"head.weight": (num_classes, dim), "head.bias": (num_classes,)}
    return keys


@pytest.mark.parametrize("attention", ["softmax", "neutreno"])
def test_deit_tiny_has_timms_keys_and_shapes(attention):
    model = create_model("deit_tiny_patch16_224", attention=attention)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == timm_vit_keys(12, 192, 16, 3, 196, 1000, 768)
    assert sum(p.numel() for p in model.parameters()) == 5_717_416  # timm's deit_tiny count


def test_cifar_and_digits_presets():
    cifar = {k: tuple(v.shape) for k, v in create_model("vit_tiny_patch4_32").state_dict().items()}
    assert cifar == timm_vit_keys(12, 192, 4, 3, 64, 10, 768)
    digits = create_model("vit_digits")
    assert len(digits.blocks) >= 8 and digits.patch_embed.proj.in_channels == 1
    assert digits(torch.rand(3, 1, 8, 8)).shape == (3, 10)


def test_one_checkpoint_serves_softmax_and_neutreno():
    soft = create_model("vit_tiny_patch4_32", attention="softmax")
    neu = create_model("vit_tiny_patch4_32", attention="neutreno", lam=0.6)
    neu.load_state_dict(soft.state_dict(), strict=True)


def test_recipe_details():
    model = create_model("deit_tiny_patch16_224")
    block = model.blocks[0]
    assert block.norm1.eps == model.norm.eps == 1e-6
    assert block.attn.qkv.bias is not None
    assert isinstance(block.mlp.act, torch.nn.GELU) and block.mlp.act.approximate == "none"
    w = torch.cat([b.mlp.fc1.weight.flatten() for b in model.blocks])
    assert abs(w.std().item() - 0.02) < 0.001  # (truncated) normal(0.02); timm truncates at ±2, a no-op here


def test_forward_features_and_logits():
    model = create_model("deit_tiny_patch16_224", num_classes=7).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape == (2, 197, 192)
        torch.testing.assert_close(model(x), model.head(features[:, 0]))


def test_neutreno_leaves_first_block_unchanged_and_changes_later_ones():
    torch.manual_seed(0)
    soft = create_model("vit_digits").eval()
    neu = create_model("vit_digits", attention="neutreno").eval()
    neu.load_state_dict(soft.state_dict())
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad(), capture_hidden_states(soft.blocks) as hs, capture_hidden_states(neu.blocks) as hn:
        soft(x), neu(x)
    torch.testing.assert_close(hn[1], hs[1], atol=0, rtol=0)  # block 1 output
    assert all(not torch.allclose(a, b) for a, b in zip(hn[2:], hs[2:], strict=True))


def _stacks_and_input(name):
    """A small model of each family, its attention stacks (each with its own V⁰), and an input."""
    torch.manual_seed(0)
    if name == "vit":
        model = create_model("vit_digits", attention="neutreno")
        return model, [model.blocks], torch.rand(2, 1, 8, 8)
    if name == "lm":
        tiny = {"embed_dim": 32, "depth": 3, "num_heads": 4, "mlp_ratio": 2.0, "drop_rate": 0.0}
        model = create_model("lm_wt103_mini", attention="neutreno", vocab_size=300, cutoffs=(50, 150), **tiny)
        return model, [model.blocks], torch.randint(0, 300, (2, 12))
    model = create_model("segmenter_tiny", attention="neutreno", num_classes=5, img_size=64)
    return model, [model.encoder.blocks, model.decoder.blocks], torch.rand(2, 3, 64, 64)


@pytest.mark.parametrize("family", ["vit", "lm", "segmenter"])
def test_every_later_block_receives_the_first_blocks_values(family):
    """In every stack, block 0 gets no V⁰ and each later block gets block 0's values — the very tensor,
    so its gradient flows — and a model with two stacks (Segmenter) gives each its own."""
    model, stacks, x = _stacks_and_input(family)
    seen = [[] for _ in stacks]  # per stack: (v0 given, values returned) of each block

    def record(log):
        return lambda m, args, out: log.append((args[1] if len(args) > 1 else None, out[1]))

    for stack, log in zip(stacks, seen, strict=True):
        for block in stack:
            block.register_forward_hook(record(log))
    with torch.no_grad():
        model.eval()(x)
    for log in seen:
        assert len(log) >= 2 and log[0][0] is None
        assert all(v0 is log[0][1] for v0, _ in log[1:])
    if family == "segmenter":
        encoder_v0, decoder_v0 = (log[0][1] for log in seen)
        assert encoder_v0.shape[-2] != decoder_v0.shape[-2]  # the decoder's own tokens, not the encoder's


@pytest.mark.parametrize("attention", ATTENTION_TYPES)
def test_every_variant_trains_a_step(attention):
    model = create_model("vit_digits", attention=attention, featscale=True, attnscale=True)
    loss = torch.nn.functional.cross_entropy(model(torch.rand(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_registry_lists_and_rejects_clearly():
    names = list_models()
    for name in [
        "deit_tiny_patch16_224",
        "deit_small_patch16_224",
        "deit_base_patch16_224",
        "vit_tiny_patch4_32",
        "vit_digits",
    ]:
        assert name in names
    assert list_models("deit_*") == [
        "deit_base_patch16_224",
        "deit_small_patch16_224",
        "deit_tiny_patch16_224",
    ]
    # as timm's: a list of patterns, exclusions, "" for all (a list raised fnmatch's "expected str")
    assert list_models(["deit_t*", "vit_d*"]) == ["deit_tiny_patch16_224", "vit_digits"]
    assert list_models(filter="deit_*", exclude_filters=["*small*", "*base*"]) == ["deit_tiny_patch16_224"]
    assert list_models("") == list_models() == list_models([])
    with pytest.raises(TypeError, match="filter must be a pattern or a list of patterns, got 3"):
        list_models(3)
    with pytest.raises(ValueError, match="unknown model 'vit_huge'; available: deit_base"):
        create_model("vit_huge")
    with pytest.raises(ValueError, match="unknown attention 'flash'; valid: softmax, neutreno"):
        create_model("vit_digits", attention="flash")
    with pytest.raises(ValueError, match=r"unknown model argument\(s\) \['heads'\]"):
        create_model("vit_digits", heads=3)
    with pytest.raises(ValueError, match="expected 8x8 images"):
        create_model("vit_digits")(torch.rand(1, 1, 16, 16))
    # sizes and rates a ViT cannot have: num_classes -1 built a model without a head, the others
    # ZeroDivisionError, torch's "negative dimension", or a TypeError at the first forward
    for kw, message in (
        (dict(num_classes=-1), "num_classes must be an integer >= 0"),
        (dict(num_classes=2.5), "num_classes must be an integer >= 0"),
        (dict(patch_size=0), "patch_size must be an integer >= 1, got 0"),
        (dict(embed_dim=-64), "embed_dim must be an integer >= 1"),
        (dict(num_heads=4.0), "num_heads must be an integer >= 1, got 4.0"),
        (dict(depth=True), "depth must be an integer >= 1, got True"),
        (dict(in_chans=0), "in_chans must be an integer >= 1"),
        (dict(drop_path_rate=1.0), r"drop_path_rate must be a number in \[0, 1\), got 1.0"),
        (dict(attn_drop_rate=-0.1), "attn_drop_rate must be a number"),
        (dict(qkv_bias="false"), "qkv_bias must be true or false, got 'false'"),  # truthy: biases kept
    ):
        with pytest.raises(ValueError, match=message):
            create_model("vit_digits", **kw)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 0"):
        create_model("vit_digits").reset_classifier(-1)
    with pytest.raises(ValueError, match="tie_embeddings must be true or false, got 'no'"):
        create_model("lm_wt103_mini", tie_embeddings="no")
    # timm's pretrained=False builds (it was an unknown argument); True names what loads weights
    assert create_model("vit_digits", pretrained=False).model_spec["args"] == {}
    with pytest.raises(ValueError, match=r"pretrained=True: neutreno downloads no weights.*load_pretrained"):
        create_model("vit_digits", pretrained=True)


def test_a_model_with_a_new_head_saves_and_loads(tmp_path):
    """reset_classifier changes the model save_model records (it recorded the old class count, and the
    file did not load: head of another shape)."""
    from neutreno.models import load_model, save_model

    model = create_model("vit_digits", depth=2)
    model.reset_classifier(5)
    save_model(tmp_path / "five.safetensors", model)
    loaded, meta = load_model(tmp_path / "five.safetensors")
    assert meta["args"]["num_classes"] == 5 and loaded.head.out_features == 5
    x = torch.rand(2, 1, 8, 8)
    torch.testing.assert_close(loaded(x), model.eval()(x), atol=0, rtol=0)
    # safetensors' own save_model(model, filename) order: it said the model had no model_spec
    with pytest.raises(TypeError, match=r"save_model takes the file first: save_model\(path, model\)"):
        save_model(model, tmp_path / "swapped.safetensors")


@pytest.mark.parametrize("attn_impl", ["fused", "explicit"])
def test_neutreno_keeps_no_more_activations_than_softmax(attn_impl):
    """NeuTRENO adds no activation memory (paper App. G.4): the fused path stores U, V rather than
    U + λ(V⁰ − V); the explicit path stores the sum in place of U."""
    images = torch.rand(8, 1, 8, 8)
    sizes = {}
    variants = (("softmax", None), ("neutreno", None), ("neutreno", "layer"), ("neutreno", "head"))
    for attention, learn_lam in variants:
        torch.manual_seed(0)
        extra = {"learn_lam": learn_lam} if learn_lam else {}
        model = create_model("vit_digits", attention=attention, attn_impl=attn_impl, **extra)
        sizes[attention, learn_lam] = saved_bytes(lambda model=model: model(images), model)
    assert sizes["neutreno", None] <= sizes["softmax", None], sizes
    # a learned λ: its values (one per layer, or (D,) per layer), and on the explicit path V⁰ − V for its
    # gradient, one (B, N, D) per later layer (V itself would keep its whole QKV projection there). After
    # the fused kernel it kept that difference too (+766 kB here) until the term became λV⁰ − λV.
    depth, tokens, dim = len(model.blocks), 1 + 16, 64
    difference = (depth - 1) * 8 * tokens * dim * 4 if attn_impl == "explicit" else 0
    for learn_lam, values in (("layer", 4), ("head", dim * 4)):
        assert sizes["neutreno", learn_lam] <= sizes["softmax", None] + difference + depth * values, sizes


# ---- timm/DeiT checkpoints in and out -----------------------------------------------------------------


def timm_deit_tiny_state(seed=0, num_classes=1000):
    """A state dict in timm's deit_tiny_patch16_224 layout, written from the key list above."""
    g = torch.Generator().manual_seed(seed)
    keys = timm_vit_keys(12, 192, 16, 3, 196, num_classes, 768)
    return {k: torch.randn(shape, generator=g) for k, shape in keys.items()}


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_timm_round_trip(tmp_path, suffix):
    from neutreno import export_timm, load_pretrained
    from neutreno.models import read_state_dict

    state = timm_deit_tiny_state()
    torch.save({"model": state, "epoch": 299}, tmp_path / "deit.pth")  # DeiT's released layout
    model = create_model("deit_tiny_patch16_224", attention="neutreno")
    assert load_pretrained(model, tmp_path / "deit.pth") == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="NeuTRENO's term"):  # timm would run it as softmax, silently
        export_timm(model, tmp_path / f"out{suffix}")
    assert not (tmp_path / f"out{suffix}").exists()
    export_timm(model, tmp_path / f"out{suffix}", as_softmax=True)
    written = read_state_dict(tmp_path / f"out{suffix}")
    assert {k: tuple(v.shape) for k, v in written.items()} == timm_vit_keys(12, 192, 16, 3, 196, 1000, 768)
    assert all(torch.equal(written[k], v) for k, v in state.items())
    again = load_pretrained(
        create_model("deit_tiny_patch16_224", attention="neutreno"), tmp_path / f"out{suffix}"
    )
    assert again == []
    # A learned λ starts at λ from timm's weights, and as_softmax leaves it out with the term (it was
    # refused as a key timm has no place for).
    learned = create_model("deit_tiny_patch16_224", attention="neutreno", learn_lam="layer")
    keys = sorted(f"blocks.{i}.attn.learned_lam.raw" for i in range(1, 12))  # block 0 has no term
    assert load_pretrained(learned, tmp_path / "deit.pth") == keys
    export_timm(learned, tmp_path / f"learned{suffix}", as_softmax=True)
    written = read_state_dict(tmp_path / f"learned{suffix}")
    assert set(written) == set(state) and all(torch.equal(written[k], v) for k, v in state.items())


def test_legacy_pickled_pth_loads_with_weights_only(tmp_path):
    from neutreno import load_pretrained

    state = timm_deit_tiny_state(1)
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    model = create_model("deit_tiny_patch16_224")
    load_pretrained(model, tmp_path / "legacy.pth")
    assert torch.equal(model.blocks[5].attn.qkv.weight, state["blocks.5.attn.qkv.weight"])

    class Payload:  # code in a pickle is never run: weights_only refuses it
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"model": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match=r"cannot read .*evil\.pth"):
        load_pretrained(model, tmp_path / "evil.pth")


def test_load_pretrained_resizes_pos_embed_and_leaves_another_head_fresh(tmp_path):
    from safetensors.torch import save_file

    from neutreno import load_pretrained

    state = timm_deit_tiny_state(2)
    save_file(state, str(tmp_path / "deit.safetensors"))
    model = create_model("deit_tiny_patch16_224", img_size=112, num_classes=10)  # 7×7 grid
    head = model.head.weight.clone()
    assert load_pretrained(model, tmp_path / "deit.safetensors") == ["head.bias", "head.weight"]
    assert torch.equal(model.head.weight, head)
    assert model.pos_embed.shape == (1, 50, 192)
    assert torch.equal(model.pos_embed[:, 0], state["pos_embed"][:, 0])  # the CLS position is kept
    assert torch.equal(model.blocks[11].mlp.fc2.bias, state["blocks.11.mlp.fc2.bias"])


def test_load_pretrained_lists_what_does_not_fit(tmp_path):
    from neutreno import export_timm, load_pretrained

    model = create_model("deit_tiny_patch16_224")
    state = timm_deit_tiny_state()

    def attempt(bad):
        torch.save(bad, tmp_path / "bad.pth")
        load_pretrained(model, tmp_path / "bad.pth")

    distilled = {**state, "dist_token": torch.zeros(1, 1, 192), "head_dist.weight": torch.zeros(1000, 192)}
    with pytest.raises(ValueError, match="distilled DeiT"):
        attempt(distilled)
    with pytest.raises(ValueError, match=r"missing \['blocks\.3\.attn\.qkv\.bias'\], unexpected \[\]"):
        attempt({k: v for k, v in state.items() if k != "blocks.3.attn.qkv.bias"})
    with pytest.raises(ValueError, match=r"unexpected \['fc_norm\.weight'\]"):
        attempt({**state, "fc_norm.weight": torch.ones(192)})
    with pytest.raises(ValueError, match=r"missing \['head\.bias'\]"):  # its weight was thrown away, silently
        attempt({k: v for k, v in state.items() if k != "head.bias"})
    with pytest.raises(
        ValueError, match=r"wrong shape \[\('blocks\.0\.mlp\.fc1\.weight', \(10, 192\), \(768, 192\)\)"
    ):
        attempt({**state, "blocks.0.mlp.fc1.weight": torch.zeros(10, 192)})
    # a ViT without a class token: its 196 positions were "195 patch positions, not a square grid"
    no_class = {k: v for k, v in state.items() if k != "cls_token"}
    no_class["pos_embed"] = state["pos_embed"][:, 1:]
    with pytest.raises(ValueError, match="196 positions, a square grid with none for a class token"):
        attempt(no_class)
    # saved from a DistributedDataParallel model, every key under "module.": taken off, as timm does
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "ddp.pth")
    assert load_pretrained(model, tmp_path / "ddp.pth") == []
    assert torch.equal(model.blocks[5].attn.qkv.weight, state["blocks.5.attn.qkv.weight"])
    with pytest.raises(ValueError, match="loads ViT weights"):
        load_pretrained(create_model("lm_wt103_mini"), tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="no place for"):
        export_timm(create_model("vit_digits", featscale=True), tmp_path / "x.pth")
    with pytest.raises(ValueError, match=r"writes \.safetensors or \.pth"):
        export_timm(model, tmp_path / "x.bin.gz")
    assert not (tmp_path / "x.pth").exists() and not (tmp_path / "x.bin.gz").exists()


def test_a_checkpoint_of_another_head_count_or_attention_function_is_refused(tmp_path):
    """Weights of the same shapes that mean something else: 2 heads' qkv split into 4 (the check was
    skipped when the saved model did not build as softmax: a learned λ, a spectral layer), a kernel
    attention's qkv read by softmax. NeuTRENO and softmax are one function of the weights."""
    from safetensors.torch import load_file, save_file

    from neutreno.models import export_timm, load_model, load_pretrained, save_model

    def saved(name, **kw):
        save_model(tmp_path / f"{name}.safetensors", create_model("vit_digits", depth=3, **kw))
        return tmp_path / f"{name}.safetensors"

    two_heads = saved("h2", attention="neutreno", num_heads=2, learn_lam="layer")
    with pytest.raises(ValueError, match="trained with 2 attention heads, this model has 4"):
        load_pretrained(
            create_model("vit_digits", depth=3, attention="neutreno", learn_lam="layer"), two_heads
        )
    spectral = saved("e", attention="eigen_neg", spectral_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="trained with 2 attention heads, this model has 4"):
        load_pretrained(
            create_model("vit_digits", depth=3, attention="eigen_neg", spectral_layers=1), spectral
        )
    # another function of the same weights: kernel for softmax, eigen_pos's +ψ² for eigen_neg's −ψ² (a
    # constructor setting: this one loaded), another residual factor
    others = [(dict(attention="kernel"), {}), (dict(attention="eigen_neg"), dict(attention="eigen_pos")),
              (dict(residual_scale=0.5), {})]  # fmt: skip
    for kw, ours in others:
        with pytest.raises(
            ValueError, match=r"holds weights of .* \(block 0\); this model has .* another function"
        ):
            load_pretrained(create_model("vit_digits", depth=3, **ours), saved("other", **kw))
    neutreno = saved("n", attention="neutreno", lam=0.3)
    for attention in ("softmax", "neutreno"):
        assert load_pretrained(create_model("vit_digits", depth=3, attention=attention), neutreno) == []
    # metadata that cannot describe a model: one line naming the file (TypeError tracebacks before)
    tensors = load_file(neutreno)
    for args, message in (("[1]", "not a mapping"), ('{"lam": 0.2}', "repeats lam"),
                          ('{"depth": "x"}', "does not describe a model")):  # fmt: skip
        meta = {"model": "vit_digits", "attention": "neutreno", "lam": "0.3", "args": args}
        save_file(tensors, str(tmp_path / "meta.safetensors"), metadata=meta)
        with pytest.raises(ValueError, match=f"meta.safetensors: its .*{message}"):
            load_model(tmp_path / "meta.safetensors")
    # A file recording no model (timm's, DeiT's) holds softmax pre-norm blocks: kernel attention loaded
    # it without a word (logits 11.4 off timm's), unlike the same weights saved by neutreno.
    timm_file = tmp_path / "timm_like.safetensors"
    export_timm(create_model("vit_digits", depth=3), timm_file)
    torch.save({"model": load_file(timm_file)}, tmp_path / "deit_like.pth")
    for path in (timm_file, tmp_path / "deit_like.pth"):
        for kw, message in ((dict(attention="kernel"), "kernel attention"),
                            (dict(attention="kernel_neutreno"), "kernel_neutreno attention"),
                            (dict(residual_scale=0.5), "residual_scale 0.5"),
                            (dict(block_norm="post"), "block_norm 'post'")):  # fmt: skip
            with pytest.raises(ValueError, match=rf"records no model.*block 0 has {message}, which reads"):
                load_pretrained(create_model("vit_digits", depth=3, **kw), path)
        for attention in ("softmax", "neutreno"):
            assert load_pretrained(create_model("vit_digits", depth=3, attention=attention), path) == []
    # 8-bit floats: quantized weights, whose scales are other tensors (isfinite raised a traceback)
    fp8 = {
        k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in load_file(timm_file).items()
    }
    save_file(fp8, str(tmp_path / "fp8.safetensors"))
    with pytest.raises(ValueError, match=r"fp8\.safetensors holds tensors of another kind.*8-bit floats"):
        load_pretrained(create_model("vit_digits", depth=3), tmp_path / "fp8.safetensors")
    from neutreno.models.checkpoint import nonfinite_names

    nan8 = torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)
    assert nonfinite_names([("a", nan8), ("b", nan8[:1])]) == ["a"]
    # timm would run these weights as another model: refused, nothing written
    for kw, message in ((dict(residual_scale=0.5), "residual_scale 0.5"),
                        (dict(attention="kernel"), "kernel"), (dict(block_norm="post"), "block_norm 'post'"),
                        (dict(attention="neutreno", learn_lam="layer"), "learned_lam")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            export_timm(create_model("vit_digits", depth=3, **kw), tmp_path / "timm.safetensors")
    assert not (tmp_path / "timm.safetensors").exists()


def test_resample_pos_embed_matches_timms_antialiased_bicubic():
    """14×14 → 24×24 and → 7×7 (DeiT's grid at 384 and at 112 px) as timm's resample_abs_pos_embed
    resamples them (antialias=True): the plain bicubic differed by up to 0.35."""
    from neutreno.models import resample_pos_embed

    from reference import pil_bicubic

    pos = torch.randn(1, 1 + 14 * 14, 32, generator=torch.Generator().manual_seed(0))
    for side in (24, 7):
        got = resample_pos_embed(pos, (side, side))
        expected = pil_bicubic(pos[0, 1:].T.reshape(32, 14, 14), (side, side)).reshape(32, -1).T
        torch.testing.assert_close(got[0, 1:], expected, atol=2e-5, rtol=1e-5)
        assert torch.equal(got[0, 0], pos[0, 0])
        # a float64 model's positions are resampled in float64 (they were rounded to float32: 1e-6 off)
        double = resample_pos_embed(pos.double(), (side, side))
        assert double.dtype == torch.float64
        exact = pil_bicubic(pos[0, 1:].T.reshape(32, 14, 14).double(), (side, side)).reshape(32, -1).T
        torch.testing.assert_close(double[0, 1:], exact, atol=1e-12, rtol=1e-12)


# ---- timm's model interface (issue 20) -------------------------------------------------------------------


def test_timm_interface_head_and_intermediates_against_the_hidden_states():
    from neutreno.diagnostics import capture_hidden_states

    torch.manual_seed(0)
    model = create_model("vit_digits", attention="neutreno", depth=4).eval()
    images = torch.randn(3, 1, 8, 8)
    with torch.no_grad(), capture_hidden_states(model.blocks) as hidden:
        logits = model(images)
        final, maps = model.forward_intermediates(images, indices=[1, -1])
        features = model.forward_features(images)
        last_two = model.forward_intermediates(images, indices=2, output_fmt="NLC", intermediates_only=True)
        with_cls = model.forward_intermediates(images, norm=True, return_prefix_tokens=True)[1]
    blocks = hidden[1:]  # hidden[0] is the embedding
    torch.testing.assert_close(final, features)
    for got, block in zip(maps, (blocks[1], blocks[3]), strict=True):
        assert got.shape == (3, 64, 4, 4)  # (B, D, h, w): patch tokens of a 4×4 grid
        torch.testing.assert_close(got[:, :, 2, 3], block[:, 1 + 2 * 4 + 3])  # row 2, column 3
    for got, block in zip(last_two, blocks[2:], strict=True):
        torch.testing.assert_close(got, block[:, 1:])
    patches, prefix = with_cls[0]
    torch.testing.assert_close(prefix, model.norm(blocks[0])[:, :1])
    assert len(with_cls) == 4 and patches.shape == (3, 64, 4, 4)
    torch.testing.assert_close(model.forward_head(features, pre_logits=True), features[:, 0])
    torch.testing.assert_close(model.get_classifier()(features[:, 0]), logits)
    with pytest.raises(ValueError, match="do not name blocks"):
        model.forward_intermediates(images, indices=[7])

    model.reset_classifier(3)
    assert model(images).shape == (3, 3) and model.pretrained_cfg["num_classes"] == 3
    model.reset_classifier(0)
    assert model(images).shape == (3, 64)
    assert model.no_weight_decay() <= set(model.state_dict())
    assert model.pretrained_cfg["input_size"] == (1, 8, 8) and model.pretrained_cfg["mean"] == (0.3,)
    cifar = create_model("vit_tiny_patch4_32").pretrained_cfg
    assert cifar["mean"] == (0.4914, 0.4822, 0.4465) and cifar["crop_pct"] == 1.0
    assert create_model("deit_tiny_patch16_224").pretrained_cfg["input_size"] == (3, 224, 224)
    # other channels drop the preset's mean and std, not its crop (it fell to 0.875: 32 → 37 → 32 in
    # timm's eval transform, a crop the model was never evaluated with)
    gray = create_model("vit_tiny_patch4_32", in_chans=1, depth=1).pretrained_cfg
    assert gray["crop_pct"] == 1.0 and gray["mean"] == (0.5,)
    assert create_model("vit_digits", in_chans=3, depth=1).pretrained_cfg["crop_pct"] == 1.0


def test_grad_checkpointing_gives_the_same_gradients_through_v0():
    torch.manual_seed(0)
    model = create_model("vit_digits", attention="neutreno", depth=4)
    images = torch.randn(4, 1, 8, 8)

    def grads(checkpointing: bool) -> dict:
        model.zero_grad()
        model.set_grad_checkpointing(checkpointing)
        model(images).square().sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    assert plain["blocks.0.attn.qkv.weight"].abs().sum() > 0
    for key in plain:  # blocks.0's value projection gets V⁰'s gradient from every later block
        torch.testing.assert_close(recomputed[key], plain[key], atol=1e-6, rtol=1e-5)


# ---- one graph for torch.compile (train.compile) ----


def graph_breaks(module, *inputs) -> list[str]:
    import torch._dynamo

    try:
        explained = torch._dynamo.explain(module)(*inputs)
    finally:
        torch._dynamo.reset()
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize(
    "attention", ["softmax", "neutreno", "sym_neutreno", "kernel_neutreno", "eigen_neg_neutreno"]
)
def test_vision_transformer_compiles_as_one_graph(attention):
    # a graph break would leave NeuTRENO's elementwise term unfused, the point of compiling long runs
    model = create_model("vit_digits", attention=attention).train()
    assert graph_breaks(model, torch.randn(2, 1, 8, 8)) == []


def test_segmenter_and_the_language_models_body_compile_as_one_graph():
    segmenter = create_model("segmenter_tiny", attention="neutreno").train()
    assert graph_breaks(segmenter, torch.randn(1, 3, 64, 64)) == []
    # (the adaptive softmax head picks each cluster's targets by value: a break there is inherent)
    lm = create_model("lm_wt103_mini", attention="neutreno").train()
    assert graph_breaks(lm.forward_features, torch.randint(0, 100, (2, 16))) == []


def test_segmenters_and_language_models_refuse_weights_of_another_function(tmp_path):
    """Only a classifier's load_pretrained compared the saved model: a Segmenter's backbone (and its
    fine-tuning), a language model's fine-tuning took a kernel or another head count's weights of the
    same shapes (max |Δ log-prob| 57 for the LM) and a NaN backbone, which then blamed the learning rate."""
    from neutreno.models import save_model
    from neutreno.models.checkpoint import refuse_another_model

    lm = dict(vocab_size=300, cutoffs=(50, 150), depth=2, embed_dim=32, context_length=16)
    segmenter = dict(num_classes=5, img_size=64)
    cases = [
        ("lm_wt103_mini", dict(attention="kernel", **lm), lm, "kernel attention"),
        ("lm_wt103_mini", dict(num_heads=8, **lm), dict(num_heads=4, **lm), "trained with 8 attention heads"),
        ("segmenter_tiny", dict(attention="kernel", **segmenter), segmenter, "kernel attention"),
    ]
    for name, theirs, ours, message in cases:
        path = tmp_path / f"{name}.safetensors"
        save_model(path, create_model(name, **theirs))
        with pytest.raises(ValueError, match=message):
            refuse_another_model(create_model(name, **ours), path)
    softmax = tmp_path / "softmax_lm.safetensors"
    save_model(softmax, create_model("lm_wt103_mini", **lm))
    refuse_another_model(create_model("lm_wt103_mini", attention="neutreno", **lm), softmax)  # one function
    backbone = tmp_path / "kernel_vit.safetensors"
    save_model(backbone, create_model("deit_tiny_patch16_224", attention="kernel", depth=2, img_size=64))
    model = create_model("segmenter_tiny", depth=2, **segmenter)
    with pytest.raises(ValueError, match="kernel attention"):
        refuse_another_model(model.encoder, backbone)
    state = create_model("deit_tiny_patch16_224", depth=2, img_size=64).state_dict()
    state["blocks.1.attn.qkv.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite weights \(blocks.1.attn.qkv.weight\)"):
        model.load_backbone(state)
    with pytest.raises(ValueError, match=r"^deit\.safetensors holds non-finite weights"):  # the file named
        model.load_backbone(state, "deit.safetensors")


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # dynamo
def test_a_compiled_model_saves_as_the_model_it_wraps(tmp_path):
    """save_model(path, torch.compile(model)) wrote "_orig_mod."-prefixed keys that load_model refused."""
    from neutreno.models import load_model, save_model

    model = create_model("vit_digits", depth=1)
    save_model(tmp_path / "m.safetensors", torch.compile(model))
    loaded, _ = load_model(tmp_path / "m.safetensors")
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("vit_digits", {"mlp_ratio": "4"}, "mlp_ratio must be a number > 0, got '4'"),  # torch's traceback
        ("vit_digits", {"mlp_ratio": float("nan")}, "mlp_ratio must be a number > 0, got nan"),
        ("segmenter_tiny", {"mlp_ratio": "4", "num_classes": 3}, "mlp_ratio must be a number > 0"),
        ("lm_wt103_mini", {"context_length": "128"}, "context_length must be an integer >= 1, got '128'"),
        ("lm_wt103_mini", {"vocab_size": 300.0}, "vocab_size must be an integer >= 1, got 300.0"),
        ("lm_wt103_mini", {"embed_dim": 0}, "embed_dim must be an integer >= 1, got 0"),  # ZeroDivisionError
        ("lm_wt103_mini", {"cutoffs": "abc"}, "cutoffs must be a list of integers, got 'abc'"),
        ("lm_wt103_mini", {"div_value": 0}, "div_value must be a number > 0, got 0"),
        ("lm_wt103_mini", {"spectral_layers": "abc"}, "spectral_layers must be an integer, got 'abc'"),
    ],
)
def test_wrongly_typed_model_arguments_are_named(name, args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        create_model(name, **args)


def test_a_segmenter_records_the_lambda_its_layers_run(tmp_path):
    """save_model took a ViT's λ from its layers but a Segmenter's from its creation arguments: a λ set on
    the layers afterwards was lost, and the reloaded Segmenter computed another function."""
    from neutreno.models import load_model, save_model

    torch.manual_seed(0)
    model = create_model("segmenter_tiny", attention="neutreno", lam=0.6, num_classes=3, img_size=64, depth=2)
    for module in model.modules():
        if isinstance(getattr(module, "lam", None), float):
            module.lam = 0.2
    save_model(tmp_path / "s.safetensors", model.eval())
    loaded, meta = load_model(tmp_path / "s.safetensors")
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert meta["lam"] == 0.2 and torch.equal(loaded.eval()(images), model(images))


def test_a_deit3_checkpoint_is_refused_naming_its_layer_scale_keys(tmp_path):
    """DeiT-III (LayerScale, no CLS position in pos_embed) was refused as 'pos_embed has 195 patch
    positions, not a square grid', which reads like a damaged file."""
    from neutreno.models import load_pretrained

    state = create_model("vit_digits", depth=1).state_dict()
    state["pos_embed"] = state["pos_embed"][:, 1:]  # timm's no_embed_class layout
    state["blocks.0.ls1.gamma"] = torch.ones(state["cls_token"].shape[-1])
    torch.save(state, tmp_path / "deit3.pth")
    with pytest.raises(ValueError, match=r"unexpected \['blocks.0.ls1.gamma'\].*pos_embed"):
        load_pretrained(create_model("vit_digits", depth=1), tmp_path / "deit3.pth")


def test_timm_names_a_user_reaches_for(tmp_path):
    """Found missing by a review as a timm user: group_matcher (without it timm's layer-wise lr decay put
    a block's attention and norms one layer below its MLP: half the learning rate at decay 0.5, silently),
    checkpoint_path=, a tagged name, list_models(pretrained=True), default_cfg, head_hidden_size,
    global_pool; and torch.jit.script failing deep in TorchScript's parser."""
    import re
    import warnings

    from neutreno import list_models
    from neutreno.models import save_model

    model = create_model("vit_digits", attention="neutreno", depth=3)
    matcher = model.group_matcher()

    def layer_of(name: str) -> int:  # timm's rule: the stem is layer 0, block i is i + 1, the norm last
        if re.match(matcher["stem"], name):
            return 0
        for pattern, fixed in matcher["blocks"]:
            found = re.match(pattern, name)
            if found:
                return fixed[0] if fixed else int(found.group(1)) + 1
        return 10**6  # the head

    layers = {name: layer_of(name) for name, _ in model.named_parameters()}
    for i in range(3):
        assert {layer for name, layer in layers.items() if name.startswith(f"blocks.{i}.")} == {i + 1}
    assert layers["cls_token"] == layers["pos_embed"] == layers["patch_embed.proj.weight"] == 0
    assert layers["blocks.2.mlp.fc2.bias"] < layers["norm.weight"] < layers["head.weight"]

    save_model(tmp_path / "model.safetensors", model)
    loaded = create_model(
        "vit_digits", attention="neutreno", depth=3, checkpoint_path=tmp_path / "model.safetensors"
    )
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert "checkpoint_path" not in loaded.model_spec["args"]
    with pytest.raises(ValueError, match=r"the tag \.fb_in1k names timm weights .* create_model\('deit_tiny"):
        create_model("deit_tiny_patch16_224.fb_in1k")
    assert list_models(pretrained=True) == [] and "vit_digits" in list_models(pretrained=False)
    assert model.default_cfg is model.pretrained_cfg and model.head_hidden_size == model.num_features == 64
    assert model.global_pool == "token"
    script = pytest.raises(TypeError, match=r"not scriptable by torch\.jit\.script: use torch\.compile")
    with script, warnings.catch_warnings():  # torch 2.13 deprecates torch.jit.script itself
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(model)


def test_deit_and_timm_training_checkpoints_and_compiled_state_dicts_load(tmp_path):
    """DeiT's checkpoint.pth and timm's model_best.pth.tar keep their command line (an
    argparse.Namespace) beside the weights: weights_only refused them with PyTorch's advice to allow
    the class, which a --finetune user cannot do (timm's own loader allows it). A compiled model's
    ``_orig_mod.`` keys listed every key as missing; a JAX .npz gave torch's internal assertion."""
    import argparse

    import numpy as np

    from neutreno import load_pretrained
    from neutreno.models.checkpoint import read_state_dict

    state = timm_deit_tiny_state(3)
    args = argparse.Namespace(lr=5e-4, model="deit_tiny_patch16_224")
    ema = {k: torch.zeros_like(v) for k, v in state.items()}
    torch.save({"model": state, "model_ema": ema, "epoch": 299, "args": args}, tmp_path / "checkpoint.pth")
    compiled = {f"module._orig_mod.{k}": v for k, v in state.items()}  # DDP around a compiled model
    torch.save({"state_dict": compiled, "arch": "deit_tiny", "args": args}, tmp_path / "model_best.pth.tar")
    for name in ("checkpoint.pth", "model_best.pth.tar"):
        model = create_model("deit_tiny_patch16_224")
        load_pretrained(model, tmp_path / name)  # the model's own weights, not its EMA's (DeiT's --finetune)
        assert torch.equal(model.blocks[5].attn.qkv.weight, state["blocks.5.attn.qkv.weight"]), name
    np.savez(tmp_path / "augreg.npz", **{"Transformer/encoder_norm/scale": np.ones(3)})
    with pytest.raises(ValueError, match=r"augreg\.npz is a JAX/NumPy \.npz checkpoint"):
        read_state_dict(tmp_path / "augreg.npz")

    class Payload:  # the Namespace allowed, nothing else: code in a pickle is still never run
        def __reduce__(self):
            return (print, ("unpickled!",))

    torch.save({"model": state, "args": args, "x": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(ValueError, match=r"cannot read .*evil\.pth"):
        read_state_dict(tmp_path / "evil.pth")


def test_rgb_weights_into_a_one_channel_vit_are_summed_over_the_colours(tmp_path):
    """timm's adapt_input_conv: a one-channel model fine-tuned from RGB weights sums the patch weights
    over the colours; here that was a wrong-shape error. On a gray image it computes what the RGB model
    computes on the same image in three equal channels."""
    from neutreno import load_pretrained

    state = {k: v.double() for k, v in timm_deit_tiny_state(4).items()}
    torch.save(state, tmp_path / "deit.pth")
    # in float64 throughout: a float32 sum of the weights is rounded, and 12 random layers amplify it
    gray, rgb = (
        create_model("deit_tiny_patch16_224", img_size=32, in_chans=c).double().eval() for c in (1, 3)
    )
    for model in (gray, rgb):
        assert load_pretrained(model, tmp_path / "deit.pth") == []
    images = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(gray(images), rgb(images.expand(-1, 3, -1, -1)))
    # two channels or another patch size: no rule, refused saying what loads (a bare shape list before)
    for args in ({"in_chans": 2}, {"patch_size": 8}):
        with pytest.raises(
            ValueError, match=r"load into the same patch size \(16\) and 3 input channels, or 1"
        ):
            load_pretrained(create_model("deit_tiny_patch16_224", img_size=32, **args), tmp_path / "deit.pth")


def test_a_loaded_models_pretrained_cfg_is_the_preprocessing_its_file_records(tmp_path):
    """load_model left the registry preset's pretrained_cfg (vit_tiny_patch4_32: CIFAR-10's mean and
    std) on a model trained with ImageNet's, and timm's resolve_data_config reads it for its transforms."""
    from neutreno.models import load_model, save_model

    model = create_model("vit_tiny_patch4_32", num_classes=2, depth=1)
    assert model.pretrained_cfg["mean"] == (0.4914, 0.4822, 0.4465)
    recorded = {"image_size": 32, "crop_pct": 0.9, "channels": 3, "mean": [0.485, 0.456, 0.406],
                "std": [0.229, 0.224, 0.225]}  # fmt: skip
    save_model(tmp_path / "m.safetensors", model, extra={"preprocess": recorded, "classes": ["a", "b"]})
    loaded, _ = load_model(tmp_path / "m.safetensors")
    cfg = loaded.pretrained_cfg
    assert cfg["mean"] == (0.485, 0.456, 0.406) and cfg["std"] == (0.229, 0.224, 0.225)
    assert cfg["crop_pct"] == 0.9 and cfg["input_size"] == (3, 32, 32) and cfg["num_classes"] == 2
    save_model(tmp_path / "plain.safetensors", model)  # no record: the preset's, as before
    assert load_model(tmp_path / "plain.safetensors")[0].pretrained_cfg["mean"] == (0.4914, 0.4822, 0.4465)


def test_a_file_records_the_lam_its_term_adding_layers_run_or_refuses_what_one_lam_cannot_say(tmp_path):
    """Found in review: save_model recorded the first block's λ, the one layer whose term is zero, so a λ
    set on the other layers, or a λ schedule's factor, was dropped: the file reloaded another model."""
    from neutreno.layers import set_lam_scale
    from neutreno.models.checkpoint import load_model, save_model

    x = torch.randn(2, 1, 8, 8)
    model = create_model("vit_digits", attention="neutreno", lam=0.6, depth=3).eval()
    for block in model.blocks[1:]:
        block.attn.lam = 0.2  # every layer that adds the term: the model's λ is 0.2
    save_model(tmp_path / "a.safetensors", model)
    loaded, meta = load_model(tmp_path / "a.safetensors")
    assert meta["lam"] == 0.2
    torch.testing.assert_close(loaded.eval()(x), model(x), rtol=0, atol=0)

    model.blocks[2].attn.lam = 0.4
    with pytest.raises(
        ValueError, match=r"λ differs between the layers that add NeuTRENO's term \(\[0\.2, 0\.4\]\)"
    ):
        save_model(tmp_path / "b.safetensors", model)
    model.blocks[2].attn.lam = 0.2
    set_lam_scale(model, 0.5)
    with pytest.raises(ValueError, match=r"runs λ × 0\.5 \(a λ schedule's factor, lam_scale\)"):
        save_model(tmp_path / "c.safetensors", model)
    assert not (tmp_path / "b.safetensors").exists() and not (tmp_path / "c.safetensors").exists()
    save_model(tmp_path / "c.safetensors", model, full_lam=True)  # a training checkpoint's: at full λ
    assert load_model(tmp_path / "c.safetensors")[1]["lam"] == 0.2
    softmax = create_model("vit_digits", depth=2)
    set_lam_scale(softmax, 0.5)  # no term to scale: nothing to refuse
    save_model(tmp_path / "d.safetensors", softmax)


def test_a_model_name_that_is_no_string_and_unbatched_inputs_are_named():
    """Found in review: create_model(None) was "'NoneType' object has no attribute 'partition'", one
    (C, H, W) image "Sizes of tensors must match", and (T,) token ids "tuple index out of range"."""
    with pytest.raises(TypeError, match="create_model takes a model name"):
        create_model(None)
    vit = create_model("vit_digits", depth=1).eval()
    with pytest.raises(ValueError, match=r"expected images \(B, C, H, W\), got shape \(1, 8, 8\)"):
        vit(torch.randn(1, 8, 8))
    lm = create_model("lm_wt103_mini", depth=1, vocab_size=50, adaptive_softmax=False, context_length=16)
    with pytest.raises(ValueError, match=r"expected token ids \(B, T\), got shape \(6,\)"):
        lm(torch.randint(0, 50, (6,)))

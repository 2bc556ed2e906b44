"""Token cosine similarity (math.md §3) and per-layer collection."""

import math

import pytest
import torch

from neutreno import create_model
from neutreno.diagnostics import capture_hidden_states, cosine_by_layer, token_cosine_similarity

from reference import cosine_loop


def test_matches_pairwise_loop_with_and_without_mask():
    x = torch.randn(3, 9, 5, generator=torch.Generator().manual_seed(0)) + 0.5
    x[1, 2] = 0  # a zero token: cosine 0 with everything
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[2, :3] = False
    torch.testing.assert_close(
        token_cosine_similarity(x, reduction="none").double(), cosine_loop(x), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        token_cosine_similarity(x, mask, reduction="none").double(), cosine_loop(x, mask), atol=1e-6, rtol=0
    )
    assert math.isclose(
        token_cosine_similarity(x, mask).item(), cosine_loop(x, mask).mean().item(), abs_tol=1e-6
    )


def test_invariants():
    same = torch.randn(1, 1, 8).expand(2, 6, 8)
    assert math.isclose(token_cosine_similarity(same).item(), 1.0, abs_tol=1e-6)
    assert math.isclose(token_cosine_similarity(torch.eye(6)[None]).item(), 0.0, abs_tol=1e-7)
    x = torch.randn(1, 6, 4)
    padded = torch.cat([x, 100 * torch.randn(1, 3, 4)], dim=1)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    assert math.isclose(
        token_cosine_similarity(padded, mask).item(), token_cosine_similarity(x).item(), abs_tol=1e-6
    )
    with pytest.raises(ValueError, match="at least two"):
        token_cosine_similarity(torch.randn(2, 1, 4))


def test_capture_hidden_states_is_embeddings_then_every_block():
    model = create_model("vit_digits").eval()
    x = torch.rand(2, 1, 8, 8)
    with torch.no_grad(), capture_hidden_states(model.blocks) as hidden:
        features = model.forward_features(x)
        torch.testing.assert_close(hidden[0], model.embed(x))
    assert len(hidden) == len(model.blocks) + 1
    torch.testing.assert_close(model.norm(hidden[-1]), features)
    assert not model.blocks[0]._forward_pre_hooks and not model.blocks[-1]._forward_hooks  # removed


def test_cosine_by_layer_averages_over_samples_across_batches():
    model = create_model("vit_digits").eval()
    images = torch.rand(5, 1, 8, 8)
    per_layer = cosine_by_layer(model, images, batch_size=2)
    with torch.no_grad(), capture_hidden_states(model.blocks) as hidden:
        model(images)
    expected = [cosine_loop(h).mean().item() for h in hidden]
    assert per_layer == pytest.approx(expected, abs=1e-5)


def test_per_sample_effective_ranks_are_each_layers_own():
    """per_sample_layers takes effective rank for all layers at once (one batch of eigenvalue solves):
    each sample's value per layer is the formula's on that layer's tokens (σ from an SVD in float64),
    and their means are run_analysis's."""
    from neutreno.diagnostics.analysis import ModelVariant, per_sample_layers, run_analysis

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_32", attention="neutreno", embed_dim=48, num_heads=3).eval()
    variant = ModelVariant("tiny", "neutreno", model)
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    batches = list(images.split(4))  # two batches of unequal size
    per_sample = per_sample_layers(variant, batches, "effective_rank")
    means = run_analysis(variant, batches, ["effective_rank"])["effective_rank"]
    with torch.no_grad(), capture_hidden_states(model.blocks) as hidden:
        model(images)
    assert sorted(per_sample) == list(range(len(hidden))) == sorted(means)
    for layer, tokens in enumerate(hidden):
        sigma = torch.linalg.svdvals(tokens.double())
        p = sigma / sigma.sum(-1, keepdim=True)
        expected = torch.exp(-(p * p.log()).nan_to_num().sum(-1))
        torch.testing.assert_close(per_sample[layer].double(), expected, rtol=1e-5, atol=0)
        assert means[layer] == pytest.approx(per_sample[layer].double().mean().item(), rel=1e-6)

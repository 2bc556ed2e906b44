"""Batch augmentation (BatchAugment, RandAugment, random erasing), Mixup/CutMix and the soft-target loss,
each checked against an explicit computation (loops, numpy, PIL)."""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from neutreno.data import augment
from neutreno.data.augment import CIFAR_MEAN, CIFAR_STD, BatchAugment, MixupCutmix, RandAugment, normalize
from neutreno.training.losses import smooth_one_hot, soft_target_cross_entropy


def _uint8_images(b=6, c=3, h=16, w=16, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (b, c, h, w), dtype=np.uint8))


def _smooth_row(label, k, s):
    return [1 - s + s / k if j == label else s / k for j in range(k)]


# ---- losses -------------------------------------------------------------------------------------


def test_smooth_one_hot_matches_loops():
    labels = torch.tensor([0, 3, 4, 3])
    out = smooth_one_hot(labels, 5, 0.2)
    assert out.dtype == torch.float32 and out.shape == (4, 5)
    expected = [_smooth_row(int(y), 5, 0.2) for y in labels]
    np.testing.assert_allclose(out.numpy(), np.array(expected), rtol=0, atol=1e-7)


def test_soft_target_cross_entropy_matches_loops_and_label_smoothing():
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 7), torch.rand(5, 7)
    targets = targets / targets.sum(1, keepdim=True)
    expected = 0.0
    for b in range(5):
        log_z = math.log(sum(math.exp(v) for v in logits[b].tolist()))
        expected += -sum(targets[b, k].item() * (logits[b, k].item() - log_z) for k in range(7)) / 5
    assert soft_target_cross_entropy(logits, targets).item() == pytest.approx(expected, rel=1e-5)

    labels = torch.tensor([0, 6, 2, 2, 5])
    loss = soft_target_cross_entropy(logits, smooth_one_hot(labels, 7, 0.1))
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, label_smoothing=0.1))


# ---- Mixup / CutMix -----------------------------------------------------------------------------


def test_mixup_matches_explicit_formula():
    images, labels = torch.rand(4, 2, 3, 5), torch.tensor([1, 0, 2, 2])
    mix = MixupCutmix(num_classes=3, mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.0, label_smoothing=0.1)
    torch.manual_seed(7)
    out, targets = mix(images, labels)
    torch.manual_seed(7)  # the same draws, in timm's order: mix? (prob 1), CutMix? (switch_prob 0), λ
    torch.rand(())
    torch.rand(())
    lam = torch.distributions.Beta(torch.tensor(0.8), torch.tensor(0.8)).sample().item()
    assert 0 < lam < 1
    x = images.numpy()
    for b in range(4):
        partner = 3 - b
        for idx in np.ndindex(*x.shape[1:]):
            assert out[b][idx].item() == pytest.approx(
                lam * x[b][idx] + (1 - lam) * x[partner][idx], abs=1e-6
            )
        own, other = _smooth_row(int(labels[b]), 3, 0.1), _smooth_row(int(labels[partner]), 3, 0.1)
        row = [lam * p + (1 - lam) * q for p, q in zip(own, other, strict=True)]
        np.testing.assert_allclose(targets[b].numpy(), row, atol=1e-6)
    np.testing.assert_allclose(targets.sum(1).numpy(), 1.0, atol=1e-6)


@pytest.mark.parametrize(
    ("lam", "centre", "box"),
    [
        (0.75, (6, 10), (3, 9, 5, 15)),  # cut 6×10 → half-sides 3 and 5, inside the 12×20 image
        (0.5, (1, 18), (0, 5, 11, 20)),  # cut 8×14 → half-sides 4 and 7, clipped at the top and right
        (0.5, (11, 1), (7, 12, 0, 8)),  # the same box clipped at the bottom and left
    ],
)
def test_cutmix_box_comes_from_flipped_batch(lam, centre, box):
    b, c, h, w, k, s = 4, 2, 12, 20, 5, 0.1
    images, labels = torch.rand(b, c, h, w), torch.tensor([0, 1, 2, 3])
    mix = MixupCutmix(num_classes=k, label_smoothing=s)
    mix._sample_lam = lambda: (lam, True)
    mix._sample_centre = lambda height, width: centre
    out, targets = mix(images, labels)
    y0, y1, x0, x1 = box
    for i in range(b):
        for ch in range(c):
            for r in range(h):
                for col in range(w):
                    source = b - 1 - i if (y0 <= r < y1 and x0 <= col < x1) else i
                    assert out[i, ch, r, col].item() == images[source, ch, r, col].item()
    kept = 1 - (y1 - y0) * (x1 - x0) / (h * w)
    for i in range(b):
        own, other = _smooth_row(i, k, s), _smooth_row(b - 1 - i, k, s)
        row = [kept * p + (1 - kept) * q for p, q in zip(own, other, strict=True)]
        np.testing.assert_allclose(targets[i].numpy(), row, atol=1e-6)
    # λ read back from the targets equals the share of pixels left unchanged
    changed = (out != images).any(1).float().mean(dim=(1, 2))
    lam_from_targets = (targets[0, 0] - s / k) / (1 - s)
    assert lam_from_targets.item() == pytest.approx(1 - changed[0].item(), abs=1e-6)


@pytest.mark.parametrize("kwargs", [{"prob": 0.0}, {"mixup_alpha": 0.0, "cutmix_alpha": 0.0}])
def test_no_mixing_gives_label_smoothing_only(kwargs):
    images, labels = torch.rand(4, 3, 8, 8), torch.tensor([3, 1, 1, 0])
    torch.manual_seed(0)
    out, targets = MixupCutmix(num_classes=4, label_smoothing=0.2, **kwargs)(images, labels)
    assert torch.equal(out, images)
    np.testing.assert_allclose(targets.numpy(), [_smooth_row(int(y), 4, 0.2) for y in labels], atol=1e-7)


def test_mix_choice_frequencies():
    torch.manual_seed(0)
    mix = MixupCutmix(num_classes=2, prob=0.6, switch_prob=0.25)
    draws = [mix._sample_lam() for _ in range(4000)]
    mixed = [(lam, cut) for lam, cut in draws if lam < 1]
    assert len(mixed) / 4000 == pytest.approx(0.6, abs=0.03)
    assert sum(cut for _, cut in mixed) / len(mixed) == pytest.approx(0.25, abs=0.03)
    assert np.mean([lam for lam, _ in mixed]) == pytest.approx(0.5, abs=0.03)  # Beta(α, α) has mean 1/2


# ---- BatchAugment -------------------------------------------------------------------------------


def _explicit_normalize(x, mean, std):
    out = np.empty(x.shape, dtype=np.float32)
    for ch in range(x.shape[1]):
        out[:, ch] = (x[:, ch].astype(np.float32) / np.float32(255) - np.float32(mean[ch])) / np.float32(
            std[ch]
        )
    return out


def _plain(size, mean, std, **kwargs):
    return BatchAugment(size=size, mean=mean, std=std, hflip=0.0, **kwargs)


@pytest.mark.parametrize(("mean", "std"), [(CIFAR_MEAN, CIFAR_STD), ((0.5,), (0.25,))])
def test_without_augmentation_output_is_exact_normalisation(mean, std):
    x = _uint8_images(c=len(mean))
    out = _plain(16, mean, std)(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    np.testing.assert_allclose(out.numpy(), _explicit_normalize(x.numpy(), mean, std), rtol=0, atol=1e-6)
    np.testing.assert_allclose(normalize(x, mean, std).numpy(), out.numpy(), rtol=0, atol=0)


def test_output_size_and_wrong_inputs():
    x = _uint8_images(h=20, w=20)
    assert _plain(12, CIFAR_MEAN, CIFAR_STD)(x).shape == (6, 3, 12, 12)
    assert BatchAugment(size=12, mean=CIFAR_MEAN, std=CIFAR_STD)(x).shape == (6, 3, 12, 12)
    with pytest.raises(TypeError):
        _plain(20, CIFAR_MEAN, CIFAR_STD)(x.float())
    with pytest.raises(ValueError):
        _plain(20, CIFAR_MEAN, CIFAR_STD)(x[:, :1])


def test_hflip_one_flips_every_image():
    x = _uint8_images()
    out = BatchAugment(size=16, mean=CIFAR_MEAN, std=CIFAR_STD, hflip=1.0)(x)
    expected = _explicit_normalize(x.numpy(), CIFAR_MEAN, CIFAR_STD)[..., ::-1]
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-6)


def test_hflip_half_flips_about_half():
    x = _uint8_images(b=400, h=6, w=6)
    torch.manual_seed(0)
    out = BatchAugment(size=6, mean=CIFAR_MEAN, std=CIFAR_STD, hflip=0.5)(x)
    clean = torch.from_numpy(_explicit_normalize(x.numpy(), CIFAR_MEAN, CIFAR_STD))
    same = (out - clean).abs().amax((1, 2, 3)) < 1e-6
    flipped = (out - clean.flip(-1)).abs().amax((1, 2, 3)) < 1e-6
    assert (same ^ flipped).all()  # each image is either kept or flipped
    assert flipped.float().mean().item() == pytest.approx(0.5, abs=0.075)


def _full(channels=3):
    mean, std = (CIFAR_MEAN, CIFAR_STD) if channels == 3 else ((0.5,), (0.25,))
    return BatchAugment(
        size=16,
        mean=mean,
        std=std,
        randaugment_n=2,
        randaugment_m=9,
        randaugment_mstd=0.5,
        random_erasing=0.25,
    )


def test_same_torch_seed_same_output_whatever_numpy_and_python_random_do():
    x, aug = _uint8_images(b=16), _full()
    torch.manual_seed(3)
    random.seed(1)
    np.random.seed(1)
    first = aug(x)
    torch.manual_seed(3)
    random.seed(2)
    np.random.seed(2)
    assert torch.equal(aug(x), first)
    torch.manual_seed(4)
    assert not torch.equal(aug(x), first)


def test_augmentation_under_a_bf16_autocast_is_the_float32_one():
    """The trainer runs the task's training_loss, augmentation included, under train.precision's autocast:
    a rotation's sampling grid (a batched matrix product) and sharpness's convolution came out in bf16,
    positions up to 0.75 px off at 224², pixels up to 85 levels off. Augmentation is data preparation,
    in float32 whatever the caller's autocast (timm's runs in PIL, in the loader workers)."""
    x, aug = _uint8_images(b=32, h=32, w=32), _full()
    ra = RandAugment(n=3, m=9.0)
    torch.manual_seed(5)
    expected = aug(x), ra(x.float() / 255)
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = aug(x), ra(x.float() / 255)
    assert all(g.dtype == torch.float32 and torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_restoring_rng_state_replays_exactly():
    x, aug = _uint8_images(b=16), _full()
    torch.manual_seed(0)
    aug(x)  # some batches in
    state = torch.get_rng_state()
    run = [aug(x) for _ in range(3)]
    torch.set_rng_state(state)  # a resumed run
    for expected in run:
        assert torch.equal(aug(x), expected)


def test_one_channel_images():
    x = _uint8_images(b=8, c=1)
    torch.manual_seed(0)
    out = _full(channels=1)(x)
    assert out.shape == (8, 1, 16, 16) and out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.manual_seed(0)
    ra = RandAugment(n=3, m=9, fill=(0.5,))(x.float() / 255)
    assert ra.shape == (8, 1, 16, 16) and ra.min() >= 0 and ra.max() <= 1


def test_random_erasing_replaces_one_box_per_image_with_noise():
    b, h, w = 32, 32, 32
    x = _uint8_images(b=b, h=h, w=w)
    torch.manual_seed(0)
    out = _plain(32, CIFAR_MEAN, CIFAR_STD, random_erasing=1.0)(x).numpy()
    clean = _explicit_normalize(x.numpy(), CIFAR_MEAN, CIFAR_STD)
    noise = []
    for i in range(b):
        changed = np.abs(out[i] - clean[i]).max(0) > 1e-6  # (H, W)
        rows = [r for r in range(h) if changed[r].any()]
        cols = [c for c in range(w) if changed[:, c].any()]
        assert rows and cols, f"image {i} was not erased"
        top, bottom, left, right = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
        for r in range(h):
            for c in range(w):
                inside = top <= r < bottom and left <= c < right
                assert changed[r, c] == inside  # exactly one box, the rest untouched
                if inside:
                    noise.extend(out[i, :, r, c])
        box_h, box_w = bottom - top, right - left
        assert 0.01 * h * w <= box_h * box_w <= 0.4 * h * w  # 0.02-1/3 of the area, after rounding
        assert box_h < h and box_w < w and 0.2 <= box_h / box_w <= 5
    assert np.mean(noise) == pytest.approx(0.0, abs=0.05)  # N(0, 1) noise in normalised space
    assert np.std(noise) == pytest.approx(1.0, abs=0.05)


# ---- RandAugment --------------------------------------------------------------------------------


def _pil_reference(op, image, level, sign, fill):
    """timm's PIL implementation of each op ("inc1" variants) at magnitude 10·level."""
    factor = max(0.1, 1 + sign * 0.9 * level)
    return {
        "auto_contrast": lambda: ImageOps.autocontrast(image),
        "equalize": lambda: ImageOps.equalize(image),
        "invert": lambda: ImageOps.invert(image),
        "posterize": lambda: ImageOps.posterize(image, 4 - int(level * 4)),
        "solarize": lambda: ImageOps.solarize(image, 256 - int(level * 256)),
        "solarize_add": lambda: image.point(
            [min(255, i + int(level * 110)) if i < 128 else i for i in range(256)] * len(image.getbands())
        ),
        "color": lambda: ImageEnhance.Color(image).enhance(factor),
        "contrast": lambda: ImageEnhance.Contrast(image).enhance(factor),
        "brightness": lambda: ImageEnhance.Brightness(image).enhance(factor),
        "sharpness": lambda: ImageEnhance.Sharpness(image).enhance(factor),
        "rotate": lambda: image.rotate(30 * level * sign, resample=Image.BICUBIC, fillcolor=fill),
        "shear_x": lambda: _pil_affine(image, fill, (1, 0.3 * level * sign, 0, 0, 1, 0)),
        "shear_y": lambda: _pil_affine(image, fill, (1, 0, 0, 0.3 * level * sign, 1, 0)),
        "translate_x": lambda: _pil_affine(image, fill, (1, 0, 0.45 * level * sign * image.size[0], 0, 1, 0)),
        "translate_y": lambda: _pil_affine(image, fill, (1, 0, 0, 0, 1, 0.45 * level * sign * image.size[1])),
    }[op]()


def _pil_affine(image, fill, coefficients):
    return image.transform(image.size, Image.AFFINE, coefficients, resample=Image.BICUBIC, fillcolor=fill)


@pytest.mark.parametrize("op", augment.RANDAUGMENT_OPS)
@pytest.mark.parametrize(("level", "sign"), [(0.7, 1.0), (0.45, -1.0)])
@pytest.mark.parametrize("channels", [3, 1])
def test_randaugment_ops_match_timm_pil(op, level, sign, channels):
    array = np.random.default_rng(1).integers(0, 256, (24, 24, channels), dtype=np.uint8)
    array[:, :4] = array[:, :4] // 2  # uneven histograms for the lookup-table ops
    fill = (128, 60, 200)[:channels]
    image = Image.fromarray(array if channels == 3 else array[..., 0])
    expected = np.asarray(
        _pil_reference(op, image, level, sign, fill if channels == 3 else fill[0]), np.float32
    )
    expected = expected.reshape(24, 24, channels) / 255
    x = torch.from_numpy(array).permute(2, 0, 1)[None].float() / 255
    lvl, sgn = torch.tensor([level]), torch.tensor([sign])
    if op in augment._PIXEL_OPS:
        out = augment._PIXEL_OPS[op](x, lvl, sgn)[0].permute(1, 2, 0).numpy()
        np.testing.assert_allclose(out, expected, rtol=0, atol=1.5 / 255)  # PIL rounds to 8 bits
    else:
        fill_t = torch.tensor(fill)[:, None, None] / 255
        out = augment.geometric_op(x, op, lvl, sgn, fill_t)[0].permute(1, 2, 0).numpy()
        # Where each output pixel's 4×4 source neighbourhood lies inside the image (PIL blends otherwise
        # along the fill's edge): on this noise, timm's bicubic (PIL's, a = −0.5) and torch's (a = −0.75)
        # differ by ~5 levels; the bilinear sampling used before was ~20 levels from timm's recipe.
        grid = F.affine_grid(augment._GEOMETRIC_OPS[op](lvl, sgn), list(x.shape), align_corners=False)[0]
        source = (grid + 1) * 24 / 2 - 0.5  # pixel coordinates (align_corners=False)
        inside = ((source >= 2) & (source <= 24 - 3)).all(-1).numpy()
        assert inside.sum() > 100
        assert np.abs(out - expected).max(-1)[inside].mean() < 10 / 255


def test_randaugment_draws_ops_and_magnitudes_like_timm(monkeypatch):
    calls = []

    def spy(name, geometric):
        def record(*args):
            level = args[0] if geometric else args[1]
            calls.append((name, *level.tolist()))
            return torch.eye(2, 3).expand(len(level), 2, 3) if geometric else args[0]

        return record

    for name in augment._PIXEL_OPS:
        monkeypatch.setitem(augment._PIXEL_OPS, name, spy(name, False))
    for name in augment._GEOMETRIC_OPS:
        monkeypatch.setitem(augment._GEOMETRIC_OPS, name, spy(name, True))
    torch.manual_seed(0)
    b, n = 3000, 2
    RandAugment(n=n, m=9, mstd=0.5)(torch.rand(b, 1, 4, 4))
    names = [c[0] for c in calls]
    levels = np.array([v for c in calls for v in c[1:]])
    assert len(levels) / (b * n) == pytest.approx(0.5, abs=0.02)  # each op applied with probability 1/2
    for name in augment.RANDAUGMENT_OPS:  # chosen uniformly among the 15
        share = sum(len(c) - 1 for c in calls if c[0] == name) / len(levels)
        assert share == pytest.approx(1 / 15, abs=0.02), name
    assert set(names) == set(augment.RANDAUGMENT_OPS)
    assert levels.max() <= 1.0 and levels.mean() == pytest.approx(0.9, abs=0.01)  # magnitude N(9, 0.5)/10
    assert levels.std() == pytest.approx(0.05, abs=0.006)  # (clipped at 10, a little under 0.05)


def test_a_mixing_alpha_where_torchs_beta_sampler_is_wrong_is_refused():
    """torch's Beta(α, α) draws for small α are far from the distribution (its gammas underflow): at
    α 0.002 6.5% of the batches were mixed with 0.05 < λ < 0.95, the exact Beta mixes 0.6%, so
    "almost no mixing" mixed heavily. Below MIN_MIX_ALPHA it is refused; at it, torch's draws match
    the exact probability (scipy's regularised incomplete beta) to sampling error."""
    special = pytest.importorskip("scipy.special")
    from neutreno.config import ConfigError, load_config
    from neutreno.data.augment import MIN_MIX_ALPHA, MixupCutmix
    from neutreno.training.classification import ClassificationConfig

    for alpha in (MIN_MIX_ALPHA, 0.1):
        torch.manual_seed(0)
        draws = torch.distributions.Beta(torch.tensor(alpha), torch.tensor(alpha)).sample((100_000,)).double()
        mixed = ((draws > 0.05) & (draws < 0.95)).double().mean().item()
        exact = special.betainc(alpha, alpha, 0.95) - special.betainc(alpha, alpha, 0.05)
        assert abs(mixed - exact) < 4 * (exact * (1 - exact) / 100_000) ** 0.5, (alpha, mixed, exact)
    with pytest.raises(ValueError, match=r"cutmix_alpha 0\.001 is below 0\.02, where torch's Beta sampler"):
        MixupCutmix(num_classes=10, cutmix_alpha=0.001)
    with pytest.raises(ConfigError, match=r"augment\.mixup_alpha: mixup_alpha 0.001 is below 0.02"):
        load_config(ClassificationConfig, None, ["augment.mixup_alpha=0.001"])
    MixupCutmix(num_classes=10, mixup_alpha=0.0, cutmix_alpha=MIN_MIX_ALPHA)  # off, and the smallest allowed

"""Segmentation data and metrics (issue 6, step 1): the CamVid/ADE20K reader on the real camvid-mini,
image/mask augmentation alignment on a real pair, and mIoU against an explicit per-class loop."""

import colorsys
import io
import math
import re
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from neutreno.data.segmentation import (
    augment_pair,
    open_segmentation_dataset,
    photometric_distortion,
    rescaled_size,
)
from neutreno.evaluation.segmentation import confusion_matrix, segmentation_scores

CAMVID = {"num_classes": 11, "ignore_index": 255, "void_label": 11}


def test_miou_matches_an_explicit_per_class_loop_with_ignored_pixels_and_absent_classes():
    torch.manual_seed(0)
    target = torch.randint(0, 5, (4, 30, 30))  # class 5 never appears in the labels ...
    pred = torch.randint(0, 5, (4, 30, 30))  # ... nor in the predictions: no IoU
    pred[0, :3] = 4
    target[1, :5] = 255  # ignored, whatever is predicted there
    pred[1, :5] = 3
    scores = segmentation_scores(confusion_matrix(pred, target, num_classes=6))
    ious, hits, total = [], 0, 0
    for c in range(6):
        intersection = union = 0
        for p, t in zip(pred.flatten().tolist(), target.flatten().tolist(), strict=True):
            if t == 255:
                continue
            intersection += p == c and t == c
            union += p == c or t == c
        ious.append(intersection / union if union else None)
    for p, t in zip(pred.flatten().tolist(), target.flatten().tolist(), strict=True):
        if t != 255:
            hits, total = hits + (p == t), total + 1
    present = [iou for iou in ious if iou is not None]
    assert scores["miou"] == pytest.approx(100 * sum(present) / len(present))
    assert scores["pixel_acc"] == pytest.approx(100 * hits / total)
    assert math.isnan(scores["iou"][5]) and scores["iou"][:5] == pytest.approx([100 * i for i in ious[:5]])
    with pytest.raises(ValueError, match="0…5"):
        confusion_matrix(torch.tensor([6]), torch.tensor([0]), num_classes=6)
    # every pixel ignored: no score at all (pixel accuracy read 0.0 beside a NaN mIoU)
    with pytest.raises(ValueError, match="every pixel is ignored"):
        segmentation_scores(confusion_matrix(pred, torch.full_like(target, 255), num_classes=6))


def test_confusion_matrices_of_parts_add_up_to_the_whole():
    """What makes the metric distributed-safe: summing per-process matrices equals one matrix."""
    pred, target = torch.randint(0, 4, (2, 50)), torch.randint(0, 4, (2, 50))
    whole = confusion_matrix(pred, target, 4)
    assert torch.equal(
        confusion_matrix(pred[0], target[0], 4) + confusion_matrix(pred[1], target[1], 4), whole
    )


def test_reader_on_camvid_mini(shared_data):
    archive = shared_data / "camvid-mini.tar.gz"
    sizes = {
        split: len(open_segmentation_dataset(archive, split, **CAMVID)) for split in ("train", "val", "test")
    }
    assert sizes == {"train": 367, "val": 101, "test": 233}
    dataset = open_segmentation_dataset(archive, "val", **CAMVID)
    image, labels = dataset[3]
    assert image.dtype == torch.uint8 and image.shape == (3, 180, 240) and labels.shape == (180, 240)
    name = dataset.items[3][0].split("/")[-1]
    with tarfile.open(archive) as tar:  # the raw mask, read here independently
        raw = np.array(Image.open(io.BytesIO(tar.extractfile(f"annotations/val/{name}.png").read())))
    expected = torch.from_numpy(np.where(raw == 11, 255, raw).astype(np.int64))
    assert torch.equal(labels, expected) and (raw == 11).any()


def test_bad_masks_are_errors_naming_the_file(shared_data, tmp_path):
    with tarfile.open(shared_data / "camvid-mini.tar.gz") as tar:
        image = tar.extractfile("images/val/0016E5_07959.jpg").read()
        mask = np.array(Image.open(io.BytesIO(tar.extractfile("annotations/val/0016E5_07959.png").read())))
    (tmp_path / "images" / "val").mkdir(parents=True)
    (tmp_path / "annotations" / "val").mkdir(parents=True)
    (tmp_path / "images" / "val" / "a.jpg").write_bytes(image)
    Image.fromarray(mask[:-4]).save(tmp_path / "annotations" / "val" / "a.png")
    dataset = open_segmentation_dataset(tmp_path, "val", **CAMVID)
    # the mask's own file is named (it was the image's path, without its suffix)
    with pytest.raises(ValueError, match=r"annotations/val/a\.png is 240×176 pixels, its image 240×180"):
        dataset[0]
    bad = mask.copy()
    bad[0, 0] = 12
    Image.fromarray(bad).save(tmp_path / "annotations" / "val" / "a.png")
    with pytest.raises(ValueError, match=r"annotations/val/a\.png has label 12, outside the 11 classes"):
        dataset[0]
    # ADE20K's convention on the same file: raw 0 is ignored, 1… shift down by one.
    ade = open_segmentation_dataset(tmp_path, "val", num_classes=12, label_offset=1)[0][1]
    assert ade[0, 0] == 11 and (ade[torch.from_numpy(bad == 0)] == 255).all()
    (tmp_path / "images" / "val" / "b.jpg").write_bytes(image)
    (tmp_path / "annotations" / "val" / "b.jpg").write_bytes(image)  # a mask as .jpg: not read, and said so
    with pytest.raises(
        FileNotFoundError, match=r"have no mask \(\.png\) in .*annotations/val, e\.g\. b: .*/b\.png$"
    ):
        open_segmentation_dataset(tmp_path, "val", **CAMVID)
    (tmp_path / "annotations" / "val" / "b.jpg").unlink()
    # a mask whose image is missing or of another kind (.tif) was left out: a smaller dataset, no word
    (tmp_path / "images" / "val" / "b.jpg").rename(tmp_path / "images" / "val" / "b.tif")
    Image.fromarray(mask).save(tmp_path / "annotations" / "val" / "b.png")
    with pytest.raises(
        FileNotFoundError, match=r"1 mask\(s\) in .*annotations/val have no image .*, e\.g\. b"
    ):
        open_segmentation_dataset(tmp_path, "val", **CAMVID)


@pytest.mark.parametrize("seed", range(6))
def test_augmentation_keeps_image_and_mask_aligned_on_a_real_pair(shared_data, seed):
    """Paint a real CamVid mask into the image (one colour per class) and augment both: away from
    class borders the augmented image still shows the augmented mask's colour."""
    _, labels = open_segmentation_dataset(shared_data / "camvid-mini.tar.gz", "val", **CAMVID)[seed]
    colours = torch.randint(0, 256, (256, 3), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    image = colours[labels].permute(2, 0, 1).contiguous()
    pixels, mask = augment_pair(
        image, labels, crop_size=160, photometric=False, generator=torch.Generator().manual_seed(seed)
    )
    assert pixels.shape == (3, 160, 160) and pixels.dtype == torch.uint8 and mask.shape == (160, 160)
    # Pixels whose 5×5 neighbourhood in the augmented mask is one real class.
    window = torch.nn.functional.unfold(mask[None, None].float(), 5, padding=2)[0]
    uniform = (window == window[12]).all(0).view(160, 160) & (mask != 255)
    assert uniform.float().mean() > 0.3
    matches = (pixels == colours[mask].permute(2, 0, 1)).all(0)
    assert matches[uniform].float().mean() > 0.99


def test_augmentation_pads_with_ignore_and_repeats_with_the_same_generator(shared_data):
    image, labels = open_segmentation_dataset(shared_data / "camvid-mini.tar.gz", "val", **CAMVID)[0]
    a = augment_pair(
        image, labels, crop_size=400, scale_range=(0.5, 0.5), generator=torch.Generator().manual_seed(3)
    )
    b = augment_pair(
        image, labels, crop_size=400, scale_range=(0.5, 0.5), generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # 90×120 after scaling, in a 400² crop: everything else is padding, labelled ignore.
    assert (a[1] != 255).sum() <= 90 * 120 and (a[1] == 255).float().mean() > 0.9
    assert a[0].min() >= 0 and a[0].max() <= 255


def test_photometric_jitter_changes_the_image_not_the_padding(shared_data):
    """The same draws (scale 1, no flip) on a 100² crop of a real image, alone and padded to 200²: its own
    pixels come out the same and the padding stays 0. The padding was jittered, and the contrast's mean
    took it in, so the image's pixels depended on how much padding the crop had (by up to 39 levels)."""
    image, labels = open_segmentation_dataset(shared_data / "camvid-mini.tar.gz", "val", **CAMVID)[0]
    image, labels = image[:, :100, :100], labels[:100, :100]

    def augmented(crop_size, seed):
        generator = torch.Generator().manual_seed(seed)
        return augment_pair(
            image, labels, crop_size=crop_size, scale_range=(1, 1), hflip=0, generator=generator
        )

    jittered = 0
    for seed in range(8):
        alone, padded = augmented(100, seed), augmented(200, seed)
        jittered += not torch.equal(alone[0], image)
        assert torch.equal(padded[0][:, :100, :100], alone[0])
        assert (padded[0][:, 100:] == 0).all() and (padded[0][:, :, 100:] == 0).all()
    assert jittered >= 5  # 7 in 8 draws jitter, on average


def write_pair(root, image_name, mask_name, level, mask_value=1):
    """A 4×3 gray ``level`` image and a mask of ``mask_value`` under ``root/{images,annotations}/val``."""
    for folder, name, array in [
        ("images", image_name, np.full((3, 4, 3), level, np.uint8)),
        ("annotations", mask_name, np.full((3, 4), mask_value, np.uint8)),
    ]:
        (root / folder / "val").mkdir(parents=True, exist_ok=True)
        Image.fromarray(array).save(root / folder / "val" / name, format="PNG")


def pack(root, archive):
    with tarfile.open(archive, "w:gz" if archive.name.endswith(".gz") else "w") as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)


def test_samples_in_subfolders_of_a_split_are_refused_not_left_out(tmp_path):
    """A Cityscapes-like layout (images/val/<city>/*.png) was read without a word as the one pair beside
    the subfolders: mIoU over part of the split. The folder and the archive refuse it, naming the layout."""
    root = tmp_path / "seg"
    write_pair(root, "a.png", "a.png", 10)
    (root / "images" / "val" / "notes").mkdir()  # a subfolder without samples is no layout of them
    assert len(open_segmentation_dataset(root, "val", **CAMVID)) == 1
    for folder in ("images", "annotations"):
        (root / folder / "val" / "frankfurt").mkdir()
    write_pair(root, "frankfurt/b.png", "frankfurt/b.png", 20)
    pack(root, tmp_path / "seg.tar")
    with pytest.raises(
        ValueError, match=r"images/val has subfolders \(frankfurt\): the layout is images/<split>"
    ):
        open_segmentation_dataset(root, "val", **CAMVID)
    with pytest.raises(
        ValueError, match=r"seg\.tar:(images|annotations)/val/frankfurt is a subfolder of samples"
    ):
        open_segmentation_dataset(tmp_path / "seg.tar", "val", **CAMVID)


def test_reader_skips_hidden_files_matches_suffixes_in_any_case_and_refuses_two_images_of_a_stem(tmp_path):
    root = tmp_path / "seg"
    write_pair(root, "a.jpg", "a.png", 10)
    write_pair(root, "B.JPG", "B.PNG", 20)  # upper-case suffixes, also for the mask
    write_pair(root, "c.Png", "c.pNg", 30)
    for folder in ("images", "annotations"):  # macOS's litter: not samples
        (root / folder / "val" / "._a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
        (root / folder / "val" / ".DS_Store").write_bytes(b"junk")
    pack(root, tmp_path / "seg.tar")
    for source in (root, tmp_path / "seg.tar"):
        dataset = open_segmentation_dataset(source, "val", **CAMVID)
        assert [name.rsplit("/", 1)[-1] for name, _, _ in dataset.items] == ["B", "a", "c"], source
        assert [int(dataset[i][0][0, 0, 0]) for i in range(3)] == [20, 10, 30]
        assert all((dataset[i][1] == 1).all() for i in range(3))

    write_pair(root, "a.png", "a.png", 99)  # a second image of the stem "a"
    pack(root, tmp_path / "seg.tar")
    for source, where in [
        (root, f"{root}/images/val"),
        (tmp_path / "seg.tar", f"{tmp_path / 'seg.tar'}:images/val"),
    ]:
        with pytest.raises(
            ValueError, match=re.escape(f"{where} has two files of the stem a: a.jpg and a.png")
        ):
            open_segmentation_dataset(source, "val", **CAMVID)


def test_sixteen_bit_image_is_scaled_but_a_sixteen_bit_mask_keeps_its_labels(tmp_path):
    root = tmp_path / "seg"
    write_pair(root, "a.png", "a.png", 0)
    values = np.array([[0, 255, 256, 1000], [30000, 32768, 65280, 65535], [512, 513, 767, 768]], np.uint16)
    Image.fromarray(values).save(root / "images" / "val" / "a.png")  # PIL mode I;16
    Image.fromarray(np.full((3, 4), 7, np.uint16)).save(root / "annotations" / "val" / "a.png")
    image, labels = open_segmentation_dataset(root, "val", **CAMVID)[0]
    assert (image.numpy() == (values // 256)[None]).all()  # the top 8 bits, in all three channels
    assert (labels == 7).all()
    Image.fromarray(values.astype(np.float32)).save(root / "images" / "val" / "a.tif")
    (root / "images" / "val" / "a.png").unlink()
    (root / "annotations" / "val" / "a.png").unlink()  # a mask without its image is an error of its own
    write_pair(root, "b.png", "b.png", 0)
    (root / "images" / "val" / "b.png").unlink()
    (root / "images" / "val" / "a.tif").rename(root / "images" / "val" / "b.png")  # a 32-bit TIFF named .png
    with pytest.raises(ValueError, match=re.escape(f"cannot read {root}/images/val/b.png: ")):
        open_segmentation_dataset(root, "val", **CAMVID)[0]


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_archive_damage_is_an_error_and_hard_links_are_read(tmp_path, suffix):
    root = tmp_path / "seg"
    write_pair(root, "a.png", "a.png", 10)
    write_pair(root, "b.png", "b.png", 20)
    (root / "annotations" / "val" / "b.png").unlink()
    (root / "annotations" / "val" / "b.png").hardlink_to(root / "annotations" / "val" / "a.png")
    archive = tmp_path / f"seg{suffix}"
    pack(root, archive)
    dataset = open_segmentation_dataset(archive, "val", **CAMVID)
    assert len(dataset) == 2 and (dataset[1][1] == 1).all() and int(dataset[1][0][0, 0, 0]) == 20

    data = bytearray(archive.read_bytes())
    if suffix == ".tar":  # the last member's header: tarfile stops there as if the archive ended
        with tarfile.open(archive) as tar:
            data[tar.getmembers()[-1].offset] ^= 0x20
    else:
        data[-8] ^= 0xFF  # the gzip trailer's CRC-32
    archive.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(f"{archive} is damaged")):
        open_segmentation_dataset(archive, "val", **CAMVID)


def test_rescale_to_a_base_size_is_mmcvs_imrescale(shared_data):
    """mmseg's Resize(img_scale=(2048, 512)) with keep_ratio: mmcv's imrescale to the largest size whose
    long edge is at most 2048 and short edge at most 512, each side int(side · factor + 0.5)."""

    def imrescale(h, w, max_long, max_short):
        factor = min(max_long / max(h, w), max_short / min(h, w))
        return int(h * factor + 0.5), int(w * factor + 0.5)

    for h, w in [(180, 240), (240, 180), (512, 683), (300, 1500), (1500, 200), (97, 97)]:
        for ratio in (0.5, 1.0, 1.37, 2.0):
            assert rescaled_size(h, w, 512 * ratio) == imrescale(h, w, 2048 * ratio, 512 * ratio)
    # In the augmentation: a CamVid pair, factor 1, base 64: 64 × 85 labelled, the rest padding.
    image, labels = open_segmentation_dataset(shared_data / "camvid-mini.tar.gz", "val", **CAMVID)[0]
    assert labels.shape == (180, 240)
    _, mask = augment_pair(
        image, torch.zeros_like(labels), crop_size=100, scale_range=(1, 1), base_size=64, hflip=0
    )
    assert (mask == 0).sum(0).max() == 64 and (mask == 0).sum(1).max() == 85


def test_crops_are_redrawn_up_to_ten_times_while_one_class_covers_three_quarters():
    """mmseg's RandomCrop(cat_max_ratio=0.75): a crop passes when more than one class is in it and none
    covers 75% of its labelled pixels; up to 10 failed draws are redrawn, the 11th kept as it comes. With
    p the share of passing crop positions (counted here over every position), 1 − (1 − p)^11 of the
    crops pass; without the rule, p."""
    labels = torch.zeros(48, 48, dtype=torch.long)
    labels[:, 36:] = 255  # ignored: not counted
    labels[:20, :20] = 1
    image = torch.zeros(3, 48, 48, dtype=torch.uint8)

    def passes(crop):
        counts = crop[crop != 255].unique(return_counts=True)[1]
        return len(counts) > 1 and counts.max().item() / counts.sum().item() < 0.75

    positions = [labels[t : t + 24, s : s + 24] for t in range(25) for s in range(25)]
    p = sum(map(passes, positions)) / len(positions)
    assert 0.05 < p < 0.3
    draws = 400
    for ratio, expected in ((0.75, 1 - (1 - p) ** 11), (1.0, p)):
        passed = sum(
            passes(augment_pair(image, labels, crop_size=24, scale_range=(1, 1), cat_max_ratio=ratio,
                                hflip=0, photometric=False, generator=torch.Generator().manual_seed(seed))[1])
            for seed in range(draws)
        )  # fmt: skip
        sd = math.sqrt(expected * (1 - expected) / draws)
        assert abs(passed / draws - expected) < 4 * sd + 1e-9, (ratio, passed / draws, expected)


def test_padding_takes_the_given_levels_and_the_ignore_label():
    image = torch.full((3, 20, 30), 200, dtype=torch.uint8)
    pixels, mask = augment_pair(
        image, torch.ones(20, 30, dtype=torch.long), crop_size=40, scale_range=(1, 1), hflip=0,
        photometric=False, pad_value=(124, 116, 104),
    )  # fmt: skip
    assert (pixels[:, :20, :30] == 200).all() and (mask[:20, :30] == 1).all()
    for channel, level in enumerate((124, 116, 104)):
        assert (pixels[channel, 20:] == level).all() and (pixels[channel, :, 30:] == level).all()
    assert (mask[20:] == 255).all() and (mask[:, 30:] == 255).all()


def test_photometric_distortion_is_mmsegs():
    """mmseg's PhotoMetricDistortion: brightness and contrast on every channel alike, so a gray image stays
    gray (saturation and hue leave gray alone); every value a whole level in [0, 255]; the hue turned by
    whole 2° steps in [−36°, 34°] half of the time."""
    gray = torch.arange(256.0).repeat(3, 1)[:, None, :]  # (3, 1, 256): every level
    moved = 0
    for seed in range(40):
        out = photometric_distortion(gray.clone(), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(out, out.round()) and out.min() >= 0 and out.max() <= 255
        assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
        moved += not torch.equal(out, gray)
    assert 22 <= moved <= 38  # brightness and contrast each act half of the time: 3 in 4 draws move gray
    red = torch.tensor([200.0, 40.0, 40.0])[:, None, None]
    hues = []
    for seed in range(200):
        out = photometric_distortion(red.clone(), generator=torch.Generator().manual_seed(seed))
        r, g, b = (v / 255 for v in out.flatten().tolist())
        h, s, v = colorsys.rgb_to_hsv(r, g, b)
        if s * v > 0.25:  # enough colour left to read the hue to about a degree
            hues.append((h * 360 + 180) % 360 - 180)  # 0° is red
    # the hue turned by k · 2°, k in [−18, 18), and by at most a degree or so of rounding to levels
    assert len(hues) > 100 and -38 < min(hues) < -25 and 25 < max(hues) < 36
    assert sum(abs(h) < 1 for h in hues) > len(hues) / 3  # half the draws leave the hue alone

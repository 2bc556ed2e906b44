"""Semantic-segmentation data: one reader for the ``images/<split>/*.jpg`` + ``annotations/<split>/*.png``
layout (ADE20K, CamVid), as a folder or a ``.tar``/``.tar.gz`` archive, and the training augmentation
applied to an image and its mask together (math.md §4 Segmenter recipe).

Labels: a raw mask value ``r`` becomes ``r − label_offset``; values that fall below 0, or equal
``void_label`` (raw), become ``ignore_index``; any other value outside ``0 … num_classes − 1`` is an
error naming the file. ADE20K: ``label_offset=1`` (raw 0 is "other", ignored; 1–150 → 0–149);
CamVid: ``label_offset=0``, ``void_label=11``.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from neutreno.data.files import check_archive_end, is_file_member, member_bytes, open_archive, to_8_bits

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


class SegmentationDataset(Dataset):
    """(image uint8 (3, H, W), labels int64 (H, W)) pairs, decoded on demand.

    Args:
        items: (name, image source, mask source) triples; a source is a path or the encoded bytes.
        num_classes, ignore_index, label_offset, void_label: see the module docstring.
    """

    def __init__(
        self,
        items: list[tuple[str, str | bytes, str | bytes]],
        *,
        num_classes: int,
        ignore_index: int = 255,
        label_offset: int = 0,
        void_label: int | None = None,
    ) -> None:
        if num_classes < 1 or 0 <= ignore_index < num_classes:
            raise ValueError(f"need num_classes >= 1 and ignore_index outside 0…{num_classes - 1}")
        self.items, self.num_classes, self.ignore_index = items, num_classes, ignore_index
        self.label_offset, self.void_label = label_offset, void_label

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        name, image_source, mask_source = self.items[index]
        # errors name the file at fault: a source read from a file by its path, one from an archive by
        # the sample's name
        image = _decode(image_source, "RGB", name if isinstance(image_source, bytes) else str(image_source))
        mask_name = f"the mask of {name}" if isinstance(mask_source, bytes) else str(mask_source)
        raw = _decode(mask_source, None, mask_name)
        if raw.ndim != 2:
            raise ValueError(f"{mask_name} has {raw.shape[-1]} channels; expected one label per pixel")
        if raw.shape != image.shape[:2]:
            raise ValueError(
                f"{mask_name} is {raw.shape[1]}×{raw.shape[0]} pixels, "
                f"its image {image.shape[1]}×{image.shape[0]}"
            )
        labels = raw.astype(np.int64) - self.label_offset
        ignored = labels < 0
        if self.void_label is not None:
            ignored |= raw == self.void_label
        bad = ~ignored & (labels >= self.num_classes)
        if bad.any():
            value = int(raw[bad][0])
            raise ValueError(
                f"{mask_name} has label {value}, outside the {self.num_classes} classes "
                f"(label_offset {self.label_offset}, void_label {self.void_label})"
            )
        labels[ignored] = self.ignore_index
        return torch.from_numpy(image).permute(2, 0, 1).contiguous(), torch.from_numpy(labels)


def _decode(source: str | bytes, mode: str | None, name: str) -> np.ndarray:
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        with Image.open(io.BytesIO(data)) as opened:  # a mask keeps its values, whatever its bit depth
            return np.array(to_8_bits(opened).convert(mode) if mode else opened)
    except Exception as error:  # PIL raises many types for bad data
        raise ValueError(f"cannot read {name}: {error}") from None


def open_segmentation_dataset(root: str | Path, split: str, **labels) -> SegmentationDataset:
    """The ``split`` of a segmentation folder or archive (``images/<split>/``, ``annotations/<split>/``,
    masks with the image's stem and a ``.png`` suffix; suffixes in any case, hidden files such as
    ``._a.jpg`` skipped). ``labels``: :class:`SegmentationDataset`'s ``num_classes``, ``ignore_index``,
    ``label_offset``, ``void_label``.

    Raises:
        FileNotFoundError: no such root, no image, or an image without a mask. ValueError: two images
            (or masks) of one stem, or an unreadable or damaged archive.
    """
    root = Path(root)
    files: dict[str, list[tuple[str, str | bytes]]] = {"images": [], "annotations": []}
    if root.is_dir():
        for kind in files:
            folder = root / kind / split
            if folder.is_dir():
                files[kind] = [(p.name, p) for p in sorted(folder.iterdir()) if _is_sample(kind, p.name)]
        where, mask_where = f"{root}/images/{split}", f"{root}/annotations/{split}"
    elif root.is_file():
        seen: dict[str, bytes] = {}
        with open_archive(root, f"cannot read archive {root}") as tar:
            for member in tar:
                parts = [part for part in member.name.split("/") if part not in ("", ".")]
                if len(parts) != 3 or parts[1] != split or parts[0] not in files:
                    continue
                if is_file_member(member) and _is_sample(parts[0], parts[2]):
                    files[parts[0]].append((parts[2], member_bytes(tar, member, seen)))
            check_archive_end(tar, root)
        where, mask_where = f"{root}:images/{split}", f"{root}:annotations/{split}"
    else:
        raise FileNotFoundError(f"no such segmentation dataset: {root}")
    images = _by_stem(files["images"], "images", where)
    masks = _by_stem(files["annotations"], "annotations", mask_where)
    if not images:
        raise FileNotFoundError(f"no images in {where}")
    missing = sorted(set(images) - set(masks))
    if missing:
        raise FileNotFoundError(f"{len(missing)} image(s) in {where} have no mask, e.g. {missing[0]}")
    items = [(f"{where}/{stem}", images[stem], masks[stem]) for stem in sorted(images)]
    return SegmentationDataset(items, **labels)


def _is_sample(kind: str, name: str) -> bool:
    """An image (``.jpg``, ``.jpeg``, ``.png``) or a mask (``.png``), in any case; not a hidden file."""
    suffixes = IMAGE_SUFFIXES if kind == "images" else (".png",)
    return not name.startswith(".") and Path(name).suffix.lower() in suffixes


def _by_stem(files: list[tuple[str, str | bytes]], kind: str, where: str) -> dict[str, str | bytes]:
    """{stem: source} of the samples among ``(file name, source)``; two files of one stem are an error."""
    found: dict[str, str | bytes] = {}
    names: dict[str, str] = {}
    for name, source in files:
        if not _is_sample(kind, name):
            continue
        stem = Path(name).stem
        if stem in names:
            first, second = sorted((names[stem], name))
            raise ValueError(f"{where} has two files of the stem {stem}: {first} and {second}")
        found[stem], names[stem] = source, name
    return found


def augment_pair(
    image: Tensor,
    labels: Tensor,
    *,
    crop_size: int,
    scale_range: tuple[float, float] = (0.5, 2.0),
    hflip: float = 0.5,
    photometric: bool = True,
    ignore_index: int = 255,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Segmenter/mmseg training augmentation of one pair, the same geometry for image and mask.

    Random rescale by a factor in ``scale_range`` (image bilinear, mask nearest), padding to at least
    ``crop_size`` (image 0, mask ``ignore_index``), a random ``crop_size``² crop, a horizontal flip with
    probability ``hflip``, then photometric jitter of the image only (brightness ±32, contrast around
    the mean and saturation ×0.5–1.5, each with probability ½), of its own pixels: the padding stays 0
    and is not in the mean (mmseg jitters before it pads). Randomness comes from torch's RNG
    (``generator``), so a resumed run repeats it.

    Args:
        image: uint8 (3, H, W). labels: int64 (H, W).
    Returns:
        (image uint8 (3, S, S), rounded like a decoded image, labels int64 (S, S)), S = ``crop_size``.
    """

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=generator).item()

    def coin(p: float) -> bool:
        return torch.rand((), generator=generator).item() < p

    height, width = labels.shape
    scale = uniform(*scale_range)
    size = (max(1, round(height * scale)), max(1, round(width * scale)))
    pixels = F.interpolate(image[None].float(), size=size, mode="bilinear", align_corners=False)[0]
    mask = F.interpolate(labels[None, None].float(), size=size, mode="nearest")[0, 0].long()
    real = pixels.new_ones(1, *size)  # the image's own pixels, 0 over the padding
    pad_h, pad_w = max(0, crop_size - size[0]), max(0, crop_size - size[1])
    if pad_h or pad_w:
        pixels = F.pad(pixels, (0, pad_w, 0, pad_h), value=0.0)
        real = F.pad(real, (0, pad_w, 0, pad_h), value=0.0)
        mask = F.pad(mask, (0, pad_w, 0, pad_h), value=ignore_index)
    top = int(torch.randint(mask.shape[0] - crop_size + 1, (), generator=generator))
    left = int(torch.randint(mask.shape[1] - crop_size + 1, (), generator=generator))
    crop = (slice(top, top + crop_size), slice(left, left + crop_size))
    pixels, real, mask = pixels[:, crop[0], crop[1]], real[:, crop[0], crop[1]], mask[crop]
    if coin(hflip):
        pixels, real, mask = pixels.flip(-1), real.flip(-1), mask.flip(-1)
    if photometric:  # on the image's own pixels (a crop always holds some): the padding stays 0
        if coin(0.5):
            pixels = pixels + uniform(-32, 32) * real
        if coin(0.5):
            mean = (pixels * real).sum() / (real.sum() * pixels.shape[0])
            pixels = ((pixels - mean) * uniform(0.5, 1.5) + mean) * real
        if coin(0.5):
            luma = pixels.new_tensor([0.299, 0.587, 0.114])[:, None, None]
            gray = (pixels * luma).sum(0, keepdim=True)
            pixels = gray + (pixels - gray) * uniform(0.5, 1.5)
    return pixels.round().clamp(0, 255).to(torch.uint8).contiguous(), mask.contiguous()

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
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

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
        image = _decode(image_source, "RGB", name)
        raw = _decode(mask_source, None, name)
        if raw.ndim != 2:
            raise ValueError(f"mask of {name} has {raw.shape[-1]} channels; expected one label per pixel")
        if raw.shape != image.shape[:2]:
            raise ValueError(
                f"mask of {name} is {raw.shape[1]}×{raw.shape[0]} pixels, "
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
                f"mask of {name} has label {value}, outside the {self.num_classes} classes "
                f"(label_offset {self.label_offset}, void_label {self.void_label})"
            )
        labels[ignored] = self.ignore_index
        return torch.from_numpy(image).permute(2, 0, 1).contiguous(), torch.from_numpy(labels)


def _decode(source: str | bytes, mode: str | None, name: str) -> np.ndarray:
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        with Image.open(io.BytesIO(data)) as opened:
            return np.array(opened.convert(mode) if mode else opened)
    except Exception as error:  # PIL raises many types for bad data
        raise ValueError(f"cannot read {name}: {error}") from None


def open_segmentation_dataset(root: str | Path, split: str, **labels) -> SegmentationDataset:
    """The ``split`` of a segmentation folder or archive (``images/<split>/``, ``annotations/<split>/``,
    masks with the image's stem and a ``.png`` suffix). ``labels``: :class:`SegmentationDataset`'s
    ``num_classes``, ``ignore_index``, ``label_offset``, ``void_label``."""
    root = Path(root)
    if root.is_dir():
        images = {
            p.stem: p
            for p in sorted((root / "images" / split).glob("*"))
            if p.suffix.lower() in IMAGE_SUFFIXES
        }
        masks = {p.stem: p for p in sorted((root / "annotations" / split).glob("*.png"))}
        where = f"{root}/images/{split}"
    elif root.is_file():
        images, masks = {}, {}
        try:
            with tarfile.open(root) as tar:
                for member in tar:
                    parts = member.name.removeprefix("./").split("/")
                    if member.isfile() and len(parts) == 3 and parts[1] == split:
                        stem, suffix = Path(parts[2]).stem, Path(parts[2]).suffix.lower()
                        if parts[0] == "images" and suffix in IMAGE_SUFFIXES:
                            images[stem] = tar.extractfile(member).read()
                        elif parts[0] == "annotations" and suffix == ".png":
                            masks[stem] = tar.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError) as error:
            raise ValueError(f"cannot read archive {root}: {error}") from None
        where = f"{root}:images/{split}"
    else:
        raise FileNotFoundError(f"no such segmentation dataset: {root}")
    if not images:
        raise FileNotFoundError(f"no images in {where}")
    missing = sorted(set(images) - set(masks))
    if missing:
        raise FileNotFoundError(f"{len(missing)} image(s) in {where} have no mask, e.g. {missing[0]}")
    items = [(f"{where}/{stem}", images[stem], masks[stem]) for stem in sorted(images)]
    return SegmentationDataset(items, **labels)


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
    probability ``hflip``, then photometric jitter of the image only (brightness ±32, contrast and
    saturation ×0.5–1.5, each with probability ½). Randomness comes from torch's RNG (``generator``),
    so a resumed run repeats it.

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
    pad_h, pad_w = max(0, crop_size - size[0]), max(0, crop_size - size[1])
    if pad_h or pad_w:
        pixels = F.pad(pixels, (0, pad_w, 0, pad_h), value=0.0)
        mask = F.pad(mask, (0, pad_w, 0, pad_h), value=ignore_index)
    top = int(torch.randint(mask.shape[0] - crop_size + 1, (), generator=generator))
    left = int(torch.randint(mask.shape[1] - crop_size + 1, (), generator=generator))
    pixels = pixels[:, top : top + crop_size, left : left + crop_size]
    mask = mask[top : top + crop_size, left : left + crop_size]
    if coin(hflip):
        pixels, mask = pixels.flip(-1), mask.flip(-1)
    if photometric:
        if coin(0.5):
            pixels = pixels + uniform(-32, 32)
        if coin(0.5):
            pixels = (pixels - pixels.mean()) * uniform(0.5, 1.5) + pixels.mean()
        if coin(0.5):
            luma = pixels.new_tensor([0.299, 0.587, 0.114])[:, None, None]
            gray = (pixels * luma).sum(0, keepdim=True)
            pixels = gray + (pixels - gray) * uniform(0.5, 1.5)
    return pixels.round().clamp(0, 255).to(torch.uint8).contiguous(), mask.contiguous()

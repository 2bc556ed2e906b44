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
import math
from pathlib import Path

import kornia.color
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from neutreno.data.files import (
    check_archive_end,
    image_error,
    is_file_member,
    member_bytes,
    open_archive,
    to_8_bits,
)
from neutreno.progress import progress

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# what a split's folder holds: its samples side by side (nested ones were left out without a word)
LAYOUT = "the layout is images/<split>/<name>.jpg and annotations/<split>/<name>.png, with no subfolders"


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
        if num_classes < 2 or 0 <= ignore_index < num_classes:  # one class: every pixel right, whatever
            raise ValueError(f"need num_classes >= 2 and ignore_index outside 0…{num_classes - 1}")
        self.items, self.num_classes, self.ignore_index = items, num_classes, ignore_index
        self.label_offset, self.void_label = label_offset, void_label

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        name, image_source, _ = self.items[index]
        # errors name the file at fault: a source read from a file by its path, one from an archive by
        # the sample's name
        image = _decode(image_source, "RGB", name if isinstance(image_source, bytes) else str(image_source))
        labels = self.labels(index, image.shape[:2])
        return torch.from_numpy(image).permute(2, 0, 1).contiguous(), labels

    def labels(self, index: int, image_shape: tuple[int, int]) -> Tensor:
        """Sample ``index``'s mask as class ids (H, W), ``ignore_index`` where ignored, checked against its
        image's (H, W): one label per pixel, the image's size, every label a class or ignored."""
        name, _, mask_source = self.items[index]
        mask_name = f"the mask of {name}" if isinstance(mask_source, bytes) else str(mask_source)
        raw = _decode(mask_source, None, mask_name)
        if raw.ndim != 2:
            raise ValueError(f"{mask_name} has {raw.shape[-1]} channels; expected one label per pixel")
        if raw.shape != tuple(image_shape):
            raise ValueError(
                f"{mask_name} is {raw.shape[1]}×{raw.shape[0]} pixels, "
                f"its image {image_shape[1]}×{image_shape[0]}"
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
        return torch.from_numpy(labels)

    def check_masks(self, desc: str = "checking masks") -> None:
        """Read every mask and check it as :meth:`labels` does, its image's size read from the image's
        header (not decoded): a bad mask of the validation split was found at the first validation,
        after a whole epoch of training. ValueError naming the first bad file."""
        for index in progress(range(len(self)), desc=desc, unit="mask", leave=False):
            name, image_source, _ = self.items[index]
            self.labels(index, _image_shape(image_source, name))


def _image_shape(source: str | bytes, name: str) -> tuple[int, int]:
    """(H, W) of an image from its header."""
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as opened:
            return opened.height, opened.width
    except Exception as error:
        raise ValueError(
            f"cannot read {name if isinstance(source, bytes) else source}: {image_error(error)}"
        ) from None


def _decode(source: str | bytes, mode: str | None, name: str) -> np.ndarray:
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        with Image.open(io.BytesIO(data)) as opened:  # a mask keeps its values, whatever its bit depth
            return np.array(to_8_bits(opened).convert(mode) if mode else opened)
    except Exception as error:  # PIL raises many types for bad data
        raise ValueError(f"cannot read {name}: {image_error(error)}") from None


def open_segmentation_dataset(root: str | Path, split: str, **labels) -> SegmentationDataset:
    """The ``split`` of a segmentation folder or archive (``images/<split>/``, ``annotations/<split>/``,
    masks with the image's stem and a ``.png`` suffix; suffixes in any case, hidden files such as
    ``._a.jpg`` skipped). ``labels``: :class:`SegmentationDataset`'s ``num_classes``, ``ignore_index``,
    ``label_offset``, ``void_label``.

    Raises:
        FileNotFoundError: no such root, no image, an image without a mask or a mask without an image.
        ValueError: two images (or masks) of one stem, or an unreadable or damaged archive.
    """
    root = Path(root)
    files: dict[str, list[tuple[str, str | bytes]]] = {"images": [], "annotations": []}
    if root.is_dir():
        for kind in files:
            folder = root / kind / split
            if folder.is_dir():
                entries = sorted(folder.iterdir())
                nested = [
                    p.name
                    for p in entries
                    if p.is_dir()
                    and not p.name.startswith(".")
                    and any(_is_sample(kind, f.name) for f in p.rglob("*") if f.is_file())
                ]  # (a folder of notes is not refused, as in an archive, where only samples show)
                if nested:  # a Cityscapes-like city per folder: its samples were left out, silently
                    raise ValueError(f"{folder} has subfolders ({_few(nested)}): {LAYOUT}")
                files[kind] = [(p.name, p) for p in entries if _is_sample(kind, p.name)]
        where, mask_where = f"{root}/images/{split}", f"{root}/annotations/{split}"
    elif root.is_file():
        seen: dict[int, bytes] = {}
        with open_archive(root, f"cannot read archive {root}") as tar:
            for member in tar:
                parts = [part for part in member.name.split("/") if part not in ("", ".")]
                nested = len(parts) > 3 and parts[1] == split and parts[0] in files and is_file_member(member)
                if nested and _is_sample(parts[0], parts[-1]) and not parts[2].startswith("."):
                    raise ValueError(f"{root}:{'/'.join(parts[:3])} is a subfolder of samples: {LAYOUT}")
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
        raise FileNotFoundError(  # (a mask saved as .jpg is not one: a lossy file's labels are not exact)
            f"{len(missing)} image(s) in {where} have no mask (.png) in {mask_where}, e.g. {missing[0]}: "
            f"{mask_where}/{missing[0]}.png"
        )
    # the other way: a mask whose image is missing, or not a .jpg/.jpeg/.png, left a smaller dataset
    orphans = sorted(set(masks) - set(images))
    if orphans:
        raise FileNotFoundError(
            f"{len(orphans)} mask(s) in {mask_where} have no image ({' '.join(IMAGE_SUFFIXES)}) in "
            f"{where}, e.g. {orphans[0]}"
        )
    items = [(f"{where}/{stem}", images[stem], masks[stem]) for stem in sorted(images)]
    return SegmentationDataset(items, **labels)


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", …" if len(names) > 3 else "")


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


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    """A draw from U(low, high) by torch's RNG (so a resumed run repeats it)."""
    return low + (high - low) * torch.rand((), generator=generator).item()


def rescaled_size(height: int, width: int, short_side: float) -> tuple[int, int]:
    """(H', W') of an image rescaled, its aspect kept, to the short side ``short_side`` with the long side
    at most 4 × ``short_side``: mmcv's ``imrescale`` to the scale (4s, s), which is what mmseg's
    ``Resize(img_scale=(2048, 512), ratio_range=…)`` does to ADE20K images in Segmenter's training and
    multi-scale test."""
    factor = min(short_side / min(height, width), 4 * short_side / max(height, width))
    return max(1, int(height * factor + 0.5)), max(1, int(width * factor + 0.5))


def augment_pair(
    image: Tensor,
    labels: Tensor,
    *,
    crop_size: int,
    scale_range: tuple[float, float] = (0.5, 2.0),
    base_size: int | None = None,
    cat_max_ratio: float = 0.75,
    hflip: float = 0.5,
    photometric: bool = True,
    ignore_index: int = 255,
    pad_value: tuple[int, int, int] = (0, 0, 0),
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Segmenter's training augmentation (its mmseg pipeline) of one pair, the same geometry for image
    and mask, in mmseg's order:

    1. rescale by r ~ U(``scale_range``) (image bilinear, mask nearest): the short side to r ×
       ``base_size`` (:func:`rescaled_size`; mmseg's ``Resize(img_scale=(2048, 512))``) or, without
       ``base_size``, the stored image × r;
    2. a random crop of at most ``crop_size``² (the whole side where the image is smaller), drawn again
       up to 10 times while one class covers ``cat_max_ratio`` or more of its labelled pixels
       (mmseg's ``RandomCrop(cat_max_ratio=0.75)``; 1 turns it off);
    3. a horizontal flip with probability ``hflip``;
    4. mmseg's ``PhotoMetricDistortion`` (:func:`photometric_distortion`);
    5. padding to ``crop_size``² at the bottom and right: image ``pad_value``, mask ``ignore_index``.
       mmseg pads after normalising, with 0, so the task passes the normalisation mean (in levels).

    Randomness comes from torch's RNG (``generator``), so a resumed run repeats it.

    Args:
        image: uint8 (3, H, W). labels: int64 (H, W).
    Returns:
        (image uint8 (3, S, S), rounded like a decoded image, labels int64 (S, S)), S = ``crop_size``.
    """

    def uniform(low: float, high: float) -> float:
        return _uniform(low, high, generator)

    def randint(high: int) -> int:
        return int(torch.randint(high, (), generator=generator))

    height, width = labels.shape
    scale = uniform(*scale_range)
    if base_size is None:
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
    else:
        size = rescaled_size(height, width, scale * base_size)
    pixels = F.interpolate(image[None].float(), size=size, mode="bilinear", align_corners=False)[0]
    # float64: float32 holds integers exactly only to 2²⁴ (an ignore_index of 2²⁴ + 1 became a class id)
    mask = F.interpolate(labels[None, None].double(), size=size, mode="nearest")[0, 0].long()

    crop_h, crop_w = min(crop_size, size[0]), min(crop_size, size[1])
    top, left = randint(size[0] - crop_h + 1), randint(size[1] - crop_w + 1)
    for _ in range(10 if cat_max_ratio < 1 else 0):
        crop_labels = mask[top : top + crop_h, left : left + crop_w]
        counts = crop_labels[crop_labels != ignore_index].unique(return_counts=True)[1]
        if len(counts) > 1 and counts.max() < cat_max_ratio * counts.sum():
            break
        top, left = randint(size[0] - crop_h + 1), randint(size[1] - crop_w + 1)
    pixels = pixels[:, top : top + crop_h, left : left + crop_w]
    mask = mask[top : top + crop_h, left : left + crop_w]
    if uniform(0, 1) < hflip:
        pixels, mask = pixels.flip(-1), mask.flip(-1)
    pixels = pixels.round().clamp(0, 255)  # mmseg's image is uint8 from here on
    if photometric:
        pixels = photometric_distortion(pixels, generator=generator)
    pad_h, pad_w = crop_size - crop_h, crop_size - crop_w
    if pad_h or pad_w:
        pixels = torch.cat([F.pad(channel, (0, pad_w, 0, pad_h), value=float(v)) for channel, v in
                            zip(pixels[:, None], pad_value, strict=True)])  # fmt: skip
        mask = F.pad(mask, (0, pad_w, 0, pad_h), value=ignore_index)
    return pixels.to(torch.uint8).contiguous(), mask.contiguous()


def photometric_distortion(pixels: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
    """mmseg's ``PhotoMetricDistortion`` of RGB levels (3, H, W) (float, whole numbers in [0, 255]).

    Each with probability ½: brightness + U(−32, 32); contrast × U(0.5, 1.5), before or after the
    colour steps (½ each); saturation × U(0.5, 1.5); hue + an integer in [−18, 18) of OpenCV's 2° units.
    Each step clips to [0, 255] and truncates to a level, as mmseg's ``convert`` does. Saturation and hue
    are taken in float HSV (OpenCV's 8-bit HSV rounds them further), back to levels by rounding."""

    def uniform(low: float, high: float) -> float:
        return _uniform(low, high, generator)

    def coin() -> bool:
        return _uniform(0, 1, generator) < 0.5

    def levels(x: Tensor) -> Tensor:
        return x.clamp(0, 255).floor()

    def contrast(x: Tensor) -> Tensor:
        return levels(x * uniform(0.5, 1.5)) if coin() else x

    if coin():
        pixels = levels(pixels + uniform(-32, 32))
    contrast_first = coin()
    if contrast_first:
        pixels = contrast(pixels)
    saturation = uniform(0.5, 1.5) if coin() else None
    hue = int(torch.randint(-18, 18, (), generator=generator)) if coin() else None
    if saturation is not None or hue is not None:
        hsv = kornia.color.rgb_to_hsv(pixels / 255)
        if saturation is not None:
            hsv[1] = (hsv[1] * saturation).clamp(0, 1)
        if hue is not None:
            hsv[0] = (hsv[0] + math.radians(2 * hue)) % (2 * math.pi)
        pixels = (kornia.color.hsv_to_rgb(hsv) * 255).round().clamp(0, 255)
    if not contrast_first:
        pixels = contrast(pixels)
    return pixels

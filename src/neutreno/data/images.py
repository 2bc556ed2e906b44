"""Images from an ImageFolder-layout folder or .tar/.tar.gz archive (``[split/]class/file``), as
used by ImageNet, CIFAR folder dumps and ``../shared/data``: decoded with PIL, converted to RGB or
grayscale, resized, scaled to [0, 1]."""

from __future__ import annotations

import io
import math
import os
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from neutreno.constants import IMAGENET_MEAN, IMAGENET_STD
from neutreno.data.files import (
    check_archive_end,
    image_error,
    is_file_member,
    is_hidden,
    is_image_name,
    member_bytes,
    open_archive,
    raise_walk_error,
    refuse_folder_link,
    to_8_bits,
)


def _spread(paths: list[str], limit: int | None, class_of) -> list[str]:
    """Up to ``limit`` paths taken round-robin over classes, each class in sorted order."""
    by_class: dict[str, list[str]] = defaultdict(list)
    for p in sorted(paths):
        by_class[class_of(p)].append(p)
    queues = [by_class[c] for c in sorted(by_class)]
    picked = []
    for i in range(max(map(len, queues), default=0)):
        picked += [q[i] for q in queues if i < len(q)]
    return picked[:limit] if limit is not None else picked


def files_under(root: Path) -> list[str]:
    """The files under ``root`` (relative POSIX paths), linked folders followed, as the dataset reader
    follows them (``rglob`` did not: a linked class folder was left out without a word).

    Raises:
        ValueError: a folder reached twice (a link cycle, or two links to one folder: its images would be
            read twice). FileNotFoundError: a symbolic link to nothing.
    """
    names, read = [], set()
    for folder, folders, files in os.walk(root, followlinks=True, onerror=raise_walk_error):
        real = os.path.realpath(folder)
        if real in read:
            raise ValueError(f"{folder} is a folder read already ({real}): its images would be read twice")
        read.add(real)
        folders[:] = [name for name in folders if not name.startswith(".")]  # hidden: never read
        for name in (*folders, *(name for name in files if not name.startswith("."))):
            entry = os.path.join(folder, name)
            if os.path.islink(entry) and not os.path.exists(entry):
                raise FileNotFoundError(f"{entry} is a symbolic link to nothing ({os.readlink(entry)})")
        names += [Path(folder, name).relative_to(root).as_posix() for name in files]
    return names


def center_square(image: Image.Image, short: int, crop: int) -> Image.Image:
    """Shorter side → ``short`` (aspect kept, long side truncated as torchvision's ``Resize(int)``),
    then the centre crop × crop (offsets rounded as torchvision's ``CenterCrop``)."""
    width, height = image.size
    if min(width, height) != short:
        if width <= height:
            width, height = short, int(short * height / width)
        else:
            width, height = int(short * width / height), short
        image = image.resize((width, height), Image.BICUBIC)
    if (width, height) == (crop, crop):
        return image
    left, top = round((width - crop) / 2), round((height - crop) / 2)
    return image.crop((left, top, left + crop, top + crop))


def resized_crop_box(
    width: int,
    height: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: random.Random,
) -> tuple[int, int, int, int]:
    """timm's ``RandomResizedCropAndInterpolation.get_params`` (DeiT's train crop) for a width × height
    image: up to ten draws of an area ``U(scale)`` × the image's and an aspect ratio log-uniform in
    ``ratio``, the first that fits placed uniformly; else the centre crop of the whole image with its
    aspect clamped to ``ratio``. Same draws as timm's from the same ``random`` state, except that a box
    of width or height 0 (timm's on images of a few pixels) does not fit, as in torchvision's.

    Returns:
        (top, left, crop height, crop width) in pixels.
    """
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = rng.uniform(*scale) * area
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:  # timm's lacks the 0 <: an empty box on a tiny image
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    w, h = width, height  # the fallback: the whole image, cut to the nearest allowed aspect
    if width / height < min(ratio):
        h = round(w / min(ratio))
    elif width / height > max(ratio):
        w = round(h * max(ratio))
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop(
    image: Image.Image,
    size: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: random.Random,
) -> Image.Image:
    """DeiT's RandomResizedCrop (timm's, bicubic): a box of :func:`resized_crop_box` from the whole
    image at its own resolution, cut out and resized to size × size with PIL's bicubic filter (which
    widens its support when it shrinks, as timm's PIL transform does)."""
    top, left, h, w = resized_crop_box(*image.size, scale, ratio, rng)
    return image.crop((left, top, left + w, top + h)).resize((size, size), Image.BICUBIC)


def load_images(
    path: str | Path,
    *,
    size: int,
    channels: int = 3,
    split: str | None = None,
    limit: int | None = None,
    crop_pct: float = 1.0,
) -> tuple[Tensor, list[str]]:
    """Read images spread evenly over the classes, preprocessed as evaluation does.

    Args:
        path: a folder or a ``.tar``/``.tar.gz`` archive with ``[split/]class/image`` entries.
        size: output side: the shorter side is resized (bicubic) to ``int(size / crop_pct)`` and the
            centre size × size kept, as :class:`~neutreno.data.datasets.ImageClassificationDataset`
            evaluates (DeiT: crop_pct 0.875). They were squashed to size × size, which evaluation
            never does. channels: 3 (RGB) or 1 (grayscale).
        split: a top-level folder to read (e.g. ``"val"``); None reads every image.
        limit: the most images to read (>= 1).
    Images are torchvision's suffixes in any case; hidden files and folders (``._x.jpg``, ``.x/``) are
    skipped, and an archive's hard links are read as their targets.
    Returns:
        (images (N, channels, size, size) float32 in [0, 1], the file names).
    Raises:
        FileNotFoundError: no such path, or no images in it. ValueError: an unreadable image (named), a
            file that is not a tar archive, a damaged archive, or a limit below 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    short = int(size / crop_pct)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such image folder or archive: {path}")
    prefix = f"{split}/" if split else ""
    mode = "RGB" if channels == 3 else "L"

    def keep(name: str) -> bool:
        return is_image_name(name) and name.startswith(prefix) and not is_hidden(name.split("/"))

    def decode(data: bytes, name: str) -> Tensor:
        try:
            image = center_square(to_8_bits(Image.open(io.BytesIO(data))).convert(mode), short, size)
        except Exception as error:
            raise ValueError(f"cannot read image {name}: {image_error(error)}") from None
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array.reshape(size, size, channels)).permute(2, 0, 1)

    def class_of(name: str) -> str:
        if split:  # split/class/…: the class folder, however deep its images lie
            parts = name.removeprefix(prefix).split("/")
            return parts[0] if len(parts) > 1 else ""
        return name.rsplit("/", 2)[-2] if name.count("/") else ""

    if path.is_dir():
        top = path / split if split else path  # only the split's folders: another may hold link targets
        names = [f"{prefix}{n}" for n in files_under(top)] if top.is_dir() else []
        names = _spread([n for n in names if keep(n)], limit, class_of)
        images = [decode((path / n).read_bytes(), str(path / n)) for n in names]
    else:
        with open_archive(path, f"{path} is not an image folder or archive (.tar, .tar.gz)") as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers() if is_file_member(m)}
            check_archive_end(tar, path)  # before extracting, which moves about the stream
            for name, member in members.items():
                if (
                    member.issym()
                    and name.startswith(prefix)
                    and not is_hidden(name.split("/"))
                    and not is_image_name(name)
                ):
                    refuse_folder_link(tar, member)  # a folder's reader follows it: the same images here
            names = _spread([n for n in members if keep(n)], limit, class_of)
            seen: dict[int, bytes] = {}
            images = [decode(member_bytes(tar, members[n], seen), f"{path}:{n}") for n in names]
    if not images:
        raise FileNotFoundError(f"no images under {path}{' in ' + split if split else ''}")
    return torch.stack(images), names


def normalize_imagenet(images: Tensor) -> Tensor:
    """RGB images in [0, 1] (N, 3, H, W) → ImageNet mean/std normalised (DeiT's preprocessing).

    Raises:
        TypeError: integer images (uint8: scale them to [0, 1] first).
    """
    if not images.is_floating_point():
        raise TypeError(f"normalize_imagenet takes float images in [0, 1], got {images.dtype}")
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (images - mean) / std

"""Images from an ImageFolder-layout folder or .tar/.tar.gz archive (``[split/]class/file``), as
used by ImageNet, CIFAR folder dumps and ``../shared/data``: decoded with PIL, converted to RGB or
grayscale, resized, scaled to [0, 1]."""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from neutreno.constants import IMAGENET_MEAN, IMAGENET_STD
from neutreno.data.files import (
    check_archive_end,
    is_file_member,
    is_hidden,
    is_image_name,
    member_bytes,
    open_archive,
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


def load_images(
    path: str | Path, *, size: int, channels: int = 3, split: str | None = None, limit: int | None = None
) -> tuple[Tensor, list[str]]:
    """Read images spread evenly over the classes.

    Args:
        path: a folder or a ``.tar``/``.tar.gz`` archive with ``[split/]class/image`` entries.
        size: output side (images are resized to size × size). channels: 3 (RGB) or 1 (grayscale).
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
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such image folder or archive: {path}")
    prefix = f"{split}/" if split else ""
    mode = "RGB" if channels == 3 else "L"

    def keep(name: str) -> bool:
        return is_image_name(name) and name.startswith(prefix) and not is_hidden(name.split("/"))

    def decode(data: bytes, name: str) -> Tensor:
        try:
            image = to_8_bits(Image.open(io.BytesIO(data))).convert(mode).resize((size, size), Image.BILINEAR)
        except Exception as error:
            raise ValueError(f"cannot read image {name}: {error}") from None
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array.reshape(size, size, channels)).permute(2, 0, 1)

    def class_of(name: str) -> str:
        return name.rsplit("/", 2)[-2] if name.count("/") else ""

    if path.is_dir():
        names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        names = _spread([n for n in names if keep(n)], limit, class_of)
        images = [decode((path / n).read_bytes(), str(path / n)) for n in names]
    else:
        with open_archive(path, f"{path} is not an image folder or archive (.tar, .tar.gz)") as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers() if is_file_member(m)}
            check_archive_end(tar, path)  # before extracting, which moves about the stream
            names = _spread([n for n in members if keep(n)], limit, class_of)
            seen: dict[str, bytes] = {}
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

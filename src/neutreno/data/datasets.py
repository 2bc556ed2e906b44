"""Image-classification datasets for training: an ImageNet ``ImageFolder`` folder or ``.tar``/``.tar.gz``
archive (``<split>/<class>/<image>``), CIFAR-10/100 in the official python-pickle format, or
scikit-learn's digits. Images are decoded with PIL in ``__getitem__`` (i.e. in the DataLoader workers)
and brought to a square uint8 tensor: for training, by DeiT's RandomResizedCrop from the whole image,
drawn from a seed the sampler hands with each index (so a resumed run sees exactly the same pixels);
the rest of the augmentation happens later, on the device."""

from __future__ import annotations

import copy
import io
import math
import os
import pickle
import random
import typing
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from neutreno.data.digits import load_digits_split
from neutreno.data.files import (
    IMAGE_SUFFIXES,
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
from neutreno.data.images import center_square, random_resized_crop

# folder name → (meta file, class-names key, labels key, data files per split)
CIFAR_LAYOUTS = {
    "cifar-10-batches-py": (
        "batches.meta",
        b"label_names",
        b"labels",
        {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
    ),
    "cifar-100-python": ("meta", b"fine_label_names", b"fine_labels", {"train": ["train"], "test": ["test"]}),
}


class UnreadableImageError(ValueError):
    """An image that PIL cannot decode: ``"cannot read image <path-or-archive:member>: <reason>"``."""


class ImageClassificationDataset(Dataset):
    """Labelled images, each decoded on demand to a uint8 (C, S, S) tensor.

    ``items`` holds either file paths (read in the worker), encoded image bytes (from an archive) or a
    uint8 array (N, H, W, C) of decoded pixels (CIFAR, digits); all pickle cheaply enough for workers.
    Geometry (PIL, bicubic): with ``crop_scale`` (training), DeiT's RandomResizedCrop
    (:func:`~neutreno.data.images.random_resized_crop`: area fraction ``crop_scale``, aspect
    ``crop_ratio``) from the whole image at its own resolution, resized to S = ``size``; otherwise with
    ``train`` the shorter side is resized to S = ``load_size or size`` and the centre S² kept, and for
    evaluation (DeiT's) the shorter side goes to ``int(size / crop_pct)`` and the centre S = ``size``
    is kept. An image already at the target size is not resampled.

    The crop's draws come from ``random.Random(seed)`` when the key is ``(index, seed)`` (what
    :class:`~neutreno.data.sampler.ResumableSampler` yields with ``item_seeds``), else from the
    process's ``random`` module (seeded per DataLoader worker by torch), as timm's transform draws.
    """

    def __init__(
        self,
        classes: list[str],
        labels: list[int],
        items: list[str] | list[bytes] | np.ndarray,
        names: list[str] | None = None,
        *,
        size: int,
        train: bool,
        load_size: int | None = None,
        crop_pct: float = 0.875,
        crop_scale: tuple[float, float] | None = None,
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        channels: int = 3,
        skip_bad: bool = False,
    ) -> None:
        _check_arguments(size, load_size, crop_pct, channels, train, crop_scale, crop_ratio)
        self.classes, self.labels, self.items, self.names = classes, labels, items, names
        self.channels, self.skip_bad = channels, skip_bad
        self.crop = (tuple(crop_scale), tuple(crop_ratio)) if crop_scale is not None else None
        self.output_size = (load_size or size) if train else size  # S of the returned (C, S, S)
        self.resize_to = self.output_size if train else int(size / crop_pct)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: list[int]) -> ImageClassificationDataset:
        """The same dataset (classes, geometry) restricted to ``indices``, in that order."""
        chosen = copy.copy(self)
        items = self.items
        chosen.items = items[indices] if isinstance(items, np.ndarray) else [items[i] for i in indices]
        chosen.labels = [self.labels[i] for i in indices]
        chosen.names = [self.names[i] for i in indices] if self.names else self.names
        return chosen

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int] | None:
        """(image uint8 (C, S, S), label) of ``key``, an index or (index, crop seed); None for an
        unreadable image when ``skip_bad``."""
        index, seed = key if isinstance(key, tuple) else (key, None)
        mode = "RGB" if self.channels == 3 else "L"
        item = self.items[index]
        if isinstance(item, np.ndarray):
            image = Image.fromarray(item[..., 0] if item.shape[-1] == 1 else item).convert(mode)
        else:
            try:
                data = item if isinstance(item, bytes) else Path(item).read_bytes()
                with Image.open(io.BytesIO(data)) as opened:
                    image = to_8_bits(opened).convert(mode)  # decodes every pixel: truncated files fail here
            except Exception as error:  # PIL raises many types for bad data; all mean "unreadable"
                if self.skip_bad:
                    return None
                name = self.names[index] if self.names else item
                raise UnreadableImageError(f"cannot read image {name}: {image_error(error)}") from None
        if self.crop is not None:
            draws = random if seed is None else random.Random(seed)
            image = random_resized_crop(image, self.output_size, *self.crop, draws)
        else:
            image = center_square(image, self.resize_to, self.output_size)
        array = np.array(image, dtype=np.uint8)
        array = array.reshape(self.output_size, self.output_size, self.channels)
        return torch.from_numpy(array).permute(2, 0, 1).contiguous(), self.labels[index]


def _check_arguments(
    size: int,
    load_size: int | None,
    crop_pct: float,
    channels: int,
    train: bool = True,
    crop_scale: tuple[float, float] | None = None,
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> None:
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if load_size is not None and load_size < 1:
        raise ValueError(f"load_size must be >= 1, got {load_size}")
    if crop_scale is not None:
        if not train:
            raise ValueError("a random crop (crop_scale) is for training sets only")
        if load_size is not None and load_size != size:  # the crop is taken at the image's own resolution
            raise ValueError(f"load_size {load_size} has no use with a random crop (crop_scale), which is "
                             f"taken from the whole image and resized to size {size}")  # fmt: skip
        if not (0 < crop_scale[0] <= crop_scale[1] <= 1 and 0 < crop_ratio[0] <= crop_ratio[1]):
            raise ValueError(f"need 0 < crop_scale low <= high <= 1 and 0 < crop_ratio low <= high, got "
                             f"{tuple(crop_scale)}, {tuple(crop_ratio)}")  # fmt: skip
    if not 0 < crop_pct <= 1:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")


def collate_images(batch: list[tuple[Tensor, int] | None]) -> tuple[Tensor, Tensor, int]:
    """DataLoader ``collate_fn``: drop the None (unreadable) items and stack the rest.

    Returns:
        (images uint8 (B, C, S, S), labels int64 (B,), number of items dropped). When every item was
        dropped, images and labels are empty tensors of shape (0,) (their C and S are unknown here).
    """
    kept = [item for item in batch if item is not None]
    if not kept:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), len(batch)
    images = torch.stack([image for image, _ in kept])
    return images, torch.tensor([label for _, label in kept], dtype=torch.int64), len(batch) - len(kept)


def class_difference(first: list[str], second: list[str], names: tuple[str, str]) -> str:
    """How two class lists differ, for an error: the names only in each (``ascii``, so that a composed
    and a decomposed "café" look apart), a hint where they agree in Unicode's NFC form, or that they
    hold the same names in another order."""
    import unicodedata

    only_first = [c for c in first if c not in second]
    only_second = [c for c in second if c not in first]
    if not only_first and not only_second:
        at = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        return f"the same {len(first)} classes in another order (at {at}: {first[at]!a} vs {second[at]!a})"
    shown = f"only in {names[0]}: {only_first[:5]!a}, only in {names[1]}: {only_second[:5]!a}"
    composed = [sorted(unicodedata.normalize("NFC", c) for c in side) for side in (first, second)]
    if composed[0] == composed[1]:
        shown += " (the same names in Unicode's NFC form: one side's names are decomposed, NFD)"
    return shown


def balanced_indices(labels: list[int], limit: int) -> list[int]:
    """The indices of a class-balanced subset of ``limit`` samples: the first samples of each class, taken
    round-robin over the classes in label order (deterministic; every class gets ⌊limit/K⌋ or one more,
    as far as it has samples)."""
    if limit < 1:
        raise ValueError(f"a subset needs at least one sample, got limit {limit}")
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    queues = [by_class[label] for label in sorted(by_class)]
    picked: list[int] = []
    for rank in range(max(map(len, queues), default=0)):
        picked += [queue[rank] for queue in queues if rank < len(queue)]
        if len(picked) >= limit:
            break
    return sorted(picked[:limit])


def _subfolders(path: Path) -> list[str]:
    """The visible folders in ``path``, sorted. A symbolic link to nothing (a folder on a disk not
    mounted) is an error: left out, its class would vanish and every later class's label shift."""
    with os.scandir(path) as entries:
        visible = [e for e in entries if not e.name.startswith(".")]
    dangling = [e.path for e in visible if e.is_symlink() and not os.path.exists(e.path)]
    if dangling:
        raise FileNotFoundError(f"{dangling[0]} is a symbolic link to nothing ({os.readlink(dangling[0])})")
    return sorted(e.name for e in visible if e.is_dir())


def _folder_images(folder: Path, read: set[str]) -> list[str]:
    """The image files under a class folder at any depth, in torchvision's ``ImageFolder`` order (folder
    path, then file name); hidden files and folders (``._x.jpg``, ``.thumbs/``) skipped, links followed.
    ``read``: the real paths of the folders read so far in the split, this one's added; a folder reached
    again (a link cycle, a link to a folder of the split) is an error, as in an archive: its images
    would be read twice, or under another class's label."""
    found = []
    for path, folders, files in os.walk(folder, followlinks=True, onerror=raise_walk_error):
        real = os.path.realpath(path)
        if real in read:
            raise ValueError(
                f"{path} is a folder read already ({real}): a link to a folder of the split, or a link "
                "cycle, would read its images twice"
            )
        read.add(real)
        folders[:] = [name for name in folders if not name.startswith(".")]
        found += [(path, name) for name in files if not name.startswith(".") and is_image_name(name)]
    return [os.path.join(path, name) for path, name in sorted(found)]


def _check_classes(classes: list[str], counts: Counter, where: str | Path, loose: int = 0) -> None:
    """As torchvision's ``ImageFolder``: a split needs images, and every class folder at least one.
    ``loose``: images lying in the split itself, outside any class folder (ImageNet's flat val)."""
    if not counts and loose:  # "no images under" a folder full of them
        raise FileNotFoundError(
            f"{where} holds {loose} image(s) but no class folders: a split is <split>/<class>/<images> "
            "(ImageNet's validation images must first be sorted into class folders, by the devkit's labels)"
        )
    if not counts:
        raise FileNotFoundError(f"no images under {where}")
    empty = [name for name in classes if not counts[name]]
    if empty:
        raise ValueError(
            f"no image in the class folder(s) {', '.join(empty)} of {where} "
            f"(image suffixes: {' '.join(IMAGE_SUFFIXES)})"
        )


def _no_split(split: str, root: str | Path, found: list[str]) -> FileNotFoundError:
    return FileNotFoundError(f"no '{split}' split in {root} (found: {', '.join(found) or 'nothing'})")


class _PickledNdarray:
    """What a CIFAR pickle names as ``numpy.ndarray``: only a marker that :class:`_PickledArray` checks."""


class _PickledDtype:
    """A stand-in for ``numpy.dtype`` in a CIFAR pickle: plain numbers only (bool, int, uint, float), the
    byte order from the state, its flags byte ignored (numpy's own ``__setstate__`` took a forged one:
    an object dtype whose "pointers" were the file's bytes, and a segfault)."""

    def __init__(self, spec: object, align: object = False, copy: object = True) -> None:
        if not isinstance(spec, str):
            raise pickle.UnpicklingError(f"a dtype given as {type(spec).__name__}")
        dtype = np.dtype(spec)
        if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
            raise pickle.UnpicklingError(f"refusing dtype {spec!r}: CIFAR files hold plain numbers")
        self.dtype = dtype

    def __setstate__(self, state: object) -> None:  # (version, byte order, subarray, names, fields, …)
        if not isinstance(state, tuple) or len(state) < 5 or state[2:5] != (None, None, None):
            raise pickle.UnpicklingError("refusing a dtype state with fields or subarrays")
        if state[1] in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(state[1])
        elif state[1] not in ("|", "="):
            raise pickle.UnpicklingError(f"a dtype of byte order {state[1]!r}")


class _PickledArray:
    """A stand-in for numpy's ``_reconstruct``: the array built with ``np.frombuffer`` from raw bytes of
    exactly its shape × item size (numpy's ``__setstate__`` never sees the file's state)."""

    def __init__(self, subtype: object, shape: object, typecode: object) -> None:
        if subtype is not _PickledNdarray:
            raise pickle.UnpicklingError("_reconstruct of something other than an ndarray")
        self.array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("an ndarray state of another form")
        _, shape, dtype, fortran, raw = state
        if not isinstance(dtype, _PickledDtype) or not isinstance(raw, (bytes, bytearray)):
            raise pickle.UnpicklingError("an ndarray whose data are not raw bytes of a plain dtype")
        if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise pickle.UnpicklingError(f"an ndarray of shape {shape!r}")
        if math.prod(shape) * dtype.dtype.itemsize != len(raw):
            raise pickle.UnpicklingError(f"{len(raw)} bytes for an array {shape} of {dtype.dtype}")
        order = "F" if fortran else "C"
        self.array = np.frombuffer(raw, dtype.dtype).reshape(shape, order=order).copy()


def _utf8_or_latin1(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles written by Python 3 use it for bytes: two codecs only."""
    return text.encode("latin1" if encoding == "latin1" else "utf-8")


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what the CIFAR files hold: containers, numbers, bytes and numpy arrays of plain
    numbers, through stand-ins (no numpy code runs on the file's state). Any other global
    (``os.system``, …) is refused, so a crafted file can neither run code nor corrupt memory."""

    STAND_INS: typing.ClassVar[dict[tuple[str, str], object]] = {
        ("numpy.core.multiarray", "_reconstruct"): _PickledArray,
        ("numpy._core.multiarray", "_reconstruct"): _PickledArray,
        ("numpy", "ndarray"): _PickledNdarray,
        ("numpy", "dtype"): _PickledDtype,
        ("_codecs", "encode"): _utf8_or_latin1,  # how protocol-2 pickles written by Python 3 store bytes
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.STAND_INS:
            return self.STAND_INS[(module, name)]
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: CIFAR files hold only arrays")


def _arrays_of(loaded: object) -> object:
    """The unpickled object with each :class:`_PickledArray` replaced by its numpy array."""
    if isinstance(loaded, _PickledArray):
        if loaded.array is None:
            raise pickle.UnpicklingError("an ndarray without its data")
        return loaded.array
    if isinstance(loaded, (_PickledDtype, _PickledNdarray)) or loaded is _PickledNdarray:
        raise pickle.UnpicklingError("a bare dtype or ndarray class")
    if isinstance(loaded, dict):
        return {key: _arrays_of(value) for key, value in loaded.items()}
    if isinstance(loaded, (list, tuple)):
        return type(loaded)(_arrays_of(value) for value in loaded)
    return loaded


def _load_cifar_pickle(data: bytes, name: str) -> dict:
    try:
        loaded = _arrays_of(_CifarUnpickler(io.BytesIO(data), encoding="bytes").load())
    except Exception as error:  # UnpicklingError, EOFError, … from a damaged or crafted file
        raise ValueError(f"{name} is not a CIFAR pickle ({error})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{name} is not a CIFAR pickle (it holds a {type(loaded).__name__})")
    return loaded


def _cifar(
    read: Callable[[str], bytes], layout: str, split: str, root: Path, **kwargs
) -> ImageClassificationDataset:
    """CIFAR from its pickles; ``read(file name)`` gives a file's bytes. They are unpickled by
    :func:`_load_cifar_pickle`, which builds only plain containers and numpy arrays (no code runs)."""
    meta_file, names_key, labels_key, files = CIFAR_LAYOUTS[layout]
    split = "test" if split == "val" else split  # CIFAR has no val split
    if split not in files:
        raise _no_split(split, root, ["train", "test"])
    try:
        classes = [name.decode() for name in _load_cifar_pickle(read(meta_file), meta_file)[names_key]]
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"{meta_file} is not a CIFAR meta file (no list of class names)") from None
    rows, labels = [], []
    for name in files[split]:
        batch = _load_cifar_pickle(read(name), name)
        try:
            data = np.asarray(batch[b"data"])
            own = [int(label) for label in batch[labels_key]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name} is not a CIFAR batch (no data rows and labels)") from None
        # a batch with a row fewer than its labels shifted every later image's label by one, silently
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape != (len(own), 3 * 32 * 32):
            raise ValueError(
                f"{name} is damaged: {len(own)} labels for data of shape {data.shape} ({data.dtype}); "
                f"a CIFAR batch holds one row of {3 * 32 * 32} bytes per label"
            )
        wrong = sorted({label for label in own if not 0 <= label < len(classes)})
        if wrong:
            raise ValueError(
                f"{name} has labels {wrong[:5]} outside its {len(classes)} classes ({meta_file})"
            )
        rows.append(data)
        labels += own
    # rows are 3 × 32 × 32 planes (R, G, B) → (N, 32, 32, 3)
    pixels = np.ascontiguousarray(np.concatenate(rows).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return ImageClassificationDataset(classes, labels, pixels, **kwargs)


def open_image_dataset(
    root: str | Path,
    split: str,
    *,
    size: int,
    train: bool,
    load_size: int | None = None,
    crop_pct: float = 0.875,
    crop_scale: tuple[float, float] | None = None,
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
    channels: int = 3,
    skip_bad: bool = False,
) -> ImageClassificationDataset:
    """Open one split of an image-classification dataset, detected from ``root``:

    - a folder ``root/<split>/<class>/<image>`` (ImageNet ``ImageFolder``; images read lazily);
    - a ``.tar``/``.tar.gz`` archive with that layout: the split's encoded images are read into memory
      once (gzip can't seek), fine for tens of MB; extract big archives (ImageNet) into a folder;
    - CIFAR-10/100 python pickles: ``cifar-10-batches-py``/``cifar-100-python``, its parent folder or the
      official ``cifar-1*-python.tar.gz`` (splits "train" and "test", "val" = "test"). This unpickles:
      give only trusted CIFAR files;
    - ``"digits"``: scikit-learn's 8×8 digits (``load_digits_split``, seed 0), 0–16 scaled to 0–255.

    Folders and archives follow torchvision's ``ImageFolder``: classes are the sorted class-folder names
    (label = index); a class's images are its files at any depth with torchvision's suffixes
    (``IMAGE_SUFFIXES``, any case), ordered by (class, folder path, file name); every class folder needs
    an image. Hidden names (``.DS_Store``, macOS's ``._x.jpg``, ``.thumbs/``) are skipped at every
    level; an archive's hard links are read as their targets, and it is read to its end, so a damaged
    one is an error rather than a smaller dataset. 16-bit grayscale images are scaled to 8 bits.
    Geometry and the other arguments: see ``ImageClassificationDataset``.

    Raises:
        FileNotFoundError: no such root, no such split, or no images in it. ValueError: a bad argument,
        an unreadable or damaged archive, or a class folder without images. UnreadableImageError comes
        later, from ``__getitem__`` (also for a 32-bit image, PIL mode ``I`` or ``F``).
    """
    _check_arguments(size, load_size, crop_pct, channels, train, crop_scale, crop_ratio)
    kwargs = dict(
        size=size,
        train=train,
        load_size=load_size,
        crop_pct=crop_pct,
        crop_scale=crop_scale,
        crop_ratio=crop_ratio,
        channels=channels,
    )
    if str(root) == "digits":
        if split not in ("train", "test", "val"):
            raise _no_split(split, root, ["train", "test"])
        x_train, y_train, x_test, y_test = load_digits_split()
        x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
        pixels = torch.round(x * 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()  # x = raw / 16 exactly
        return ImageClassificationDataset([str(d) for d in range(10)], y.tolist(), pixels, **kwargs)
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such dataset folder or archive: {root}")
    kwargs["skip_bad"] = skip_bad
    if root.is_dir():
        for folder in (root, *(root / layout for layout in CIFAR_LAYOUTS)):
            for layout, (meta_file, _, _, files) in CIFAR_LAYOUTS.items():
                # "train"/"test" are files in CIFAR-100 but folders in an ImageFolder
                if (folder / meta_file).is_file() and (folder / files["test"][0]).is_file():
                    return _cifar(
                        lambda name, f=folder: (f / name).read_bytes(), layout, split, root, **kwargs
                    )
        if not (root / split).is_dir():
            raise _no_split(split, root, _subfolders(root))
        classes, paths, labels = _subfolders(root / split), [], []
        read = {os.path.realpath(root / split)}  # the split itself: a link to it reads every class again
        for label, name in enumerate(classes):
            files = _folder_images(root / split / name, read)
            paths += files
            labels += [label] * len(files)
        loose = (
            sum(1 for p in (root / split).iterdir() if p.is_file() and is_image_name(p.name))
            if not labels
            else 0
        )
        _check_classes(classes, Counter(classes[label] for label in labels), root / split, loose)
        return ImageClassificationDataset(classes, labels, paths, paths, **kwargs)
    return _open_archive(root, split, kwargs)


def _open_archive(root: Path, split: str, kwargs: dict) -> ImageClassificationDataset:
    """One sequential pass over the archive keeping only the bytes needed (the split's images, or the
    CIFAR meta and split files), then a read to its end (:func:`check_archive_end`). A class is a folder
    ``<split>/<class>``, from its own entry or the paths under it; its images may lie at any depth."""
    cifar_split = "test" if split == "val" else split
    tops, class_names, blobs, seen = set(), set(), {}, {}
    loose = 0  # images in the split itself, outside any class folder
    not_archive = f"{root} is not an image folder, an image archive (.tar, .tar.gz) or CIFAR's pickles"
    with open_archive(root, not_archive) as tar:
        for member in tar:
            parts = [part for part in member.name.split("/") if part not in ("", ".")]
            if not parts or (len(parts) == 1 and not member.isdir()):
                continue
            tops.add(parts[0])
            if parts[0] in CIFAR_LAYOUTS and len(parts) == 2 and is_file_member(member):
                meta_file, _, _, files = CIFAR_LAYOUTS[parts[0]]
                if parts[1] == meta_file or parts[1] in files.get(cifar_split, []):
                    blobs[parts[1]] = member_bytes(tar, member, seen)
            elif parts[0] == split and len(parts) >= 2 and not parts[1].startswith("."):
                if member.issym() and not is_hidden(parts[2:]) and not is_image_name(parts[-1]):
                    refuse_folder_link(tar, member)  # a class, or a folder in one, the folder's reader reads
                if len(parts) >= 3 or member.isdir():
                    class_names.add(parts[1])
                loose += len(parts) == 2 and is_file_member(member) and is_image_name(parts[1])
                if (
                    len(parts) >= 3
                    and is_file_member(member)
                    and not is_hidden(parts[2:])
                    and is_image_name(parts[-1])
                ):
                    blobs[tuple(parts[1:])] = member_bytes(tar, member, seen)
        check_archive_end(tar, root)
    layout = next((layout for layout in CIFAR_LAYOUTS if layout in tops), None)
    if layout is not None:

        def read(name: str) -> bytes:
            if name not in blobs:
                raise FileNotFoundError(f"no {layout}/{name} in {root}")
            return blobs[name]

        return _cifar(read, layout, split, root, **kwargs)
    if split not in tops:
        raise _no_split(split, root, sorted(tops))
    classes = sorted(class_names)
    _check_classes(classes, Counter(key[0] for key in blobs), f"{root}:{split}", loose)
    label_of = {name: label for label, name in enumerate(classes)}
    # torchvision's order: class, then the folder path within it, then the file name
    keys = sorted(blobs, key=lambda key: (label_of[key[0]], "/".join(key[:-1]), key[-1]))
    names = [f"{root}:{split}/{'/'.join(key)}" for key in keys]
    return ImageClassificationDataset(
        classes, [label_of[key[0]] for key in keys], [blobs[key] for key in keys], names, **kwargs
    )

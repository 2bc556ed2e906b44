"""Corruption robustness of a saved classifier (math.md §4's ImageNet-C row), ``neutreno robustness``.

Each image is decoded and preprocessed once (resize, centre crop), then scored clean and under every
corruption × severity of :mod:`neutreno.data.corruptions` (image i of the evaluated set draws from seed
``seed + i``, so two models see identical corrupted images). The errors give Hendrycks & Dietterich's
corruption error CE_c = Σ_s E_{s,c} / Σ_s E^base_{s,c} against a baseline model run the same way, or
mean_s E_{s,c} / E^AlexNet_c against AlexNet's published ImageNet-C errors, and mCE, the mean of CE_c.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset

from neutreno.constants import SEED_LIMIT
from neutreno.data.corruptions import (
    CORRUPTIONS,
    CORRUPTIONS_VERSION,
    SEVERITIES,
    check_severity,
    corrupt,
    resolve_preset,
    stored_as_imagenet_c,
)
from neutreno.data.datasets import CIFAR_LAYOUTS, collate_images
from neutreno.data.images import files_under
from neutreno.evaluation.classification import classification_sums, open_classifier, summarize_classification
from neutreno.evaluation.metric import MetricSums
from neutreno.io import atomic_path
from neutreno.progress import progress, write

# AlexNet's top-1 error on ImageNet-C, the mean over the 5 severities (Hendrycks & Dietterich, 2019), for
# the corruptions we implement as ImageNet-C does that its mCE uses (gaussian_blur and saturate are its
# extras; our elastic_transform's levels 1-2 are not ImageNet-C's, which would make its CE compare a milder
# corruption with AlexNet's error on the harsher one).
ALEXNET_ERRORS = {
    "gaussian_noise": 0.886428,
    "shot_noise": 0.894468,
    "impulse_noise": 0.922640,
    "defocus_blur": 0.819880,
    "motion_blur": 0.785948,
    "zoom_blur": 0.798360,
    "fog": 0.819324,
    "brightness": 0.564592,
    "contrast": 0.853204,
    "pixelate": 0.717840,
    "jpeg_compression": 0.606500,
}


def corruption_errors(
    errors: Mapping[str, Mapping[int, float]], baseline: Mapping[str, Mapping[int, float]] | str
) -> dict[str, float]:
    """CE_c in percent for the corruptions c of ``errors`` ({c: {severity: top-1 error %}}) that the
    baseline has: those in ``baseline``, another model's errors in the same layout
    (CE_c = Σ_s E_{s,c} / Σ_s E^base_{s,c}), or with ``"alexnet"`` those in :data:`ALEXNET_ERRORS`
    (CE_c = mean_s E_{s,c} / E^AlexNet_c; AlexNet's errors are means over the five severities).

    Raises:
        ValueError: an error that is not a number in [0, 100]; severities other than AlexNet's five, or
            than the baseline's on a corruption (a CE over some of them compares other difficulties).
    """
    for role, table in (("", errors), ("the baseline's ", {} if baseline == "alexnet" else baseline)):
        for name, by_severity in table.items():
            for severity, error in by_severity.items():
                if not is_percentage(error):
                    raise ValueError(
                        f"{role}{name} severity {severity}: a top-1 error is a percentage in [0, 100], "
                        f"got {error!r}"
                    )
    ce = {}
    for name, by_severity in errors.items():
        if baseline == "alexnet":
            if name in ALEXNET_ERRORS:
                if sorted(by_severity) != [1, 2, 3, 4, 5]:
                    raise ValueError(
                        f"{name}: AlexNet's error is over severities 1–5, got {sorted(by_severity)}"
                    )
                mean = sum(by_severity.values()) / len(by_severity)
                ce[name] = mean / ALEXNET_ERRORS[name]
        elif name in baseline:
            if sorted(by_severity) != sorted(baseline[name]):
                raise ValueError(
                    f"{name}: severities {sorted(by_severity)}, the baseline's {sorted(baseline[name])}"
                )
            total = sum(baseline[name].values())
            if total == 0:
                raise ValueError(f"the baseline has no error on {name} at severities {list(by_severity)}")
            ce[name] = 100 * sum(by_severity.values()) / total
    return ce


def is_percentage(value: object) -> bool:
    """Whether ``value`` is a number in [0, 100] (NaN and infinities are not; nor are bools)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100


def mean_corruption_error(ce: Mapping[str, float]) -> float:
    """mCE: the mean of the corruption errors CE_c (percent)."""
    if not ce:
        raise ValueError("no corruption errors to average (no corruption shared with the baseline)")
    return sum(ce.values()) / len(ce)


def data_identity(data: str, split: str | None = None) -> list:
    """Which images ``data`` names, as a report records it: the resolved path (a relative one names
    other images in another folder) and, for an archive, its size and modification time, or, for a
    folder, how many files the dataset reads there and a digest of their names, sizes and modification
    times (images replaced in place are other images); the name itself where it is no path
    (``digits``)."""
    path = Path(data)
    if not path.exists():
        return [str(data)]
    if path.is_file():
        stat = path.stat()
        return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    top, names = _dataset_files(path, split)
    digest = hashlib.sha256()
    for name in names:
        stat = (top / name).stat()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return [str(path.resolve()), len(names), digest.hexdigest()[:16]]


def _dataset_files(path: Path, split: str | None) -> tuple[Path, list[str]]:
    """The folder and files (relative names) a dataset folder's split is read from: a CIFAR layout's
    pickles (not the rest of its folder, which may hold this command's --out), or the split's folder."""
    for folder in (path, *(path / layout for layout in CIFAR_LAYOUTS)):
        for meta_file, _, _, files in CIFAR_LAYOUTS.values():
            if (folder / meta_file).is_file() and (folder / files["test"][0]).is_file():
                names = [meta_file, *(name for group in files.values() for name in group)]
                return folder, [name for name in names if (folder / name).is_file()]
    top = path / split if split and (path / split).is_dir() else path
    return top, sorted(files_under(top))


def _file_identity(path: Path) -> list:
    """A file as it is now: its path, size and modification time (a retrained checkpoint differs)."""
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def _restore(resume_file: str | Path, identity: dict, metrics: dict) -> int:
    """Load the sums of an earlier, stopped run of the same evaluation into ``metrics``; the batches it
    had done (0: no file, or one of another evaluation, which is then overwritten)."""
    path = Path(resume_file)
    if not path.is_file():
        return 0
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:  # a damaged file (the writes are atomic: another program's)
        write(f"robustness: ignoring {path}, which cannot be read ({type(error).__name__}); starting afresh")
        return 0
    if not isinstance(state, dict) or state.get("identity") != identity:
        write(f"robustness: ignoring {path}: it holds the progress of another evaluation; starting afresh")
        return 0
    for metric, saved in zip(metrics.values(), state["sums"], strict=True):
        metric.load_state_dict(saved)
    write(f"robustness: continuing from batch {state['done']} ({path})")
    return int(state["done"])


def spread_indices(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over range(total) (a class-ordered dataset keeps every class)."""
    count = min(count, total)
    return [i * total // count for i in range(count)]


@torch.no_grad()
def evaluate_corruptions(
    checkpoint: str | Path,
    data: str,
    *,
    split: str = "val",
    corruptions: Sequence[str] | None = None,
    severities: Sequence[int] = SEVERITIES,
    samples: int | None = None,
    seed: int = 0,
    batch_size: int = 100,
    num_workers: int = 2,
    device: str = "auto",
    resume_file: str | Path | None = None,
    save_every_s: float = 60.0,
) -> dict:
    """Clean top-1/top-5 and the top-1 error (percent) per corruption and severity of a checkpoint.

    ``corruptions``: names of :data:`CORRUPTIONS`; None, every one the model's images can take (not
    saturate for one channel, where it changes nothing; named, it is refused).

    ``resume_file``: the sums so far are saved there (atomically, at most every ``save_every_s``
    seconds), and an evaluation stopped before its end continues from them when run again with the same
    checkpoint file, data and settings (the same numbers as one uninterrupted run); a file of another
    evaluation is ignored. The caller deletes it once the report is written.

    Returns: {"checkpoint", "data", "data_identity", "corruptions_version", "split", "samples", "images",
    "seed", "clean": {top1, top5, loss, count}, "error": {corruption: {severity: error %}}, "preprocess":
    the checkpoint's (its image size decides the corrupted images and, through ``preset="auto"``, the
    corruption settings), "classes_scored"}.
    """
    for name in corruptions or ():
        if name not in CORRUPTIONS:
            raise ValueError(f"unknown corruption {name!r}; valid: {', '.join(CORRUPTIONS)}")
    try:
        for severity in severities or [None]:
            check_severity(severity)  # integers only: 3.0 indexed a list, True counted as 1
    except ValueError:
        raise ValueError(f"severities must be among 1 … 5, got {list(severities)}") from None
    classifier = open_classifier(checkpoint, data, split, device)
    one_channel = classifier.preprocess.get("channels") == 1
    if corruptions is None:
        corruptions = [name for name in CORRUPTIONS if not (one_channel and name == "saturate")]
    if "saturate" in corruptions and one_channel:
        raise ValueError(  # its error would be the clean error, averaged into the mCE as a corruption's
            f"saturate changes nothing in one-channel images (grey stays grey), and {checkpoint} reads "
            "one channel: leave it out of the corruptions"
        )
    dataset = classifier.dataset
    if samples is not None:
        dataset = Subset(dataset, spread_indices(len(dataset), samples))
    if not 0 <= seed <= SEED_LIMIT - len(dataset):  # image i's seed + i past 2³² wrapped onto seed i − 1's
        raise ValueError(
            f"seed {seed}: image i draws from seed + i, which for {len(dataset)} images must stay below 2^32"
        )
    keys = ["clean", *((name, s) for name in corruptions for s in severities)]
    metrics = {key: MetricSums(summarize_classification, device=classifier.device) for key in keys}
    which_data = data_identity(data, split)
    identity = {
        "weights": _file_identity(classifier.weights),
        "data": which_data,
        "corruptions_version": CORRUPTIONS_VERSION,
        **{"split": split, "samples": samples, "seed": seed, "batch_size": batch_size},
        "images": len(dataset),
        "variants": [key if key == "clean" else list(key) for key in keys],
    }
    done = _restore(resume_file, identity, metrics) if resume_file is not None else 0
    total_batches = -(-len(dataset) // batch_size)
    offset = done * batch_size  # image i of the set keeps its seed: seed + i
    rest = Subset(dataset, range(offset, len(dataset))) if done else dataset
    loader = DataLoader(rest, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_images)
    saved_at = time.monotonic()
    batches = progress(
        loader, desc=f"robustness ({len(keys)} variants)", unit="batch", total=total_batches, initial=done
    )
    for images, labels, dropped in batches:
        if dropped:
            raise ValueError(f"{dropped} unreadable image(s) in {data}")
        stored = resolve_preset(images) == "imagenet"  # as ImageNet-C's files: JPEG, quality 85
        for key in keys:
            batch = images if key == "clean" else corrupt(images, key[0], key[1], seed=seed + offset)
            if stored and key != "clean":
                batch = stored_as_imagenet_c(batch)
            logits = classifier.logits(batch)
            metrics[key].update(classification_sums(logits, labels.to(logits.device)))
        offset += len(images)
        done += 1
        if resume_file is not None and done < total_batches and time.monotonic() - saved_at >= save_every_s:
            state = {"identity": identity, "done": done, "sums": [metrics[key].state_dict() for key in keys]}
            with atomic_path(resume_file) as tmp:
                torch.save(state, tmp)
            saved_at = time.monotonic()
    error = {
        name: {s: 100 - metrics[(name, s)].compute()["top1"] for s in severities} for name in corruptions
    }
    return {
        "checkpoint": str(classifier.weights),
        "data": str(data),
        "data_identity": which_data,
        "corruptions_version": CORRUPTIONS_VERSION,  # which corrupted images (a baseline's must match)
        "split": split,
        "samples": samples,  # with data and split, says which images (spread_indices) before any scoring
        "images": offset,
        "seed": seed,
        "clean": metrics["clean"].compute(),
        "error": error,
        "preprocess": dict(classifier.preprocess),
        "classes_scored": len(classifier.dataset.classes),
    }

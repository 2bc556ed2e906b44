"""scikit-learn's 8×8 handwritten digits (1,797 real images, 10 classes), offline.

Read from the CSV file scikit-learn ships, without importing scikit-learn (its import took 2.3 s of
every digits run's start, more than the run itself in tests and the demo), and split as its
``train_test_split(..., stratify=y)`` splits, index for index."""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A stratified train/test split of the digits.

    Returns:
        (x_train, y_train, x_test, y_test): images (N, 1, 8, 8) float32 scaled to [0, 1] (the raw
        pixel values are 0–16), labels (N,) int64.
    """
    pixels, labels = _digits()
    x = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels (1797, 64) float64, labels (1797,) int64): ``sklearn.datasets.load_digits``' data, read
    from its file; through scikit-learn itself if a release moves the file."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the digits ship with scikit-learn", name="sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        with gzip.open(path, "rt") as file:
            data = np.loadtxt(file, delimiter=",")
        return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target.astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices) of a stratified shuffle split: the classes keep their shares in
    both parts. The same indices as scikit-learn's ``train_test_split(..., test_size=test_fraction,
    random_state=seed, stratify=labels)`` (its ``StratifiedShuffleSplit``: per-class counts from the
    hypergeometric mode, ties broken by the seeded generator, then a permutation per class and of
    each part), so splits made with scikit-learn before stay the same."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n_test = math.ceil(test_fraction * len(labels))
    n_train = len(labels) - n_test
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if counts.min() < 2 or min(n_train, n_test) < len(counts):
        raise ValueError(f"{len(labels)} samples of {len(counts)} classes cannot be split {test_fraction}")
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed % 2**32)  # numpy takes [0, 2**32); the CLI's seeds are 64-bit
    train_counts = _approximate_mode(counts, n_train, rng)
    test_counts = _approximate_mode(counts - train_counts, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for members, n, t in zip(by_class, train_counts, test_counts, strict=True):
        shuffled = members.take(rng.permutation(len(members)))
        train.extend(shuffled[:n])
        test.extend(shuffled[n : n + t])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class draws near the mode of the multivariate hypergeometric: floor of the shares, then one
    more for the largest remainders, ties broken at random (scikit-learn's ``_approximate_mode``)."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    missing = int(draws - floored.sum())
    if missing > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            add = min(len(tied), missing)
            floored[rng.choice(tied, size=add, replace=False)] += 1
            missing -= add
            if missing == 0:
                break
    return floored.astype(np.int64)

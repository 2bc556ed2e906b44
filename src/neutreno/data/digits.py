"""scikit-learn's 8×8 handwritten digits (1,797 real images, 10 classes), offline."""

from __future__ import annotations

import torch
from torch import Tensor


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A stratified train/test split of the digits.

    Returns:
        (x_train, y_train, x_test, y_test): images (N, 1, 8, 8) float32 scaled to [0, 1] (the raw
        pixel values are 0–16), labels (N,) int64.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        torch.arange(len(y)).numpy(), test_size=test_fraction, random_state=seed, stratify=y.numpy()
    )
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]

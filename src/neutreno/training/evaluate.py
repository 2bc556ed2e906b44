"""Evaluate a saved classifier on an image dataset, preprocessing as the checkpoint records."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from neutreno.data.augment import normalize
from neutreno.data.datasets import collate_images, open_image_dataset
from neutreno.models import load_model
from neutreno.training.checkpoint import resolve_weights
from neutreno.training.classification import classification_sums, summarize_classification
from neutreno.training.distributed import resolve_device


@torch.no_grad()
def evaluate_checkpoint(
    checkpoint: str | Path,
    data: str,
    *,
    split: str = "val",
    batch_size: int = 256,
    num_workers: int = 2,
    ema: bool = False,
    device: str = "auto",
) -> dict:
    """Top-1/top-5 accuracy (percent), mean loss and image count of a checkpoint on ``data``/``split``.

    The checkpoint's metadata gives the preprocessing (size, crop, mean/std) and class names; a dataset
    whose class names differ is refused rather than scored against the wrong labels.
    """
    weights = resolve_weights(checkpoint)
    if ema:
        weights = weights.with_name("ema.safetensors")
        if not weights.is_file():
            raise FileNotFoundError(f"no EMA weights beside the checkpoint: {weights}")
    model, meta = load_model(weights)
    pre = meta.get("preprocess")
    if pre is None:
        raise ValueError(f"{weights} records no preprocessing (not written by neutreno train)")
    dataset = open_image_dataset(
        data, split, size=pre["image_size"], train=False, crop_pct=pre["crop_pct"], channels=pre["channels"]
    )
    if "classes" in meta and list(dataset.classes) != list(meta["classes"]):
        raise ValueError(
            f"{data} ({split}) has classes {list(dataset.classes)[:4]}…, the checkpoint was trained "
            f"on {list(meta['classes'])[:4]}…"
        )
    target = resolve_device(device)
    model.to(target)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_images)
    sums: dict[str, float] = {}
    for images, labels, _ in tqdm(loader, desc="eval", unit="batch", leave=False):
        logits = model(normalize(images.to(target), pre["mean"], pre["std"]))
        for key, value in classification_sums(logits, labels.to(target)).items():
            sums[key] = sums.get(key, 0.0) + value.item()
    return {"checkpoint": str(weights), "data": str(data), "split": split, **summarize_classification(sums)}

"""Semantic segmentation (math.md §4 Segmenter): its config and the task the training engine runs.

Workers decode (image, mask) pairs at their own size; on the training device each pair gets the
joint rescale/crop/flip/photometric augmentation (torch's RNG, so a resumed run repeats it), and the
loss is the pixel cross-entropy of the upsampled logits, ignoring ``ignore_index``. Validation during
training is single-scale sliding-window inference, scored from one confusion matrix; the inference and
the scores are :mod:`neutreno.evaluation.segmentation`'s.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.config import (
    check,
    check_attention,
    check_model_args,
    check_model_builds,
    check_named,
    check_normalization,
    check_num_workers,
)
from neutreno.data.augment import normalize
from neutreno.data.images import IMAGENET_MEAN, IMAGENET_STD
from neutreno.data.segmentation import augment_pair, open_segmentation_dataset
from neutreno.deprecation import moved_names
from neutreno.evaluation.metric import NonFiniteOutputs
from neutreno.evaluation.segmentation import confusion_matrix, segment_probabilities, segmentation_scores
from neutreno.models import create_model, list_models, read_state_dict
from neutreno.models.checkpoint import refuse_another_model
from neutreno.progress import note
from neutreno.training.checkpoint import resolve_weights
from neutreno.training.engine import OptimConfig, TrainConfig

# The inference and scores moved to neutreno.evaluation.segmentation (issue 20): those the task uses are
# imported above, these others still import from here, with a DeprecationWarning.
__getattr__ = moved_names(
    __name__,
    {name: f"neutreno.evaluation.segmentation:{name}" for name in ("MS_SCALES", "sliding_window_logits")},
)


# ---- config and task ------------------------------------------------------------------------------------


@dataclasses.dataclass
class SegmenterConfig:
    name: str = "segmenter_tiny"  # segmenter_tiny or segmenter_small
    attention: str = "softmax"  # math.md §2; used in the encoder and the mask-transformer decoder
    lam: float | None = None  # λ of the NeuTRENO variants (null: DEFAULT_LAM, 0.6)
    decoder: str = "mask_transformer"  # or linear
    drop_path_rate: float = 0.1  # encoder stochastic depth
    backbone: str | None = (
        None  # classification weights for the encoder: ours, or timm/DeiT .pth/.safetensors
    )
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # other constructor overrides

    def __post_init__(self) -> None:
        names = list_models("segmenter_*")
        check(
            self.name in names, "name", f"unknown segmentation model {self.name!r}; one of {', '.join(names)}"
        )
        check_attention(self.attention, self.lam)
        # an empty one (an unset shell variable in --set model.backbone=$CKPT) trained from random weights
        check(
            self.backbone is None or bool(self.backbone.strip()), "backbone",
            "must name weights, got an empty string (null: random weights)",
        )  # fmt: skip
        check(self.decoder in ("linear", "mask_transformer"), "decoder", "must be linear or mask_transformer")
        check(0 <= self.drop_path_rate < 1, "drop_path_rate", f"must be in [0, 1), got {self.drop_path_rate}")
        check_model_args(
            self.args, ("attention", "lam", "decoder", "drop_path_rate"), ("num_classes", "img_size")
        )


@dataclasses.dataclass
class SegmentationDataConfig:
    """A segmentation folder or archive (``images/<split>/``, ``annotations/<split>/``) and its labels."""

    root: str = "${NEUTRENO_DATA}/camvid-mini.tar.gz"
    train_split: str = "train"
    val_split: str = "val"
    num_classes: int = 11
    ignore_index: int = 255
    label_offset: int = 0  # ADE20K: 1 (raw 0 is "other", ignored)
    void_label: int | None = 11  # a raw label to ignore (CamVid's void)
    class_names: list[str] | None = None
    crop_size: int = 160  # training crops and inference windows, crop_size²
    window_stride: int | None = None  # sliding-window stride (default: crop_size, Segmenter's choice)
    eval_size: int | None = None  # evaluation: short side resized to this (default: as stored)
    mean: list[float] = dataclasses.field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = dataclasses.field(default_factory=lambda: list(IMAGENET_STD))
    num_workers: int = 2

    def __post_init__(self) -> None:
        check_named(self, ("root", "train_split", "val_split"))
        check(  # (one class: a loss of 0 and an mIoU of 100 whatever the model does)
            self.num_classes >= 2,
            "num_classes",
            f"must be >= 2 (one class has nothing to tell apart), got {self.num_classes}",
        )
        check(
            not 0 <= self.ignore_index < self.num_classes,
            "ignore_index",
            f"must lie outside the classes 0…{self.num_classes - 1}, got {self.ignore_index}",
        )
        if self.void_label is not None:  # CamVid's default 11 kept under ADE20K's offset dropped "cabinet"
            real = self.void_label - self.label_offset
            check(
                not 0 <= real < self.num_classes,
                "void_label",
                f"{self.void_label} is class {real} after label_offset {self.label_offset}: it would drop a "
                "real class from the loss and mIoU (null for no void label)",
            )
        check(
            self.class_names is None or len(self.class_names) == self.num_classes,
            "class_names",
            f"needs {self.num_classes} names",
        )
        repeated = sorted({n for n in self.class_names or [] if list(self.class_names).count(n) > 1})
        # eval reports IoU by name: a repeated one would keep only its last class's
        check(not repeated, "class_names", f"must be distinct, {repeated} repeated")
        # the encoder's img_size: a multiple of the Segmenter's 16-pixel patches (else an error after the
        # data are read, naming img_size)
        check(self.crop_size >= 16 and self.crop_size % 16 == 0, "crop_size",
              f"must be a multiple of the patch size 16, got {self.crop_size}")  # fmt: skip
        check(
            self.window_stride is None or 1 <= self.window_stride <= self.crop_size,
            "window_stride",
            f"must be in 1…crop_size ({self.crop_size}) or null",
        )
        check(self.eval_size is None or self.eval_size >= 16, "eval_size", "must be >= 16 or null")
        check_normalization(self.mean, self.std, 3)
        check_num_workers(self.num_workers)


@dataclasses.dataclass
class SegmentationAugmentConfig:
    scale_range: tuple[float, float] = (0.5, 2.0)  # random rescale factor r
    base_size: int | None = None  # rescale the short side to r × this (ADE20K: 512); null: stored × r
    cat_max_ratio: float = 0.75  # redraw a crop where one class covers this much (1: never)
    hflip: float = 0.5
    photometric: bool = True  # mmseg's brightness, contrast, saturation and hue jitter

    def __post_init__(self) -> None:
        low, high = self.scale_range
        check(0 < low <= high, "scale_range", f"must be 0 < low <= high, got {self.scale_range}")
        check(self.base_size is None or self.base_size >= 16, "base_size", "must be >= 16 or null")
        # a rescale past 65,535 pixels a side is no image (1e30 was a TypeError traceback mid-training,
        # base_size 1e18 a storage overflow); the stored images are at least a crop's 16 pixels
        side = (self.base_size or 16) * high
        check(
            side <= 65535, "scale_range" if self.base_size is None else "base_size",
            f"rescales to {side:.3g} pixels a side (base_size or 16, × scale_range's high), above 65,535",
        )  # fmt: skip
        check(0 < self.cat_max_ratio <= 1, "cat_max_ratio", f"must be in (0, 1], got {self.cat_max_ratio}")
        check(0 <= self.hflip <= 1, "hflip", f"must be in [0, 1], got {self.hflip}")


def _segmenter_optim() -> OptimConfig:
    # Segmenter: SGD momentum 0.9, lr 1e-3, polynomial decay (power 0.9) to 1e-5, no weight decay.
    return OptimConfig(
        name="sgd",
        schedule="poly",
        lr=1e-3,
        lr_base_batch=None,
        weight_decay=0.0,
        warmup_epochs=0.0,
        min_lr=1e-5,
    )


def build_segmenter(m: SegmenterConfig, d: SegmentationDataConfig) -> nn.Module:
    """The Segmenter a segmentation config names (its backbone weights not loaded)."""
    return create_model(
        m.name,
        attention=m.attention,
        lam=m.lam,
        num_classes=d.num_classes,
        img_size=d.crop_size,
        decoder=m.decoder,
        drop_path_rate=m.drop_path_rate,
        **m.args,
    )


@dataclasses.dataclass
class SegmentationConfig:
    task: str = "segmentation"
    model: SegmenterConfig = dataclasses.field(default_factory=SegmenterConfig)
    data: SegmentationDataConfig = dataclasses.field(default_factory=SegmentationDataConfig)
    augment: SegmentationAugmentConfig = dataclasses.field(default_factory=SegmentationAugmentConfig)
    optim: OptimConfig = dataclasses.field(default_factory=_segmenter_optim)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        check(self.task == "segmentation", "task", f"expected 'segmentation', got {self.task!r}")
        check_model_builds(
            lambda: build_segmenter(self.model, self.data), self.model.args, {"img_size": "data.crop_size"}
        )


def _recorded_normalization(weights: Path) -> tuple[list[float], list[float]] | None:
    """The mean and std a neutreno classifier's file records for its inputs, or None (no record)."""
    from neutreno.models.checkpoint import read_metadata, safetensors_metadata

    if weights.suffix != ".safetensors" or "model" not in safetensors_metadata(weights):
        return None
    preprocess = read_metadata(weights).get("preprocess")
    if not isinstance(preprocess, dict):
        return None
    return list(preprocess["mean"]), list(preprocess["std"])


def summarize_segmentation(sums: dict[str, Any]) -> dict[str, float]:
    """mIoU and pixel accuracy (percent) from the summed confusion matrix."""
    scores = segmentation_scores(sums["confusion"])
    return {"miou": scores["miou"], "pixel_acc": scores["pixel_acc"]}


class SegmentationTask:
    """Builds the datasets and the Segmenter from a :class:`SegmentationConfig`; see the module docstring."""

    main_metric = "miou"

    def __init__(self, cfg: SegmentationConfig) -> None:
        self.cfg = cfg
        d, m = cfg.data, cfg.model
        self.labels = {
            "num_classes": d.num_classes,
            "ignore_index": d.ignore_index,
            "label_offset": d.label_offset,
            "void_label": d.void_label,
        }
        self.train_set = open_segmentation_dataset(d.root, d.train_split, **self.labels)
        self.val_set = open_segmentation_dataset(d.root, d.val_split, **self.labels)
        # its first bad mask was found at the first validation, after an epoch of training (the training
        # split's are met in the first steps)
        self.val_set.check_masks(f"checking {d.val_split} masks")
        self.num_workers = d.num_workers
        self.counters: dict[str, int] = {}
        self.model = build_segmenter(m, d)
        if m.backbone:  # checked as load_pretrained checks a classifier's: finite, the same function
            backbone = resolve_weights(m.backbone)
            refuse_another_model(self.model.encoder, backbone)
            trained = _recorded_normalization(backbone)
            if trained is not None and trained != (list(d.mean), list(d.std)):
                note(  # the encoder then sees inputs normalised otherwise than in its training
                    f"backbone {backbone} was trained on images normalised with mean {trained[0]}, std "
                    f"{trained[1]}; data.mean and data.std are {list(d.mean)}, {list(d.std)}"
                )
            fresh = self.model.load_backbone(read_state_dict(backbone), backbone)
            if fresh:
                note(f"backbone {backbone}: {', '.join(fresh)} start at λ or the identity (not in it)")

    @staticmethod
    def collate(batch: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        return batch  # pairs differ in size until augmented

    def training_loss(self, model: nn.Module, batch: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        d, aug = self.cfg.data, self.cfg.augment
        device = next(model.parameters()).device
        # mmseg pads after normalising, with 0: the mean's levels
        pad_value = tuple(min(255, max(0, round(255 * m))) for m in d.mean)
        pairs = [
            augment_pair(
                image.to(device, non_blocking=True),
                labels.to(device, non_blocking=True),
                crop_size=d.crop_size,
                scale_range=aug.scale_range,
                base_size=aug.base_size,
                cat_max_ratio=aug.cat_max_ratio,
                hflip=aug.hflip,
                photometric=aug.photometric,
                ignore_index=d.ignore_index,
                pad_value=pad_value,
            )
            for image, labels in batch
        ]
        images = normalize(torch.stack([p[0] for p in pairs]), d.mean, d.std)
        targets = torch.stack([p[1] for p in pairs])
        # the sum over labelled pixels and their count: the step's loss is the mean over all its labelled
        # pixels (mmseg's per-batch mean, for a batch split into micro-batches); a batch without one (a
        # small crop of ADE20K's "other") adds 0, not the NaN of an empty mean
        loss = F.cross_entropy(model(images).float(), targets, ignore_index=d.ignore_index, reduction="sum")
        return loss, (targets != d.ignore_index).sum()

    def eval_sums(self, model: nn.Module, batch: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        d = self.cfg.data
        device = next(model.parameters()).device
        confusion = torch.zeros(d.num_classes, d.num_classes, dtype=torch.int64, device=device)
        for image, labels in batch:
            try:
                probabilities = segment_probabilities(model, image.to(device), **self.inference_args())
            except NonFiniteOutputs:  # raised by every process alike from the all-reduced totals, not here
                return {"confusion": torch.full_like(confusion, math.nan, dtype=torch.float64)}
            confusion += confusion_matrix(
                probabilities.argmax(0), labels.to(device), d.num_classes, d.ignore_index
            )
        return {"confusion": confusion}

    summarize = staticmethod(summarize_segmentation)

    def inference_args(self) -> dict:
        d = self.cfg.data
        return {
            "mean": list(d.mean),
            "std": list(d.std),
            "window": d.crop_size,
            "stride": d.window_stride or d.crop_size,
            "eval_size": d.eval_size,
        }

    def weights_metadata(self) -> dict:
        """What ``neutreno eval`` needs: labels, class names, inference settings and the dataset."""
        d = self.cfg.data
        names = d.class_names or [str(i) for i in range(d.num_classes)]
        return {
            "segmentation": {
                **self.labels,
                **self.inference_args(),
                "class_names": names,
                "root": str(Path(d.root).resolve()),
                "split": d.val_split,
            }
        }

    def load_pretrained(self, path: str) -> None:
        from neutreno.models.checkpoint import load_state_dict_checked

        weights = resolve_weights(path)
        refuse_another_model(self.model, weights)  # same shapes, another attention or head count
        state = read_state_dict(weights)  # .safetensors or .pth (the .pth was called damaged)
        if not any(k.startswith("encoder.") for k in state) and any(k.startswith("blocks.") for k in state):
            raise ValueError(  # "63 missing (encoder.cls_token…), 32 unexpected (blocks.0…)" said not why
                f"{weights} holds a classification ViT's weights (blocks.…, no encoder.…): give it as "
                "model.backbone, which loads a classifier into the encoder; train.finetune takes a "
                "Segmenter's"
            )
        # another crop size (an ADE20K model fine-tuned on CamVid): positions resampled; another class
        # count: the class parameters fresh (a strict load refused both with a bare shape error)
        state, per_class = self.model.fit_for_finetuning(state)
        fresh = load_state_dict_checked(self.model, state, weights, start_additions=True)
        if per_class:
            note(
                f"fine-tuning from {path}: {', '.join(per_class)} start as initialised (another class count)"
            )
        if fresh:
            note(f"fine-tuning from {path}: {', '.join(fresh)} start at λ or the identity (not in it)")

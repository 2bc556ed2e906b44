"""Image classification (DeiT recipe, math.md §4): its config, and the task the training engine runs.

Workers decode images with PIL and take DeiT's RandomResizedCrop from the whole image (uint8 squares);
on the training device the batch gets the rest of DeiT's augmentations (flip, RandAugment,
normalisation, random erasing), then Mixup/CutMix with label-smoothed soft targets and a soft-target
cross-entropy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
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
from neutreno.data.augment import MIN_MIX_ALPHA, BatchAugment, MixupCutmix, normalize, too_small_alpha
from neutreno.data.datasets import balanced_indices, class_difference, collate_images, open_image_dataset
from neutreno.data.files import same_source
from neutreno.data.images import IMAGENET_MEAN, IMAGENET_STD
from neutreno.evaluation.classification import (
    CLASSIFICATION_SUMS,
    classification_sums,
    summarize_classification,
)
from neutreno.layers import has_learned_lam, lam_by_layer
from neutreno.models import create_model, list_models, load_pretrained
from neutreno.progress import note
from neutreno.training.checkpoint import resolve_weights
from neutreno.training.engine import OptimConfig, TrainConfig
from neutreno.training.losses import soft_target_cross_entropy


@dataclasses.dataclass
class ModelConfig:
    name: str = "vit_tiny_patch4_32"  # a registry name (neutreno.list_models())
    attention: str = "softmax"  # a variant of math.md §2 (neutreno.ATTENTION_TYPES)
    lam: float | None = None  # λ of the NeuTRENO variants (null: DEFAULT_LAM, 0.6)
    featscale: bool = False
    attnscale: bool = False
    drop_path_rate: float = 0.0
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # other constructor overrides

    def __post_init__(self) -> None:
        check(
            self.name in list_models(),
            "name",
            f"unknown model {self.name!r}; one of {', '.join(list_models())}",
        )
        check_attention(self.attention, self.lam)
        check(0 <= self.drop_path_rate < 1, "drop_path_rate", f"must be in [0, 1), got {self.drop_path_rate}")
        fields = ("attention", "lam", "featscale", "attnscale", "drop_path_rate")
        check_model_args(self.args, fields, ("num_classes", "img_size", "in_chans"))


@dataclasses.dataclass
class ImageDataConfig:
    """Where images come from (ImageFolder folder or archive, CIFAR pickles, or ``digits``) and their size."""

    train: str = "${NEUTRENO_DATA}/cifar10-train.tar.gz"
    train_split: str = "train"
    val: str | None = "${NEUTRENO_DATA}/cifar10-test.tar.gz"  # null: the training source
    val_split: str = "test"
    image_size: int = 32
    train_load_size: int | None = None  # without a random crop: side of the workers' centre square
    crop_pct: float = 1.0  # evaluation: resize to image_size / crop_pct, centre-crop image_size (DeiT: 0.875)
    channels: int = 3
    mean: list[float] = dataclasses.field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = dataclasses.field(default_factory=lambda: list(IMAGENET_STD))
    num_workers: int = 2
    skip_bad_images: bool = False  # skip (and count) unreadable training images instead of stopping
    train_limit: int | None = None  # train on a class-balanced subset of this many images
    val_limit: int | None = None  # evaluate on a class-balanced subset of this many images

    def __post_init__(self) -> None:
        check(self.image_size >= 1, "image_size", f"must be >= 1, got {self.image_size}")
        check(0 < self.crop_pct <= 1, "crop_pct", f"must be in (0, 1], got {self.crop_pct}")
        check(  # 1e-300 was an OverflowError in the loader, 1e-4 a resize to 320,000 pixels a side
            self.image_size / self.crop_pct <= 65535, "crop_pct",
            f"{self.crop_pct} resizes to more than 65,535 pixels a side (image_size / crop_pct)",
        )  # fmt: skip
        check(self.channels in (1, 3), "channels", f"must be 1 or 3, got {self.channels}")
        check_normalization(self.mean, self.std, self.channels)
        check_num_workers(self.num_workers)
        # an empty val (an unset shell variable) validated on the training set; an empty split trained
        # on the split folders as classes (train vs val), validated on the training images
        check_named(self, ("train", "val", "train_split", "val_split"))
        for key in ("train_limit", "val_limit"):
            value = getattr(self, key)
            check(value is None or value >= 1, key, f"must be >= 1 or null, got {value}")


MAX_REPEATS = 1000  # repeated augmentation's copies of an image; more is a typo (1e30 overflowed the sampler)


@dataclasses.dataclass
class AugmentConfig:
    """DeiT's training augmentation; set a probability or alpha to 0 to switch a part off."""

    crop_scale: tuple[float, float] | None = (0.08, 1.0)  # RandomResizedCrop's area range; null: no crop
    hflip: float = 0.5
    randaugment_n: int = 2  # 0: no RandAugment
    randaugment_m: float = 9.0
    randaugment_mstd: float = 0.5
    random_erasing: float = 0.25
    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.1
    repeated_aug: int = 1  # DeiT's repeated augmentation (RASampler): each image this many times in a row

    def __post_init__(self) -> None:
        for key in ("hflip", "random_erasing", "mix_prob", "switch_prob"):
            check(0 <= getattr(self, key) <= 1, key, f"must be in [0, 1], got {getattr(self, key)}")
        check(
            0 <= self.label_smoothing < 1, "label_smoothing", f"must be in [0, 1), got {self.label_smoothing}"
        )
        for key in ("mixup_alpha", "cutmix_alpha"):  # each under its own name
            alpha = getattr(self, key)
            check(alpha >= 0, key, f"must be >= 0, got {alpha}")
            check(not 0 < alpha < MIN_MIX_ALPHA, key, too_small_alpha(key, alpha))
        check(self.randaugment_n >= 0, "randaugment_n", f"must be >= 0, got {self.randaugment_n}")
        check(
            1 <= self.repeated_aug <= MAX_REPEATS, "repeated_aug",
            f"must be 1 to {MAX_REPEATS} (DeiT: 3), got {self.repeated_aug}",
        )  # fmt: skip
        for key in ("randaugment_m", "randaugment_mstd"):
            check(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")
        check(
            self.crop_scale is None or 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1,
            "crop_scale",
            f"must be null or 0 < low <= high <= 1, got {self.crop_scale}",
        )


def build_classifier(m: ModelConfig, data: ImageDataConfig, num_classes: int) -> nn.Module:
    """The model a classification config names, for ``num_classes`` classes (the data's)."""
    return create_model(
        m.name,
        attention=m.attention,
        lam=m.lam,
        num_classes=num_classes,
        img_size=data.image_size,
        in_chans=data.channels,
        drop_path_rate=m.drop_path_rate,
        featscale=m.featscale,
        attnscale=m.attnscale,
        **m.args,
    )


@dataclasses.dataclass
class ClassificationConfig:
    task: str = "classification"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: ImageDataConfig = dataclasses.field(default_factory=ImageDataConfig)
    augment: AugmentConfig = dataclasses.field(default_factory=AugmentConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        check(self.task == "classification", "task", f"expected 'classification', got {self.task!r}")
        load, size = self.data.train_load_size, self.data.image_size
        check(
            self.augment.crop_scale is None or load in (None, size),
            "data.train_load_size",
            f"{load} has no use with augment.crop_scale: the random crop is taken from the whole image at "
            f"its own resolution and resized to data.image_size {size} (set it to null)",
        )
        # num_classes comes from the data: 2 stands in for it
        check_model_builds(
            lambda: build_classifier(self.model, self.data, 2),
            self.model.args,
            {"img_size": "data.image_size", "in_chans": "data.channels"},
        )


class ClassificationTask:
    """Builds the datasets and the model from a :class:`ClassificationConfig`; see the module docstring."""

    main_metric = "top1"

    def __init__(self, cfg: ClassificationConfig) -> None:
        data, aug = cfg.data, cfg.augment
        self.cfg = cfg
        self.sample_repeats = cfg.augment.repeated_aug  # the engine's training sampler repeats each index
        self.sample_seeds = aug.crop_scale is not None  # and hands the seed of each sample's crop
        common = {"size": data.image_size, "channels": data.channels}
        self.train_set = open_image_dataset(
            data.train,
            data.train_split,
            train=True,
            load_size=data.train_load_size,
            crop_scale=aug.crop_scale,
            skip_bad=data.skip_bad_images,
            **common,
        )
        # never skipped in validation: a score over the readable images only, of a count no record said,
        # is not the split's (neutreno eval refuses them too)
        self.val_set = open_image_dataset(
            data.val or data.train, data.val_split, train=False, crop_pct=data.crop_pct, **common
        )
        if data.val_split == data.train_split and same_source(data.val or data.train, data.train):
            note(  # a training accuracy reported as validation
                f"warning: data.val and data.val_split name the training images ({data.val or data.train}, "
                f"split {data.val_split}): validation scores the images trained on"
            )
        if data.train_limit:
            self.train_set = self.train_set.subset(balanced_indices(self.train_set.labels, data.train_limit))
        if data.val_limit:
            self.val_set = self.val_set.subset(balanced_indices(self.val_set.labels, data.val_limit))
        self.classes = list(self.train_set.classes)
        if len(self.classes) < 2:  # top-1 over one class is 100% whatever the model does
            raise ValueError(
                f"{data.train} has {len(self.classes)} class(es) {self.classes}; a classifier needs "
                "at least 2"
            )
        if list(self.val_set.classes) != self.classes:
            raise ValueError(
                "the training and validation sets have different classes: "
                + class_difference(self.classes, list(self.val_set.classes), ("training", "validation"))
            )
        self.num_workers = data.num_workers
        self.counters = {"skipped_images": 0}
        self.model = build_classifier(cfg.model, data, len(self.classes))
        self.augment = BatchAugment(
            size=data.image_size,
            mean=data.mean,
            std=data.std,
            hflip=aug.hflip,
            randaugment_n=aug.randaugment_n,
            randaugment_m=aug.randaugment_m,
            randaugment_mstd=aug.randaugment_mstd,
            random_erasing=aug.random_erasing,
        )
        self.mixup = MixupCutmix(
            num_classes=len(self.classes),
            mixup_alpha=aug.mixup_alpha,
            cutmix_alpha=aug.cutmix_alpha,
            prob=aug.mix_prob,
            switch_prob=aug.switch_prob,
            label_smoothing=aug.label_smoothing,
        )

    collate = staticmethod(collate_images)

    def training_loss(self, model: nn.Module, batch: tuple[Tensor, Tensor, int]) -> tuple[Tensor, int]:
        images, labels, skipped = batch
        self.counters["skipped_images"] += skipped
        if len(labels) == 0:
            raise ValueError("a whole training batch was unreadable images; check the dataset")
        device = next(model.parameters()).device
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        images, targets = self.mixup(self.augment(images), labels)
        # a sum and its count: a batch that skipped images weighs less in the step (the engine's mean)
        return soft_target_cross_entropy(model(images).float(), targets, reduction="sum"), len(labels)

    def eval_sums(self, model: nn.Module, batch: tuple[Tensor, Tensor, int]) -> dict[str, Tensor]:
        images, labels, _ = batch
        device = next(model.parameters()).device
        if len(labels) == 0:  # every image of the batch was unreadable and skipped: it adds nothing
            return {key: torch.zeros((), device=device) for key in CLASSIFICATION_SUMS}
        images = normalize(images.to(device), self.cfg.data.mean, self.cfg.data.std)
        return classification_sums(model(images), labels.to(device))

    summarize = staticmethod(summarize_classification)

    def weights_metadata(self) -> dict:
        """What ``neutreno eval`` needs to preprocess images as in training, stored with the weights."""
        d = self.cfg.data
        preprocess = {
            "image_size": d.image_size,
            "crop_pct": d.crop_pct,
            "channels": d.channels,
            "mean": list(d.mean),
            "std": list(d.std),
        }
        return {"preprocess": preprocess, "classes": self.classes}

    def load_pretrained(self, path: str) -> None:
        """Start from other weights (a run, a checkpoint, or a timm/DeiT .pth/.safetensors file):
        pos_embed resampled to this grid, head left fresh on a class mismatch (said on stderr)."""
        fresh = load_pretrained(self.model, resolve_weights(path))
        if fresh:
            note(f"fine-tuning from {path}: {', '.join(fresh)} left as initialised (the file's head is of "
                 "another class count or it has none; a learned λ, FeatScale or AttnScale it has none of "
                 "starts at λ or the identity)")  # fmt: skip
        if not has_learned_lam(self.model):
            return
        start = self.model.blocks[-1].attn.lam  # model.lam as resolved: where a fresh learned λ starts
        loaded = [
            v for lam in lam_by_layer(self.model)[1:] for v in (lam if isinstance(lam, list) else [lam])
        ]
        if any(abs(v - start) > 1e-6 * max(1.0, start) for v in loaded):
            # the config, results.json and the file's record say model.lam; the model runs the file's
            shown = ", ".join(f"{v:.3g}" for v in loaded[:8]) + (", …" if len(loaded) > 8 else "")
            note(f"fine-tuning from {path}: the learned λ continues from the file's ({shown}), not from "
                 f"model.lam {start:g}")  # fmt: skip

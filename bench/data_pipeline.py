"""Is training ever input-bound? Images/s of the data pipeline (JPEG decoding and the random crop in 2
DataLoader workers + the other train augmentations on the device) against images/s of training steps, for
the CPU presets ``configs/cifar10_vit_{softmax,neutreno}.yaml`` and the DeiT recipe's heavier augmentation.
The issue's target: pipeline ≥ 3× training. Writes bench/results/data_pipeline.json."""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from neutreno.cli.train import load_train_config
from neutreno.training.classification import ClassificationTask
from neutreno.training.engine import param_groups
from neutreno.training.losses import soft_target_cross_entropy

from timing import interleaved_times, machine, positive_int, write_result

ROOT = Path(__file__).resolve().parents[1]
DEIT_AUGMENT = [  # the DeiT recipe's augmentation (SPEC §4) on the same CIFAR images
    "augment.crop_scale=[0.08, 1.0]",
    "augment.randaugment_n=2",
    "augment.random_erasing=0.25",
    "augment.mixup_alpha=0.8",
    "augment.cutmix_alpha=1.0",
]


def pipeline_images_per_s(task: ClassificationTask, batch_size: int, batches: int) -> float:
    """Decode (2 workers) + augment + mix ``batches`` batches, after the workers have started."""
    loader = DataLoader(
        task.train_set,
        batch_size=batch_size,
        shuffle=True,
        num_workers=2,
        collate_fn=task.collate,
        drop_last=True,
        persistent_workers=True,
    )
    stream = iter(loader)
    for images, labels, _ in itertools.islice(stream, 5):  # warm-up: worker start, first batches
        task.mixup(task.augment(images), labels)
    start = time.perf_counter()
    for images, labels, _ in itertools.islice(stream, batches):
        task.mixup(task.augment(images), labels)
    return batches * batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=positive_int, default=60, help="batches per pipeline measurement")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of training-step timing")
    args = parser.parse_args()
    data = ROOT.parent / "shared" / "data"
    overrides = [f"data.train={data / 'cifar10-train.tar.gz'}", f"data.val={data / 'cifar10-test.tar.gz'}"]
    result = {"machine": machine(), "target": "pipeline images/s >= 3 x training images/s", "presets": {}}
    steps, batch_size = {}, None
    for name in ("cifar10_vit_softmax", "cifar10_vit_neutreno"):
        cfg = load_train_config(ROOT / "configs" / f"{name}.yaml", overrides)
        torch.manual_seed(0)
        task = ClassificationTask(cfg)
        batch_size = cfg.train.batch_size
        optimizer = torch.optim.AdamW(param_groups(task.model, 0.05), lr=1e-4)
        images, labels, _ = next(
            iter(DataLoader(task.train_set, batch_size=batch_size, collate_fn=task.collate))
        )

        def step(
            task=task, optimizer=optimizer, images=images, labels=labels, bf16=cfg.train.precision == "bf16"
        ):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                x, targets = task.mixup(task.augment(images), labels)
                loss = soft_target_cross_entropy(task.model(x).float(), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[name] = step
        if name == "cifar10_vit_softmax":
            light = pipeline_images_per_s(task, batch_size, args.batches)
            deit = pipeline_images_per_s(
                ClassificationTask(
                    load_train_config(ROOT / "configs" / f"{name}.yaml", overrides + DEIT_AUGMENT)
                ),
                batch_size,
                args.batches,
            )
    times = interleaved_times(steps, rounds=args.rounds, per_round=3)
    for name, timing in times.items():
        train_rate = batch_size / timing["median_s"]
        result["presets"][name] = {
            "train_images_per_s": round(train_rate, 1),
            "pipeline_images_per_s": round(light, 1),
            "pipeline_over_train": round(light / train_rate, 2),
            "deit_augment_pipeline_images_per_s": round(deit, 1),
            "deit_augment_pipeline_over_train": round(deit / train_rate, 2),
        }
    result["batch_size"] = batch_size
    result["note"] = (
        "training steps include the on-device augmentation; on this 2-core CPU decoding workers and training "
        "share the cores, so both rates were measured separately, one after the other"
    )
    path = write_result("data_pipeline", result)
    for name, row in result["presets"].items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

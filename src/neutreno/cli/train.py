"""``neutreno train CONFIG.yaml [--set key=value …] [--resume] [--finetune CKPT]`` and ``neutreno eval``.

Run it under ``torchrun --nproc_per_node=N -m neutreno train …`` for DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neutreno.config import apply_overrides, from_dict, read_yaml, to_dict

TASKS = ("classification",)  # the values of a config's `task:` key


def _task_classes(name: str) -> tuple[type, type]:
    """The config class and task class of a task name (imported only when used)."""
    if name == "classification":
        from neutreno.training.classification import ClassificationConfig, ClassificationTask

        return ClassificationConfig, ClassificationTask
    from neutreno.config import ConfigError

    raise ConfigError(f"task: unknown task {name!r}; one of {', '.join(TASKS)}")


def load_train_config(path: Path, overrides: list[str]):
    """The typed config of ``path`` with ``--set`` overrides, checked (ConfigError naming the key)."""
    data = apply_overrides(read_yaml(path), overrides)
    config_cls, _ = _task_classes(data.get("task", "classification"))
    return from_dict(config_cls, data)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="a YAML config (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.epochs=10 (repeatable)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in train.out_dir from its latest checkpoint"
    )
    parser.add_argument("--finetune", metavar="CKPT", help="start from these weights (sets train.finetune)")


def run_train(args: argparse.Namespace) -> int:
    from neutreno.training.engine import train

    overrides = list(args.overrides) + ([f"train.finetune={args.finetune}"] if args.finetune else [])
    cfg = load_train_config(args.config, overrides)
    _, task_cls = _task_classes(cfg.task)
    results = train(lambda: task_cls(cfg), cfg.train, cfg.optim, to_dict(cfg), resume=args.resume)
    val = results["val"].get("model", {})
    if val:
        print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in val.items()))
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a .safetensors file, a checkpoint folder or a run folder"
    )
    parser.add_argument("--data", required=True, help="image folder/archive, CIFAR pickles or 'digits'")
    parser.add_argument("--split", default="val", help="split to evaluate (default: val)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights of a checkpoint folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, help="also write the metrics to this JSON file")


def run_eval(args: argparse.Namespace) -> int:
    import json

    from neutreno.training.evaluate import evaluate_checkpoint

    if args.batch_size < 1 or args.workers < 0:
        raise ValueError("--batch-size must be >= 1 and --workers >= 0")
    metrics = evaluate_checkpoint(
        args.checkpoint,
        args.data,
        split=args.split,
        batch_size=args.batch_size,
        num_workers=args.workers,
        ema=args.ema,
        device=args.device,
    )
    if args.out:
        from neutreno.io import write_json

        write_json(args.out, metrics)
    json.dump(metrics, sys.stdout, indent=2)
    print()
    return 0

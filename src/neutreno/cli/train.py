"""``neutreno train CONFIG [--set key=value …] [--resume] [--finetune CKPT]``: train a YAML config or a
preset (``torchrun`` for many processes)."""

from __future__ import annotations

import argparse
from pathlib import Path

from neutreno.cli.types import add_set_argument
from neutreno.config import refuse_overrides_of, set_text, to_dict
from neutreno.training.tasks import load_train_config, task_classes


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="a YAML config, or a preset's name (`neutreno presets`)")
    add_set_argument(parser)
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in train.out_dir from its latest checkpoint"
    )
    parser.add_argument("--finetune", metavar="CKPT", help="start from these weights (sets train.finetune)")


def run_train(args: argparse.Namespace) -> int:
    from neutreno.training.distributed import setup_distributed
    from neutreno.training.engine import train

    if args.finetune:  # --set train.finetune=A --finetune B trained from B without a word
        refuse_overrides_of(args.overrides, {"train.finetune": "--finetune sets it"})
    overrides = list(args.overrides) + ([set_text("train.finetune", args.finetune)] if args.finetune else [])
    cfg = load_train_config(args.config, overrides)
    args.out_dir = cfg.train.out_dir  # for the hint of an interrupted run (what it can resume from)
    _, task_cls = task_classes(cfg.task)
    results = train(lambda: task_cls(cfg), cfg.train, cfg.optim, to_dict(cfg), resume=args.resume)
    val = results["val"].get("model", {})
    if val and setup_distributed(cfg.train.device).is_main:  # once under torchrun (the group is joined)
        print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in val.items()))
    return 0

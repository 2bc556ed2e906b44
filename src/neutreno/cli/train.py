"""``neutreno train CONFIG.yaml [--set key=value …] [--resume] [--finetune CKPT]``, ``neutreno eval``
and ``neutreno generate``.

Run it under ``torchrun --nproc_per_node=N -m neutreno train …`` for DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neutreno.cli.types import finite_at_least, int_at_least
from neutreno.config import to_dict
from neutreno.training.tasks import load_train_config, task_classes


def add_set_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--set KEY=VALUE`` config overrides into ``args.overrides`` (``scope``: e.g. " in every run")."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value{scope}, e.g. --set train.epochs=10 (repeatable)",
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="a YAML config, or a preset's name (`neutreno presets`)")
    add_set_argument(parser)
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in train.out_dir from its latest checkpoint"
    )
    parser.add_argument("--finetune", metavar="CKPT", help="start from these weights (sets train.finetune)")


def run_train(args: argparse.Namespace) -> int:
    from neutreno.training.engine import train

    overrides = list(args.overrides) + ([f"train.finetune={args.finetune}"] if args.finetune else [])
    cfg = load_train_config(args.config, overrides)
    _, task_cls = task_classes(cfg.task)
    results = train(lambda: task_cls(cfg), cfg.train, cfg.optim, to_dict(cfg), resume=args.resume)
    val = results["val"].get("model", {})
    if val:
        print(", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in val.items()))
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a .safetensors file, a checkpoint folder or a run folder"
    )
    parser.add_argument(
        "--data",
        help="classifier: image folder/archive, CIFAR pickles or 'digits' (required); language model: "
        "corpus folder; segmenter: images/annotations folder or archive (default: the one it was trained on)",
    )
    parser.add_argument(
        "--split", help="classifier, segmenter: split to evaluate (default: val); LM: one split only"
    )
    parser.add_argument(
        "--stride",
        type=int,
        default=1,
        help="LM: sliding-window stride; 1 (default) is the paper's protocol, larger is faster",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default: 256 images or 32 windows")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights of a checkpoint folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, help="also write the metrics to this JSON file")
    parser.add_argument(
        "--scales",
        default="0.5,0.75,1.0,1.25,1.5,1.75",
        help="segmenter: the multi-scale test's scales, with flips (default: the paper's)",
    )
    parser.add_argument(
        "--overlay", type=Path, help="segmenter: write a PNG of the first validation images and predictions"
    )


def run_eval(args: argparse.Namespace) -> int:
    import json

    from neutreno.models import read_metadata
    from neutreno.training.checkpoint import resolve_weights
    from neutreno.training.evaluate import evaluate_checkpoint, evaluate_language_model, evaluate_segmentation

    if (args.batch_size is not None and args.batch_size < 1) or args.workers < 0 or args.stride < 1:
        raise ValueError("--batch-size and --stride must be >= 1 and --workers >= 0")
    weights = resolve_weights(args.checkpoint)
    if args.ema:
        weights = weights.with_name("ema.safetensors")
        if not weights.is_file():
            raise FileNotFoundError(f"no EMA weights beside the checkpoint: {weights}")
    meta = read_metadata(weights)
    if "segmentation" in meta:
        try:
            scales = tuple(float(s) for s in args.scales.split(","))
        except ValueError:
            raise ValueError(f"--scales must be comma-separated numbers, got {args.scales!r}") from None
        if not scales or min(scales) <= 0:
            raise ValueError(f"--scales must be positive, got {args.scales!r}")
        metrics = evaluate_segmentation(
            weights,
            args.data,
            split=args.split or "val",
            scales=scales,
            device=args.device,
            overlay=args.overlay,
        )
        _print_segmentation(metrics)
    elif "tokenizer" in meta:
        metrics = evaluate_language_model(
            weights,
            args.data,
            splits=(args.split,) if args.split else ("valid", "test"),
            stride=args.stride,
            batch_size=args.batch_size or 32,
            device=args.device,
        )
    else:
        if not args.data:
            raise ValueError("--data is required to evaluate a classifier")
        metrics = evaluate_checkpoint(
            weights,
            args.data,
            split=args.split or "val",
            batch_size=args.batch_size or 256,
            num_workers=args.workers,
            device=args.device,
        )
    if args.out:
        from neutreno.io import write_json

        write_json(args.out, metrics)
    if "segmentation" not in meta:
        json.dump(metrics, sys.stdout, indent=2)
        print()
    return 0


def _print_segmentation(metrics: dict) -> None:
    """SS and MS scores side by side, then the per-class IoU."""
    ss, ms = metrics["ss"], metrics["ms"]
    print(f"{metrics['images']} images of {metrics['data']} ({metrics['split']})")
    print(f"{'':>16} {'SS':>7} {'MS':>7}")
    print(f"{'mIoU':>16} {ss['miou']:7.2f} {ms['miou']:7.2f}")
    print(f"{'pixel accuracy':>16} {ss['pixel_acc']:7.2f} {ms['pixel_acc']:7.2f}")
    for name in ss["iou"]:
        print(f"{name[:16]:>16} {ss['iou'][name]:7.2f} {ms['iou'][name]:7.2f}")
    print(f"last-layer token cosine similarity of the encoder: {metrics['last_layer_token_cosine']:.4f}")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a language model: .safetensors file, checkpoint folder or run folder"
    )
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int_at_least(0), default=50)
    parser.add_argument(
        "--temperature", type=finite_at_least(0.0), default=1.0, help="0: greedy (default: 1.0)"
    )
    parser.add_argument(
        "--top-k", type=int_at_least(1), default=None, help="sample from the k most likely tokens"
    )
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from neutreno.training.distributed import resolve_device
    from neutreno.training.language_model import load_language_model

    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    model, tokenizer, _ = load_language_model(args.checkpoint)
    prompt = tokenizer.encode_text(args.prompt)
    if not prompt:
        raise ValueError("--prompt has no tokens")
    device = resolve_device(args.device)
    model.to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ids = model.generate(
        torch.tensor([prompt], device=device),
        args.max_new_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k,
        generator=generator,
    )
    # The prompt as the model read it (unknown words as <unk>), then its continuation.
    print(tokenizer.decode_text(ids[0]))
    return 0


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="a YAML config, or a preset's name (`neutreno presets`)")
    add_set_argument(parser, " in every run")
    parser.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2,…",
        help="values of one config key, e.g. --grid model.lam=0,0.2,0.4 (repeatable: every combination)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time, as subprocesses (default 1: in turn)"
    )
    parser.add_argument("--out", type=Path, help="sweep folder (default runs/sweep_<config name>)")


def run_sweep(args: argparse.Namespace) -> int:
    from neutreno.training import sweep

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    out = args.out or Path("runs") / f"sweep_{args.config.stem}"
    runs = sweep.plan_sweep(args.config, args.grid, out, args.overrides)
    results = sweep.run_sweep(args.config, runs, args.jobs)
    rows = sweep.summarize(runs, results)
    written = sweep.write_report(out, runs, rows)
    print("\n" + (out / "sweep.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    return 0

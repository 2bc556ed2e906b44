"""``neutreno eval CHECKPOINT --data …``: a classifier's top-1/top-5, a language model's perplexity, a
segmenter's mIoU or a text classifier's accuracy."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from neutreno.cli.types import integer
from neutreno.config import check_num_workers
from neutreno.io import check_output_file

PAPER_SCALES = "0.5,0.75,1.0,1.25,1.5,1.75"
# the options of one kind of model: given for another, they would be ignored while the run says done
KIND_OPTIONS = {
    "segmenter": ("scales", "overlay", "stride"),
    "language model": ("stride", "batch_size"),
    "classifier": ("workers", "batch_size"),
    "text classifier": ("batch_size",),
}
MODEL_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
RUN_FILES = ("config.json", "results.json", "metrics.jsonl", "curves.png")  # a run folder's own


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", type=Path, help="a .safetensors file, a checkpoint folder or a run folder"
    )
    parser.add_argument(
        "--data",
        help="classifier: image folder/archive, CIFAR pickles or 'digits' (required); text classifier: a "
        ".csv or .jsonl file with the columns it was trained on (required); language model: "
        "corpus folder; segmenter: images/annotations folder or archive (default: the one it was trained on)",
    )
    parser.add_argument(
        "--split",
        help="classifier, segmenter: split to evaluate (default: val; a segmenter on the data it was "
        "trained on: its validation split); LM: one split only (default: valid, and test where there is one)",
    )
    parser.add_argument(
        "--stride",
        type=integer,
        help="LM: sliding-window stride; 1 (default) is the paper's protocol, larger is faster. Segmenter: "
        "the sliding window's (default: the run's data.window_stride; Segmenter's own evaluation script, "
        "behind its published figures, uses the window - 32, e.g. 480)",
    )
    parser.add_argument(
        "--batch-size",
        type=integer,
        default=None,
        help="classifier, LM, text classifier: default 256 images, 32 windows or 32 texts",
    )
    parser.add_argument("--workers", type=integer, help="classifier: DataLoader workers (default 2)")
    parser.add_argument("--ema", action="store_true", help="evaluate the EMA weights of a checkpoint folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, help="also write the metrics to this JSON file")
    parser.add_argument(
        "--scales",
        help=f"segmenter: the multi-scale test's scales, with flips (default: the paper's, {PAPER_SCALES})",
    )
    parser.add_argument(
        "--overlay",
        type=Path,
        help="segmenter: write a PNG of 4 images spread over the split, their labels and predictions",
    )


def run_eval(args: argparse.Namespace) -> int:

    from neutreno.evaluation.classification import evaluate_checkpoint
    from neutreno.evaluation.language_model import evaluate_language_model
    from neutreno.evaluation.segmentation import evaluate_segmentation
    from neutreno.models.checkpoint import checkpoint_kind, read_metadata
    from neutreno.training.checkpoint import lam_warmup_note, resolve_weights

    if any(value is not None and value < 1 for value in (args.batch_size, args.stride)):
        raise ValueError("--batch-size and --stride must be >= 1")
    if args.workers is not None:
        check_num_workers(args.workers, "--workers")
    for path, flag in ((args.out, "--out"), (args.overlay, "--overlay")):
        if path is not None:  # found now, not after the evaluation
            check_output_file(path, flag)
            refuse_model_file(path, flag)
    weights = resolve_weights(args.checkpoint)
    if args.ema:
        weights = weights.with_name("ema.safetensors")
        if not weights.is_file():
            raise FileNotFoundError(f"no EMA weights beside the checkpoint: {weights}")
    meta = read_metadata(weights)
    kind = checkpoint_kind(meta)
    warmup = lam_warmup_note(weights)
    if warmup:  # (the run's log and results.json hold other numbers)
        print(warmup, file=sys.stderr)
    unused = sorted({option for k, options in KIND_OPTIONS.items() if k != kind for option in options}
                    - set(KIND_OPTIONS[kind]))  # fmt: skip
    given = [f"--{option.replace('_', '-')}" for option in unused if getattr(args, option) is not None]
    if given:
        raise ValueError(
            f"{' and '.join(given)} {'do' if len(given) > 1 else 'does'} not apply to {weights}, a {kind}"
        )
    if kind == "segmenter":
        try:
            scales = tuple(
                float(s) for s in (PAPER_SCALES if args.scales is None else args.scales).split(",")
            )
        except ValueError:
            raise ValueError(f"--scales must be comma-separated numbers, got {args.scales!r}") from None
        if not scales or not all(0 < scale < math.inf for scale in scales):  # NaN fails too
            raise ValueError(f"--scales must be finite positive numbers, got {args.scales!r}")
        metrics = evaluate_segmentation(
            weights,
            args.data,
            split=args.split,
            scales=scales,
            stride=args.stride,
            device=args.device,
            overlay=args.overlay,
        )
        _print_segmentation(metrics)
    elif kind == "language model":
        metrics = evaluate_language_model(
            weights,
            args.data,
            splits=(args.split,) if args.split else None,
            stride=args.stride or 1,
            batch_size=args.batch_size or 32,
            device=args.device,
        )
    elif kind == "text classifier":
        from neutreno.evaluation.text_classification import evaluate_text_classifier

        if not args.data:
            raise ValueError("--data is required to evaluate a text classifier (a .csv or .jsonl file)")
        metrics = evaluate_text_classifier(
            weights, args.data, batch_size=args.batch_size or 32, device=args.device
        )
    else:
        if not args.data:
            raise ValueError("--data is required to evaluate a classifier")
        metrics = evaluate_checkpoint(
            weights,
            args.data,
            split=args.split or "val",
            batch_size=args.batch_size or 256,
            num_workers=2 if args.workers is None else args.workers,
            device=args.device,
        )
        if metrics["classes_scored"] < metrics["head_classes"]:  # said, not only a number in the JSON
            print(
                f"note: scored over the data's {metrics['classes_scored']} classes, a subset of the head's "
                f"{metrics['head_classes']}: each image's best among them (as ImageNet-A/R are); the "
                "other outputs are ignored",
                file=sys.stderr,
            )
    if args.out:
        from neutreno.io import write_json

        write_json(args.out, metrics)
    if "segmentation" not in meta:
        from neutreno.io import json_text

        print(json_text(metrics))
    return 0


def refuse_model_file(path: Path, flag: str) -> None:
    """An output path named like a model or checkpoint file (the checkpoint evaluated, say), or a run
    folder's own record (config.json, results.json, …): a ValueError naming it. The metrics were written
    over the weights given, and the run could not resume."""
    path = Path(path)
    run_folder = (path.parent / "checkpoints").is_dir() and (path.parent / "config.json").is_file()
    if path.name in RUN_FILES and run_folder:
        raise ValueError(f"{flag} {path} is its run folder's own {path.name}: give another file name")
    if path.suffix.lower() in MODEL_FILE_SUFFIXES:
        raise ValueError(f"{flag} {path} is named like a model file ({path.suffix}): give another file name")


def _print_segmentation(metrics: dict) -> None:
    """SS and MS scores side by side, then the per-class IoU."""
    ss, ms = metrics["ss"], metrics["ms"]
    print(
        f"{metrics['images']} images of {metrics['data']} ({metrics['split']}), {metrics['window']}² windows "
        f"every {metrics['stride']} pixels"
    )
    print(f"{'':>16} {'SS':>7} {'MS':>7}")
    print(f"{'mIoU':>16} {ss['miou']:7.2f} {ms['miou']:7.2f}")
    print(f"{'pixel accuracy':>16} {ss['pixel_acc']:7.2f} {ms['pixel_acc']:7.2f}")

    def cell(iou: float | None) -> str:  # NaN (null in the JSON): in no label and no prediction
        return f"{'absent':>7}" if iou is None or math.isnan(iou) else f"{iou:7.2f}"

    for name in ss["iou"]:
        print(f"{name[:16]:>16} {cell(ss['iou'][name])} {cell(ms['iou'][name])}")
    if any(cell(v).strip() == "absent" for v in (*ss["iou"].values(), *ms["iou"].values())):
        print("absent: a class in no label and no prediction of these images, left out of the mIoU")
    print(f"last-layer token cosine similarity of the encoder: {metrics['last_layer_token_cosine']:.4f}")

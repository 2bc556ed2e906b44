"""``neutreno study rank-collapse`` and ``neutreno study spectrum``: the source papers' explanations of
over-smoothing, measured."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from neutreno.cli.types import integer, seed
from neutreno.io import FolderLock, check_output_folder


def _list(kind):
    """argparse type: a comma list of ``kind`` (int or str)."""

    def parse(text: str) -> list:
        try:
            items = [t.strip() for t in text.split(",")]
            if "" in items:  # "2,,4" ran 2 and 4 without a word (every other list refuses it)
                raise ValueError("an empty item")
            values = [kind(t) for t in items]
        except (ValueError, argparse.ArgumentTypeError) as error:  # (a seed out of torch's range, too)
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {kind.__name__}, got {text!r} ({error})"
            ) from None
        twice = sorted({v for v in values if values.count(v) > 1}, key=str)
        if twice:  # one model measured again would count as another seed
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given twice in {text!r}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neutreno.cli.types import add_set_argument
    from neutreno.studies import rank_collapse as rc

    studies = parser.add_subparsers(dest="study", required=True, metavar="STUDY")
    p = studies.add_parser(
        "rank-collapse",
        help="token cosine and Q/K/V gradient norms at initialisation over depth, norm, α and attention",
        description=rc.__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--data",
        default="${NEUTRENO_DATA}/wikitext103-mini",
        help="a WikiText corpus folder (default: wikitext103-mini in $NEUTRENO_DATA)",
    )
    p.add_argument("--depths", type=_list(int), default=list(rc.DEPTHS), help="default 2,4,8,16,32,64")
    p.add_argument("--norms", type=_list(str), default=["pre", "post", "none"], help="default pre,post,none")
    p.add_argument(
        "--residual-scales",
        type=_list(str),
        default=list(rc.RESIDUAL_SCALES),
        help="α values: numbers or 1/sqrt(L) (default 1,1/sqrt(L))",
    )
    p.add_argument(
        "--attentions", type=_list(str), default=list(rc.ATTENTIONS), help="default softmax,neutreno"
    )
    p.add_argument(
        "--lam", type=float, default=None, help="λ of the NeuTRENO variants (default the LM's 0.4)"
    )
    p.add_argument(
        "--seeds", type=_list(seed), default=[0, 1, 2], help="initialisation seeds (default 0,1,2)"
    )
    p.add_argument("--samples", type=integer, default=8, help="WikiText windows (default 8)")
    p.add_argument("--length", type=integer, default=128, help="tokens per window (default 128, the context)")
    p.add_argument(
        "--init",
        choices=rc.INITS,
        default="fan_in",
        help="fan_in: N(0, 1/fan_in) as Noci et al. analyse (default); model: the model's own init",
    )
    p.add_argument("--out", type=Path, default=Path("runs/study_rank_collapse"), help="output folder")

    from neutreno.studies import spectrum

    p = studies.add_parser(
        "spectrum",
        help="train standard, smoothing (+) and sharpening (−) ViTs; accuracy and high frequencies by layer",
        description=spectrum.__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--config", type=Path, default=Path(spectrum.DEFAULT_CONFIG), help="a classification config"
    )
    add_set_argument(p, " in every run")
    p.add_argument(
        "--attentions",
        type=_list(str),
        default=list(spectrum.ATTENTIONS),
        help="default softmax,eigen_pos,eigen_neg",
    )
    p.add_argument("--data", help="images to measure the layers on (default: the config's validation set)")
    p.add_argument(
        "--samples", type=integer, default=1000, help="images, spread over the classes (default 1000)"
    )
    p.add_argument("--out", type=Path, default=Path("runs/study_spectrum"), help="output folder")


def run(args) -> int:
    return run_spectrum(args) if args.study == "spectrum" else run_rank_collapse(args)


def run_rank_collapse(args) -> int:
    from neutreno.layers import LM_DEFAULT_LAM
    from neutreno.studies import rank_collapse as rc

    if args.lam is not None and not any(a.endswith("neutreno") for a in args.attentions):
        # recorded in results.json as the study's λ, where no model had one
        raise ValueError(f"--lam {args.lam:g} is for the NeuTRENO variants, and --attentions has none")
    lam = LM_DEFAULT_LAM if args.lam is None else args.lam
    rc.check_grid(args.depths, args.norms, args.residual_scales, args.attentions, lam, args.init)
    if args.samples < 1 or not 2 <= args.length <= 128:
        raise ValueError(
            f"--samples must be >= 1 and --length 2..128 (a token cosine needs two), got {args.samples} "
            f"and {args.length}"
        )
    check_output_folder(args.out, "--out", writes="results.json")
    from neutreno.config import expand_env

    data = rc.load_windows(expand_env(args.data, "--data"), args.samples, args.length)
    rc.check_memory(data, max(args.depths))
    settings = [
        rc.Setting(depth, norm, scale, attention, seed, lam if attention.endswith("neutreno") else None)
        for norm, scale, attention, depth, seed in itertools.product(
            args.norms, args.residual_scales, args.attentions, args.depths, args.seeds
        )
    ]
    print(f"{len(settings)} models ({rc.MODEL} width, {args.init} init) on {data.source}")
    _lock = FolderLock(args.out)  # held to the end: two studies into one folder mixed runs.jsonl and reports
    records = rc.run_study(settings, data, args.out, args.init)
    rows = rc.summarize(records)
    print(f"\n{rc.TABLE_CAPTION}\n")
    print(rc.markdown_table(rows))
    # the study's λ where a NeuTRENO variant ran with it; None where no model has one
    study_lam = lam if any(a.endswith("neutreno") for a in args.attentions) else None
    meta = {"model": rc.MODEL, "data": data.source, "lam": study_lam, "init": args.init, "seeds": args.seeds}
    written = rc.write_report(args.out, records, rows, meta)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def run_spectrum(args) -> int:
    from neutreno.data.datasets import CIFAR_LAYOUTS
    from neutreno.data.images import load_images
    from neutreno.studies import spectrum

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    check_output_folder(args.out, "--out", writes="results.json")
    variants = spectrum.variant_configs(args.config, args.attentions, args.out, args.overrides)
    data_cfg = variants[0].config.data
    data = args.data or data_cfg.val or data_cfg.train
    split = None if args.data else data_cfg.val_split
    report = {"config": str(args.config), "overrides": args.overrides, "data": data, "variants": {}}
    # the images measured, read once before any training (a wrong --data was found after three runs)
    pickles = any((Path(data) / name).is_dir() or Path(data).name == name for name in CIFAR_LAYOUTS)
    if str(data) == "digits" or pickles or str(data).endswith("-python.tar.gz"):  # (it said "no images")
        raise ValueError(
            f"study spectrum measures images of a folder or archive, which {data!r} (digits or CIFAR "
            "pickles, as the config trains on) is not: give one with --data, e.g. "
            "$NEUTRENO_DATA/cifar10-test.tar.gz"
        )
    load_images(data, size=data_cfg.image_size, channels=data_cfg.channels, split=split, limit=1)
    trained = {v.attention: spectrum.train_variant(v) for v in variants}
    for variant in variants:
        val = trained[variant.attention]["val"]["model"]
        measured = spectrum.measure_variant(variant.out_dir, data, split, args.samples)
        report["images"] = measured.pop("images")
        report["variants"][variant.attention] = {
            "top1": val["top1"],
            "top5": val.get("top5"),
            "val_images": val["count"],
            "train_seconds": trained[variant.attention].get("train_seconds"),
            **measured,
        }
    table = spectrum.markdown_table(report)
    print(f"\n{report['images']} images of {data}\n\n{table}")
    _lock = FolderLock(args.out)
    written = spectrum.write_report(args.out, report)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0

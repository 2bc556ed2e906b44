"""``neutreno study rank-collapse``: the source papers' explanations of over-smoothing, measured."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path


def _list(kind):
    """argparse type: a comma list of ``kind`` (int or str)."""

    def parse(text: str) -> list:
        try:
            return [kind(t.strip()) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {kind.__name__}, got {text!r}"
            ) from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neutreno.studies import rank_collapse as rc

    studies = parser.add_subparsers(dest="study", required=True, metavar="STUDY")
    p = studies.add_parser(
        "rank-collapse",
        help="token cosine and Q/K/V gradient norms at initialisation over depth, norm, α and attention",
        description=rc.__doc__.split("\n\n")[1],
    )
    p.add_argument("--data", default="../shared/data/wikitext103-mini", help="a WikiText corpus folder")
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
    p.add_argument("--seeds", type=_list(int), default=[0, 1, 2], help="initialisation seeds (default 0,1,2)")
    p.add_argument("--samples", type=int, default=8, help="WikiText windows (default 8)")
    p.add_argument("--length", type=int, default=128, help="tokens per window (default 128, the context)")
    p.add_argument(
        "--init",
        choices=rc.INITS,
        default="fan_in",
        help="fan_in: N(0, 1/fan_in) as Noci et al. analyse (default); model: the model's own init",
    )
    p.add_argument("--out", type=Path, default=Path("runs/study_rank_collapse"), help="output folder")


def run(args) -> int:
    from neutreno.models.language_model import LM_DEFAULT_LAM
    from neutreno.studies import rank_collapse as rc

    lam = LM_DEFAULT_LAM if args.lam is None else args.lam
    rc.check_grid(args.depths, args.norms, args.residual_scales, args.attentions, lam, args.init)
    if args.samples < 1 or not 1 <= args.length <= 128:
        raise ValueError(f"--samples must be >= 1 and --length 1..128, got {args.samples} and {args.length}")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a folder")
    data = rc.load_windows(args.data, args.samples, args.length)
    settings = [
        rc.Setting(depth, norm, scale, attention, seed, lam if attention.endswith("neutreno") else None)
        for norm, scale, attention, depth, seed in itertools.product(
            args.norms, args.residual_scales, args.attentions, args.depths, args.seeds
        )
    ]
    print(f"{len(settings)} models ({rc.MODEL} width, {args.init} init) on {data.source}")
    records = rc.run_study(settings, data, args.out, args.init)
    rows = rc.summarize(records)
    print("\nlast-layer token cosine / ‖∇W_Q‖/‖∇W_V‖ (whole stack), mean over seeds\n")
    print(rc.markdown_table(rows))
    meta = {"model": rc.MODEL, "data": data.source, "lam": lam, "init": args.init, "seeds": args.seeds}
    written = rc.write_report(args.out, records, rows, meta)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0

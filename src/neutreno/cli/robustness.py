"""``neutreno robustness CKPT --data DIR``: top-1 error under every corruption and severity, and mCE
against a baseline checkpoint or AlexNet's published ImageNet-C errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from neutreno.cli.types import integer, seed
from neutreno.config import check_num_workers
from neutreno.io import FolderLock, check_output_folder, first_missing, remove_if_only_lock
from neutreno.progress import note
from neutreno.reporting import pyplot, readable_ylim, save_figure, write_csv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from neutreno.data.corruptions import CORRUPTIONS

    parser.add_argument(
        "checkpoint", type=Path, help="a classifier: .safetensors file, checkpoint or run folder"
    )
    parser.add_argument("--data", required=True, help="image folder/archive or CIFAR pickles (as for eval)")
    parser.add_argument("--split", default="val", help="split to corrupt (default: val)")
    parser.add_argument(
        "--corruptions",
        default="all",
        help="comma list or 'all' (default; saturate left out for a one-channel model): "
        + ", ".join(CORRUPTIONS),
    )
    parser.add_argument("--severities", default="1,2,3,4,5", help="comma list of 1 … 5 (default: all)")
    parser.add_argument(
        "--samples", type=integer, default=None, help="images, spread over the split (default: all)"
    )
    parser.add_argument(
        "--baseline",
        help="mCE relative to: another checkpoint (run on the same corrupted images), a robustness.json "
        "written by this command, or 'alexnet' (ImageNet-C's published AlexNet errors; ImageNet models)",
    )
    parser.add_argument("--seed", type=seed, default=0, help="corruption seed (image i uses seed + i)")
    parser.add_argument("--batch-size", type=integer, default=100)
    parser.add_argument("--workers", type=integer, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, default=Path("runs/robustness"), help="output folder")


def run(args) -> int:
    from neutreno.data.corruptions import CORRUPTIONS

    corruptions = list(CORRUPTIONS) if args.corruptions == "all" else args.corruptions.split(",")
    if not all(corruptions):  # "," named "" twice: "--corruptions names  more than once"
        raise ValueError(f"--corruptions must be a comma list of names, got {args.corruptions!r}")
    try:
        severities = [int(s) for s in args.severities.split(",")]
    except ValueError:
        raise ValueError(f"--severities must be a comma list of 1 … 5, got {args.severities!r}") from None
    for option, values in (("--corruptions", corruptions), ("--severities", severities)):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:  # scored twice over, and the report holds one
            raise ValueError(f"{option} names {', '.join(twice)} more than once")
    unknown = [name for name in corruptions if name not in CORRUPTIONS]
    if unknown:  # before a JSON baseline is read (it said "has no baseline error for fogg")
        raise ValueError(f"unknown corruption {unknown[0]!r}; valid: {', '.join(CORRUPTIONS)}")
    if not all(1 <= s <= 5 for s in severities):
        raise ValueError(f"--severities must be among 1 … 5, got {args.severities!r}")
    severities.sort()  # the table's columns, the CSV's rows and the plot's curves run 1 → 5 (5,1,3 zigzagged)
    if (args.samples is not None and args.samples < 1) or args.batch_size < 1:
        raise ValueError("--samples and --batch-size must be >= 1")
    check_num_workers(args.workers, "--workers")
    check_output_folder(args.out, "--out")
    left_out = args.corruptions == "all" and _reads_one_channel(args.checkpoint)
    if left_out:  # grey stays grey: its "error" would be the clean one, averaged into the mCE
        corruptions.remove("saturate")
    if args.baseline == "alexnet":
        from neutreno.evaluation.robustness import ALEXNET_ERRORS

        if not set(corruptions) & ALEXNET_ERRORS.keys():  # found after scoring every image, before
            raise ValueError(
                f"--baseline alexnet: AlexNet's ImageNet-C table has none of {', '.join(corruptions)} "
                f"(it has {', '.join(ALEXNET_ERRORS)})"
            )
        _check_imagenet_model(args.checkpoint, args.data, args.split, severities)
    baseline_report = None
    if args.baseline and args.baseline != "alexnet":
        ours = _image_preprocess(_preprocess(args.checkpoint))
        if args.baseline.endswith(".json"):
            baseline_report = _baseline_report(Path(args.baseline), args, corruptions, severities)
            theirs = _image_preprocess(baseline_report.get("preprocess"))
        else:
            theirs = _image_preprocess(_preprocess(Path(args.baseline)))
            _check_baseline_opens(Path(args.baseline), args.data, args.split)
        if theirs != ours:
            raise ValueError(
                f"the baseline {args.baseline} sees images preprocessed as {theirs}, this model as {ours}: "
                "other corrupted images (and, across 64 px, other corruption settings) compare nothing"
            )
    # one run at a time in --out: its progress files (a stopped run continues from them) are its own
    created = first_missing(args.out)
    lock = FolderLock(args.out)
    try:
        done = _score_and_report(args, corruptions, severities, baseline_report, lock)
        if left_out:  # (said once the evaluation ran: before it, the arguments' errors come first)
            note("saturate was left out: it changes nothing in one-channel images")
        return done
    except BaseException:
        lock.release()
        if created:
            remove_if_only_lock(args.out, created)
        raise


def _score_and_report(args, corruptions: list[str], severities: list[int], baseline_report, lock) -> int:
    from neutreno.evaluation.robustness import corruption_errors, evaluate_corruptions, mean_corruption_error

    progress_files = {role: args.out / f".robustness-{role}-progress.pt" for role in ("model", "baseline")}
    settings = dict(
        split=args.split,
        corruptions=corruptions,
        severities=severities,
        samples=args.samples,
        seed=args.seed,
        batch_size=args.batch_size,
        num_workers=args.workers,
        device=args.device,
    )
    report = evaluate_corruptions(args.checkpoint, args.data, **settings, resume_file=progress_files["model"])
    result = {"model": report}
    if args.baseline == "alexnet":
        result["ce"] = corruption_errors(report["error"], "alexnet")
        result["baseline"] = "alexnet"
    elif args.baseline:
        if baseline_report is None:
            baseline_report = evaluate_corruptions(
                Path(args.baseline), args.data, **settings, resume_file=progress_files["baseline"]
            )
        else:
            if baseline_report.get("images") != report["images"]:
                raise ValueError(
                    f"{args.baseline} scored {baseline_report.get('images')} images, this run "
                    f"{report['images']}: corruption errors compare only on the same images"
                )
            # JSON keys are strings; a baseline scored at more severities gives CE over this run's
            baseline_report["error"] = {
                c: {int(s): e for s, e in v.items() if int(s) in severities}
                for c, v in baseline_report["error"].items()
            }
        result["baseline"] = baseline_report
        result["ce"] = corruption_errors(report["error"], baseline_report["error"])
    if "ce" in result:
        result["mce"] = mean_corruption_error(result["ce"])
    print_table(result)
    written = write_report(args.out, result, locked=True)
    for path in progress_files.values():
        path.unlink(missing_ok=True)
    lock.release()
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _baseline_report(path: Path, args, corruptions: list[str], severities: list[int]) -> dict:
    """The model part of a saved ``robustness.json``, checked before any work to have been scored as this
    run will be (the same corrupted images of the same data, split, seed, samples; every corruption and
    severity asked for) and to hold errors: errors on other images, or a corruption left out, would
    give a corruption error that compares nothing."""
    from neutreno.data.corruptions import CORRUPTIONS_VERSION
    from neutreno.evaluation.robustness import data_identity

    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path} as a robustness report: {error}") from None
    report = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(report, dict) or not isinstance(report.get("error"), dict):
        raise ValueError(f"{path} is not a robustness report (no model errors)")
    _check_errors(path, report)
    if report.get("corruptions_version") != CORRUPTIONS_VERSION:
        raise ValueError(
            f"{path} was scored on the corrupted images of an older neutreno (motion blur and pixelate "
            "differ since): score the baseline again, or give its checkpoint"
        )
    ours = data_identity(args.data, args.split)
    if report.get("data_identity") != ours:
        raise ValueError(
            f"{path} was scored on {report.get('data')!r} ({report.get('data_identity')}), this run on "
            f"{args.data!r} ({ours}): other images (or the same folder since changed)"
        )
    checked = [("split", args.split), ("seed", args.seed), ("samples", args.samples)]
    for key, ours in checked:
        if report.get(key) != ours:
            raise ValueError(f"{path} was scored with {key} {report.get(key)!r}, this run with {ours!r}")
    missing = [
        f"{c} severity {s}"
        for c in corruptions
        for s in severities
        if str(s) not in report["error"].get(c, {})
    ]
    if missing:
        listed = ", ".join(missing[:3]) + (f", … ({len(missing)} in all)" if len(missing) > 3 else "")
        raise ValueError(f"{path} has no baseline error for {listed}")
    return report


def _check_errors(path: Path, report: dict) -> None:
    """A saved report's errors are {corruption: {"1" … "5": a number in [0, 100]}}: JSON keys as this
    command writes them ("01" beside "1" replaced one severity by the other), and a percentage (NaN, a
    negative or a string gave a NaN or negative mCE, or a traceback)."""
    from neutreno.evaluation.robustness import is_percentage

    clean = report.get("clean")
    top1 = clean.get("top1") if isinstance(clean, dict) else None
    if not is_percentage(top1):
        raise ValueError(f"{path}: its clean top-1 is not a percentage in [0, 100] ({top1!r})")
    for name, by_severity in report["error"].items():
        if not isinstance(by_severity, dict):
            raise ValueError(f"{path}: {name} holds {by_severity!r}, not errors by severity")
        for key, error in by_severity.items():
            if key not in {str(s) for s in range(1, 6)}:
                raise ValueError(f'{path}: {name} has severity {key!r}; severities are "1" … "5"')
            if not is_percentage(error):
                raise ValueError(f"{path}: {name} severity {key} holds {error!r}, not an error in [0, 100]")


def _image_preprocess(preprocess: dict | None) -> dict | None:
    """What of a preprocessing decides the corrupted images: size, crop and channels (corruptions act on
    the 8-bit crop; the mean and std are applied to the model's input after)."""
    if not isinstance(preprocess, dict):
        return preprocess
    return {key: preprocess.get(key) for key in ("image_size", "crop_pct", "channels")}


def _check_baseline_opens(baseline: Path, data: str, split: str) -> None:
    """The baseline checkpoint reads this data (its classes, its image channels) before the model is
    scored, which on ImageNet takes hours and was thrown away when the baseline then failed, in words
    blaming "the checkpoint"."""
    from neutreno.evaluation.classification import open_classifier

    try:
        open_classifier(baseline, data, split, "cpu")
    except ValueError as error:
        raise ValueError(f"the baseline {baseline}: {error}") from None


def _check_imagenet_model(checkpoint: Path, data: str, split: str, severities: list[int]) -> None:
    """AlexNet's published ImageNet-C errors are a baseline only for a 1000-class ImageNet model scored
    over all 1000 classes at all five severities (CE_c = Σ_s E_s,c / Σ_s E^AlexNet_s,c): a 10-class
    subset's error, or severity 1's alone, divided by AlexNet's means a number that compares nothing."""
    from neutreno.evaluation.classification import open_classifier
    from neutreno.models.checkpoint import read_metadata
    from neutreno.training.checkpoint import resolve_weights

    advice = "give another checkpoint or a robustness.json as the baseline"
    classes = read_metadata(resolve_weights(checkpoint)).get("classes") or []
    if len(classes) != 1000:
        raise ValueError(
            f"--baseline alexnet holds AlexNet's errors on the 1000 ImageNet classes; {checkpoint} has "
            f"{len(classes)} classes: {advice}"
        )
    if sorted(severities) != [1, 2, 3, 4, 5]:
        raise ValueError(f"--baseline alexnet needs all five severities (its CE sums them), got {severities}")
    pre = _preprocess(checkpoint)
    if pre.get("image_size") != 224 or pre.get("crop_pct") != 0.875:
        # ImageNet-C's images are 224-px centre crops of 256-px ones; at 64 px and below they would be
        # corrupted with CIFAR-10-C's settings, and at other sizes at other strengths
        raise ValueError(
            "--baseline alexnet holds AlexNet's errors on ImageNet-C's 224-px crops (image size 224, crop "
            f"0.875); {checkpoint} sees images of size {pre.get('image_size')}, crop {pre.get('crop_pct')}: "
            f"{advice}"
        )
    scored = len(open_classifier(checkpoint, data, split, "cpu").dataset.classes)
    if scored != 1000:
        raise ValueError(
            f"--baseline alexnet holds AlexNet's errors over 1000 classes; {data} ({split}) has {scored}, "
            f"which would be scored over those alone: {advice}"
        )


def _reads_one_channel(checkpoint: Path) -> bool:
    """Whether a checkpoint records one-channel preprocessing; False where it cannot say (the evaluation
    then names what is wrong with it)."""
    try:
        return _preprocess(checkpoint).get("channels") == 1
    except (OSError, ValueError):
        return False


def _preprocess(checkpoint: Path) -> dict | None:
    """The preprocessing a checkpoint records, as a robustness.json holds it (lists, not tuples)."""
    from neutreno.models.checkpoint import checkpoint_kind, read_metadata
    from neutreno.training.checkpoint import resolve_weights

    weights = resolve_weights(checkpoint)
    meta = read_metadata(weights)
    kind = checkpoint_kind(meta)
    if kind != "classifier":  # (it said: "sees images preprocessed as None")
        raise ValueError(f"{weights} is a {kind}: robustness scores image classifiers")
    if "preprocess" not in meta:
        raise ValueError(f"{weights} records no preprocessing (not written by neutreno train)")
    return json.loads(json.dumps(meta["preprocess"]))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def print_table(result: dict) -> None:
    model, baseline = result["model"], result.get("baseline")
    other = baseline if isinstance(baseline, dict) else None
    severities = list(next(iter(model["error"].values())))
    clean = f"clean top-1 {model['clean']['top1']:.2f}" + (
        f" (baseline {other['clean']['top1']:.2f})" if other else ""
    )
    print(f"\n{model['images']} images of {model['data']} ({model['split']}); {clean}")
    header = f"{'corruption':>18}  " + "  ".join(f"{'s' + str(s):>6}" for s in severities) + f"  {'mean':>6}"
    header += f"  {'base':>6}" if other else ""
    print(header + (f"  {'CE':>6}" if "ce" in result else ""))
    for name, by_severity in model["error"].items():
        row = (
            f"{name:>18}  "
            + "  ".join(f"{e:6.2f}" for e in by_severity.values())
            + f"  {_mean(by_severity.values()):6.2f}"
        )
        if other:  # over this run's severities, as its mean and the CE are
            row += f"  {_mean(other['error'][name][s] for s in by_severity):6.2f}"
        if "ce" in result:
            row += f"  {result['ce'][name]:6.1f}" if name in result["ce"] else f"  {'—':>6}"
        print(row)
    if "mce" in result:
        against = "AlexNet's ImageNet-C errors" if baseline == "alexnet" else "the baseline"
        print(f"mCE {result['mce']:.2f} (relative to {against}, over {len(result['ce'])} corruptions)")


def write_report(out: Path, result: dict, locked: bool = False) -> list[Path]:
    """``robustness.json``, ``robustness.csv`` (model, corruption, severity, error) and ``robustness.png``;
    ``locked``: the caller holds ``out``'s lock (a second lock of this process, closed, would release it)."""
    from matplotlib.ticker import MaxNLocator

    from neutreno.io import remove_report, write_json

    plt = pyplot()

    # One writer at a time, and the last report's files gone first: two runs into one folder, or a run
    # stopped between its writes, left the json and csv of one run beside the plot of another.
    _lock = None if locked else FolderLock(out)
    remove_report(out, ["robustness.json", "robustness.csv", "robustness.png"])
    write_json(out / "robustness.json", result)
    models = {"model": result["model"]}
    if isinstance(result.get("baseline"), dict):
        models["baseline"] = result["baseline"]
    rows = [["model", "checkpoint", "corruption", "severity", "top1_error"]]
    for role, report in models.items():
        rows.append([role, report["checkpoint"], "clean", 0, f"{100 - report['clean']['top1']:.4f}"])
        for name, by_severity in report["error"].items():
            by_severity = sorted((int(s), e) for s, e in by_severity.items())  # a baseline's JSON any order
            rows += [[role, report["checkpoint"], name, s, f"{e:.4f}"] for s, e in by_severity]
    write_csv(out / "robustness.csv", rows)
    names = list(result["model"]["error"])
    rows = -(-len(names) // 5)  # at most 5 panels a row, the rows filled evenly
    cols = -(-len(names) // rows)
    fig, axes = plt.subplots(
        rows, cols, figsize=(2.6 * cols, 2.3 * rows + 0.9), squeeze=False, sharex=True, sharey=True,
        layout="constrained",
    )  # fmt: skip
    for ax, name in zip(axes.flat, names, strict=False):
        for role, report in models.items():
            severities, errors = zip(
                *sorted((int(s), e) for s, e in report["error"][name].items()), strict=True
            )
            line = ax.plot(severities, errors, marker="o", ms=3, label=f"{role}, corrupted")
            clean = 100 - report["clean"]["top1"]
            ax.axhline(clean, color=line[0].get_color(), lw=0.8, ls=":", label=f"{role}, clean")
        ax.set_title(name.replace("_", " "), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    readable_ylim(axes[0][0], bounds=(0.0, 100.0))  # shared by every panel
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("top-1 error (%)", fontsize=8)
    for index, ax in enumerate(axes.flat[: len(names)]):
        if index + cols >= len(names):  # the lowest panel of its column
            ax.set_xlabel("severity", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(
        "top-1 error by corruption severity" + (f"; mCE {result['mce']:.1f}" if "mce" in result else "")
    )
    save_figure(fig, out / "robustness.png", dpi=110)
    return [out / "robustness.json", out / "robustness.csv", out / "robustness.png"]

"""``neutreno robustness``: errors under corruptions, CE/mCE, and scoring a subset of the classes
(ImageNet-A/R) — on classifiers trained here on the real digits."""

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import digits_config
from neutreno.cli.main import main
from neutreno.data.augment import normalize
from neutreno.data.corruptions import CORRUPTIONS, CORRUPTIONS_VERSION, corrupt
from neutreno.data.datasets import open_image_dataset
from neutreno.evaluation.classification import evaluate_checkpoint
from neutreno.evaluation.robustness import (
    ALEXNET_ERRORS,
    corruption_errors,
    evaluate_corruptions,
    mean_corruption_error,
)
from neutreno.models import create_model, load_model
from neutreno.training.checkpoint import resolve_weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A softmax and a NeuTRENO digits classifier, 3 epochs each."""
    root = tmp_path_factory.mktemp("robustness")
    out = {}
    for attention in ("softmax", "neutreno"):
        config = digits_config(
            model={"name": "vit_digits", "attention": attention, "args": {"depth": 2}},
            train={"epochs": 3, "batch_size": 32, "out_dir": str(root / attention)},
        )
        path = root / f"{attention}.yaml"
        path.write_text(yaml.safe_dump(config))
        assert main(["train", str(path)]) == 0
        out[attention] = root / attention
    return out


def test_corruption_errors_and_mce_by_hand():
    errors = {"fog": {1: 20.0, 2: 40.0}, "contrast": {1: 10.0, 2: 30.0}, "saturate": {1: 5.0, 2: 5.0}}
    baseline = {"fog": {1: 40.0, 2: 60.0}, "contrast": {1: 20.0, 2: 20.0}}
    ce = corruption_errors(errors, baseline)
    assert ce == pytest.approx({"fog": 60.0, "contrast": 100.0})  # 100·60/100, 100·40/40; no saturate base
    assert mean_corruption_error(ce) == pytest.approx(80.0)
    # saturate is not among ImageNet-C's 15; our elastic_transform's levels are not ImageNet-C's
    five = {name: {s: 10.0 * s + len(name) for s in range(1, 6)} for name in ("fog", "contrast", "saturate")}
    alexnet = corruption_errors({**five, "elastic_transform": {s: 10.0 for s in range(1, 6)}}, "alexnet")
    assert alexnet == pytest.approx(
        {"fog": (30.0 + 3) / ALEXNET_ERRORS["fog"], "contrast": (30.0 + 8) / ALEXNET_ERRORS["contrast"]}
    )
    # some severities only: divided by AlexNet's five-severity mean, or over the baseline's shared ones
    # (severities 1–5 against a baseline's 1–3 gave CE 100 from the shared three), without a word
    with pytest.raises(ValueError, match=r"fog: AlexNet's error is over severities 1–5, got \[1, 2\]"):
        corruption_errors(errors, "alexnet")
    with pytest.raises(ValueError, match=r"fog: severities \[1, 2\], the baseline's \[1\]"):
        corruption_errors(errors, {"fog": {1: 40.0}})
    with pytest.raises(ValueError, match="no corruption errors"):
        mean_corruption_error({})


def test_errors_match_an_explicit_evaluation_and_not_the_batch_size(runs):
    settings = dict(
        split="test", corruptions=["impulse_noise", "contrast"], severities=[2, 5], samples=90, seed=3
    )
    report = evaluate_corruptions(runs["softmax"], "digits", **settings, batch_size=64, num_workers=0)
    assert report["images"] == 90 and set(report["error"]) == {"impulse_noise", "contrast"}
    again = evaluate_corruptions(runs["softmax"], "digits", **settings, batch_size=7, num_workers=0)
    assert again["error"] == report["error"] and again["clean"] == pytest.approx(report["clean"])

    # By hand: the same 90 images (every len/90-th of the test split), image i corrupted with seed 3 + i.
    model, _ = load_model(resolve_weights(runs["softmax"]))
    dataset = open_image_dataset("digits", "test", size=8, train=False, crop_pct=1.0, channels=1)
    picks = [i * len(dataset) // 90 for i in range(90)]
    images = torch.stack([dataset[i][0] for i in picks])
    labels = torch.tensor([dataset[i][1] for i in picks])
    for name, severity in [("impulse_noise", 5), ("contrast", 2)]:
        corrupted = torch.cat([corrupt(images[i : i + 1], name, severity, seed=3 + i) for i in range(90)])
        with torch.no_grad():
            predicted = model.eval()(normalize(corrupted, [0.3], [0.4])).argmax(-1)
        expected = 100 * (predicted != labels).float().mean().item()
        assert report["error"][name][severity] == pytest.approx(expected)
    assert report["error"]["impulse_noise"][5] > 100 - report["clean"]["top1"]  # 27 % of pixels salt/pepper


def digits_args(corruptions: str, severities: str) -> list[str]:
    """`neutreno robustness` arguments scoring the digits' test split at these corruptions and severities."""
    return ["--data", "digits", "--split", "test", "--corruptions", corruptions, "--severities", severities,
            "--workers", "0"]  # fmt: skip


def test_cli_writes_the_report_with_a_baseline_checkpoint_or_report(runs, tmp_path, capsys):
    out = tmp_path / "r"
    common = [*digits_args("impulse_noise,fog", "1,5"), "--samples", "60"]
    assert (
        main(
            [
                "robustness",
                str(runs["neutreno"]),
                *common,
                "--baseline",
                str(runs["softmax"]),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads((out / "robustness.json").read_text())
    model, base = result["model"]["error"], result["baseline"]["error"]
    for name in ("impulse_noise", "fog"):
        expected = 100 * (model[name]["1"] + model[name]["5"]) / (base[name]["1"] + base[name]["5"])
        assert result["ce"][name] == pytest.approx(expected)
    assert result["mce"] == pytest.approx(sum(result["ce"].values()) / 2)
    rows = (out / "robustness.csv").read_text().splitlines()
    assert rows[0] == "model,checkpoint,corruption,severity,top1_error" and len(rows) == 1 + 2 * (1 + 4)
    assert (out / "robustness.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "mCE" in printed and "impulse_noise" in printed

    # The baseline's own report gives the same mCE without scoring it again.
    baseline_report = tmp_path / "base"
    assert main(["robustness", str(runs["softmax"]), *common, "--out", str(baseline_report)]) == 0
    again = tmp_path / "again"
    report_path = str(baseline_report / "robustness.json")
    assert (
        main(["robustness", str(runs["neutreno"]), *common, "--baseline", report_path, "--out", str(again)])
        == 0
    )
    assert json.loads((again / "robustness.json").read_text())["mce"] == pytest.approx(result["mce"])
    # Fewer severities than the saved report: CE over this run's (it was refused once scored).
    fewer = [*digits_args("impulse_noise,fog", "5"), "--samples", "60", "--baseline", report_path]
    assert main(["robustness", str(runs["neutreno"]), *fewer, "--out", str(tmp_path / "fewer")]) == 0
    ce = json.loads((tmp_path / "fewer" / "robustness.json").read_text())["ce"]
    assert ce == pytest.approx({name: 100 * model[name]["5"] / base[name]["5"] for name in model})
    # A saved report scored otherwise than this run is refused, naming what differs (before any work; the
    # image count once scored), no report written: an mCE over other images or corruptions compares nothing.
    capsys.readouterr()
    for changed, message in (
        (["--seed", "1"], "seed 0, this run with 1"),
        (["--split", "train"], "split 'test', this run with 'train'"),
        (["--corruptions", "impulse_noise,fog,contrast"], "no baseline error for contrast severity 1"),
        (["--severities", "1,2"], "no baseline error for impulse_noise severity 2"),
        (["--samples", "30"], "samples 60, this run with 30"),
        # checked before the report's errors: "has no baseline error for fogg severity 1"
        (["--corruptions", "impulse_noise,fogg"], "unknown corruption 'fogg'"),
        (["--severities", "0"], "--severities must be among 1 … 5, got '0'"),
    ):
        other = tmp_path / "other"
        args = ["robustness", str(runs["neutreno"]), *common, *changed, "--baseline", report_path]
        assert main([*args, "--out", str(other)]) == 2, changed
        assert message in capsys.readouterr().err, changed
        assert not other.exists()
    # A report of an older neutreno, whose motion blur and pixelate were other images: refused before any
    # work (it was taken, a level off on a third of those pixels).
    saved = json.loads((baseline_report / "robustness.json").read_text())
    assert saved["model"]["corruptions_version"] == CORRUPTIONS_VERSION
    del saved["model"]["corruptions_version"]
    (tmp_path / "old.json").write_text(json.dumps(saved))
    args = ["robustness", str(runs["neutreno"]), *common, "--baseline", str(tmp_path / "old.json")]
    assert main([*args, "--out", str(tmp_path / "other")]) == 2
    assert "an older neutreno" in capsys.readouterr().err and not (tmp_path / "other").exists()
    (tmp_path / "list.json").write_text("[1]")
    assert (
        main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(tmp_path / "list.json")]) == 2
    )
    assert "is not a robustness report" in capsys.readouterr().err
    # AlexNet's ImageNet-C errors are no baseline for a model of other classes: refused before any work.
    capsys.readouterr()
    refused = tmp_path / "refused"
    assert (
        main(["robustness", str(runs["neutreno"]), *common, "--baseline", "alexnet", "--out", str(refused)])
        == 2
    )
    assert "1000 ImageNet classes" in capsys.readouterr().err and not refused.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--corruptions", "snow"], "unknown corruption 'snow'"),
        (["--severities", "0,1"], "severities must be among 1 … 5"),
        (["--severities", "x"], "--severities must be a comma list"),
        (["--samples", "0"], "--samples and --batch-size must be >= 1"),
        (["--workers", "100000"], "--workers: must be 0 to 256, got 100000"),  # forked until stalled
        (["--severities", "1,2,2"], "--severities names 2 more than once"),  # scored twice, reported once
        (["--corruptions", "fog,contrast,fog"], "--corruptions names fog more than once"),
        (
            ["--corruptions", "fog,"],
            "--corruptions must be a comma list of names, got 'fog,'",
        ),  # "names  more"
        # 360 test digits: image 1 of seed 2³² − 1 drew seed 0's noise (the generator keeps 32 bits)
        (["--split", "test", "--seed", str(2**32 - 1)], "for 360 images must stay below 2^32"),
    ],
)
def test_cli_refuses_bad_arguments(runs, tmp_path, capsys, extra, message):
    args = ["robustness", str(runs["softmax"]), "--data", "digits", "--out", str(tmp_path / "o"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("neutreno robustness: error:") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_severities_given_out_of_order_are_reported_in_order(runs, tmp_path, capsys):
    """Found in review: --severities 5,1,3 printed columns s5 s1 s3, wrote the CSV's rows in that order
    and drew each curve 5 → 1 → 3 (the 3 → 5 segment never drawn)."""
    out = tmp_path / "r"
    args = ["robustness", str(runs["softmax"]), *digits_args("fog", "5,1,3"), "--samples", "20"]
    assert main([*args, "--out", str(out)]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "s1" in line)
    assert header.split().index("s1") < header.split().index("s3") < header.split().index("s5")
    assert list(json.loads((out / "robustness.json").read_text())["model"]["error"]["fog"]) == ["1", "3", "5"]
    rows = [line.split(",") for line in (out / "robustness.csv").read_text().splitlines()[1:]]
    assert [(name, severity) for _, _, name, severity, _ in rows] == [
        ("clean", "0"),
        ("fog", "1"),
        ("fog", "3"),
        ("fog", "5"),
    ]


def test_a_baseline_checkpoint_of_other_classes_is_refused_before_the_model_is_scored(
    runs, tmp_path, capsys, monkeypatch
):
    """Found in review: it was refused only once the model had been scored (hours on ImageNet, thrown
    away), in words that blamed "the checkpoint" (the model's?)."""
    from neutreno.evaluation import robustness
    from neutreno.models import save_model

    model, meta = load_model(resolve_weights(runs["softmax"]))
    other = tmp_path / "other.safetensors"
    save_model(other, model, {"classes": [f"n{i:08d}" for i in range(10)], "preprocess": meta["preprocess"]})
    scored = []
    original = robustness.evaluate_corruptions
    monkeypatch.setattr(
        robustness, "evaluate_corruptions", lambda *a, **k: scored.append(a) or original(*a, **k)
    )
    args = ["robustness", str(runs["neutreno"]), *digits_args("fog", "1"), "--baseline", str(other)]
    assert main([*args, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"error: the baseline {other}: " in err and "classes" in err and not scored
    assert not (tmp_path / "r").exists()


def _digit_folder(root, digits):
    """An ImageFolder (``root/test/<digit>/*.png``) of the real test digits of some classes only."""
    dataset = open_image_dataset("digits", "test", size=8, train=False, crop_pct=1.0, channels=1)
    for index in range(len(dataset)):
        image, label = dataset[index]
        if str(label) in digits:
            folder = root / "test" / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[0].numpy()).save(folder / f"{index:04d}.png")
    return root


def test_a_subset_of_the_classes_is_scored_over_the_subset(runs, tmp_path):
    """ImageNet-A/R hold 200 of ImageNet's 1000 classes: their logits are those classes' columns."""
    root = _digit_folder(tmp_path / "subset", {"3", "5", "8"})
    scored = evaluate_checkpoint(runs["softmax"], str(root), split="test", num_workers=0)
    assert scored["classes_scored"] == 3
    model, _ = load_model(resolve_weights(runs["softmax"]))
    files = sorted((root / "test").glob("*/*.png"))
    images = torch.tensor(np.stack([np.asarray(Image.open(f)) for f in files]))[:, None]
    labels = torch.tensor([["3", "5", "8"].index(f.parent.name) for f in files])
    with torch.no_grad():
        logits = model.eval()(normalize(images, [0.3], [0.4]))[:, [3, 5, 8]]
    assert scored["top1"] == pytest.approx(100 * (logits.argmax(-1) == labels).float().mean().item())
    assert scored["count"] == len(files)
    assert scored["head_classes"] == 10


def test_neutreno_eval_says_when_it_scores_a_subset_of_the_heads_classes(runs, tmp_path, capsys):
    """A validation folder that lost a class was scored 9-way with nothing said (only classes_scored in
    the JSON): a head always picking the missing class read 11.1% top-1, not 0%."""
    root = _digit_folder(tmp_path / "subset", {"3", "5", "8"})
    assert main(["eval", str(runs["softmax"]), "--data", str(root), "--split", "test", "--workers", "0"]) == 0
    err = capsys.readouterr().err
    assert "note: scored over the data's 3 classes, a subset of the head's 10" in err
    assert main(["eval", str(runs["softmax"]), "--data", "digits", "--split", "test", "--workers", "0"]) == 0
    assert "note:" not in capsys.readouterr().err

    other = _digit_folder(tmp_path / "other", {"3"})
    (other / "test" / "cat").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(other / "test" / "cat" / "x.png")
    with pytest.raises(ValueError, match="a subset of its classes is scored"):
        evaluate_checkpoint(runs["softmax"], str(other), split="test", num_workers=0)


def test_a_baseline_or_alexnet_that_saw_other_images_is_refused_before_any_work(runs, tmp_path, capsys):
    """A baseline checkpoint of another image size was scored on other corrupted images (across 64 px
    under other corruption settings) and its CE taken anyway; AlexNet's 1000-way, five-severity errors
    divided a 10-class or one-severity error."""
    from neutreno.cli.robustness import print_table
    from neutreno.models import save_model

    weights = resolve_weights(runs["softmax"])
    model, meta = load_model(weights)
    larger = tmp_path / "larger.safetensors"
    save_model(
        larger, model, {"classes": meta["classes"], "preprocess": {**meta["preprocess"], "image_size": 96}}
    )
    common = digits_args("fog", "1")
    out = tmp_path / "r"
    assert (
        main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(larger), "--out", str(out)])
        == 2
    )
    assert "'image_size': 96" in capsys.readouterr().err and not out.exists()
    # a language model or segmenter as the baseline: "sees images preprocessed as None"
    lm = tmp_path / "lm.safetensors"
    save_model(lm, create_model("lm_wt103_mini", vocab_size=8, depth=1, context_length=8, cutoffs=[4]),
               {"tokenizer": {"kind": "words", "words": list("abcdefgh")}})  # fmt: skip
    assert main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(lm), "--out", str(out)]) == 2
    assert f"{lm} is a language model: robustness scores image classifiers" in capsys.readouterr().err
    report = tmp_path / "base"
    assert main(["robustness", str(runs["softmax"]), *common, "--samples", "20", "--out", str(report)]) == 0
    saved = json.loads((report / "robustness.json").read_text())
    assert saved["model"]["preprocess"]["image_size"] == 8 and saved["model"]["classes_scored"] == 10
    saved["model"]["preprocess"]["image_size"] = 96
    (tmp_path / "larger.json").write_text(json.dumps(saved))
    args = ["robustness", str(runs["neutreno"]), *common, "--samples", "20", "--out", str(out)]
    assert main([*args, "--baseline", str(tmp_path / "larger.json")]) == 2
    assert "'image_size': 96" in capsys.readouterr().err and not out.exists()

    imagenet = tmp_path / "imagenet.safetensors"  # 1000 classes, of which the digits hold 10
    wide = create_model("vit_digits", depth=2, num_classes=1000)
    classes = [*meta["classes"], *(f"n{i:08d}" for i in range(990))]
    save_model(imagenet, wide, {"classes": classes, "preprocess": meta["preprocess"]})
    # ImageNet-C's images are 224-px crops: an 8-px model's were corrupted with CIFAR-10-C's settings
    # (Gaussian noise σ 0.10 for 0.38) and divided by AlexNet's errors
    at_224 = tmp_path / "imagenet_224.safetensors"
    save_model(at_224, wide, {"classes": classes, "preprocess": {**meta["preprocess"], "image_size": 224,
                                                                "crop_pct": 0.875}})  # fmt: skip
    for checkpoint, severities, message in (
        (imagenet, "1", "needs all five severities"),
        (imagenet, "1,2,3,4,5", "ImageNet-C's 224-px crops (image size 224, crop 0.875); "),
        (at_224, "1,2,3,4,5", "has 10"),
    ):
        extra = ["--severities", severities, "--baseline", "alexnet", "--out", str(out)]
        assert main(["robustness", str(checkpoint), "--data", "digits", "--split", "test", *extra]) == 2
        assert message in capsys.readouterr().err and not out.exists()

    # The printed baseline column averages this run's severities, as the CE does, not all it holds.
    errors = {"fog": {1: 10.0, 5: 50.0}}
    result = {
        "model": {**saved["model"], "error": {"fog": {5: 40.0}}},
        "baseline": {**saved["model"], "error": errors},
    }
    result["baseline"]["clean"] = saved["model"]["clean"]
    print_table({**result, "ce": {"fog": 80.0}, "mce": 80.0})
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("fog"))
    assert row.split() == ["fog", "40.00", "40.00", "50.00", "80.0"]


def test_saturate_is_left_out_for_one_channel_images_and_alexnet_needs_a_corruption_it_has(
    runs, tmp_path, capsys
):
    """On a one-channel model saturate changes nothing (grey stays grey): its 'error' was the clean error,
    averaged into the mCE as a corruption's (101.47 where the corruptions gave 97.6). And --baseline
    alexnet with corruptions outside AlexNet's table scored every image, then failed."""
    assert corrupt(torch.randint(0, 256, (2, 1, 8, 8), dtype=torch.uint8), "saturate", 5).shape == (
        2,
        1,
        8,
        8,
    )
    out = tmp_path / "r"
    args = [
        "robustness",
        str(runs["neutreno"]),
        "--data",
        "digits",
        "--split",
        "test",
        "--samples",
        "10",
        "--workers",
        "0",
    ]
    assert main([*args, "--corruptions", "saturate,fog", "--out", str(out)]) == 2
    assert "saturate changes nothing in one-channel images" in capsys.readouterr().err and not out.exists()
    assert main([*args, "--severities", "1", "--out", str(out)]) == 0
    assert "saturate was left out" in capsys.readouterr().err
    report = json.loads((out / "robustness.json").read_text())
    assert "saturate" not in report["model"]["error"] and "fog" in report["model"]["error"]
    extra = ["--corruptions", "saturate,gaussian_blur", "--baseline", "alexnet", "--out", str(tmp_path / "a")]
    assert main([*args, *extra]) == 2
    assert "AlexNet's ImageNet-C table has none of saturate, gaussian_blur" in capsys.readouterr().err
    # called from Python with its default corruptions (all): those a one-channel model's images can take
    report = evaluate_corruptions(
        runs["neutreno"], "digits", split="test", samples=5, severities=[1], num_workers=0
    )
    assert "saturate" not in report["error"] and len(report["error"]) == len(CORRUPTIONS) - 1
    # a one-pixel side: pixelate's PIL resize to 0 pixels raised PIL's "height and width must be > 0"
    one = torch.randint(0, 256, (1, 3, 1, 1), dtype=torch.uint8)
    assert torch.equal(corrupt(one, "pixelate", 1), one)


def test_a_stopped_evaluation_continues_where_it_stopped_with_the_same_errors(runs, tmp_path, monkeypatch):
    """`neutreno robustness` on a large set (ImageNet: 50,000 images × 70 variants) started again from
    the first batch when it was stopped. Now it saves its sums as it goes and continues from them."""
    from neutreno.evaluation import robustness

    settings = dict(
        split="test", corruptions=["impulse_noise", "fog"], severities=[1, 4], samples=50, seed=5,
        batch_size=8, num_workers=0,
    )  # fmt: skip
    whole = evaluate_corruptions(runs["neutreno"], "digits", **settings)
    progress = tmp_path / "progress.pt"
    calls, real_corrupt = [], robustness.corrupt

    def stops_in_batch_4(images, name, severity, seed):
        calls.append(seed)
        if len(calls) == 3 * 4 + 1:  # 4 variants a batch: the first of batch 4
            raise KeyboardInterrupt
        return real_corrupt(images, name, severity, seed=seed)

    monkeypatch.setattr(robustness, "corrupt", stops_in_batch_4)
    with pytest.raises(KeyboardInterrupt):
        evaluate_corruptions(runs["neutreno"], "digits", **settings, resume_file=progress, save_every_s=0)
    monkeypatch.setattr(robustness, "corrupt", real_corrupt)
    assert torch.load(progress, weights_only=True)["done"] == 3
    resumed = evaluate_corruptions(
        runs["neutreno"], "digits", **settings, resume_file=progress, save_every_s=0
    )
    assert resumed == whole  # every count, error and loss: batches 4 … 7 only, with their own seeds
    # the progress of another evaluation (here another seed) is not taken for this one's
    other = evaluate_corruptions(
        runs["neutreno"], "digits", **{**settings, "seed": 6}, resume_file=progress, save_every_s=0
    )
    assert other["images"] == 50 and other != whole


def test_the_cli_leaves_no_progress_file_behind_a_finished_report(runs, tmp_path):
    out = tmp_path / "r"
    args = [*digits_args("fog", "1"), "--samples", "30", "--batch-size", "8", "--out", str(out)]
    assert main(["robustness", str(runs["softmax"]), *args]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".lock",
        "robustness.csv",
        "robustness.json",
        "robustness.png",
    ]
    refused = tmp_path / "refused"  # a checkpoint that does not load: no folder left behind
    assert main(["robustness", str(tmp_path / "missing"), *args[:-1], str(refused)]) == 2
    assert not refused.exists()


def test_the_out_folder_stays_locked_until_the_run_has_cleaned_up(tmp_path, monkeypatch):
    """write_report took a second lock of the same folder: POSIX locks are the process's, so closing it
    released the run's own, and another run could start while this one deleted its progress files."""
    import gc
    import subprocess
    import sys

    import neutreno.cli.robustness as cli

    out = tmp_path / "out"
    report = {"checkpoint": "m", "data": "digits", "split": "test", "samples": None, "images": 1, "seed": 0,
              "clean": {"top1": 90.0, "top5": 99.0, "loss": 0.1, "count": 1}, "error": {"fog": {1: 20.0}},
              "preprocess": {}, "classes_scored": 10}  # fmt: skip
    monkeypatch.setattr("neutreno.evaluation.robustness.evaluate_corruptions", lambda *a, **k: report)
    after_writing = []
    write = cli.write_report

    def writes_then_asks_another_process(folder, result, **kwargs):
        written = write(folder, result, **kwargs)
        gc.collect()  # whatever write_report opened is closed now
        code = f"from neutreno.io import FolderLock; FolderLock({str(folder)!r})"
        after_writing.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True))
        return written

    monkeypatch.setattr(cli, "write_report", writes_then_asks_another_process)
    assert main(["robustness", str(tmp_path / "m"), *digits_args("fog", "1"), "--out", str(out)]) == 0
    (asked,) = after_writing
    assert asked.returncode != 0 and "is being written by another process" in asked.stderr, asked.stderr


def test_a_checkpoint_without_class_names_is_scored_only_where_its_head_fits_the_data(tmp_path):
    """Without class names the data's class k is scored at the head's row k: a hand-saved 1000-way DeiT
    on a 10-class ImageNet subset got top-1 0 (its 1000-way softmax read at rows 0–9) where scoring the
    right synsets gives 10, and a head narrower than the classes crashed with an IndexError. Refused
    now unless the head has one output per class."""
    from neutreno.evaluation.classification import open_classifier
    from neutreno.models import create_model, save_model

    preprocess = {"mean": [0.3], "std": [0.4], "image_size": 16, "crop_pct": 0.875, "channels": 1}
    for outputs, classes in ((12, None), (8, None), (10, None), (12, [str(d) for d in range(12)])):
        model = create_model("vit_digits", img_size=16, num_classes=outputs).eval()
        weights = tmp_path / f"m{outputs}{classes is None}.safetensors"
        save_model(
            weights, model, extra={"preprocess": preprocess, **({"classes": classes} if classes else {})}
        )
        if classes is None and outputs != 10:
            with pytest.raises(
                ValueError, match=f"records no class names and its head has {outputs} outputs"
            ):
                open_classifier(weights, "digits", "test", device="cpu")
        else:  # one output per class, or the classes named: digits' 10 scored at their own rows
            assert len(open_classifier(weights, "digits", "test", device="cpu").dataset.classes) == 10
    # names that do not say which output scores which class: 10 names for 12 outputs (the data's classes
    # equal the names, so all 12 outputs were scored while classes_scored said 10), 14 names (an
    # IndexError mid-evaluation), a name twice, integers (a TypeError in the error's own formatting)
    model = create_model("vit_digits", img_size=16, num_classes=12).eval()
    bad = (
        [str(d) for d in range(10)],
        [str(d) for d in range(14)],
        ["0", "0", *(str(d) for d in range(2, 12))],
        list(range(12)),
    )
    for classes in bad:
        save_model(
            tmp_path / "named.safetensors", model, extra={"preprocess": preprocess, "classes": classes}
        )
        with pytest.raises(ValueError, match=r"class names for a head of 12 outputs .*one distinct name"):
            open_classifier(tmp_path / "named.safetensors", "digits", "test", device="cpu")


def test_a_baseline_report_is_read_only_as_errors_of_the_same_images(runs, tmp_path, capsys, monkeypatch):
    """Found in review: a report scored on another folder's images under the same relative --data was
    taken (mCE 106 for 102); so were a NaN, a negative or a duplicated severity in a report (a NaN or
    negative mCE, one severity silently replaced), and a string gave a traceback. A baseline checkpoint
    that differs only in normalisation sees the same corrupted images and is taken."""
    from neutreno.models import save_model

    for folder, digits in (("a", {"1", "2", "3"}), ("b", {"4", "5", "6"})):
        _digit_folder(tmp_path / folder / "data", digits)
    common = [*digits_args("fog", "1,2"), "--data", "data", "--samples", "20"]
    monkeypatch.chdir(tmp_path / "a")
    assert main(["robustness", str(runs["softmax"]), *common, "--out", "base"]) == 0
    report = tmp_path / "a" / "base" / "robustness.json"
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    assert main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(report), "--out", "r"]) == 2
    err = capsys.readouterr().err
    assert f"was scored on 'data' (['{tmp_path / 'a' / 'data'}', " in err and "this run on 'data'" in err
    assert not (tmp_path / "b" / "r").exists()
    monkeypatch.chdir(tmp_path / "a")  # the same images: taken
    assert main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(report), "--out", "r"]) == 0
    capsys.readouterr()
    # Found in review: images replaced in the same folder were taken as the baseline's (a folder was its
    # path alone): CE 110.7 for 108.8. Two images swapped, and one rewritten to other bytes, are refused.
    shutil.copytree(tmp_path / "a" / "data", tmp_path / "a" / "kept")
    first, second = sorted((tmp_path / "a" / "data" / "test").glob("*/*.png"))[:2]
    swapped = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(swapped)
    assert main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(report), "--out", "s"]) == 2
    assert "other images (or the same folder since changed)" in capsys.readouterr().err
    assert not (tmp_path / "a" / "s").exists()
    shutil.rmtree(tmp_path / "a" / "data")
    shutil.copytree(tmp_path / "a" / "kept", tmp_path / "a" / "data", copy_function=shutil.copy2)
    assert main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(report), "--out", "s"]) == 0
    capsys.readouterr()

    saved = json.loads(report.read_text())
    for change, message in (
        (lambda m: m["error"]["fog"].update({"1": float("nan")}), "fog severity 1 holds nan"),
        (lambda m: m["error"]["fog"].update({"2": -65.0}), "fog severity 2 holds -65.0"),
        (lambda m: m["error"]["fog"].update({"2": 650.0}), "fog severity 2 holds 650.0"),
        (lambda m: m["error"]["fog"].update({"1": "65.0"}), "fog severity 1 holds '65.0'"),
        (lambda m: m["error"]["fog"].update({"01": 3.0}), "fog has severity '01'"),
        (lambda m: m["error"].update({"fog": 3.0}), "fog holds 3.0, not errors by severity"),
        (lambda m: m["clean"].update({"top1": None}), "its clean top-1 is not a percentage"),
    ):
        bad = json.loads(json.dumps(saved))
        change(bad["model"])
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad, allow_nan=True))
        assert (
            main(["robustness", str(runs["neutreno"]), *common, "--baseline", str(path), "--out", "x"]) == 2
        )
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, message
        assert not (tmp_path / "a" / "x").exists()
    with pytest.raises(ValueError, match=r"the baseline's fog severity 1: .* got inf"):
        corruption_errors({"fog": {1: 10.0}}, {"fog": {1: float("inf")}})
    with pytest.raises(ValueError, match=r"fog severity 1: .* got nan"):
        corruption_errors({"fog": {1: float("nan")}}, "alexnet")

    # another mean and std only: the same corrupted images (normalised after), so the same CE
    weights = resolve_weights(runs["softmax"])
    model, meta = load_model(weights)
    renormalised = tmp_path / "renormalised.safetensors"
    preprocess = {**meta["preprocess"], "mean": [0.5], "std": [0.25]}
    save_model(renormalised, model, {"classes": meta["classes"], "preprocess": preprocess})
    args = ["robustness", str(runs["neutreno"]), *common, "--baseline", str(renormalised), "--out", "n"]
    assert main(args) == 0


def test_a_language_model_or_segmenter_is_named_as_such_not_as_unwritten_by_train(tmp_path):
    """Robustness given a language model or a Segmenter trained by `neutreno train` said it "records no
    preprocessing (not written by neutreno train)"."""
    from neutreno.data.corpus import Vocabulary
    from neutreno.evaluation.classification import open_classifier
    from neutreno.models import create_model, save_model

    lm = create_model("lm_wt103_mini", vocab_size=8, embed_dim=16, depth=1, num_heads=2, cutoffs=[4])
    segmenter = create_model("segmenter_tiny", num_classes=3, img_size=32, depth=1, decoder_depth=1)
    for model, extra, kind in (
        (lm, {"tokenizer": Vocabulary([str(i) for i in range(8)]).metadata()}, "a language model"),
        (segmenter, {"segmentation": {"num_classes": 3}}, "a segmenter"),
    ):
        weights = tmp_path / f"{kind[2:]}.safetensors"
        save_model(weights, model, extra=extra)
        with pytest.raises(ValueError, match=f"is {kind}, not an image classifier$"):
            open_classifier(weights, "digits", "test", device="cpu")


def test_data_identity_sees_an_archive_rewritten_and_ignores_an_out_folder_beside_cifar_pickles(tmp_path):
    """Found in review: an archive was its path and size (images swapped under the same names kept
    both: the baseline was taken); and a CIFAR folder's digest took in the whole folder, the --out
    inside it too, so a stopped evaluation there always started afresh and its report was refused."""
    import os

    from neutreno.evaluation.robustness import data_identity

    archive = tmp_path / "d.tar"
    archive.write_bytes(b"a" * 1024)
    before = data_identity(str(archive), "test")
    archive.write_bytes(b"b" * 1024)  # the same size
    os.utime(archive, ns=(1, 1))
    assert data_identity(str(archive), "test") != before

    cifar = tmp_path / "cifar-10-batches-py"
    cifar.mkdir()
    for name in ("batches.meta", "test_batch", "data_batch_1"):
        (cifar / name).write_bytes(name.encode())
    before = data_identity(str(tmp_path), "test")
    assert before[1] == 3
    (cifar / "out").mkdir()
    (cifar / "out" / ".robustness-model-progress.pt").write_bytes(b"x")
    (cifar / "out" / "robustness.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("beside")
    assert data_identity(str(tmp_path), "test") == before
    (cifar / "test_batch").write_bytes(b"other images")
    assert data_identity(str(tmp_path), "test") != before

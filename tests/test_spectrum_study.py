"""``neutreno study spectrum``: standard, "+" and "−" models trained, then measured layer by layer."""

import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from sklearn.datasets import load_digits

from conftest import digits_config
from neutreno.cli.main import main
from neutreno.diagnostics import BlockProbe, high_frequency_ratio
from neutreno.models import load_model
from neutreno.training.checkpoint import resolve_weights


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    """The real digits as an ImageFolder of 8×8 grayscale PNGs: 30 train and 8 test images per class."""
    root = tmp_path_factory.mktemp("digits")
    digits = load_digits()
    counts = {}
    for image, label in zip(digits.images, digits.target, strict=True):
        index = counts.get(label, 0)
        if index >= 38:
            continue
        counts[label] = index + 1
        folder = root / ("train" if index < 30 else "test") / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 15.9).astype(np.uint8), mode="L").save(folder / f"{index:03d}.png")
    return root


@pytest.fixture(scope="module")
def config(digits_folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "digits.yaml"
    config = digits_config(
        model={"name": "vit_digits", "args": {"depth": 3}},
        data={"train": str(digits_folder), "val": str(digits_folder), "val_split": "test"},
    )
    path.write_text(yaml.safe_dump(config))
    return path


def test_study_trains_each_attention_and_measures_its_layers(config, digits_folder, tmp_path, capsys):
    out = tmp_path / "study"
    args = ["study", "spectrum", "--config", str(config), "--samples", "80", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "results.json").read_text())
    assert list(report["variants"]) == ["softmax", "eigen_pos", "eigen_neg"]
    assert report["images"] == 80
    for attention, measured in report["variants"].items():
        run = json.loads((out / attention / "results.json").read_text())
        assert run["config"]["model"]["attention"] == attention
        assert measured["top1"] == run["val"]["model"]["top1"] and measured["val_images"] == 80
        assert len(measured["high_frequency"]) == len(measured["cosine"]) == 4
        assert len(measured["regime"]) == 3 and measured["regime_images"] == 80  # the first batch's
    # Two short epochs leave the LayerNorm gains positive, so the signs of H decide the regimes.
    assert report["variants"]["eigen_pos"]["regime"] == ["smooth"] * 3
    assert report["variants"]["eigen_neg"]["regime"] == ["sharpen"] * 3

    # The last layer's ratio, recomputed from the saved weights on the same (all 80) test images.
    model, _ = load_model(resolve_weights(out / "eigen_neg"))
    files = [p for folder in sorted((digits_folder / "test").iterdir()) for p in sorted(folder.iterdir())]
    images = np.stack([np.asarray(Image.open(p), dtype=np.float32) / 255 for p in files])
    x = (torch.tensor(images)[:, None] - 0.3) / 0.4
    last = BlockProbe(model.eval())(x).hidden[-1]
    expected = high_frequency_ratio(last).item()
    assert report["variants"]["eigen_neg"]["high_frequency"][-1] == pytest.approx(expected, rel=1e-4)

    rows = (out / "layers.csv").read_text().splitlines()
    assert (
        rows[0] == "attention,layer,high_frequency,cosine,regime,smooth_fraction" and len(rows) == 1 + 3 * 4
    )
    assert (out / "spectrum_study.png").stat().st_size > 0
    assert "| − (sharpening) |" in (out / "table.md").read_text()
    assert "predicted smooth / sharpen layers (from 80 images)" in (out / "table.md").read_text()

    # A rerun reuses the finished runs; a finished run of another config is refused.
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.count("reused the finished run") == 3
    assert main([*args, "--set", "train.epochs=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a finished run of another config" in err and "\n" not in err
    # ... before any training: a new first variant trained, then the second's old run was refused
    assert main([*args, "--attentions", "symmetric,eigen_pos", "--set", "train.epochs=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{out / 'eigen_pos'} holds a finished run of another config" in err and "\n" not in err
    assert not (out / "symmetric").exists()
    # a NeuTRENO model's layers past the first get no prediction: empty cells (a TypeError after training)
    assert main([*args, "--attentions", "softmax,neutreno"]) == 0
    rows = [r.split(",") for r in (out / "layers.csv").read_text().splitlines() if r.startswith("neutreno,")]
    assert rows[1][4] in ("smooth", "sharpen") and [r[4:] for r in rows[2:]] == [["", ""], ["", ""]]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--attentions", "softmax,bogus"], "model.attention"),
        (["--set", "train.epochs=0"], "train.epochs"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--data", "/nonexistent"], "no such image folder or archive: /nonexistent"),  # after 3 trainings
        # what the config trains on, but not what the study reads: it said "no such image folder"
        (["--data", "digits"], "which 'digits' (digits or CIFAR pickles, as the config trains on) is not"),
        (["--data", "data/cifar-10-batches-py"], "'data/cifar-10-batches-py' (digits or CIFAR pickles"),
        # the study sets these itself: softmax was trained under --set model.attention=neutreno, exit 0
        (["--set", "model.attention=neutreno"], "--set model.attention: --attentions chooses it"),
        (["--set", "model={attention: neutreno}"], "--set model (its model.attention): --attentions chooses"),
        (["--set", "train.out_dir=elsewhere"], "--set train.out_dir: each run's folder is --out/<attention>"),
    ],
)
def test_study_refuses_bad_settings_before_training(config, tmp_path, capsys, extra, message):
    out = tmp_path / "study"
    assert main(["study", "spectrum", "--config", str(config), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("neutreno study spectrum: error:") and message in err and "\n" not in err
    assert not out.exists()


def test_study_refuses_a_language_model_config(tmp_path, capsys):
    assert (
        main(["study", "spectrum", "--config", "configs/lm_wt103_mini_softmax.yaml", "--out", str(tmp_path)])
        == 2
    )
    assert "trains image classifiers" in capsys.readouterr().err

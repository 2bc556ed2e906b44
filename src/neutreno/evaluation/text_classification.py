"""A fine-tuned Hugging Face text classifier's accuracy on a labelled text file: the sums the trainer's
validation adds up, the batches it tokenizes, and a saved run scored on another file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.evaluation.metric import MetricSums
from neutreno.progress import progress as progress_bar

Example = tuple[str, str | None, str]  # (text, second text or None, label)


def text_classification_sums(logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """Hits (argmax), summed cross-entropy and count of a batch: logits (B, K), labels (B,) class ids."""
    return {
        "correct": (logits.argmax(-1) == labels).sum(),
        "loss": F.cross_entropy(logits.float(), labels, reduction="sum"),
        "count": torch.tensor(len(labels)),
    }


def summarize_text_classification(sums: dict[str, float]) -> dict[str, float]:
    """Accuracy (percent), mean loss and count from :func:`text_classification_sums` totals."""
    count = max(sums["count"], 1)
    return {
        "accuracy": 100 * sums["correct"] / count,
        "loss": sums["loss"] / count,
        "count": int(sums["count"]),
    }


def tokenize_batch(
    tokenizer, batch: list[Example], classes: list[str], max_length: int, pair: bool
) -> tuple[dict[str, Tensor], Tensor]:
    """A batch of examples as the model's inputs (padded, cut to ``max_length`` tokens, the longer text
    of a pair first) and the class ids of their labels (their index in ``classes``)."""
    texts, pairs, labels = zip(*batch, strict=True)
    inputs = tokenizer(
        list(texts), list(pairs) if pair else None,
        padding=True, truncation=True, max_length=max_length, return_tensors="pt",
    )  # fmt: skip
    return dict(inputs), torch.tensor([classes.index(label) for label in labels])


def classifier_logits(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The float32 logits (B, K) of a Hugging Face sequence classifier on tokenized ``inputs``."""
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in inputs.items()}).logits.float()


def tokenizer_digest(tokenizer) -> str:
    """A digest of what turns a text into ids: a fast tokenizer's vocabulary, added tokens and rules
    (normalizer, pre-tokenizer, post-processor; not the padding and truncation settings each call
    sets), or a slow one's vocabulary and class. The same folder path may hold another tokenizer later."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        rules = json.loads(backend.to_str())
        shown = {
            k: rules.get(k)
            for k in ("added_tokens", "normalizer", "pre_tokenizer", "post_processor", "model")
        }
    else:
        shown = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def evaluate_text_classifier(
    checkpoint: str | Path, data: str | Path, *, batch_size: int = 32, device: str = "auto"
) -> dict:
    """Accuracy (percent), mean loss and count of a ``neutreno train`` text classifier on a labelled
    ``.csv``/``.jsonl`` file, read with the columns, classes and ``max_length`` its file records and
    tokenized by the tokenizer of the model it was fine-tuned from (that folder, or the hub id in the
    local cache; refused where it is not the tokenizer the run recorded): the numbers its validation
    reports for the same file, computed in float32 (a run trained in bf16 validated under its autocast:
    its loss may differ in the fourth digit).

    Raises:
        ValueError: not a text classifier, a file that records no columns or length, or labels the
            classifier has no class for.
    """
    import transformers

    from neutreno.data.text import MissingColumnError, load_labelled_texts
    from neutreno.integrations.hf import load_hf
    from neutreno.models import load_model
    from neutreno.models.checkpoint import checkpoint_kind, read_metadata
    from neutreno.training.checkpoint import resolve_weights
    from neutreno.training.distributed import resolve_device
    from neutreno.training.text_classification import check_tokens

    weights = resolve_weights(checkpoint)
    meta = read_metadata(weights)
    if checkpoint_kind(meta) != "text classifier":
        raise ValueError(f"{weights} is not a text classifier of neutreno train")
    columns, max_length, classes = meta.get("columns"), meta.get("max_length"), meta.get("classes")
    if not isinstance(columns, dict) or not isinstance(max_length, int) or not isinstance(classes, list):
        raise ValueError(
            f"{weights} records no columns, max_length or classes: neutreno eval scores the text classifiers "
            "of neutreno train (task: text_classification)"
        )
    wanted = [c for c in (columns.get("text"), columns.get("pair"), columns.get("label")) if c]
    try:
        examples = load_labelled_texts(data, columns.get("text"), columns.get("label"), columns.get("pair"))
    except MissingColumnError as error:  # (its advice names config keys, which eval has not)
        raise ValueError(
            f"{data}: {weights} reads the columns {wanted}; this header has {error.header}"
        ) from None
    unknown = sorted({label for *_, label in examples} - set(classes))
    if unknown:
        raise ValueError(f"{data}: labels {unknown[:5]} are none of the classifier's classes {classes[:10]}")
    model, _ = load_model(weights)
    source = model.model_spec["model"].removeprefix("hf:")
    try:
        tokenizer = load_hf(transformers.AutoTokenizer, source)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{weights} was fine-tuned from {source}, whose tokenizer eval reads: that folder is gone "
            "(moved? the weights need nothing from it)"
        ) from None
    recorded = meta.get("tokenizer_digest")  # (files from before it was recorded: not checked)
    if recorded is not None and recorded != tokenizer_digest(tokenizer):
        raise ValueError(
            f"the tokenizer of {source} is not the one {weights} was trained with (its vocabulary or rules "
            "changed since): its ids would be other words to the model"
        )
    check_tokens(str(data), examples, tokenizer, max_length)
    target = resolve_device(device)
    model = model.eval().to(target)
    metric = MetricSums(summarize_text_classification, device=target)
    starts = range(0, len(examples), batch_size)
    for start in progress_bar(starts, desc="eval", unit="batch", leave=False):
        batch = examples[start : start + batch_size]
        inputs, labels = tokenize_batch(
            tokenizer, batch, classes, max_length, columns.get("pair") is not None
        )
        logits = classifier_logits(model, inputs)
        metric.update(text_classification_sums(logits, labels.to(logits.device)))
    return {"checkpoint": str(weights), "data": str(data), **metric.compute()}

"""A fine-tuned Hugging Face text classifier's accuracy on a labelled text file: the sums the trainer's
validation adds up, the batches it tokenizes, and a saved run scored on another file."""

from __future__ import annotations

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


@torch.no_grad()
def evaluate_text_classifier(
    checkpoint: str | Path, data: str | Path, *, batch_size: int = 32, device: str = "auto"
) -> dict:
    """Accuracy (percent), mean loss and count of a ``neutreno train`` text classifier on a labelled
    ``.csv``/``.jsonl`` file, read with the columns, classes and ``max_length`` its file records and
    tokenized by the tokenizer of the model it was fine-tuned from (that folder, or the hub id in the
    local cache): the numbers its validation reports for the same file.

    Raises:
        ValueError: not a text classifier, a file that records no columns or length, or labels the
            classifier has no class for.
    """
    import transformers

    from neutreno.data.text import load_labelled_texts
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
    examples = load_labelled_texts(data, columns.get("text"), columns.get("label"), columns.get("pair"))
    unknown = sorted({label for *_, label in examples} - set(classes))
    if unknown:
        raise ValueError(f"{data}: labels {unknown[:5]} are none of the classifier's classes {classes[:10]}")
    model, _ = load_model(weights)
    tokenizer = load_hf(transformers.AutoTokenizer, model.model_spec["model"].removeprefix("hf:"))
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

"""Language-model perplexity by the paper's sliding-window protocol (math.md §4, WikiText-103): the
summed negative log-likelihood of a token stream, and a saved model scored on its corpus's splits
(``neutreno eval``)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from neutreno.evaluation.metric import MetricSums
from neutreno.progress import progress as progress_bar


def perplexity(loss: float) -> float:
    """exp(mean negative log-likelihood in nats per token); inf where that overflows a float (a loss above
    ~709.8: a broken model, whose exact loss is reported beside it). ``math.exp`` raised OverflowError.
    NaN for a NaN loss (not inf: nothing says it was large)."""
    return math.exp(loss) if not loss >= _LOG_FLOAT_MAX else math.inf


_LOG_FLOAT_MAX = math.log(sys.float_info.max)


@torch.no_grad()
def sliding_window_nll(
    model: nn.Module, stream: Tensor, *, stride: int = 1, batch_size: int = 32, progress: bool = True
) -> tuple[float, int]:
    """Summed negative log-likelihood of every token of ``stream`` after the first, and their count.

    The paper's protocol (math.md §4): windows of the model's ``context_length`` L slide by ``stride``;
    the first window scores all its positions, each later one only its last ``stride`` (the tokens not
    scored yet), so every token is predicted once, with as much left context as fits (stride 1: L
    tokens). A larger stride is the faster approximation. Windows are batched.

    The model runs in eval mode (no dropout), and is put back in the mode it was in.

    Args:
        model: a causal LM whose ``forward(idx, targets)`` returns per-token NLL (B, T).
        stream: token ids (T,).
    Returns:
        (total NLL in nats, number of tokens scored = T − 1).
    """
    if stride < 1 or batch_size < 1:
        raise ValueError(f"stride and batch_size must be >= 1, got {stride} and {batch_size}")
    if stream.ndim != 1:
        raise ValueError(f"stream must be token ids of shape (T,), got shape {tuple(stream.shape)}")
    check_stride(stride, model.context_length)
    length = min(model.context_length, stream.numel() - 1)
    if length < 1:
        raise ValueError("a stream of fewer than 2 tokens has nothing to score")
    last = stream.numel() - 1  # index of the last target
    ends = torch.arange(length, last + stride, stride).clamp(max=last).unique_consecutive()
    scored = torch.diff(ends, prepend=torch.tensor([0]))  # new targets per window: L, then ≤ stride
    windows = stream.unfold(0, length + 1, 1)  # (T − L, L + 1) view: inputs and targets of every start
    device = next(model.parameters()).device
    positions = torch.arange(length, device=device)
    metric = MetricSums(device=device)
    batches = range(0, len(ends), batch_size)
    was_training = model.training
    model.eval()
    try:
        for i in progress_bar(batches, desc="windows", unit="batch", leave=False, enabled=progress):
            batch = windows[ends[i : i + batch_size] - length].to(device)
            nll = model(batch[:, :-1], batch[:, 1:])
            keep = positions >= length - scored[i : i + batch_size, None].to(device)
            metric.update({"nll": nll.double().masked_fill(~keep, 0).sum(), "count": keep.sum()})
    finally:
        model.train(was_training)
    totals = metric.compute()
    return totals["nll"], int(totals["count"])


def check_stride(stride: int, context_length: int) -> None:
    """A window scores at most its L tokens: with a longer stride the ones between would never be."""
    if stride > context_length:
        raise ValueError(f"stride {stride} is longer than the model's context ({context_length} tokens)")


@torch.no_grad()
def evaluate_language_model(
    checkpoint: str | Path,
    corpus: str | Path | None = None,
    *,
    splits: tuple[str, ...] | None = None,
    stride: int = 1,
    batch_size: int = 32,
    device: str = "auto",
) -> dict:
    """Sliding-window perplexity (:func:`sliding_window_nll`) of a trained language model on the
    ``splits`` of ``corpus`` (default: the corpus it was trained on), tokenized with the checkpoint's
    own tokenizer. ``splits`` default: valid, and test where the corpus has it (a raw-text corpus may
    have none). Every split's file is found before any is scored. Returns ``{split: {"ppl", "loss",
    "tokens", "unknown_tokens", "dropped_characters"}}`` with the settings used; a split with text the
    tokenizer does not know (:func:`~neutreno.data.corpus.unknown_tokens`) or drops
    (:meth:`~neutreno.data.corpus.SubwordTokenizer.dropped_characters`) is warned of on stderr."""
    from neutreno.data.corpus import encode_file, split_file, unread_text
    from neutreno.training.checkpoint import resolve_weights
    from neutreno.training.distributed import resolve_device
    from neutreno.training.language_model import load_language_model

    weights = resolve_weights(checkpoint)
    model, tokenizer, meta = load_language_model(weights)
    if corpus is None and "corpus" not in meta:  # a file saved by hand (save_model): a KeyError traceback
        raise ValueError(f"{weights} records no corpus: give the text to score with --data")
    corpus = Path(corpus or meta["corpus"])
    check_stride(stride, model.context_length)  # before the first split is read (a long encoding)
    model.to(resolve_device(device))
    results = {"checkpoint": str(weights), "corpus": str(corpus), "stride": stride,
               "context_length": model.context_length}  # fmt: skip
    if splits is None:
        splits = ("valid", "test") if _has_split(corpus, "test") else ("valid",)
    files = {split: split_file(corpus, split) for split in splits}  # a missing one: before any work
    for split, file in files.items():
        ids = encode_file(file, tokenizer)
        unknown, dropped = unread_text(file, tokenizer, ids)
        if unknown:  # scored as <unk>, which a model predicts well: a perplexity that looks too good
            print(
                f"warning: {file}: {unknown} of {len(ids)} tokens ({unknown / len(ids):.1%}) are text the "
                "model's tokenizer does not know, scored as <unk>: this perplexity is not comparable with "
                "one on text it knows",
                file=sys.stderr,
            )
        if dropped:  # text no token stands for is never scored
            print(
                f"warning: {file}: the model's tokenizer drops {dropped} characters (no token stands for "
                "them, and it has no unknown token), which this perplexity does not score",
                file=sys.stderr,
            )
        if len(ids) < 2:  # (the window function's own error named no file)
            raise ValueError(f"{file}: {len(ids)} token(s), fewer than the 2 a prediction needs")
        nll, count = sliding_window_nll(model, ids, stride=stride, batch_size=batch_size)
        results[split] = {"ppl": perplexity(nll / count), "loss": nll / count, "tokens": count,
                          "unknown_tokens": unknown, "dropped_characters": dropped}  # fmt: skip
    return results


def _has_split(corpus: Path, split: str) -> bool:
    from neutreno.data.corpus import split_file

    try:
        split_file(corpus, split)
    except FileNotFoundError:
        return False
    return True

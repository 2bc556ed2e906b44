"""Per-layer metrics over a dataset, streamed batch by batch (torchmetrics-style update/compute):
memory stays flat in the number of samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from neutreno.diagnostics.collect import BlockProbe, LayerTensors, evaluating
from neutreno.diagnostics.metrics import _check_mask as check_mask
from neutreno.diagnostics.metrics import (
    all_finite,
    effective_rank,
    effective_ranks,
    gradient_alignment,
    head_redundancy,
    high_frequency_ratio,
    nonlocal_energy,
    rank_residual,
    token_cosine_similarity,
)
from neutreno.progress import progress

# On hidden states: layer 0 is the embeddings, layer l the output of block l.
HIDDEN_METRICS: dict[str, Callable[[Tensor, Tensor | None], Tensor]] = {
    "cosine": lambda h, m: token_cosine_similarity(h, m, reduction="none"),
    "rank_residual": lambda h, m: rank_residual(h, m, reduction="none"),
    "rank_residual_l1inf": lambda h, m: rank_residual(h, m, norm="l1_inf", reduction="none"),
    "high_frequency": lambda h, m: high_frequency_ratio(h, m, reduction="none"),
    "effective_rank": lambda h, m: effective_rank(h, m, reduction="none"),
}
# Those computed for all layers in one call, with the same values as HIDDEN_METRICS' layer by layer
ALL_LAYERS: dict[str, Callable[[list[Tensor], Tensor | None], list[Tensor]]] = {
    "effective_rank": effective_ranks
}


def hidden_metric_by_layer(name: str, hidden: list[Tensor], mask: Tensor | None) -> list[Tensor]:
    """A hidden-state metric of each layer's states (per sample, ``reduction="none"``), for all layers
    in one call where :data:`ALL_LAYERS` has one."""
    if name in ALL_LAYERS:
        return ALL_LAYERS[name](hidden, mask)
    return [HIDDEN_METRICS[name](h, mask) for h in hidden]


def _exact(attn: Tensor) -> bool:
    return attn.dtype in (torch.float32, torch.float64)


# On block l's attention (l = 1..L); head redundancy compares block l with block l + 1 (math.md §3: the
# head-averaged maps; "_matched" head h with head h, "_best" each head with its closest).
ATTENTION_METRICS: dict[str, Callable[[LayerTensors, int], Tensor]] = {
    "energy": lambda t, i: nonlocal_energy(t.attn[i], t.v[i], t.mask, reduction="none"),
    # A V from float32/64 maps: update() runs it only where they are softmax(q kᵀ/√d) (qk_unexplained
    # None), and lower-precision maps (within 2e-2 of it) would move the metric by their rounding
    "gradient_alignment": lambda t, i: gradient_alignment(
        t.q[i], t.k[i], t.v[i], t.mask, reduction="none", attn=t.attn[i] if _exact(t.attn[i]) else None
    ),
    "head_redundancy": lambda t, i: head_redundancy(t.attn[i], t.attn[i + 1], reduction="none", mask=t.mask),
    "head_redundancy_matched": lambda t, i: head_redundancy(
        t.attn[i], t.attn[i + 1], reduction="none", form="matched", mask=t.mask
    ),
    "head_redundancy_best": lambda t, i: head_redundancy(
        t.attn[i], t.attn[i + 1], reduction="none", form="best", mask=t.mask
    ),
}


QK_METRICS = ("gradient_alignment",)  # on q and k themselves (and the maps, as softmax(q kᵀ/√d))
PAIRWISE_METRICS = ("head_redundancy", "head_redundancy_matched", "head_redundancy_best")  # ℓ with ℓ + 1
METRICS = (*HIDDEN_METRICS, *ATTENTION_METRICS)
# Metrics without a meaning under causal attention (a decoder), and why. The others are defined on any
# hidden states or attention maps: a causal layer's maps are lower-triangular, and they stay correct.
CAUSAL_REFUSED = {
    "gradient_alignment": "it compares a layer with the symmetric kernel softmax(KKᵀ/√d) over all tokens "
    "(paper App. E.1), future ones included, which causal attention never sees",
}


def check_causal(metrics: Sequence[str]) -> None:
    """Raise the one-line ValueError for metrics in :data:`CAUSAL_REFUSED`."""
    refused = [m for m in metrics if m in CAUSAL_REFUSED]
    if refused:
        reasons = "; ".join(f"{m}: {CAUSAL_REFUSED[m]}" for m in refused)
        raise ValueError(f"not defined for a causal (decoder) model: {reasons}")


class LayerwiseMetrics:
    """Running per-layer means of math.md §3 metrics: ``update`` with each batch's
    :class:`LayerTensors`, ``compute`` for ``{metric: {layer: mean over samples}}``, ``reset`` to start
    again. Every batch must come from a model of the same depth (ValueError otherwise)."""

    def __init__(self, metrics: Sequence[str] = ("cosine",)) -> None:
        if isinstance(metrics, str):  # its letters were taken as names
            raise TypeError(f"metrics must be a list of names, got the string {metrics!r}")
        unknown = [m for m in metrics if m not in METRICS]
        if unknown or not metrics:
            raise ValueError(f"unknown metric(s) {unknown}; valid: {', '.join(METRICS)}")
        self.metrics = list(dict.fromkeys(metrics))
        self.reset()

    def reset(self) -> None:
        """Forget every batch added so far."""
        self.totals: dict[str, dict[int, float]] = {m: {} for m in self.metrics}
        self.samples = 0

    @property
    def needs_attention(self) -> bool:
        return any(m in ATTENTION_METRICS for m in self.metrics)

    def update(self, layers: LayerTensors) -> None:
        if self.needs_attention and layers.attn is None:
            raise ValueError(f"metrics {self.metrics} need attention maps; collect with attention=True")
        if layers.causal:
            check_causal(self.metrics)
        pairwise = [m for m in self.metrics if m in PAIRWISE_METRICS]
        if pairwise and layers.attn is not None and len(layers.attn) < 2:  # else an empty result, silently
            raise ValueError(f"{', '.join(pairwise)} compare block l with block l + 1: one block has no pair")
        if layers.qk_unexplained is not None:
            on_qk = [m for m in self.metrics if m in QK_METRICS]
            if on_qk:
                raise ValueError(f"{layers.qk_unexplained}; leave out {', '.join(on_qk)}")
        mask = None if layers.mask is None else check_mask(layers.mask, layers.hidden[0].shape[:-1], "tokens")
        for i, h in enumerate(layers.hidden):  # padded rows may hold anything; the real ones count
            if not all_finite(h if mask is None else h[mask]):
                raise ValueError(
                    f"hidden state {i} (0: the embeddings) is not finite (NaN or inf): the model overflows "
                    "on this input, and no metric of it would mean anything"
                )
        batch = {}  # every metric's sums first: one that refuses the batch must leave no other's behind
        for name in self.metrics:
            if name in HIDDEN_METRICS:
                values = dict(enumerate(hidden_metric_by_layer(name, layers.hidden, layers.mask)))
            else:
                last = len(layers.attn) - (1 if name in PAIRWISE_METRICS else 0)
                values = {i + 1: ATTENTION_METRICS[name](layers, i) for i in range(last)}
            batch[name] = {layer: per_sample.double().sum().item() for layer, per_sample in values.items()}
        if self.samples:  # a model of another depth: its extra layers' sums over all samples' count
            first, this = sorted(next(iter(self.totals.values()))), sorted(next(iter(batch.values())))
            if first != this:
                raise ValueError(
                    f"this batch has layers {this[0]}..{this[-1]}, the earlier ones {first[0]}..{first[-1]}: "
                    "one LayerwiseMetrics measures one model (reset() to start again)"
                )
        for name, sums in batch.items():
            totals = self.totals[name]
            for layer, total in sums.items():
                totals[layer] = totals.get(layer, 0.0) + total
        self.samples += layers.hidden[0].shape[0]

    def compute(self) -> dict[str, dict[int, float]]:
        if not self.samples:
            raise ValueError("no samples: call update() first")
        return {
            m: {layer: t / self.samples for layer, t in sorted(v.items())} for m, v in self.totals.items()
        }


def analyze_layers(
    probe: Callable[[Any], LayerTensors], batches: Iterable, metrics: Sequence[str], desc: str = "analyze"
) -> dict[str, dict[int, float]]:
    """Run ``probe`` over ``batches`` and return the per-layer means of ``metrics``."""
    aggregate = LayerwiseMetrics(metrics)
    for batch in progress(batches, desc=desc, unit="batch", leave=False):
        aggregate.update(probe(batch))
    return aggregate.compute()


@torch.no_grad()
def cosine_by_layer(model: nn.Module, images: Tensor, batch_size: int = 256) -> list[float]:
    """Token cosine similarity (math.md §3) of the embeddings and of every block's output, averaged
    over ``images`` (N, C, H, W); L + 1 floats, entry 0 the embeddings. ``model.blocks`` is used."""
    with evaluating(model):  # the caller's mode kept
        per_layer = analyze_layers(BlockProbe(model), images.split(batch_size), ["cosine"], desc="cosine")
    return list(per_layer["cosine"].values())

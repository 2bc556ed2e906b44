"""Metric sums: per-batch sums added up over an evaluation set and over processes, then summarized.

Every score neutreno reports is a function of sums over the evaluated items — top-1 hits and the image
count, summed negative log-likelihoods and the token count, a confusion matrix — so one object serves
the trainer's validation and the standalone evaluators, in torchmetrics' shape:
:meth:`MetricSums.update` once per batch, :meth:`MetricSums.compute` at the end (summed over the
processes of a ``torchrun`` group, then summarized), :meth:`MetricSums.reset` to start again.

The sums are float64 tensors on one device: adding them costs no synchronisation per batch, float64
holds integer counts exactly up to 2⁵³, and a sum of many float32 losses keeps the small ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from neutreno.training.distributed import DistributedContext

# What :meth:`MetricSums.compute` hands ``summarize``: scalars as floats, larger sums as CPU tensors.
Totals = dict[str, float | Tensor]


class NonFiniteOutputs(ValueError):
    """A model's outputs on the evaluated items are not finite (NaN or inf): its weights overflow, and
    a score of them (top-1 as the argmax of NaN logits) would mean nothing."""


def sum_over_processes(
    sums: Mapping[str, Tensor], context: DistributedContext | None = None
) -> dict[str, float | Tensor]:
    """Each tensor summed over the processes of ``context`` (none: this process only), in one
    all-reduce of float64 values on ``context.device``; scalars come back as floats, larger tensors
    (a confusion matrix (K, K)) as CPU float64 tensors of their shape."""
    keys = sorted(sums)
    tensors = [torch.as_tensor(sums[k]) for k in keys]
    device = context.device if context is not None else (tensors[0].device if tensors else None)
    flat = [t.to(device, torch.float64).flatten() for t in tensors]
    totals = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    if context is not None and context.distributed:
        from neutreno.training.distributed import all_reduce_sum

        totals = all_reduce_sum(totals, context)
    result: dict[str, float | Tensor] = {}
    for key, tensor, part in zip(keys, tensors, totals.cpu().split([f.numel() for f in flat]), strict=True):
        result[key] = part.item() if tensor.ndim == 0 else part.view(tensor.shape)
    return result


class MetricSums:
    """Running sums of the per-batch metric sums of an evaluation, summarized at the end.

    Args:
        summarize: turns the totals ``{key: float | Tensor}`` into the scores (a task's ``summarize``,
            e.g. top-1 % = 100 · hits / count); None: :meth:`compute` returns the totals themselves.
        context: the processes to sum over in :meth:`compute` (None: this process only).
        device: where the sums live (default: ``context.device``, else the CPU); batches are moved there.

    Example::

        metric = MetricSums(summarize_classification)
        for logits, labels in batches:
            metric.update(classification_sums(logits, labels))  # {"loss", "top1", "top5", …, "count"}
        metric.compute()  # {"top1": …, "top5": …, "loss": …, "count": …}
    """

    def __init__(
        self,
        summarize: Callable[[Totals], dict[str, Any]] | None = None,
        *,
        context: DistributedContext | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.summarize, self.context = summarize, context
        self.device = torch.device(device or (context.device if context is not None else "cpu"))
        self.reset()

    def reset(self) -> None:
        """Forget every batch added so far."""
        self.sums: dict[str, Tensor] = {}
        self.batches = 0

    def update(self, sums: Mapping[str, Tensor | float]) -> None:
        """Add one batch's sums (tensors of any shape, or numbers). Every batch must give the keys and
        shapes of the first (ValueError naming the key otherwise)."""
        if not sums:
            raise ValueError("a batch with no sums to add")
        # Numbers go straight to float64 (as_tensor would make a Python float float32 first).
        values = {
            key: value.detach() if isinstance(value, Tensor) else torch.tensor(value, dtype=torch.float64)
            for key, value in sums.items()
        }
        if not self.batches:  # a copy: the caller's tensors are never changed by later additions
            self.sums = {k: v.to(self.device, torch.float64, copy=True) for k, v in values.items()}
        else:
            self._check(values)
            for key, value in values.items():
                self.sums[key] += value.to(self.device, torch.float64)
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        """The sums and the batch count (tensors and an int: ``torch.load(weights_only=True)`` reads them),
        to resume an evaluation with :meth:`load_state_dict`. A snapshot: copies, which later additions
        leave as they are (``.cpu()`` of CPU sums was the sums themselves)."""
        return {
            "sums": {k: v.detach().to("cpu", copy=True) for k, v in self.sums.items()},
            "batches": self.batches,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s sums (copied: additions here leave ``state`` as it is)."""
        self.sums = {k: v.to(self.device, torch.float64, copy=True) for k, v in state["sums"].items()}
        self.batches = int(state["batches"])

    def compute(self) -> dict[str, Any]:
        """The totals summed over the processes, summarized. With a distributed ``context`` every process
        must call it (one all-reduce); the sums here stay as they were, so more batches may follow.

        Raises:
            ValueError: no batch was added (on any process); processes summed other keys or shapes
                (the all-reduce would add unrelated numbers, or fail in the backend), raised on every
                process alike. A process that added no batch (a split smaller than the group) adds zeros.
        """
        if self.context is not None and self.context.distributed:
            sums = self._agreed_sums()
        elif not self.batches:
            raise ValueError("nothing to compute: no batch was added (since the start or the last reset)")
        else:
            sums = self.sums
        totals = sum_over_processes(sums, self.context)
        for key, total in totals.items():
            if not bool(torch.isfinite(torch.as_tensor(total)).all()):
                raise NonFiniteOutputs(
                    f"the evaluation's sum {key!r} is not finite: the model's outputs overflow (NaN or inf), "
                    "so no score of them means anything"
                )
        return totals if self.summarize is None else self.summarize(totals)

    def _agreed_sums(self) -> dict[str, Tensor]:
        """This process's sums once every process's keys and shapes are known to agree (zeros of them
        where this one added no batch). Every process sees the same list, so all raise or none does."""
        from neutreno.training.distributed import all_gather_objects

        mine = sorted((k, tuple(v.shape)) for k, v in self.sums.items()) if self.batches else None
        given = [(rank, s) for rank, s in enumerate(all_gather_objects(mine, self.context)) if s is not None]
        if not given:
            raise ValueError("nothing to compute: no batch was added on any process")
        (first_rank, first), shown = given[0], lambda s: ", ".join(f"{k} {list(shape)}" for k, shape in s)
        for rank, signature in given[1:]:
            if signature != first:
                raise ValueError(
                    f"process {rank} summed {shown(signature)}, process {first_rank} {shown(first)}: "
                    "every process must give the same sums"
                )
        if mine is None:
            return {k: torch.zeros(shape, dtype=torch.float64, device=self.device) for k, shape in first}
        return self.sums

    def _check(self, values: dict[str, Tensor]) -> None:
        batch, differ = self.batches + 1, sorted(set(self.sums) ^ set(values))
        if differ:
            what, first = "lacks" if differ[0] in self.sums else "adds", ", ".join(sorted(self.sums))
            raise ValueError(f"batch {batch} {what} the sum {differ[0]!r} (the first batch had {first})")
        for key, value in values.items():
            if value.shape != self.sums[key].shape:
                raise ValueError(
                    f"batch {batch} gives {key!r} the shape {tuple(value.shape)}, the first batch "
                    f"{tuple(self.sums[key].shape)}"
                )

"""Dropout with a mask that is cheap to draw on a CPU.

``F.dropout`` draws one random float per element, and on a CPU that is most of its time: on 2 Intel
cores, 27 ms forward and backward for one (8, 256, 2048) feed-forward activation of ``lm_wt103``, 22
of them in the forward that draws the mask, and its 16 layers' worth was a third of the language
model's training step. Here the mask comes from 16-bit random integers, four to each 64-bit draw of
the same generator (seeded, saved and restored as any other): 13 ms, and the step 1.24× (fp32) and
1.29× (bf16) faster. Elsewhere (CUDA draws in the kernel) it is ``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KEEP_LEVELS = 2**16  # p is rounded to a multiple of 1/65536 on a CPU


@torch.jit.unused
def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``: in training each element is zeroed with probability p and the
    rest are scaled by 1/(1 − p), so that the expectation is x.

    On a CPU, p is rounded to a multiple of 1/65536 (0.1 → 0.1000061), and the scale is 1/(1 − p) of
    that p, so the expectation stays exactly x. Element i is kept when its 16-bit random integer (the
    i-th int16 of int64 words drawn uniformly over all 2⁶⁴ values by ``random_``, as signed) is at
    least ``round(p · 65536) − 32768``. Autograd keeps the boolean mask only, as ``F.dropout`` does.
    ``F.dropout`` itself off the CPU, for non-float tensors (which it refuses) and where a graph is
    being compiled or traced (``random_`` over a range breaks a torch.compile graph).

    Args:
        x: any shape. p: the drop probability, in [0, 1].
    """
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or not x.is_floating_point() or _building_a_graph():
        return F.dropout(x, p, training=True)
    dropped = round(p * KEEP_LEVELS)
    if dropped == KEEP_LEVELS:
        return x * 0.0  # as F.dropout(p=1): zeros, and gradients of zero
    words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64, device=x.device)
    words.random_(-(2**63), None)  # every int64: every bit of every 16-bit chunk uniform
    keep = words.view(torch.int16)[: x.numel()].view(x.shape) >= dropped - KEEP_LEVELS // 2
    return torch.where(keep, x, 0.0).mul_(KEEP_LEVELS / (KEEP_LEVELS - dropped))


def _building_a_graph() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


class Dropout(nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout` (same arguments, no state, the same checkpoints;
    ``inplace=True`` and TorchScript get ``F.dropout``)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace or torch.jit.is_scripting():
            return F.dropout(x, self.p, self.training, self.inplace)
        return dropout(x, self.p, self.training)

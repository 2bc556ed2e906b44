"""The full-softmax cross-entropy of a linear head, computed a block of the vocabulary at a time.

``F.cross_entropy(hidden @ weight.T, targets)`` builds the (N, V) logits, then their log-softmax and
the gradients of both, each as large: for the WikiText-103 language model with a full softmax
(N = 2,048 tokens, V = 267,735 words) 2.2 GB apiece, which make its step memory-bound. Here forward
keeps a running log-sum-exp over blocks of the vocabulary, and backward recomputes each block's logits
(one more matrix product) to form its softmax gradient there, as Liger-Kernel's fused linear
cross-entropy and Apple's Cut Cross-Entropy do on a GPU: the same numbers, and no (N, V) tensor.
``bench/lm.py`` measures it against the plain path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

# Logits per block: 8 MiB in float32, the fastest measured (2-core Intel Xeon, N = 2,048, D = 128,
# fp32 and bf16: half as many as fast, twice as many up to 12% slower, 4x as many 10-40% slower);
# tokens per chunk, so that a block keeps at least _MIN_BLOCK words.
_BLOCK_ELEMENTS = 1 << 21
_ROWS = 1 << 12
_MIN_BLOCK = 1 << 9


def _eager_when_compiled(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, applied at the first call: the decorator imports torch._dynamo,
    about 2 s that every ``neutreno`` command (and ``import neutreno``) would pay at start-up."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


# Runs eagerly inside a compiled model (a graph break): traced, its loop would unroll over every block.
@_eager_when_compiled
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None = None, ignore_index: int = -100
) -> Tensor:
    """Per-token negative log-likelihood ``F.cross_entropy(hidden @ weight.T + bias, targets,
    reduction="none", ignore_index=ignore_index)`` without the (N, V) logits: float32 (float64 for
    float64 inputs).

    Under autocast the products run in the autocast dtype and the softmax in float32, as autocast
    runs ``F.cross_entropy(head(hidden).float(), …)``. First derivatives only: a backward with
    ``create_graph=True`` (a gradient penalty) raises rather than leave the second-order term out.

    Args:
        hidden: (N, D). weight: (V, D), an ``nn.Linear``'s weight (or a tied embedding). bias: (V,).
        targets: (N,) class ids in [0, V), or ``ignore_index`` (a loss and gradient of 0).
    Returns:
        (N,), float32 or float64.
    Raises:
        ValueError: shapes that do not fit, targets that are not integers, or a target outside [0, V)
            that is not ``ignore_index``.
    """
    n, width = hidden.shape if hidden.ndim == 2 else (None, None)
    vocab = weight.shape[0]
    if (
        n is None
        or weight.shape != (vocab, width)
        or targets.shape != (n,)
        or (bias is not None and bias.shape != (vocab,))
    ):
        raise ValueError(
            f"need hidden (N, D), weight (V, D), targets (N,) and bias (V,) or None; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}, "
            f"{None if bias is None else tuple(bias.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got {targets.dtype}")
    ignored = targets == ignore_index
    if not (ignored | ((targets >= 0) & (targets < vocab))).all():
        bad = targets[~ignored & ((targets < 0) | (targets >= vocab))][0].item()
        raise ValueError(f"target {bad} is outside the vocabulary [0, {vocab})")
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast casts the head's linear: float64 stays
        dtype = torch.get_autocast_dtype(device)
        hidden, weight, bias = (
            t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (hidden, weight, bias)
        )
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, ignored)


def _blocks(n: int) -> tuple[int, int]:
    """Tokens per chunk and words per block."""
    rows = min(n, _ROWS) or 1
    return rows, max(_MIN_BLOCK, _BLOCK_ELEMENTS // rows)


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the half types, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One block's logits in the softmax dtype, rounded to the compute dtype first (as a head's are)."""
    out = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    return out.to(_softmax_dtype(out.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignored):
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, words = _blocks(n)
        acc = _softmax_dtype(hidden.dtype)
        lse = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
        target_logit = torch.zeros(n, dtype=acc, device=hidden.device)
        safe = targets.masked_fill(ignored, 0).long()  # (any integer dtype; ignored rows read word 0)
        for r in range(0, n, rows):
            h, t = hidden[r : r + rows], safe[r : r + rows]
            for w in range(0, vocab, words):
                b = None if bias is None else bias[w : w + words]
                logits = _logits(h, weight[w : w + words], b)
                torch.logaddexp(lse[r : r + rows], logits.logsumexp(-1), out=lse[r : r + rows])
                # the target's logit from the same block of logits as the log-sum-exp (nll >= 0)
                inside = (t >= w) & (t < w + logits.shape[1])
                picked = logits.gather(1, (t - w).clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
                target_logit[r : r + rows] += torch.where(inside, picked, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe, ignored, lse)
        return torch.where(ignored, 0.0, lse - target_logit)

    @staticmethod
    def backward(ctx, grad_nll):
        # grad mode is on only under create_graph (once_differentiable would turn it off before this
        # test, and its error is raised only when the incoming gradient itself requires grad)
        if torch.is_grad_enabled():  # a second derivative would come out silently zero
            raise RuntimeError(
                "linear_cross_entropy has no second derivative (backward with create_graph=True): "
                "use F.cross_entropy on the logits for that"
            )
        hidden, weight, bias, safe, ignored, lse = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, words = _blocks(n)
        acc = lse.dtype
        grad_nll = torch.where(ignored, 0.0, grad_nll.to(acc))
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        # gradients summed over blocks and token chunks in the softmax dtype (float32 for bf16 products)
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if needs_bias else None
        for r in range(0, n, rows):
            h, g = hidden[r : r + rows], grad_nll[r : r + rows, None]
            for w in range(0, vocab, words):
                wb = weight[w : w + words]
                b = None if bias is None else bias[w : w + words]
                # softmax of the block × the token's gradient; the target's −1 is added below
                grad_logits = _logits(h, wb, b).sub_(lse[r : r + rows, None]).exp_().mul_(g)
                if needs_bias:
                    grad_bias[w : w + words] += grad_logits.sum(0)
                grad_logits = grad_logits.to(hidden.dtype)
                if needs_hidden:
                    grad_hidden[r : r + rows] += grad_logits @ wb
                if needs_weight:
                    grad_weight[w : w + words] += grad_logits.T @ h
        # the target's −1: d nll / d logit_t = softmax_t − 1
        if needs_hidden:
            grad_hidden -= grad_nll[:, None] * weight[safe].to(acc)
        if needs_weight:
            grad_weight.index_add_(0, safe, -grad_nll[:, None] * hidden.to(acc))
        if needs_bias:
            grad_bias.index_add_(0, safe, -grad_nll)
        return (
            grad_hidden.to(hidden.dtype) if needs_hidden else None,
            grad_weight.to(weight.dtype) if needs_weight else None,
            grad_bias.to(bias.dtype) if needs_bias else None,
            None,
            None,
        )

"""NeuTRENO's fidelity term λ(V⁰ − V) (math.md §2, paper Eq. 26): the one function every model and the
Hugging Face integration add it with, and the output projection that adds it without storing the sum."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

DEFAULT_LAM = 0.6  # the paper's λ for vision (math.md §2)
LM_DEFAULT_LAM = 0.4  # the paper's λ for language modelling


def add_neutreno_term(
    u: Tensor, v: Tensor, v0: Tensor, lam: float | Tensor, inplace: bool = False, kept: bool = False
) -> Tensor:
    """NeuTRENO's fidelity term: ``u + λ (v0 − v)`` (math.md §2, paper Eq. 26).

    Args:
        u: attention output A V, (B, H, N, d) (or any layout, the same for all three).
        v: this layer's values, u's shape (or broadcasting to it: a value head shared by query heads).
        v0: the first attention layer's values for the same input, v's shape; not detached.
        lam: λ, a number or a tensor broadcasting against u (a learned λ: one, or one per channel).
        inplace: write the sum into u (the same numbers): for a u nothing else reads, without autograd.
        kept: v and v0 are kept for backward anyway (by a fused attention kernel): a learned λ's gradient
            then recomputes v0 − v from them instead of keeping it, one (B, N, D) tensor less per layer
            (the same numbers). Elsewhere keeping v would cost more than the difference: the explicit
            product keeps a copy of v, and v is a view of the whole QKV projection.
    """
    if v.shape != v0.shape:  # a V⁰ of one sample was broadcast over the batch, silently
        raise ValueError(f"v and v0 must have one shape, got {tuple(v.shape)} and {tuple(v0.shape)}")
    if u.shape != v.shape and torch.broadcast_shapes(u.shape, v.shape) != u.shape:
        # v broadcasts to u (a value head shared by query heads), never u to v: a u of one sample was
        # broadcast over the batch
        raise ValueError(f"v {tuple(v.shape)} must have u's shape {tuple(u.shape)} or broadcast to it")
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real | Tensor):
        raise TypeError(f"lam must be a number or a tensor, got {lam!r}")
    if isinstance(lam, Tensor):
        if inplace:
            return u.add_(lam * (v0 - v))
        if kept and torch.is_grad_enabled() and lam.requires_grad and not _building_a_graph():
            return _TermOfKeptValues.apply(u, v, v0, lam)
        return u + lam * (v0 - v)
    return u.add_(v0 - v, alpha=lam) if inplace else torch.add(u, v0 - v, alpha=lam)


class _TermOfKeptValues(torch.autograd.Function):
    """``u + λ (v0 − v)`` for a learned λ, keeping v, v0 and λ (kept anyway) rather than v0 − v for λ's
    gradient, Σ g (v0 − v), which backward recomputes: the numbers of autograd's own backward of the same
    expression. Written in differentiable operations, so that a second derivative (create_graph=True) is
    that of the expression."""

    @staticmethod
    def forward(ctx, u, v, v0, lam):
        ctx.save_for_backward(v, v0, lam)
        ctx.u_meta = (u.shape, u.dtype)
        return u + lam * (v0 - v)

    @staticmethod
    def backward(ctx, grad):
        v, v0, lam = ctx.saved_tensors
        (u_shape, u_dtype), needs = ctx.u_meta, ctx.needs_input_grad
        grad_u = grad.sum_to_size(u_shape).to(u_dtype) if needs[0] else None
        grad_v = grad_v0 = grad_lam = None
        if needs[1] or needs[2]:
            scaled = grad * lam
            grad_v = (-scaled).sum_to_size(v.shape).to(v.dtype) if needs[1] else None
            grad_v0 = scaled.sum_to_size(v0.shape).to(v0.dtype) if needs[2] else None
        if needs[3]:
            grad_lam = (grad * (v0 - v)).sum_to_size(lam.shape).to(lam.dtype)
        return grad_u, grad_v, grad_v0, grad_lam


def _building_a_graph() -> bool:
    """A graph being traced, exported or compiled, or a torch.func transform running: they get the plain
    expression (an autograd.Function without ``setup_context`` fails under torch.func)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or _functorch_transforming()


def eager_inference() -> bool:
    """Whether this call runs eagerly without autograd, where :func:`add_neutreno_term` may write into
    attention's own fresh output (``inplace``). Not while a graph is traced or exported
    (``torch.jit.trace``, ``torch.export``, ``torch.compile``): the graph would keep the in-place add for
    its later calls, with autograd too, where the fused kernel's backward reads the output it had saved
    (a NeuTRENO model traced or exported under ``no_grad`` could not be trained; and ``jit.trace``'s own
    check, which reruns under ``no_grad``, failed on every NeuTRENO model)."""
    return not (torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling())


LEARN_LAM = ("layer", "head")
# The attribute under which neutreno.hf gives a patched Hugging Face layer its LearnedLam (saved with
# the weights as ``….neutreno_lam.raw``); our own Attention keeps its as ``learned_lam``.
HF_LEARNED_LAM = "neutreno_lam"


class LearnedLam(nn.Module):
    """A learned λ (math.md §2): ``λ = softplus(raw)``, so λ > 0 whatever the optimizer does; one per
    layer (``per="layer"``, shape ()) or one per head (``per="head"``, shape (H,)); starts at ``lam``."""

    def __init__(self, lam: float, num_heads: int, per: str = "layer") -> None:
        super().__init__()
        if per not in LEARN_LAM:
            raise ValueError(f"learn_lam must be one of {', '.join(LEARN_LAM)}, got {per!r}")
        if not 0 < lam < math.inf:
            raise ValueError(f"a learned λ starts at a finite λ > 0 (softplus never reaches 0), got {lam}")
        shape = () if per == "layer" else (num_heads,)
        # softplus⁻¹(λ) = log(e^λ − 1), written so that e^λ never overflows (λ > 709)
        self.raw = nn.Parameter(torch.full(shape, lam + math.log(-math.expm1(-lam))))

    def forward(self) -> Tensor:
        """λ, () or (H,)."""
        return F.softplus(self.raw)


def neutreno_projection(u: Tensor, v: Tensor, v0: Tensor, lam: float | Tensor, proj: nn.Linear) -> Tensor:
    """``proj(u + λ(v0 − v))`` (math.md §2, Eq. 26, then W_O) without storing the sum for backward.

    After the fused kernel, which keeps u and v (and, in the first layer, v0) for its own backward,
    keeping them instead of the sum costs nothing, while a plain ``linear`` would keep the sum: one more
    (B, N, D) tensor per layer, ~6% of a ViT's activations. Backward rebuilds the sum, one cheap add. A
    learned λ's gradient flows through the sum, which keeps nothing new either (``kept``).
    (After the explicit product, which keeps a copy of v rather than v, plain ``linear`` is leaner.)

    Args:
        u, v, v0: (B, N, D) — the attention output, this layer's values and the first layer's values
            with heads concatenated.
        lam: λ, a number or a learned λ's tensor (its gradient flows through the sum, not kept either).
        proj: the output projection W_O.
    Returns:
        (B, N, D).
    """

    def rebuild(u: Tensor, v: Tensor, v0: Tensor) -> Tensor:
        return add_neutreno_term(u, v, v0, lam, kept=True)

    return linear_of_rebuilt_input(proj, rebuild(u, v, v0), rebuild, u, v, v0)


class _LinearOfRebuiltInput(torch.autograd.Function):
    """``module(x)`` for a linear layer (``nn.Linear``, or transformers' ``Conv1D``, whose weight is
    (in, out)) that saves ``parts`` instead of x and rebuilds x in backward as ``rebuild(*parts)``.
    Gradients in the dtypes of x and the weights (autocast too). Backward is written in differentiable
    operations, so that under ``create_graph=True`` (a gradient penalty) the second derivative is that of
    a plain linear layer, not silently zero."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, rebuild, *parts):
        ctx.save_for_backward(weight, *parts)  # saved as autograd saves: version-checked, seen by hooks
        plain = plain_linear_type(module)
        ctx.rebuild, ctx.transposed = rebuild, plain is not nn.Linear
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return plain.forward(module, x)  # the module's own arithmetic: the outputs are unchanged

    @staticmethod
    def backward(ctx, grad_y):
        weight, *parts = ctx.saved_tensors
        grad_rows = grad_y.reshape(-1, grad_y.shape[-1])
        w = weight.to(grad_y.dtype)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_rows @ (w.T if ctx.transposed else w)).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x = ctx.rebuild(*parts).reshape(-1, ctx.x_shape[-1]).to(grad_y.dtype)
            grad_weight = (x.T @ grad_rows if ctx.transposed else grad_rows.T @ x).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, *(None for _ in parts)


def linear_of_rebuilt_input(
    module: nn.Module, x: Tensor, rebuild: Callable[..., Tensor], *parts: Tensor
) -> Tensor:
    """``module(x)`` (an ``nn.Linear`` or a transformers ``Conv1D``), the same numbers, but autograd
    keeps ``parts`` instead of x and backward recomputes x as ``rebuild(*parts)`` (x's elements in
    order, any shape): how a Hugging Face W_O takes u + λ(V⁰ − V) without storing the sum, when u, V
    and V⁰ are kept anyway (:mod:`neutreno.integrations.hf`).

    Raises:
        TypeError: a module whose gradients are not those of a plain linear layer (a subclass, a wrapper).
    """
    if not is_plain_linear(module):
        raise TypeError(f"{type(module).__name__} is not an nn.Linear or a transformers Conv1D")
    # torch.func.grad, vmap: they cannot run this Function; torch.jit.trace records it as an opaque call
    # that its check, rerun under no_grad, found in one graph and not the other: plain linear, the same
    # numbers, keeping the sum
    if _functorch_transforming() or torch.jit.is_tracing():
        return module(x)
    return _LinearOfRebuiltInput.apply(x, module.weight, module.bias, module, rebuild, *parts)


def _functorch_transforming() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev, …) is running: an autograd.Function without
    ``setup_context`` fails under them (per-sample gradients of a NeuTRENO model raised)."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def runs_as_linear(module: nn.Module) -> bool:
    """Whether ``module(x)`` is exactly ``F.linear(x, module.weight, module.bias)``, so that a caller may
    compute it from the parameters (:func:`neutreno_projection`, a language model's fused head): an
    ``nn.Linear`` (no subclass, no parametrization, no ``forward`` set on the instance) that ``__call__``
    would run without a hook, neither its own nor a global one, forward or backward. Anything else (a
    LoRA wrapper, weight norm, pruning's mask, a hook recording activations or gradients) is called as
    itself, so that it keeps its effect."""
    hooks = (
        module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
        _module._global_forward_hooks, _module._global_forward_pre_hooks,
        _module._global_backward_hooks, _module._global_backward_pre_hooks,
    )  # fmt: skip
    return type(module) is nn.Linear and "forward" not in module.__dict__ and not any(hooks)


def plain_linear_type(module: nn.Module) -> type | None:
    """``nn.Linear`` or transformers' ``Conv1D`` (GPT-2) when ``module`` is one, or is of a subclass that
    declares it computes what that class computes (``plain_type`` in its own class body: the linear
    layers of :func:`neutreno.hf.apply_neutreno`, whose forward only chooses what backward keeps); None
    for any other module, a subclass or a wrapper (LoRA, a quantized layer, a parametrization)."""
    kind = type(module)
    kind = kind.__dict__.get("plain_type", kind)
    conv1d = kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils"
    return kind if kind is nn.Linear or conv1d else None


def is_plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a layer :func:`linear_of_rebuilt_input` knows the gradients of
    (:func:`plain_linear_type`)."""
    return plain_linear_type(module) is not None

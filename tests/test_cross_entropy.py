"""linear_cross_entropy: the full-softmax NLL of a linear head a vocabulary block at a time, against an
explicit float64 computation (logits, max-shifted log-sum-exp, softmax − one-hot gradients written out)."""

import pytest
import torch
import torch.nn.functional as F

import neutreno.layers.cross_entropy as ce
from neutreno.layers import linear_cross_entropy
from test_language_model import tiny_lm


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 7 words and chunks of 8 tokens, so that a small case crosses every boundary."""
    monkeypatch.setattr(ce, "_ROWS", 8)
    monkeypatch.setattr(ce, "_BLOCK_ELEMENTS", 40)
    monkeypatch.setattr(ce, "_MIN_BLOCK", 7)


def explicit(hidden, weight, targets, bias=None, ignore_index=-100):
    """NLL and its gradients for d(Σ_i c_i nll_i) with c_i = i + 1, in float64, by the formulas:
    nll_i = log Σ_j exp(z_ij) − z_{i t_i}; ∂nll_i/∂z_ij = softmax(z_i)_j − [j = t_i]."""
    h, w = hidden.double(), weight.double()
    z = h @ w.T + (0 if bias is None else bias.double())
    top = z.max(-1, keepdim=True).values
    lse = top[:, 0] + (z - top).exp().sum(-1).log()
    keep = targets != ignore_index
    rows = torch.arange(len(targets))
    nll = torch.where(keep, lse - z[rows, targets.clamp(min=0)], 0.0)
    c = torch.arange(1, len(targets) + 1, dtype=torch.float64) * keep
    dz = (z - lse[:, None]).exp()
    dz[rows, targets.clamp(min=0)] -= 1
    dz = dz * c[:, None]
    return nll, dz @ w, dz.T @ h, None if bias is None else dz.sum(0), c


def ours_with_grads(hidden, weight, targets, bias=None, c=None, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    b = None if bias is None else bias.detach().clone().requires_grad_()
    nll = linear_cross_entropy(leaves[0], leaves[1], targets, b, **kw)
    (nll.double() * c).sum().backward()
    return nll, leaves[0].grad, leaves[1].grad, None if b is None else b.grad


@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_explicit_computation_across_blocks_and_chunks(small_blocks, with_bias):
    torch.manual_seed(0)
    n, d, v = 21, 5, 45  # 3 token chunks (8, 8, 5), vocabulary blocks of 7 (the last one of 3)
    hidden, weight = torch.randn(n, d), torch.randn(v, d)
    bias = torch.randn(v) if with_bias else None
    targets = torch.randint(0, v, (n,))
    targets[[0, 5]] = torch.tensor([0, v - 1])  # the first and the last word
    nll, gh, gw, gb, c = explicit(hidden, weight, targets, bias)
    ours = ours_with_grads(hidden, weight, targets, bias, c)
    assert ours[0].dtype == torch.float32
    for got, want in zip(ours, (nll, gh, gw, gb), strict=True):
        if want is not None:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_float64_is_kept_and_exact(small_blocks):
    torch.manual_seed(1)
    hidden, weight = torch.randn(19, 4, dtype=torch.float64), torch.randn(30, 4, dtype=torch.float64)
    targets = torch.randint(0, 30, (19,))
    nll, gh, gw, _, c = explicit(hidden, weight, targets)
    ours = ours_with_grads(hidden, weight, targets, c=c)
    assert ours[0].dtype == torch.float64
    for got, want in zip(ours[:3], (nll, gh, gw), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_ignored_targets_get_no_loss_and_no_gradient(small_blocks):
    torch.manual_seed(2)
    hidden, weight = torch.randn(12, 4), torch.randn(20, 4)
    targets = torch.randint(0, 20, (12,))
    targets[[1, 9]] = -100
    nll, gh, gw, _, c = explicit(hidden, weight, targets)
    ours = ours_with_grads(hidden, weight, targets, c=c)
    assert (ours[0][[1, 9]] == 0).all() and (ours[1][[1, 9]] == 0).all()
    for got, want in zip(ours[:3], (nll, gh, gw), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[0], F.cross_entropy(hidden @ weight.T, targets, reduction="none"))


def test_bf16_autocast_computes_as_autocast_runs_the_plain_head():
    """Under autocast the plain path is F.cross_entropy(linear(h).float()): bf16 products, float32
    softmax. Ours gives the same losses and gradients to bf16 rounding, and float32 gradients for
    float32 leaves."""
    torch.manual_seed(3)
    head = torch.nn.Linear(16, 3000, bias=False)
    hidden = torch.randn(64, 16, requires_grad=True)
    targets = torch.randint(0, 3000, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(head(hidden).float(), targets, reduction="none")
    plain.sum().backward()
    plain_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, head.weight, targets)
    ours.sum().backward()
    assert ours.dtype == torch.float32 and hidden.grad.dtype == head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(ours, plain, rtol=1e-3, atol=1e-3)
    for got, want in zip((hidden.grad, head.weight.grad), plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_float64_stays_float64_under_autocast_as_autocast_leaves_it():
    torch.manual_seed(5)
    hidden, weight = torch.randn(6, 4, dtype=torch.float64), torch.randn(9, 4, dtype=torch.float64)
    targets = torch.randint(0, 9, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, targets)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, explicit(hidden, weight, targets)[0], rtol=1e-12, atol=1e-12)


def test_any_integer_targets_and_no_silent_second_derivative():
    """uint8 targets are ids, not a mask (indexing with them once picked rows by mask); a gradient
    penalty through the loss raises instead of dropping its second-order term."""
    torch.manual_seed(6)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64)
    targets = torch.tensor([1, 2, 3, 4, 1])
    expected = explicit(hidden.detach(), weight, targets)[0]
    for dtype in (torch.uint8, torch.int32, torch.int64):
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets.to(dtype)), expected)
    loss = linear_cross_entropy(hidden, weight, targets).sum()
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_keeps_no_tensor_the_size_of_the_logits():
    torch.manual_seed(4)
    n, v = 256, 5000
    hidden, weight = torch.randn(n, 8, requires_grad=True), torch.randn(v, 8, requires_grad=True)
    targets = torch.randint(0, v, (n,))

    def largest_saved(loss_fn) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss_fn().sum().backward()
        return max(sizes)

    assert largest_saved(lambda: F.cross_entropy(hidden @ weight.T, targets, reduction="none")) >= n * v
    assert largest_saved(lambda: linear_cross_entropy(hidden, weight, targets)) == v * 8  # the weight


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(4, 3), torch.randn(10, 3), torch.tensor([0, 1, 10, 2])), "target 10 is outside"),
        ((torch.randn(4, 3), torch.randn(10, 3), torch.tensor([0, -1, 3, 2])), "target -1 is outside"),
        ((torch.randn(4, 3), torch.randn(10, 2), torch.tensor([0, 1, 2, 3])), "need hidden"),
        ((torch.randn(4, 3), torch.randn(10, 3), torch.tensor([0, 1])), "need hidden"),
        ((torch.randn(2, 4, 3), torch.randn(10, 3), torch.tensor([0, 1])), "need hidden"),
        ((torch.randn(2, 3), torch.randn(10, 3), torch.tensor([0.0, 1.0])), "integer class ids"),
    ],
)
def test_bad_inputs_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(*args)


@pytest.mark.parametrize("options", [{}, {"tie_embeddings": False}])
def test_language_model_full_softmax_nll_is_its_log_probs_at_the_targets(options):
    model = tiny_lm(adaptive_softmax=False, **options)
    ids = torch.randint(0, 300, (2, 9))
    targets = torch.randint(0, 300, (2, 9))
    log_probs = model(ids)
    torch.testing.assert_close(model(ids, targets), -log_probs.gather(-1, targets[..., None])[..., 0])


def test_language_model_head_with_a_hook_goes_through_its_forward():
    """A hooked (or wrapped) head changes what its forward returns; the blockwise loss reads the weight
    alone, so such a head takes the plain path and its hook counts."""
    model = tiny_lm(adaptive_softmax=False, tie_embeddings=False)
    ids, targets = torch.randint(0, 300, (2, 9)), torch.randint(0, 300, (2, 9))
    plain = model(ids, targets)
    model.head.register_forward_hook(lambda module, args, out: 2 * out)
    doubled = model.head(model.forward_features(ids)).log_softmax(-1)  # the hook doubles the logits
    expected = -doubled.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(model(ids, targets), expected)
    assert (model(ids, targets) - plain).abs().max() > 1e-3


def test_language_model_last_only_is_the_last_positions_log_probs():
    model = tiny_lm(adaptive_softmax=False)
    ids = torch.randint(0, 300, (2, 9))
    torch.testing.assert_close(model(ids, last_only=True), model(ids)[:, -1])


def test_runs_eagerly_under_torch_compile_even_when_first_called_there():
    """The compile guard is applied at the first call (so importing neutreno does not import
    torch._dynamo): a graph break there, the block loop never traced, and the same numbers."""
    import torch._dynamo

    def blockwise(x):  # a loop that tracing would unroll
        return sum((x * i).sin() for i in range(20))

    wrapped = ce._eager_when_compiled(blockwise)  # fresh: its first call is under compile

    def outer(x):
        return wrapped(x.cos()) + 1

    x = torch.randn(5)
    try:
        explained = torch._dynamo.explain(outer)(x)
        torch._dynamo.reset()
        compiled = torch.compile(outer, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    traced_ops = sum(len(g.graph.nodes) for g in explained.graphs)
    assert explained.graph_break_count >= 1 and traced_ops < 20, (explained.graph_break_count, traced_ops)
    torch.testing.assert_close(compiled, blockwise(x.cos()) + 1)

    hidden, weight, targets = torch.randn(6, 4), torch.randn(9, 4), torch.randint(0, 9, (6,))
    try:
        explained = torch._dynamo.explain(lambda h: linear_cross_entropy(h * 2, weight, targets) + 1)(hidden)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count >= 1


def test_importing_the_package_and_its_command_leaves_torch_dynamo_out():
    """torch._dynamo takes ~2 s to import: every `neutreno` command, a bad-option error included, paid it."""
    import subprocess
    import sys

    code = "import sys, neutreno, neutreno.cli.main; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

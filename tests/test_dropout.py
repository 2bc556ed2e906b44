"""neutreno.layers.dropout: the CPU mask against its definition written out bit by bit, its statistics,
gradients, and the models using it."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from neutreno import create_model
from neutreno.layers import Dropout, dropout


def mask_by_hand(seed: int, shape: tuple, p: float) -> np.ndarray:
    """The keep mask as its docstring defines it, from the same generator's int64 words: element i is
    the i-th 16-bit chunk in memory order (little-endian: the low 16 bits first), read as signed."""
    n = math.prod(shape)
    torch.manual_seed(seed)
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    unsigned = words.numpy().view(np.uint64)
    chunks = [(unsigned >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(4)]
    as_unsigned = np.stack(chunks, axis=1).reshape(-1)[:n].astype(np.int64)
    as_signed = np.where(as_unsigned >= 2**15, as_unsigned - 2**16, as_unsigned)
    return (as_signed >= round(p * 2**16) - 2**15).reshape(shape)


@pytest.mark.parametrize("shape", [(3, 5, 7), (1000,), (2, 1)])
def test_mask_and_scale_are_the_definition(shape):
    x = torch.randn(shape, dtype=torch.float64)
    p = 0.3
    torch.manual_seed(11)
    y = dropout(x, p)
    keep = torch.from_numpy(mask_by_hand(11, shape, p))
    p_used = round(p * 65536) / 65536
    expected = torch.where(keep, x / (1 - p_used), torch.zeros_like(x))
    torch.testing.assert_close(y, expected, rtol=1e-15, atol=0)


def test_drop_rate_and_expectation_within_sampling_error():
    n, p = 2_000_000, 0.1
    torch.manual_seed(0)
    y = dropout(torch.ones(n), p)
    dropped = (y == 0).double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)  # p rounded to 1/65536 is far inside this
    assert abs(y.double().mean().item() - 1) < 5 * math.sqrt(p / (1 - p) / n)  # E = x: kept scaled up


def test_gradient_is_the_mask_times_the_scale_and_autograd_keeps_only_the_mask():
    x = torch.randn(64, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.manual_seed(3)
        y = dropout(x, 0.25)
    g = torch.randn_like(y)
    y.backward(g)
    keep = torch.from_numpy(mask_by_hand(3, (64, 32), 0.25))
    torch.testing.assert_close(x.grad, torch.where(keep, g / 0.75, torch.zeros_like(g)))
    assert [t.dtype for t in saved] == [torch.bool]


def test_edges_match_f_dropout():
    x = torch.randn(4, 4, requires_grad=True)
    assert dropout(x, 0.0) is x and dropout(x, 0.5, training=False) is x
    zeros = dropout(x, 1.0)
    assert torch.equal(zeros, F.dropout(x, 1.0)) and zeros.requires_grad
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            dropout(x, p)
    torch.manual_seed(5)
    first = dropout(x, 0.5)
    torch.manual_seed(5)
    assert torch.equal(dropout(x, 0.5), first)  # the global generator: seeded and resumed as any other
    module = Dropout(0.5)
    assert module.eval()(x) is x and repr(module) == repr(torch.nn.Dropout(0.5))


def test_models_drop_with_it():
    for name in ("lm_wt103", "vit_digits"):
        model = create_model(name)
        dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
        assert dropouts and all(type(m) is Dropout for m in dropouts), name


def test_strided_and_bf16_inputs_take_the_same_mask():
    x = torch.randn(6, 10, dtype=torch.float64)
    torch.manual_seed(4)
    expected = dropout(x.t().contiguous(), 0.2)
    torch.manual_seed(4)
    assert torch.equal(dropout(x.t(), 0.2), expected)  # element order, not memory order
    torch.manual_seed(4)
    half = dropout(x.t().bfloat16(), 0.2)
    assert half.dtype == torch.bfloat16 and torch.equal(half == 0, expected == 0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_graphs_and_script_get_f_dropout():
    # random_ over a range breaks a torch.compile graph: compiled code (train.compile) takes F.dropout
    compiled = torch.compile(lambda x: dropout(x, 0.5), backend="eager", fullgraph=True)
    y = compiled(torch.ones(4000))
    assert set(y.unique().tolist()) == {0.0, 2.0}
    scripted = torch.jit.script(Dropout(0.5))
    assert set(scripted(torch.ones(100)).unique().tolist()) == {0.0, 2.0}
    x = torch.ones(100)
    Dropout(0.5, inplace=True)(x)
    assert set(x.unique().tolist()) == {0.0, 2.0}  # in place, as asked
    with pytest.raises(RuntimeError):  # as F.dropout: integers are refused
        dropout(torch.ones(4, dtype=torch.int64), 0.5)

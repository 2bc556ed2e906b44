"""Efficiency of attention variants (paper App. G.4), ``neutreno bench efficiency``.

For one registry model built with each attention: parameters, FLOPs per sample (forward, and a training
step's forward + backward; counted by ``torch.utils.flop_counter`` on the explicit attention path, which
counts matrix products — NeuTRENO's term λ(V⁰ − V) is elementwise and adds none), memory, and time per
sample for inference and for a training step (forward, backward, AdamW). Times come from one
interleaved run (variants alternate within every round, so machine noise hits all alike); ratios are
against the first attention, softmax by default.

Memory: on CUDA the peak allocated during a training step; on the CPU, which has no allocator peak, the
bytes of the tensors autograd saves for backward — what a training step holds beyond weights and
optimizer state.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from neutreno import reporting
from neutreno.layers.functional import MATRIX_UNITS, cpu_flags
from neutreno.models import create_model
from neutreno.models.language_model import TransformerLM
from neutreno.training.engine import fusable


def interleaved_times(
    steps: dict[str, Callable[[], None]], rounds: int, per_round: int, warmup: int = 2
) -> dict:
    """Run each callable ``per_round`` times per round, variants alternating within every round;
    return per variant the seconds per call of every round (``seconds``), their median and min."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))  # no variant always runs first
        for name in order:
            start = time.perf_counter()
            for _ in range(per_round):
                steps[name]()
            samples[name].append((time.perf_counter() - start) / per_round)
    return {
        n: {"median_s": statistics.median(s), "min_s": min(s), "rounds": len(s), "seconds": s}
        for n, s in samples.items()
    }


def time_ratio(times: dict, numerator: str, denominator: str) -> dict:
    """How many times as long ``numerator`` took as ``denominator`` in one :func:`interleaved_times` run:
    the geometric mean of the rounds' ratios (a round runs both, so a slow stretch of the shared machine
    slows both) and its 95% Student-t interval over the rounds: ``{"ratio", "low", "high", "rounds"}``."""
    from neutreno.reproduce.stats import paired_interval  # (neutreno.reproduce imports this module)

    logs = [[math.log(s) for s in times[name]["seconds"]] for name in (numerator, denominator)]
    interval = paired_interval(*logs)
    if interval.n < 2:  # one round: no interval (None, not an unbounded one)
        return {"ratio": math.exp(interval.mean), "low": None, "high": None, "rounds": 1}
    bounds = {"low": math.exp(interval.low), "high": math.exp(interval.high)}
    return {"ratio": math.exp(interval.mean), **bounds, "rounds": interval.n}


def cpu_name() -> str:
    """The CPU's model name and its matrix extensions (AMX, AVX-512 bf16; else its widest vectors and
    "no bf16 units"), from /proc/cpuinfo where there is one: figures from two CPUs must never be
    compared, so every report names its CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), ""
    )
    flags = cpu_flags()
    extensions = [f for f in MATRIX_UNITS if f in flags]
    vector = next((f for f in ("avx512f", "avx2") if f in flags), None)  # two "AMD EPYC"s differ here
    if not extensions and vector:
        extensions = [vector, "no bf16 units"]
    return f"{name or platform.machine()}" + (f" ({', '.join(extensions)})" if extensions else "")


def machine(device: torch.device | None = None) -> dict:
    """What the numbers were measured on: the CPU, and the GPU when ``device`` is a CUDA one."""
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_name(),
    }
    if device is not None and device.type == "cuda":  # the device measured (not the current one)
        info["cuda_device"] = torch.cuda.get_device_name(device)
    return info


# Token ids like a word-level corpus's, whose ids are frequency ranks: P(id = k) ∝ (k + 1)^−s. An
# adaptive softmax's cost depends on how many targets fall past its head; uniform ids put 93% there
# for lm_wt103's cutoffs (WikiText-103's validation text: 2.4%): 2.15× its training FLOPs. At s 1.2,
# 5.4% fall past its 20,000-word head (real text 2.4%), 9.5% past lm_wt103_mini's 2,000 of 34,147
# (real 20.5%): the shares of real text to within a factor of about 2, from no data.
ZIPF_EXPONENT = 1.2


def zipf_token_ids(vocab_size: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` token ids below ``vocab_size`` with P(k) ∝ (k + 1)^−:data:`ZIPF_EXPONENT` (int64)."""
    weights = torch.arange(1, vocab_size + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    return torch.multinomial(weights, count, replacement=True, generator=generator)


def example_batch(model: nn.Module, batch: int, device: torch.device) -> tuple[Tensor, Callable]:
    """Random inputs for ``model`` and its training loss: token ids (:func:`zipf_token_ids`, as a
    corpus's are distributed) and next-token NLL for a :class:`TransformerLM`; images and cross-entropy
    over the output's dim 1 (classes, or per-pixel classes for a segmenter) otherwise."""
    generator = torch.Generator().manual_seed(0)
    if isinstance(model, TransformerLM):
        shape = (batch, model.context_length + 1)
        ids = zipf_token_ids(model.vocab_size, shape[0] * shape[1], generator).view(shape).to(device)
        return ids[:, :-1], lambda m, x: m(x, ids[:, 1:]).mean()
    embed = model.patch_embed if hasattr(model, "patch_embed") else model.encoder.patch_embed
    size, channels = embed.img_size, embed.proj.in_channels
    images = torch.randn(batch, channels, size, size, generator=generator).to(device)

    def loss(m: nn.Module, x: Tensor) -> Tensor:
        out = m(x)
        labels = torch.zeros(out.shape[:1] + out.shape[2:], dtype=torch.long, device=out.device)
        return F.cross_entropy(out.float(), labels)

    return images, loss


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``'s type; nothing for ``None`` (full precision)."""
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def count_flops(
    model: nn.Module, inputs: Tensor, loss_fn: Callable, train: bool, ops: tuple[str, ...] | None = None
) -> int:
    """FLOPs (2 per multiply-add) of one forward, or forward + backward with ``train``; with ``ops``
    (names such as ``"aten.mm"``), those operators' only."""
    counter = FlopCounterMode(display=False)
    with counter:
        if train:
            loss_fn(model, inputs).backward()
        else:
            with torch.no_grad():
                loss_fn(model, inputs)
    model.zero_grad(set_to_none=True)
    if ops is None:
        return counter.get_total_flops()
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ops)


def training_memory(model: nn.Module, inputs: Tensor, loss_fn: Callable, dtype: torch.dtype | None) -> int:
    """Bytes a forward + backward needs beyond the model's parameters and buffers (which exist anyway):
    on CUDA the peak allocated above what was allocated before (activations, gradients, workspaces);
    on the CPU the distinct storages autograd saves for backward (what autocast casts from the
    parameters counts)."""
    device = inputs.device
    if device.type == "cuda":
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with autocast(device, dtype):
            loss = loss_fn(model, inputs)
        loss.backward()
        torch.cuda.synchronize(device)
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated(device) - before
    storages: dict = {}
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in own:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        loss = loss_fn(model, inputs)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def inference_step(model: nn.Module, inputs, loss_fn: Callable, dtype: torch.dtype | None) -> Callable:
    """A callable running one forward of ``model`` on ``inputs`` (no grad, autocast to ``dtype``)."""
    device = next(model.parameters()).device

    def step() -> None:
        with torch.no_grad(), autocast(device, dtype):
            loss_fn(model, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def training_step(model: nn.Module, inputs, loss_fn: Callable, dtype: torch.dtype | None) -> Callable:
    """A callable running one AdamW training step of ``model`` on ``inputs`` (autocast to ``dtype``),
    returning when the device is done (fused AdamW, as the trainer's)."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fusable(model.parameters()))

    def step() -> None:
        with autocast(device, dtype):
            loss = loss_fn(model, inputs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def measure_efficiency(
    model_name: str,
    attentions: list[str],
    *,
    batch: int = 16,
    rounds: int = 5,
    per_round: int = 1,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    model_kwargs: dict | None = None,
) -> dict:
    """Parameters, FLOPs, memory and time per sample of ``model_name`` with each attention, and each
    variant's ratios to the first one. ``dtype``: autocast (e.g. ``torch.bfloat16``) or None for fp32."""
    device = torch.device(device)
    kwargs = model_kwargs or {}
    models, flop_models = {}, {}
    for attention in attentions:
        torch.manual_seed(0)
        models[attention] = create_model(model_name, attention=attention, **kwargs).to(device)
        # Counting needs the explicit attention product: the fused CPU kernel's FLOPs are not counted.
        flop_models[attention] = create_model(model_name, attention=attention, attn_impl="explicit", **kwargs)
    inputs, loss_fn = example_batch(next(iter(models.values())), batch, device)
    cpu_inputs, cpu_loss_fn = example_batch(next(iter(flop_models.values())), batch, torch.device("cpu"))

    # Inference in eval mode; training (and its memory) with dropout and drop path on, as in training.
    infer = {a: inference_step(m.eval(), inputs, loss_fn, dtype) for a, m in models.items()}
    infer_times = interleaved_times(infer, rounds, per_round)
    train = {a: training_step(m.train(), inputs, loss_fn, dtype) for a, m in models.items()}
    train_times = interleaved_times(train, rounds, per_round)
    variants = {}
    for attention, model in models.items():
        flop_model = flop_models[attention]
        variants[attention] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "forward_flops_per_sample": count_flops(flop_model, cpu_inputs, cpu_loss_fn, train=False) / batch,
            "train_flops_per_sample": count_flops(flop_model, cpu_inputs, cpu_loss_fn, train=True) / batch,
            "memory_bytes": training_memory(model, inputs, loss_fn, dtype),
            "inference_s_per_sample": infer_times[attention]["median_s"] / batch,
            "train_s_per_sample": train_times[attention]["median_s"] / batch,
            "times": {"inference": infer_times[attention], "train": train_times[attention]},
        }
    reference = variants[attentions[0]]
    keys = [k for k in reference if k != "times"]
    for attention, values in variants.items():
        values["ratio"] = {k: values[k] / reference[k] if reference[k] else float("nan") for k in keys}
        # The medians' ratios above say nothing of the noise; these say how sure the timed ones are.
        values["time_ratio"] = {
            "inference_s_per_sample": time_ratio(infer_times, attention, attentions[0]),
            "train_s_per_sample": time_ratio(train_times, attention, attentions[0]),
        }
    return {
        "model": model_name,
        "model_kwargs": kwargs,
        "batch": batch,
        "rounds": rounds,
        "dtype": str(dtype).replace("torch.", "") if dtype else "float32",
        "device": str(device),
        "memory": "CUDA peak allocated" if device.type == "cuda" else "CPU: activations saved for backward",
        **({"token_ids": f"Zipf, exponent {ZIPF_EXPONENT}"} if not inputs.is_floating_point() else {}),
        "machine": machine(device),
        "reference": attentions[0],
        "variants": variants,
    }


RATIO_KEYS = ("train_flops_per_sample", "memory_bytes", "inference_s_per_sample", "train_s_per_sample")


def markdown_table(result: dict) -> str:
    """One row per attention: parameters, GFLOPs, memory, ms per sample (medians), the counted costs'
    ratios to the reference, and the time ratios with their 95% intervals (the geometric mean of the
    rounds' ratios, as :func:`time_ratio` gives it: a ratio of the medians can fall outside its interval)."""
    rows = [[
        "attention", "params", "fwd GFLOPs/sample", "train GFLOPs/sample", "memory MiB", "infer ms/sample",
        "train ms/sample", "ratio FLOPs / memory", "time ratio infer / train [95% interval]",
    ]]  # fmt: skip
    for attention, v in result["variants"].items():
        r = v["ratio"]
        rows.append([
            attention, f"{v['parameters']:,}", f"{v['forward_flops_per_sample'] / 1e9:.4g}",
            f"{v['train_flops_per_sample'] / 1e9:.4g}", f"{v['memory_bytes'] / 2**20:.1f}",
            f"{1e3 * v['inference_s_per_sample']:.2f}", f"{1e3 * v['train_s_per_sample']:.2f}",
            " / ".join(f"{r[k]:.3f}" for k in RATIO_KEYS[:2]),
            " / ".join(_ratio_text(v["time_ratio"][k]) for k in RATIO_KEYS[2:]),
        ])  # fmt: skip
    return reporting.markdown_table(rows)


def _ratio_text(ratio: dict) -> str:
    """A :func:`time_ratio` as ``1.003 [0.929, 1.045]`` (without an interval for one round)."""
    if ratio["low"] is None:
        return f"{ratio['ratio']:.3f}"
    return f"{ratio['ratio']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]"

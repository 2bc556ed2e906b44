"""The GPU path, measured (``make bench-gpu``; issue 22). On a CUDA machine:

1. ``kernel``: with NeuTRENO on, a DeiT's attention runs the flash or memory-efficient SDPA kernel and
   autograd saves no N×N tensor (the profiler's kernel names; every tensor saved for backward), in
   fp32 and in bf16;
2. ``numerics``: the same weights on CUDA and on the CPU, fp32 (TF32 off): DeiT-tiny logits and
   gradients, softmax and NeuTRENO (its W_O has a backward of its own), and the causal language model's
   per-token loss;
3. ``throughput``: DeiT-tiny and DeiT-small bf16 training steps, ours softmax and NeuTRENO against
   Hugging Face's ``ViTForImageClassification`` (sdpa and eager) and timm's DeiT where timm imports:
   images/s, ratios with their intervals, and MFU against the device's measured bf16 matmul FLOP/s;
   then the same models in bf16 inference;
4. ``lm``: training tokens/s of the WikiText-103 language model, softmax and NeuTRENO, and Hugging
   Face's GPT-2 of the same depth, width, heads and FFN (full softmax, sdpa);
5. ``hf_patch``: what ``neutreno.hf.apply_neutreno`` costs on the device: a BERT-base training step in
   bf16 and GPT-2-small cached greedy generation, patched / unpatched;
6. ``paths``: the fused kernel against the explicit product per length (what ``impl="auto"``'s
   "fused on CUDA" rests on);
7. ``projection``: NeuTRENO's W_O as it runs (``neutreno_projection``: keeps U, V and V⁰, which the
   fused kernel keeps anyway, and rebuilds their sum in a backward of its own) against a plain
   ``proj(U + λ(V⁰ − V))`` (one more saved (B, N, D) tensor per layer, no Python autograd node):
   DeiT training step time and memory, at two batch sizes;
8. ``torchrun``: ``neutreno train`` under ``torchrun --nproc_per_node=1`` (NCCL) for a few steps;
9. ``compiled``: DeiT-tiny's bf16 training step ``torch.compile``d as the trainer does
   (``train.compile``), softmax and NeuTRENO, against eager, with the first step's seconds, at batch 128
   and at 512 (where the kernels, not Python's launches, set the pace);
10. ``compiled_generate``: GPT-2-small-shaped cached greedy generation on a static KV cache, its
   decoding step compiled by transformers as one graph, ``apply_neutreno`` patched / unpatched, and
   the patched tokens against eager generation on the dynamic cache.

Without CUDA (``--device cpu``, what the tests run with ``--quick``) every part that does not need
CUDA runs the same code on the CPU: the fused CPU kernel, gloo, and no numerics comparison; ``--quick``
skips compiling (minutes on a CPU). Ratios come from interleaved rounds (``timing.interleaved_times``),
each step synchronised; a ratio's brackets are its 95% interval over the rounds. A part that fails is
recorded as ``{"error": …}`` and the others still run (the exit status is then 1); the file is
rewritten after each part, so a run stopped midway keeps what it measured.

Writes bench/results/gpu.json on CUDA, build/gpu_cpu.json otherwise (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from neutreno import create_model
from neutreno.layers.functional import softmax_attention
from neutreno.studies.efficiency import (
    autocast,
    count_flops,
    inference_step,
    time_ratio,
    training_memory,
    training_step,
)

from timing import (
    hf_vit,
    interleaved_times,
    machine,
    matmul_flops_per_second,
    provenance,
    timm_model,
    with_plain_projection,
)

ROOT = Path(__file__).resolve().parents[1]
# The SDPA kernels that never form the N×N matrix (CUDA flash / memory-efficient / cuDNN, CPU flash).
FUSED_KERNELS = ("flash_attention", "efficient_attention", "cudnn_attention")
PARTS = (
    "kernel", "numerics", "torchrun", "throughput", "lm", "hf_patch", "paths", "projection", "compiled",
    "compiled_generate",
)  # fmt: skip
# Largest CUDA-vs-CPU difference called agreement, in fp32 with TF32 off, relative to the largest
# value compared: set before any run, well above fp32 reduction-order noise (~1e-6) and far below
# what a wrong formula gives (λ(V⁰ − V) alone moves logits by O(1)).
AGREE_RELATIVE = 1e-4


def kernel_check(device: torch.device, dtype: torch.dtype | None, batch: int) -> dict:
    """Which SDPA kernels a NeuTRENO DeiT-tiny training step runs, and whether autograd saves any N×N
    tensor (N = 197 tokens): a fused kernel saves only (B, H, N, d) tensors and per-row statistics."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = create_model("deit_tiny_patch16_224", attention="neutreno").to(device)
    images = torch.randn(batch, 3, 224, 224, device=device)
    tokens = model.patch_embed.num_patches + 1
    square = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == tokens:
            square.append(tuple(t.shape))
        return t

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
            loss = model(images).float().logsumexp(-1).mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = sorted({e.key for e in prof.key_averages() if "attention" in e.key and "scaled_dot" in e.key})
    return {"sdpa_ops": names, "fused": all_fused(names), "nxn_saved_tensors": len(square), "tokens": tokens}


def all_fused(sdpa_ops: list[str]) -> bool:
    """Whether every forward SDPA kernel among the profiled op names is a fused one: one fused op beside
    a math-path fallback in some layer is not fused (the dispatching op itself names no kernel)."""
    forward = [n for n in sdpa_ops if "backward" not in n and n != "aten::scaled_dot_product_attention"]
    return bool(forward) and all(any(k in n for k in FUSED_KERNELS) for n in forward)


def step_flops(model, inputs, loss_fn) -> int:
    """FLOPs of one forward + backward, counted on the explicit attention path (the flop counter has no
    formula for every fused kernel): the same matrix products the fused path computes."""
    explicit = {m: m.impl for m in model.modules() if hasattr(m, "impl") and hasattr(m, "attend")}
    for module in explicit:
        module.impl = "explicit"
    try:
        return count_flops(model, inputs, loss_fn, train=True)
    finally:
        for module, impl in explicit.items():
            module.impl = impl


def image_loss(model, images):
    return F.cross_entropy(
        model(images).float(), torch.zeros(len(images), dtype=torch.long, device=images.device)
    )


def logits(model, images):
    return model(images)


def median_times(times: dict) -> dict:
    return {n: v["median_s"] for n, v in times.items()}


def round_seconds(times: dict) -> dict:
    """Every round's seconds per variant: the intervals can be recomputed from the JSON."""
    return {"round_seconds": {n: v["seconds"] for n, v in times.items()}}


def deit_models(size: str, device: torch.device) -> dict:
    """Ours softmax and NeuTRENO, HF (sdpa, eager) and, where it imports, timm with our softmax weights
    (our keys are timm's), all DeiT-``size`` with random weights."""
    models = {}
    for attention in ("softmax", "neutreno"):
        torch.manual_seed(0)
        models[attention] = create_model(f"deit_{size}_patch16_224", attention=attention)
    width, heads = {"tiny": (192, 3), "small": (384, 6)}[size]
    models["hf_sdpa"], models["hf_eager"] = hf_vit(width, heads, "sdpa"), hf_vit(width, heads, "eager")
    try:
        models["timm"] = timm_model(f"deit_{size}_patch16_224")
        models["timm"].load_state_dict(models["softmax"].state_dict())
    except ImportError as error:
        print(f"  no timm rows: {error}", flush=True)
    return {n: m.to(device) for n, m in models.items()}


def ratios(times: dict) -> dict:
    """The ratios a DeiT entry reports, from one interleaved run's times: NeuTRENO / softmax time, ours'
    speed-up over HF's faster implementation and over timm, each with its interval."""
    t = median_times(times)
    hf_best = min((n for n in ("hf_sdpa", "hf_eager") if n in t), key=t.get)
    out = {
        **round_seconds(times),
        "neutreno_over_softmax_time": t["neutreno"] / t["softmax"],
        "neutreno_over_softmax_interval": time_ratio(times, "neutreno", "softmax"),
        "hf_fastest_impl": hf_best,
        "ours_speedup_over_hf": t[hf_best] / t["softmax"],
        "ours_speedup_over_hf_interval": time_ratio(times, hf_best, "softmax"),
    }
    if "timm" in t:
        out["ours_speedup_over_timm"] = t["timm"] / t["softmax"]
        out["ours_speedup_over_timm_interval"] = time_ratio(times, "timm", "softmax")
    return out


def throughput(device, dtype, batch: int, sizes: list[str], rounds: int, per_round: int) -> dict:
    """Training and inference images/s per DeiT size (ours softmax and NeuTRENO, HF, timm) and the
    training step's MFU."""

    def measure_peak() -> float:
        size = 8192 if device.type == "cuda" else 1024
        return matmul_flops_per_second(dtype or torch.float32, size, 10, device)

    # measured before and after the trainings, the best kept: one slow stretch of a shared machine
    # during the peak's few milliseconds would otherwise put MFU above 1
    peak = measure_peak()
    results = {}
    for size in sizes:
        print(f"  deit_{size}…", flush=True)
        models = deit_models(size, device)
        images = torch.randn(batch, 3, 224, 224, device=device)
        flops = step_flops(models["softmax"], images, image_loss)
        steps = {n: training_step(m.train(), images, image_loss, dtype) for n, m in models.items()}
        times = interleaved_times(steps, rounds, per_round)
        t = median_times(times)
        entry = {
            "batch": batch,
            "step_seconds": t,
            "images_per_s": {n: batch / s for n, s in t.items()},
            **ratios(times),
            "train_step_flops": flops,
            "step_flops_per_s": {n: flops / s for n, s in t.items()},
        }
        del steps
        infer_batch = 2 * batch
        images = torch.randn(infer_batch, 3, 224, 224, device=device)
        forwards = {n: inference_step(m.eval(), images, logits, dtype) for n, m in models.items()}
        times = interleaved_times(forwards, rounds, per_round)
        t = median_times(times)
        entry["inference"] = {
            "batch": infer_batch,
            "seconds": t,
            "images_per_s": {n: infer_batch / s for n, s in t.items()},
            **ratios(times),
        }
        results[f"deit_{size}"] = entry
        print(f"  train images/s {_rounded(entry['images_per_s'])}; inference "
              f"{_rounded(entry['inference']['images_per_s'])}", flush=True)  # fmt: skip
        del models, forwards
    peak = max(peak, measure_peak())
    for size in sizes:
        entry = results[f"deit_{size}"]
        entry["mfu"] = {n: rate / peak for n, rate in entry.pop("step_flops_per_s").items()}
    return {"matmul_flops_per_s": peak, **results}


def _rounded(rates: dict) -> dict:
    return {n: round(r) for n, r in rates.items()}


def lm_tokens(device, dtype, model_name: str, batch: int, rounds: int, per_round: int) -> dict:
    """Training tokens/s of the language model, softmax and NeuTRENO, and of HF's GPT-2 of the same
    shape (full softmax over the same vocabulary, sdpa)."""
    from lm import _GPT2Loss  # bench/lm.py: the same GPT-2 the CPU benchmark compares against

    models = {}
    for attention in ("softmax", "neutreno"):
        torch.manual_seed(0)
        models[attention] = create_model(model_name, attention=attention)
    if model_name == "lm_wt103":  # GPT-2 shaped as the paper's model (D 128, 16 layers, FFN 2048)
        models["hf_gpt2_sdpa"] = _GPT2Loss("sdpa")
    context = models["softmax"].context_length
    # Real text's ids, as bench/lm.py times them: uniform ids put 90% of targets in the adaptive
    # softmax's tail clusters (97% fall in its head on WikiText), a heavier step than training's
    from lm import text_source, text_stream

    ids = text_stream(batch * (context + 1), models["softmax"].vocab_size).view(batch, context + 1).to(device)
    steps = {
        n: training_step(m.to(device).train(), ids, lambda m, x: m(x[:, :-1], x[:, 1:]).mean(), dtype)
        for n, m in models.items()
    }
    times = interleaved_times(steps, rounds, per_round)
    t = median_times(times)
    tokens = batch * context
    out = {
        "model": model_name,
        "tokens_per_step": tokens,
        "ids": text_source(),
        "tokens_per_s": {n: tokens / s for n, s in t.items()},
        **round_seconds(times),
        "neutreno_over_softmax_time": t["neutreno"] / t["softmax"],
        "neutreno_over_softmax_interval": time_ratio(times, "neutreno", "softmax"),
    }
    if "hf_gpt2_sdpa" in t:
        out["ours_speedup_over_hf_gpt2"] = t["hf_gpt2_sdpa"] / t["softmax"]
        out["ours_speedup_over_hf_gpt2_interval"] = time_ratio(times, "hf_gpt2_sdpa", "softmax")
    print(f"  tokens/s {_rounded(out['tokens_per_s'])}", flush=True)
    return out


def hf_patch(device, dtype, quick: bool, rounds: int, per_round: int) -> dict:
    """``apply_neutreno``'s cost on ``device``: a BERT-base-shaped training step (AdamW, ``dtype``
    autocast, batch × 128 tokens) and GPT-2-small-shaped cached greedy generation (64 new tokens after
    16, batch 1 and 8, fp32), patched / unpatched, λ 0.6."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    import neutreno.hf
    from hf_patch import make_generate  # bench/hf_patch.py: the CPU benchmark's generation

    layers = 2 if quick else 12
    torch.manual_seed(0)
    bert = BertModel._from_config(
        BertConfig(num_hidden_layers=layers), attn_implementation="sdpa", add_pooling_layer=False
    ).to(device)
    models = {"unpatched": bert, "patched": neutreno.hf.apply_neutreno(copy.deepcopy(bert), lam=0.6)}
    input_ids = torch.randint(0, bert.config.vocab_size, (2 if quick else 32, 128), device=device)

    def loss(model, ids):
        return model(input_ids=ids).last_hidden_state.float().square().mean()

    steps = {n: training_step(m.train(), input_ids, loss, dtype) for n, m in models.items()}
    times = interleaved_times(steps, rounds, per_round)
    t = median_times(times)
    out = {
        "lam": 0.6,
        "bert_base_train": {
            "batch_tokens": list(input_ids.shape),
            "step_seconds": t,
            **round_seconds(times),
            "patched_over_unpatched_time": t["patched"] / t["unpatched"],
            "patched_over_unpatched_interval": time_ratio(times, "patched", "unpatched"),
        },
    }
    del steps, models, bert
    gpt2 = GPT2LMHeadModel._from_config(GPT2Config(n_layer=layers), attn_implementation="sdpa")
    gpt2 = gpt2.to(device).eval()
    generators = {"unpatched": gpt2, "patched": neutreno.hf.apply_neutreno(copy.deepcopy(gpt2), lam=0.6)}
    new_tokens = 4 if quick else 64
    for batch in (1, 8):
        prompt = torch.randint(0, gpt2.config.vocab_size, (batch, 16), device=device)
        calls = {n: make_generate(m, prompt, new_tokens) for n, m in generators.items()}
        times = interleaved_times(calls, rounds, 1, warmup=1)
        t = median_times(times)
        out[f"generate_batch_{batch}"] = {
            "new_tokens": new_tokens,
            "seconds": t,
            **round_seconds(times),
            "patched_over_unpatched_time": t["patched"] / t["unpatched"],
            "patched_over_unpatched_interval": time_ratio(times, "patched", "unpatched"),
        }
    print(f"  BERT train {out['bert_base_train']['patched_over_unpatched_time']:.3f}, generate "
          f"{out['generate_batch_1']['patched_over_unpatched_time']:.3f} / "
          f"{out['generate_batch_8']['patched_over_unpatched_time']:.3f}", flush=True)  # fmt: skip
    return out


def attention_paths(device, lengths: tuple[int, ...], rounds: int) -> dict:
    """The fused kernel against the explicit product at DeiT-tiny's heads (B 16, H 3, d 64), per
    dtype, length and mode: the explicit product's speed-up (above 1: explicit faster)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for training in (True, False):
            case = f"{str(dtype).removeprefix('torch.')}/{'train' if training else 'infer'}"
            out[case] = []
            for n in lengths:
                q, k, v = (
                    torch.randn(16, 3, n, 64, dtype=dtype, device=device, requires_grad=training)
                    for _ in range(3)
                )

                def step(impl: str, q=q, k=k, v=v, training=training) -> None:
                    with torch.set_grad_enabled(training):
                        out_ = softmax_attention(q, k, v, impl=impl)
                        if training:
                            out_.sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)

                calls = {impl: lambda impl=impl: step(impl) for impl in ("fused", "explicit")}
                times = median_times(interleaved_times(calls, rounds, 3))
                out[case].append({"tokens": n, "fused_ms": times["fused"] * 1e3,
                                  "explicit_ms": times["explicit"] * 1e3,
                                  "explicit_speedup": times["fused"] / times["explicit"]})  # fmt: skip
    return out


def projection(device, dtype, cases: list[tuple[str, int]], rounds: int, per_round: int) -> dict:
    """NeuTRENO's W_O that keeps U, V, V⁰ (as it runs) against a plain one that keeps their sum: DeiT
    training step time (interleaved with softmax) and the memory a step needs (on CUDA the peak above
    the weights; on a CPU the bytes saved for backward), per (size, batch) case."""
    out = {}
    for size, batch in cases:
        torch.manual_seed(0)
        softmax = create_model(f"deit_{size}_patch16_224").to(device)
        neutreno = create_model(f"deit_{size}_patch16_224", attention="neutreno").to(device)
        plain = copy.deepcopy(neutreno)
        images = torch.randn(batch, 3, 224, 224, device=device)
        steps = {
            "softmax": training_step(softmax.train(), images, image_loss, dtype),
            "neutreno": training_step(neutreno.train(), images, image_loss, dtype),
            "neutreno_plain_wo": with_plain_projection(
                training_step(plain.train(), images, image_loss, dtype)
            ),
        }
        times = interleaved_times(steps, rounds, per_round)
        memory = {
            "softmax": training_memory(softmax, images, image_loss, dtype),
            "neutreno": training_memory(neutreno, images, image_loss, dtype),
            "neutreno_plain_wo": with_plain_projection(
                functools.partial(training_memory, plain, images, image_loss, dtype)
            )(),
        }
        out[f"deit_{size}_batch_{batch}"] = {
            "step_seconds": median_times(times),
            **round_seconds(times),
            "neutreno_over_softmax_interval": time_ratio(times, "neutreno", "softmax"),
            "plain_wo_over_softmax_interval": time_ratio(times, "neutreno_plain_wo", "softmax"),
            "memory_bytes": memory,
            "neutreno_over_softmax_memory": memory["neutreno"] / memory["softmax"],
            "plain_wo_over_softmax_memory": memory["neutreno_plain_wo"] / memory["softmax"],
        }
        entry = out[f"deit_{size}_batch_{batch}"]
        time_ours, time_plain = (
            entry[f"{n}_over_softmax_interval"]["ratio"] for n in ("neutreno", "plain_wo")
        )
        memory_ours, memory_plain = (entry[f"{n}_over_softmax_memory"] for n in ("neutreno", "plain_wo"))
        print(f"  deit_{size} batch {batch}: / softmax: time {time_ours:.3f} (plain W_O {time_plain:.3f}), "
              f"memory {memory_ours:.3f} (plain W_O {memory_plain:.3f})", flush=True)  # fmt: skip
        del softmax, neutreno, plain, steps
    return out


def torchrun_check(device: torch.device, steps: int) -> dict:
    """``neutreno train`` on the digits under ``torchrun --nproc_per_node=1`` (NCCL on CUDA, gloo on the
    CPU) for ``steps`` optimizer steps: its exit status, backend and seconds."""
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "digits.yaml"
        config.write_text(
            "model: {name: vit_digits, attention: neutreno}\n"
            "data: {train: digits, val: digits, val_split: test, image_size: 8, channels: 1, "
            "mean: [0.3], std: [0.4], num_workers: 0}\n"
            "optim: {warmup_epochs: 0}\n"  # a few steps: the default 5 epochs of warm-up would never end
            f"train: {{total_steps: {steps}, batch_size: 32, eval_every: 1, device: {device.type}, "
            f"out_dir: {folder}/run}}\n"
        )
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "neutreno", "train", str(config)]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        seconds = time.perf_counter() - start
        results = Path(folder) / "run" / "results.json"
        recorded = json.loads(results.read_text()) if results.is_file() else {}
    return {
        "returncode": done.returncode,
        "backend": recorded.get("process_group"),  # as the run recorded it: null = no process group
        "processes": recorded.get("processes"),
        "steps": steps,
        "finished": "val" in recorded,
        "seconds": seconds,
        "stderr_tail": done.stderr[-2000:] if done.returncode else "",
    }


def _max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |a|: a difference relative to the scale of what is compared."""
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()


def numerics(device: torch.device) -> dict:
    """CUDA against the CPU on the same weights, fp32, TF32 off: a DeiT-tiny's logits and its
    parameters' gradients, softmax and NeuTRENO, and the causal language model's per-token loss;
    ``agrees`` where every difference is under :data:`AGREE_RELATIVE` of the largest value."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA: the CPU is the reference"}
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        out = {"tolerance_relative": AGREE_RELATIVE}
        images = torch.randn(4, 3, 224, 224)
        labels = torch.randint(0, 1000, (4,))
        for attention in ("softmax", "neutreno"):
            torch.manual_seed(0)
            cpu_model = create_model("deit_tiny_patch16_224", attention=attention).eval()
            gpu_model = copy.deepcopy(cpu_model).to(device)
            cpu_logits, gpu_logits = cpu_model(images), gpu_model(images.to(device))
            F.cross_entropy(cpu_logits, labels).backward()
            F.cross_entropy(gpu_logits, labels.to(device)).backward()
            gradients = {
                name: _max_relative(p.grad, dict(gpu_model.named_parameters())[name].grad.cpu())
                for name, p in cpu_model.named_parameters()
            }
            worst = max(gradients, key=gradients.get)
            out[attention] = {
                "logits_max_abs_diff": (cpu_logits - gpu_logits.cpu()).abs().max().item(),
                "logits_relative": _max_relative(cpu_logits.detach(), gpu_logits.detach().cpu()),
                "gradients_worst_relative": gradients[worst],
                "gradients_worst_parameter": worst,
            }
        torch.manual_seed(0)
        lm = create_model("lm_wt103_mini", attention="neutreno").eval()
        ids = torch.randint(0, lm.vocab_size, (2, lm.context_length + 1))
        with torch.no_grad():
            cpu_nll = lm(ids[:, :-1], ids[:, 1:])
            gpu_nll = lm.to(device)(ids[:, :-1].to(device), ids[:, 1:].to(device)).cpu()
        out["lm_neutreno"] = {"nll_relative": _max_relative(cpu_nll, gpu_nll)}
        relative = [v for entry in out.values() if isinstance(entry, dict) for k, v in entry.items()
                    if k.endswith("relative")]  # fmt: skip
        out["agrees"] = max(relative) <= AGREE_RELATIVE
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32


def compiled(device, dtype, batches: list[int], rounds: int, per_round: int) -> dict:
    """DeiT-tiny's training step, ``torch.compile``d as the trainer compiles a run's model, softmax and
    NeuTRENO, interleaved with the eager steps; the first compiled step's seconds (compiling included).
    At the first batch size, and at each further one under ``"larger_batch"``: on an H100 a bf16 batch of
    128 leaves the GPU waiting on Python (28–31 ms of launches for 15 ms of kernels, bench/gpu_profile.py),
    so its ratios time the host; at 512 the kernels set the pace."""
    first, *larger = [_compiled_at(device, dtype, batch, rounds, per_round) for batch in batches]
    return {**first, **({"larger_batch": larger} if larger else {})}


def _compiled_at(device, dtype, batch: int, rounds: int, per_round: int) -> dict:
    from torch._inductor.utils import fresh_cache

    images = torch.randn(batch, 3, 224, 224, device=device)
    models = {}
    for attention in ("softmax", "neutreno"):
        torch.manual_seed(0)
        models[attention] = create_model("deit_tiny_patch16_224", attention=attention).to(device)
        models[f"{attention}_compiled"] = torch.compile(copy.deepcopy(models[attention]))
    steps = {n: training_step(m.train(), images, image_loss, dtype) for n, m in models.items()}
    first_step = {}
    for name in ("softmax_compiled", "neutreno_compiled"):
        # cold: neither the other model's compile nor an earlier run's on-disk cache helps it
        with fresh_cache():
            start = time.perf_counter()
            steps[name]()
            first_step[name] = time.perf_counter() - start
    times = interleaved_times(steps, rounds, per_round)
    t = median_times(times)
    return {
        "batch": batch,
        "step_seconds": t,
        "first_step_seconds": first_step,
        **round_seconds(times),
        "neutreno_over_softmax_time": t["neutreno_compiled"] / t["softmax_compiled"],
        "neutreno_over_softmax_interval": time_ratio(times, "neutreno_compiled", "softmax_compiled"),
        "eager_neutreno_over_softmax_time": t["neutreno"] / t["softmax"],
        "eager_neutreno_over_softmax_interval": time_ratio(times, "neutreno", "softmax"),
        "softmax_speedup": t["softmax"] / t["softmax_compiled"],
        "neutreno_speedup": t["neutreno"] / t["neutreno_compiled"],
        "softmax_speedup_interval": time_ratio(times, "softmax", "softmax_compiled"),
    }


def compiled_generation(device, quick: bool, rounds: int) -> dict:
    """``apply_neutreno``'s cost in compiled cached generation: GPT-2-small-shaped (fp32, batch 1, 64 new
    tokens after 16), on a static KV cache, whose decoding step transformers compiles (``CompileConfig``,
    here ``fullgraph=True``: one graph or an error; on CUDA its default mode, CUDA graphs), patched /
    unpatched interleaved; and whether the patched model's tokens and logits equal its eager generation
    on the dynamic cache."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.generation import CompileConfig

    import neutreno.hf

    torch.manual_seed(0)
    layers = 2 if quick else 12
    gpt2 = GPT2LMHeadModel._from_config(GPT2Config(n_layer=layers), attn_implementation="sdpa")
    models = {"unpatched": gpt2.to(device).eval()}
    models["patched"] = neutreno.hf.apply_neutreno(copy.deepcopy(models["unpatched"]), lam=0.6)
    prompt = torch.randint(0, gpt2.config.vocab_size, (1, 16), device=device)
    new_tokens = 4 if quick else 64
    compile_config = CompileConfig(fullgraph=True)
    if device.type != "cuda":
        compile_config._compile_all_devices = True  # transformers compiles on CUDA alone unless told

    def generate(model, **settings):
        with torch.no_grad():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **settings,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    compiled = dict(cache_implementation="static", compile_config=compile_config)
    first_call = {}
    for name, model in models.items():
        start = time.perf_counter()
        generate(model, **compiled)  # compiles the decoding step
        first_call[name] = time.perf_counter() - start
    calls = {n: functools.partial(generate, m, **compiled) for n, m in models.items()}
    times = interleaved_times(calls, rounds, 1, warmup=1)
    t = median_times(times)
    check = dict(output_logits=True, return_dict_in_generate=True)
    eager, fast = generate(models["patched"], **check), generate(models["patched"], **compiled, **check)
    logits = torch.stack(eager.logits), torch.stack(fast.logits)
    out = {
        "new_tokens": new_tokens,
        "batch": 1,
        "first_call_seconds": first_call,
        "seconds": t,
        **round_seconds(times),
        "patched_over_unpatched_time": t["patched"] / t["unpatched"],
        "patched_over_unpatched_interval": time_ratio(times, "patched", "unpatched"),
        "patched_tokens_equal_eager_dynamic_cache": bool(torch.equal(eager.sequences, fast.sequences)),
        "patched_logits_max_relative_difference": float(
            (logits[0] - logits[1]).abs().max() / logits[0].abs().max()
        ),
    }
    print(f"  compiled generation patched / unpatched {out['patched_over_unpatched_time']:.3f}, "
          f"tokens equal eager: {out['patched_tokens_equal_eager_dynamic_cache']}", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny batches, one size, few rounds (the tests)")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="autocast of the timed steps (fp32 for a CPU without bf16 matrix units)",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, comma-separated: {PARTS}")
    parser.add_argument(
        "--out", type=Path, help="default: bench/results/gpu.json on CUDA, else build/gpu_cpu.json"
    )
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown --parts {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    device = torch.device(args.device)
    # the README's GPU figures come from bench/results/gpu.json: a CPU run never replaces them unasked
    out = args.out or ROOT / ("bench/results/gpu.json" if device.type == "cuda" else "build/gpu_cpu.json")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: --device cuda, but torch sees no CUDA device")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training as one runs it on Hopper
    dtype = torch.bfloat16 if args.dtype == "bf16" else None  # None: no autocast, fp32
    quick, cuda = args.quick, device.type == "cuda"
    rounds, per_round = (2, 1) if quick else (8, 3 if cuda else 1)
    runs = {
        # the path impl="auto" picks in each precision (on a CPU, bf16 at 197 tokens: the explicit product)
        "kernel": lambda: {
            name: kernel_check(device, kind, batch=2 if quick else 32)
            for name, kind in (("fp32", None), ("bf16", torch.bfloat16))
        },
        "numerics": lambda: numerics(device),
        "throughput": lambda: throughput(
            device, dtype, 2 if quick else 128, ["tiny"] if quick else ["tiny", "small"], rounds, per_round
        ),
        "lm": lambda: lm_tokens(
            device, dtype, "lm_wt103_mini" if quick else "lm_wt103", 2 if quick else 32, rounds, per_round
        ),
        "hf_patch": lambda: hf_patch(device, dtype, quick, rounds, per_round),
        "paths": lambda: attention_paths(device, (65,) if quick else (197, 577, 1025, 4097), rounds),
        "projection": lambda: projection(
            device,
            dtype,
            [("tiny", 2)] if quick else [("tiny", 128), ("tiny", 512), ("small", 128)],
            rounds,
            per_round,
        ),
        "torchrun": lambda: torchrun_check(device, steps=2 if quick else 20),
        "compiled": lambda: (
            {"skipped": "--quick: compiling takes minutes on a CPU"}
            if quick and not cuda
            else compiled(device, dtype, [2] if quick else [128, 512], rounds, per_round)
        ),
        "compiled_generate": lambda: (
            {"skipped": "--quick: compiling takes minutes on a CPU"}
            if quick and not cuda
            else compiled_generation(device, quick, rounds)
        ),
    }
    result = {
        "machine": machine(device),
        "device": str(device),
        "dtype": args.dtype,
        "quick": quick,
        **provenance(),
    }
    failed = []
    for part in parts:
        print(f"{part}…", flush=True)
        start = time.perf_counter()
        try:
            result[part] = runs[part]()
        except Exception as error:  # one part's failure must not lose the others' figures
            traceback.print_exc()
            result[part] = {"error": f"{type(error).__name__}: {error}"}
            failed.append(part)
        result.setdefault("seconds", {})[part] = time.perf_counter() - start
        if part in ("kernel", "numerics", "torchrun"):
            print(f"  {result[part]}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        _write(out, result)
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"bench/gpu.py: failed: {', '.join(failed)} (see {out})")
    return result


def _write(path: Path, result: dict) -> None:
    from neutreno.io import write_json  # strict JSON: a non-finite number is null

    write_json(path, result)


if __name__ == "__main__":
    main()

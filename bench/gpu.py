"""The GPU path, measured (``make bench-gpu``; issue 22). On a CUDA machine:

1. ``kernel``: with NeuTRENO on, a DeiT's attention runs the flash or memory-efficient SDPA kernel and
   autograd saves no N×N tensor (the profiler's kernel names; every tensor saved for backward), in
   fp32 and in bf16;
2. ``throughput``: DeiT-tiny and DeiT-small training steps in bf16, ours softmax and NeuTRENO against
   Hugging Face's ``ViTForImageClassification`` (sdpa) of the same size: images/s, and MFU against the
   device's measured bf16 matmul FLOP/s;
3. ``lm``: training tokens/s of the WikiText-103 language model, softmax and NeuTRENO;
4. ``torchrun``: ``neutreno train`` under ``torchrun --nproc_per_node=1`` (NCCL) for a few steps;
5. ``numerics``: the same weights on CUDA and on the CPU, fp32, softmax and NeuTRENO: the largest
   logit difference.

Without CUDA (``--device cpu``, what the tests run with ``--quick``) every part that does not need
CUDA runs the same code on the CPU: the fused CPU kernel, gloo, and no numerics comparison. Ratios
come from interleaved rounds (``timing.interleaved_times``), each step synchronised.

Writes bench/results/gpu.json (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from neutreno import create_model
from neutreno.studies.efficiency import autocast, count_flops, training_step

from timing import hf_vit, interleaved_times, machine, matmul_flops_per_second

ROOT = Path(__file__).resolve().parents[1]
# The SDPA kernels that never form the N×N matrix (CUDA flash / memory-efficient, CPU flash).
FUSED_KERNELS = ("flash_attention", "efficient_attention", "cudnn_attention")


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
    fused = [n for n in names if any(k in n for k in FUSED_KERNELS)]
    return {"sdpa_ops": names, "fused": bool(fused), "nxn_saved_tensors": len(square), "tokens": tokens}


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


def throughput(device, dtype, batch: int, sizes: list[str], rounds: int) -> dict:
    """Training images/s and MFU per DeiT size: ours softmax, ours NeuTRENO, Hugging Face (sdpa)."""
    matmul_n = 4096 if device.type == "cuda" else 1024

    def measure_peak() -> float:
        return matmul_flops_per_second(dtype or torch.float32, matmul_n, 6, device)

    # measured before and after the trainings, the best kept: one slow stretch of a shared machine
    # during the peak's few milliseconds would otherwise put MFU above 1
    peak = measure_peak()
    results = {}
    for size in sizes:
        images = torch.randn(batch, 3, 224, 224, device=device)
        models = {}
        for attention in ("softmax", "neutreno"):
            torch.manual_seed(0)
            models[attention] = create_model(f"deit_{size}_patch16_224", attention=attention).to(device)
        models["hf_sdpa"] = hf_vit(*{"tiny": (192, 3), "small": (384, 6)}[size]).to(device)
        flops = step_flops(models["softmax"], images, image_loss)
        steps = {n: training_step(m.train(), images, image_loss, dtype) for n, m in models.items()}
        times = {n: v["median_s"] for n, v in interleaved_times(steps, rounds, 1).items()}
        results[f"deit_{size}"] = {
            "batch": batch,
            "step_seconds": times,
            "images_per_s": {n: batch / t for n, t in times.items()},
            "neutreno_over_softmax_time": times["neutreno"] / times["softmax"],
            "ours_speedup_over_hf": times["hf_sdpa"] / times["softmax"],
            "train_step_flops": flops,
            "step_flops_per_s": {n: flops / t for n, t in times.items()},
        }
    peak = max(peak, measure_peak())
    for size in sizes:
        entry = results[f"deit_{size}"]
        entry["mfu"] = {n: rate / peak for n, rate in entry.pop("step_flops_per_s").items()}
    return {"matmul_flops_per_s": peak, **results}


def lm_tokens(device, dtype, model_name: str, batch: int, rounds: int) -> dict:
    """Training tokens/s of the language model, softmax and NeuTRENO."""
    steps, tokens = {}, 0
    for attention in ("softmax", "neutreno"):
        torch.manual_seed(0)
        model = create_model(model_name, attention=attention).to(device)
        ids = torch.randint(0, model.vocab_size, (batch, model.context_length + 1), device=device)
        tokens = batch * model.context_length
        steps[attention] = training_step(
            model.train(), ids, lambda m, x: m(x[:, :-1], x[:, 1:]).mean(), dtype
        )
    times = {n: v["median_s"] for n, v in interleaved_times(steps, rounds, 1).items()}
    return {
        "model": model_name,
        "tokens_per_step": tokens,
        "tokens_per_s": {n: tokens / t for n, t in times.items()},
        "neutreno_over_softmax_time": times["neutreno"] / times["softmax"],
    }


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
        finished = results.is_file() and "val" in json.loads(results.read_text())
    return {
        "returncode": done.returncode,
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "steps": steps,
        "finished": finished,
        "seconds": seconds,
        "stderr_tail": done.stderr[-2000:] if done.returncode else "",
    }


def numerics(device: torch.device) -> dict:
    """The largest difference of a DeiT-tiny's logits on ``device`` and on the CPU, same weights, fp32
    (TF32 off), softmax and NeuTRENO."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA: the CPU is the reference"}
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    images = torch.randn(4, 3, 224, 224)
    out = {}
    for attention in ("softmax", "neutreno"):
        torch.manual_seed(0)
        model = create_model("deit_tiny_patch16_224", attention=attention).eval()
        with torch.no_grad():
            cpu = model(images)
            gpu = model.to(device)(images.to(device)).cpu()
        out[attention] = {
            "max_abs_diff": (cpu - gpu).abs().max().item(),
            "max_abs_logit": cpu.abs().max().item(),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny batches, one size, few rounds (the tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: --device cuda, but torch sees no CUDA device")
    dtype = torch.bfloat16
    quick = args.quick
    result = {"machine": machine(), "device": str(device), "dtype": "bf16", "quick": quick}
    print("kernel check…", flush=True)
    # the path impl="auto" picks in each precision (on a CPU, bf16 at 197 tokens: the explicit product)
    result["kernel"] = {
        name: kernel_check(device, kind, batch=2 if quick else 32)
        for name, kind in (("fp32", None), ("bf16", dtype))
    }
    print(f"  {result['kernel']}", flush=True)
    print("throughput…", flush=True)
    result["throughput"] = throughput(
        device, dtype, batch=2 if quick else 128, sizes=["tiny"] if quick else ["tiny", "small"],
        rounds=2 if quick else 10,
    )  # fmt: skip
    print("language model…", flush=True)
    result["lm"] = lm_tokens(device, dtype, "lm_wt103_mini" if quick else "lm_wt103", 2 if quick else 32,
                             rounds=2 if quick else 10)  # fmt: skip
    print("torchrun…", flush=True)
    result["torchrun"] = torchrun_check(device, steps=2 if quick else 20)
    result["numerics"] = numerics(device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()

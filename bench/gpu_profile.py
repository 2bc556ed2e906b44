"""Where a DeiT-tiny step's time goes on a GPU: ours softmax, ours NeuTRENO and timm (issue 22).

For each case (bf16 and fp32 training at batch 128, bf16 training at 512, inference at 256) and model:
the step's wall time, the host time until the step's last launch returns (wall ≫ kernels: the GPU waits
on Python), the summed kernel time and the kernel count from the profiler; then, kernel by kernel, what
NeuTRENO adds to softmax and what ours saves against timm (with timm's weights = ours).

fp32 runs with TF32 matrix products, as bench/gpu.py times it (the profile before 2026-11-28 did not).
Writes bench/results/gpu_profile.json on CUDA, build/gpu_profile_cpu.json otherwise (``--out``
elsewhere). ``--device cpu --quick`` runs it on a CPU (operators instead of kernels), small: the fp32
cases at batch 2 (each case records its batch), two timed steps each, timm left out where it is not
installed; a check that it runs, tested in the suite.
"""

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from neutreno import create_model

from timing import machine, provenance, timm_model

dev = torch.device("cuda")  # --device
ACTIVITIES = [ProfilerActivity.CUDA]
sync = torch.cuda.synchronize
CASES = (
    ("train_bf16_b128", "train", 128, torch.bfloat16),
    ("train_bf16_b512", "train", 512, torch.bfloat16),
    ("infer_bf16_b256", "infer", 256, torch.bfloat16),
    ("infer_fp32_b256", "infer", 256, None),
    ("train_fp32_b128", "train", 128, None),
)
PAIRS = (("softmax", "neutreno"), ("timm", "softmax"))


def train_step(model, x, dtype):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.type == "cuda")
    y = torch.zeros(len(x), dtype=torch.long, device=dev)

    def step():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def infer_step(model, x, dtype):
    def step():
        with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            model(x)

    return step


def measure(step, n: int = 15, warmup: int = 3, profiled: int = 3) -> dict:
    for _ in range(warmup):
        step()
    sync()
    host, wall = [], []
    for _ in range(n):
        start = time.perf_counter()
        step()
        launched = time.perf_counter()
        sync()
        wall.append(time.perf_counter() - start)
        host.append(launched - start)
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(profiled):
            step()
        sync()
    kernel_us, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if dev.type != "cuda":  # operators' own CPU time
            kernel_us[event.name[:90]] += event.self_cpu_time_total / profiled
            counts[event.name[:90]] += 1 / profiled
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us[event.name[:90]] += event.device_time / profiled
            counts[event.name[:90]] += 1 / profiled
    return {
        "wall_ms": 1e3 * statistics.median(wall),
        "host_ms": 1e3 * statistics.median(host),
        "gpu_ms": sum(kernel_us.values()) / 1e3,
        "kernels": round(sum(counts.values())),
        "by_kernel_us": dict(kernel_us),
        "count_by_kernel": dict(counts),
    }


def difference(a: dict, b: dict, top: int = 14) -> list[str]:
    """The kernels whose time differs most from a to b: time and count added (+) or saved (−)."""
    rows = []
    for name in set(a["by_kernel_us"]) | set(b["by_kernel_us"]):
        extra_us = b["by_kernel_us"].get(name, 0) - a["by_kernel_us"].get(name, 0)
        extra = b["count_by_kernel"].get(name, 0) - a["count_by_kernel"].get(name, 0)
        rows.append((extra_us, round(extra), name))
    rows.sort(key=lambda r: -abs(r[0]))
    return [f"{us:+9.1f} us  {n:+4d}x  {name}" for us, n, name in rows[:top]]


def models(with_timm: bool) -> dict:
    torch.manual_seed(0)
    out = {
        "softmax": create_model("deit_tiny_patch16_224").to(dev),
        "neutreno": create_model("deit_tiny_patch16_224", attention="neutreno").to(dev),
    }
    if with_timm:
        out["timm"] = timm_model("deit_tiny_patch16_224").to(dev)
        out["timm"].load_state_dict(out["softmax"].state_dict())
    return out


def default_out(device: torch.device) -> Path:
    """Where a run writes without --out: a CPU run never replaces the GPU's figures."""
    root = Path(__file__).resolve().parents[1]
    return root / (
        "bench/results/gpu_profile.json" if device.type == "cuda" else "build/gpu_profile_cpu.json"
    )


def main() -> None:
    global dev, ACTIVITIES, sync
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="default: bench/results/gpu_profile.json on CUDA, else build/gpu_profile_cpu.json",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="fp32 cases at batch 2, two timed steps")
    args = parser.parse_args()
    dev = torch.device(args.device)
    out = args.out or default_out(dev)
    out.parent.mkdir(parents=True, exist_ok=True)
    if dev.type != "cuda":
        ACTIVITIES, sync = [ProfilerActivity.CPU], lambda: None
    else:  # fp32 matrix products as gpu.py times them (and one runs fp32 training on Hopper): TF32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    report = {"machine": machine(dev), "tf32": dev.type == "cuda", **provenance()}
    with_timm = True
    try:
        timm_model("deit_tiny_patch16_224")
    except ImportError as error:
        if not args.quick:
            raise
        with_timm, report["timm"] = False, f"left out: {error}"
    cases = [c for c in CASES if c[3] is None] if args.quick else CASES
    counts = {"n": 2, "warmup": 1, "profiled": 1} if args.quick else {}
    for name, kind, batch, dtype in cases:
        x = torch.randn(2 if args.quick else batch, 3, 224, 224, device=dev)
        measured = {}
        for key, model in models(with_timm).items():
            model.train(kind == "train")
            step = (train_step if kind == "train" else infer_step)(model, x, dtype)
            measured[key] = measure(step, **counts)
        summary = {
            k: {s: round(v[s], 3) for s in ("wall_ms", "host_ms", "gpu_ms")} | {"kernels": v["kernels"]}
            for k, v in measured.items()
        }
        pairs = [(a, b) for a, b in PAIRS if a in measured and b in measured]
        diffs = {f"{a}->{b}": difference(measured[a], measured[b]) for a, b in pairs}
        report[name] = {"batch": x.shape[0], "summary": summary, "diffs": diffs}
        print(
            name,
            json.dumps(summary),
            *(f"{k}\n    " + "\n    ".join(r) for k, r in diffs.items()),
            sep="\n  ",
        )
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, out)


if __name__ == "__main__":
    main()

"""`neutreno analyze` cost on 1,000 CIFAR-10 test images with a deit_tiny-size model
(vit_tiny_patch4_32: D 192, 12 layers, 3 heads, 65 tokens): time against a plain forward pass over
the same images, and peak memory at 200 and 1,000 samples (flat = streaming works). The same times
for DeiT-tiny itself on 128 ImageNet images (224 px, 197 tokens), where effective rank's
eigenvalue solves are of 192 × 192 matrices. Per setting, where the time goes: one pass timing the
plain forward, the probe's forward and each metric apart. Writes bench/results/analyze.json."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from neutreno import create_model
from neutreno.allocator import keep_freed_memory
from neutreno.data.images import load_images, normalize_imagenet
from neutreno.diagnostics import BlockProbe, analyze_layers
from neutreno.diagnostics.layerwise import (
    ATTENTION_METRICS,
    HIDDEN_METRICS,
    PAIRWISE_METRICS,
    hidden_metric_by_layer,
)
from neutreno.studies.efficiency import time_ratio

from timing import machine, positive_int, span, write_result

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CIFAR_TEST = DATA / "cifar10-test.tar.gz"
# model, data, image size, batch size
SETTINGS = {
    "cifar": ("vit_tiny_patch4_32", CIFAR_TEST, 32, 50),
    "imagenet": ("deit_tiny_patch16_224", DATA / "imagenette-mini.tar.gz", 224, 16),
}
HIDDEN = ["cosine", "rank_residual", "high_frequency", "effective_rank"]
ALL = [*HIDDEN, "energy", "gradient_alignment", "head_redundancy"]


def one_run(setting: str, samples: int, mode: str) -> None:
    """Child process: time one pass and print `seconds peak_rss_bytes`."""
    keep_freed_memory()  # as the `neutreno` program runs `analyze`
    name, data, size, batch_size = SETTINGS[setting]
    torch.manual_seed(0)
    model = create_model(name, attention="neutreno").eval()
    images, _ = load_images(data, size=size, limit=samples)
    batches = list(normalize_imagenet(images).split(batch_size))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if mode == "forward":
        with torch.no_grad():
            for batch in batches:
                model(batch)
    else:
        metrics = HIDDEN if mode == "hidden" else ALL
        analyze_layers(BlockProbe(model, attention=mode == "all"), batches, metrics)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(seconds, (peak - base) * 1024)


def breakdown(setting: str, samples: int) -> None:
    """Child process: print, as JSON, the seconds of one pass spent in the plain forward, the probe's
    forward (attention maps and q/k/v kept) and each metric of ALL, over every batch and layer."""
    keep_freed_memory()
    name, data, size, batch_size = SETTINGS[setting]
    torch.manual_seed(0)
    model = create_model(name, attention="neutreno").eval()
    images, _ = load_images(data, size=size, limit=samples)
    probe = BlockProbe(model, attention=True)
    seconds = dict.fromkeys(["forward", "probe", *ALL], 0.0)
    for batch in normalize_imagenet(images).split(batch_size):
        start = time.perf_counter()
        with torch.no_grad():
            model(batch)
        seconds["forward"] += time.perf_counter() - start
        start = time.perf_counter()
        layers = probe(batch)
        seconds["probe"] += time.perf_counter() - start
        for metric in ALL:  # as LayerwiseMetrics.update computes them, each layer's values summed
            start = time.perf_counter()
            if metric in HIDDEN_METRICS:
                values = hidden_metric_by_layer(metric, layers.hidden, layers.mask)
            else:
                last = len(layers.attn) - (metric in PAIRWISE_METRICS)
                values = [ATTENTION_METRICS[metric](layers, i) for i in range(last)]
            [v.double().sum().item() for v in values]
            seconds[metric] += time.perf_counter() - start
    print(json.dumps(seconds))


def time_parts(setting: str, samples: int) -> dict[str, float]:
    """:func:`breakdown`'s seconds, run in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(samples), "breakdown", "--setting", setting],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.splitlines()[-1])


def measure(samples: int, mode: str, setting: str = "cifar") -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(samples), mode, "--setting", setting],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(out.stderr)
    seconds, growth = out.stdout.split()[-2:]
    return float(seconds), int(growth)


DEIT_SAMPLES = 128


def interleaved(repeats: int, samples: int, setting: str) -> dict[str, list[float]]:
    """Seconds per mode and round: each run in a fresh process, the order alternating per round."""
    times: dict[str, list[float]] = {"forward": [], "hidden": [], "all": []}
    for r in range(repeats):
        for mode in times if r % 2 == 0 else reversed(times):
            times[mode].append(measure(samples, mode, setting)[0])
    return times


def ratios(times: dict[str, list[float]]) -> dict:
    """Per round (a round runs all three, so a slow stretch of the shared machine slows each alike):
    the geometric mean of the rounds' ratios to the forward pass and its 95% interval."""
    rounds = {mode: {"seconds": t} for mode, t in times.items()}
    result = {}
    for mode in ("hidden", "all"):
        ratio = time_ratio(rounds, mode, "forward")
        result[f"{mode}_metrics_over_forward"] = ratio["ratio"]
        result[f"{mode}_metrics_over_forward_interval"] = ratio
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, metavar=("SAMPLES", "MODE"))
    parser.add_argument("--setting", choices=SETTINGS, default="cifar", help="with --child")
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    if args.child and args.child[1] == "breakdown":
        return breakdown(args.setting, int(args.child[0]))
    if args.child:
        return one_run(args.setting, int(args.child[0]), args.child[1])
    for _, data, _, _ in SETTINGS.values():
        if not data.exists():
            raise SystemExit(f"needs {data}")
    result = {
        "machine": machine(),
        "allocator_keeps_freed_memory": keep_freed_memory(),  # as in each child
        "model": "vit_tiny_patch4_32 (neutreno)",
        "runs": {},
    }
    times = interleaved(args.repeats, 1000, "cifar")
    result["seconds_1000"] = {mode: min(t) for mode, t in times.items()}
    result.update(ratios(times))
    result["seconds_1000_rounds"] = times
    result["parts_seconds_1000"] = time_parts("cifar", 1000)
    deit = interleaved(args.repeats, DEIT_SAMPLES, "imagenet")
    result["deit_tiny_224"] = {
        "model": "deit_tiny_patch16_224 (neutreno), imagenette-mini, 224 px, batch 16",
        "samples": DEIT_SAMPLES,
        "seconds": {mode: min(t) for mode, t in deit.items()},
        **ratios(deit),
        "seconds_rounds": deit,
        "parts_seconds": time_parts("imagenet", DEIT_SAMPLES),
    }
    memory = {n: measure(n, "all")[1] for n in (200, 1000)}
    result["peak_memory_growth_bytes"] = memory
    best = result["seconds_1000"]
    spans = {m: span(result[f"{m}_metrics_over_forward_interval"], 2, "x") for m in ("hidden", "all")}
    print(f"1,000 CIFAR-10 test images: forward {best['forward']:.2f}s, analyze (hidden-state metrics "
          f"{', '.join(HIDDEN)}) {best['hidden']:.2f}s = {spans['hidden']}, all metrics (+ attention "
          f"maps: energy, gradient alignment, head redundancy) {best['all']:.2f}s = {spans['all']}"
          f" (fastest of {args.repeats} rounds; ratios per round)")  # fmt: skip
    deit, deit_spans = result["deit_tiny_224"], {}
    for m in ("hidden", "all"):
        deit_spans[m] = span(deit[f"{m}_metrics_over_forward_interval"], 2, "x")
    print(f"DeiT-tiny, {DEIT_SAMPLES} ImageNet images at 224 px: forward {deit['seconds']['forward']:.2f}s, "
          f"hidden-state metrics {deit_spans['hidden']}, all metrics {deit_spans['all']}")  # fmt: skip
    for label, parts in (("CIFAR", result["parts_seconds_1000"]), ("DeiT", deit["parts_seconds"])):
        shares = ", ".join(
            f"{part} {t / parts['forward']:.2f}" for part, t in parts.items() if part != "forward"
        )
        print(f"{label}, one pass, each part / the plain forward ({parts['forward']:.2f}s): {shares}")
    print(f"peak memory growth during analysis (all metrics): 200 samples {memory[200] / 2**20:.0f} MiB, "
          f"1,000 samples {memory[1000] / 2**20:.0f} MiB")  # fmt: skip
    print(f"wrote {write_result('analyze', result)}")


if __name__ == "__main__":
    main()

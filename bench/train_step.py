"""Training-step throughput of deit_tiny_patch16_224 (batch 16, 224²), fp32 and bf16 autocast:
NeuTRENO vs softmax (time, activation memory), Dovonon et al.'s spectral attention (eigen_neg: a QR of
each layer's 192×192 Θ per step) vs softmax, ours vs Hugging Face ViTForImageClassification of
the same size (its fastest attention implementation) and vs timm's deit_tiny_patch16_224 holding our
softmax model's weights, softmax and NeuTRENO compiled as `train.compile` compiles them (where inductor
can build here), and achieved FLOP/s as a fraction of this machine's matmul FLOP/s; then batch-64
inference. Writes bench/results/train_step.json."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from neutreno import create_model
from neutreno.allocator import keep_freed_memory
from neutreno.studies.efficiency import (
    count_flops,
    inference_step,
    time_ratio,
    training_memory,
    training_step,
)
from neutreno.training.engine import can_compile

from timing import (
    hf_vit,
    interleaved_times,
    machine,
    matmul_flops_per_second,
    positive_int,
    timm_model,
    write_result,
)

BATCH, IMG, CLASSES = 16, 224, 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=positive_int, default=8)
    parser.add_argument("--per-round", type=positive_int, default=2)
    args = parser.parse_args()
    allocator = keep_freed_memory()  # as the `neutreno` program runs (bench/allocator.py measures it)
    torch.manual_seed(0)
    images, labels = torch.randn(BATCH, 3, IMG, IMG), torch.randint(0, CLASSES, (BATCH,))

    def loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), labels)

    models = {
        "softmax": create_model("deit_tiny_patch16_224", attention="softmax"),
        "neutreno": create_model("deit_tiny_patch16_224", attention="neutreno"),
        "eigen_neg": create_model("deit_tiny_patch16_224", attention="eigen_neg"),
        "hf_sdpa": hf_vit(192, 3, "sdpa"),
        "hf_eager": hf_vit(192, 3, "eager"),
    }
    timm = timm_baseline(models["softmax"], images)
    if "model" in timm:
        models["timm"] = timm.pop("model")
    compiled = compiled_models(models) if can_compile(torch.device("cpu")) else {}
    models.update(compiled)
    # counted on the explicit attention path: FlopCounterMode has no formula for the CPU fused kernel
    explicit = create_model("deit_tiny_patch16_224", attn_impl="explicit")
    flops = count_flops(explicit, images, loss, train=True)
    matmul_flops = count_flops(explicit, images, loss, train=True, ops=MATMUL_OPS)
    result = {
        "machine": machine(),
        "allocator_keeps_freed_memory": allocator,
        "batch": BATCH,
        "image": IMG,
        "model": "deit_tiny_patch16_224",
        "timm": timm,
        "dtypes": {},
    }
    for dtype_name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        print(f"[{dtype_name}] timing {', '.join(models)} (interleaved, {args.rounds} rounds)...", flush=True)
        steps = {n: training_step(m.train(), images, loss, dtype) for n, m in models.items()}
        try:  # the first steps compile, for this dtype
            compile_seconds = {n: cold_compile_seconds(steps[n]) for n in compiled}
        except Exception as error:  # a kernel inductor could not build: no compiled rows, not a crash
            print(f"[{dtype_name}] compiling failed, no compiled rows: {str(error).splitlines()[0]}")
            for name in compiled:
                del models[name], steps[name]
            compiled = {}
        times = interleaved_times(steps, args.rounds, args.per_round)
        t = {n: v["median_s"] for n, v in times.items()}
        t_min = {n: v["min_s"] for n, v in times.items()}
        hf_best = min(("hf_sdpa", "hf_eager"), key=t.get)
        memory = {n: training_memory(models[n], images, loss, dtype) for n in ("softmax", "neutreno")}
        peak = matmul_flops_per_second(dtype or torch.float32)
        entry = {
            "step_seconds": times,
            "neutreno_over_softmax_time": t["neutreno"] / t["softmax"],
            "neutreno_over_softmax_interval": time_ratio(times, "neutreno", "softmax"),
            "activation_bytes": memory,
            "neutreno_over_softmax_memory": memory["neutreno"] / memory["softmax"],
            "eigen_neg_over_softmax_time": t["eigen_neg"] / t["softmax"],
            "hf_fastest_impl": hf_best,
            "ours_speedup_over_hf": t[hf_best] / t["softmax"],
            "ours_speedup_over_hf_interval": time_ratio(times, hf_best, "softmax"),
            "ours_neutreno_speedup_over_hf": t[hf_best] / t["neutreno"],
            **over_timm(times),
            "from_min_times": {
                "neutreno_over_softmax_time": t_min["neutreno"] / t_min["softmax"],
                "eigen_neg_over_softmax_time": t_min["eigen_neg"] / t_min["softmax"],
                "ours_speedup_over_hf": min(t_min["hf_sdpa"], t_min["hf_eager"]) / t_min["softmax"],
            },
            "train_step_flops": flops,
            "achieved_flops_per_s": flops / t["softmax"],
            "matmul_flops_per_s": peak,
            "fraction_of_matmul_peak": flops / t["softmax"] / peak,
            "matmul_products_alone": matmul_bound(explicit, images, loss, dtype, matmul_flops, peak),
        }
        if compiled:
            entry["compiled"] = compiled_entry(times, compile_seconds, flops / peak)
        result["dtypes"][dtype_name] = entry
        print(
            f"[{dtype_name}] step: softmax {t['softmax']:.3f}s  neutreno {t['neutreno']:.3f}s  "
            f"eigen_neg {t['eigen_neg']:.3f}s  "
            f"hf_sdpa {t['hf_sdpa']:.3f}s  hf_eager {t['hf_eager']:.3f}s\n"
            f"[{dtype_name}] NeuTRENO/softmax time {entry['neutreno_over_softmax_time']:.3f}, "
            f"activation memory {entry['neutreno_over_softmax_memory']:.3f}; "
            f"eigen_neg/softmax time {entry['eigen_neg_over_softmax_time']:.3f}; "
            f"ours/HF ({hf_best}) speed-up {entry['ours_speedup_over_hf']:.2f}x "
            f"(NeuTRENO {entry['ours_neutreno_speedup_over_hf']:.2f}x; from min times "
            f"{entry['from_min_times']['ours_speedup_over_hf']:.2f}x); "
            f"ours/timm {entry.get('ours_speedup_over_timm', float('nan')):.2f}x; "
            f"{flops / 1e9:.1f} GFLOP/step, {entry['achieved_flops_per_s'] / 1e9:.0f} GFLOP/s = "
            f"{entry['fraction_of_matmul_peak']:.0%} of matmul {peak / 1e9:.0f} GFLOP/s; the step's "
            f"matrix products alone {entry['matmul_products_alone']['fraction_of_matmul_peak']:.0%}",
            flush=True,
        )
        if compiled:
            c = entry["compiled"]
            print(
                f"[{dtype_name}] compiled: softmax {t['softmax_compiled']:.3f}s  neutreno "
                f"{t['neutreno_compiled']:.3f}s (first steps, compiling: "
                f"{' / '.join(f'{secs:.0f}s' for secs in c['compile_seconds'].values())}); NeuTRENO/softmax "
                f"{c['neutreno_over_softmax_time']:.3f}; speed-up over eager {c['softmax_speedup']:.2f}x "
                f"(NeuTRENO {c['neutreno_speedup']:.2f}x); {c['fraction_of_matmul_peak']:.0%} of matmul peak",
                flush=True,
            )
    result["inference"] = inference(models, dtypes=(("fp32", None), ("bf16", torch.bfloat16)))
    print(f"wrote {write_result('train_step', result)}")


def timm_baseline(ours: torch.nn.Module, images: torch.Tensor) -> dict:
    """timm's deit_tiny_patch16_224 with ``ours``' weights (our keys are timm's, loaded strictly) under
    "model", and the largest logit difference from ours in eval mode; or why timm is missing."""
    try:
        model = timm_model("deit_tiny_patch16_224")
    except ImportError as error:
        print(f"no timm rows: {error}", flush=True)
        return {"missing": str(error)}
    import timm

    model.load_state_dict(ours.state_dict())
    ours.eval()
    model.eval()
    with torch.no_grad():
        difference = (model(images) - ours(images)).abs().max().item()
    print(f"timm {timm.__version__}: our weights load strictly; logits differ by at most {difference:.2e}")
    return {"model": model, "version": timm.__version__, "max_abs_logit_difference": difference}


def compiled_models(models: dict) -> dict:
    """Softmax and NeuTRENO, each a copy of ``models``' with its weights, ``torch.compile``d as the
    trainer compiles a run's model (``train.compile``)."""
    compiled = {}
    for name in ("softmax", "neutreno"):
        model = create_model("deit_tiny_patch16_224", attention=name)
        model.load_state_dict(models[name].state_dict())
        compiled[f"{name}_compiled"] = torch.compile(model)
    return compiled


def matmul_bound(model: torch.nn.Module, images, loss, dtype, flops: int, peak: float) -> dict:
    """The step's matrix products alone (``flops``, those of :data:`MATMUL_OPS`; seconds profiled over 3
    steps of ``model``, which runs the explicit attention path so that both see its products): the
    fraction of the matmul peak they reach is the most the whole step could reach if nothing else took
    time."""
    step = training_step(model.train(), images, loss, dtype)
    for _ in range(2):
        step()
    with torch.profiler.profile() as profiled:
        for _ in range(3):
            step()
    events = [e for e in profiled.key_averages() if e.key.replace("::", ".") in MATMUL_OPS]
    # their whole time, the bias copied into addmm's output included (none of them calls another)
    seconds = sum(e.cpu_time_total for e in events) / 1e6 / 3
    return {"flops": flops, "seconds": seconds, "fraction_of_matmul_peak": flops / seconds / peak}


MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.bmm")


def cold_compile_seconds(step) -> float:
    """Seconds of a compiled model's first step, with inductor's caches emptied (on disk and in memory):
    what a run's compiling costs, but for inductor's one-time start-up, which the first one pays."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        start = time.perf_counter()
        step()
        return time.perf_counter() - start


def compiled_entry(times: dict, compile_seconds: dict, flops_over_peak: float) -> dict:
    """The compiled steps against each other and against the eager ones, from one interleaved run."""
    t = {n: v["median_s"] for n, v in times.items()}
    return {
        "compile_seconds": compile_seconds,  # the first step's, compiling with empty caches included
        "neutreno_over_softmax_time": t["neutreno_compiled"] / t["softmax_compiled"],
        "neutreno_over_softmax_interval": time_ratio(times, "neutreno_compiled", "softmax_compiled"),
        "softmax_speedup": t["softmax"] / t["softmax_compiled"],
        "neutreno_speedup": t["neutreno"] / t["neutreno_compiled"],
        "fraction_of_matmul_peak": flops_over_peak / t["softmax_compiled"],
    }


def over_timm(times: dict) -> dict:
    """Ours' speed-up over timm (softmax, and our NeuTRENO) from median times, and softmax's with its
    interval over the rounds, where timm ran."""
    if "timm" not in times:
        return {}
    t = {n: v["median_s"] for n, v in times.items()}
    return {
        "ours_speedup_over_timm": t["timm"] / t["softmax"],
        "ours_speedup_over_timm_interval": time_ratio(times, "timm", "softmax"),
        "ours_neutreno_speedup_over_timm": t["timm"] / t["neutreno"],
    }


def inference(models: dict, dtypes, batch: int = 64, rounds: int = 6) -> dict:
    """Forward time of a batch-``batch`` inference (no grad), ours against HF and timm, interleaved per
    dtype."""
    images = torch.randn(batch, 3, IMG, IMG)
    names = [n for n in ("softmax", "neutreno", "hf_sdpa", "hf_eager", "timm") if n in models]
    out = {"batch": batch}
    for model in models.values():
        model.eval()
    for dtype_name, dtype in dtypes:
        forwards = {n: inference_step(models[n], images, lambda m, x: m(x), dtype) for n in names}
        times = interleaved_times(forwards, rounds, 1)
        t = {n: v["median_s"] for n, v in times.items()}
        hf_best = min(("hf_sdpa", "hf_eager"), key=t.get)
        out[dtype_name] = {
            "seconds": times,
            "neutreno_over_softmax_time": t["neutreno"] / t["softmax"],
            "neutreno_over_softmax_interval": time_ratio(times, "neutreno", "softmax"),
            "hf_fastest_impl": hf_best,
            "ours_speedup_over_hf": t[hf_best] / t["softmax"],
            "ours_speedup_over_hf_interval": time_ratio(times, hf_best, "softmax"),
            **over_timm(times),
        }
        print(
            f"[{dtype_name}] inference batch {batch}: softmax {t['softmax']:.3f}s "
            f"neutreno {t['neutreno']:.3f}s "
            f"hf_sdpa {t['hf_sdpa']:.3f}s hf_eager {t['hf_eager']:.3f}s; ours/HF ({hf_best}) "
            f"{t[hf_best] / t['softmax']:.2f}x, NeuTRENO/softmax {t['neutreno'] / t['softmax']:.3f}"
            + (f", ours/timm {t['timm'] / t['softmax']:.2f}x (timm {t['timm']:.3f}s)" if "timm" in t else ""),
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()

"""The README's benchmark tables, rendered from ``bench/results/*.json`` so that every figure there
traces to a run: each table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` and is
rewritten from ``NAME.json`` (with the CPU it ran on) by ``python bench/readme_tables.py``;
``--check`` only says whether the README is up to date (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from neutreno.studies.efficiency import time_ratio

ROOT = Path(__file__).resolve().parents[1]
RESULTS, README = ROOT / "bench" / "results", ROOT / "README.md"


def allocator(result: dict) -> list[str]:
    lines = [
        "| step | glibc default | freed memory kept | speed-up |",
        "|---|---|---|---|",
    ]
    for c in result["cases"].values():
        lines.append(f"| {c['what']} | {c['default_s']:.3f} s | {c['keep_s']:.3f} s | {c['speedup']:.2f}× |")
    lines.append("")
    lines.append(
        f"Medians of {result['rounds']} alternating processes of {result['steps']} steps each, on "
        f"{_on(result['machine'])} (`bench/results/allocator.json`)."
    )
    return lines


def _on(machine: dict) -> str:
    cpu = machine.get("cpu", machine.get("processor", "?"))
    threads = machine.get("threads")  # torch's threads, where a bench ran fewer than the cores
    fewer = (
        f" ({threads} torch thread{'s' * (threads != 1)})" if threads not in (None, machine["cpus"]) else ""
    )
    return f"{cpu}, {machine['cpus']} cores{fewer}, torch {machine['torch']}"


def _rows(columns: list[dict], rows: list[tuple[str, object]]) -> list[str]:
    """Markdown rows: a label, then ``cell(column)`` for each column."""
    return [f"| {label} | " + " | ".join(cell(c) for c in columns) + " |" for label, cell in rows]


def train_step(result: dict) -> list[str]:
    inference = result.get("inference", {})
    columns = [{**result["dtypes"][d], "inference": inference.get(d)} for d in ("fp32", "bf16")]

    def seconds(c: dict, name: str) -> float:
        return c["step_seconds"][name]["median_s"]

    def hf(c: dict) -> str:
        return f"{seconds(c, c['hf_fastest_impl']):.3f} s ({c['hf_fastest_impl'].removeprefix('hf_')})"

    def flops(c: dict) -> str:
        achieved, peak = c["achieved_flops_per_s"] / 1e9, c["matmul_flops_per_s"] / 1e9
        return f"{achieved:.0f} / {peak:.0f} GFLOP/s ({c['fraction_of_matmul_peak']:.0%})"

    gflop = columns[0]["train_step_flops"] / 1e9
    about_timm = result.get("timm", {})
    timm = f"{about_timm['version']}, our weights" if "version" in about_timm else "(not installed)"
    rows = [
        ("step time, softmax / NeuTRENO",
         lambda c: f"{seconds(c, 'softmax'):.3f} s / {seconds(c, 'neutreno'):.3f} s"),
        ("NeuTRENO / softmax: time, activation memory",
         lambda c: f"{_ratio(c, 'neutreno_over_softmax_time')}, {c['neutreno_over_softmax_memory']:.3f}"),
        ("Hugging Face `ViTForImageClassification`, fastest of sdpa/eager", hf),
        ("ours / HF speed-up", lambda c: _ratio(c, "ours_speedup_over_hf", 2, "×")),
        (f"timm `deit_tiny_patch16_224` {timm}", lambda c: _seconds_or_dash(c["step_seconds"].get("timm"))),
        ("ours / timm speed-up", lambda c: _speedup_or_dash(c, "ours_speedup_over_timm")),
        (f"achieved FLOP/s ({gflop:.1f} GFLOP per step) vs measured matmul peak", flops),
        ("the step's matrix products alone (mm, addmm, bmm) vs matmul peak",
         lambda c: f"{c['matmul_products_alone']['fraction_of_matmul_peak']:.0%}"),
    ]  # fmt: skip
    if all("compiled" in c for c in columns):  # where inductor could build
        rows += [
            ("compiled (`train.compile`): step time, softmax / NeuTRENO",
             lambda c: f"{seconds(c, 'softmax_compiled'):.3f} s / {seconds(c, 'neutreno_compiled'):.3f} s"),
            ("compiled: NeuTRENO / softmax time",
             lambda c: _ratio(c["compiled"], "neutreno_over_softmax_time")),
            ("compiled / eager speed-up, softmax / NeuTRENO",
             lambda c: f"{c['compiled']['softmax_speedup']:.2f}× / {c['compiled']['neutreno_speedup']:.2f}×"),
            ("compiled: achieved / matmul peak",
             lambda c: f"{c['compiled']['fraction_of_matmul_peak']:.0%}"),
        ]  # fmt: skip
    if inference:
        rows += [
            (f"inference, batch {inference['batch']}: ours / HF speed-up (fastest of sdpa/eager)",
             lambda c: f"{_ratio(c['inference'], 'ours_speedup_over_hf', 2, '×')} "
                       f"({c['inference']['hf_fastest_impl'].removeprefix('hf_')})"),
            ("inference: ours / timm speed-up",
             lambda c: _speedup_or_dash(c["inference"], "ours_speedup_over_timm")),
            ("inference: NeuTRENO / softmax time",
             lambda c: _ratio(c["inference"], "neutreno_over_softmax_time")),
        ]  # fmt: skip
    return [
        "| | fp32 | bf16 autocast |",
        "|---|---|---|",
        *_rows(columns, rows),
        "",
        f"DeiT-tiny training step, batch {result['batch']}, {result['image']}², medians of "
        f"{_rounds(columns[0]['step_seconds'])} interleaved rounds"
        + (f" ({_rounds(inference['fp32']['seconds'])} in inference)" if inference else "")
        + f", on {_on(result['machine'])} (`bench/results/train_step.json`).",
    ]


def _rounds(times: dict) -> int:
    """The rounds of one interleaved run (``{variant: {"rounds": n, …}}``), the same for every variant."""
    return min(t["rounds"] for t in times.values())


def _ratio(entry: dict, key: str, digits: int = 3, unit: str = "") -> str:
    """``1.049 [1.031, 1.068]``: a time ratio with its 95% interval over the rounds, where the run has one
    (``<key>_interval``, ``_time`` left out of key; the median ratio alone otherwise)."""
    interval = entry.get(key.removesuffix("_time") + "_interval")
    if interval is None or interval["low"] is None:
        return f"{entry[key]:.{digits}f}{unit}"
    return _interval(interval, digits, unit)


def _seconds_or_dash(times: dict | None) -> str:
    return "—" if times is None else f"{times['median_s']:.3f} s"


def _speedup_or_dash(entry: dict, key: str) -> str:
    return "—" if key not in entry else _ratio(entry, key, 2, "×")


def lm(result: dict) -> list[str]:
    columns = [result["fp32"], result["bf16"]]

    def rate(name: str):
        return lambda c: f"{c['times'][name]['tokens_per_s']:,.0f}"

    def both(c: dict) -> str:
        return f"{rate('lm_wt103 softmax')(c)} / {rate('lm_wt103 neutreno')(c)}"

    def gpt2_speedup(c: dict) -> str:
        # its interval from the rounds the JSON keeps (runs before bench/lm.py recorded it): a median
        # alone hid rounds that varied two-fold
        if "speedup_vs_hf_gpt2_interval" not in c:
            c = {**c, "speedup_vs_hf_gpt2_interval": time_ratio(
                c["times"], "hf GPT2LMHeadModel (sdpa)", "lm_wt103 softmax"
            )}  # fmt: skip
        return _ratio(c, "speedup_vs_hf_gpt2", 2, "×")

    rows = [
        ("`lm_wt103` (adaptive softmax), softmax / NeuTRENO", both),
        ("Hugging Face `GPT2LMHeadModel`, same depth/width/heads/FFN, full softmax (sdpa)",
         rate("hf GPT2LMHeadModel (sdpa)")),
        ("`lm_wt103` / GPT-2 speed-up", gpt2_speedup),
        ("NeuTRENO / softmax time", lambda c: _ratio(c, "neutreno_over_softmax_time")),
        ("`lm_wt103` with a full softmax / GPT-2 speed-up",
         lambda c: _ratio(c, "speedup_vs_hf_gpt2_same_full_softmax", 2, "×")),
    ]  # fmt: skip
    if "full_softmax_head" in columns[0]:  # (runs before it had none)

        def kept(c: dict) -> str:
            return " / ".join(f"{b / 2**30:.3f}" for b in c["full_softmax_head"]["saved_bytes"].values())

        rows += [
            (f"the full-softmax head alone ({columns[0]['full_softmax_head']['tokens']:,} tokens): "
             "`F.cross_entropy` / `linear_cross_entropy` time",
             lambda c: _ratio(c["full_softmax_head"], "plain_over_blockwise_time", 2, "×")),
            ("the same: GiB kept for backward, `F.cross_entropy` / `linear_cross_entropy`", kept),
        ]  # fmt: skip
    window, context = result["sliding_window_eval"], result["context"]
    stride_1, stride_256 = window["stride_1"]["tokens_per_s"], window["stride_256"]["tokens_per_s"]
    return [
        "| training tokens/s | fp32 | bf16 autocast |",
        "|---|---|---|",
        *_rows(columns, rows),
        "",
        f"Batch {result['batch']} × {context} tokens, on {_on(result['machine'])}. Sliding-window "
        f"evaluation of `lm_wt103` scores {stride_1:,.1f} tokens/s at stride 1 (one {context}-token window "
        f"per token) and {stride_256:,.0f} tokens/s at stride 256: {window['stride_256_over_stride_1']:.0f}× "
        "faster (`bench/results/lm.json`).",
        *(
            [
                f"The GiB kept for backward were counted again on {recount['date']}, on "
                f"{_on(recount['machine'])} (`bench/lm.py --recount-head-memory`; a count of the autograd "
                "graph's storages, the same on every CPU)."
            ]
            if (recount := result.get("head_memory_recounted"))
            else []
        ),
    ]


def hf_patch(result: dict) -> list[str]:
    train = result["train"]
    columns = ["fp32", "bf16"]
    rows = []
    models = (("bert_base", "BERT-base-shaped encoder"), ("llama_style", "Llama-style decoder (GQA)"))
    for name, label in models:
        runs, tokens = train[name], " × ".join(str(n) for n in train[name]["batch_tokens"])
        for what, key in ((f"training step ({tokens} tokens): time", "patched_over_unpatched_time"),
                          ("bytes kept for backward", "patched_over_unpatched_saved_bytes")):  # fmt: skip
            rows.append(f"| {label}, {what} | " + " | ".join(_ratio(runs[c], key) for c in columns) + " |")
    generate = result["generate"]
    return [
        "| patched / unpatched | fp32 | bf16 autocast |",
        "|---|---|---|",
        *rows,
        "",
        f"Cached greedy generation ({generate['model']}, {generate['new_tokens']} new tokens after "
        f"{generate['prompt']}, fp32): patched / unpatched time "
        f"{_ratio(generate['batch_1'], 'patched_over_unpatched_time')} at batch 1, "
        f"{_ratio(generate['batch_8'], 'patched_over_unpatched_time')} at batch 8. λ = {result['lam']}, on "
        f"{_on(result['machine'])} (`bench/results/hf_patch.json`).",
    ]


def host_bound(result: dict) -> list[str]:
    vit, generation = result["vit_training"], result["gpt2_generation"]
    compiled = result.get("compiled_call")  # (runs before it was measured have none)
    rows = [
        "| one thread, tiny models | ratio |",
        "|---|---|",
        f"| ViT training step: NeuTRENO / softmax, W_O as it runs (`neutreno_projection`) | "
        f"{_interval(vit['neutreno_over_softmax'])} |",
        f"| the same, a plain W_O `proj(U + λ(V⁰ − V))` / softmax | "
        f"{_interval(vit['plain_wo_over_softmax'])} |",
        f"| W_O as it runs / plain | {_interval(vit['neutreno_over_plain_wo'])} |",
        f"| GPT-2 cached greedy generation: `apply_neutreno` patched / unpatched | "
        f"{_interval(generation['patched_over_unpatched'])} |",
    ]
    about = f"ViT: {vit['model']}, softmax step {vit['step_ms']['softmax']:.1f} ms. "
    about += f"GPT-2: {generation['model']}. "
    if compiled:
        rows.append(
            "| a compiled GPT-2 decoding call's host cost (its graph a constant): patched / unpatched | "
            f"{_interval(compiled['patched_over_unpatched'])} |"
        )
        about += f"Compiled call: {compiled['call_us']['unpatched']:.0f} µs unpatched. "
    return [
        *rows,
        "",
        about + f"λ = {result['lam']}, {result['rounds']} interleaved rounds, on {_on(result['machine'])} "
        "(`bench/results/host_bound.json`).",
    ]


def analyze(result: dict) -> list[str]:
    seconds, memory = result["seconds_1000"], result["peak_memory_growth_bytes"]
    return [
        f"On 1,000 CIFAR-10 test images with a DeiT-tiny-size model, analysing costs "
        f"{_ratio(result, 'hidden_metrics_over_forward', 2, '×')} a plain forward pass with the hidden-state "
        f"metrics and {_ratio(result, 'all_metrics_over_forward', 2, '×')} with the attention metrics too "
        f"({_over_rounds(result)}fastest rounds {seconds['forward']:.1f} s, {seconds['hidden']:.1f} s, "
        f"{seconds['all']:.1f} s), on "
        f"{_on(result['machine'])}. Peak memory growth is {memory['200'] / 2**20:.0f} MiB at 200 samples "
        f"and {memory['1000'] / 2**20:.0f} MiB at 1,000 (`bench/results/analyze.json`).",
        *_analyze_deit(result.get("deit_tiny_224")),
        *_analyze_parts(result),
    ]


def _analyze_parts(result: dict) -> list[str]:
    """Where the time goes, from one pass per setting timing each part apart."""
    settings = [
        ("CIFAR", result.get("parts_seconds_1000")),
        ("DeiT-tiny", result.get("deit_tiny_224", {}).get("parts_seconds")),
    ]
    rows = [
        f"| {label} | "
        + " | ".join(f"{parts[p] / parts['forward']:.2f}" for p in parts if p != "forward")
        + " |"
        for label, parts in settings
        if parts
    ]
    if not rows:
        return []
    names = [p for p in next(parts for _, parts in settings if parts) if p != "forward"]
    return [
        "",
        "Where the time goes (one pass per setting, each part timed apart, as a multiple of the plain "
        "forward pass; `probe` is the forward pass that keeps the attention maps and q, k, v):",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        *rows,
    ]


def _analyze_deit(deit: dict | None) -> list[str]:
    if deit is None:
        return []
    seconds = deit["seconds"]
    return [
        "",
        f"DeiT-tiny itself on {deit['samples']} ImageNet images (224 px, 197 tokens; effective rank then "
        f"solves 192 × 192 eigenvalue problems): {_ratio(deit, 'hidden_metrics_over_forward', 2, '×')} with "
        f"the hidden-state metrics, {_ratio(deit, 'all_metrics_over_forward', 2, '×')} with all (fastest "
        f"rounds {seconds['forward']:.1f} s, {seconds['hidden']:.1f} s, {seconds['all']:.1f} s), same run.",
    ]


def _over_rounds(result: dict) -> str:
    interval = result.get("all_metrics_over_forward_interval")
    return "" if interval is None else f"95% intervals over {interval['rounds']} interleaved rounds; "


def data_pipeline(result: dict) -> list[str]:
    preset = result["presets"]["cifar10_vit_softmax"]
    return [
        f"For the CPU presets, batch {result['batch_size']}, JPEG decoding in 2 workers plus the crop/flip "
        f"augmentation delivers {preset['pipeline_images_per_s']:,.0f} images/s, against "
        f"{preset['train_images_per_s']:,.0f} images/s of training steps: "
        f"{preset['pipeline_over_train']:.1f}×, "
        "where the target is at least 3×. With the full DeiT augmentation (RandAugment, erasing, "
        f"Mixup/CutMix), the pipeline delivers {preset['deit_augment_pipeline_images_per_s']:,.0f} images/s "
        f"({preset['deit_augment_pipeline_over_train']:.1f}×). On {_on(result['machine'])} "
        "(`bench/results/data_pipeline.json`).",
    ]


# bench/gpu.py's PARTS (a test keeps them equal; importing gpu.py here would import torch to render text)
GPU_PARTS = ("kernel", "numerics", "torchrun", "throughput", "lm", "hf_patch", "paths", "projection",
             "compiled", "compiled_generate")  # fmt: skip


def gpu(result: dict) -> list[str]:
    """bench/gpu.py's run on a CUDA device: DeiT training and inference, the compiled step, the W_O
    ablation, the language model, apply_neutreno, and the checks (kernels, numerics, torchrun); a part
    that failed or did not run is said to be missing, not rendered."""
    ran = {part: entry for part, entry in result.items() if isinstance(entry, dict) and "error" not in entry}
    # a skipped part renders nothing, so it is missing too (the numerics say why they were skipped)
    missing = [p for p in GPU_PARTS if p not in ran or ("skipped" in ran[p] and p != "numerics")]
    precision = {"bf16": "bf16 autocast", "fp32": "fp32"}[result.get("dtype", "bf16")]
    if "throughput" not in ran:
        return [f"No DeiT figures in this run (`bench/results/gpu.json`); missing: {', '.join(missing)}."]
    put = ran["throughput"]
    sizes = [s for s in ("deit_tiny", "deit_small") if s in put]
    columns = [put[s] for s in sizes]

    def rates(key: str, *names: str):
        return lambda c: " / ".join(f"{c[key][n]:,.0f}" for n in names)

    def inference_rates(*names: str):
        return lambda c: " / ".join(f"{c['inference']['images_per_s'][n]:,.0f}" for n in names)

    batch, infer_batch = columns[0]["batch"], columns[0]["inference"]["batch"]
    rows = [
        (f"training images/s (batch {batch}), ours softmax / NeuTRENO",
         rates("images_per_s", "softmax", "neutreno")),
        ("the same, Hugging Face `ViTForImageClassification` sdpa / eager",
         rates("images_per_s", "hf_sdpa", "hf_eager")),
        ("the same, timm",
         lambda c: rates("images_per_s", "timm")(c) if "timm" in c["images_per_s"] else "—"),
        ("training: NeuTRENO / softmax time", lambda c: _ratio(c, "neutreno_over_softmax_time")),
        ("training: ours / HF speed-up", lambda c: _ratio(c, "ours_speedup_over_hf", 2, "×")),
        ("training: ours / timm speed-up", lambda c: _speedup_or_dash(c, "ours_speedup_over_timm")),
        (f"training MFU, ours softmax / NeuTRENO ({result.get('dtype', 'bf16')} matmul peak measured)",
         lambda c: f"{c['mfu']['softmax']:.1%} / {c['mfu']['neutreno']:.1%}"),
        (f"inference images/s (batch {infer_batch}), ours softmax / NeuTRENO",
         inference_rates("softmax", "neutreno")),
        ("inference: NeuTRENO / softmax time",
         lambda c: _ratio(c["inference"], "neutreno_over_softmax_time")),
        ("inference: ours / HF speed-up (HF's faster of sdpa and eager)",
         lambda c: f"{_ratio(c['inference'], 'ours_speedup_over_hf', 2, '×')} "
                   f"({c['inference']['hf_fastest_impl'].removeprefix('hf_')})"),
        ("inference: ours / timm speed-up",
         lambda c: _speedup_or_dash(c["inference"], "ours_speedup_over_timm")),
    ]  # fmt: skip
    lines = [
        f"| {precision}, eager | " + " | ".join(s.replace("deit_", "DeiT-") for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
        *_rows(columns, rows),
    ]
    device = result["machine"].get("cuda_device", result["device"])
    lines += ["", f"On one {device} (host {_on(result['machine'])}; `bench/results/gpu.json`)."]
    if rerun := result.get("rerun"):  # parts measured again after the full run: say which, and where
        rerun_device = rerun["machine"].get("cuda_device", "another device")
        lines[-1] += (
            f" Its {', '.join(f'`{p}`' for p in rerun['parts'])} parts are from a second run "
            f"(`{rerun['command']}`, on one {rerun_device}): {rerun['why']}."
        )
    compiled = ran.get("compiled", {})
    if "neutreno_over_softmax_interval" in compiled:
        first = compiled["first_step_seconds"]
        lines += [
            "",
            f"Compiled (`torch.compile`, as `train.compile` does; DeiT-tiny, batch {compiled['batch']}): "
            f"NeuTRENO / softmax time {_ratio(compiled, 'neutreno_over_softmax_time')} (eager in the same "
            f"run: {compiled['eager_neutreno_over_softmax_time']:.3f}); compiled / eager speed-up "
            f"{_ratio(compiled, 'softmax_speedup', 2, '×')} for softmax, {compiled['neutreno_speedup']:.2f}× "
            f"for NeuTRENO; the first step, compiling included, {first['softmax_compiled']:.0f} s / "
            f"{first['neutreno_compiled']:.0f} s.",
        ]
        for larger in compiled.get("larger_batch", []):
            lines[-1] += (
                f" At batch {larger['batch']}, where the kernels rather than Python's launches set the pace: "
                f"compiled {_ratio(larger, 'neutreno_over_softmax_time')}, eager "
                f"{_ratio(larger, 'eager_neutreno_over_softmax_time')}."
            )
    projection = ran.get("projection", {})
    if projection:
        cases = []
        for name, entry in projection.items():
            size, _, batch_size = name.removeprefix("deit_").partition("_batch_")
            memory = (entry[f"{n}_over_softmax_memory"] for n in ("neutreno", "plain_wo"))
            cases.append(
                f"DeiT-{size} batch {batch_size}: {_interval(entry['neutreno_over_softmax_interval'])} "
                f"(plain {_interval(entry['plain_wo_over_softmax_interval'])}), memory "
                "{:.3f} (plain {:.3f})".format(*memory)
            )
        lines += [
            "",
            "NeuTRENO's W_O that keeps U, V, V⁰ (`neutreno_projection`, as it runs) against a plain "
            f"`proj(U + λ(V⁰ − V))`, training step / softmax, eager {precision}: " + "; ".join(cases) + ".",
        ]
    lm = ran.get("lm", {})
    if "tokens_per_s" in lm:
        rate = lm["tokens_per_s"]
        gpt2 = (
            f", Hugging Face GPT-2 of the same shape (full softmax, sdpa) {rate['hf_gpt2_sdpa']:,.0f}: "
            f"ours {_ratio(lm, 'ours_speedup_over_hf_gpt2', 2, '×')}"
            if "hf_gpt2_sdpa" in rate
            else ""
        )
        lines += [
            "",
            f"`{lm['model']}` training, {precision}, {lm['tokens_per_step']:,} tokens a step: softmax "
            f"{rate['softmax']:,.0f} / NeuTRENO {rate['neutreno']:,.0f} tokens/s, NeuTRENO / softmax time "
            f"{_ratio(lm, 'neutreno_over_softmax_time')}{gpt2}.",
        ]
    patch = ran.get("hf_patch", {})
    if "bert_base_train" in patch:
        bert = patch["bert_base_train"]
        tokens = " × ".join(str(n) for n in bert["batch_tokens"])
        lines += [
            "",
            f"`apply_neutreno` (λ {patch['lam']}), patched / unpatched time: BERT-base training step "
            f"({tokens} tokens, {precision}) {_ratio(bert, 'patched_over_unpatched_time')}; GPT-2-small "
            f"cached greedy generation ({patch['generate_batch_1']['new_tokens']} new tokens, fp32) "
            f"{_ratio(patch['generate_batch_1'], 'patched_over_unpatched_time')} at batch 1, "
            f"{_ratio(patch['generate_batch_8'], 'patched_over_unpatched_time')} at batch 8.",
        ]
    generate = ran.get("compiled_generate", {})
    if "patched_over_unpatched_interval" in generate:
        same = "the same tokens" if generate["patched_tokens_equal_eager_dynamic_cache"] else "other tokens"
        first = generate["first_call_seconds"]
        lines += [
            "",
            f"Compiled generation (a static KV cache, transformers compiling the decoding step as one graph; "
            f"GPT-2-small, batch {generate['batch']}, {generate['new_tokens']} new tokens, fp32): "
            f"`apply_neutreno` patched / unpatched time {_ratio(generate, 'patched_over_unpatched_time')}; "
            f"{generate['seconds']['unpatched']:.3f} s a call unpatched; the first call, compiling included, "
            f"{first['unpatched']:.0f} s / {first['patched']:.0f} s; the patched model gives {same} as its "
            f"eager generation on the dynamic cache (logits within "
            f"{generate['patched_logits_max_relative_difference']:.1e} of the largest).",
        ]
    lines += ["", *_gpu_checks(ran)]
    if missing:
        lines += ["", f"Not in this run (failed or not run): {', '.join(missing)}."]
    return lines


def _interval(interval: dict, digits: int = 3, unit: str = "") -> str:
    """``1.049 [1.031, 1.068]`` from a :func:`time_ratio` result."""
    if interval.get("low") is None:  # one round: no interval
        return f"{interval['ratio']:.{digits}f}{unit} (one round)"
    ratio, low, high = (f"{interval[k]:.{digits}f}" for k in ("ratio", "low", "high"))
    return f"{ratio}{unit} [{low}, {high}]"


def _gpu_checks(ran: dict) -> list[str]:
    """The kernel, numerics and torchrun checks of a run, each where it ran."""
    checks = []
    if "kernel" in ran:
        checks.append(_kernel_check(ran["kernel"]))
    numerics = ran.get("numerics", {})
    if "agrees" in numerics:
        checks.append(_numerics_check(numerics))
    elif "skipped" in numerics:
        checks.append(f"CUDA against the CPU: not compared ({numerics['skipped']}).")
    if "torchrun" in ran:
        run = ran["torchrun"]
        checks.append(
            f"`neutreno train` under `torchrun --nproc_per_node=1` ran {run['steps']} steps in a "
            f"{run['backend']} process group of {run['processes']} "
            + ("and finished." if run["finished"] else f"and did NOT finish (exit {run['returncode']}).")
        )
    return ["Checks: " + " ".join(checks)] if checks else []


def _kernel_check(kernel: dict) -> str:
    def fused_op(dtype: str) -> str:
        ops = [op for op in kernel[dtype]["sdpa_ops"] if "_scaled_dot" in op and "backward" not in op]
        return ops[0].removeprefix("aten::") if ops else "no SDPA kernel"

    kernels = "; ".join(
        f"{dtype}: `{fused_op(dtype)}`, {kernel[dtype]['nxn_saved_tensors']} N×N tensors saved"
        for dtype in ("fp32", "bf16")
    )
    fused = all(kernel[dtype]["fused"] for dtype in ("fp32", "bf16"))
    runs = "the fused kernel" if fused else "NOT only fused kernels"
    return f"NeuTRENO DeiT-tiny training runs {runs} ({kernels})."


def _numerics_check(numerics: dict) -> str:
    worst = max(
        value
        for entry in numerics.values()
        if isinstance(entry, dict)
        for key, value in entry.items()
        if key.endswith("relative")
    )
    agree = "agree" if numerics["agrees"] else "DISAGREE"
    return (
        f"CUDA and the CPU {agree} on the same weights in fp32 with TF32 off: DeiT-tiny logits and every "
        f"gradient, softmax and NeuTRENO, and the language model's loss, differ by at most {worst:.1e} of "
        f"the largest value (tolerance {numerics['tolerance_relative']:.0e})."
    )


TABLES = {
    "allocator": allocator,
    "train_step": train_step,
    "lm": lm,
    "hf_patch": hf_patch,
    "host_bound": host_bound,
    "analyze": analyze,
    "data_pipeline": data_pipeline,
    "gpu": gpu,
}


def render(readme: str) -> str:
    """``readme`` with every marked table rewritten from its JSON."""
    for name, table in TABLES.items():
        result = json.loads((RESULTS / f"{name}.json").read_text())
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no {start} … {end} block")
        block = "\n".join([start, *table(result), end])
        readme = pattern.sub(lambda _, block=block: block, readme)  # no backslash escapes in block
    return readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = parser.parse_args()
    text = README.read_text()
    rendered = render(text)
    if args.check:
        if rendered != text:
            print("README.md's benchmark tables differ from bench/results: run python bench/readme_tables.py")
            return 1
        return 0
    README.write_text(rendered)
    print(f"rewrote the tables of {', '.join(TABLES)} in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

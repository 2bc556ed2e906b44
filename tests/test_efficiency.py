"""``neutreno bench efficiency`` (paper App. G.4): FLOPs against a hand count, ratios, the CLI."""

import json
import math
import os

import pytest
import torch

from neutreno.cli.main import main
from neutreno.models import create_model
from neutreno.studies.efficiency import count_flops, example_batch, measure_efficiency


def vit_forward_flops(img, patch, chans, dim, depth, mlp, classes):
    """Multiply-adds × 2 of a ViT forward for one image, written out layer by layer."""
    n = (img // patch) ** 2 + 1  # patches + CLS
    embed = 2 * (n - 1) * dim * chans * patch * patch
    block = 2 * n * dim * 3 * dim + 2 * 2 * n * n * dim + 2 * n * dim * dim + 2 * 2 * n * dim * mlp
    return embed + depth * block + 2 * dim * classes  # the head reads the CLS token only


@pytest.mark.parametrize("attention", ["softmax", "neutreno"])
def test_forward_flops_match_the_hand_count(attention):
    model = create_model("vit_digits", attention=attention, attn_impl="explicit")
    images, loss = example_batch(model, 3, torch.device("cpu"))
    flops = count_flops(model, images, loss, train=False)
    # vit_digits: 8×8×1 images, patch 2, D 64, 12 layers, MLP 128, 10 classes; λ(V⁰ − V) adds no matmul.
    assert flops == 3 * vit_forward_flops(8, 2, 1, 64, 12, 128, 10)
    assert count_flops(model, images, loss, train=True) > 2.5 * flops  # backward ≈ twice the forward
    assert all(p.grad is None for p in model.parameters())


def test_measure_efficiency_reports_ratios_to_the_first_attention():
    result = measure_efficiency("vit_digits", ["softmax", "neutreno", "eigen_neg"], batch=4, rounds=1)
    softmax, neutreno, eigen = (result["variants"][a] for a in ("softmax", "neutreno", "eigen_neg"))
    assert all(v == 1.0 for v in softmax["ratio"].values())
    assert (
        neutreno["parameters"] == softmax["parameters"]
        and neutreno["ratio"]["forward_flops_per_sample"] == 1.0
    )
    # NeuTRENO after the fused kernel keeps U and V, which the kernel keeps anyway: no extra activations.
    assert neutreno["ratio"]["memory_bytes"] == pytest.approx(1.0, abs=0.01)
    assert eigen["parameters"] < softmax["parameters"]  # no V/O biases; Θ and ψ replace W_V, W_O
    for v in result["variants"].values():
        assert v["train_s_per_sample"] > 0 and v["times"]["train"]["rounds"] == 1
        assert v["ratio"]["train_s_per_sample"] == pytest.approx(
            v["train_s_per_sample"] / softmax["train_s_per_sample"]
        )
        one_round = v["time_ratio"]["train_s_per_sample"]  # its own ratio, with no interval from one round
        assert one_round["low"] is None
        assert one_round["ratio"] == pytest.approx(v["ratio"]["train_s_per_sample"])


def test_inference_is_timed_in_eval_mode_and_training_in_train_mode(monkeypatch):
    """Inference was timed with the models in train mode (dropout on)."""
    import neutreno.studies.efficiency as efficiency

    seen = []

    def recording_model(*args, **kwargs):
        model = create_model(*args, **kwargs)
        if "attn_impl" in kwargs:  # the FLOP-counting twin, not timed
            return model
        model.register_forward_pre_hook(lambda m, _: seen.append((torch.is_grad_enabled(), m.training)))
        return model

    monkeypatch.setattr(efficiency, "create_model", recording_model)
    efficiency.measure_efficiency("lm_wt103_mini", ["softmax"], batch=2, rounds=1, model_kwargs={"depth": 1})
    assert (False, False) in seen and (True, True) in seen  # no-grad forwards in eval, training in train
    assert (False, True) not in seen


def test_timed_ratios_come_with_the_interval_over_rounds():
    result = measure_efficiency("vit_digits", ["softmax", "neutreno"], batch=4, rounds=3)
    softmax, neutreno = result["variants"]["softmax"], result["variants"]["neutreno"]
    for key, times in (("inference_s_per_sample", "inference"), ("train_s_per_sample", "train")):
        ours, base = neutreno["times"][times]["seconds"], softmax["times"][times]["seconds"]
        logs = [math.log(a / b) for a, b in zip(ours, base, strict=True)]
        mean = sum(logs) / 3
        half = 4.302653 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2 / 3)  # t(0.975, 2 df)
        got = neutreno["time_ratio"][key]
        assert got["ratio"] == pytest.approx(math.exp(mean))
        assert (got["low"], got["high"]) == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
        assert softmax["time_ratio"][key] == {"ratio": 1.0, "low": 1.0, "high": 1.0, "rounds": 3}


def test_language_models_are_measured_on_token_windows():
    kwargs = {"depth": 2, "context_length": 16}
    result = measure_efficiency(
        "lm_wt103_mini", ["softmax", "neutreno"], batch=2, rounds=1, model_kwargs=kwargs
    )
    assert result["variants"]["neutreno"]["ratio"]["train_flops_per_sample"] == 1.0
    assert result["variants"]["softmax"]["forward_flops_per_sample"] > 0


def test_cli_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "eff"
    args = [
        "bench",
        "efficiency",
        "--model",
        "vit_digits",
        "--batch",
        "2",
        "--rounds",
        "2",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    result = json.loads((out / "efficiency.json").read_text())
    assert list(result["variants"]) == ["softmax", "neutreno"] and result["reference"] == "softmax"
    table = (out / "efficiency.md").read_text()
    assert table.startswith("| attention | params |")
    assert "| neutreno | 403,914 |" in capsys.readouterr().out
    # the memory column is in MiB (2^20 bytes), as its header says: it said MB over the same division
    header, _, *rows = [line.strip("|").split(" | ") for line in table.splitlines()]
    column = [cell.strip() for cell in header].index("memory MiB")
    memory = result["variants"]["softmax"]["memory_bytes"] / 2**20
    assert rows[0][column].strip() == f"{memory:.1f}"


def test_table_time_ratio_is_the_geometric_mean_of_the_rounds_inside_its_interval():
    """The table printed the medians' ratio beside the interval of the rounds' geometric mean: with
    rounds (1, 1, 10) against (1, 1, 1) the medians' ratio is 1.000, outside [1.0…, …] of the mean."""
    from neutreno.studies.efficiency import markdown_table, time_ratio

    times = {"softmax": {"seconds": [1.0, 1.0, 1.0]}, "neutreno": {"seconds": [1.2, 1.3, 10.0]}}
    variants = {}
    for name in times:
        ratio = time_ratio(times, name, "softmax")
        variants[name] = {
            "parameters": 1, "forward_flops_per_sample": 1e9, "train_flops_per_sample": 3e9,
            "memory_bytes": 2**20, "inference_s_per_sample": 1.0, "train_s_per_sample": 1.0,
            "ratio": {"train_flops_per_sample": 1.0, "memory_bytes": 1.0,
                      "inference_s_per_sample": 1.0, "train_s_per_sample": 1.0},
            "time_ratio": {"inference_s_per_sample": ratio, "train_s_per_sample": ratio},
        }  # fmt: skip
    header, _, _, neutreno = [
        line.strip("|").split(" | ") for line in markdown_table({"variants": variants}).splitlines()
    ]
    cell = neutreno[[h.strip() for h in header].index("time ratio infer / train [95% interval]")].strip()
    geometric = (1.2 * 1.3 * 10.0) ** (1 / 3)
    infer = cell.split(" / ")[0]
    assert infer.startswith(f"{geometric:.3f} [")
    low, high = (float(b) for b in infer[infer.index("[") + 1 : -1].split(", "))
    assert low < geometric < high


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--attentions", "softmax,fast"], "unknown attention(s) ['fast']"),
        (["--attentions", "softmax,neutreno,softmax"], "--attentions names softmax twice"),  # one row shown
        (["--model", "resnet50"], "unknown model 'resnet50'"),
        (["--batch", "0"], "--batch must be >= 1 and --rounds >= 2"),
        # one round's ratio has no interval: 0.72 was printed for NeuTRENO's inference (4 rounds: 1.00)
        (["--rounds", "1"], "--batch must be >= 1 and --rounds >= 2, got 16 and 1"),
    ],
)
def test_cli_refuses_bad_arguments(tmp_path, capsys, extra, message):
    assert main(["bench", "efficiency", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("neutreno bench efficiency: error:") and message in err and "\n" not in err


def test_the_gpu_benchmark_runs_its_cpu_parts(tmp_path):
    """bench/gpu.py (``make bench-gpu``) on the CPU, small: the NeuTRENO attention runs the fused kernel
    in fp32 with no N×N tensor saved, the trainings and inferences are timed, torchrun trains to the end
    in a gloo process group of one process (NCCL on CUDA: a real process group, not the one-process
    shortcut), apply_neutreno's cost is measured, and the CUDA-vs-CPU numerics say they need CUDA.
    fp32: on a CPU without bf16 matrix units a bf16 step is 8–16× slower."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--quick", "--dtype", "fp32", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert not [part for part, entry in result.items() if isinstance(entry, dict) and "error" in entry]
    fp32 = result["kernel"]["fp32"]
    assert fp32["fused"] and fp32["nxn_saved_tensors"] == 0, fp32
    assert any("flash_attention" in op for op in fp32["sdpa_ops"])
    tiny = result["throughput"]["deit_tiny"]
    assert all(len(seconds) == 2 for seconds in tiny["round_seconds"].values())  # every round kept
    assert {"softmax", "neutreno", "hf_sdpa", "hf_eager"} <= set(tiny["images_per_s"])
    assert 0 < tiny["mfu"]["softmax"] < 1 and tiny["inference"]["images_per_s"]["neutreno"] > 0
    assert tiny["neutreno_over_softmax_interval"]["low"] <= tiny["neutreno_over_softmax_interval"]["high"]
    assert result["lm"]["tokens_per_s"]["neutreno"] > 0
    assert result["hf_patch"]["bert_base_train"]["patched_over_unpatched_time"] > 0
    assert set(result["paths"]) == {"float32/train", "float32/infer", "bfloat16/train", "bfloat16/infer"}
    run = result["torchrun"]
    assert run["returncode"] == 0 and run["finished"], run
    assert run["backend"] == "gloo" and run["processes"] == 1  # recorded by the run, not assumed
    assert "skipped" in result["numerics"] and "skipped" in result["compiled"]
    assert "cpu" in result["machine"] and result["dtype"] == "fp32"


def test_the_gpu_profile_runs_on_a_cpu(tmp_path):
    """bench/gpu_profile.py, small, on the CPU (operators instead of kernels): each fp32 case is timed and
    profiled for our softmax and NeuTRENO, and the difference names what NeuTRENO adds. (A GPU session
    has minutes; a script broken since its last run would spend them.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_profile.py"
    out = tmp_path / "gpu_profile.json"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"train_fp32_b128", "infer_fp32_b256"} <= set(report) and "cpu" in report["machine"]
    assert report["tf32"] is False and {
        report[c]["batch"] for c in ("train_fp32_b128", "infer_fp32_b256")
    } == {2}
    assert not {"train_bf16_b128", "infer_bf16_b256"} & set(report)  # --quick: fp32 only
    for case in ("train_fp32_b128", "infer_fp32_b256"):
        summary, diffs = report[case]["summary"], report[case]["diffs"]
        for model in ("softmax", "neutreno"):
            assert min(summary[model][key] for key in ("wall_ms", "gpu_ms", "kernels")) > 0, summary
        # NeuTRENO runs more operators than softmax (its λ(V⁰ − V) term), and the difference lists them
        assert summary["neutreno"]["kernels"] > summary["softmax"]["kernels"]
        assert diffs["softmax->neutreno"] and ("timm" in summary) == ("timm->softmax" in diffs)
        assert ("timm" in summary) != ("timm" in report)  # timm measured, or why it was left out
    assert report["command"][0] == "gpu_profile.py" and "--quick" in report["command"]


def test_bench_results_name_their_command_commit_and_threads(monkeypatch):
    """A result file did not say which code it timed, nor how it was run; and the README's footers said
    '2 cores' for a bench that ran torch on 1 thread (bench/host_bound.py)."""
    import subprocess
    from pathlib import Path

    timing = _bench_module("timing", monkeypatch)
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout: no commit to name")
    commit = timing.provenance()["commit"]
    assert head.stdout.startswith(commit.removesuffix("+changes")) and len(commit.split("+")[0]) == 12
    tables = _bench_module("readme_tables", monkeypatch)
    machine = {"cpu": "Some CPU", "cpus": 2, "threads": 1, "torch": "2.13.0+cpu"}
    assert tables._on(machine) == "Some CPU, 2 cores (1 torch thread), torch 2.13.0+cpu"
    assert tables._on({**machine, "threads": 2}) == "Some CPU, 2 cores, torch 2.13.0+cpu"


def test_the_fused_kernel_check_needs_every_attention_fused(monkeypatch):
    """One fused op anywhere said "runs the fused kernel", beside a layer on the math path."""
    gpu = _bench_module("gpu", monkeypatch)
    flash = [
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_backward",
    ]
    assert gpu.all_fused(["aten::scaled_dot_product_attention", *flash])
    assert not gpu.all_fused([*flash, "aten::_scaled_dot_product_attention_math"])
    assert not gpu.all_fused(["aten::scaled_dot_product_attention"])  # no kernel seen: not shown fused


def test_a_cpu_gpu_profile_never_replaces_the_gpus_figures(monkeypatch):
    """Its default output was bench/results/gpu_profile.json on any device: a CPU check overwrote the
    H100 profile the README quotes."""
    profile = _bench_module("gpu_profile", monkeypatch)
    assert profile.default_out(torch.device("cpu")).name == "gpu_profile_cpu.json"
    assert profile.default_out(torch.device("cuda")).parts[-3:] == ("bench", "results", "gpu_profile.json")


def test_the_gpu_readme_table_renders_a_cpu_run_and_a_failed_part(monkeypatch):
    """bench/readme_tables.py's GPU table from runs that are not a whole CUDA run: the numerics not
    compared (a CPU), a part that failed. It says what is missing instead of a KeyError."""
    import json
    from pathlib import Path

    tables = _bench_module("readme_tables", monkeypatch)
    run = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu.json").read_text())
    lines = "\n".join(tables.gpu({**run, "numerics": {"skipped": "needs CUDA: the CPU is the reference"}}))
    assert "not compared (needs CUDA" in lines and "DeiT-tiny" in lines
    lines = "\n".join(tables.gpu({**run, "kernel": {"error": "RuntimeError: x"}, "compiled": {"error": "x"}}))
    assert "Not in this run (failed or not run): kernel, compiled." in lines and "fused kernel" not in lines
    assert "missing: throughput" in "\n".join(tables.gpu({**run, "throughput": {"error": "x"}}))
    # every part is said when it failed or was skipped (the lm's and apply_neutreno's paragraphs
    # vanished without a word), and a one-round interval renders instead of a TypeError
    lines = "\n".join(tables.gpu({**run, "lm": {"error": "x"}, "hf_patch": {"error": "x"},
                                   "compiled": {"skipped": "no compiler"}}))  # fmt: skip
    assert "Not in this run (failed or not run): lm, hf_patch, compiled." in lines
    assert tables._interval({"ratio": 1.5, "low": None, "high": None}) == "1.500 (one round)"
    assert tables.GPU_PARTS == _bench_module("gpu", monkeypatch).PARTS


def test_gpu_benchmark_refuses_unknown_parts():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--parts", "kernel,speed"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "unknown --parts speed" in done.stderr


def test_the_plain_w_o_ablation_keeps_the_sum_and_restores_w_o(monkeypatch):
    """bench/timing.py's with_plain_projection, the other side of the W_O ratios (bench/gpu.py,
    bench/host_bound.py): it must really run the plain proj(U + λ(V⁰ − V)), which keeps the sum, one
    (B, N, D) float32 tensor per layer with the term (all but the first), and put W_O back after."""
    from neutreno.layers import attention as attention_layers
    from neutreno.studies.efficiency import training_memory

    timing = _bench_module("timing", monkeypatch)
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_32", attention="neutreno", embed_dim=48, num_heads=3).train()
    images = torch.randn(2, 3, 32, 32)

    def loss(m, x):
        return m(x).square().mean()

    kept = attention_layers.neutreno_projection
    ours = training_memory(model, images, loss, None)
    plain = timing.with_plain_projection(lambda: training_memory(model, images, loss, None))()
    assert plain - ours == 11 * (2 * 65 * 48) * 4  # 11 sums of (2, 65 tokens, 48) float32
    assert attention_layers.neutreno_projection is kept


def test_the_host_bound_benchmark_runs():
    """bench/host_bound.py (``make bench``), a few rounds: every ratio is there (not written: --quick)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "host_bound.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NeuTRENO / softmax" in done.stdout and "patched / unpatched" in done.stdout
    assert "compiled decoding call's host cost, patched / unpatched: " in done.stdout


def test_the_analyze_bench_times_every_part_on_real_images(shared_data, monkeypatch, capsys):
    """bench/analyze.py's breakdown on 4 CIFAR-10 test images: the plain forward, the probe and every
    metric the bench's "all" row runs, each with its own positive time (the README's table)."""
    import json

    analyze = _bench_module("analyze", monkeypatch)
    monkeypatch.setattr(analyze, "keep_freed_memory", lambda: True)  # not this process's allocator
    analyze.breakdown("cifar", 4)
    seconds = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert list(seconds) == ["forward", "probe", *analyze.ALL] and min(seconds.values()) > 0


def _bench_module(name: str, monkeypatch):
    """bench/<name>.py, loaded as a module, with bench/ on the path (its scripts import ``timing``)."""
    import importlib.util
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timm_baseline_imports_torchvision_as_a_stand_in_that_refuses_use(monkeypatch):
    """bench/timing.py's stand-in for a torchvision that cannot load (timm imports it at import time):
    the names timm reads at import exist (an enum member as a dict key too), and anything called fails
    loudly instead of doing something else; no other package is affected."""
    import sys

    timing = _bench_module("timing", monkeypatch)
    real = {m: sys.modules.pop(m) for m in list(sys.modules) if timing._is_torchvision(m)}
    monkeypatch.setattr(sys, "meta_path", [timing._UnusableTorchvision(), *sys.meta_path])
    try:
        import torchvision.transforms.functional as tf
        from torchvision.ops.misc import FrozenBatchNorm2d

        modes = {tf.InterpolationMode.BILINEAR: "bilinear", tf.InterpolationMode.BICUBIC: "bicubic"}
        assert modes[tf.InterpolationMode.BILINEAR] == "bilinear" and len(modes) == 2
        with pytest.raises(RuntimeError, match="FrozenBatchNorm2d: torchvision is not installed"):
            FrozenBatchNorm2d(8)
        with pytest.raises(RuntimeError, match="not installed"):
            tf.resize(torch.zeros(1, 4, 4), [2, 2])
        assert timing._UnusableTorchvision().find_spec("torchvisionx", None) is None
    finally:  # not left for later tests (monkeypatch.delitem would put the stand-ins back)
        timing._forget_torchvision()
        sys.modules.update(real)


def test_timm_baseline_says_timm_is_missing(monkeypatch, tmp_path):
    import importlib.util

    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed in this environment")
    timing = _bench_module("timing", monkeypatch)
    monkeypatch.setattr(timing, "TIMM_DIR", tmp_path)
    with pytest.raises(ImportError, match="timm is not installed"):
        timing.timm_model("deit_tiny_patch16_224")


def test_time_ratio_is_the_geometric_mean_of_round_ratios_with_a_t_interval():
    from neutreno.studies.efficiency import interleaved_times, time_ratio

    slow, fast = [2.2, 2.6, 2.0, 2.9], [2.0, 2.0, 2.0, 2.5]
    logs = [math.log(a / b) for a, b in zip(slow, fast, strict=True)]
    mean = sum(logs) / 4
    se = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3) / 2
    t_975_df3 = 3.182446305284263  # Student's t, 97.5th percentile, 3 degrees of freedom (tables)
    got = time_ratio({"slow": {"seconds": slow}, "fast": {"seconds": fast}}, "slow", "fast")
    assert got["rounds"] == 4 and got["ratio"] == pytest.approx(math.exp(mean))
    assert got["low"] == pytest.approx(math.exp(mean - t_975_df3 * se))
    assert got["high"] == pytest.approx(math.exp(mean + t_975_df3 * se))
    times = interleaved_times({"a": lambda: None, "b": lambda: None}, rounds=3, per_round=1, warmup=0)
    assert len(times["a"]["seconds"]) == 3 and time_ratio(times, "a", "b")["rounds"] == 3
    one = time_ratio({"a": {"seconds": [2.0]}, "b": {"seconds": [1.0]}}, "a", "b")
    assert one == {"ratio": pytest.approx(2.0), "low": None, "high": None, "rounds": 1}  # JSON-safe


def test_train_step_bench_counts_and_times_the_matrix_products_alone(monkeypatch):
    """bench/train_step.py's bound on the step's fraction of the matmul peak: the FLOPs of the step's
    mm/addmm/bmm only (count_flops' ``ops``), here written out for a two-layer MLP (input without a
    gradient), over their profiled seconds."""
    train_step = _bench_module("train_step", monkeypatch)
    rows, d_in, hidden, d_out = 32, 8, 16, 4
    mlp = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d_out))
    x = torch.randn(rows, d_in)
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    flops = count_flops(mlp, x, loss, train=True, ops=train_step.MATMUL_OPS)
    forward = 2 * rows * (d_in * hidden + hidden * d_out)
    backward = 2 * rows * (hidden * d_out + hidden * d_out + d_in * hidden)  # dX₂, dW₂, dW₁ (no dX₁)
    assert flops == forward + backward
    bound = train_step.matmul_bound(mlp, x, loss, None, flops, peak=1e12)
    assert bound["flops"] == flops and bound["seconds"] > 0
    assert bound["fraction_of_matmul_peak"] == pytest.approx(bound["flops"] / bound["seconds"] / 1e12)


def test_lm_bench_times_the_full_softmax_head_both_ways_and_counts_what_each_keeps(monkeypatch):
    """bench/lm.py's head-alone row: both paths timed in the same rounds, and the bytes kept for
    backward: the plain path keeps the (N, V) float32 log-probabilities once (they were counted twice,
    once for log_softmax and once for nll_loss, with the weight that exists anyway), the blockwise one
    a small part of that."""
    lm = _bench_module("lm", monkeypatch)
    targets = torch.randint(0, lm.WT103_VOCAB_SIZE, (2, 4))
    head = lm.full_softmax_head(targets, None, rounds=2)
    assert head["tokens"] == 8 and set(head["seconds"]) == {"plain", "blockwise"}
    assert head["plain_over_blockwise_interval"]["rounds"] == 2
    logits_bytes = 8 * lm.WT103_VOCAB_SIZE * 4
    weight_bytes = lm.WT103_VOCAB_SIZE * 128 * 4
    assert logits_bytes <= head["saved_bytes"]["plain"] < logits_bytes + 1024  # and the 8 targets
    assert head["saved_bytes"]["blockwise"] < logits_bytes / 8 < weight_bytes


def test_cpu_name_tells_cpus_of_one_model_name_apart(monkeypatch):
    """Two machines both named "AMD EPYC" (one with AVX-512 bf16, one AVX2 only) gave figures under one
    name: the name carries the matrix units, or else the widest vectors and "no bf16 units"."""
    from neutreno.studies import efficiency

    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo here: the CPU is named by platform alone")
    cases = {
        ("avx2", "avx512f", "avx512_bf16", "amx_bf16"): "(amx_bf16, avx512_bf16)",
        ("avx2", "avx512f", "avx512_bf16"): "(avx512_bf16)",
        ("avx2", "avx512f"): "(avx512f, no bf16 units)",
        ("fma", "avx2"): "(avx2, no bf16 units)",
    }
    for flags, suffix in cases.items():
        monkeypatch.setattr(efficiency, "cpu_flags", lambda flags=flags: list(flags))
        assert efficiency.cpu_name().endswith(suffix), flags
    monkeypatch.setattr(efficiency, "cpu_flags", lambda: ["neon", "asimd"])  # no x86 vectors: no suffix
    unmarked = efficiency.cpu_name()
    monkeypatch.setattr(efficiency, "cpu_flags", lambda: ["fma", "avx2"])
    assert efficiency.cpu_name() == f"{unmarked} (avx2, no bf16 units)"


def test_bench_scripts_refuse_zero_rounds_and_show_a_workers_error(monkeypatch):
    """``--rounds 0`` ended in "no median for empty data" after building the models; and a failed
    allocator worker showed only CalledProcessError's exit status, its traceback swallowed."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "train_step.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "argument --rounds: must be at least 1, got 0" in done.stderr
    allocator = _bench_module("allocator", monkeypatch)
    with pytest.raises(SystemExit, match=r"(?s)default worker of .* failed:.*--steps: must be at least 1"):
        allocator.measure("deit_tiny_infer_b64_fp32", 1, 0)


def test_the_benchmarks_text_ids_fit_the_model_without_shared(tmp_path, monkeypatch):
    """Without ../shared, bench/lm.py's text_stream drew ids over the full WikiText-103 vocabulary
    (267,735): bench/gpu.py --quick's lm_wt103_mini (34,147 words) failed on ids beyond it, and the
    result file said 'WikiText-103 text' for random ids."""
    lm = _bench_module("lm", monkeypatch)
    monkeypatch.setattr(lm, "SHARED", tmp_path / "absent")
    ids = lm.text_stream(5000, vocab_size=34_147)
    assert ids.numel() == 5000 and int(ids.min()) >= 0 and int(ids.max()) < 34_147
    assert "random ids" in lm.text_source() and "absent" in lm.text_source()


def test_a_language_models_ids_fall_in_its_clusters_as_texts_do(monkeypatch, shared_data):
    """Found in review: uniform token ids put 93% of lm_wt103's targets past its 20,000-word head (2.4%
    of WikiText-103's validation text), so the study's FLOPs and time per sample were over 2× a real
    step's. The Zipf ids are within a factor of about 2 of the text's tail share; and a CPU run on a
    CUDA host named the GPU as its device."""
    from neutreno.data.corpus import load_wikitext
    from neutreno.studies import efficiency

    model = create_model(
        "lm_wt103_mini", vocab_size=267_735, depth=1, context_length=64, cutoffs=[20_000, 40_000]
    )
    ids, _ = example_batch(model, 64, torch.device("cpu"))
    text = load_wikitext(shared_data / "wikitext103-mini")[1]["valid"]
    tail, real = (ids >= 20_000).float().mean().item(), (text >= 20_000).float().mean().item()
    assert 0.02 < real < 0.03 and real < tail < 2.5 * real  # uniform ids: 0.93
    assert efficiency.machine()["cpu"] and "cuda_device" not in efficiency.machine(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU {device}")
    assert efficiency.machine(torch.device("cuda", 1))["cuda_device"] == "GPU cuda:1"

"""tools/hf_sweep.py, the sweep of apply_neutreno and HFProbe over transformers' architectures, on a few
types whose outcome is known: each runs in its own process, and the exit status says whether any type was
accepted and then gave a wrong result."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SWEEP = Path(__file__).resolve().parents[1] / "tools" / "hf_sweep.py"


def sweep(tmp_path, check: str, types: list[str]) -> tuple[int, dict[str, dict]]:
    out = tmp_path / f"{check}.jsonl"
    command = [sys.executable, str(SWEEP), "--check", check, "--types", ",".join(types), "--jobs", "2"]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert f"{check} over {len(types)} types:" in done.stdout, done.stderr
    return done.returncode, {r["type"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_patch_sweep_judges_against_the_interface_reference(tmp_path):
    """BERT (sdpa) and Gemma-2 (eager, soft-capped scores) equal NeuTRENO written at the interface over
    their own eager kernels; DPT (keyword arguments dropped) and DeBERTa-v2 (attention bypassing the
    interface) and HRM (layer stacks run in a loop) are refused. BART (encoder and decoder: a V⁰ per
    stack, its cross-attention plain), which the reference did not model, and T5 (decoder inputs) and
    GPT-J (rotary_dim beyond the tiny head), which did not build, are judged too. ALBERT (one shared
    layer in a list of one group, called 3 times) was a false "mismatch": the reference took lists of
    one layer for no stack and ran it plain."""
    types = ["bert", "gemma2", "dpt", "deberta-v2", "hrm_text", "bart", "t5", "gptj", "albert"]
    code, results = sweep(tmp_path, "patch", types)
    outcomes = {t: r["outcome"] for t, r in results.items()}
    assert outcomes == {"bert": "ok", "gemma2": "ok", "dpt": "refused", "deberta-v2": "refused",
                        "hrm_text": "refused", "bart": "ok", "t5": "ok", "gptj": "ok",
                        "albert": "ok"}, results  # fmt: skip
    assert code == 0
    assert "max |patched − reference|" in results["bert"]["detail"]


def test_probe_sweep_checks_maps_against_q_and_k(tmp_path):
    code, results = sweep(tmp_path, "probe", ["convbert", "clip_text_model", "longformer"])
    assert {t: r["outcome"] for t, r in results.items()} == {
        "convbert": "ok", "clip_text_model": "ok", "longformer": "refused"
    }, results  # fmt: skip
    assert results["clip_text_model"]["detail"].startswith("causal")
    assert code == 0


def test_unknown_types_are_refused(tmp_path):
    done = subprocess.run([sys.executable, str(SWEEP), "--types", "bert,no_such_model"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "unknown model types ['no_such_model']" in done.stderr
    for options, message in (  # found in review: bert,bert ran and counted twice; --jobs 0 a traceback
        (["--types", "bert,bert"], "--types names ['bert'] more than once"),
        (["--types", "bert", "--jobs", "0"], "--jobs and --timeout must be >= 1, got 0 and 120"),
    ):
        done = subprocess.run(
            [sys.executable, str(SWEEP), *options], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_static_sweep_compares_static_and_dynamic_cache_generation(tmp_path):
    """GPT-2 patched generates the same logits on a static cache as on the dynamic one; Bloom (attention
    outside the interface) is refused."""
    code, results = sweep(tmp_path, "static", ["gpt2", "bloom"])
    assert {t: r["outcome"] for t, r in results.items()} == {"gpt2": "ok", "bloom": "refused"}, results
    assert results["gpt2"]["detail"].startswith("static against dynamic") and code == 0


def test_a_crash_or_hang_after_the_model_ran_is_a_failure_not_unbuilt(monkeypatch):
    """A worker killed, or over its time, after its model was built and ran (say a hang inside the
    patched attention) counted as "unbuilt", and the sweep exited 0 with nothing judged."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_sweep", SWEEP)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def finished(stdout, code):
        return lambda *a, **k: subprocess.CompletedProcess(a, code, stdout=stdout, stderr="Killed")

    def hung(stdout):
        def run(command, **kwargs):
            raise subprocess.TimeoutExpired(command, 2, output=stdout)

        return run

    for fake, outcome in [
        (finished("built\n", -9), "crash"),
        (finished("", -9), "unbuilt"),
        (hung(b"built\n"), "crash"),
        (hung(None), "unbuilt"),
    ]:
        monkeypatch.setattr(tool.subprocess, "run", fake)
        assert tool.run_one("bert", "patch", 2)["outcome"] == outcome
    assert "crash" in tool.FAILED


def test_a_model_too_big_to_copy_is_not_judged_not_a_crash(monkeypatch):
    """Seven multimodal types ran out of the worker's 6 GiB address space in the tool's own copy of the
    model, before apply_neutreno was called, and were counted as crashes (exit 1)."""
    import importlib.util

    import torch
    import transformers

    spec = importlib.util.spec_from_file_location("hf_sweep", SWEEP)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    model = transformers.BertModel(config).eval()
    inputs = {"input_ids": torch.arange(8)[None] % 96}

    def no_memory(obj, memo=None):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4194304 bytes")

    monkeypatch.setattr(tool.copy, "deepcopy", no_memory)
    outcome, detail = tool.check_patch(model, inputs)
    assert outcome == "unjudged" and "6 GiB" in detail and outcome not in tool.FAILED

"""What keeping freed CPU memory for reuse (``neutreno.allocator.keep_freed_memory``, which the
``neutreno`` program sets) is worth: step times with glibc's default allocator and with it, per case.

The setting is process-wide, so each measurement is its own process; the two settings alternate,
round by round, so machine noise hits both alike. Each process times ``--steps`` steps after two
warm-up steps; a case's figure is the median over rounds of each process's median step.

Writes bench/results/allocator.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from timing import machine, positive_int, write_result

CASES = {  # name: what one step is
    "deit_tiny_infer_b64_fp32": "DeiT-tiny inference, batch 64, fp32",
    "deit_tiny_infer_b64_bf16": "DeiT-tiny inference, batch 64, bf16 autocast",
    "deit_tiny_train_b16_fp32": "DeiT-tiny NeuTRENO training step, batch 16, fp32",
    "lm_wt103_train_b8_fp32": "lm_wt103 NeuTRENO training step, batch 8 × 256 tokens, fp32",
}
MODES = ("default", "keep")


def step_function(case: str):
    from neutreno import create_model
    from neutreno.studies.efficiency import inference_step, training_step, zipf_token_ids

    torch.manual_seed(0)
    dtype = torch.bfloat16 if case.endswith("bf16") else None
    if case.startswith("deit_tiny_infer"):
        model = create_model("deit_tiny_patch16_224").eval()
        return inference_step(model, torch.randn(64, 3, 224, 224), lambda m, x: m(x), dtype)
    if case.startswith("deit_tiny_train"):
        model = create_model("deit_tiny_patch16_224", attention="neutreno")
        images, labels = torch.randn(16, 3, 224, 224), torch.randint(0, 1000, (16,))
        return training_step(model.train(), images, lambda m, x: F.cross_entropy(m(x), labels), dtype)
    model = create_model("lm_wt103", attention="neutreno")
    ids = zipf_token_ids(model.vocab_size, 8 * 257, torch.Generator().manual_seed(0))  # as a text's
    ids = ids.view(8, 257)
    return training_step(model.train(), ids[:, :-1], lambda m, x: m(x, ids[:, 1:]).mean(), dtype)


def worker(mode: str, case: str, steps: int) -> None:
    """One process: the allocator setting first, then the model, two warm-up steps and ``steps`` timed."""
    from neutreno.allocator import keep_freed_memory

    applied = keep_freed_memory() if mode == "keep" else False
    step = step_function(case)
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"applied": applied, "median_s": statistics.median(times)}))


def measure(case: str, rounds: int, steps: int) -> dict:
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            done = subprocess.run(
                [sys.executable, __file__, "--worker", mode, case, "--steps", str(steps)],
                capture_output=True, text=True, env={**os.environ, "NEUTRENO_MALLOC": ""},
            )  # fmt: skip
            if done.returncode != 0:  # its traceback, not CalledProcessError's bare exit status
                raise SystemExit(f"the {mode} worker of {case} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if mode == "keep" and not result["applied"]:
                raise SystemExit("keep_freed_memory() did not apply here (not glibc?)")
            samples[mode].append(result["median_s"])
    default, keep = (statistics.median(samples[m]) for m in MODES)
    return {
        "what": CASES[case],
        "default_s": default,
        "keep_s": keep,
        "speedup": default / keep,
        "rounds": {m: samples[m] for m in MODES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.steps)
        return
    results = {}
    for case in CASES:
        results[case] = measure(case, args.rounds, args.steps)
        r = results[case]
        print(f"{r['what']}: {r['default_s']:.3f} s → {r['keep_s']:.3f} s per step ({r['speedup']:.2f}×)")
    path = write_result("allocator", {"machine": machine(), "rounds": args.rounds, "steps": args.steps,
                                      "cases": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Fused ``scaled_dot_product_attention`` vs the explicit product, per dtype, sequence length and
mode (training: forward + backward; inference: forward without autograd), at DeiT-tiny's heads
(B 16, H 3, d 64): the measurements behind ``impl="auto"``.

Writes bench/results/attention_paths.json; ``--update-package`` also writes this CPU's entry (its
matrix-unit profile, ``neutreno.layers.functional.cpu_profile``) into the table ``impl="auto"``
reads, ``src/neutreno/layers/attention_paths.json``, keeping the other CPUs' entries.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch

from neutreno.layers import functional
from neutreno.layers.functional import (
    PATHS_TABLE,
    case_key,
    choose_softmax_impl,
    cpu_profile,
    softmax_attention,
)

from timing import interleaved_times, machine, write_result

LENGTHS = (17, 65, 197, 401, 577, 1025, 2049)
PACKAGE_TABLE = Path(__file__).resolve().parents[1] / "src" / "neutreno" / "layers" / PATHS_TABLE


def measure(dtype: torch.dtype, n: int, training: bool) -> dict:
    q, k, v = (torch.randn(16, 3, n, 64, dtype=dtype, requires_grad=training) for _ in range(3))

    def step(impl: str) -> None:
        if training:
            softmax_attention(q, k, v, impl=impl).sum().backward()
        else:
            with torch.no_grad():
                softmax_attention(q, k, v, impl=impl)

    long = n > 1000
    times = interleaved_times({i: (lambda i=i: step(i)) for i in ("fused", "explicit")}, 2 if long else 4,
                              1 if long else 3)  # fmt: skip
    fused, explicit = times["fused"]["median_s"], times["explicit"]["median_s"]
    speedup = fused / explicit
    return {"tokens": n, "fused_ms": fused * 1e3, "explicit_ms": explicit * 1e3, "explicit_speedup": speedup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--update-package", action="store_true", help="also write this CPU's entry into the package's table"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    profile = cpu_profile()
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        for training in (True, False):
            case = case_key(dtype, training)
            cases[case] = []
            for n in LENGTHS:
                run = measure(dtype, n, training)
                cases[case].append(run)
                print(f"{case:15} N={n:5d}  fused {run['fused_ms']:8.2f} ms  explicit "
                      f"{run['explicit_ms']:8.2f} ms  explicit speed-up {run['explicit_speedup']:5.2f}x",
                      flush=True)  # fmt: skip
    spec = machine()
    if args.update_package:
        table = json.loads(PACKAGE_TABLE.read_text())
        table["profiles"][profile] = {
            "measured_on": f"{spec['cpu']}, {spec['cpus']} cores, torch {spec['torch']}, "
            f"{datetime.date.today().isoformat()} (bench/attention_paths.py)",
            "cases": {
                case: [{key: run[key] for key in ("tokens", "explicit_speedup")} for run in runs]
                for case, runs in cases.items()
            },
        }
        tmp = PACKAGE_TABLE.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, PACKAGE_TABLE)
        functional.MEASURED_PATHS = functional.measured_paths()  # what auto picks from now on
        print(f"wrote the {profile!r} entry of {PACKAGE_TABLE}")
    for case, runs in cases.items():  # what impl="auto" picks now, from the package's table
        dtype, mode = case.split("/")
        for run in runs:
            run["auto_picks"] = choose_softmax_impl(torch.device("cpu"), getattr(torch, dtype), run["tokens"],
                                                    training=mode == "train")  # fmt: skip
        print(f"{case:15} auto picks: " + ", ".join(f"{r['tokens']}: {r['auto_picks']}" for r in runs))
    result = {"machine": spec, "profile": profile, "shape": "B16 H3 d64", "cases": cases}
    print(f"wrote {write_result('attention_paths', result)}")


if __name__ == "__main__":
    main()

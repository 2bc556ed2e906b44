"""Shared benchmark helpers: interleaved timing (so machine noise hits every variant alike),
matmul peak FLOP/s, and atomic result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def interleaved_times(
    steps: dict[str, Callable[[], None]], rounds: int, per_round: int, warmup: int = 2
) -> dict:
    """Run each callable ``per_round`` times per round, variants alternating within every round;
    return per-variant median and min seconds per call over the rounds."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))  # no variant always runs first
        for name in order:
            start = time.perf_counter()
            for _ in range(per_round):
                steps[name]()
            samples[name].append((time.perf_counter() - start) / per_round)
    return {
        n: {"median_s": statistics.median(s), "min_s": min(s), "rounds": len(s)} for n, s in samples.items()
    }


def matmul_flops_per_second(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """Best achieved FLOP/s of an n×n matmul in ``dtype`` on the CPU."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def machine() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def write_result(name: str, data: dict) -> Path:
    """Write ``bench/results/<name>.json`` atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path

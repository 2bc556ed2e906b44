"""Shared benchmark helpers: interleaved timing (so machine noise hits every variant alike) and the
machine's description, from the package (``neutreno bench efficiency`` uses them too), matmul peak
FLOP/s, and atomic result files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from neutreno.studies.efficiency import interleaved_times, machine  # noqa: F401 (re-exported)

RESULTS = Path(__file__).parent / "results"


def matmul_flops_per_second(
    dtype: torch.dtype, n: int = 2048, repeats: int = 10, device: torch.device | str = "cpu"
) -> float:
    """Best achieved FLOP/s of an n×n matmul in ``dtype`` on ``device`` (each timed to completion)."""
    device = torch.device(device)
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))

    def matmul() -> None:
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        matmul()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def write_result(name: str, data: dict) -> Path:
    """Write ``bench/results/<name>.json`` atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path

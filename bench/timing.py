"""Shared benchmark helpers: interleaved timing (so machine noise hits every variant alike) and the
machine's description, from the package (``neutreno bench efficiency`` uses them too), matmul peak
FLOP/s, Hugging Face's ViT as a baseline, and atomic result files."""

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


def hf_vit(width: int, heads: int, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Hugging Face ``ViTForImageClassification`` shaped as DeiT at ``width``/``heads`` (12 layers,
    224², patch 16, 1000 classes, random weights), called as ``model(images) -> logits`` like ours."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=width, num_hidden_layers=12, num_attention_heads=heads, intermediate_size=4 * width,
        image_size=224, patch_size=16, qkv_bias=True, layer_norm_eps=1e-6, num_labels=1000,
    )  # fmt: skip
    model = ViTForImageClassification._from_config(config, attn_implementation=attn_implementation)
    return _LogitsOnly(model)


class _LogitsOnly(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def write_result(name: str, data: dict) -> Path:
    """Write ``bench/results/<name>.json`` atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path

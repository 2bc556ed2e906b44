"""Shared benchmark helpers: interleaved timing (so machine noise hits every variant alike) and the
machine's description, from the package (``neutreno bench efficiency`` uses them too), matmul peak
FLOP/s, Hugging Face's ViT and timm's DeiT as baselines, and atomic result files."""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from neutreno.layers import attention as attention_layers
from neutreno.layers.neutreno import add_neutreno_term
from neutreno.studies.efficiency import interleaved_times, machine  # noqa: F401 (re-exported)

RESULTS = Path(__file__).parent / "results"
# `make bench` installs timm here (pip --no-deps --target): it is a baseline, not a dependency
TIMM_DIR = Path(__file__).resolve().parents[1] / "build" / "bench-timm"


def positive_int(text: str) -> int:
    """An argparse type for counts of rounds, steps and batches: 0 gave a median of nothing."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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


def timm_model(name: str) -> torch.nn.Module:
    """timm's ``create_model(name)`` (random weights) from :data:`TIMM_DIR` or the environment.

    timm imports torchvision at import time (for ``FrozenBatchNorm2d`` and its data transforms, which a
    ViT never runs), and torchvision has no CPU build for this machine's torch; where it cannot be
    imported, ``torchvision`` is a stand-in whose every name raises if it is used.

    Raises:
        ImportError: timm is not installed (``make bench`` installs it).
    """
    if TIMM_DIR.is_dir() and str(TIMM_DIR) not in sys.path:
        sys.path.append(str(TIMM_DIR))
    if importlib.util.find_spec("timm") is None:
        raise ImportError(f"timm is not installed (make bench puts it in {TIMM_DIR})")
    stand_in = None
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # absent, or a build for another torch (its native ops fail to register)
        print(f"timm gets a stand-in torchvision that refuses use: importing torchvision failed ({error})")
        stand_in = _UnusableTorchvision()
        _forget_torchvision()
        sys.meta_path.insert(0, stand_in)
    try:
        import timm
    finally:  # timm keeps what it imported; nothing imported later (transformers) finds the stand-in
        if stand_in is not None:
            sys.meta_path.remove(stand_in)
            _forget_torchvision()
    return timm.create_model(name, pretrained=False)


def _is_torchvision(module_name: str) -> bool:
    return module_name.split(".")[0] == "torchvision"


def _forget_torchvision() -> None:
    for module in [m for m in sys.modules if _is_torchvision(m)]:
        del sys.modules[module]


class _UnusableTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``torchvision`` and ``torchvision.*`` as modules whose every name is a class that raises
    when called, so that importing timm works and using torchvision through it fails loudly."""

    def find_spec(self, fullname, path, target=None):
        if _is_torchvision(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class _StandIn(type):
    def __getattr__(cls, name):  # enum members and nested names (InterpolationMode.BILINEAR)
        return _stand_in(cls, cls.__name__, name)

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__}: torchvision is not installed here")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        return _stand_in(self, self.__name__, name)


def _stand_in(owner: object, owner_name: str, name: str) -> type:
    """``owner.name`` as a :class:`_StandIn`, made once (the same object each time: a dict key)."""
    if name.startswith("__"):
        raise AttributeError(name)
    stand_in = _StandIn(f"{owner_name}.{name}", (), {})
    setattr(owner, name, stand_in)
    return stand_in


def _plain_projection(u, v, v0, lam, proj):
    return proj(add_neutreno_term(u, v, v0, lam))


def with_plain_projection(step):
    """``step`` run with NeuTRENO's W_O as a plain ``proj(u + λ(v0 − v))``, which keeps the sum for
    backward (the attention layers read ``neutreno_projection`` from their module at each call)."""

    def run():
        kept = attention_layers.neutreno_projection
        attention_layers.neutreno_projection = _plain_projection
        try:
            return step()
        finally:
            attention_layers.neutreno_projection = kept

    return run


def span(ratio: dict, digits: int = 3, unit: str = "") -> str:
    """``1.160 [1.126, 1.195]``: a :func:`time_ratio` result with its 95% interval (the ratio alone
    after a single round)."""
    if ratio["low"] is None:
        return f"{ratio['ratio']:.{digits}f}{unit}"
    return f"{ratio['ratio']:.{digits}f}{unit} [{ratio['low']:.{digits}f}, {ratio['high']:.{digits}f}]"


def write_result(name: str, data: dict) -> Path:
    """Write ``bench/results/<name>.json`` atomically, with the command and the commit it measured (a
    figure must name the code it timed: ``"+changes"`` where the work tree differed from that commit)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    from neutreno.io import write_json  # strict JSON: a non-finite number is null

    path = RESULTS / f"{name}.json"
    write_json(path, {**data, **provenance()})
    return path


def provenance() -> dict:
    """``{"command", "commit"}``: how a result file was made, and from which code."""
    return {"command": [Path(sys.argv[0]).name, *sys.argv[1:]], "commit": source_commit()}


def source_commit() -> str | None:
    """The checkout's commit, with ``+changes`` when tracked files under src/ or bench/ differ from it
    (the results folder aside); None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short=12", "HEAD").strip()
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", "src", "bench", ":!bench/results"
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if changed.strip() else "")

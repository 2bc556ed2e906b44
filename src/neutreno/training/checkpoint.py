"""Training checkpoints: one folder per save, made whole before it gets its name.

``<run>/checkpoints/step-000120/`` holds ``model.safetensors`` (weights + architecture, see
:func:`neutreno.models.save_model`), ``ema.safetensors`` when an EMA is kept, and ``state.pt``:
step, optimizer state, every rank's RNG states and counters, saved with plain tensors and
containers so it loads with ``torch.load(weights_only=True)`` (no code is unpickled).
The folder is written under a temporary name and renamed, then ``checkpoints/latest`` (a one-line
text file) is replaced atomically; a run killed at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from neutreno.io import atomic_path
from neutreno.models import save_model

LATEST = "latest"


def save_checkpoint(
    folder: Path,
    step: int,
    model: nn.Module,
    state: dict,
    *,
    ema: nn.Module | None = None,
    extra: dict | None = None,
    keep: int = 2,
) -> Path:
    """Write ``checkpoints/step-XXXXXX`` under ``folder``, point ``latest`` at it, keep the newest ``keep``.

    Args:
        model / ema: the (unwrapped) model and its EMA copy; weights go to safetensors files.
        state: plain data for ``state.pt`` (tensors, numbers, strings, lists, dicts).
        extra: JSON-able metadata stored in the weight files (e.g. preprocessing).
    """
    folder = Path(folder) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=f".{name}."))
    try:
        save_model(tmp / "model.safetensors", model, extra)
        if ema is not None:
            save_model(tmp / "ema.safetensors", ema, extra)
        torch.save(state, tmp / "state.pt")
        final = folder / name
        if final.exists():  # re-saving a step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with atomic_path(folder / LATEST) as pointer:
        pointer.write_text(name + "\n")
    saved = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in saved[: max(0, len(saved) - keep)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint folder ``run_dir/checkpoints/latest`` points at, or None if there is none."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    return folder if (folder / "state.pt").is_file() else None


def load_state(checkpoint: Path) -> dict:
    """``state.pt`` of a checkpoint folder, loaded without unpickling code."""
    return torch.load(Path(checkpoint) / "state.pt", map_location="cpu", weights_only=True)


def resolve_weights(path: str | Path) -> Path:
    """A weights file from a ``.safetensors`` path, a checkpoint folder, or a run folder (its latest)."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "model.safetensors").is_file():
        return path / "model.safetensors"
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is not None:
        return latest / "model.safetensors"
    raise FileNotFoundError(
        f"no checkpoint at {path} (give a .safetensors file, a checkpoint or a run folder)"
    )

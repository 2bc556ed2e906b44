"""Model weights as safetensors files that carry their architecture, so they load without code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from neutreno.io import atomic_path
from neutreno.models.registry import create_model


def save_model(path: str | os.PathLike, model: nn.Module, extra: dict | None = None) -> None:
    """Write ``model``'s weights to a safetensors file, atomically.

    The metadata holds ``model.model_spec`` (set by :func:`create_model`: registry name, attention, λ,
    constructor overrides) and any JSON-able ``extra`` (e.g. the preprocessing a model expects).
    """
    from safetensors.torch import save_file

    spec = getattr(model, "model_spec", None)
    if spec is None:
        raise ValueError("save_model needs a model built by neutreno.create_model (it has no model_spec)")
    lam = getattr(model.blocks[0].attn, "lam", None) if hasattr(model, "blocks") else spec["lam"]
    metadata = {
        "model": spec["model"],
        "attention": spec["attention"],
        "lam": json.dumps(lam),
        "args": json.dumps(spec["args"]),
        **{key: json.dumps(value) for key, value in (extra or {}).items()},
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)


def read_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a safetensors file written by :func:`save_model` (JSON values decoded)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    with safe_open(str(path), "pt") as f:
        raw = f.metadata() or {}
    if "model" not in raw:
        raise ValueError(f"{path} has no 'model' metadata: it was not written by neutreno")
    return {
        key: value if key in ("model", "attention") else _json_or_text(value) for key, value in raw.items()
    }


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_model(path: str | os.PathLike) -> tuple[nn.Module, dict]:
    """Rebuild the model a :func:`save_model` file describes and load its weights (strict).

    Returns:
        (model in eval mode, metadata).
    """
    from safetensors.torch import load_file

    meta = read_metadata(path)
    attention = meta.get("attention", "softmax")
    lam = meta.get("lam") if attention.endswith("neutreno") else None
    model = create_model(meta["model"], attention=attention, lam=lam, **meta.get("args", {}))
    model.load_state_dict(load_file(str(path)))
    return model.eval(), meta


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file, or of a PyTorch ``.pth``/``.pt``/``.bin`` file read with
    ``weights_only=True`` (no code is unpickled); DeiT's ``{"model": …}`` and ``{"state_dict": …}``
    wrappers are unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such weights file: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle and zip errors come in many types
        raise ValueError(f"cannot read {path} as PyTorch weights: {error}") from None
    for wrapper in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return state

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

from neutreno.io import atomic_path, failed_writes_named, finish_temp, fsync_path
from neutreno.models import save_model
from neutreno.progress import note

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

    Every file is flushed to disk before the folder is renamed, and the rename before ``latest`` points
    at it. (The trainer removes the temp folders of a save that was killed when it takes the run lock.)

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
        final = folder / name
        # at full λ: a λ warm-up's factor is the run's state, set again from the step on resume
        _write(tmp, final, "model.safetensors", lambda path: save_model(path, model, extra, full_lam=True))
        if ema is not None:
            _write(tmp, final, "ema.safetensors", lambda path: save_model(path, ema, extra, full_lam=True))
        # whether ema.safetensors belongs here: a checkpoint that lost it is refused, not resumed without
        state = {**state, "ema": ema is not None}
        _write(tmp, final, "state.pt", lambda path: torch.save(state, path))
        finish_temp(tmp / "state.pt")
        finish_temp(tmp, 0o777)  # mkdtemp makes it 0700
        if final.exists():  # re-saving a step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_path(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with atomic_path(folder / LATEST) as pointer:
        pointer.write_text(name + "\n")
    saved = checkpoints_by_step(folder)
    for old in saved[: max(0, len(saved) - keep)]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write(tmp: Path, final: Path, name: str, write) -> None:
    """``write(tmp / name)``, a failed write an OSError naming ``final / name`` (where the file was going)
    and the space left: safetensors and torch.save report a full disk as their own errors
    (SafetensorError, RuntimeError "unexpected pos"), which reached the user as a traceback that did
    not say what was wrong. Any other error (a state that cannot be saved) is not the disk's: it passes."""
    with failed_writes_named(final / name):
        write(tmp / name)


def checkpoints_by_step(folder: Path) -> list[Path]:
    """The ``step-N`` checkpoint folders by N (their names sort as text only up to 6 digits)."""
    steps = [p for p in folder.glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def _candidates(run_dir: Path) -> list[Path]:
    """Checkpoint folders to try, best first: the one ``latest`` names, then every ``step-*``, newest
    first (so an emptied or damaged pointer does not hide valid checkpoints)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    steps = checkpoints_by_step(folder)[::-1]
    pointer = folder / LATEST
    try:
        named = pointer.read_text().strip() if pointer.is_file() else ""
    except (OSError, UnicodeDecodeError):
        named = ""
    first = [folder / named] if named.startswith("step-") and (folder / named).is_dir() else []
    return first + [p for p in steps if p not in first]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder of a run (``checkpoints/latest``, else the newest ``step-*``) that
    holds its files, or None if there is none. :func:`resume_checkpoint` also checks they load."""
    for folder in _candidates(run_dir):
        if (folder / "state.pt").is_file() and (folder / "model.safetensors").is_file():
            return folder
    return None


def checkpoint_problem(folder: Path, trainer_state: bool = False) -> str | None:
    """Why a checkpoint folder cannot be resumed from (a missing, truncated or unreadable file, or one
    holding a NaN or an infinity: weights, EMA or optimizer state), or None. ``trainer_state``: the
    state is the trainer's, which a resume reads: its step, process count, RNG states and optimizer
    state must be there (a :func:`save_checkpoint` of one's own may keep other things)."""
    from neutreno.models.checkpoint import load_safetensors, nonfinite_names, safetensors_metadata

    if not (folder / "model.safetensors").is_file():
        return f"{folder / 'model.safetensors'} is missing"
    try:
        for name in ("model.safetensors", "ema.safetensors"):
            if (folder / name).is_file():
                safetensors_metadata(folder / name)  # reads the header: a truncated file fails here
                bad = nonfinite_names(load_safetensors(folder / name).items())
                if bad:  # the run never saves these (it stops first), so the file was changed since
                    return f"{folder / name} holds non-finite weights ({', '.join(bad[:3])})"
    except (ValueError, OSError) as error:  # OSError: unreadable (a permission)
        return str(error)
    try:
        state = load_state(folder)
    except Exception as error:
        return f"{folder / 'state.pt'} is damaged or missing ({str(error).splitlines()[0][:200]})"
    if not isinstance(state, dict):
        return f"{folder / 'state.pt'} is damaged (not a dict)"
    lacks = _state_problem(state) if trainer_state else None
    if lacks:  # read unchecked on resume: a KeyError traceback, or Adam restarted from zero moments
        return f"{folder / 'state.pt'} is damaged ({lacks})"
    bad = nonfinite_optimizer_state(state.get("optimizer"))
    if bad:  # never saved either: resumed, Adam would never move those weights again (or turn them NaN)
        return f"{folder / 'state.pt'} holds non-finite optimizer state ({', '.join(bad[:3])})"
    if "ema" in state:
        keeps_ema, why = bool(state["ema"]), "the checkpoint was saved with an EMA"
    else:  # saved before state.pt said so: the run's config does
        trained = state.get("config", {})
        ema_decay = (trained.get("train") or {}).get("ema_decay") if isinstance(trained, dict) else None
        keeps_ema, why = bool(ema_decay), f"the run keeps an EMA, train.ema_decay {ema_decay}"
    if keeps_ema and not (folder / "ema.safetensors").is_file():  # saved beside the model, or not at all
        return f"{folder / 'ema.safetensors'} is missing ({why})"
    return None


def _state_problem(state: dict) -> str | None:
    """What a training state lacks that a resume reads: the step, the process count, one RNG state per
    process and the optimizer's state and groups (Adam's moments, once it has stepped); None if nothing."""
    step, processes, rng, optimizer = (state.get(k) for k in ("step", "world_size", "rng", "optimizer"))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step {step!r}, not a count"
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        return f"world_size {processes!r}, not a process count"
    if not isinstance(rng, (list, tuple)) or len(rng) != processes:
        return f"no random-number state for each of its {processes} process(es)"
    if not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("state"), dict)
        and isinstance(optimizer.get("param_groups"), list)
        and optimizer["param_groups"]
    ):
        return "no optimizer state and parameter groups"
    adam = any(isinstance(group, dict) and "betas" in group for group in optimizer["param_groups"])
    if adam and step > 0 and not optimizer["state"]:
        return f"an Adam optimizer at step {step} with no moments"
    return None


def nonfinite_optimizer_state(optimizer_state: object) -> list[str]:
    """What in an optimizer's ``state_dict()`` holds a NaN or an infinity, as ``param I NAME``
    (``param 0 exp_avg_sq``); [] for finite state, or for anything that is not such a dict."""
    from neutreno.models.checkpoint import nonfinite_names

    if not isinstance(optimizer_state, dict) or not isinstance(optimizer_state.get("state"), dict):
        return []
    return nonfinite_names(
        (f"param {index} {name}", value)
        for index, per_param in optimizer_state["state"].items()
        if isinstance(per_param, dict)
        for name, value in per_param.items()
        if isinstance(value, torch.Tensor)
    )


def resume_checkpoint(run_dir: Path, trainer_state: bool = True) -> Path | None:
    """The newest checkpoint of a run that loads (:func:`checkpoint_problem`, of a trainer's state unless
    ``trainer_state`` is False); a damaged newer one is skipped with a warning naming it. None when the
    run has no checkpoint folder at all.

    Raises:
        ValueError: the run has checkpoint folders, but none of them loads.
    """
    candidates = _candidates(run_dir)
    problems = []
    for folder in candidates:
        problem = checkpoint_problem(folder, trainer_state)
        if problem is None:
            for skipped in problems:
                note(f"warning: skipping a damaged checkpoint: {skipped}; resuming from {folder.name}")
            return folder
        problems.append(problem)
    if problems:
        raise ValueError(f"no checkpoint of {run_dir} can be resumed: {'; '.join(problems)}")
    return None


def load_state(checkpoint: Path) -> dict:
    """``state.pt`` of a checkpoint folder, loaded without unpickling code."""
    return torch.load(Path(checkpoint) / "state.pt", map_location="cpu", weights_only=True)


def resolve_weights(path: str | Path) -> Path:
    """A weights file from a ``.safetensors`` path, a checkpoint folder, or a run folder (its latest; its
    ``checkpoints`` folder or ``checkpoints/latest`` pointer name the same, which were refused as "no
    checkpoint" or read as weights)."""
    path = Path(path)
    if path.name == "latest" and path.parent.name == "checkpoints" and path.is_file():
        path = path.parent
    if path.name == "checkpoints" and path.is_dir() and not (path / "model.safetensors").is_file():
        path = path.parent
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


def lam_warmup_note(weights: Path) -> str | None:
    """What to say of weights a run saved inside its λ warm-up (``train.lam_warmup_steps``): it scored
    them at a fraction of λ, and the file, which holds weights only, loads at full λ, so a tool that
    scores it (eval, analyze) gives other numbers than the run's log. None for anything else."""
    import json

    folder = Path(weights).parent
    if folder.parent.name != "checkpoints" or not folder.name.startswith("step-"):
        return None
    try:
        step = int(folder.name.removeprefix("step-"))
        config = json.loads((folder.parent.parent / "config.json").read_text())
        warmup = config["train"]["lam_warmup_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(warmup, int) or not 0 < step < warmup:
        return None
    return (
        f"note: {folder} was saved at step {step} of a {warmup}-step λ warm-up: its run scored it at a "
        "fraction of λ (results.json's lam_scale); it is scored here at full λ, as the file loads"
    )

"""Model weights as safetensors files that carry their architecture, so they load without code."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import reprlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from neutreno.config import ConfigError, check_normalization
from neutreno.io import atomic_path
from neutreno.layers.attention import attention_class, upgrade_attention_keys
from neutreno.layers.neutreno import HF_LEARNED_LAM
from neutreno.models.registry import create_model, family_describer, model_family


def save_model(
    path: str | os.PathLike, model: nn.Module, extra: dict | None = None, *, full_lam: bool = False
) -> None:
    """Write ``model``'s weights to a safetensors file, atomically.

    The metadata holds ``model.model_spec`` (set by :func:`create_model`: registry name, attention, λ
    as the layers run it, constructor overrides) and any JSON-able ``extra`` (e.g. the preprocessing a
    model expects). A λ that differs by layer, or a λ schedule's factor (``lam_scale``) on, is refused
    (:func:`model_lam`); ``full_lam``: record λ without that factor (a training checkpoint's, which
    reloads at full λ).
    """
    from safetensors.torch import save_file

    if isinstance(path, nn.Module):  # safetensors' save_model(model, filename) order
        raise TypeError("save_model takes the file first: save_model(path, model)")
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its keys gain "_orig_mod."
    if getattr(model, "model_spec", None) is None:
        raise ValueError("save_model needs a model built by neutreno.create_model (it has no model_spec)")
    spec = running_spec(model, full_lam)
    metadata = {
        "model": spec["model"],
        "attention": spec["attention"],
        "lam": json.dumps(spec["lam"]),
        "args": json.dumps(spec["args"]),
        **{key: json.dumps(value) for key, value in (extra or {}).items()},
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)


def load_safetensors(path: str | os.PathLike, device: str = "cpu") -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file; ValueError naming the file when it is damaged
    (truncated, not safetensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such weights file: {path}")
    _check_readable(path)
    try:
        return load_file(str(path), device=device)
    except Exception as error:  # SafetensorError, OSError, … : the file, not the code, is at fault
        raise ValueError(f"{path} is damaged or not a safetensors file ({_first_line(error)})") from None


def safetensors_metadata(path: Path) -> dict:
    """The raw metadata of a safetensors file (its header only); ValueError naming a damaged file."""
    from safetensors import safe_open

    _check_readable(path)
    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception as error:
        raise ValueError(f"{path} is damaged or not a safetensors file ({_first_line(error)})") from None


def _check_readable(path: Path) -> None:
    """Raise the system's OSError (a permission, a lost mount) for a file that cannot be opened:
    safetensors reported an unreadable file as one that is not there, which was then called damaged."""
    with open(path, "rb"):
        pass


def _torch_load_cause(error: BaseException) -> str:
    """What went wrong in ``torch.load(weights_only=True)``, in one line (its message is a page)."""
    text = str(error)
    refused = " (not a plain state dict; files that need code to load are refused)"
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0].strip()
        return detail + refused
    if text.startswith("Weights only load failed"):
        # its first line advises weights_only=False, running the file's code; the cause is further down
        causes = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        detail = next((c for c in causes if "GLOBAL" in c or "Unsupported" in c), causes[0] if causes else "")
        return (detail or "it holds objects other than tensors") + refused
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# parts of parameter names a softmax model has none of (a learned λ, FeatScale, AttnScale): each starts
# where it leaves the model as it was, at λ or at the identity
ADDED_PARTS = (".learned_lam.", f".{HF_LEARNED_LAM}.", ".featscale.", ".attnscale.")


def is_addition(key: str) -> bool:
    """Whether a state-dict key is one of the parameters a softmax model lacks by design (a learned λ,
    FeatScale, AttnScale: :data:`ADDED_PARTS`)."""
    return any(part in f".{key}" for part in ADDED_PARTS)


def additions_missing(source: str, model_name: str, keys: str) -> ValueError:
    """The error for weights holding a learned λ, FeatScale or AttnScale (``keys``, shown) that the model
    has none of."""
    return ValueError(
        f"{source} holds a learned λ, FeatScale or AttnScale that this {model_name} has none of ({keys}): "
        "build the model with them (learn_lam, featscale, attnscale)"
    )


def fresh_additions(own: Iterable[str], given: Iterable[str]) -> set[str]:
    """The keys of ``own`` of each added kind (:data:`ADDED_PARTS`) that ``given`` has none of: softmax
    weights into a model with a learned λ, say (the paper's adaptation). Some of a kind but not all is
    another model's file, not these."""
    own, given = set(own), set(given)
    fresh: set[str] = set()
    for part in ADDED_PARTS:
        added = {k for k in own if part in k}
        fresh |= added if not added & given else set()
    return fresh


def load_state_dict_checked(
    model: nn.Module, state: dict[str, Tensor], source: str | os.PathLike, *, start_additions: bool = False
) -> list[str]:
    """``model.load_state_dict(state)`` (strict), with an error that summarises a mismatch in a few
    lines naming ``source`` instead of listing every key. With ``start_additions`` (fine-tuning, never
    a resume) a learned λ, FeatScale or AttnScale the file has none of starts at λ or the identity.

    Returns:
        The keys left at their initial values (those additions), or []."""
    state = upgrade_attention_keys(dict(state))
    own = model.state_dict()
    fresh = check_fits(model, state, source, start_additions=start_additions)
    refuse_other_kinds(own, state, source)
    model.load_state_dict(state, strict=not fresh)
    refuse_nonfinite(model.named_parameters(), source)
    return sorted(fresh)


def check_fits(
    model: nn.Module, state: dict[str, Tensor], source: str | os.PathLike, *, start_additions: bool = False
) -> set[str]:
    """Raise the few-line ValueError of :func:`load_state_dict_checked` unless ``state``'s keys and
    shapes are ``model``'s (its additions aside, with ``start_additions``); the additions it leaves fresh.
    Shapes only: ``state`` and ``model`` may be meta tensors."""
    state = upgrade_attention_keys(dict(state))
    own = model.state_dict()
    fresh = fresh_additions(own, state) if start_additions else set()
    missing = [k for k in own if k not in state and k not in fresh]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shapes:

        def few(keys: list[str]) -> str:
            return ", ".join(keys[:3]) + (f", … ({len(keys)} in all)" if len(keys) > 3 else "")

        if unexpected and not missing and not shapes and all(is_addition(k) for k in unexpected):
            # a learned-λ run into a fixed-λ model: 5 unexpected keys said not why
            raise additions_missing(source, type(model).__name__, few(unexpected))
        parts = [
            f"{len(missing)} missing ({few(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({few(unexpected)})" if unexpected else "",
            f"{len(shapes)} of another shape ({few(shapes)})" if shapes else "",
        ]
        raise ValueError(
            f"{source} does not fit a {type(model).__name__} of this architecture: "
            + "; ".join(p for p in parts if p)
        )
    return fresh


def _kind(t: Tensor) -> str:
    if t.is_floating_point() and t.element_size() == 1:  # fp8: quantized, read only with its scales
        return f"{t.dtype} (8-bit floats, quantized)"
    return "complex" if t.is_complex() else "floating-point" if t.is_floating_point() else str(t.dtype)


def refuse_other_kinds(own: dict[str, Tensor], state: dict[str, Tensor], source: str | os.PathLike) -> None:
    """Raise a ValueError naming ``source`` where a tensor of ``state`` is of another kind than the
    model's (``own``): ``load_state_dict`` casts silently, so float weights stored as integers loaded
    as mostly zeros and scored like chance, and 8-bit floats are quantized weights whose scales live in
    other tensors. Another float precision (fp16, bf16, fp64) loads as usual."""
    bad = [k for k in own if k in state and _kind(own[k]) != _kind(state[k])]
    if bad:
        listed = ", ".join(f"{k} ({_kind(state[k])}, {_kind(own[k])} here)" for k in bad[:3])
        more = f", … ({len(bad)} in all)" if len(bad) > 3 else ""
        raise ValueError(f"{source} holds tensors of another kind than the model's: {listed}{more}")


def nonfinite_names(tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity."""
    # fp8 has no isfinite kernel: widened, its NaN and infinities stay what they are
    return [
        name
        for name, t in tensors
        if t.is_floating_point() and not bool(torch.isfinite(t if t.element_size() > 1 else t.float()).all())
    ]


def refuse_nonfinite(tensors: Iterable[tuple[str, Tensor]], source: str | os.PathLike) -> None:
    """Raise a ValueError naming ``source`` and the first tensors that hold a NaN or an infinity: weights
    from a diverged or damaged run, which would evaluate, fine-tune or resume into NaN."""
    bad = nonfinite_names(tensors)
    if bad:
        listed = ", ".join(bad[:3]) + (f", … ({len(bad)} in all)" if len(bad) > 3 else "")
        raise ValueError(f"{source} holds non-finite weights ({listed}): a diverged or damaged checkpoint")


def checkpoint_kind(meta: dict) -> str:
    """What a checkpoint of ``neutreno train`` holds, from its :func:`read_metadata`: ``"segmenter"``,
    ``"language model"``, ``"text classifier"`` (a Hugging Face encoder's, ``model`` ``hf:…``) or
    ``"classifier"`` (of images)."""
    if "segmentation" in meta:
        return "segmenter"
    if "tokenizer" in meta:
        return "language model"
    return "text classifier" if str(meta.get("model", "")).startswith("hf:") else "classifier"


def metadata_differs(path: str | os.PathLike, ours: dict, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` whose value ``path``'s metadata records otherwise than ``ours`` (as JSON: tuples are
    lists there); a key either side lacks is not compared."""
    saved = read_metadata(path)
    return [k for k in keys if k in saved and k in ours and json.loads(json.dumps(ours[k])) != saved[k]]


def read_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a safetensors file written by :func:`save_model` (JSON values decoded)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such checkpoint: {path}")
    if path.suffix != ".safetensors":
        raise ValueError(
            f"{path} is not a neutreno checkpoint (.safetensors); a timm/DeiT .pth loads into a model with "
            "neutreno.models.load_pretrained, or as train.finetune"
        )
    raw = safetensors_metadata(path)
    if "model" not in raw:
        raise ValueError(f"{path} has no 'model' metadata: it was not written by neutreno")
    meta = {
        key: value if key in ("model", "attention") else _json_or_text(value) for key, value in raw.items()
    }
    if "preprocess" in meta:
        _check_preprocess(meta["preprocess"], path)
    return meta


PREPROCESS_KEYS = ("image_size", "crop_pct", "channels", "mean", "std")


def _check_preprocess(preprocess: object, path: Path) -> None:
    """An image classifier's recorded preprocessing must be what training's config allows
    (``ImageDataConfig``): a hand-edited or damaged one scored images otherwise normalised (one mean for
    three channels broadcast silently; a std of 0 gave inf) or failed with a KeyError traceback."""

    def refuse(what: str) -> None:
        raise ValueError(f"{path}: its preprocess metadata {what}")

    if not isinstance(preprocess, dict):
        refuse(f"is not a mapping: {reprlib.repr(preprocess)}")
    missing = [key for key in PREPROCESS_KEYS if key not in preprocess]
    if missing:
        refuse(f"lacks {', '.join(missing)}")
    size, crop, channels = preprocess["image_size"], preprocess["crop_pct"], preprocess["channels"]
    if not _is_int(size) or size < 1:
        refuse(f"image_size must be an integer >= 1, got {reprlib.repr(size)}")
    if not _is_number(crop) or not 0 < crop <= 1 or size / crop > 65535:
        refuse(f"crop_pct must be in (0, 1] (resizing to at most 65,535 px), got {reprlib.repr(crop)}")
    if not _is_int(channels) or channels not in (1, 3):
        refuse(f"channels must be 1 or 3, got {reprlib.repr(channels)}")
    for key in ("mean", "std"):
        values = preprocess[key]
        if not isinstance(values, list) or not all(_is_number(v) for v in values):
            refuse(f"{key} must be {channels} fractions of 255, got {reprlib.repr(values)}")
    try:  # as the config's data.mean and data.std are checked
        check_normalization(tuple(preprocess["mean"]), tuple(preprocess["std"]), channels)
    except ConfigError as error:
        refuse(str(error))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (a crafted file's 100,000 nested "[" gave a traceback)
        return text


def load_model(path: str | os.PathLike) -> tuple[nn.Module, dict]:
    """Rebuild the model a :func:`save_model` file describes and load its weights (strict).

    Returns:
        (model in eval mode, metadata).
    """
    meta = read_metadata(path)
    # the architecture on the meta device first, its shapes against the file's header: metadata naming
    # a model of other sizes (hand-made, or of a huge one) is refused before its memory is allocated
    try:
        with torch.device("meta"):
            skeleton = _build_saved(path, meta)
    except (NotImplementedError, RuntimeError):  # a builder that cannot run on meta: the load checks alone
        skeleton = None
    if skeleton is not None:
        check_fits(skeleton, _header_tensors(path), path)
    model = _build_saved(path, meta)
    load_state_dict_checked(model, load_safetensors(path), path)
    _record_preprocess(model, meta.get("preprocess"))
    return model.eval(), meta


def _record_preprocess(model: nn.Module, preprocess: dict | None) -> None:
    """The input the file says the model was trained on, in its timm ``pretrained_cfg`` (which timm's
    ``resolve_data_config`` builds its transforms from): the registry preset's normalisation and crop
    stood there instead (a CIFAR-10 mean on a model trained with ImageNet's)."""
    cfg = getattr(model, "pretrained_cfg", None)
    if preprocess is None or not isinstance(cfg, dict):
        return
    size = preprocess["image_size"]
    model.pretrained_cfg = {
        **cfg,
        "input_size": (preprocess["channels"], size, size),
        "mean": tuple(preprocess["mean"]),
        "std": tuple(preprocess["std"]),
        "crop_pct": preprocess["crop_pct"],
    }


def _header_tensors(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a safetensors file as meta tensors of their shapes and dtypes (its header only)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
            return {
                key: torch.empty(s.get_shape(), dtype=_dtype(s), device="meta") for key, s in slices.items()
            }
    except Exception as error:
        raise ValueError(f"{path} is damaged or not a safetensors file ({_first_line(error)})") from None


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def _dtype(tensor_slice) -> torch.dtype:
    return _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype(), torch.float32)


def _build_saved(path: str | os.PathLike, meta: dict) -> nn.Module:
    """The model a file's metadata describes (registry name, attention, λ, constructor arguments),
    with its initial weights; ValueError naming the file when the metadata cannot describe one."""
    attention, args = meta.get("attention", "softmax"), meta.get("args") or {}
    if not isinstance(args, dict):
        raise ValueError(
            f"{path}: its 'args' metadata is not a mapping of model arguments: {reprlib.repr(args)}"
        )
    repeated = sorted({"attention", "lam"} & set(args))
    if repeated:
        raise ValueError(f"{path}: its 'args' metadata repeats {', '.join(repeated)}")
    lam = meta.get("lam") if attention.endswith("neutreno") else None
    build = model_family(meta["model"])  # e.g. "hf:…", a Hugging Face classifier fine-tuned by neutreno
    try:
        if build is not None:
            return build(meta["model"], args, attention, lam)
        return create_model(meta["model"], attention=attention, lam=lam, **args)
    except (TypeError, ValueError) as error:  # an unknown model, an argument it does not take
        raise ValueError(f"{path}: its metadata does not describe a model ({error})") from None


def read_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file, or of a PyTorch ``.pth``/``.pt``/``.bin`` file read with
    ``weights_only=True`` (no code is unpickled); DeiT's ``{"model": …}`` and timm's ``{"state_dict": …}``
    wrappers are unwrapped (of a training checkpoint, the model's weights, not its EMA's, as DeiT's
    ``--finetune`` takes them), and the ``module.`` prefix DistributedDataParallel puts on every key and
    ``torch.compile``'s ``_orig_mod.`` are taken off (timm's ``clean_state_dict``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such weights file: {path}")
    if path.suffix == ".safetensors":
        return _without_ddp_prefix(load_safetensors(path))
    if path.suffix == ".npz":  # torch.load's own message was an internal assertion
        raise ValueError(
            f"{path} is a JAX/NumPy .npz checkpoint (timm's augreg weights): load it in timm and save it as "
            ".safetensors, which loads here"
        )
    with open(path, "rb") as file:
        head = file.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip, or its older pickle
        # (torch.load of a YAML file said "pop from empty list")
        raise ValueError(f"{path} is not a weights file (.safetensors, or PyTorch's .pth/.pt/.bin)")
    try:
        # DeiT's and timm's training checkpoints keep their command line as an argparse.Namespace beside
        # the weights (as timm's own loader does, that one class is allowed; still no code is run)
        allowing = getattr(torch.serialization, "safe_globals", None)  # (torch >= 2.5)
        with allowing([argparse.Namespace]) if allowing else contextlib.nullcontext():
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle and zip errors come in many types
        raise ValueError(f"cannot read {path} as PyTorch weights: {_torch_load_cause(error)}") from error
    for wrapper in ("model", "state_dict"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return _without_ddp_prefix(state)


def _without_ddp_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with the prefix of a DDP-wrapped model's keys (``module.``) or a compiled one's
    (``_orig_mod.``) taken off, each where every key has it, in either order."""
    for _ in range(2):
        for prefix in ("module.", "_orig_mod."):
            if state and all(isinstance(k, str) and k.startswith(prefix) for k in state):
                state = {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def load_pretrained(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Load a timm/DeiT ``VisionTransformer`` checkpoint (or one of ours) into ``model``.

    Reads ``.safetensors``, or ``.pth`` — a plain state dict or DeiT's ``{"model": …}`` — with
    ``weights_only=True``. Strict: missing, unexpected and wrong-shape keys are listed in the error;
    ``pos_embed`` is resampled when the patch grid differs, and the head is left as initialised when
    the class count differs (:func:`~neutreno.models.vision_transformer.load_vit_weights`). NeuTRENO
    adds no parameters, so softmax weights load into a NeuTRENO model unchanged; a learned λ, FeatScale
    or AttnScale that the file has none of starts at λ or the identity.

    A neutreno checkpoint records its model: one of another head count, or whose weights this model
    would read as another function (another attention class, eigen_pos for eigen_neg, another
    residual_scale), is refused; softmax and NeuTRENO at any λ load into each other.

    Returns:
        The keys left at their initial values (a head of another class count or none in the file; the
        additions above), or [].
    Raises:
        ValueError: a distilled DeiT, a model that is not one of our ViTs, weights that do not fit, a
            checkpoint of another model (above), or metadata that describes no model.
    """
    from neutreno.models.vision_transformer import VisionTransformer, load_vit_weights

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"load_pretrained loads ViT weights; got a {type(model).__name__}")
    try:
        state = read_state_dict(path)
    except ValueError:
        raise  # it names the file, and keeps its cause
    refuse_nonfinite(state.items(), path)
    refuse_other_kinds(model.state_dict(), state, path)
    refuse_another_model(model, path)
    try:
        return load_vit_weights(model, state)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def refuse_another_model(model: nn.Module, path: str | os.PathLike) -> None:
    """A neutreno checkpoint records its model. Weights of the same shapes can mean something else here:
    another head count splits qkv into heads otherwise, and another attention function (kernel for
    softmax) reads the same qkv and proj differently. NeuTRENO with any λ and softmax are one function
    of the weights (the term has no parameters): they load into each other. Every transformer block is
    compared in order (a ViT's; a Segmenter's encoder and decoder; a language model's). A file that
    records nothing (timm's, DeiT's) holds timm's blocks: softmax attention, pre-norm, residual unscaled
    (its head count is the user's to match)."""
    path = Path(path)
    if path.suffix != ".safetensors" or "model" not in safetensors_metadata(path):
        for i, block in enumerate(_blocks(model)):
            differs = not_timms_block(block)
            if differs:
                raise ValueError(
                    f"{path} records no model, so it holds timm's or DeiT's blocks (softmax attention, "
                    f"pre-norm); this model's block {i} has {', '.join(differs)}, which reads the same "
                    "weights as another function (save weights with neutreno.models.save_model to record "
                    "their model)"
                )
        return
    meta = read_metadata(path)
    if model_family(meta["model"]) is not None:  # a Hugging Face model: no ViT's weights
        return
    saved = _build_saved(path, meta)  # with its registry defaults and overrides
    saved_blocks, blocks = _blocks(saved), _blocks(model)
    if not saved_blocks or not blocks or len(saved_blocks) != len(blocks):
        return  # another kind of model or depth: the key and shape checks decide
    heads = [getattr(m, "num_heads", None) for m in (saved_blocks[0].attn, blocks[0].attn)]
    if None not in heads and heads[0] != heads[1]:
        raise ValueError(f"{path} was trained with {heads[0]} attention heads, this model has {heads[1]}")
    for i, (theirs, ours) in enumerate(zip(saved_blocks, blocks, strict=True)):
        if _block_function(theirs) != _block_function(ours):
            raise ValueError(
                f"{path} holds weights of {_describe(theirs)} (block {i}); this model has {_describe(ours)}, "
                "which reads the same weights as another function"
            )


def running_spec(model: nn.Module, full_lam: bool = False) -> dict:
    """``model.model_spec`` (registry name, attention, λ, constructor arguments) of what the model
    computes now, which a file records: the λ its layers run (:func:`model_lam`); for a Hugging Face
    model, whether it is patched, at which λ, learned or not (patched or unpatched since it was built,
    its spec said what it no longer computes)."""
    spec = model.model_spec
    describe = family_describer(spec["model"])
    if describe is not None:
        return describe(model, spec)
    return {**spec, "lam": model_lam(model, full_lam)}


def model_lam(model: nn.Module, full_lam: bool = False) -> float | None:
    """The λ a built model's layers run, which the file records: a λ set on the layers after
    ``create_model`` is the one the model computes with. Read from the blocks that add the term (each
    stack's first has none, math.md §2), the one λ they share.

    Raises:
        ValueError: λ differs between those layers (one λ is recorded: the file would reload another
            model), or a λ schedule's factor (``lam_scale`` ≠ 1) is on unless ``full_lam`` (a training
            checkpoint, whose run keeps the factor as its state and reloads at full λ).
    """
    blocks = _blocks(model)
    if not blocks:
        return model.model_spec["lam"]
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and any(b in blocks for b in m)]
    adding = [b for stack in stacks for b in list(stack)[1:] if b in blocks] or blocks[:1]
    lams = [getattr(b.attn, "lam", None) for b in adding]
    if len(set(lams)) > 1:
        raise ValueError(
            f"λ differs between the layers that add NeuTRENO's term ({lams}): a file records one λ, and "
            "would reload every layer at the first"
        )
    scales = {getattr(b.attn, "lam_scale", 1.0) for b in adding}
    if not full_lam and lams[0] and scales != {1.0}:
        raise ValueError(
            f"the model runs λ × {sorted(scales)[0]:g} (a λ schedule's factor, lam_scale): "
            "set_lam_scale(model, 1.0) before saving, or the file would reload it at another λ"
        )
    return lams[0]


def _blocks(model: nn.Module) -> list[nn.Module]:
    from neutreno.layers import Block

    return [m for m in model.modules() if isinstance(m, Block)]


def _block_function(block: nn.Module) -> tuple:
    """What a block computes from its weights, NeuTRENO's λ aside (it has no weights): the attention's
    class, the sign of a spectral attention's H (eigen_neg or eigen_pos: a constructor setting, not a
    weight) and the residual branches' factor."""
    attn = block.attn
    sign = getattr(getattr(attn, "value_output", None), "sign", None)
    return attention_class(getattr(attn, "attention", "softmax")), sign, getattr(block, "residual_scale", 1.0)


def not_timms_block(block: nn.Module) -> list[str]:
    """How ``block`` computes otherwise than timm's ViT block from the same weights (pre-norm, residual
    added unscaled, softmax attention), NeuTRENO's term aside (it has no weights); [] when alike."""
    kind = attention_class(getattr(block.attn, "attention", "softmax"))
    return [
        *([f"{block.attn.attention} attention"] if kind is not attention_class("softmax") else []),
        *([f"residual_scale {block.residual_scale:g}"] if getattr(block, "residual_scale", 1) != 1 else []),
        *([f"block_norm {block.norm!r}"] if getattr(block, "norm", "pre") != "pre" else []),
    ]


def _describe(block: nn.Module) -> str:
    scale = getattr(block, "residual_scale", 1.0)
    return f"{getattr(block.attn, 'attention', 'softmax')} attention" + (
        f", residual_scale {scale:g}" if scale != 1 else ""
    )


# Parameters timm's VisionTransformer has no place for (FeatScale/AttnScale gains; the symmetric
# variants' kv and the spectral variants' qk and value_output replace qkv and proj; a learned λ).
_NOT_TIMM = (".featscale.", ".attnscale.", ".attn.kv.", ".attn.qk.", ".value_output.", ".learned_lam.")


def export_timm(model: nn.Module, path: str | os.PathLike, *, as_softmax: bool = False) -> None:
    """Write a ViT's weights as a timm ``VisionTransformer`` state dict, atomically: ``.safetensors``
    (no metadata), or ``.pth`` (``torch.save`` of the plain dict). timm loads it with
    ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay={"file": path})``. A head
    of other than 1000 classes needs ``"num_classes": K`` inside that overlay: timm's
    ``num_classes=K`` argument alone drops the file's head and keeps a fresh one, silently.

    timm runs every model as softmax attention: NeuTRENO's λ(V⁰ − V) has no weights, so a NeuTRENO
    model with λ ≠ 0 would predict otherwise there. It is refused unless ``as_softmax=True`` says that
    is meant (its weights as a starting point for softmax fine-tuning, say); a learned λ is then left
    out with the term.

    Raises:
        ValueError: not one of our ViTs, parameters timm's ViT has no place for (named), or blocks timm
            would run as another function (kernel attention, residual_scale ≠ 1,
            block_norm other than "pre", NeuTRENO's term without ``as_softmax``).
    """
    from neutreno.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"export_timm writes ViT weights; got a {type(model).__name__}")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if as_softmax:  # the term is dropped, and a learned λ with it
        state = {k: v for k, v in state.items() if ".learned_lam." not in k}
    foreign = [k for k in state if any(part in k for part in _NOT_TIMM)]
    if foreign:
        raise ValueError(
            f"timm's VisionTransformer has no place for {foreign[:4]} (FeatScale, AttnScale, kv, learned λ)"
        )
    # weights timm would load and run as another function: its blocks are pre-norm, add the residual
    # unscaled and attend by softmax (NeuTRENO's term aside, which has no weights)
    for i, block in enumerate(model.blocks):
        lam = getattr(block.attn, "lam", 0) if i else 0  # the first layer has no term
        differs = not_timms_block(block)
        if lam and not as_softmax:
            differs.append(f"NeuTRENO's term (λ {lam:g}; as_softmax=True exports it anyway)")
        if differs:
            raise ValueError(
                f"timm's VisionTransformer would run these weights as another model: block {i} has "
                f"{', '.join(differs)} (timm's: softmax attention, residual_scale 1, block_norm 'pre')"
            )
    path = Path(path)
    if path.suffix not in (".safetensors", ".pth", ".pt", ".bin"):
        raise ValueError(f"export_timm writes .safetensors or .pth files, not {path.name!r}")
    with atomic_path(path) as tmp:
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(tmp))
        else:
            torch.save(state, tmp)

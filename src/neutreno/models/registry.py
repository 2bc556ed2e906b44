"""timm-style model registry: ``@register_model`` factories and ``create_model(name, ...)``."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from torch import nn

_MODEL_FACTORIES: dict[str, Callable[..., nn.Module]] = {}


def register_model(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register ``factory`` under its function name."""
    _MODEL_FACTORIES[factory.__name__] = factory
    return factory


_FAMILIES: dict[str, Callable[..., nn.Module]] = {}
_DESCRIBERS: dict[str, Callable[[nn.Module, dict], dict]] = {}


def register_model_family(
    prefix: str, build: Callable[..., nn.Module], describe: Callable[[nn.Module, dict], dict] | None = None
) -> None:
    """Let :func:`~neutreno.models.load_model` rebuild checkpoints whose model name starts with ``prefix``
    (e.g. ``"hf:"``, registered by :mod:`neutreno.integrations.hf`), so that ``models`` never imports
    the integrations. ``build(name, args, attention, lam)`` returns the model, weights not loaded;
    ``describe(model, model_spec)`` returns the model_spec of what the model computes now (its
    attention may have been patched or unpatched since it was built), which a saved file records."""
    _FAMILIES[prefix] = build
    if describe is not None:
        _DESCRIBERS[prefix] = describe


def model_family(name: str) -> Callable[..., nn.Module] | None:
    """The builder registered for ``name``'s prefix, or None for a registry model."""
    return next((build for prefix, build in _FAMILIES.items() if name.startswith(prefix)), None)


def family_describer(name: str) -> Callable[[nn.Module, dict], dict] | None:
    """The ``describe`` registered for ``name``'s prefix (:func:`register_model_family`), or None."""
    return next((describe for prefix, describe in _DESCRIBERS.items() if name.startswith(prefix)), None)


_ARGS_UPGRADES: dict[str, Callable[[dict], dict]] = {}


def register_args_upgrade(names: tuple[str, ...], upgrade: Callable[[dict], dict]) -> None:
    """Register how a model's arguments of earlier releases map to today's (renamed arguments), so
    that :func:`canonical_args` can tell a config written with the earlier names for the same model."""
    for name in names:
        _ARGS_UPGRADES[name] = upgrade


def canonical_args(name: str, args: dict) -> dict:
    """``args`` of model ``name`` in today's names (a copy; unchanged for a model without renames)."""
    upgrade = _ARGS_UPGRADES.get(name)
    return upgrade(args) if upgrade is not None else dict(args)


def list_models(
    filter: str | Sequence[str] = "", exclude_filters: str | Sequence[str] = "", pretrained: bool = False
) -> list[str]:
    """Registered model names, sorted, as timm's ``list_models``: those matching the shell-style pattern
    ``filter`` (or any of a list of them; ``""``: all) and none of ``exclude_filters``. ``pretrained``:
    only those with weights to download, which none has (neutreno downloads nothing: load a file with
    :func:`neutreno.models.load_pretrained`), so an empty list."""
    if pretrained:
        return []

    def patterns(value: str | Sequence[str], name: str) -> list[str]:
        found = [value] if isinstance(value, str) else list(value) if isinstance(value, Sequence) else None
        if found is None or not all(isinstance(p, str) for p in found):  # fnmatch's error named no argument
            raise TypeError(f"list_models' {name} must be a pattern or a list of patterns, got {value!r}")
        return [p for p in found if p]

    wanted, unwanted = patterns(filter, "filter") or ["*"], patterns(exclude_filters, "exclude_filters")
    return sorted(
        n
        for n in _MODEL_FACTORIES
        if any(fnmatch.fnmatch(n, p) for p in wanted) and not any(fnmatch.fnmatch(n, p) for p in unwanted)
    )


def create_model(
    name: str,
    pretrained: bool = False,
    *,
    attention: str = "softmax",
    lam: float | None = None,
    **overrides,
) -> nn.Module:
    """Build a registered model.

    Args:
        name: a name from :func:`list_models`, e.g. ``"deit_tiny_patch16_224"``.
        pretrained: False, as timm's argument; weights are never downloaded: load a file with
            :func:`neutreno.models.load_pretrained` (timm/DeiT ``.pth`` or ``.safetensors``).
        attention: one of :data:`neutreno.ATTENTION_TYPES` (math.md §2): softmax, symmetric, kernel,
            the spectral eigen_pos/eigen_neg, each also with ``_neutreno`` (``neutreno`` is softmax's).
        lam: λ of the NeuTRENO variants (default :data:`neutreno.layers.DEFAULT_LAM`).
        **overrides: constructor arguments that replace the preset's, e.g. ``num_classes=10``,
            ``img_size=384``, ``featscale=True``, ``attnscale=True``, ``drop_path_rate=0.1``.

        checkpoint_path: as timm's, a weights file loaded into the model once built
            (:func:`neutreno.models.load_pretrained`).

    Raises:
        ValueError: an unknown model name, attention name or argument, listing the valid ones; a timm
            tag (``deit_tiny_patch16_224.fb_in1k``: which weights to download, and their class count).
    """
    if not isinstance(name, str):
        raise TypeError(f"create_model takes a model name (a string), got {name!r}")
    if name not in _MODEL_FACTORIES:
        architecture, dot, tag = name.partition(".")
        if dot and architecture in _MODEL_FACTORIES:
            raise ValueError(
                f"unknown model {name!r}: the tag .{tag} names timm weights to download, which neutreno does "
                f"not fetch: create_model({architecture!r}) and load the file with "
                "neutreno.models.load_pretrained(model, path)"
            )
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    checkpoint_path = overrides.pop("checkpoint_path", None)
    if pretrained:
        raise ValueError(
            f"pretrained={pretrained!r}: neutreno downloads no weights; build the model and load a file with "
            "neutreno.models.load_pretrained(model, path) (timm/DeiT .pth or .safetensors)"
        )
    model = _MODEL_FACTORIES[name](attention=attention, lam=lam, **overrides)
    # How to rebuild it: saved beside the weights so a checkpoint names its own architecture.
    model.model_spec = {"model": name, "attention": attention, "lam": lam, "args": dict(overrides)}
    if checkpoint_path:
        from neutreno.models.checkpoint import load_pretrained

        load_pretrained(model, checkpoint_path)
    return model


def check_sizes(**sizes: object) -> None:
    """Sizes and counts must be integers >= 1 (not ``True``, not ``4.0``, not a quoted ``"128"``)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_rates(**rates: object) -> None:
    """Dropout and drop-path rates must be numbers in [0, 1)."""
    for name, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {rate!r}")

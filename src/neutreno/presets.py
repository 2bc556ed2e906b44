"""The training presets that ship with the package (``neutreno/configs/*.yaml``): the papers' recipes
and their CPU-sized versions. ``neutreno train NAME`` takes a preset's name as well as a file."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from neutreno.config import ConfigError


def presets_dir() -> Path:
    """The folder holding the presets, inside the installed package."""
    return Path(str(resources.files("neutreno") / "configs"))


def preset_file(name: str) -> Path:
    """Where the preset ``name`` (``cifar10_vit_neutreno`` or ``cifar10_vit_neutreno.yaml``) would be."""
    return presets_dir() / (name if name.endswith(".yaml") else f"{name}.yaml")


def list_presets() -> dict[str, str]:
    """Preset name → its description (what it trains), in name order."""
    return {path.stem: describe_preset(path.read_text()) for path in sorted(presets_dir().glob("*.yaml"))}


# a sentence's end: a full stop before a space or the end, not an abbreviation's (App. G.9, et al.)
_SENTENCE_END = re.compile(r"(?<!\bApp)(?<!\bal)(?<!\be\.g)(?<!\bi\.e)\.(?=\s|$)")


def describe_preset(text: str) -> str:
    """The first sentence of a preset file's opening comment, which may run over several lines (its
    first line alone cut 9 of 23 descriptions mid-sentence), up to a blank line, an indented command
    line or the first setting."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  ") or not line.strip("# "):
            break
        lines.append(line.lstrip("#").strip())
    joined = " ".join(lines)
    end = _SENTENCE_END.search(joined)
    return (joined[: end.end()] if end else joined).removesuffix(":")


def resolve_config(name_or_path: str | Path) -> Path:
    """A config file: ``name_or_path`` itself when it is a file, else the preset of that name
    (``cifar10_vit_neutreno``, ``cifar10_vit_neutreno.yaml``, or ``configs/cifar10_vit_neutreno.yaml``
    as a checkout names it, from any folder).

    Raises:
        ConfigError: neither a file nor a preset (the presets are listed).
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = preset_file(path.name)
    if path.parent in (Path("."), Path("configs")) and preset.is_file():
        return preset
    raise ConfigError(
        f"no such config file or preset: {name_or_path} (presets: {', '.join(list_presets())}; "
        "`neutreno presets` describes them)"
    )

"""Typed configs: dataclasses loaded from YAML, overridden with ``--set a.b=value``, checked before any work.

A config file is a nested mapping whose keys are the dataclass fields. ``base: other.yaml`` (a path
relative to the file) merges the file over another, so a paper variant is a few lines. Every
unknown key and every value of the wrong type or range raises :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import reprlib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key that does not exist, or a value of the wrong type or out of range."""


DATA_ENV = "NEUTRENO_DATA"  # the folder holding the datasets; configs write it as ${NEUTRENO_DATA}
_ENV_REFERENCE = re.compile(r"\$\{(\w+)\}")


def expand_env(value: str, key: str) -> str:
    """``value`` with each ``${NAME}`` replaced by the environment variable NAME (the presets name their
    data as ``${NEUTRENO_DATA}/…``); ConfigError naming the key and the variable when it is not set."""

    def lookup(match: re.Match) -> str:
        name = match.group(1)
        if not os.environ.get(name):  # empty: ${NEUTRENO_DATA}/imagenet would be /imagenet
            hint = " (or pass --data-root where the command has it)" if name == DATA_ENV else ""
            state = "it is empty" if name in os.environ else "set it"
            raise ConfigError(f"{key}: {_shown(value)} needs the environment variable {name}: {state}{hint}")
        return os.environ[name]

    return _ENV_REFERENCE.sub(lookup, value)


def check_env_references(value: str, key: str) -> None:
    """Refuse a ``$NAME``, ``${NAME:-default}`` or unclosed ``${`` in a value: only ``${NAME}`` is
    expanded, and a shell's other forms stayed as text (``$HOME/runs`` made a folder named "$HOME")."""
    rest = _ENV_REFERENCE.sub("", value)
    found = re.search(r"\$(\{[^}]*\}?|[A-Za-z_]\w*)", rest)
    if found:
        name = re.match(r"\{?(\w*)", found.group(1)).group(1) or "NAME"
        raise ConfigError(
            f"{key}: {_shown(value)} has {found.group(0)!r}: only ${{{name}}} is expanded (a config is not a "
            "shell: $NAME and ${NAME:-default} stay as text)"
        )


def check(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError("<key>: <message>")`` unless ``condition``; for ``__post_init__`` range checks."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


def check_normalization(mean: tuple, std: tuple, channels: int) -> None:
    """``data.mean`` and ``data.std``: ``channels`` values each, fractions of 255 as timm writes them
    (ImageNet's 0.485, …): pixels are divided by 255 before the mean is subtracted. mmseg's and
    Segmenter's configs write levels (123.675, …): with them a model trained on near-blank images."""
    check(len(mean) == channels, "mean", f"needs {channels} values, got {list(mean)}")
    check(
        len(std) == channels and all(s > 0 for s in std),
        "std",
        f"needs {channels} positive values, got {list(std)}",
    )
    for key, values in (("mean", mean), ("std", std)):
        check(
            all(0 <= v <= 1 for v in values),
            key,
            f"values are fractions of 255 in [0, 1] (ImageNet's mean 0.485, 0.456, 0.406), got "
            f"{list(values)}: divide levels of 0-255 (mmseg's 123.675, …) by 255",
        )


MAX_WORKERS = 256  # DataLoader processes; more is a typo (a million forks until the machine stalls)


def _shown(value: object) -> str:
    """``repr(value)`` cut to a readable length: a YAML file of nested aliases (a few hundred bytes)
    expanded to gigabytes in an error message's repr."""
    return _SHOWN.repr(value)


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 200, 200
_SHOWN.maxdict = _SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = 8


def did_you_mean(given: object, valid: typing.Iterable) -> str:
    """``" (did you mean 'adamw'?)"`` for the valid name ``given`` differs from only in case, or a close
    spelling of it; "" when there is none."""
    names = [str(v) for v in valid]
    text = str(given)
    same = [n for n in names if n.lower() == text.lower()]
    close = same or difflib.get_close_matches(text.lower(), names, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_num_workers(num_workers: int, key: str = "num_workers") -> None:
    """DataLoader workers: 0 (load in the main process) to :data:`MAX_WORKERS`."""
    check(0 <= num_workers <= MAX_WORKERS, key, f"must be 0 to {MAX_WORKERS}, got {num_workers}")


def check_named(config: object, keys: typing.Iterable[str]) -> None:
    """Each of ``keys`` (a path or name) is null or a non-blank string: an empty one (an unset shell
    variable) is the folder itself or the current one (an empty split made the split folders the classes)."""
    for key in keys:
        value = getattr(config, key)
        check(
            value is None or bool(value.strip()),
            key,
            "must name a dataset, file or split, got an empty string",
        )


def check_attention(attention: str, lam: float | None) -> None:
    """The checks every model config shares: a known attention variant (math.md §2) and λ >= 0."""
    from neutreno.layers.attention import ATTENTION_TYPES

    check(
        attention in ATTENTION_TYPES,
        "attention",
        f"{attention!r} is not one of {', '.join(ATTENTION_TYPES)}{did_you_mean(attention, ATTENTION_TYPES)}",
    )
    check(lam is None or lam >= 0, "lam", f"must be >= 0, got {lam}")


def check_model_args(args: dict, fields: tuple[str, ...], derived: tuple[str, ...]) -> None:
    """``model.args`` (other constructor keywords) must not name what the config sets elsewhere: a model
    field (``model.lam``) or a value the task derives from its data (``num_classes``); either would reach
    the constructor twice."""
    for key in args:
        check(key not in fields, "args", f"{key} is set by model.{key}, not model.args")
        check(key not in derived, "args", f"{key} comes from the data, not model.args")


def check_model_builds(
    build: typing.Callable[[], object], args: dict, derived: dict[str, str] | None = None
) -> None:
    """Run ``build`` (the task's ``create_model`` call, with stand-ins for what comes from the data) on
    the meta device: no memory, no arithmetic. A value that only the model's constructor checks
    (``model.args.depth`` 0, an unknown keyword, ``model.lam`` for softmax attention) is then refused
    with the config's checks, naming the key, before any data is read, and a sweep finds a bad grid
    point before it trains the first. Only the constructor's refusals (ValueError, TypeError) and its
    arithmetic on a bad value (OverflowError from ``int(dim * mlp_ratio)`` at an infinite ratio,
    ZeroDivisionError) count; a message is its first line (torch's can end in a C++ backtrace).
    ``derived``: constructor arguments the task sets from other keys (``{"img_size": "data.image_size"}``),
    named by that key when the message names only them."""
    import torch

    try:
        with torch.device("meta"):
            build()
    except (ValueError, TypeError, ArithmeticError) as error:
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        said = message.split("; valid:")[0]  # not the list of valid arguments, which names good keys too
        named = [f"args.{k}" for k in args if re.search(rf"\b{re.escape(str(k))}\b", said)]
        # a message naming the argument otherwise ("dim 97", "norm must be …, got 'x'"): by its value,
        # when one argument's alone appears in it
        valued = [f"args.{k}" for k, v in args.items() if _mentions(said, v)]
        key = named[0] if named else valued[0] if len(valued) == 1 else None
        key = key or ("lam" if re.search(r"\blam\b", message) else None)
        if key:
            raise ConfigError(f"model.{key}: {message}") from None
        sources = [source for name, source in (derived or {}).items() if re.search(rf"\b{name}\b", said)]
        raise ConfigError(f"{sources[0]}: {message}" if len(sources) == 1 else f"model: {message}") from None


def _mentions(message: str, value: object) -> bool:
    """Whether ``message`` shows ``value`` (a number or string, as a word or quoted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or value == "":
        return False
    shown = [repr(value), str(value)] if isinstance(value, str) else [str(value)]
    return any(re.search(rf"(?<![\w.]){re.escape(text)}(?![\w.])", message) for text in shown)


class _BadKey(yaml.YAMLError):
    """A mapping key YAML parses but a config cannot take: a list as a key, or a key given twice."""


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, but:

    - numbers are decimal only: YAML 1.1 (PyYAML's) reads ``064`` as octal 52, ``1:30`` as base-60 90,
      ``0b101`` as 5 and ``0x40`` as 64, silently; here they are strings, which a number key refuses by
      name (leading zeros included). ``1e-3`` is a float (1.1 read it as a string);
    - a key given twice in one mapping is an error: plain YAML keeps the last, so a second ``train:``
      section would silently drop the first one's settings.
    """

    def __init__(self, stream) -> None:
        super().__init__(stream)
        # mappings flattened (their "<<:" merges written into them, overridden keys and all): not checked
        # for keys given twice again when an alias reads one
        self.flattened: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self.flattened:  # its own keys, before the merges are written into it (an
            # anchored mapping merged elsewhere is flattened before it is read: a key twice passed)
            self._check_keys(node)
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" and isinstance(value_node, yaml.SequenceNode):
                    # PyYAML lets the last mapping win where YAML's merge lets the first
                    line = key_node.start_mark.line + 1
                    raise _BadKey(f"'<<:' merges one mapping here, not a list of them (line {line})")
        self.flattened.add(id(node))
        super().flatten_mapping(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if id(node) not in self.flattened:
            self._check_keys(node)
        return super().construct_mapping(node, deep)

    def _check_keys(self, node: yaml.MappingNode) -> None:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<:" merges are overridden on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):
                raise _BadKey(f"a key must be a name, got {key!r} (line {line})")
            if key in seen:
                raise _BadKey(f"key {key!r} is given twice (line {line})")
            seen.add(key)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# an underscore only between digits (1_000): 1_, 1__0 and 0.6_ are typos, kept as text and refused by key
_DIGITS = r"[0-9](?:_?[0-9])*"
_ConfigLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9](?:_?[0-9])*)$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        rf"^(?:[-+]?(?:{_DIGITS}\.(?:{_DIGITS})?|\.{_DIGITS})(?:[eE][-+]?[0-9]+)?|[-+]?{_DIGITS}[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> dict:
    """A YAML config as a dict, with its ``base:`` chain merged in (the file's own keys win).

    An empty file is an error (it would silently train every default), as are a ``base:`` that is not
    a file name and a ``base:`` chain that comes back to a file already in it."""
    return merge_layers(read_yaml_layers(path))


def merge_layers(layers: list[dict]) -> dict:
    """:func:`read_yaml_layers`' files merged, each over the ones before it."""
    merged: dict = {}
    for layer in layers:
        merged = merge(merged, layer)
    return merged


def _yaml_reason(error: Exception) -> str:
    """What a YAML error found and where, in one line: PyYAML's first line is only its context ("while
    scanning for the next token"), its problem and position ("found character '\\t' that cannot start
    any token", line 3, column 1) on the lines after."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if not problem:
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    line = str(getattr(mark, "buffer", "") or "").splitlines()[mark.line : mark.line + 1] if mark else []
    if line and "${" in line[0] and "flow" in str(getattr(error, "context", "")):
        where += ": inside { } or [ ], quote a ${VAR} (its { opens a mapping)"
    return f"{problem}{where}"


def read_yaml_layers(path: str | Path, _chain: tuple[Path, ...] = ()) -> list[dict]:
    """The files of a config's ``base:`` chain, each as written (less its ``base:``), the first base
    first and ``path`` itself last: :func:`read_yaml` merges them; which one gave a key is in them."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such config file: {path}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)  # not the locale's
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as error:  # ValueError: a tag (!!int 1.5)
        raise ConfigError(f"{path} is not valid YAML: {_yaml_reason(error)}") from None
    if data is None:
        raise ConfigError(f"{path} is empty; a config names at least the settings it changes")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return [data]
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base: expects the file name of another config, got {base!r}")
    chain = (*_chain, path.resolve())
    base_path = path.parent / base
    if not base_path.exists() and Path(base).parent == Path("."):  # a packaged preset's name (a user's
        from neutreno.presets import preset_file  # own config building on one, from any folder)

        preset = preset_file(base)
        base_path = preset if preset.is_file() else base_path
    if base_path.resolve() in chain:
        cycle = " → ".join(p.name for p in (*chain, base_path.resolve()))
        raise ConfigError(f"{path}: base: makes a cycle ({cycle})")
    return [*read_yaml_layers(base_path, chain), data]


def merge(base: dict, update: dict) -> dict:
    """``update`` merged over ``base``, recursively for nested mappings; an empty mapping empties its key
    (``args: {}``), as ``--set model.args={}`` does."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and value and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def set_text(key: str, value: object) -> str:
    """The ``--set`` override giving ``key`` the text of ``value`` as it is (a path): written bare, as
    YAML it lost what follows a " #" (a comment), became a date (``2024-05-01``) or None (``null``)."""
    return f"{key}={json.dumps(str(value), ensure_ascii=False)}"  # a JSON string is a YAML string


def refuse_overrides_of(overrides: list[str], owned: dict[str, str]) -> None:
    """ConfigError for an override of a key a command sets itself after the user's overrides (``owned``:
    {key: what sets it}): the value given was silently replaced (a sweep's train.out_dir), written as
    a key or inside a mapping (``train={out_dir: x}``), or below an owned key (a sweep's grid
    ``model.args={depth: 1}`` replaced ``--set model.args.depth=2``)."""
    for item in overrides:
        for key in override_leaves(item):
            owner = next((o for o in owned if key == o or key.startswith(o + ".")), None)
            if owner is not None:
                where = item.partition("=")[0].strip()
                named = key if where == key else f"{where} (its {key})"
                raise ConfigError(f"--set {named}: {owned[owner]}, so the value given would be ignored")


def override_leaves(item: str) -> list[str]:
    """The keys an override ``key=value`` sets: ``train={seed: 1, epochs: 2}`` sets train.seed and
    train.epochs; an empty mapping (``model.args={}``) sets its key."""

    def leaves(data: dict, prefix: str = "") -> list[str]:
        found = []
        for key, value in data.items():
            found += (
                leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [prefix + str(key)]
            )
        return found

    return leaves(apply_overrides({}, [item]))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``["a.b=1", "c=[1, 2]"]`` to a nested dict; values are YAML (``null``, ``true``, lists),
    read as config files are. A mapping merges into the mapping it replaces, as ``base:`` does:
    ``train={max_steps: 1}`` changes that key, not the whole section; ``model.args={}`` empties it."""
    data = dict(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        try:
            value = yaml.load(text, Loader=_ConfigLoader) if text else ""
        except (yaml.YAMLError, ValueError) as error:
            # a flow mapping or list that does not parse, or a key given twice, is a typo: its section
            # kept as a string would be replaced silently by the next nested --set; a tag that does
            # not convert (!!int 1.5) raises ValueError
            if text.lstrip()[:1] in ("{", "[") or isinstance(error, (_BadKey, ValueError)):
                raise ConfigError(
                    f"--set {key}: {text!r} is not valid YAML ({_yaml_reason(error)})"
                ) from None
            value = text  # a plain string YAML reserves a character of (@, `, %)
        if text.count("#") > json.dumps(value, ensure_ascii=False, default=str).count("#"):
            # YAML read " #" as a comment: "out_dir=runs/run #2" gave runs/run, silently
            raise ConfigError(
                f"--set {key}: {text!r} holds ' #', the start of a YAML comment: quote the value "
                f"(--set '{key}=\"…\"')"
            )
        *parents, leaf = key.split(".")
        node = data
        for depth, part in enumerate(parents):
            child = node.get(part)
            if child is not None and not isinstance(child, dict):
                where = ".".join(parents[: depth + 1])
                raise ConfigError(f"--set {key}: {where} is {child!r}, not a mapping")
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        given = node.get(leaf)
        merges = isinstance(given, dict) and isinstance(value, dict) and value
        node[leaf] = merge(given, value) if merges else value
    return data


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a nested dict, checking every key and value type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {_shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields), key=str)  # a YAML key may be a number or null
    if unknown:
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'{did_you_mean(unknown[0], fields)}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        factory = fields[name].default_factory
        if (
            dataclasses.is_dataclass(hints[name])
            and isinstance(value, dict)
            and factory is not dataclasses.MISSING
        ):
            # A section given in part keeps the task's own defaults (e.g. the LM's optimiser), not the
            # section class's.
            value = merge(to_dict(factory()), value)
        kwargs[name] = _convert(hints[name], value, prefix + name)
    for name, f in fields.items():  # defaults that name ${NEUTRENO_DATA} are expanded like values
        if name in kwargs:
            continue
        if isinstance(f.default, str) and "${" in f.default:
            kwargs[name] = expand_env(f.default, prefix + name)
        elif dataclasses.is_dataclass(hints[name]) and f.default_factory is not dataclasses.MISSING:
            kwargs[name] = from_dict(hints[name], to_dict(f.default_factory()), prefix + name + ".")
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{prefix}{error}") from None


def to_dict(config: Any) -> dict:
    """A config as plain nested dicts/lists (tuples become lists), ready for YAML or JSON."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(config))


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """``cls`` from a YAML file (or the defaults) with ``--set`` overrides applied."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, list(overrides)))


def _convert(hint: Any, value: Any, key: str) -> Any:
    """``value`` checked against type ``hint`` (and converted: int → float, list → tuple)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{key}: {_shown(value)} is not a valid {_name(hint)}"
        )
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{key}: {_shown(value)} is not one of {', '.join(map(str, args))}{did_you_mean(value, args)}"
            )
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {_shown(value)}")
        return tuple(_convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {_shown(value)}")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_shown(value)}")
        if args and args[0] is str:  # keyword arguments: a YAML key 1 or null failed in the constructor
            wrong = [k for k in value if not isinstance(k, str)]
            if wrong:
                raise ConfigError(f"{key}: keys must be names, got {wrong[0]!r}")
            glued = [k for k, v in value.items() if v is None and re.fullmatch(r"\w+:\S.*", k)]
            if glued:  # {depth:1} is the key "depth:1" with no value, in YAML's flow style
                name, _, given = glued[0].partition(":")
                raise ConfigError(
                    f"{key}: {glued[0]!r} is one key without a value: write {{{name}: {given}}}"
                )
        return dict(value)
    if hint is Any:
        return value
    if hint is str and isinstance(value, str) and value.startswith("~"):
        # a shell leaves ~ after "key=" as it is: ~/runs made a folder named "~" in the current one
        value = os.path.expanduser(value)
    if hint is str and isinstance(value, str) and "$" in value:
        check_env_references(value, key)
        return expand_env(value, key)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > sys.float_info.max:  # float() would raise OverflowError
            raise ConfigError(f"{key}: must be a finite number, got an integer beyond float's range")
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        # a column named "no" or "on": YAML 1.1 read the word as a boolean
        quote = " (YAML reads yes, no, on, off, true, false as booleans: quote a word meant as text)"
        raise ConfigError(
            f"{key}: expected {_name(hint)}, got {_shown(value)}"
            + (quote if hint is str and isinstance(value, bool) else "")
        )
    return value


def _name(hint: Any) -> str:
    """``bool or 'auto'`` for ``bool | Literal["auto"]``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return " or ".join(map(repr, args))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")

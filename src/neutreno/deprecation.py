"""Names that moved keep importing from their old module, with a DeprecationWarning naming the new place."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(
    module: str, targets: dict[str, str], instead: dict[str, str] | None = None
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` serving the names that moved away from it.

    Args:
        module: the old module's ``__name__``.
        targets: old name → ``"package.module:attribute"`` where it lives now.
        instead: old name → what to use instead, when that is not the target itself.
    """

    def __getattr__(name: str) -> Any:
        if name not in targets:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, attribute = targets[name].split(":")
        use = (instead or {}).get(name, f"{where}.{attribute}")
        warnings.warn(f"{module}.{name} is deprecated: use {use}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(where), attribute)

    return __getattr__

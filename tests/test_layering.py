"""The package's dependencies point down only (issue 20): read from the source, so a new import that
breaks the layering fails here."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "neutreno"

# package → packages it must never import (directly or inside a function)
FORBIDDEN = {
    "layers": {"models", "data", "training", "diagnostics", "integrations", "studies", "reproduce", "cli"},
    "models": {"data", "training", "diagnostics", "integrations", "studies", "reproduce", "cli"},
    "data": {"training", "diagnostics", "integrations", "studies", "reproduce", "cli"},
    "integrations": {"training", "diagnostics", "studies", "reproduce", "cli"},
}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "neutreno" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_dependencies_point_down():
    broken = []
    for package, forbidden in FORBIDDEN.items():
        for path in (SRC / package).rglob("*.py"):
            bad = imported_packages(path) & forbidden
            if bad:
                broken.append(f"{path.relative_to(SRC)} imports {sorted(bad)}")
    assert not broken, broken


def test_nothing_outside_cli_imports_cli():
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if "cli" in imported_packages(path) and path.parts[-2] != "cli" and path.name != "__main__.py"
    ]
    assert not offenders, offenders

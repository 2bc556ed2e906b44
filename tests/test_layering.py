"""The package's dependencies point down only (issue 20): read from the source, so a new import that
breaks the layering fails here."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "neutreno"

# package → packages it must never import (directly or inside a function)
FORBIDDEN = {
    "layers": {"models", "data", "training", "diagnostics", "integrations", "studies", "reproduce", "cli"},
    "models": {"data", "training", "diagnostics", "integrations", "studies", "reproduce", "cli"},
    "data": {"training", "diagnostics", "integrations", "studies", "reproduce", "cli"},
    "integrations": {"training", "diagnostics", "studies", "reproduce", "cli"},
    # The trainer's validation and the tasks use evaluation's metrics and inference; its evaluators of
    # saved runs use training's run folders, devices and language-model loading, but only when called
    # (see test_evaluation_imports_training_only_when_called).
    "evaluation": {"studies", "reproduce", "cli"},
}


def imported_packages(path: Path, *, at_import: bool = False) -> set[str]:
    """The neutreno packages ``path`` imports; ``at_import``: only those imported when it is imported
    (not inside a function, nor under ``if TYPE_CHECKING:``)."""
    found = set()
    nodes = [ast.parse(path.read_text())]
    while nodes:
        node = nodes.pop()
        if at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if at_import and isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            nodes.extend(node.orelse)
            continue
        nodes.extend(ast.iter_child_nodes(node))
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


def test_evaluation_imports_training_only_when_called():
    """training imports evaluation as it loads (the trainer's MetricSums, the tasks' metrics and
    inference), so evaluation must not import training as it loads: either package can be imported
    first, and neither ever meets the other half-imported."""
    offenders = [
        str(path.relative_to(SRC))
        for path in (SRC / "evaluation").rglob("*.py")
        if "training" in imported_packages(path, at_import=True)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        ("neutreno.training.evaluate", "evaluate_checkpoint", "neutreno.evaluation.classification"),
        ("neutreno.training.evaluate", "sliding_window_nll", "neutreno.evaluation.language_model"),
        ("neutreno.training.evaluate", "evaluate_segmentation", "neutreno.evaluation.segmentation"),
        ("neutreno.training.robustness", "evaluate_corruptions", "neutreno.evaluation.robustness"),
    ],
)
def test_the_old_evaluation_modules_still_import_with_a_deprecation_warning(old, name, new):
    sys.modules.pop(old, None)  # imported afresh, so it warns again
    with pytest.deprecated_call(match=new.rsplit(".", 1)[0]):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_names_moved_out_of_training_segmentation_still_import_with_a_deprecation_warning():
    import neutreno.evaluation.segmentation as new
    import neutreno.training.segmentation as old

    with pytest.deprecated_call(match="neutreno.evaluation.segmentation.sliding_window_logits"):
        assert old.sliding_window_logits is new.sliding_window_logits
    assert old.confusion_matrix is new.confusion_matrix  # the task's own imports stay silent
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018

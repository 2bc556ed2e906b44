"""Deprecated: moved to :mod:`neutreno.evaluation.robustness` (issue 20). Importing this module still
works, with a DeprecationWarning."""

import warnings

from neutreno.evaluation.robustness import (
    ALEXNET_ERRORS,
    corruption_errors,
    evaluate_corruptions,
    mean_corruption_error,
    spread_indices,
)

__all__ = [
    "ALEXNET_ERRORS",
    "corruption_errors",
    "evaluate_corruptions",
    "mean_corruption_error",
    "spread_indices",
]

warnings.warn(
    "neutreno.training.robustness moved to neutreno.evaluation.robustness", DeprecationWarning, stacklevel=2
)

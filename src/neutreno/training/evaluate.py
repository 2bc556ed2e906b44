"""Deprecated: the evaluators moved to :mod:`neutreno.evaluation` (issue 20) — classifiers to
:mod:`~neutreno.evaluation.classification`, language models to :mod:`~neutreno.evaluation.language_model`,
Segmenters to :mod:`~neutreno.evaluation.segmentation`. Importing this module still works, with a
DeprecationWarning."""

import warnings

from neutreno.evaluation.classification import Classifier, evaluate_checkpoint, open_classifier
from neutreno.evaluation.language_model import evaluate_language_model, sliding_window_nll
from neutreno.evaluation.segmentation import evaluate_segmentation, save_overlays

__all__ = [
    "Classifier",
    "evaluate_checkpoint",
    "evaluate_language_model",
    "evaluate_segmentation",
    "open_classifier",
    "save_overlays",
    "sliding_window_nll",
]

warnings.warn(
    "neutreno.training.evaluate moved to neutreno.evaluation (classification, language_model, segmentation)",
    DeprecationWarning,
    stacklevel=2,
)

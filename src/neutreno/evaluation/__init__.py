"""Evaluation in one place: the metric sums every score is computed from, and the scores of saved runs.

- :mod:`~neutreno.evaluation.metric`: :class:`MetricSums`, per-batch sums added up over a dataset and
  over processes, then summarized — the trainer's validation and every evaluator below use it.
- :mod:`~neutreno.evaluation.classification`: top-1/top-5 sums and a checkpoint scored on an image
  dataset (:func:`~neutreno.evaluation.classification.evaluate_checkpoint`).
- :mod:`~neutreno.evaluation.language_model`: sliding-window perplexity
  (:func:`~neutreno.evaluation.language_model.evaluate_language_model`).
- :mod:`~neutreno.evaluation.segmentation`: confusion-matrix mIoU, sliding-window and multi-scale
  inference, a Segmenter's SS/MS mIoU (:func:`~neutreno.evaluation.segmentation.evaluate_segmentation`).
- :mod:`~neutreno.evaluation.robustness`: top-1 errors under corruptions, CE and mCE.

The training tasks import their metrics and inference from here; the evaluators reach back into
:mod:`neutreno.training` (run folders, devices, saved language models) only when called, so importing
either package never needs the other half-imported. Only :mod:`~neutreno.evaluation.metric` is
imported here, to keep ``import neutreno.training`` light.
"""

from neutreno.evaluation.metric import MetricSums, sum_over_processes

__all__ = ["MetricSums", "sum_over_processes"]

"""Over-smoothing diagnostics: metric functions (``metrics``), per-layer collection (``collect``)
and streaming aggregation over a dataset (``layerwise``)."""

from neutreno.diagnostics.collect import BlockProbe, HFProbe, LayerTensors, capture_hidden_states
from neutreno.diagnostics.layerwise import METRICS, LayerwiseMetrics, analyze_layers, cosine_by_layer
from neutreno.diagnostics.metrics import (
    attention_eigenvalues,
    effective_rank,
    gradient_alignment,
    head_redundancy,
    high_frequency_ratio,
    nonlocal_energy,
    rank_residual,
    spearman_correlation,
    spectral_regime,
    token_cosine_similarity,
    value_projection_spectrum,
)

__all__ = [
    "METRICS",
    "BlockProbe",
    "HFProbe",
    "LayerTensors",
    "LayerwiseMetrics",
    "analyze_layers",
    "attention_eigenvalues",
    "capture_hidden_states",
    "cosine_by_layer",
    "effective_rank",
    "gradient_alignment",
    "head_redundancy",
    "high_frequency_ratio",
    "nonlocal_energy",
    "rank_residual",
    "spearman_correlation",
    "spectral_regime",
    "token_cosine_similarity",
    "value_projection_spectrum",
]

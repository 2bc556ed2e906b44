"""Over-smoothing diagnostics: metric functions (``metrics``), per-layer collection (``collect``),
streaming aggregation over a dataset (``layerwise``) and per-layer spectral analysis (``spectral``)."""

from neutreno.diagnostics.collect import (
    BlockProbe,
    HFProbe,
    LayerTensors,
    capture_hidden_states,
    qkv_gradient_norms,
)
from neutreno.diagnostics.layerwise import METRICS, LayerwiseMetrics, analyze_layers, cosine_by_layer
from neutreno.diagnostics.metrics import (
    attention_eigenvalues,
    effective_rank,
    effective_ranks,
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
from neutreno.diagnostics.spectral import (
    LayerSpectrum,
    flipped_layer_norm_signs,
    layer_spectra,
    terms_beyond_the_rule,
    value_output_maps,
)

__all__ = [
    "METRICS",
    "BlockProbe",
    "HFProbe",
    "LayerSpectrum",
    "LayerTensors",
    "LayerwiseMetrics",
    "analyze_layers",
    "attention_eigenvalues",
    "capture_hidden_states",
    "cosine_by_layer",
    "effective_rank",
    "effective_ranks",
    "flipped_layer_norm_signs",
    "gradient_alignment",
    "head_redundancy",
    "high_frequency_ratio",
    "layer_spectra",
    "nonlocal_energy",
    "qkv_gradient_norms",
    "rank_residual",
    "spearman_correlation",
    "spectral_regime",
    "terms_beyond_the_rule",
    "token_cosine_similarity",
    "value_output_maps",
    "value_projection_spectrum",
]

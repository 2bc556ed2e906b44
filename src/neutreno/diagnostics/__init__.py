"""Over-smoothing diagnostics: metric functions (``metrics``) and per-layer collection (``collect``)."""

from neutreno.diagnostics.collect import capture_hidden_states
from neutreno.diagnostics.layerwise import cosine_by_layer
from neutreno.diagnostics.metrics import token_cosine_similarity

__all__ = ["capture_hidden_states", "cosine_by_layer", "token_cosine_similarity"]

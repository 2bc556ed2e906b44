"""The papers' claims, one module per family; importing them registers each claim (``claim.CLAIMS``) in
the order ``neutreno reproduce --list`` shows them."""

from neutreno.reproduce.claim import CLAIMS
from neutreno.reproduce.claims import (
    accuracy,  # noqa: F401  (NeuTRENO: trained comparisons)
    cost,  # noqa: F401  (NeuTRENO: cost)
    learned,  # noqa: F401  (beyond the papers: a learned λ)
    signal,  # noqa: F401  (Noci et al.)
    smoothing,  # noqa: F401  (NeuTRENO: over-smoothing)
    spectral,  # noqa: F401  (Dovonon et al.)
)

__all__ = ["CLAIMS"]

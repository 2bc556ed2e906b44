"""Experiments that test the source papers' explanations of over-smoothing (``neutreno study``):
``rank_collapse`` (Noci et al., at initialisation) and ``spectrum`` (Dovonon et al., trained smoothing
and sharpening models)."""

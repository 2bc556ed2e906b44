"""Datasets and loaders."""

from neutreno.data.digits import load_digits_split

__all__ = ["load_digits_split"]

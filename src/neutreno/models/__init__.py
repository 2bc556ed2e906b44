"""Models and the ``create_model`` registry."""

from neutreno.models.registry import create_model, list_models, register_model
from neutreno.models.vision_transformer import VisionTransformer

__all__ = ["VisionTransformer", "create_model", "list_models", "register_model"]

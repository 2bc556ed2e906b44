"""Models, the ``create_model`` registry, and self-describing weight files."""

from neutreno.models.checkpoint import load_model, read_metadata, read_state_dict, save_model
from neutreno.models.language_model import TransformerLM
from neutreno.models.registry import create_model, list_models, register_model
from neutreno.models.segmenter import Segmenter
from neutreno.models.vision_transformer import VisionTransformer, adapt_state_dict, resample_pos_embed

__all__ = [
    "Segmenter",
    "TransformerLM",
    "VisionTransformer",
    "adapt_state_dict",
    "create_model",
    "list_models",
    "load_model",
    "read_metadata",
    "read_state_dict",
    "register_model",
    "resample_pos_embed",
    "save_model",
]

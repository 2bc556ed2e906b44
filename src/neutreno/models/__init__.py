"""Models, the ``create_model`` registry, and self-describing weight files."""

from neutreno.models.checkpoint import (
    export_timm,
    load_model,
    load_pretrained,
    read_metadata,
    read_state_dict,
    save_model,
)
from neutreno.models.language_model import TransformerLM
from neutreno.models.registry import canonical_args, create_model, list_models, register_model
from neutreno.models.segmenter import Segmenter
from neutreno.models.vision_transformer import VisionTransformer, load_vit_weights, resample_pos_embed

__all__ = [
    "Segmenter",
    "TransformerLM",
    "VisionTransformer",
    "canonical_args",
    "create_model",
    "export_timm",
    "list_models",
    "load_model",
    "load_pretrained",
    "load_vit_weights",
    "read_metadata",
    "read_state_dict",
    "register_model",
    "resample_pos_embed",
    "save_model",
]

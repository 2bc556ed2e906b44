"""neutreno: NeuTRENO attention and tools against over-smoothing in transformers."""

from neutreno.integrations import hf as _hf  # noqa: F401  (registers the "hf:" checkpoints; no transformers import)
from neutreno.layers import ATTENTION_TYPES, Attention
from neutreno.models import create_model, export_timm, list_models, load_pretrained

__version__ = "0.1.0"
__all__ = [
    "ATTENTION_TYPES",
    "Attention",
    "__version__",
    "create_model",
    "export_timm",
    "list_models",
    "load_pretrained",
]

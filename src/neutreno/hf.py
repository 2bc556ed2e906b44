"""``neutreno.hf``: NeuTRENO in pretrained Hugging Face models (implemented in
:mod:`neutreno.integrations.hf`)::

    import neutreno.hf
    model = transformers.AutoModel.from_pretrained("bert-base-uncased")
    neutreno.hf.apply_neutreno(model, lam=0.6)
"""

from neutreno.integrations.hf import (
    apply_neutreno,
    hf_model_path,
    is_patched,
    neutreno_lambda,
    remove_neutreno,
    set_inner_attention,
)

__all__ = [
    "apply_neutreno",
    "hf_model_path",
    "is_patched",
    "neutreno_lambda",
    "remove_neutreno",
    "set_inner_attention",
]

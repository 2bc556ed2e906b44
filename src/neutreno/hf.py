"""``neutreno.hf``: NeuTRENO in pretrained Hugging Face models (implemented in
:mod:`neutreno.integrations.hf`)::

    import neutreno.hf
    model = transformers.AutoModel.from_pretrained("bert-base-uncased")
    neutreno.hf.apply_neutreno(model, lam=0.6)
"""

from neutreno.integrations.hf import *  # noqa: F403  (the public names, listed once there)
from neutreno.integrations.hf import __all__  # noqa: F401

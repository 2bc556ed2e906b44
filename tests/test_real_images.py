"""Behaviour on real ImageNet images from ../shared/data (paper App. G.3: at random initialisation
NeuTRENO keeps late-layer token similarity below softmax's, which grows with depth)."""

import io
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from neutreno import create_model
from neutreno.diagnostics import capture_hidden_states, token_cosine_similarity

MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


def imagenette_val_images(archive, count):
    """``count`` validation images, spread over the classes, resized to 224², ImageNet-normalised."""
    with tarfile.open(archive) as tar:
        members = sorted(
            (
                m
                for m in tar.getmembers()
                if m.isfile() and m.name.startswith("val/") and m.name.endswith(".JPEG")
            ),
            key=lambda m: m.name,
        )[::40][:count]
        images = []
        for member in members:
            image = Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB").resize((224, 224))
            images.append(torch.tensor(np.asarray(image)).permute(2, 0, 1).float() / 255)
    return (torch.stack(images) - MEAN[:, None, None]) / STD[:, None, None]


def test_random_init_neutreno_keeps_late_layers_less_similar(shared_data):
    images = imagenette_val_images(shared_data / "imagenette-mini.tar.gz", 6)
    cosine = {}
    for attention in ("softmax", "neutreno"):
        torch.manual_seed(0)
        model = create_model("deit_tiny_patch16_224", attention=attention).eval()
        with torch.no_grad(), capture_hidden_states(model.blocks) as hidden:
            model(images)
        cosine[attention] = [token_cosine_similarity(h).item() for h in hidden]
    soft, neu = cosine["softmax"], cosine["neutreno"]
    assert neu[1] == pytest.approx(soft[1], abs=1e-6)  # the first block has no NeuTRENO term
    assert soft[-1] > soft[1] + 0.01  # softmax drifts towards similar tokens with depth
    assert all(n < s for n, s in zip(neu[-4:], soft[-4:], strict=True)), (soft, neu)

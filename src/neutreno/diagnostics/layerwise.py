"""Per-layer measurements over a dataset, streamed batch by batch (memory flat in sample count)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from neutreno.diagnostics.collect import capture_hidden_states
from neutreno.diagnostics.metrics import token_cosine_similarity


@torch.no_grad()
def cosine_by_layer(model: nn.Module, images: Tensor, batch_size: int = 256) -> list[float]:
    """Token cosine similarity (SPEC §3) of the embeddings and of every block's output, averaged
    over ``images`` (N, C, H, W). Returns L + 1 floats; entry 0 is the embeddings.

    ``model`` must have a ``blocks`` list (every model of the project does).
    """
    model.eval()
    totals = None
    for chunk in images.split(batch_size):
        with capture_hidden_states(model.blocks) as hidden:
            model(chunk)
        batch = torch.stack([token_cosine_similarity(h, reduction="none").sum() for h in hidden])
        totals = batch if totals is None else totals + batch
    return (totals / len(images)).tolist()

"""The demo's small in-memory loop (tensors, no DataLoader): AdamW, warm-up + cosine, cross-entropy.

Real training runs use :mod:`neutreno.training.engine`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neutreno.progress import progress
from neutreno.training.engine import fusable, param_groups


def warmup_cosine(step: int, total_steps: int, warmup_steps: int) -> float:
    """Learning-rate multiplier: linear warm-up from 1/W at step 0 to 1 at step W − 1 (W =
    ``warmup_steps``), then cosine decay to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_classifier(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    *,
    epochs: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    warmup_epochs: int = 1,
    label_smoothing: float = 0.0,
    seed: int = 0,
    desc: str = "train",
) -> list[float]:
    """Train ``model`` on in-memory ``images`` (N, ...) and ``labels`` (N,); returns per-epoch mean loss.

    The data order depends only on ``seed``, so two models trained with the same seed see the same
    batches. As in DeiT, biases, norms, per-channel gains, tokens and position embeddings get no
    weight decay.
    """
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, fused=fusable(model.parameters()))
    steps_per_epoch = math.ceil(len(labels) / batch_size)
    total = epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total, warmup_epochs * steps_per_epoch)
    )
    order = torch.Generator().manual_seed(seed)
    history = []
    model.train()
    with progress(total=total, desc=desc, unit="step", leave=False) as bar:
        for _ in range(epochs):
            running, seen = 0.0, 0
            for idx in torch.randperm(len(labels), generator=order).split(batch_size):
                loss = F.cross_entropy(model(images[idx]), labels[idx], label_smoothing=label_smoothing)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                running += loss.item() * len(idx)
                seen += len(idx)
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}")
            history.append(running / seen)
    model.eval()
    return history


@torch.no_grad()
def predict(model: nn.Module, images: Tensor, batch_size: int = 256) -> Tensor:
    """Predicted class ids (N,) of ``model`` in eval mode."""
    model.eval()
    return torch.cat([model(chunk).argmax(-1) for chunk in images.split(batch_size)])

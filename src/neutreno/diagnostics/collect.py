"""Collecting per-layer tensors from a model, separate from the math on them.

Works with any ``nn.Module`` given its list of blocks (forward hooks): our models
(``model.blocks``), Hugging Face encoders (``model.encoder.layer``), or a user's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor, nn


@contextmanager
def capture_hidden_states(blocks: Sequence[nn.Module], detach: bool = True) -> Iterator[list[Tensor]]:
    """Record the input of the first block and the output of every block, per forward call.

    Like Hugging Face's ``output_hidden_states``: after ``model(x)`` inside the context the list
    holds L + 1 tensors (B, N, D) — the embeddings, then each block's output (the first element
    of a tuple output). A second forward call inside the context starts a new list's contents.

    Example::

        with capture_hidden_states(model.blocks) as hidden:
            model(images)
        cos = [token_cosine_similarity(h) for h in hidden]
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("capture_hidden_states needs at least one block")
    hidden: list[Tensor] = []

    def first(value):
        return value[0] if isinstance(value, (tuple, list)) else value

    def on_input(module, args, kwargs):
        hidden.clear()
        x = first(args) if args else first(next(iter(kwargs.values())))
        hidden.append(x.detach() if detach else x)

    def on_output(module, args, output):
        x = first(output)
        hidden.append(x.detach() if detach else x)

    handles = [blocks[0].register_forward_pre_hook(on_input, with_kwargs=True)]
    handles += [b.register_forward_hook(on_output) for b in blocks]
    try:
        yield hidden
    finally:
        for handle in handles:
            handle.remove()

"""A sampler whose order depends only on (seed, epoch, rank), so training can resume mid-epoch exactly."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Sample indices for one process: an epoch-seeded permutation of ``range(size)``, split over ranks.

    Rank ``r`` of ``w`` takes every ``w``-th index from position ``r``, so the ranks' batches together
    are exactly the batches one process with a ``w`` times larger batch would see. With ``drop_tail``
    (training) every rank gets ``size // w`` indices; without it (evaluation) every index is used once.
    ``set_epoch(epoch, start)`` skips the first ``start`` indices of this rank's epoch (resume).
    """

    def __init__(
        self,
        size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_tail: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:  # another rank would repeat rank 0's samples
            raise ValueError(f"rank must be in [0, world_size), world_size >= 1, got {rank} of {world_size}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.drop_tail = rank, world_size, drop_tail
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if start < 0:  # a negative start would count from the end
            raise ValueError(f"start must be >= 0, got {start}")
        self.epoch, self.start = epoch, start

    def _indices(self) -> torch.Tensor:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.size)
        end = self.size // self.world_size * self.world_size if self.drop_tail else self.size
        return order[self.rank : end : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start :].tolist())

    def __len__(self) -> int:
        per_rank = (
            self.size // self.world_size
            if self.drop_tail
            else len(range(self.rank, self.size, self.world_size))
        )
        return max(0, per_rank - self.start)

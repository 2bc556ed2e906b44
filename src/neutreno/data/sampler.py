"""A sampler whose order depends only on (seed, epoch, rank), so training can resume mid-epoch exactly."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Sample indices for one process: an epoch-seeded permutation of ``range(size)``, split over ranks.

    Rank ``r`` of ``w`` takes every ``w``-th index from position ``r``, so the ranks' batches together
    are exactly the batches one process with a ``w`` times larger batch would see. With ``drop_tail``
    (training) every rank gets ``size // w`` indices; without it (evaluation) every index is used once.
    ``set_epoch(epoch, start)`` skips the first ``start`` indices of this rank's epoch (resume).

    ``repeats`` > 1 is DeiT's repeated augmentation (its ``RASampler``): each index of the permutation
    is repeated ``repeats`` times in a row before the split, so consecutive copies land on different
    ranks (each augmented its own way), and every rank still takes ``size // world_size`` indices an
    epoch (DeiT rounds ``size`` down to a multiple of 256 first), the first 1/``repeats`` of the
    permutation. One process gets its copies in one batch.

    ``item_seeds`` yields ``(index, seed)`` pairs instead of indices: the seed of a dataset's own random
    transform of that sample (DeiT's RandomResizedCrop, drawn in the workers), ``mixed_seed("crop",
    seed, epoch, position)`` with the position in the epoch's order over all ranks. So the draws depend on
    neither the ranks, the workers nor a resume, and the copies of repeated augmentation differ.
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
        repeats: int = 1,
        item_seeds: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:  # another rank would repeat rank 0's samples
            raise ValueError(f"rank must be in [0, world_size), world_size >= 1, got {rank} of {world_size}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if (
            isinstance(repeats, bool)
            or not isinstance(repeats, int)
            or repeats < 1
            or (repeats > 1 and not drop_tail)
        ):
            raise ValueError(f"repeats must be an integer >= 1, and 1 for evaluation; got {repeats}")
        self.repeats, self.item_seeds = repeats, item_seeds
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.rank, self.world_size, self.drop_tail = rank, world_size, drop_tail
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if start < 0:  # a negative start would count from the end
            raise ValueError(f"start must be >= 0, got {start}")
        self.epoch, self.start = epoch, start

    def _indices(self) -> torch.Tensor:
        if self.shuffle:
            # mixed, not seed + epoch: another seed's epochs would repeat these orders one epoch apart
            seed = mixed_seed("order", self.seed, self.epoch)
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(seed))
        else:
            order = torch.arange(self.size)
        if self.repeats > 1:  # DeiT's RASampler, padded by wrapping around as it pads
            order = order.repeat_interleave(self.repeats)
            total = -(-len(order) // self.world_size) * self.world_size
            order = torch.cat([order, order[: total - len(order)]])
            return order[self.rank : total : self.world_size][: self.size // self.world_size]
        end = self.size // self.world_size * self.world_size if self.drop_tail else self.size
        return order[self.rank : end : self.world_size]

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        indices = self._indices()[self.start :].tolist()
        if not self.item_seeds:
            return iter(indices)
        # this rank's i-th index is at position rank + world_size · i of the epoch's order (as split above);
        # locals, so the pairs keep this epoch's seeds whatever set_epoch does while they are drawn
        seed, epoch, world = self.seed, self.epoch, self.world_size
        first = self.rank + self.start * world
        return ((i, mixed_seed("crop", seed, epoch, first + k * world)) for k, i in enumerate(indices))

    def __len__(self) -> int:
        per_rank = (
            self.size // self.world_size
            if self.drop_tail
            else len(range(self.rank, self.size, self.world_size))
        )
        return max(0, per_rank - self.start)


def mixed_seed(use: str, *numbers: int) -> int:
    """A 64-bit seed for ``use`` (each RNG stream its own label) from ``numbers``, in which no two tuples
    collide as sums do (seed + rank), nor two uses with the same numbers."""
    digest = hashlib.blake2b(",".join(map(str, (use, *numbers))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")

"""The training data loader ``initialize(training_data=...)`` builds.

Each rank reads its own share of every global batch: a ``DistributedSampler`` deals the
(shuffled) indices out round-robin, so the i-th micro-batches of all ranks together are
the i-th contiguous slice of the epoch's order.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ShardedDataLoader:
    """A ``DataLoader`` over this rank's share of ``dataset``; a new shuffle each epoch.

    Args:
        dataset: a map-style dataset.
        micro_batch_size: samples per rank per micro-step.
        rank, world_size: this rank's place among the data-parallel ranks.
        collate_fn: passed to ``DataLoader``.
        drop_last: drop the tail that does not fill a micro-batch on every rank.
        shuffle, seed: the sampler's order (the same on every rank).
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0):
        self.dataset = dataset
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 num_workers=num_workers)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


def is_map_dataset(obj) -> bool:
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
                                        and not isinstance(obj, torch.Tensor))

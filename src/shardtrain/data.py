"""The training data loader ``initialize(training_data=...)`` builds, and its resumable sampler.

Each rank reads its own share of every global batch: the sampler deals the (shuffled) indices
out round-robin, so the i-th micro-batches of all ranks together are the i-th contiguous
slice of the epoch's order. The order is ``torch.DistributedSampler``'s (``randperm`` seeded
with ``seed + epoch``), so a run is unchanged by the switch to this sampler.

The loader remembers how far into the epoch's order it has handed out batches. A checkpoint
stores that as a *global* position (samples of the epoch order consumed by all ranks), so a
resumed run, on any number of ranks, continues at the same global sample.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ShardedDataLoader", "ResumableDistributedSampler", "RepeatingLoader", "epoch_order",
           "is_map_dataset"]


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The global order of one epoch: the same on every rank and for every world size."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator()
    g.manual_seed(seed + epoch)  # DistributedSampler's rule: every rank draws the same order
    return torch.randperm(n, generator=g)


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler``'s order, able to start an epoch at a global position.

    From global position ``start`` of the epoch's order, the remaining indices are padded
    (repeating the epoch's first indices) to a multiple of ``world_size``, or cut down to one
    with ``drop_last``, and rank ``r`` takes every ``world_size``-th index from ``start + r``.
    With ``start=0`` this is exactly ``DistributedSampler``.

    Args:
        dataset_len: number of samples.
        world_size, rank: the data-parallel group.
        shuffle, seed: the epoch order (``randperm`` seeded ``seed + epoch``).
        drop_last: drop the tail that does not give every rank an index.
    """

    def __init__(self, dataset_len: int, world_size: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"sampler rank {rank} is outside the world of {world_size} ranks.")
        self.dataset_len, self.world_size, self.rank = dataset_len, world_size, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch the next iteration reads, from global position ``start`` of its order."""
        if not 0 <= start <= self.dataset_len:
            raise ValueError(f"sampler start {start} is outside the epoch's {self.dataset_len} "
                             "samples.")
        self.epoch, self.start = epoch, start

    def _global_indices(self) -> torch.Tensor:
        order = epoch_order(self.dataset_len, self.epoch, self.seed, self.shuffle)
        rest = order[self.start:]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.world_size]
        pad = -len(rest) % self.world_size
        while pad > 0:  # as DistributedSampler: repeat from the start of the epoch's order
            rest = torch.cat([rest, order[:pad]])
            pad = -len(rest) % self.world_size
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._global_indices()[self.rank:: self.world_size].tolist())

    def __len__(self) -> int:
        rest = self.dataset_len - self.start
        if self.drop_last:
            return rest // self.world_size
        return -(-rest // self.world_size)


class ShardedDataLoader:
    """A ``DataLoader`` over this rank's share of ``dataset``; a new shuffle each epoch.

    It can be checkpointed: :meth:`state_dict` gives the epoch and the global position in
    its order up to which batches were handed out, and :meth:`load_state_dict` makes the
    next iteration continue from there, on this or another world size.

    Args:
        dataset: a map-style dataset.
        micro_batch_size: samples per rank per micro-step.
        rank, world_size: this rank's place among the data-parallel ranks.
        collate_fn: passed to ``DataLoader``.
        drop_last: drop the tail that does not fill a micro-batch on every rank.
        shuffle, seed: the sampler's order (the same on every rank).
        transform: applied to each batch after collation (a sequence-parallel rank's slice).

    Example:
        >>> state = loader.state_dict()            # {"epoch": 0, "consumed": 120, ...}
        >>> other_loader.load_state_dict(state)    # its next batch is global sample 120
    """

    def __init__(self, dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 transform: Optional[Callable[[Any], Any]] = None):
        self.dataset = dataset
        self._transform = transform
        self.micro_batch_size, self.world_size = micro_batch_size, world_size
        self.sampler = ResumableDistributedSampler(len(dataset), world_size, rank, shuffle,
                                                   seed, drop_last)
        # DataLoader draws a base seed (for its workers) each time an iteration starts; from
        # its own generator, re-seeded per epoch, that draw neither moves the global torch RNG
        # nor depends on it, so a resumed run's RNG streams match the uninterrupted run's.
        self._generator = torch.Generator()
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 num_workers=num_workers, generator=self._generator)
        self.epoch = 0      # the epoch the next iteration reads
        self._start = 0     # where in that epoch's order it starts (after a load)
        # [epoch, consumed, end] of the running iteration; ``end`` is where it finishes
        self._reading: Optional[List[int]] = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self.sampler.set_epoch(self.epoch, self._start)
        self._generator.manual_seed(self.sampler.seed + self.epoch)
        end = min(self._start + len(self.loader) * self._per_batch(), self.sampler.dataset_len)
        self._reading = [self.epoch, self._start, end]
        self.epoch, self._start = self.epoch + 1, 0
        return self._counted(iter(self.loader), self._reading)

    def _per_batch(self) -> int:
        return self.micro_batch_size * self.world_size  # global samples per micro-step

    def _counted(self, batches: Iterator, reading: List[int]) -> Iterator:
        # Counted as handed out, not as drawn from the sampler: DataLoader workers prefetch.
        for batch in batches:
            reading[1] = min(reading[1] + self._per_batch(), reading[2])
            yield batch if self._transform is None else self._transform(batch)

    def state_dict(self) -> Dict[str, Any]:
        """Where the next batch comes from: ``epoch`` and ``consumed``, the global position
        in that epoch's order (a finished epoch counts as the start of the next)."""
        epoch, consumed = self.epoch, self._start
        if self._reading is not None and self._reading[1] < self._reading[2]:
            epoch, consumed = self._reading[:2]
        return {"epoch": epoch, "consumed": consumed, "dataset_len": self.sampler.dataset_len,
                "seed": self.sampler.seed, "shuffle": self.sampler.shuffle}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Makes the next iteration continue at ``state``'s global position."""
        if int(state["dataset_len"]) != self.sampler.dataset_len:
            raise ValueError(f"the saved data position is for a dataset of {state['dataset_len']} "
                             f"samples, but this one has {self.sampler.dataset_len}: load with "
                             "the same dataset to resume its order.")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.sampler.dataset_len:
            raise ValueError(f"the saved data position {consumed} is outside the dataset's "
                             f"{self.sampler.dataset_len} samples.")
        self.epoch, self._start = int(state["epoch"]), consumed
        self._reading = None


def is_map_dataset(obj) -> bool:
    return isinstance(obj, Dataset) or (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")
                                        and not isinstance(obj, torch.Tensor))


class RepeatingLoader:
    """Iterates ``loader`` for ever, starting it again each time it ends (DeepSpeed's
    ``RepeatingLoader``: what ``engine.train_batch()`` pulls its micro-batches from); a
    :class:`ShardedDataLoader` starts its next epoch's order each time."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:
                raise ValueError("RepeatingLoader: the loader yields no batches at all.") from None

"""The resumable sampler and loader position (one process: no process group needed).

The sampler must deal exactly what ``DistributedSampler`` deals, and a loader position saved
on one world size must continue the same global order on another.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from shardtrain.data import ResumableDistributedSampler, ShardedDataLoader, epoch_order


@pytest.mark.parametrize("n", [2, 10, 11, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_order_as_distributed_sampler(n, world, drop_last, shuffle):
    data = TensorDataset(torch.arange(n))
    for rank in range(world):
        theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=5,
                                    drop_last=drop_last)
        ours = ResumableDistributedSampler(n, world, rank, shuffle, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def loaders(world, micro, n=48, **kw):
    data = TensorDataset(torch.arange(n))
    return [ShardedDataLoader(data, micro, rank, world, **kw) for rank in range(world)]


def take(loaders, steps):
    """``steps`` micro-batches from every rank, merged into the global order they came in."""
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        batches = [next(it)[0].tolist() for it in iters]
        for j in range(max(len(b) for b in batches)):  # rank r holds positions r, r+world, ...
            out += [b[j] for b in batches if j < len(b)]
    return out, iters


@pytest.mark.parametrize("old,new", [((2, 3), (3, 2)), ((1, 6), (2, 3)), ((3, 2), (1, 6)),
                                     ((2, 3), (2, 3))])
def test_a_position_resumes_on_another_world_size(old, new):
    (world, micro), (world2, micro2) = old, new
    first, _ = take(loaders(world, micro), 5)  # 5 micro-steps of 6 samples
    state = loaders(world, micro)[0]
    it = iter(state)
    for _ in range(5):
        next(it)
    saved = state.state_dict()
    assert (saved["epoch"], saved["consumed"]) == (0, 30)
    resumed = loaders(world2, micro2)
    for loader in resumed:
        loader.load_state_dict(saved)
    rest, _ = take(resumed, 3)  # 18 samples: to the end of epoch 0
    assert first + rest == epoch_order(48, 0, 0, True).tolist()
    nxt, _ = take(resumed, 1)  # the next iteration starts epoch 1
    assert nxt == epoch_order(48, 1, 0, True)[:6].tolist()


def test_a_finished_epoch_resumes_at_the_next_one():
    loader = loaders(2, 3)[0]
    batches = list(loader)  # all of epoch 0 handed out
    assert len(batches) == 8
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == 0


def test_a_dropped_tail_counts_as_a_finished_epoch():
    loader = loaders(2, 4, n=50, drop_last=True)[0]  # 50 = 6 batches of 8, tail of 2 dropped
    it = iter(loader)
    for _ in range(6):
        next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["consumed"]) == (1, 0)


def test_a_position_from_another_dataset_is_refused():
    loader = loaders(2, 3)[0]
    with pytest.raises(ValueError, match="dataset of 50 samples, but this one has 48"):
        loader.load_state_dict({"epoch": 0, "consumed": 6, "dataset_len": 50})


def test_starting_an_iteration_leaves_the_global_rng_alone():
    """DataLoader draws a worker base seed per iteration: from the loader's own generator,
    so that a resumed run (which starts a new iteration) keeps the uninterrupted RNG stream."""
    loader = loaders(2, 3)[0]
    before = torch.get_rng_state()
    for _ in range(3):
        next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)

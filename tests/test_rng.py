"""Model-parallel random streams (shardtrain.rng; DeepSpeed's ``get_cuda_rng_tracker`` and
``model_parallel_cuda_manual_seed``): forks that leave the default stream alone, seeds per
tensor-parallel rank over 2 processes, and dropout inside a fork recomputed identically by
activation checkpointing."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F

from _dist import run_ranks
from shardtrain import activation_checkpointing as ac
from shardtrain.rng import MODEL_PARALLEL_RNG, RNGStatesTracker, get_rng_tracker, model_parallel_manual_seed


@pytest.fixture(autouse=True)
def clean():
    get_rng_tracker().reset()
    ac.reset()
    yield
    get_rng_tracker().reset()
    ac.reset()


def test_a_fork_draws_from_its_stream_and_leaves_the_default_one_alone():
    model_parallel_manual_seed(7, tp_rank=1)
    torch.manual_seed(7)
    want_default = torch.rand(4)
    torch.manual_seed(7 + 2718 + 1)
    want_stream = torch.rand(4), torch.rand(4)
    model_parallel_manual_seed(7, tp_rank=1)
    with get_rng_tracker().fork():
        first = torch.rand(4)
    default = torch.rand(4)  # as if the fork had not happened
    with get_rng_tracker().fork(MODEL_PARALLEL_RNG):
        second = torch.rand(4)  # the stream goes on where it stopped
    assert torch.equal(default, want_default)
    assert torch.equal(first, want_stream[0]) and torch.equal(second, want_stream[1])


def test_the_tracker_refuses_unknown_streams_and_reused_seeds():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="named 'a' exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with tracker.fork("missing"):
            pass
    saved = tracker.get_states()
    with tracker.fork("a"):
        torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        again = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), again)


class ForkedDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        with get_rng_tracker().fork():
            h = F.dropout(h, 0.5)
        return F.dropout(torch.tanh(h), 0.3)  # the default stream too


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing_recomputes_the_same_dropout_masks_inside_a_fork(use_reentrant):
    torch.manual_seed(0)
    layer = ForkedDropout()
    x = torch.randn(8, 16, requires_grad=True)

    def grads(checkpointed: bool):
        model_parallel_manual_seed(3)
        layer.zero_grad()
        x.grad = None
        out = ac.checkpoint(layer, x, use_reentrant=use_reentrant) if checkpointed else layer(x)
        torch.rand(5)  # other draws between forward and backward, on both streams
        with get_rng_tracker().fork():
            torch.rand(5)
        out.pow(2).sum().backward()
        return out.detach(), layer.fc.weight.grad.clone(), x.grad.clone()

    plain, checkpointed = grads(False), grads(True)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)


def seeded_on_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    import deepspeed
    from shardtrain import comm

    class MPU:  # every rank its own tensor-parallel rank (a group of 2)
        def get_model_parallel_rank(self):
            return comm.get_rank()

    deepspeed.checkpointing.configure(mpu_=MPU())
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(11)
    default = torch.rand(6)
    with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
        stream = torch.rand(6)
    return {"default": default, "stream": stream}


def test_model_parallel_seed_differs_per_tensor_parallel_rank_only_in_the_stream():
    ranks = run_ranks("test_rng:seeded_on_ranks", 2, timeout=60)
    assert torch.equal(ranks[0]["default"], ranks[1]["default"])
    assert not torch.equal(ranks[0]["stream"], ranks[1]["stream"])
    torch.manual_seed(11 + 2718 + 1)
    assert torch.equal(ranks[1]["stream"], torch.rand(6))

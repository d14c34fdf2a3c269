"""shardtrain.memory.StateOffload in one process: storages freed in place and restored bit for
bit, views and identities kept, shared storages moved once, refusals before any move."""
from __future__ import annotations

import pytest
import torch

from shardtrain.memory import StateOffload, count_bytes


def _states():
    torch.manual_seed(0)
    flat = torch.randn(10)
    param = torch.nn.Parameter(flat[:6].view(2, 3))       # a view into a flat buffer
    grad = torch.randn(2, 3)
    moment = torch.randn(2, 3).to(torch.bfloat16)
    return flat, param, grad, moment


def test_offload_frees_the_storages_and_reload_restores_the_bytes():
    flat, param, grad, moment = _states()
    before = [t.clone() for t in (flat, grad, moment)]
    moved = StateOffload()
    freed = moved.offload({"lp_params": [param], "lp_grads": [grad], "optim_states": [moment]},
                          ["lp_params", "optim_states"])
    assert freed == flat.numel() * 4 + moment.numel() * 2 == moved.host_bytes
    assert flat.untyped_storage().nbytes() == 0 and param.untyped_storage().nbytes() == 0
    assert count_bytes({"all": [param, grad, moment]})["total"] == grad.numel() * 4
    assert moved.kinds == {"lp_params", "optim_states"}
    assert moved.reload() == freed and moved.kinds == set() and moved.host_bytes == 0
    for now, then in zip((flat, grad, moment), before):
        assert torch.equal(now, then) and now.dtype == then.dtype
    assert param.data_ptr() == flat.data_ptr()  # the view still points into the flat buffer
    param.data.mul_(2)
    assert torch.equal(flat[:6], before[0][:6] * 2)


def test_a_storage_named_by_two_kinds_moves_once_and_marks_both():
    flat, param, grad, _ = _states()
    master = flat[6:]                                        # same storage as the parameter
    moved = StateOffload()
    moved.offload({"lp_params": [param], "hp_params": [master], "lp_grads": [grad]}, ["hp_params"])
    assert moved.kinds == {"hp_params", "lp_params"} and moved.host_bytes == flat.numel() * 4
    moved.offload({"lp_params": [param], "hp_params": [master], "lp_grads": [grad]}, ["lp_params"])
    assert moved.host_bytes == flat.numel() * 4              # already away: not copied twice
    moved.reload()
    assert param.untyped_storage().nbytes() == flat.numel() * 4


def test_a_storage_that_cannot_be_freed_is_refused_before_anything_moves():
    fixed = torch.from_numpy(__import__("numpy").arange(4, dtype="float32"))
    other = torch.randn(3)
    moved = StateOffload()
    with pytest.raises(ValueError, match="cannot be freed in place"):
        moved.offload({"optim_states": [other, fixed]}, ["optim_states"])
    assert other.untyped_storage().nbytes() == 12 and moved.kinds == set()

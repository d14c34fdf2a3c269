"""What the optimizer holds in place of each parameter (shardtrain.zero._optview), and a real
torch optimizer stepping through it against the same optimizer on a plain fp32 model."""
from __future__ import annotations

from typing import Callable, List

import pytest
import torch

from shardtrain.zero._optview import OptimizerView, full_slices
from shardtrain.zero._shards import shard_range

HALF = [torch.bfloat16, torch.float16]


def param(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=gen).to(dtype))


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- the three kinds of optimizer tensor ------------------------------------------------------------


def test_whole_fp32_slices_are_the_parameters_themselves():
    params = [param(4, 5), param(3, seed=1)]
    view = OptimizerView(params, full_slices(params))
    assert full_slices(params) == [(0, 20), (0, 3)]
    assert all(t is p for t, p in zip(view.tensors, params))
    assert view.masters == []


def test_a_partial_fp32_slice_is_a_view_that_updates_the_parameter():
    p = param(4, 5)
    before = p.detach().clone()
    view = OptimizerView([p], [(3, 11)])
    (t,) = view.tensors
    assert isinstance(t, torch.nn.Parameter) and t.shape == (8,) and t.dtype == torch.float32
    assert torch.equal(t, p.view(-1)[3:11]) and shares_memory(t, p) and view.masters == []
    with torch.no_grad():
        t.mul_(2)
    assert torch.equal(p.view(-1)[3:11], before.view(-1)[3:11] * 2)
    assert torch.equal(p.view(-1)[:3], before.view(-1)[:3])
    assert torch.equal(p.view(-1)[11:], before.view(-1)[11:])


def test_an_empty_slice_has_no_optimizer_tensor():
    view = OptimizerView([param(2)], [(2, 2)])
    assert view.tensors == [None] and view.masters == []


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("lo, hi", [(0, 20), (5, 12)])
def test_16_bit_parameters_get_an_fp32_master(dtype, lo, hi):
    p = param(4, 5, dtype=dtype)
    view = OptimizerView([p], [(lo, hi)])
    (master,) = view.tensors
    assert master.dtype == torch.float32 and not shares_memory(master, p)
    assert master.shape == (p.shape if (lo, hi) == (0, p.numel()) else (hi - lo,))
    assert torch.equal(master.view(-1), p.detach().view(-1)[lo:hi].float())
    assert len(view.masters) == 1 and view.masters[0] is master


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_offloaded_masters_live_on_the_host_apart_from_the_parameters(dtype):
    params = [param(4, 5, dtype=dtype), param(3, dtype=dtype, seed=1)]
    view = OptimizerView(params, [(0, 20), (1, 3)], offload=True)
    for t, p in zip(view.tensors, params):
        assert t.device.type == "cpu" and t.dtype == torch.float32
        assert t is not p and not shares_memory(t, p)
    assert [id(m) for m in view.masters] == [id(t) for t in view.tensors]


# -- masters and parameters ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype, offload", [(torch.bfloat16, False), (torch.float16, False),
                                            (torch.float32, True)])
def test_copy_masters_to_params_writes_only_the_slices(dtype, offload):
    params = [param(4, 5, dtype=dtype), param(6, dtype=dtype, seed=1)]
    before = [p.detach().clone() for p in params]
    slices = [(0, 20), (2, 5)]
    view = OptimizerView(params, slices, offload=offload)
    with torch.no_grad():
        for master in view.masters:
            master.add_(0.5)
    view.copy_masters_to_params()
    for p, old, master, (lo, hi) in zip(params, before, view.tensors, slices):
        flat, old = p.detach().view(-1), old.view(-1)
        assert torch.equal(flat[lo:hi], master.detach().view(-1).to(dtype))
        assert torch.equal(flat[:lo], old[:lo]) and torch.equal(flat[hi:], old[hi:])


@pytest.mark.parametrize("dtype", HALF)
def test_refresh_masters_rereads_all_or_the_given_parameters(dtype):
    a, b = param(4, 5, dtype=dtype), param(6, dtype=dtype, seed=1)
    view = OptimizerView([a, b], [(0, 20), (1, 4)])
    with torch.no_grad():
        a.fill_(3)
        b.fill_(4)
    view.refresh_masters([b])  # only b's master
    assert not (view.tensors[0] == 3).any() and (view.tensors[1] == 4).all()
    view.refresh_masters()
    assert (view.tensors[0] == 3).all() and view.tensors[0].shape == a.shape


# -- adopting a client optimizer ------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True])
def test_adopt_repoints_the_groups_and_keeps_their_hyperparameters(offload):
    a, b, c, outsider = param(6), param(2, seed=1), param(3, seed=2), param(2, seed=3)
    optimizer = torch.optim.SGD([{"params": [a, b], "lr": 0.1, "momentum": 0.9},
                                 {"params": [c, outsider], "lr": 0.5, "weight_decay": 0.01}])
    settings = [{k: v for k, v in g.items() if k not in ("params", "foreach")}
                for g in optimizer.param_groups]
    view = OptimizerView([a, b, c], [(2, 4), (2, 2), (0, 3)], offload=offload)
    view.adopt(optimizer)
    first, second = (g["params"] for g in optimizer.param_groups)
    assert [id(t) for t in first] == [id(view.tensors[0])]  # b holds nothing here: dropped
    assert [id(t) for t in second] == [id(view.tensors[2]), id(outsider)]
    assert (view.tensors[2] is c) != offload
    assert [{k: v for k, v in g.items() if k not in ("params", "foreach")}
            for g in optimizer.param_groups] == settings
    # Offloaded steps run vectorised on the host unless the user chose otherwise.
    assert [g["foreach"] for g in optimizer.param_groups] == [True if offload else None] * 2


def test_adopt_leaves_an_explicit_foreach_alone():
    p = param(4)
    optimizer = torch.optim.Adam([p], foreach=False)
    OptimizerView([p], [(0, 4)], offload=True).adopt(optimizer)
    assert optimizer.param_groups[0]["foreach"] is False


# -- gradients -------------------------------------------------------------------------------------


def test_load_grads_reshapes_converts_and_skips():
    whole, half, empty, unused = (param(2, 3), param(4, dtype=torch.bfloat16, seed=1),
                                  param(2, seed=2), param(5, seed=3))
    view = OptimizerView([whole, half, empty, unused], [(0, 6), (1, 3), (2, 2), (0, 5)])
    unused.grad = torch.ones(5)
    flat = torch.arange(6.0)
    half_grad = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    out = view.load_grads([flat, half_grad, torch.ones(1), None])

    assert whole.grad.shape == (2, 3) and torch.equal(whole.grad.view(-1), flat)
    assert shares_memory(whole.grad, flat)  # a flat shard of a whole parameter: reshaped, not copied
    master = view.tensors[1]
    assert master.grad.dtype == torch.float32 and master.grad.tolist() == [1.5, -2.0]
    assert view.tensors[3] is unused and unused.grad is None
    assert [id(g) for g in out] == [id(whole.grad), id(master.grad)]


def test_release_grads_keeps_the_parameters_own_gradient():
    p, q = param(4), param(4, dtype=torch.bfloat16, seed=1)
    view = OptimizerView([p, q], full_slices([p, q]))
    view.load_grads([torch.ones(4), torch.ones(4, dtype=torch.bfloat16)])
    view.release_grads()
    assert p.grad is not None and view.tensors[1].grad is None


# -- a real optimizer step through the view -----------------------------------------------------


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)


def small_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)  # parameters of 20, 4, 8 and 2 elements: some empty at world 3
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


@pytest.mark.parametrize("make", [adamw, sgd])
@pytest.mark.parametrize("dtype, offload", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float16, False), (torch.float32, True)])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_steps_equal_the_plain_optimizer(make: Callable, dtype, offload, world):
    """Every rank's view steps its own slices of one shared model; together they must do
    exactly what the same optimizer does on an fp32 copy given the same gradients."""
    model = small_model(dtype)
    params = list(model.parameters())
    reference = [p.detach().float().clone().requires_grad_() for p in params]
    ref_opt = make(reference)
    if offload:
        ref_opt.param_groups[0]["foreach"] = True  # as adopt sets it for an offloaded step
    views: List[OptimizerView] = []
    optimizers = []
    for rank in range(world):
        view = OptimizerView(params, [shard_range(p.numel(), world, rank) for p in params],
                             offload=offload)
        optimizer = make(params)
        view.adopt(optimizer)
        views.append(view)
        optimizers.append(optimizer)

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 5, generator=gen).to(dtype)
        for p in params:
            p.grad = None
        model(x).float().square().mean().backward()
        grads = [p.grad.detach().clone() for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.to(torch.float32, copy=True)  # foreach SGD adds into its gradients
        ref_opt.step()
        for view, optimizer in zip(views, optimizers):
            view.load_grads([g.view(-1)[lo:hi] for g, (lo, hi) in zip(grads, view.slices)])
            optimizer.step()
            view.copy_masters_to_params()
            view.release_grads()

    for p, r in zip(params, reference):
        assert torch.equal(p.detach(), r.detach().to(dtype))

"""The two halves of a split backward (the zero-bubble schedule's), in one process: the input
half gives the inputs' gradients and touches no parameter; the weight half then gives every
parameter the gradient of one whole backward, through layer norms, an embedding, a weight
used twice, a checkpointed region and an output beside the inputs' paths; and the two halves
together do the floating-point work of one backward, not more."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from shardtrain.pipe.split_backward import input_grads, supported


class Stage(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.norm, self.emb = nn.LayerNorm(width), nn.Embedding(5, width)
        self.shared = nn.Parameter(torch.randn(width, width) / 4)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x, recompute: bool = False):
        h = self.a(x)
        h = checkpoint(lambda t: self.norm(torch.relu(t)), h, use_reentrant=False) \
            if recompute else self.norm(torch.relu(h))
        h = self.b(h @ self.shared) + self.emb.weight[:1]
        return torch.tanh(h @ self.shared) * self.scale, self.scale * 2


def _whole(stage, x, grads, recompute=False):
    x = x.detach().requires_grad_(x.requires_grad)
    torch.autograd.backward(stage(x, recompute), grads)
    out = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    return out, x.grad


def test_torch_restarts_autograd_at_a_node():
    assert supported() is None


def test_the_halves_give_one_backwards_gradients():
    torch.manual_seed(0)
    stage = Stage()
    grads = [torch.randn(4, 16), torch.randn(16)]
    for recompute in (False, True):
        x = torch.randn(4, 16, requires_grad=True)
        ref, ref_x = _whole(stage, x, grads, recompute)
        arrived = []
        hooks = [p.register_post_accumulate_grad_hook(lambda t, name=name, seen=arrived: seen.append(name))
                 for name, p in stage.named_parameters()]
        half = input_grads(stage(x, recompute), grads, [x], list(stage.parameters()))
        assert torch.equal(x.grad, ref_x)
        assert all(p.grad is None for p in stage.parameters()) and not arrived
        half.run()
        for name, p in stage.named_parameters():
            assert torch.allclose(p.grad, ref[name], atol=1e-6), name
        assert sorted(arrived) == sorted(n for n, _ in stage.named_parameters())
        for hook in hooks:
            hook.remove()
        stage.zero_grad(set_to_none=True)


def test_a_first_stage_has_only_a_weight_half_and_extra_gradients_join_it():
    torch.manual_seed(0)
    stage = Stage()
    x, grads = torch.randn(4, 16), [torch.randn(4, 16), torch.randn(16)]
    ref, _ = _whole(stage, x, grads)
    half = input_grads(stage(x), grads, [], list(stage.parameters()))
    assert all(p.grad is None for p in stage.parameters())
    added = torch.randn(16, 16)
    half.run(extra=[(stage.shared, added)])
    assert torch.allclose(stage.shared.grad, ref["shared"] + added, atol=1e-6)
    assert torch.allclose(stage.a.weight.grad, ref["a.weight"], atol=1e-6)


def test_the_halves_do_one_backwards_work():
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x, grad = torch.randn(32, 64, requires_grad=True), torch.randn(32, 64)
    out = stage(x)
    with FlopCounterMode(display=False) as whole:
        torch.autograd.backward([out], [grad])
    out = stage(x)
    with FlopCounterMode(display=False) as first:
        half = input_grads([out], [grad], [x], list(stage.parameters()))
    with FlopCounterMode(display=False) as second:
        half.run()
    # each linear layer's backward is two products of 32 x 64 x 64: one per half
    assert first.get_total_flops() == second.get_total_flops() == whole.get_total_flops() // 2


def test_a_region_whose_backward_runs_whole_is_refused_by_name():
    """Reentrant checkpointing computes its weights' gradients inside the input half: named,
    with the fix."""
    import pytest
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    out = checkpoint(layer, x, use_reentrant=True)
    with pytest.raises(RuntimeError, match="CheckpointFunctionBackward.*use_reentrant"):
        input_grads([out], [torch.ones_like(out)], [x], list(layer.parameters()))

"""Muon's optimizer block (DeepSpeed 0.19.8's keys and defaults, checked values), its split of
the parameters, and its step against the formulas written out (one process, fp32)."""
from __future__ import annotations

import math

import pytest
import torch

from shardtrain.optim import MuonWithAuxAdam, build_optimizer, uses_muon


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(7, 4)
        self.proj = torch.nn.Linear(4, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.lm_head = torch.nn.Linear(6, 7, bias=False)


def _build(params=None, model=None):
    model = model or _Net()
    names = {id(p): n for n, p in model.named_parameters()}
    return model, build_optimizer({"type": "Muon", "params": params or {}},
                                  list(model.parameters()), param_names=names)


def test_split_and_defaults_follow_deepspeed():
    model, opt = _build()
    assert isinstance(opt, MuonWithAuxAdam)
    muon, adam = opt.param_groups
    assert muon["params"] == [model.proj.weight]  # embed_tokens and lm_head go to AdamW
    assert (muon["lr"], muon["momentum"], muon["weight_decay"], muon["ns_method"]) == (0.02, 0.95, 0.0, "gram")
    assert (adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == (3e-4, (0.9, 0.95), 1e-10, 0.0)
    assert len(adam["params"]) == 5
    assert uses_muon("layers.0.mlp.up_proj.weight", (8, 4)) and not uses_muon("x.bias", (8,))
    assert not uses_muon("model.EMBED.weight", (8, 4))


def test_shared_lr_then_muon_lr_and_adam_lr_then_the_groups_own_keys():
    _, opt = _build({"lr": 0.1, "weight_decay": 0.01})
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.1]
    _, opt = _build({"lr": 0.1, "muon_lr": 0.05, "adam_lr": 0.001, "betas": [0.8, 0.9]})
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.001]
    assert opt.param_groups[1]["betas"] == (0.8, 0.9)
    model = _Net()
    groups = [{"params": [model.proj.weight, model.proj.bias], "weight_decay": 0.5},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("proj")]}]
    opt = build_optimizer({"type": "muon", "params": {"weight_decay": 0.1}}, groups,
                          param_names={id(p): n for n, p in model.named_parameters()})
    assert [(g["use_muon"], g["weight_decay"]) for g in opt.param_groups] == \
        [(True, 0.5), (False, 0.5), (False, 0.1)]


@pytest.mark.parametrize("params, error, match", [
    ({"momentum": 1.5}, ValueError, r"momentum=1\.5"),
    ({"lr": -1}, ValueError, r"lr=-1"),
    ({"betas": [0.9]}, ValueError, r"betas=\[0\.9\]"),
    ({"ns_method": "svd"}, ValueError, r"ns_method='svd'.*'gram' or 'standard'"),
    ({"momentun": 0.9}, ValueError, r"momentun.*Did you mean 'momentum'"),
    ({"per_head_muon": True}, NotImplementedError, r"per_head_muon"),
])
def test_bad_values_are_named(params, error, match):
    with pytest.raises(error, match=match):
        _build(params)


def _reference_muon(w, grads, lr, beta, wd):
    buf = torch.zeros_like(w)
    for g in grads:
        buf = beta * buf + (1 - beta) * g
        u = (1 - beta) * g + beta * buf
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
        x = x.T if u.shape[0] > u.shape[1] else x
        w = w * (1 - lr * wd) - lr * math.sqrt(max(1, u.shape[0] / u.shape[1])) * x
    return w


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])
def test_muon_step_is_the_formula(shape):
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(shape))
    start = w.detach().clone()
    grads = [torch.randn(shape) for _ in range(3)]
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": True, "lr": 0.05, "momentum": 0.9,
                            "weight_decay": 0.1}])
    for g in grads:
        w.grad = g.clone()
        opt.step()
    want = _reference_muon(start, grads, 0.05, 0.9, 0.1)
    assert torch.allclose(w.detach(), want, atol=1e-6)


def test_adam_half_is_torch_adamw():
    torch.manual_seed(2)
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    b.data.copy_(a.data)
    ours = MuonWithAuxAdam([{"params": [a], "use_muon": False, "lr": 0.01, "betas": (0.8, 0.9),
                             "eps": 1e-8, "weight_decay": 0.1}])
    theirs = torch.optim.AdamW([b], lr=0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.allclose(a, b, atol=1e-7)


def test_a_weight_without_gradient_is_left_alone():
    w, v = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2, 3))
    opt = MuonWithAuxAdam([{"params": [w, v], "use_muon": True, "weight_decay": 0.1}])
    v.grad = torch.randn(2, 3)
    opt.step()
    assert torch.equal(w.detach(), torch.ones(3, 2)) and w not in opt.state
    assert not torch.equal(v.detach(), torch.ones(2, 3))

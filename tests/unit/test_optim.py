"""Tests for shardtrain.optim: DeepSpeed-compatible optimizer and LR scheduler building."""
from __future__ import annotations

import logging
import math
from typing import List

import pytest
import torch

from shardtrain.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_optimizer,
    build_scheduler,
)

TOL = 1e-6


def _sgd(lr: float = 0.01, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr)


def _adamw(lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lr(opt: torch.optim.Optimizer) -> float:
    return float(opt.param_groups[0]["lr"])


def _run(sched, opt, n: int) -> List[float]:
    """[init lr, lr after t=0, ..., lr after t=n-1]."""
    out = [_lr(opt)]
    for _ in range(n):
        sched.step()
        out.append(_lr(opt))
    return out


def _assert_close(got: List[float], want: List[float]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, abs=TOL), f"index {i}: {g} != {w}"


# ----------------------------------------------------------------- checked values
WARMUP_LOG = [0, 0, .0030103, .0047712, .0060206, .0069897, .0077815, .0084510, .0090309,
              .0095424, .01, .01, .01, .01]
WARMUP_LINEAR = [0, 0, .001, .002, .003, .004, .005, .006, .007, .008, .009, .01, .01, .01]


@pytest.mark.parametrize("kind, want", [("log", WARMUP_LOG), ("linear", WARMUP_LINEAR)])
def test_warmup_lr_checked_values(kind, want):
    opt = _sgd(lr=0.5)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type=kind)
    _assert_close(_run(sched, opt, 13), want)


def test_warmup_decay_linear_checked_values():
    opt = _sgd(lr=0.5)
    sched = WarmupDecayLR(opt, total_num_steps=20, warmup_max_lr=0.01, warmup_num_steps=10,
                          warmup_type="linear")
    got = _run(sched, opt, 25)
    decay = [.01, .009, .008, .007, .006, .005, .004, .003, .002, .001]  # t = 10..19
    _assert_close(got, WARMUP_LINEAR[:11] + decay + [0.0] * 5)


def test_warmup_cosine_linear_checked_values():
    opt = _sgd(lr=0.01)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=10, cos_min_ratio=1e-4,
                           warmup_type="linear")
    got = _run(sched, opt, 23)
    tail = [.0097553, .0090452, .0079391, .0065454, .0050005, .0034556, .0020619, .00095582,
            .00024569]  # t = 10..18
    _assert_close(got, WARMUP_LINEAR[:11] + tail + [1e-6] * 4)


def test_warmup_cosine_log_equals_warmup_log():
    opt = _sgd(lr=0.01)
    sched = WarmupCosineLR(opt, total_num_steps=20, warmup_num_steps=10, warmup_type="log")
    _assert_close(_run(sched, opt, 10), WARMUP_LOG[:11])


def test_onecycle_checked_values():
    opt = _adamw()
    sched = OneCycle(opt, cycle_min_lr=.001, cycle_max_lr=.01, decay_lr_rate=.5,
                     cycle_first_step_size=4, cycle_second_step_size=4, decay_step_size=2,
                     cycle_min_mom=.8, cycle_max_mom=.9, decay_mom_rate=.1)
    want = [(.001, .8), (.00325, .875), (.0055, .85), (.00775, .825), (.01, .8), (.00775, .825),
            (.0055, .85), (.00325, .875), (.001, .9), (.0008, .945), (.00066667, .99),
            (.00057143, 1.035)]
    got = []
    for i in range(len(want)):
        if i:
            sched.step()
        group = opt.param_groups[0]
        assert group["betas"][1] == pytest.approx(0.99)
        got.append((_lr(opt), group["betas"][0]))
    _assert_close([g[0] for g in got], [w[0] for w in want])
    _assert_close([g[1] for g in got], [w[1] for w in want])


@pytest.mark.parametrize("staircase, want", [
    (False, [.001, .0015, .002, .0025, .003]),
    (True, [.001, .001, .002, .002, .003]),
])
def test_lr_range_test_checked_values(staircase, want):
    opt = _sgd(lr=0.5)
    sched = LRRangeTest(opt, lr_range_test_min_lr=.001, lr_range_test_step_size=2,
                        lr_range_test_staircase=staircase)
    _assert_close(_run(sched, opt, 4), want)


def test_warmup_max_unset_two_groups():
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": .01},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": .02}], lr=1.0)
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    want = [(0, 0), (0, 0), (.0025, .005), (.005, .01), (.0075, .015), (.01, .02)]
    for i, pair in enumerate(want):
        if i:
            sched.step()
        _assert_close([g["lr"] for g in opt.param_groups], list(pair))
    _assert_close(sched.get_last_lr(), [.01, .02])


# ----------------------------------------------------------------- scheduler mechanics
def _make(name: str, opt):
    kwargs = {
        "WarmupLR": dict(warmup_max_lr=.01, warmup_num_steps=10),
        "WarmupDecayLR": dict(total_num_steps=20, warmup_max_lr=.01, warmup_num_steps=10),
        "WarmupCosineLR": dict(total_num_steps=20, warmup_num_steps=10),
        "OneCycle": dict(cycle_min_lr=.001, cycle_max_lr=.01, cycle_first_step_size=4,
                         decay_lr_rate=.5, decay_step_size=2),
        "LRRangeTest": dict(lr_range_test_min_lr=.001, lr_range_test_step_size=2),
    }[name]
    return build_scheduler({"type": name, "params": kwargs}, opt)


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"])
def test_state_dict_round_trip_continues(name):
    opt_a = _adamw()
    a = _make(name, opt_a)
    reference = _run(a, opt_a, 14)
    opt_b = _adamw()
    b = _make(name, opt_b)
    for _ in range(6):
        b.step()
    state = b.state_dict()
    assert state == {"last_batch_iteration": 5}
    opt_c = _adamw()
    c = _make(name, opt_c)
    c.load_state_dict(state)
    assert c.last_batch_iteration == 5
    _assert_close(_run(c, opt_c, 8)[1:], reference[7:])


def test_step_with_explicit_iteration_and_get_lr(caplog):
    opt = _sgd(lr=0.5)
    sched = WarmupLR(opt, warmup_max_lr=.01, warmup_num_steps=10, warmup_type="linear")
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        assert sched.get_lr() == [0.0]
    assert "before the first step" in caplog.text
    sched.step(5)
    assert sched.last_batch_iteration == 5
    _assert_close(sched.get_lr() + sched.get_last_lr(), [.005, .005])


def test_tensor_lr_filled_in_place():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(.001)


def test_wrapped_optimizer_is_unwrapped():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    opt = _sgd()
    sched = WarmupLR(Wrapper(opt), warmup_max_lr=.01, warmup_num_steps=10)
    assert sched.optimizer is opt
    assert isinstance(build_scheduler({"type": "StepLR", "params": {"step_size": 1}}, Wrapper(opt)),
                      torch.optim.lr_scheduler.StepLR)


def test_per_group_list_values_and_length_check():
    opt = _sgd(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2,
                     warmup_type="linear")
    _assert_close([g["lr"] for g in opt.param_groups], [0.0, 0.1])
    sched.step(5)
    _assert_close([g["lr"] for g in opt.param_groups], [1.0, 0.2])
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_warmup_num_steps_validated(bad):
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(_sgd(), warmup_num_steps=bad)


def test_onecycle_and_range_test_validation():
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(_adamw(), .001, .01, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_second_step_size"):
        OneCycle(_adamw(), .001, .01, cycle_first_step_size=4, cycle_second_step_size=-1)
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(_sgd(), lr_range_test_step_size=0)


def test_onecycle_without_betas_warns(caplog):
    opt = _sgd()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        sched = OneCycle(opt, .001, .01, cycle_first_step_size=4)
    assert "momentum cycling is disabled" in caplog.text
    assert "betas" not in opt.param_groups[0] and sched.get_mom() is None
    assert _lr(opt) == pytest.approx(.001)


def test_onecycle_stairs():
    opt = _adamw()
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    # b = t+1 = 1..8: rising 1/4, 2/4, 3/4, 4/4 -> floor(pos*2)/2; falling mirrors it.
    _assert_close(_run(sched, opt, 8)[1:], [0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


def test_unknown_warmup_type_falls_back_to_log(caplog):
    opt = _sgd()
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        sched = WarmupLR(opt, warmup_max_lr=.01, warmup_num_steps=10, warmup_type="cubic")
    assert "cubic" in caplog.text and sched.warmup_type == "log"


# ----------------------------------------------------------------- build_scheduler
def test_build_torch_scheduler_by_name():
    opt = _sgd(lr=1.0)
    sched = build_scheduler({"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(2):
        opt.step()
        sched.step()
    assert _lr(opt) == pytest.approx(0.5)


def test_build_scheduler_errors():
    with pytest.raises(ValueError, match="Did you mean 'WarmupLR'"):
        build_scheduler({"type": "warmuplr", "params": {}}, _sgd())
    with pytest.raises(ValueError, match="not a known LR scheduler"):
        build_scheduler({"type": "NoSuchThing"}, _sgd())
    with pytest.raises(ValueError, match=r"WarmupLR.*warmup_steps"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_steps": 3}}, _sgd())
    with pytest.raises(ValueError, match=r"OneCycle.*cycle_max_lr"):
        build_scheduler({"type": "OneCycle"}, _sgd())
    with pytest.raises(TypeError):
        build_scheduler({"type": 3}, _sgd())


def test_build_scheduler_without_params_uses_defaults():
    opt = _sgd(lr=0.01)
    sched = build_scheduler({"type": "WarmupLR"}, opt)
    assert isinstance(sched, WarmupLR) and sched.warmup_num_steps == 1000 and _lr(opt) == 0.0


# ----------------------------------------------------------------- build_optimizer
def _tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("type_name", ["Adam", "adam", "ADAMW", "AdamW"])
def test_adam_is_decoupled_by_default(type_name):
    ours_model, ref_model = _tiny_model(), _tiny_model()
    opt = build_optimizer({"type": type_name, "params": {"lr": 0.01}}, ours_model.parameters())
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.0 and group["eps"] == 1e-8 and tuple(group["betas"]) == (0.9, 0.999)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.0)
    _train(ours_model, opt)
    _train(ref_model, ref)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_adam_with_decay_matches_adamw():
    ours_model, ref_model = _tiny_model(), _tiny_model()
    opt = build_optimizer({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}},
                          ours_model.parameters())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, weight_decay=0.1)
    _train(ours_model, opt)
    _train(ref_model, ref)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_adam_w_mode_false_gives_torch_adam():
    params = list(_tiny_model().parameters())
    opt = build_optimizer({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, params)
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["weight_decay"] == 0.1
    opt = build_optimizer({"type": "AdamW", "params": {"adam_w_mode": False}}, params)
    assert type(opt) is torch.optim.AdamW


def test_defaults_and_torch_adam():
    params = list(_tiny_model().parameters())
    opt = build_optimizer({"type": "AdamW"}, params)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0.0
    opt = build_optimizer({"type": "adam", "params": {"torch_adam": True}}, params)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.01
    opt = build_optimizer({"type": "adam", "params": {"bias_correction": True, "betas": [0.8, 0.9]}}, params)
    assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9)


def test_adagrad():
    opt = build_optimizer({"type": "Adagrad", "params": {"lr": 0.05}}, _tiny_model().parameters())
    assert type(opt) is torch.optim.Adagrad and opt.param_groups[0]["lr"] == 0.05


def test_torch_optimizer_by_exact_name():
    opt = build_optimizer({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, _tiny_model().parameters())
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="Did you mean 'SGD'"):
        build_optimizer({"type": "sgd", "params": {"lr": 0.1}}, _tiny_model().parameters())


def test_optimizer_errors():
    params = list(_tiny_model().parameters())
    with pytest.raises(ValueError, match=r"adam.*'betaz'.*accepted keys.*'betas'"):
        build_optimizer({"type": "adam", "params": {"betaz": [0.9, 0.99]}}, params)
    with pytest.raises(ValueError, match=r"SGD.*'nesterovv'"):
        build_optimizer({"type": "SGD", "params": {"lr": 0.1, "nesterovv": True}}, params)
    with pytest.raises(ValueError, match="gradient_clipping"):
        build_optimizer({"type": "adam", "params": {"max_grad_norm": 1.0}}, params)
    with pytest.raises(ValueError, match="amsgrad"):
        build_optimizer({"type": "adam", "params": {"amsgrad": True}}, params)
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer({"type": "adam", "params": {"bias_correction": False}}, params)
    with pytest.raises(TypeError):
        build_optimizer({"type": 5}, params)
    for name in ("lamb", "Lion"):
        with pytest.raises(NotImplementedError, match="AdamW"):
            build_optimizer({"type": name}, params)


def test_max_grad_norm_zero_is_accepted():
    opt = build_optimizer({"type": "adam", "params": {"max_grad_norm": 0.0}}, _tiny_model().parameters())
    assert type(opt) is torch.optim.AdamW


def test_empty_param_groups_dropped():
    model = _tiny_model()
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.1},
              {"params": [], "weight_decay": 0.0},
              {"params": list(model[2].parameters()), "lr": 0.5}]
    opt = build_optimizer({"type": "adamw", "params": {"lr": 0.01}}, groups)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["lr"] == 0.5


def test_schedule_on_built_optimizer_end_to_end():
    model = _tiny_model()
    opt = build_optimizer({"type": "Adam", "params": {"lr": 0.01}}, model.parameters())
    sched = build_scheduler({"type": "WarmupCosineLR", "params": {
        "total_num_steps": 20, "warmup_num_steps": 10, "warmup_type": "linear"}}, opt)
    assert _lr(opt) == 0.0
    sched.step(10)
    assert _lr(opt) == pytest.approx(.0097553, abs=TOL)
    assert math.isclose(sched.get_lr_ratio(), .97553, abs_tol=1e-4)

"""Engine behaviour that one process shows: DeepSpeed-style entry points, counters,
logging, profiler ranges and the loss-scale rules."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

import shardtrain
from shardtrain.precision import LossScaler

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def step(engine, n=1):
    for _ in range(n):
        loss = engine(torch.randn(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def test_initialize_reads_deepspeed_config_from_args(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    parser = shardtrain.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    engine, optimizer, loader, scheduler = shardtrain.initialize(
        args=args, model=model(), model_parameters=model().parameters())
    assert engine.train_micro_batch_size_per_gpu() == 2 and loader is None and scheduler is None
    assert isinstance(optimizer, torch.optim.SGD) and args.local_rank == 0


def test_initialize_errors_name_the_fix(tmp_path):
    args = argparse.Namespace(deepspeed_config="a.json")
    # each is a ValueError, and an AssertionError as DeepSpeed raises for the same mistakes
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="keep one"):
            shardtrain.initialize(args=args, model=model(), config=CONFIG)
        with pytest.raises(error, match="needs a config"):
            shardtrain.initialize(model=model())
        with pytest.raises(error, match="needs model="):
            shardtrain.initialize(config=CONFIG)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        shardtrain.initialize(model=lambda x: x, config=CONFIG)
    engine, *_ = shardtrain.initialize(model=model(), config={"train_batch_size": 2})
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        engine.step()


def test_an_empty_config_file_is_named_with_a_minimal_config(tmp_path):
    """A new user's first train.json, still empty: the error names the file, not a batch key."""
    path = tmp_path / "train.json"
    path.write_text("\n")
    with pytest.raises(shardtrain.ConfigError, match=r"'.*train\.json' is empty\. A minimal config: "
                       r'\{"train_micro_batch_size_per_gpu": 8'):
        shardtrain.initialize(model=model(), config=str(path))


def test_steps_per_print_logs_lr_scale_and_throughput(records):
    engine, *_ = shardtrain.initialize(model=model(), config={**CONFIG, "steps_per_print": 2})
    step(engine, 4)
    lines = [r.getMessage() for r in records if "step=" in r.getMessage()]
    assert len(lines) == 2 and "step=2" in lines[0] and "step=4" in lines[1]
    assert "lr=[0.1]" in lines[0] and "loss_scale=1" in lines[0] and "samples/s=" in lines[0]


def test_log_dist_once(records):
    shardtrain.log_dist("hello", ranks=[0])
    shardtrain.log_dist("not me", ranks=[5])
    for _ in range(3):
        shardtrain.log_dist_once("only once", ranks=[0])
    messages = [r.getMessage() for r in records]
    assert messages.count("hello") == 1 and "not me" not in messages
    assert messages.count("only once") == 1


def test_profiler_ranges_around_forward_backward_step():
    engine, *_ = shardtrain.initialize(model=model(), config=CONFIG)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(engine)
    names = {e.name for e in prof.events()}
    assert {"shardtrain.forward", "shardtrain.backward", "shardtrain.step"} <= names


def test_boundary_override_and_unmanaged_accumulation():
    engine, *_ = shardtrain.initialize(model=model(),
                                       config={**CONFIG, "gradient_accumulation_steps": 4})
    engine.set_gradient_accumulation_boundary(True)  # sticky: every step is a boundary
    step(engine, 2)
    assert engine.global_steps == 2 and engine.micro_steps == 2
    free, *_ = shardtrain.initialize(model=model(), config={
        **CONFIG, "gradient_accumulation_steps": 2, "managed_gradient_accumulation": False})
    for _ in range(3):
        loss = free(torch.randn(2, 4)).pow(2).mean()
        free.backward(loss)
    free.step()  # every step() is a boundary; samples follow the backward calls
    assert free.global_steps == 1 and free.global_samples == 3 * 2
    with pytest.raises(RuntimeError, match="managed_gradient_accumulation"):
        free.set_gradient_accumulation_boundary(True)


def test_backward_returns_loss_divided_by_accumulation_steps():
    engine, *_ = shardtrain.initialize(model=model(),
                                       config={**CONFIG, "gradient_accumulation_steps": 4})
    loss = engine(torch.randn(2, 4)).pow(2).mean()
    assert torch.allclose(engine.backward(loss), loss.detach() / 4)


def after_each(scaler, overflows):
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_loss_scaler_follows_deepspeed_rules():
    """DeepSpeed's checked sequences: init 16, window 2, hysteresis 2."""
    clean = LossScaler(16, dynamic=True, window=2, hysteresis=2)
    assert after_each(clean, [False] * 5) == [16, 16, 32, 32, 64]
    bumpy = LossScaler(16, dynamic=True, window=2, hysteresis=2)
    assert after_each(bumpy, [True] * 3 + [False] * 3) == [16, 8, 4, 4, 4, 8]
    floor = LossScaler(16, dynamic=True, window=2, hysteresis=1, min_scale=1)
    assert after_each(floor, [True] * 4) == [8, 4, 2, 1]
    with pytest.raises(RuntimeError, match="minimum loss scale"):
        floor.update(True)
    static = LossScaler(128, dynamic=False)
    assert after_each(static, [True, False]) == [128, 128]


def test_set_train_batch_size_and_get_mom():
    engine, *_ = shardtrain.initialize(model=model(), config={
        **CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.8, 0.9]}}})
    engine.set_train_batch_size(6)
    assert engine.gradient_accumulation_steps() == 3 and engine.train_batch_size() == 6
    step(engine, 3)
    assert engine.global_steps == 1
    with pytest.raises(ValueError, match="multiple of"):
        engine.set_train_batch_size(5)
    assert engine.get_mom() == [(0.8, 0.9)] and engine.dp_world_size == 1


@pytest.mark.parametrize("buffer_dtype", [None, "bf16"])
def test_bf16_casts_buffers_only_with_buffer_dtype(buffer_dtype):
    """As DeepSpeed: bf16 casts the parameters; floating buffers (BatchNorm's running
    statistics) keep fp32 unless ``data_types.buffer_dtype`` names a dtype; integer buffers
    never change. (BatchNorm needs its statistics in its weights' dtype: with bf16 it trains
    once ``buffer_dtype`` is bf16.)"""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    config = {**CONFIG, "bf16": {"enabled": True}}
    if buffer_dtype:
        config["data_types"] = {"buffer_dtype": buffer_dtype}
    engine, *_ = shardtrain.initialize(model=net, config=config)
    norm = engine.module[1]
    assert norm.weight.dtype == torch.bfloat16
    want = torch.bfloat16 if buffer_dtype else torch.float32
    assert norm.running_mean.dtype == norm.running_var.dtype == want
    assert norm.num_batches_tracked.dtype == torch.int64
    if not buffer_dtype:
        engine.destroy()
        return
    before = norm.running_mean.clone()
    step(engine, 2)
    assert norm.running_mean.dtype == want and not torch.equal(norm.running_mean, before)
    engine.destroy()


def test_disable_python_gc_holds_the_collector_off_while_an_engine_lives():
    """``disable_python_gc``: off while any engine with the key lives, back on when the last
    is destroyed; an engine without the key leaves it alone; ``collect_python_gc`` collects."""
    import gc
    assert gc.isenabled()
    config = {**CONFIG, "disable_python_gc": True}
    first, *_ = shardtrain.initialize(model=model(), config=config)
    second, *_ = shardtrain.initialize(model=model(), config=config)
    plain, *_ = shardtrain.initialize(model=model(), config=CONFIG)
    assert not gc.isenabled()
    step(first)
    cycle = []
    cycle.append(cycle)
    del cycle
    assert first.collect_python_gc() >= 1  # the cycle above, found on request
    first.destroy()
    first.destroy()  # twice: one lease returned once
    assert not gc.isenabled()
    second.destroy()
    assert gc.isenabled()
    plain.destroy()
    assert gc.isenabled()


def test_dump_state_logs_what_the_engine_was_built_into(records):
    engine, *_ = shardtrain.initialize(model=model(), config={**CONFIG, "dump_state": True})
    report = "\n".join(r.getMessage() for r in records if r.getMessage().startswith("Engine state:"))
    assert engine.dump_state() and report == engine.state_report()
    for line in ("zero_optimization.stage", "train_batch_size", "optimizer", "SGD",
                 "trainable parameters", "10", "model states: total"):
        assert line in report, line
    engine.destroy()


@pytest.mark.parametrize("from_fp32", [True, False])
def test_load_from_fp32_weights_false_rebuilds_masters_from_the_16_bit_weights(tmp_path, from_fp32):
    """``zero_optimization.load_from_fp32_weights``: true (the default) loads the fp32 masters
    saved in the checkpoint; false starts them again from the loaded bf16 weights."""
    config = {**CONFIG, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    engine, *_ = shardtrain.initialize(model=model(), config=config)
    step(engine, 3)
    engine.save_checkpoint(str(tmp_path))
    saved = [s.tensor.detach().clone() for s in engine.optimizer_slots()]
    engine.destroy()
    config["zero_optimization"]["load_from_fp32_weights"] = from_fp32
    loaded, *_ = shardtrain.initialize(model=model(), config=config)
    loaded.load_checkpoint(str(tmp_path))
    for slot, master in zip(loaded.optimizer_slots(), saved):
        weights = slot.param.detach().float().view(-1)[slot.lo:slot.hi].view_as(master)
        want = master if from_fp32 else weights
        assert torch.equal(slot.tensor.detach(), want)
    assert any(not torch.equal(m, s.param.detach().float().view_as(m)) for m, s in
               zip(saved, loaded.optimizer_slots()))  # the fp32 masters hold more than bf16
    loaded.destroy()


def test_a_destroyed_engine_says_so():
    engine, *_ = shardtrain.initialize(model=model(), config=CONFIG)
    x = torch.randn(2, engine.module.in_features)
    engine.destroy()
    engine.destroy()  # a second call does nothing
    assert engine.phase is shardtrain.state.Phase.DESTROYED
    for call in (lambda: engine(x), engine.step, lambda: engine.no_sync().__enter__(),
                 lambda: engine.save_checkpoint("unused")):
        with pytest.raises(RuntimeError, match="this engine was destroyed"):
            call()
    assert shardtrain.state.live_engines.of_module(engine.module) is None

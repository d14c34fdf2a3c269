"""The helpers of the DeepSpeed-compatible tree, in one process: the accelerator object,
``OnDevice``, DeepSpeed's optimizers as torch optimizers, ``zero_to_fp32`` over a shardtrain
checkpoint, and the small utilities scripts import."""
from __future__ import annotations

import json

import pytest
import torch

import shardtrain
import shardtrain.deepspeed as deepspeed
from shardtrain.deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from shardtrain.deepspeed.compression.helper import recursive_getattr, recursive_setattr
from shardtrain.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from shardtrain.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardtrain.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardtrain.deepspeed.runtime.zero import partition_parameters as pp
from shardtrain.deepspeed.utils import zero_to_fp32


def test_the_accelerator_object_on_the_cpu():
    acc = deepspeed.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert torch.device(acc.current_device_name()).type == "cpu"
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed_all(3)
    a = torch.rand(2)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(2))
    assert acc.total_memory() >= acc.available_memory() > 0 and acc.memory_allocated() > 0
    assert torch.bfloat16 in acc.supported_dtypes() and acc.is_bf16_supported()
    assert acc.FloatTensor([1.0]).dtype == torch.float32 and acc.on_accelerator(torch.zeros(1))
    env = {}
    acc.set_visible_devices_envs(env, [0, 1])
    assert env == {} and acc.Stream is None


def test_on_device_builds_on_meta_in_the_dtype_asked():
    with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    with deepspeed.OnDevice(device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


@pytest.mark.parametrize("cls, torch_cls, kw", [
    (FusedAdam, torch.optim.AdamW, dict(weight_decay=0.1)),
    (DeepSpeedCPUAdam, torch.optim.AdamW, dict(weight_decay=0.1)),
    (DeepSpeedCPUAdam, torch.optim.Adam, dict(weight_decay=0.1, adamw_mode=False)),
    (DeepSpeedCPUAdagrad, torch.optim.Adagrad, dict(weight_decay=0.1, adamw_mode=True)),
])
def test_deepspeed_optimizers_step_as_torchs(cls, torch_cls, kw):
    def run(make):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(5))
        opt = make([w])
        for _ in range(3):
            (w ** 3).sum().backward()
            opt.step()
            opt.zero_grad()
        return w.detach()
    theirs = {k: v for k, v in kw.items() if k != "adamw_mode"}
    lr = 1e-2 if cls is DeepSpeedCPUAdagrad else 1e-3
    torch.testing.assert_close(run(lambda p: cls(p, lr=lr, **kw)), run(lambda p: torch_cls(p, lr=lr, **theirs)))
    assert isinstance(cls([torch.nn.Parameter(torch.zeros(1))]), torch.optim.Optimizer)
    with pytest.raises(ValueError, match=r"FusedAdam\(bias_correction=False\) is not supported"):
        FusedAdam([torch.nn.Parameter(torch.zeros(1))], bias_correction=False)


def test_zero_to_fp32_reads_a_shardtrain_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    engine, *_ = shardtrain.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.randn(2, 4)).float().sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert all(v.dtype == torch.float32 for v in state.values())  # from the fp32 masters
    assert sorted(state) == sorted(model.state_dict())
    trained = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        str(tmp_path / "ckpt"), exclude_frozen_parameters=True)
    assert "0.bias" not in trained and "0.weight" in trained
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_size=200, safe_serialization=True)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and len(set(index["weight_map"].values())) > 1
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    zero_to_fp32.load_state_dict_from_zero_checkpoint(fresh, str(tmp_path / "ckpt"))
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, state[name])


def test_small_helpers():
    item = {"a": [torch.arange(6).view(2, 3)[0]], "b": (torch.ones(2), 3)}
    cloned = clone_tensors_for_torch_save(item)
    assert cloned["a"][0].untyped_storage().nbytes() == 3 * 8 and cloned["b"][1] == 3
    net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(net, "0.0") is net[0][0]
    recursive_setattr(net, "0.0", torch.nn.Identity())
    assert isinstance(net[0][0], torch.nn.Identity)
    params = [torch.nn.Parameter(torch.zeros(1))]
    assert split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "p"}) == [
        {"params": params, "name": "p"}]
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16)
    assert wrapped(2).dtype == torch.bfloat16 and pp._orig_torch_arange is torch.arange
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        deepspeed.zero.register_external_parameter(object(), params[0])
    cfg = deepspeed.DeepSpeedConfig({"train_batch_size": 8})
    assert isinstance(cfg, shardtrain.ShardConfig) and cfg["train_micro_batch_size_per_gpu"] == 8
    assert deepspeed.DeepSpeedConfigError is shardtrain.ConfigError
    with pytest.raises(NotImplementedError, match="mesh_param"):
        shardtrain.initialize(model=torch.nn.Linear(1, 1), config={"train_batch_size": 1},
                              mesh_param=(2, 1))

"""``activation_checkpointing.partition_activations`` on 2 tensor-parallel ranks: each rank
saves half of a checkpointed region's inputs and gathers them back in backward. Outputs and
gradients equal the unpartitioned checkpoint's bit for bit (dropout on the default stream
and inside the tracker's fork included), the saved bytes halve, and through the engine
(AutoTP, ZeRO stages 1 and 3) training is the same with and without it."""
from __future__ import annotations

import functools
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F

from _dist import result, run_ranks


def _saved_bytes(packed):
    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def layers(rank: int, world_size: int) -> Dict[str, Any]:
    from shardtrain import activation_checkpointing as ac
    from shardtrain import comm
    from shardtrain.parallel import ColumnParallelLinear, RowParallelLinear
    from shardtrain.rng import get_rng_tracker, model_parallel_manual_seed

    mesh = comm.init_mesh(tp=2)

    class MPU:  # what engine.mpu is: the mesh's groups
        def __init__(self):
            self.mesh = mesh

    torch.manual_seed(0)
    up = ColumnParallelLinear.from_linear(torch.nn.Linear(16, 32), mesh.tp)
    down = RowParallelLinear.from_linear(torch.nn.Linear(32, 16), mesh.tp)

    def block(x):
        h = F.gelu(up(x))
        with get_rng_tracker().fork():  # this rank's half of the features: its own stream
            h = F.dropout(h, 0.2)
        return F.dropout(down(h), 0.1) + x  # replicated: the default stream, alike on both

    x0 = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for partition in (False, True):
        ac.reset()
        ac.configure(mpu_=MPU(), partition_activations=partition)
        model_parallel_manual_seed(5, mesh.tp.rank())
        up.zero_grad()
        down.zero_grad()
        x = x0.clone().requires_grad_()
        packed: list = []
        with _saved_bytes(packed):
            y = ac.checkpoint(block, ac.checkpoint(block, x))
        torch.rand(3)  # draws between forward and backward
        y.pow(2).sum().backward()
        out[partition] = {"y": y.detach(), "x": x.grad.clone(), "up": up.weight.grad.clone(),
                          "down": down.weight.grad.clone(), "saved": sum(packed)}
    ac.reset()
    return out


def through_the_engine(rank: int, world_size: int) -> Dict[str, Any]:
    import cases_parallel as cp
    import shardtrain
    from shardtrain import activation_checkpointing as ac
    from shardtrain.full_weights import full_state_dict

    def build():
        model = cp.gpt()
        for block in model.blocks:
            block.forward = functools.partial(ac.checkpoint, block.forward)
        return model

    out = {}
    for stage in (1, 3):
        for partition in (False, True):
            cfg = cp.config(stage, tensor_parallel={"autotp_size": 2, "partition_config": {
                "layer_specs": cp.GPT_SPECS}},
                activation_checkpointing={"partition_activations": partition})
            engine, *_ = shardtrain.initialize(model=build(), config=cfg, training_data=cp.Tokens())
            batches = iter(engine.training_dataloader)
            losses, packed = [], []
            for i in range(2 * engine.gradient_accumulation_steps()):
                batch = next(batches)
                with _saved_bytes(packed if i == 0 else []):
                    loss = cp.gpt_loss(engine, batch)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            weights = {k: v.float().clone() for k, v in full_state_dict(engine.module, rank=None).items()}
            engine.destroy()
            ac.reset()
            out[f"stage{stage}-{partition}"] = {"losses": losses, "weights": weights,
                                                 "saved": sum(packed)}
    return out


@pytest.fixture(scope="module")
def run():
    return 2, run_ranks("test_partition_activations:layers", 2, timeout=120)


def test_outputs_and_gradients_equal_the_unpartitioned_checkpoint(run):
    for rank in range(2):
        got = result(run, False, rank), result(run, True, rank)
        for key in ("y", "x", "up", "down"):
            assert torch.equal(got[0][key], got[1][key]), (rank, key)


def test_each_rank_saves_half_of_the_regions_inputs(run):
    for rank in range(2):
        whole, split = result(run, False, rank)["saved"], result(run, True, rank)["saved"]
        assert whole == 2 * 4 * 16 * 4  # two regions' fp32 inputs of 4 x 16
        assert split * 2 == whole


def test_training_through_the_engine_is_the_same_with_and_without_it():
    ranks = run_ranks("test_partition_activations:through_the_engine", 2, timeout=240)
    for got in ranks:
        for stage in (1, 3):
            plain, split = got[f"stage{stage}-False"], got[f"stage{stage}-True"]
            assert plain["losses"] == split["losses"], stage
            assert split["saved"] < plain["saved"], (stage, split["saved"], plain["saved"])
            assert all(torch.equal(plain["weights"][k], v) for k, v in split["weights"].items())

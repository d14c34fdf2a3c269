"""The pure parts of pipeline parallelism, in one process: how layers are cut into stages
(DeepSpeed's boundaries), each stage's order of actions, the topologies' rank layout, the
header that lets activations of any shape and dtype travel, the pipeline config block, and a
PipelineModule of one stage."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from shardtrain.pipe import (LayerSpec, PipeDataParallelTopology, PipelineModule,
                             PipeModelDataParallelTopology, ProcessTopology, TiedLayerSpec,
                             bubble_fraction, partition_balanced, partition_uniform,
                             read_settings, train_actions)
from shardtrain.pipe.p2p import decode, encode


def test_uniform_cuts_give_the_remainder_to_the_first_stages():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # fewer layers than stages


# boundaries DeepSpeed 0.19.8's partition_balanced gives for the same weights
@pytest.mark.parametrize("weights,parts,expected", [
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([0, 10, 10, 10, 10, 0], 2, [0, 3, 6]),
    ([5, 1, 1, 1, 1, 5], 3, [0, 1, 5, 6]),
    ([100, 3, 1000, 0, 2], 2, [0, 2, 5]),
    ([1, 0, 1, 0, 1, 0, 1], 4, [0, 2, 4, 6, 7]),
])
def test_balanced_cuts_are_deepspeeds(weights, parts, expected):
    assert partition_balanced(weights, parts) == expected


@pytest.mark.parametrize("stages,micro", [(1, 3), (2, 4), (4, 4), (4, 2), (3, 7)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_stage_runs_every_micro_batch_once_each_way_in_order(stages, micro, schedule):
    for stage in range(stages):
        actions = train_actions(stage, stages, micro, schedule)
        forwards = [i for kind, i in actions if kind == "F"]
        backwards = [i for kind, i in actions if kind == "B"]
        assert forwards == backwards == list(range(micro))
        for i in range(micro):  # a micro-batch's backward comes after its forward
            assert actions.index(("F", i)) < actions.index(("B", i))


def test_1f1b_keeps_at_most_stages_minus_stage_micro_batches_alive():
    for stage in range(4):
        alive = peak = 0
        for kind, _ in train_actions(stage, 4, 8):
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert peak == 4 - stage
    assert train_actions(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def _needs(action, s: int, stages: int, chunks: int):
    """What an action waits for: the action of another stage whose send it receives."""
    kind, i, c = (*action, 0)[:3]
    if kind == "F":
        if s > 0:
            return (s - 1, "F", i, c)
        return (stages - 1, "F", i, c - 1) if c > 0 else None
    if s == stages - 1 and c == chunks - 1:
        return (s, "F", i, c)  # the loss: this rank's own forward
    return (s + 1, "B", i, c) if s < stages - 1 else (0, "B", i, c + 1)


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                             ("interleaved", 3)])
def test_the_schedules_cannot_deadlock(schedule, chunks):
    """Simulated with blocking receives and sends that never wait: every stage finishes."""
    for stages, micro in ((2, 4), (4, 4), (4, 8), (3, 6), (2, 2)):
        lists = [train_actions(s, stages, micro, schedule, chunks) for s in range(stages)]
        at, done = [0] * stages, set()
        progress = True
        while progress:
            progress = False
            for s in range(stages):
                if at[s] == len(lists[s]):
                    continue
                action = lists[s][at[s]]
                need = _needs(action, s, stages, chunks)
                if need is None or need in done:
                    done.add((s, *(*action, 0)[:3]))
                    at[s] += 1
                    progress = True
        assert at == [len(x) for x in lists], (stages, micro, schedule, at)


def _v_needs(action, s: int, stages: int):
    """As _needs, with two chunks placed as a V and split backwards: the action (of any
    stage, this one included) it waits for."""
    kind, i, c = action
    part = s if c == 0 else 2 * stages - 1 - s

    def at(kind, part):
        return (part if part < stages else 2 * stages - 1 - part, kind, i,
                0 if part < stages else 1)
    if kind == "F":
        return at("F", part - 1) if part else None
    if kind == "W":
        return at("B", part)
    return at("F", part) if part == 2 * stages - 1 else at("B", part + 1)


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 16), (3, 6), (4, 3), (2, 1)])
def test_zbv_runs_each_half_once_within_1f1b_memory_and_cannot_deadlock(stages, micro):
    """Every (micro-batch, chunk) once as F, B and W, in that order, per part in micro-batch
    order; at most 2 x stages chunk activations alive (1F1B's peak); simulated with blocking
    receives every stage finishes; the idle share is far below 1F1B's."""
    lists = [train_actions(s, stages, micro, "zbv", chunks=2) for s in range(stages)]
    for actions in lists:
        for kind in "FBW":
            for c in (0, 1):
                assert [a[1] for a in actions if a[0] == kind and a[2] == c] == list(range(micro))
        for i in range(micro):
            for c in (0, 1):
                assert actions.index(("F", i, c)) < actions.index(("B", i, c)) \
                    < actions.index(("W", i, c))
        alive = peak = 0
        for kind, *_ in actions:
            alive += {"F": 1, "B": 0, "W": -1}[kind]
            peak = max(peak, alive)
        assert peak <= 2 * stages
    at, done, progress = [0] * stages, set(), True
    while progress:
        progress = False
        for s in range(stages):
            if at[s] < len(lists[s]):
                action = lists[s][at[s]]
                need = _v_needs(action, s, stages)
                if need is None or need in done:
                    done.add((s, *action))
                    at[s] += 1
                    progress = True
    assert at == [len(x) for x in lists]
    if micro >= 2 * stages:
        assert bubble_fraction(stages, micro, schedule="zbv") < \
            bubble_fraction(stages, micro) / 3


def test_zbv_on_two_stages_and_its_bubble():
    assert train_actions(1, 2, 4, "zbv", chunks=2)[:8] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("B", 0, 1), ("B", 0, 0),
        ("W", 0, 1), ("F", 2, 0)]
    assert bubble_fraction(4, 8, schedule="zbv") == pytest.approx(3 / 51)
    with pytest.raises(ValueError, match="virtual_stages=2, chunk_placement=\"v\""):
        train_actions(0, 2, 4, "zbv")


def test_interleaved_runs_each_chunk_of_each_micro_batch_once_each_way():
    actions = train_actions(1, 2, 4, "interleaved", chunks=2)
    assert sorted(a for a in actions if a[0] == "F") == [
        ("F", i, c) for i in range(4) for c in range(2)]
    # the last stage: 2 forwards ahead (chunk 0 of a group of 2), then one forward, one backward
    assert actions[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1), ("F", 1, 1),
                           ("B", 1, 1)]
    assert train_actions(0, 2, 4, "interleaved", chunks=2)[:5] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0)]  # 4 ahead
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        train_actions(0, 4, 6, "interleaved", chunks=2)
    with pytest.raises(ValueError, match="set pipeline.schedule to \"interleaved\""):
        train_actions(0, 2, 4, "1f1b", chunks=2)


def test_topologies_lay_ranks_out_as_deepspeed_does():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    assert topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_coord(6) == topo.ProcessCoord(pipe=1, data=1, model=0)
    assert topo.get_rank_repr(5) == "model_01"
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=0, model=1) == [1, 3]
    assert PipeDataParallelTopology(num_pp=2, num_dp=3).get_coord(4).pipe == 1
    with pytest.raises(ValueError, match="needs every axis"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="one size per distinct axis"):
        ProcessTopology(["a", "a"], [1, 2])


def test_the_header_carries_count_dtypes_and_shapes():
    tensors = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64),
               torch.zeros((), dtype=torch.bfloat16), torch.zeros(0, 5)]
    words = encode(tensors)
    assert decode(words) == [(t.dtype, tuple(t.shape)) for t in tensors]
    with pytest.raises(ValueError, match="pack them into one"):
        encode([torch.zeros(1, 1, 1, 1)] * 12)
    with pytest.raises(TypeError, match="cannot send"):
        encode([torch.zeros(1, dtype=torch.float8_e4m3fn)])


def test_one_message_carries_the_header_and_every_tensor():
    from shardtrain.pipe.p2p import _pack, _unpack
    parts = [torch.randn(2, 3), torch.arange(4), torch.tensor([True, False, True]),
             torch.randn(1, 5).bfloat16(), torch.zeros(0, 2), torch.randn(3).double()]
    message = _pack(encode(parts), parts, torch.device("cpu"))
    assert message.dtype == torch.uint8 and message.numel() == 512 + 24 + 32 + 8 + 16 + 0 + 24
    back = _unpack(message)
    assert [(t.dtype, t.shape) for t in back] == [(t.dtype, t.shape) for t in parts]
    assert all(torch.equal(a, b) for a, b in zip(back, parts))


def test_the_pipeline_block_is_read_strictly():
    assert read_settings({}).schedule == "1f1b"
    got = read_settings({"schedule": "GPipe", "activation_checkpoint_interval": 2,
                         "pipe_partitioned": True, "partition": "best"})
    assert (got.schedule, got.activation_checkpoint_interval) == ("gpipe", 2)
    with pytest.raises(ValueError, match="unknown key"):
        read_settings({"micro_batches": 4})
    with pytest.raises(ValueError, match="must be true or false"):
        read_settings({"grad_partitioned": "yes"})


def test_one_stage_builds_every_layer_under_its_global_index():
    layers = [TiedLayerSpec("embed", nn.Embedding, 10, 4), LayerSpec(nn.Linear, 4, 4),
              nn.Tanh(), lambda x: x * 2,
              TiedLayerSpec("embed", nn.Embedding, 10, 4,
                            forward_fn=lambda m, x: x @ m.weight.t())]
    module = PipelineModule(layers, num_stages=1, partition_method="uniform", seed_layers=True)
    assert sorted(n for n, _ in module.named_parameters()) == [
        "1.bias", "1.weight", "tied_modules.embed.weight"]
    assert module.partitions() == [0, 5] and module.stage_owner(4) == 0
    assert module.tie_stages == {"embed": [0]}
    out = module(torch.tensor([[1, 2]]))
    assert out.shape == (1, 2, 10)
    module.set_checkpoint_interval(2)  # recomputed in backward: the same values
    again = module(torch.tensor([[1, 2]]))
    assert torch.equal(out, again)
    with pytest.raises(TypeError, match="torch.nn.Module class"):
        LayerSpec(lambda: None)
    with pytest.raises(ValueError, match="num_stages or topology"):
        PipelineModule(layers)

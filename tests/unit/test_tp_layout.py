"""SplitSpec: how a full tensor is cut into tensor-parallel shards and joined again."""
from __future__ import annotations

import pytest
import torch

from shardtrain.layout import place
from shardtrain.parallel import SplitSpec, is_tp_split


@pytest.mark.parametrize("spec, shape", [
    (SplitSpec(0, (12,)), (12, 3)),
    (SplitSpec(0, (8, 8)), (16, 3)),           # gate_up_proj: [gate; up]
    (SplitSpec(0, (8, 4, 4)), (16, 2)),        # GQA qkv
    (SplitSpec(1, (4, 8)), (3, 12)),
    (SplitSpec(2, (4,)), (2, 3, 4)),
])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_join_inverts_shard(spec, shape, size):
    full = torch.randn(shape)
    shards = [spec.shard(full, r, size) for r in range(size)]
    assert all(s.shape == spec.local_shape(shape, size) for s in shards)
    assert torch.equal(spec.join(shards), full)


def test_each_fused_part_is_split_on_its_own():
    full = torch.arange(16.0)
    gate_up = SplitSpec(0, (8, 8))
    assert gate_up.shard(full, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    gate, up = gate_up.shard(full, 0, 2).chunk(2)  # the layer's own chunk(2) still works
    assert gate.tolist() == [0, 1, 2, 3] and up.tolist() == [8, 9, 10, 11]


def test_a_shard_is_a_copy_not_a_view():
    full = torch.zeros(4, 2)
    SplitSpec(0, (4,)).shard(full, 0, 2).fill_(1)
    assert full.sum() == 0


def test_split_spec_refusals():
    with pytest.raises(ValueError, match=r"cannot split size 6 along dim 0 into 4 equal tensor-"
                                         r"parallel pieces: choose a tensor-parallel size that "
                                         r"divides 6"):
        SplitSpec(0, (6,)).local_shape((6, 2), 4)
    with pytest.raises(ValueError, match=r"does not have size 8 \(parts \(4, 4\)\) along dim 0"):
        SplitSpec(0, (4, 4)).shard(torch.zeros(6), 0, 2)
    with pytest.raises(ValueError, match="parts must be positive integers"):
        SplitSpec(0, (4, 0))
    with pytest.raises(ValueError, match="dim must be a non-negative integer"):
        SplitSpec(-1, (4,))
    with pytest.raises(ValueError, match=r"shard 1 has shape \(3,\); expected size 2"):
        SplitSpec(0, (4,)).join([torch.zeros(2), torch.zeros(3)])


def test_split_specs_are_frozen_values():
    assert SplitSpec(0, [4, 4]) == SplitSpec(0, (4, 4))
    assert hash(SplitSpec(1, (3,))) == hash(SplitSpec(1, (3,)))
    p = torch.nn.Parameter(torch.zeros(2))
    assert not is_tp_split(p)
    place(p, local_shape=(2,), tp=SplitSpec(0, (4,)))
    assert is_tp_split(p) and p.tp_split == SplitSpec(0, (4,))  # the attribute, from the record

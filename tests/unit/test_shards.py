"""Even per-parameter sharding (shardtrain.zero._shards), checked against torch.chunk and
F.pad: a parameter padded to ``world * chunk`` elements and viewed as ``[world, chunk]``."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import List

import pytest
import torch
import torch.nn.functional as F

from shardtrain.layout import place
from shardtrain.zero._shards import ShardLayout, chunk_size, full_numel, shard_range

WORLDS = range(1, 9)
NUMELS = [*range(0, 20), 31, 32, 33, 63, 64, 65, 1000, 1001]


@pytest.mark.parametrize("world", WORLDS)
def test_chunk_size_is_the_ceiling_and_never_zero(world):
    for n in NUMELS:
        c = chunk_size(n, world)
        assert c >= 1
        if n:
            assert c * world >= n > (c - 1) * world  # the ceiling of n / world
        else:
            assert c == 1


@pytest.mark.parametrize("world", WORLDS)
def test_ranges_tile_the_parameter_in_rank_order(world):
    for n in NUMELS:
        ranges = [shard_range(n, world, r) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        for (_lo, hi), (next_lo, _) in zip(ranges, ranges[1:]):
            assert hi == next_lo
        assert all(0 <= hi - lo <= math.ceil(n / world) for lo, hi in ranges)


@pytest.mark.parametrize("world", WORLDS)
def test_ranges_hold_what_torch_chunk_gives_each_rank(world):
    for n in NUMELS:
        chunks = torch.arange(n).chunk(world)
        for r in range(world):
            lo, hi = shard_range(n, world, r)
            want = chunks[r].tolist() if r < len(chunks) else []
            assert list(range(lo, hi)) == want, (n, world, r)


def test_fewer_elements_than_ranks():
    assert [shard_range(3, 5, r) for r in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    assert [shard_range(0, 4, r) for r in range(4)] == [(0, 0)] * 4


def test_full_numel_reads_the_partitioned_size():
    p = torch.nn.Parameter(torch.empty(0))
    assert full_numel(p) == 0
    place(p, local_shape=(3, 4),  # a ZeRO-3 parameter whose own data was released
          zero_group=SimpleNamespace(size=lambda: 2, rank=lambda: 0))
    assert full_numel(p) == 12 and p.ds_numel == 12  # DeepSpeed's attribute, from the record


def reference_rows(flats: List[torch.Tensor], world: int) -> torch.Tensor:
    """[world, sum of chunks]: each parameter zero-padded to world * chunk, then side by side."""
    blocks = []
    for flat in flats:
        c = math.ceil(flat.numel() / world) or 1
        blocks.append(F.pad(flat, (0, world * c - flat.numel())).view(world, c))
    return torch.cat(blocks, dim=1)


def random_group(seed: int, dtype: torch.dtype = torch.float32) -> List[torch.Tensor]:
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 2, 3, 5, 7, 8, 16, 17, 100]) for _ in range(rng.randint(1, 6))]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in numels]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("seed", range(6))
def test_layout_offsets_row_and_slices(world, seed):
    numels = [f.numel() for f in random_group(seed)]
    layout = ShardLayout(numels, world, rank=world - 1, extra=3)
    chunks = [math.ceil(n / world) or 1 for n in numels]
    assert layout.offsets == [sum(chunks[:i]) for i in range(len(numels))]
    assert layout.params_width == sum(chunks) and layout.row == sum(chunks) + 3
    assert layout.slices == [shard_range(n, world, world - 1) for n in numels]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_matches_the_padded_reference_and_unpack_round_trips(world, seed, dtype):
    flats = random_group(seed, dtype)
    layout = ShardLayout([f.numel() for f in flats], world, rank=0, extra=2)
    out = torch.full((world, layout.row), float("nan"), dtype=dtype)  # stale contents
    layout.pack(flats, out)
    assert torch.equal(out[:, : layout.params_width], reference_rows(flats, world))  # zero padding
    assert out[:, layout.params_width:].isnan().all()  # the extra columns are the caller's

    restored = [torch.full_like(f, float("nan")) for f in flats]
    layout.unpack(out, restored)
    for got, want in zip(restored, flats):
        assert torch.equal(got, want)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_unpack_never_reads_the_padding(world):
    flats = random_group(1)
    layout = ShardLayout([f.numel() for f in flats], world, rank=0)
    gathered = reference_rows(flats, world)
    padding = reference_rows([torch.ones_like(f) for f in flats], world) == 0
    gathered[padding] = float("nan")
    restored = [torch.empty_like(f) for f in flats]
    layout.unpack(gathered, restored)
    for got, want in zip(restored, flats):
        assert torch.equal(got, want)


@pytest.mark.parametrize("world", [1, 2, 5])
def test_pack_none_writes_zeros(world):
    flats = random_group(2)
    layout = ShardLayout([f.numel() for f in flats], world, rank=0)
    out = torch.full((world, layout.row), 7.0)
    layout.pack([None, *flats[1:]], out)
    assert torch.equal(out, reference_rows([torch.zeros_like(flats[0]), *flats[1:]], world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("seed", range(4))
def test_own_is_this_ranks_shard_range_as_a_view_of_its_row(world, seed):
    flats = random_group(seed)
    numels = [f.numel() for f in flats]
    packed = reference_rows(flats, world)
    for rank in range(world):
        layout = ShardLayout(numels, world, rank, extra=1)
        row = torch.cat([packed[rank], torch.tensor([5.0])])
        for i, flat in enumerate(flats):
            lo, hi = shard_range(flat.numel(), world, rank)
            mine = layout.own(row, i)
            assert torch.equal(mine, flat[lo:hi])
            mine.add_(1)  # a view: writing it writes the row
            assert torch.equal(row[layout.offsets[i]: layout.offsets[i] + hi - lo], flat[lo:hi] + 1)
        assert row[layout.params_width:].tolist() == [5.0]

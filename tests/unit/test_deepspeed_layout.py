"""The pure parts of the DeepSpeed import, in one process: flat partitions cut into
parameters, the stage-0 matching of optimizer indices to names, and DeepSpeed's own pickled
types received by the restricted loader's stand-ins (from the committed fixtures)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardtrain.checkpoint._deepspeed_files import (FragmentAddress, LossScalerState,
                                                    ZeroStage, load_pickle)
from shardtrain.checkpoint._deepspeed_layout import (FlatView, group_offsets, stage3_offsets,
                                                     stage3_param)
from shardtrain.checkpoint._deepspeed_stage0 import align

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "deepspeed"


def test_a_flat_view_gives_views_inside_one_part_and_copies_across_parts():
    a, b = torch.arange(4.0), torch.arange(4.0, 7.0)
    view = FlatView([a, b])
    assert view.numel == 7
    inside = view.slice(1, 3)
    assert inside.tolist() == [1.0, 2.0] and inside.data_ptr() == a[1:].data_ptr()
    assert view.slice(3, 6).tolist() == [3.0, 4.0, 5.0]
    assert view.slice(5, 5).numel() == 0
    with pytest.raises(IndexError):
        view.slice(6, 8)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage12_groups_put_back_together(world):
    """Parameters end to end with alignment padding, the tail padded to the world size, cut
    into equal pieces; each rank's piece saved without its share of the tail padding."""
    numels, paddings = [6, 1, 5], [2, 3, 0]
    params = [torch.randn(n) for n in numels]
    flat = torch.cat([torch.cat([p, torch.zeros(pad)]) for p, pad in zip(params, paddings)])
    padded = torch.cat([flat, torch.zeros(-flat.numel() % world)])
    size = padded.numel() // world
    pieces = [padded[r * size:(r + 1) * size] for r in range(world)]
    saved = [p[:max(0, min(size, flat.numel() - r * size))] for r, p in enumerate(pieces)]
    offsets, end = group_offsets(numels, paddings)
    view = FlatView(saved)
    assert (offsets, end, view.numel) == ([0, 8, 12], 17, 17)
    for p, off in zip(params, offsets):
        assert torch.equal(view.slice(off, off + p.numel()), p)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_stage3_pieces_put_back_together(world):
    """Each parameter cut on its own into ceil(n / world) pieces, the last padded."""
    params = [torch.randn(n) for n in (7, 1, 0, 12)]
    ranks = []
    for r in range(world):
        pieces = []
        for p in params:
            c = math.ceil(p.numel() / world) if p.numel() else 0
            piece = torch.cat([p, torch.zeros(c * world - p.numel())])[r * c:(r + 1) * c]
            pieces.append(piece)
        ranks.append(FlatView([torch.cat(pieces)]))
    offsets, length = stage3_offsets([p.numel() for p in params], world)
    assert all(v.numel == length for v in ranks)
    for p, off in zip(params, offsets):
        assert torch.equal(stage3_param(ranks, off, p.numel()), p)


def test_align_finds_the_one_order_preserving_fit():
    shapes = {"a": [2], "b": [3], "frozen": [4], "c": [2]}
    wanted = [[2], [3], [2]]
    got = align(3, list(shapes), lambda i, n: shapes[n] == wanted[i], "x.pt")
    assert got == ["a", "b", "c"]


def test_align_refuses_a_choice_shapes_cannot_make_and_names_the_candidates():
    shapes = {"a": [2], "frozen": [2], "b": [3]}
    with pytest.raises(ValueError, match=r"could be \['frozen'\] or \['a'\].*--frozen frozen"):
        align(2, list(shapes), lambda i, n: shapes[n] == [[2], [3]][i], "x.pt")
    with pytest.raises(ValueError, match="do not match the module's parameters"):
        align(2, list(shapes), lambda i, n: shapes[n] == [5], "x.pt")


def test_deepspeeds_pickled_types_reach_inert_stand_ins():
    """The bytes DeepSpeed 0.19.8 wrote: its loss scaler, ZeRO stage enum and fragment
    addresses, read by the restricted unpickler without DeepSpeed."""
    path = FIXTURES / "s1-bf16" / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    osd = load_pickle(str(path))["optimizer_state_dict"]
    assert type(osd["loss_scaler"]) is LossScalerState
    assert vars(osd["loss_scaler"]) == {"cur_scale": 1.0, "dynamic": False}
    assert osd["zero_stage"] is ZeroStage.optimizer_states
    address = osd["param_slice_mappings"][0]["head.bias"]
    assert type(address) is FragmentAddress and (address.numel, address.start) == (5, 780)

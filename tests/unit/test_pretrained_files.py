"""shardtrain.load_pretrained in one process: which tensors load, what is read, and every
refusal with its message. The same reads at ZeRO stage 3 are checked for each rank of a
world by partitioning the parameters in place (``partition(..., src=None)`` needs no process
group); tests/test_pretrained.py runs the real thing on 2 ranks."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import shardtrain
from shardtrain.pretrained import _files, _match, _write
from shardtrain.zero._params import partition
from shardtrain.zero._shards import shard_range


class Tiny(nn.Module):
    """A tied embedding and head, a 3-d and a 0-d parameter, persistent buffers (one of
    them integer) and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.cube = nn.Parameter(torch.randn(7, 3, 2))
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("scale", torch.rand(6))
        self.register_buffer("steps", torch.tensor(3))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def tiny(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def pretrained_state() -> Dict[str, torch.Tensor]:
    """What save_pretrained writes of another initialisation: the tied head once."""
    state = tiny(7).state_dict()
    return {k: v.clone().contiguous() for k, v in state.items() if k != "head.weight"}


@pytest.fixture
def file(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(pretrained_state(), str(path))
    return path


@pytest.fixture
def reads(monkeypatch) -> List[tuple]:
    """Every read: (name, rows asked for, elements returned)."""
    seen: List[tuple] = []
    original = _files.WeightFiles.read

    def read(self, name, rows=None):
        values = original(self, name, rows)
        seen.append((name, rows, values.numel()))
        return values

    monkeypatch.setattr(_files.WeightFiles, "read", read)
    return seen


def state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_every_tensor_loads_and_a_tied_weight_is_read_once(file, reads):
    model = tiny(0)
    result = shardtrain.load_pretrained(model, file)
    assert result == ([], []) and result.missing_keys == [] and result.unexpected_keys == []
    want = pretrained_state()
    got = state(model)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert model.head.weight is model.emb.weight
    assert torch.equal(got["head.weight"], want["emb.weight"])
    assert sorted(name for name, _, _ in reads) == sorted(want)  # each once, whole
    assert all(rows is None for _, rows, _ in reads)


def test_a_model_directory_one_file_or_an_index_of_shards(tmp_path, file):
    one = tmp_path / "one"
    one.mkdir()
    file.rename(one / _files.SINGLE)
    want = pretrained_state()
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(want)
    parts = {"model-00001-of-00002.safetensors": names[:3],
             "model-00002-of-00002.safetensors": names[3:]}
    for file_name, keys in parts.items():
        save_file({k: want[k] for k in keys}, str(sharded / file_name))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (sharded / _files.INDEX).write_text(json.dumps(index))
    for path in (one, sharded, sharded / _files.INDEX):
        model = tiny(0)
        assert shardtrain.load_pretrained(model, path) == ([], [])
        assert torch.equal(model.cube, want["cube"]) and torch.equal(model.emb.weight,
                                                                     want["emb.weight"])


def test_strict_refuses_names_one_side_lacks_before_anything_is_read(tmp_path, reads):
    changed = pretrained_state()
    del changed["body.bias"]
    changed["extra.weight"] = torch.ones(2)
    path = tmp_path / "changed.safetensors"
    save_file(changed, str(path))
    model = tiny(0)
    before = state(model)
    with pytest.raises(ValueError) as info:
        shardtrain.load_pretrained(model, path)
    message = str(info.value)
    assert "missing from the file: 1 (body.bias)" in message
    assert "in the file but not in the model: 1 (extra.weight)" in message
    assert str(path) in message and "strict=False" in message
    assert not reads
    assert all(torch.equal(v, before[k]) for k, v in state(model).items())

    missing, unexpected = shardtrain.load_pretrained(model, path, strict=False)
    assert (missing, unexpected) == (["body.bias"], ["extra.weight"])
    assert torch.equal(model.body.bias, before["body.bias"])  # kept its own value
    assert torch.equal(model.body.weight, changed["body.weight"])
    assert "extra.weight" not in {name for name, _, _ in reads}  # never read


def test_a_tied_weight_missing_under_every_name_is_reported_under_each(tmp_path):
    changed = pretrained_state()
    del changed["emb.weight"]
    path = tmp_path / "untied.safetensors"
    save_file(changed, str(path))
    missing, unexpected = shardtrain.load_pretrained(tiny(0), path, strict=False)
    assert (missing, unexpected) == (["emb.weight", "head.weight"], [])


def test_the_long_list_of_names_is_cut(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({f"layer{i}.weight": torch.ones(1) for i in range(25)}, str(path))
    with pytest.raises(ValueError, match=r"in the file but not in the model: 25 \(layer0.weight, "
                                         r".* and 5 more\)"):
        shardtrain.load_pretrained(tiny(0), path)


def test_a_shape_mismatch_is_refused_with_the_name_and_both_shapes(tmp_path):
    changed = pretrained_state()
    changed["emb.weight"] = torch.zeros(13, 6)
    path = tmp_path / "bigger.safetensors"
    save_file(changed, str(path))
    model = tiny(0)
    before = state(model)
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"'emb.weight' has shape \[13, 6\] in the file but "
                                             r"\[11, 6\] in the model"):
            shardtrain.load_pretrained(model, path, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in state(model).items())


def test_floating_point_values_are_cast_other_dtypes_must_match(tmp_path):
    halves = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
              for k, v in pretrained_state().items()}
    path = tmp_path / "bf16.safetensors"
    save_file(halves, str(path))
    model = tiny(0)
    shardtrain.load_pretrained(model, path)
    assert model.cube.dtype == torch.float32
    assert torch.equal(model.cube, halves["cube"].float())
    for name, value in (("steps", torch.tensor(3.0)), ("cube", torch.ones(7, 3, 2).long())):
        wrong = dict(pretrained_state(), **{name: value})
        save_file(wrong, str(path))
        with pytest.raises(ValueError, match=rf"'{name}' is torch\.\w+ in the file but "
                                             r"torch\.\w+ in the model"):
            shardtrain.load_pretrained(tiny(0), path)


def test_what_is_not_a_module_is_refused():
    with pytest.raises(TypeError, match="needs a torch.nn.Module or an engine, got dict"):
        shardtrain.load_pretrained({}, "x.safetensors")


def test_paths_that_hold_no_safetensors_checkpoint(tmp_path):
    model = tiny(0)
    with pytest.raises(FileNotFoundError, match="does not exist: give a .safetensors file"):
        shardtrain.load_pretrained(model, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no model.safetensors and no "
                                                "model.safetensors.index.json: it holds neither"):
        shardtrain.load_pretrained(model, tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"it holds \['pytorch_model.bin'\]\. Pickled "
                                                r"checkpoints are not read"):
        shardtrain.load_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match="is not a safetensors file: .* "
                                         "safetensors.torch.save_file"):
        shardtrain.load_pretrained(model, tmp_path / "pytorch_model.bin")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="broken.safetensors is not a readable safetensors file"):
        shardtrain.load_pretrained(model, broken)


@pytest.mark.parametrize("weight_map, error, message", [
    ("not an object", ValueError, "is not a safetensors index"),
    ({"cube": "../model.safetensors"}, ValueError,
     "names the file '../model.safetensors', which is not a plain file name"),
    ({"cube": "model-00009.safetensors"}, FileNotFoundError,
     "places tensors in model-00009.safetensors, which is not in"),
    ({"missing.weight": "model.safetensors"}, ValueError,
     r"places \['missing.weight'\] in model.safetensors, which does not hold"),
])
def test_an_index_that_does_not_match_its_files(tmp_path, file, weight_map, error, message):
    index = tmp_path / _files.INDEX
    index.write_text(json.dumps({"weight_map": weight_map}) if isinstance(weight_map, dict)
                     else weight_map)
    with pytest.raises(error, match=message):
        shardtrain.load_pretrained(tiny(0), index)


@pytest.mark.parametrize("shape", [(11,), (11, 6), (7, 3, 2), (1, 5), (5, 1)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_covering_rows_hold_the_range_with_less_than_a_row_beyond_each_end(shape, world):
    numel, row = math.prod(shape), math.prod(shape[1:])
    for rank in range(world):
        lo, hi = shard_range(numel, world, rank)
        if hi <= lo:
            continue
        r0, r1, start = _write.covering_rows(lo, hi, shape)
        assert r0 * row + start == lo and r1 * row >= hi
        assert start < row and r1 * row - hi < row  # less than one row beyond each end


class _Ranks:
    """One rank of a group of ``world`` as a ``comm.Group`` reports it: this test plays each
    rank in turn in one process (partitioning with ``src=None`` and reading files need no
    collective)."""

    def __init__(self, world: int, rank: int):
        self._world, self._rank = world, rank

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("world", [2, 3, 5])
def test_each_rank_of_a_stage_3_world_reads_its_rows_and_keeps_its_shard(file, reads, world):
    """Parameters partitioned as stage 3 (and zero.Init) leave them, on every rank: the rank
    reads the rows that cover its shard, and its shard holds the file's values."""
    want = pretrained_state()
    for rank in range(world):
        model = tiny(0)
        for p in model.parameters():
            partition(p, _Ranks(world, rank), src=None)
        reads.clear()
        with _files.WeightFiles(file) as files:
            found = _match.match(model, files)
            _match.refuse_mismatches(found, files)
            for target in found.loading:
                _write.load_target(target, files)
        read = {name: numel for name, _, numel in reads}
        for name, p in model.named_parameters():
            value = want[name].reshape(-1)
            lo, hi = shard_range(value.numel(), world, rank)
            assert torch.equal(p.ds_tensor[: hi - lo], value[lo:hi]), (name, rank)
            row = math.prod(want[name].shape[1:])
            assert read.get(name, 0) <= (hi - lo) + 2 * (row - 1), (name, rank, read.get(name))
        assert torch.equal(model.scale, want["scale"])  # buffers: whole on every rank

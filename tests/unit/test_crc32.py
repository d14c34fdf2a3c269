"""The CRC32 arithmetic and the rank-file writer's checksums, in one process.

``crc32_combine`` must agree with ``zlib.crc32`` of the concatenation for every length
(empty parts, one byte, lengths with many bits set); the safetensors writer must record each
tensor's checksum in its header (fixed-width hex, written after the data) and report the
whole file's CRC32, combined from the header's and the data's, exactly as ``zlib.crc32``.
"""
from __future__ import annotations

import json
import random
import zlib

import pytest
import torch
from safetensors import safe_open

from shardtrain.files import crc32_combine
from shardtrain.checkpoint._agreement import Problem
from shardtrain.checkpoint._integrity import HEADER_CRC32, header_crc32s
from shardtrain.checkpoint._safetensors_writer import write_safetensors

LENGTHS = [0, 1, 2, 3, 7, 8, 255, 256, 1023, 4096, 65537, 2**20 + 12345]


@pytest.mark.parametrize("len2", LENGTHS)
@pytest.mark.parametrize("len1", [0, 1, 100])
def test_combine_equals_the_crc_of_the_concatenation(len1, len2):
    rng = random.Random(len1 * 1000003 + len2)
    a, b = rng.randbytes(len1), rng.randbytes(len2)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_folds_many_parts():
    rng = random.Random(0)
    parts = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(50)]
    crc = 0
    for part in parts:
        crc = crc32_combine(crc, zlib.crc32(part), len(part))
    assert crc == zlib.crc32(b"".join(parts))


def test_combine_refuses_a_negative_length():
    with pytest.raises(ValueError, match="len2 is -1"):
        crc32_combine(0, 0, -1)


def test_rank_file_records_a_checksum_per_tensor(tmp_path):
    """Each tensor's [before, after]: the running CRC32 of the data section around its bytes,
    so that zlib.crc32(its bytes, before) == after checks it alone."""
    tensors = {"param/w": torch.randn(5, 7), "master/w": torch.randn(35).bfloat16(),
               "optim/w/step": torch.arange(3), "buffer/empty": torch.empty(0),
               "rng/torch": torch.get_rng_state()}
    path = str(tmp_path / "rank00000.safetensors")
    info = write_safetensors(path, tensors, {"shardtrain.rank": "0"}, checksums=HEADER_CRC32)
    data = (tmp_path / "rank00000.safetensors").read_bytes()
    assert info == {"bytes": len(data), "crc32": zlib.crc32(data)}
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["shardtrain.rank"] == "0"
        recorded = header_crc32s(path, f.metadata())
        running = 0
        for name in sorted(tensors):  # the file's order
            assert torch.equal(f.get_tensor(name), tensors[name])
            raw = tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            before, after = recorded[name]
            assert before == running and zlib.crc32(raw, before) == after, name
            running = after


def test_files_without_checksums_keep_their_metadata_as_given(tmp_path):
    path = str(tmp_path / "m.safetensors")
    write_safetensors(path, {"w": torch.ones(2)}, {"format": "pt"})
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_recorded_checksums_are_read_back_and_damaged_ones_refused():
    assert header_crc32s("f", {HEADER_CRC32: json.dumps({"a": ["00000000", "0000002a"]})}) \
        == {"a": (0, 42)}
    assert header_crc32s("f", {"other": "1"}) is None  # saved before per-tensor checksums
    for damaged in ["[1, 2]", '{"a": ["zzzzzzzz", "0"]}', '{"a": 5}', '{"a": ["0"]}', "{not"]:
        with pytest.raises(Problem, match="is truncated or corrupted"):
            header_crc32s("f", {HEADER_CRC32: damaged})


@pytest.mark.parametrize("tensors", [{}, {'client/a "quoted" \\ key é': torch.ones(3)}],
                         ids=["no-tensors", "names-json-escapes"])
def test_checksums_of_unusual_files(tmp_path, tensors):
    path = str(tmp_path / "f.safetensors")
    info = write_safetensors(path, tensors, {"x": "{}"}, checksums=HEADER_CRC32)
    data = (tmp_path / "f.safetensors").read_bytes()
    assert info == {"bytes": len(data), "crc32": zlib.crc32(data)}
    with safe_open(path, framework="pt") as f:
        recorded = header_crc32s(path, f.metadata())
        assert f.metadata()["x"] == "{}"
        for name, value in tensors.items():
            assert torch.equal(f.get_tensor(name), value)
            assert recorded[name][1] == zlib.crc32(value.numpy().tobytes(), recorded[name][0])
    assert set(recorded) == set(tensors)

"""The CRC32 arithmetic and the rank-file writer's checksums, in one process.

``crc32_combine`` must agree with ``zlib.crc32`` of the concatenation for every length
(empty parts, one byte, lengths with many bits set); the safetensors writer must record each
tensor's CRC32 in its header and report the whole file's, without reading the data twice.
"""
from __future__ import annotations

import json
import random
import zlib

import pytest
import torch
from safetensors import safe_open

from shardtrain._crc32 import crc32_combine
from shardtrain._fileio import write_synced
from shardtrain.checkpoint._integrity import HEADER_CRC32
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


def test_write_synced_combines_the_crcs_it_is_given(tmp_path):
    blobs = [b"head", bytes(range(200)), b"", b"tail" * 99]
    known = [None, zlib.crc32(blobs[1]), zlib.crc32(blobs[2]), None]
    info = write_synced(str(tmp_path / "f"), *blobs, crc32s=known)
    data = (tmp_path / "f").read_bytes()
    assert info == {"bytes": len(data), "crc32": zlib.crc32(data)}
    with pytest.raises(ValueError, match="2 buffers but 1 CRC32s"):
        write_synced(str(tmp_path / "g"), b"a", b"b", crc32s=[None])


def test_rank_file_records_each_tensors_crc32(tmp_path):
    tensors = {"param/w": torch.randn(5, 7), "master/w": torch.randn(35).bfloat16(),
               "optim/w/step": torch.arange(3), "buffer/empty": torch.empty(0),
               "rng/torch": torch.get_rng_state()}
    path = str(tmp_path / "rank00000.safetensors")
    info = write_safetensors(path, tensors, {"shardtrain.rank": "0"}, checksums=HEADER_CRC32)
    data = (tmp_path / "rank00000.safetensors").read_bytes()
    assert info == {"bytes": len(data), "crc32": zlib.crc32(data)}
    with safe_open(path, framework="pt") as f:
        recorded = json.loads(f.metadata()[HEADER_CRC32])
        assert f.metadata()["shardtrain.rank"] == "0"
        for name, value in tensors.items():
            assert torch.equal(f.get_tensor(name), value)
            raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert recorded[name] == zlib.crc32(raw), name


def test_files_without_checksums_keep_their_metadata_as_given(tmp_path):
    path = str(tmp_path / "m.safetensors")
    write_safetensors(path, {"w": torch.ones(2)}, {"format": "pt"})
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

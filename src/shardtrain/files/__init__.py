"""Files: how the package writes them, and the byte formats its writers share.

Every writer of the package (checkpoints, exports, full weights, the autotuner's JSON files)
writes through here, so that no reader ever sees half a file:

* :mod:`._atomic`: :func:`atomic_path` (a temporary name beside the destination, fsync'ed,
  then renamed over it), :func:`write_synced` and :func:`synced_file` for writers that
  stage a whole directory, :func:`fsync_dir`, and :func:`write_json`;
* :mod:`._safetensors`: the safetensors format at the byte level (:func:`header_bytes`,
  :func:`tensor_bytes`), for the writers that stream tensors as they arrive;
* :mod:`._crc32`: :func:`crc32_combine`, a file's CRC32 from its parts' (zlib's, which
  Python does not expose);
* :mod:`._weights`: :func:`write_weights`, a flat state dict as one file.

This package imports no other room of shardtrain: checkpoint/, autotune/, full_weights.py
and memory/ build on it without depending on each other.

Example:
    >>> from shardtrain.files import atomic_path
    >>> with atomic_path("out/model.safetensors") as tmp:
    ...     safetensors.torch.save_file(tensors, tmp)
"""
from ._atomic import atomic_path, fsync_dir, synced_file, temporary_name, write_json, write_synced
from ._crc32 import crc32_combine
from ._safetensors import ST_DTYPES, ST_NAMES, Layout, header_bytes, tensor_bytes
from ._weights import write_weights

__all__ = ["atomic_path", "synced_file", "write_synced", "fsync_dir", "temporary_name",
           "write_json", "crc32_combine", "ST_DTYPES", "ST_NAMES", "Layout", "header_bytes",
           "tensor_bytes", "write_weights"]

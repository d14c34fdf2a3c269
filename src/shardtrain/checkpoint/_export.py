"""Export to the Hugging Face layout, streamed: shards of full weights with bounded memory.

The plan (:mod:`._export_plan`) comes from meta.json alone, so each shard's safetensors header
is written first and its tensors' bytes follow, read piece by piece from the rank files
(:meth:`._reading.Reader.stream`: views of the files' mapped memory, in chunks of at most
:data:`CHUNK_BYTES`) and converted to the output dtype one chunk at a time. What the process
allocates is at most one chunk converted to the output dtype; no output tensor, shard or
model is ever assembled in memory.

Only the tensors written are read: the module's weights (or the fp32 masters, for ``fp32``
of a 16-bit run) and buffers, never the optimizer states. They are verified without the
optimizer states too: every piece against the CRC32 its file's header recorded for it at the
save, each file's header against meta.json first (a checkpoint saved before per-tensor
CRC32s is checked file by file instead, which reads everything).

Publication is atomic per file and all-or-nothing for the set: every file is written under a
temporary name beside its destination and the names are swapped in only once all of them are
written, shards first, the index and config.json last. A failure leaves the directory as it
was. Then the shards of an earlier export that the new one does not replace are removed (a
stale ``model.safetensors`` would shadow a new index in ``from_pretrained``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, BinaryIO, Dict, List, Optional, Union

import torch

from ..files import atomic_path, header_bytes, tensor_bytes, write_synced
from ..log import logger
from ._agreement import as_plain_errors, corrupted
from ._consolidation import DTYPES, check_dtype
from ._export_plan import CONFIG, INDEX, Plan, Planned, plan_export, shard_size_bytes
from ._format import META
from ._reading import Reader, read_meta, tag_dir_of

__all__ = ["export_pretrained", "CHUNK_BYTES"]

CHUNK_BYTES = 64 * 2 ** 20  # of a saved tensor read, and converted, at a time
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")


def export_pretrained(checkpoint_dir: str, out_dir: str, max_shard_size: Union[int, str] = "5GB",
                      dtype: Optional[str] = None, tag: Optional[str] = None) -> List[str]:
    """Writes a checkpoint's model as ``save_pretrained`` does, for ``from_pretrained``.

    Runs in one CPU process with no process group, whatever world size and ZeRO stage saved
    the checkpoint, holding at most one chunk of one tensor in memory (never a whole shard
    or model). Reads the module's weights (or fp32 masters) and buffers, never the optimizer
    states, and checks every piece it reads against its recorded CRC32.

    Writes ``model.safetensors``, or, when the weights exceed ``max_shard_size``,
    ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json``; and
    ``config.json`` when the trained model had a Hugging Face ``config``. Tied weights are
    written once, as ``save_pretrained`` writes them.

    Args:
        checkpoint_dir: the ``save_dir`` given to ``save_checkpoint`` (or one tag directory).
        out_dir: the directory to write (created if needed; other files in it are kept).
        max_shard_size: the most bytes of tensor data per shard: a number or a size such as
            ``"5GB"`` or ``"2GiB"``. A tensor larger than that gets a shard of its own.
        dtype: as :func:`consolidate`: None keeps each saved dtype, ``"fp32"`` takes the fp32
            masters of a 16-bit run, ``"bf16"``/``"fp16"`` cast floating-point parameters.
        tag: the checkpoint to read; default the one named by ``latest``.

    Returns:
        The paths written: the shards, then the index and config.json when written.

    Raises:
        FileNotFoundError: no such directory or tag, or ``latest`` is missing.
        ValueError: a file or tensor is truncated or corrupted, an argument is invalid, or
            ``out_dir`` is a file.

    Example:
        >>> export_pretrained("checkpoints", "hf-model", max_shard_size="2GB", dtype="bf16")
        >>> model = transformers.AutoModelForCausalLM.from_pretrained("hf-model")
    """
    check_dtype(dtype)
    limit = shard_size_bytes(max_shard_size)
    tag_dir = tag_dir_of(os.fspath(checkpoint_dir), tag)
    meta = as_plain_errors(read_meta, tag_dir)
    plan = as_plain_errors(_plan, tag_dir, meta, DTYPES.get(dtype) if dtype else None, limit)
    if meta.get("excluded_frozen"):
        logger.warning("export: %s saved the model without its frozen parameters %s; "
                       "from_pretrained will initialise them afresh.", tag_dir,
                       meta["excluded_frozen"])
    out_dir = _output_directory(os.fspath(out_dir))
    written = as_plain_errors(_write_files, tag_dir, meta, plan, out_dir)
    _remove_stale(out_dir, {os.path.basename(p) for p in written})
    return written


def _plan(tag_dir: str, meta: Dict[str, Any], dtype: Optional[torch.dtype], limit: int) -> Plan:
    try:
        return plan_export(meta, dtype, limit)
    except (KeyError, TypeError) as error:  # a field read_meta does not check
        raise corrupted(os.path.join(tag_dir, META), f"unexpected layout: {error!r}") from None


def _output_directory(out_dir: str) -> str:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory: the Hugging Face layout is a "
                         "directory; give another path (or OUT.safetensors for one file).")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{out_dir}: cannot create the output directory ({error.strerror}); "
                         "give another path.") from None
    return out_dir


def _write_files(tag_dir: str, meta: Dict[str, Any], plan: Plan, out_dir: str) -> List[str]:
    """Every file under a temporary name; all renamed into place when the last is written
    (the stack exits last-in first-out: shards first, then config.json and the index)."""
    small = {INDEX: plan.index, CONFIG: plan.config}
    with contextlib.ExitStack() as stack:
        for name, content in small.items():
            if content is not None:
                tmp = stack.enter_context(atomic_path(os.path.join(out_dir, name)))
                write_synced(tmp, (json.dumps(content, indent=2, sort_keys=True) + "\n").encode())
        reader = Reader(tag_dir, meta, stack)
        for name, tensors in plan.shards:
            tmp = stack.enter_context(atomic_path(os.path.join(out_dir, name)))
            with open(tmp, "wb") as f:
                _write_shard(f, tensors, reader)
    shards = [os.path.join(out_dir, name) for name, _ in plan.shards]
    return shards + [os.path.join(out_dir, n) for n, c in small.items() if c is not None]


def _write_shard(f: BinaryIO, tensors: List[Planned], reader: Reader) -> None:
    """The header, then each tensor's bytes, chunk by chunk (converted per chunk)."""
    f.write(header_bytes([(t.name, t.dtype, t.shape) for t in tensors], {"format": "pt"}))
    for t in tensors:
        written = 0
        for chunk in reader.stream(t.key, t.entry, CHUNK_BYTES):
            # converted (a copy) only when the dtype changes, and freed once written
            f.write(tensor_bytes(chunk.to(t.dtype)))
            written += chunk.numel()
        assert written * t.dtype.itemsize == t.nbytes, "meta.json's pieces cover each tensor"


def _remove_stale(out_dir: str, written: set) -> None:
    """Weight files of an earlier export into ``out_dir`` that this one did not replace."""
    stale = [name for name in sorted(os.listdir(out_dir)) if name not in written
             and _OURS.fullmatch(name) and os.path.isfile(os.path.join(out_dir, name))]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    if stale:
        logger.info("export: removed %d file(s) an earlier export left in %s: %s", len(stale),
                    out_dir, ", ".join(stale))

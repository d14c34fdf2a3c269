"""The safetensors files of a pretrained checkpoint: where they are, what they hold, and reads
of a range of rows of one tensor.

A checkpoint is one ``.safetensors`` file, or a Hugging Face model directory holding either
``model.safetensors`` or the shards ``model-0000N-of-0000M.safetensors`` with
``model.safetensors.index.json``, whose ``weight_map`` names the file of every tensor.

Opening a file reads its header only (names, shapes, dtypes, byte offsets). A value is read
when asked for, as rows ``[r0, r1)`` of one tensor (along its first dimension): safetensors
reads exactly those bytes, so a rank that keeps a slice of a tensor never reads the rest of
it. Pickled checkpoints (``pytorch_model.bin``) are refused: a pickle cannot be read in parts,
and unpickling runs code.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
from safetensors import safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_LAYOUT = (f"a .safetensors file, or a Hugging Face model directory holding {SINGLE}, or "
           f"{INDEX} with its model-0000N-of-0000M.safetensors files")

#: safetensors' dtype names, for the torch dtypes this torch knows
_DTYPES: Dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2"}.items() if hasattr(torch, attr)}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint, from its file's header."""

    file: Path
    shape: Tuple[int, ...]
    dtype: torch.dtype


class WeightFiles:
    """The tensors of a checkpoint, by name; a context manager that keeps the files open.

    Args:
        path: a safetensors file, an index file or a model directory (see the module).

    Example:
        >>> with WeightFiles("gpt2-small") as files:
        ...     files.tensors["wte.weight"].shape, files.read("wte.weight", 0, 2).shape
    """

    def __init__(self, path: Union[str, Path]):
        self.source = Path(path)
        self.files = _checkpoint_files(self.source)
        self.tensors: Dict[str, TensorInfo] = {}
        self._stack = contextlib.ExitStack()
        self._handles: Dict[Path, object] = {}

    def __enter__(self) -> "WeightFiles":
        try:
            for file, wanted in self.files.items():
                handle = self._stack.enter_context(_open(file))
                self._handles[file] = handle
                self.tensors.update(_header(handle, file, wanted))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def read(self, name: str, rows: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of tensor ``name`` (all of it when ``rows`` is None), as stored."""
        info = self.tensors[name]
        handle = self._handles[info.file]
        if rows is None or not info.shape:
            return handle.get_tensor(name)
        return handle.get_slice(name)[rows[0]: rows[1]]


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors raises its own error types for a bad header
        raise ValueError(f"{file} is not a readable safetensors file ({error}): it is truncated "
                         "or of another format; save it again, e.g. with "
                         "safetensors.torch.save_file or save_pretrained.") from error


def _header(handle, file: Path, wanted: Optional[List[str]]) -> Dict[str, TensorInfo]:
    """The tensors ``file`` holds (only ``wanted`` ones, when its index names them)."""
    present = set(handle.keys())
    names = sorted(present) if wanted is None else wanted
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(f"{file.parent / INDEX} places {missing[:5]} in {file.name}, which "
                         "does not hold them: the index and the files come from different "
                         "saves; save the checkpoint again or fetch matching files.")
    out = {}
    for name in names:
        view = handle.get_slice(name)
        dtype = _DTYPES.get(view.get_dtype())
        if dtype is None:
            raise ValueError(f"{file}: tensor {name!r} has dtype {view.get_dtype()}, which this "
                             "torch cannot hold; convert the checkpoint to a torch dtype.")
        out[name] = TensorInfo(file, tuple(view.get_shape()), dtype)
    return out


def _checkpoint_files(path: Path) -> Dict[Path, Optional[List[str]]]:
    """file -> the tensor names its index places there (None: every tensor it holds)."""
    if path.is_dir():
        for name in (SINGLE, INDEX):
            if (path / name).is_file():
                return _checkpoint_files(path / name)
        raise FileNotFoundError(_no_weights_message(path))
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: give {_LAYOUT}.")
    if path.name.endswith(".index.json"):
        return _indexed_files(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path} is not a safetensors file: give {_LAYOUT}. "
                         f"{_PICKLE_ADVICE if path.suffix in ('.bin', '.pt', '.pth') else ''}")
    return {path: None}


_PICKLE_ADVICE = ("Pickled checkpoints are not read (they cannot be read in parts, and "
                  "unpickling runs code): convert once with "
                  "safetensors.torch.save_file(torch.load(path, weights_only=True), "
                  "'model.safetensors'), or save_pretrained(dir) in transformers.")


def _no_weights_message(path: Path) -> str:
    pickles = sorted(p.name for p in path.glob("*.bin"))
    found = f"it holds {pickles}. {_PICKLE_ADVICE}" if pickles else "it holds neither."
    return f"{path} has no {SINGLE} and no {INDEX}: {found}"


def _indexed_files(index: Path) -> Dict[Path, Optional[List[str]]]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                         f"'weight_map' of tensor name -> file name): {error!r}; save the "
                         "checkpoint again.") from error
    files: Dict[Path, Optional[List[str]]] = {}
    for name, file_name in weight_map.items():
        files.setdefault(_shard_path(index, str(file_name)), []).append(name)
    return files


def _shard_path(index: Path, file_name: str) -> Path:
    """A file the index names: a plain name in the index's own directory."""
    if Path(file_name).name != file_name or file_name in ("", ".", ".."):
        raise ValueError(f"{index} names the file {file_name!r}, which is not a plain file name "
                         "in its directory: the shards must sit beside the index; fix the "
                         "index or move the files there.")
    path = index.parent / file_name
    if not path.is_file():
        raise FileNotFoundError(f"{index} places tensors in {file_name}, which is not in "
                                f"{index.parent}: fetch or copy every shard the index names.")
    return path

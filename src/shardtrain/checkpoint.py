"""Checkpoints: save, load on any world size and ZeRO stage, and consolidate to one file.

A checkpoint is a directory ``<save_dir>/<tag>/``:

* ``meta.json``: format version, world size, stage, precision, the resolved config,
  counters, scheduler and loss-scaler state, the optimizer's param-group hyperparameters
  and per-parameter scalar states, and for every parameter its shape, dtype and which
  ``[lo, hi)`` of its flattened elements each rank file holds; sizes and CRC32s of the files.
* ``rank{r:05d}.safetensors``: rank ``r``'s even shard ``shard_range(numel, world, r)`` of
  every trainable parameter (``param/<name>``), of its fp32 master in 16-bit modes
  (``master/<name>``) and of each per-element optimizer state (``optim/<name>/<key>``);
  rank 0 also holds frozen parameters and buffers whole. Plus RNG and client tensors.
* ``rank{r:05d}.json``: the rank's RNG states and the JSON part of its ``client_state``.
* ``rank{r:05d}.client.pt``, only when ``client_state`` holds values JSON cannot (a trainer's
  whole state: nested tensors, sets, ``OrderedDict``s, ...): those keys, written by
  ``torch.save``.

Tensors come from safetensors and everything else from JSON, except that client file, which
is read with torch's restricted unpickler (``torch.load(weights_only=True)``): containers,
numbers, strings, tensors and the types registered with
``torch.serialization.add_safe_globals``; anything else is refused with its name, and no
code in the file runs.
Because every rank file holds an even, contiguous slice of each flattened parameter, loading
on another world size or stage only means reading the byte ranges that overlap the slices a
rank needs now. Writes are atomic: the files go to ``<tag>.tmp-<id>/``, which rank 0 renames
to ``<tag>`` once every rank has written and fsync'ed its part; ``latest`` is replaced last.

Example:
    >>> engine.save_checkpoint("checkpoints")                  # tag global_step<N>, on all ranks
    >>> path, client = engine.load_checkpoint("checkpoints")   # the tag named by ``latest``
    >>> consolidate("checkpoints", "model.safetensors")        # one process, no group needed
"""
from __future__ import annotations

import contextlib
import io
import json
import mmap
import pickle
import re
import os
import random
import shutil
import signal
import struct
import uuid
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from . import comm
from ._fileio import atomic_path, fsync_dir, write_synced
from .log import logger
from .zero._params import GatheredParameters, is_partitioned
from .zero._shards import shard_range

if TYPE_CHECKING:  # annotations only: nothing here imports the engine at run time
    from .engine import Engine

__all__ = ["consolidate", "full_weights", "save_checkpoint", "load_checkpoint", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_FORMAT = "shardtrain-checkpoint"
_META = "meta.json"
_LATEST = "latest"
_TMP = ".tmp-"            # <tag>.tmp-<id>: a save in progress (never named by ``latest``)
_REPLACED = ".replaced-"  # <tag>.replaced-<id>: the old <tag> while a re-save swaps it
_RESERVED_CLIENT_KEYS = ("checkpoint_parallel_dimensions",)  # as DeepSpeed
_FAULT_ENV = "SHARDTRAIN_CHECKPOINT_FAULT"  # test hook: "<point>@<rank>" kills that rank there
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Piece = Tuple[int, int, int]  # (rank, lo, hi): rank file ``rank`` holds elements [lo, hi)


def _rank_file(rank: int, ext: str) -> str:
    return f"rank{rank:05d}.{ext}"


# =============================================================================================
# Errors every rank agrees on
# =============================================================================================

_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
           "FileNotFoundError": FileNotFoundError, "NotImplementedError": NotImplementedError,
           "OSError": OSError, "RuntimeError": RuntimeError}


class _Problem(Exception):
    """A failure found by one rank; :func:`_agree` raises it on every rank."""

    def __init__(self, kind: type, message: str):
        super().__init__(message)
        self.kind, self.message = kind.__name__, message


def _problem_of(error: Exception) -> _Problem:
    if isinstance(error, _Problem):
        return error
    if isinstance(error, SafetensorError):
        return _Problem(ValueError, f"safetensors: {error}")
    if isinstance(error, KeyError) and error.args:
        return _Problem(KeyError, str(error.args[0]))  # str(KeyError) would add quotes
    for kind in _ERRORS.values():  # the most specific known type (FileNotFoundError first)
        if type(error) is kind:
            return _Problem(kind, str(error))
    kind = OSError if isinstance(error, OSError) else RuntimeError
    return _Problem(kind, f"{type(error).__name__}: {error}")


@contextlib.contextmanager
def _capture(box: List[Optional[_Problem]]) -> Iterator[None]:
    """Stores a phase's failure in ``box`` instead of raising it, so that the rank still
    joins the collective (:func:`_agree`) where every rank learns of it. Any exception is
    caught: one that escaped on one rank would leave the others waiting in that collective."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised on every rank by _agree
        if not isinstance(error, (_Problem, SafetensorError, OSError, ValueError, TypeError,
                                  KeyError, NotImplementedError)):
            logger.error("checkpoint: unexpected failure on rank %d", comm.get_rank(),
                         exc_info=True)
        box[0] = _problem_of(error)


def _agree(problem: Optional[_Problem], payload: Any = None) -> List[Any]:
    """Gathers every rank's outcome of a phase; raises the first rank's problem on all ranks.

    Every phase of a save or load ends here: a rank that fails still joins this collective,
    so no rank is left waiting in a collective the failing one never reaches.
    """
    sent = (problem.kind, problem.message) if problem is not None else None
    gathered = comm.all_gather_object((sent, payload))
    failures = [(rank, err) for rank, (err, _) in enumerate(gathered) if err is not None]
    if failures:
        rank, (kind, message) = failures[0]
        others = f" (and {len(failures) - 1} more rank(s) failed)" if len(failures) > 1 else ""
        where = f" [rank {rank}]" if len(gathered) > 1 else ""
        raise _ERRORS.get(kind, OSError)(f"{message}{where}{others}")
    return [p for _, p in gathered]


# =============================================================================================
# JSON values (no pickle anywhere)
# =============================================================================================

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype_from(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):  # never resolve anything but a dtype from a file
        raise _Problem(ValueError, f"{where} names an unknown dtype {name!r}: the checkpoint is "
                                   "corrupted or from a newer shardtrain.")
    return dtype


def _encode(value: Any, what: str) -> Any:
    """Plain JSON for ``value``; tuples and 0-d tensors are tagged so they come back as such."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return {"__tensor__": value.item(), "dtype": _dtype_name(value.dtype)}
        raise TypeError(f"{what} is a tensor of shape {list(value.shape)} inside a structure: "
                        "only top-level client_state tensors are stored (in safetensors); "
                        "move it to its own key.")
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{what}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return _encode_dict(value, what)
    raise TypeError(f"{what} is of type {type(value).__name__}: checkpoints store JSON values and "
                    "tensors only (never pickle); convert it to numbers, strings, lists or "
                    "dicts, or leave it out.")


def _encode_dict(value: Dict[Any, Any], what: str) -> Dict[str, Any]:
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or key in ("__tuple__", "__tensor__"):
            raise TypeError(f"{what} has the key {key!r}: checkpoint JSON needs string keys "
                            "(other than __tuple__/__tensor__).")
        out[key] = _encode(item, f"{what}[{key!r}]")
    return out


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=_dtype_from(value["dtype"], "a value"))
    return {k: _decode(v) for k, v in value.items()}


# =============================================================================================
# The engine's model states (the one place that knows where they live)
# =============================================================================================
# Stages 0-2 keep every module parameter whole on every rank. Stage 3 keeps only a shard of a
# partitioned parameter (the full shape in ``ds_shape``), which is exactly the even shard a
# rank file holds; any other range is gathered (a collective: every rank asks for it).

def _shape(p: torch.Tensor) -> List[int]:
    return list(getattr(p, "ds_shape", p.shape))


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _param_range(engine: "Engine", p: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the full flattened parameter (a view where possible)."""
    del engine
    if not is_partitioned(p):
        return p.detach().reshape(-1)[lo:hi]
    own_lo, own_hi = shard_range(p.ds_numel, comm.get_world_size(), comm.get_rank())
    if (lo, hi) == (own_lo, own_hi):
        return p.ds_tensor[: hi - lo]
    with GatheredParameters([p]):
        return p.ds_full.reshape(-1)[lo:hi].clone()


@torch.no_grad()
def _set_param(engine: "Engine", p: torch.Tensor, full: torch.Tensor) -> None:
    """Writes the full parameter ``full`` (1-D, any dtype) into the module (at stage 3,
    into this rank's shard of it)."""
    del engine
    if not is_partitioned(p):
        p.data.copy_(full.reshape(p.shape))
        return
    lo, hi = shard_range(p.ds_numel, comm.get_world_size(), comm.get_rank())
    p.ds_tensor[: hi - lo].copy_(full.reshape(-1)[lo:hi])


@dataclass
class _Trainable:
    """A trainable parameter and what the optimizer holds of it on this rank."""

    name: str
    param: torch.nn.Parameter
    lo: int          # [lo, hi): the optimizer's slice of the flattened parameter on this rank
    hi: int
    tensor: Optional[torch.Tensor]  # the optimizer's tensor (None when the slice is empty)

    @property
    def has_master(self) -> bool:
        """An fp32 master of a 16-bit parameter: the only copy that holds more than the
        module's own weights (and so the only one saved)."""
        return self.tensor is not None and self.param.dtype != torch.float32

    def is_copy(self, engine: "Engine") -> bool:
        """The optimizer updates a copy of the slice (a master, or a host copy when the
        optimizer is offloaded), not the parameter's own memory: a load must set it too."""
        if self.tensor is None:
            return False
        own = _param_range(engine, self.param, self.lo, self.hi)
        return not (self.tensor.device == own.device and self.tensor.dtype == own.dtype
                    and self.tensor.data_ptr() == own.data_ptr())


def _named_params(engine: "Engine") -> List[Tuple[str, torch.nn.Parameter]]:
    return list(engine.module.named_parameters())  # tied weights appear once


def _named_buffers(engine: "Engine") -> List[Tuple[str, torch.Tensor]]:
    persistent = set(engine.module.state_dict(keep_vars=True))  # non-persistent ones are not
    return [(n, b) for n, b in engine.module.named_buffers() if n in persistent]


def _trainables(engine: "Engine") -> Dict[str, _Trainable]:
    view = engine._strategy.view
    index = {id(p): i for i, p in enumerate(view.params)}
    out = {}
    for name, p in _named_params(engine):
        if id(p) in index:
            i = index[id(p)]
            lo, hi = view.slices[i]
            out[name] = _Trainable(name, p, lo, hi, view.tensors[i])
    return out


def _aliases(engine: "Engine") -> Dict[str, str]:
    """state_dict names that are another name's tensor (tied weights) -> that name."""
    canon = {id(t): n for n, t in _named_params(engine) + _named_buffers(engine)}
    return {k: canon[id(v)] for k, v in engine.module.state_dict(keep_vars=True).items()
            if canon.get(id(v), k) != k}


def _check_stage(engine: "Engine", what: str) -> None:
    if engine.zero_optimization_stage() not in (0, 1, 2, 3):
        raise NotImplementedError(f"{what} at ZeRO stage {engine.zero_optimization_stage()} "
                                  "is not supported.")


def _any_partitioned(engine: "Engine") -> bool:
    return any(is_partitioned(p) for p in engine.module.parameters())


def _device_rng(engine: "Engine"):
    """The device's RNG module, or None where torch's CPU generator is the only one."""
    module = torch.get_device_module(engine.device)
    return module if hasattr(module, "get_rng_state") else None


# =============================================================================================
# Saving
# =============================================================================================

def save_checkpoint(engine: "Engine", save_dir: str, tag: Optional[str] = None,
                    client_state: Optional[Dict[str, Any]] = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Saves the engine's full training state to ``<save_dir>/<tag>/``; call it on all ranks.

    See :meth:`shardtrain.Engine.save_checkpoint` for the arguments.
    """
    if not save_dir:
        raise ValueError("save_checkpoint: save_dir is empty; give the directory to save into.")
    _check_stage(engine, "save_checkpoint")
    save_dir = os.fspath(save_dir)
    tag = _agreed_tag(engine, tag)
    rank = comm.get_rank()
    box: List[Optional[_Problem]] = [None]
    staged, token, infos = None, None, {}
    with _capture(box):  # everything that can refuse happens before any file is written
        staged = _stage_rank(engine, client_state or {}, exclude_frozen_parameters)
        if rank == 0:
            token = _prepare_dirs(save_dir, tag)
    token = _agree(box[0], token)[0]  # also the barrier: the directory exists from here on
    tmp = os.path.join(save_dir, f"{tag}{_TMP}{token}")
    with _removed_on_failure(tmp if rank == 0 else None):
        with _capture(box):
            infos = _write_rank(tmp, staged)
        files = {name: info for per_rank in _agree(box[0], infos) for name, info in
                 per_rank.items()}
        if rank == 0:
            with _capture(box):
                _publish(save_dir, tag, token, staged.meta, files, save_latest)
        _agree(box[0])
    return True


@contextlib.contextmanager
def _removed_on_failure(tmp: Optional[str]) -> Iterator[None]:
    """Rank 0 removes the temporary tag directory of a save that failed (one that was
    killed leaves it; the next save of the tag clears it)."""
    try:
        yield
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _agreed_tag(engine: "Engine", tag: Optional[str]) -> str:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tags = comm.all_gather_object(tag)
    if len(set(tags)) > 1:
        mode = engine.config.checkpoint.tag_validation
        message = (f"save_checkpoint: ranks passed different tags {sorted(set(tags))}; rank 0's "
                   f"{tags[0]!r} is used. Pass the same tag on every rank.")
        if mode == "Fail":
            raise ValueError(message + " (checkpoint.tag_validation is Fail)")
        if mode == "Warn":
            logger.warning(message)
    tag = tags[0]
    bad = (not tag or tag in (".", "..", _LATEST) or "/" in tag or os.sep in tag
           or _TMP in tag or _REPLACED in tag)
    if bad:
        raise ValueError(f"save_checkpoint: tag {tag!r} cannot name a checkpoint directory "
                         f"(no '/', not 'latest', no '{_TMP}' or '{_REPLACED}'); choose another.")
    return tag


@dataclass
class _Staged:
    """What one rank writes, prepared (and validated) before anything touches the disk."""

    tensors: Dict[str, torch.Tensor]
    rank_json: Dict[str, Any]
    meta: Optional[Dict[str, Any]] = None  # rank 0 only
    rank: int = 0
    client_objects: Optional[bytes] = None  # the pickled part of client_state, if any


def _stage_rank(engine: "Engine", client_state: Dict[str, Any],
                exclude_frozen: bool) -> _Staged:
    client_json, client_tensors, client_objects = _split_client_state(client_state)
    rank, world = comm.get_rank(), comm.get_world_size()
    trainables = _trainables(engine)
    tensors: Dict[str, torch.Tensor] = {}
    for t in trainables.values():
        tensors.update(_trainable_shard(engine, t, world, rank))
    if rank == 0 or _any_partitioned(engine):  # a partitioned frozen one is gathered by all
        whole = _whole_tensors(engine, trainables, exclude_frozen)
        if rank == 0:
            tensors.update(whole)
    tensors.update({f"client/{k}": v for k, v in client_tensors.items()})
    rng_json, rng_tensors = _rng_state(engine)
    tensors.update(rng_tensors)
    # Device tensors are copied to the CPU now; CPU ones are written from where they are
    # (nothing changes them while the save runs: it is synchronous).
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    rank_json = {"rank": rank, "rng": rng_json,
                 "client": {"json": client_json, "tensors": sorted(client_tensors),
                            "objects": sorted(map(str, client_objects))}}
    meta = _describe(engine, trainables, exclude_frozen) if rank == 0 else None
    return _Staged(cpu, rank_json, meta, rank, _pickle_client(client_objects))


def _split_client_state(client_state: Dict[str, Any]
                        ) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[Any, Any]]:
    """(JSON part, top-level tensors, everything else): a key whose value JSON cannot hold
    (a trainer's whole state) goes to the pickled part, whole."""
    if not isinstance(client_state, dict):
        raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}.")
    for key in _RESERVED_CLIENT_KEYS:
        if key in client_state:
            raise KeyError(f"client_state key {key!r} is reserved by the checkpoint format; "
                           "rename it.")
    tensors = {k: v for k, v in client_state.items()
               if isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() > 0}
    as_json: Dict[str, Any] = {}
    objects: Dict[Any, Any] = {}
    for key, value in client_state.items():
        if key in tensors:
            continue
        if isinstance(key, str) and _is_plain(value):
            as_json.update(_encode_dict({key: value}, "client_state"))
        else:
            objects[key] = value
    return as_json, tensors, objects


def _is_plain(value: Any) -> bool:
    """Whether JSON gives ``value`` back as it is: exact containers (an ``OrderedDict``, a
    ``torch.Size`` or a named tuple would come back as a plain dict or tuple), string keys,
    numbers, strings, 0-d tensors."""
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, np.generic):
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    if type(value) in (list, tuple):
        return all(_is_plain(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, str) and k not in ("__tuple__", "__tensor__") and _is_plain(v)
                   for k, v in value.items())
    return False


def _pickle_client(objects: Dict[Any, Any]) -> Optional[bytes]:
    """``torch.save`` of the client values JSON cannot hold, made before any write, so a
    value that cannot be pickled fails the save before the disk is touched."""
    if not objects:
        return None
    buffer = io.BytesIO()
    try:
        torch.save(objects, buffer)
    except Exception as error:  # pickle raises many kinds (TypeError, AttributeError, ...)
        raise TypeError(f"client_state cannot be saved: {type(error).__name__}: {error}. "
                        f"Keys {sorted(map(str, objects))} hold values JSON cannot store, so "
                        f"they are pickled, and this one cannot be.") from None
    return buffer.getvalue()


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _unpickle_client(path: str, data: bytes) -> Dict[Any, Any]:
    """The pickled part of a client_state, through torch's restricted unpickler."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = _GLOBAL.search(str(error))
        name = found.group(1) if found else "an object of a type it does not know"
        raise _Problem(ValueError, (
            f"{path}: client_state holds {name}, which the checkpoint loader refuses: "
            f"unpickling an arbitrary type can run code. If you trust this checkpoint, allow "
            f"the type before loading: torch.serialization.add_safe_globals([{name}]).")) from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise _corrupted(path, f"its client_state cannot be read: {error}") from None


def _elementwise(value: Any, tensor: torch.Tensor) -> bool:
    """An optimizer state stored per element of the slice (Adam's moments, momentum)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == tensor.shape


def _trainable_shard(engine: "Engine", t: _Trainable, world: int,
                     rank: int) -> Dict[str, torch.Tensor]:
    """This rank's even shard of the parameter, its master and its per-element states."""
    lo, hi = shard_range(_numel(t.param), world, rank)
    if hi <= lo:
        return {}
    assert t.lo <= lo and hi <= t.hi, "a rank's optimizer slice must hold its even shard"
    out = {f"param/{t.name}": _param_range(engine, t.param, lo, hi)}
    a, b = lo - t.lo, hi - t.lo  # the shard within the optimizer's slice
    if t.has_master:
        out[f"master/{t.name}"] = t.tensor.detach().reshape(-1)[a:b]
    state = engine.optimizer.state.get(t.tensor, {}) if engine.optimizer is not None else {}
    for key, value in state.items():
        if _elementwise(value, t.tensor):
            out[f"optim/{t.name}/{key}"] = value.detach().reshape(-1)[a:b]
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise NotImplementedError(
                f"optimizer state {key!r} of parameter {t.name!r} has shape "
                f"{list(value.shape)}, neither per-element ({list(t.tensor.shape)}) nor scalar: "
                "checkpoints cannot reshard it. Use an elementwise optimizer (Adam, SGD, ...).")
    return out


def _whole_tensors(engine: "Engine", trainables: Dict[str, _Trainable],
                   exclude_frozen: bool) -> Dict[str, torch.Tensor]:
    """Frozen parameters and buffers, written whole by rank 0."""
    out = {}
    if not exclude_frozen:
        for name, p in _named_params(engine):
            if name not in trainables:
                out[f"param/{name}"] = _param_range(engine, p, 0, _numel(p))
    for name, b in _named_buffers(engine):
        out[f"buffer/{name}"] = b.detach().reshape(-1)
    return out


def _rng_state(engine: "Engine") -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    as_json = {"python": _encode(random.getstate(), "random state"),
               "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                         "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    tensors = {"rng/torch": torch.get_rng_state()}
    device = _device_rng(engine)
    if device is not None:
        tensors["rng/device"] = device.get_rng_state()
    return as_json, tensors


def _describe(engine: "Engine", trainables: Dict[str, _Trainable],
              exclude_frozen: bool) -> Dict[str, Any]:
    """meta.json: everything but the tensors, written by rank 0 (which holds a non-empty
    slice of every parameter, so it sees every parameter's scalar optimizer states)."""
    world = comm.get_world_size()
    params, excluded = {}, []
    for name, p in _named_params(engine):
        if name in trainables:
            params[name] = _trainable_meta(engine, trainables[name], world)
        elif exclude_frozen:
            excluded.append(name)
        else:
            params[name] = _tensor_meta(p, [(0, 0, _numel(p))] if _numel(p) else [])
    buffers = {n: _tensor_meta(b, [(0, 0, b.numel())] if b.numel() else [])
               for n, b in _named_buffers(engine)}
    return {"format": _FORMAT, "version": FORMAT_VERSION, "world_size": world,
            "zero_stage": engine.zero_optimization_stage(),
            "precision": _precision_meta(engine), "config": engine.config.to_dict(),
            "counters": _counters_meta(engine), "params": params, "buffers": buffers,
            "aliases": _aliases(engine), "excluded_frozen": excluded,
            "optimizer": _optimizer_meta(engine), "lr_scheduler": _scheduler_meta(engine),
            "loss_scaler": engine.loss_scaler.state_dict(),
            "data_sampler": _sampler_meta(engine)}


def _counters_meta(engine: "Engine") -> Dict[str, int]:
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "gradient_accumulation_steps": engine.gradient_accumulation_steps()}


def _tensor_meta(t: torch.Tensor, pieces: List[Piece]) -> Dict[str, Any]:
    return {"shape": _shape(t), "dtype": _dtype_name(t.dtype), "numel": _numel(t),
            "trainable": False, "master": False, "pieces": [list(p) for p in pieces]}


def _trainable_meta(engine: "Engine", t: _Trainable, world: int) -> Dict[str, Any]:
    n = _numel(t.param)
    pieces = [(r, *shard_range(n, world, r)) for r in range(world)]
    entry = _tensor_meta(t.param, [p for p in pieces if p[2] > p[1]])
    entry.update(trainable=True, master=t.param.dtype != torch.float32)
    opt = engine.optimizer
    if opt is None or t.tensor is None:
        return entry
    groups = [i for i, g in enumerate(opt.param_groups) if any(x is t.tensor for x in g["params"])]
    entry["group"] = groups[0] if groups else None
    state = opt.state.get(t.tensor)
    if state:
        entry["state"] = {
            "tensors": {k: _dtype_name(v.dtype) for k, v in state.items()
                        if _elementwise(v, t.tensor)},
            "scalars": {k: _encode(v, f"optimizer state {k!r} of {t.name!r}")
                        for k, v in state.items() if not _elementwise(v, t.tensor)}}
    return entry


def _precision_meta(engine: "Engine") -> Dict[str, Any]:
    precision = engine._precision
    autocast = precision.autocast_dtype
    return {"param_dtype": _dtype_name(precision.param_dtype),
            "autocast_dtype": _dtype_name(autocast) if autocast is not None else None,
            "loss_scaling": torch.float16 in (precision.param_dtype, autocast)}


def _optimizer_meta(engine: "Engine") -> Optional[Dict[str, Any]]:
    opt = engine.optimizer
    if opt is None:
        return None
    groups = [_encode({k: v for k, v in g.items() if k != "params"}, f"param group {i}")
              for i, g in enumerate(opt.param_groups)]
    return {"class": type(opt).__name__, "groups": groups}


def _scheduler_meta(engine: "Engine") -> Optional[Dict[str, Any]]:
    sched = engine.lr_scheduler
    if sched is None or not hasattr(sched, "state_dict"):
        return None
    return {"class": type(sched).__name__,
            "state": _encode(sched.state_dict(), f"{type(sched).__name__}.state_dict()")}


def _sampler_meta(engine: "Engine") -> Optional[Dict[str, Any]]:
    loader = engine.training_dataloader
    return loader.state_dict() if loader is not None else None


# -- writing ----------------------------------------------------------------------------------

def _prepare_dirs(save_dir: str, tag: str) -> str:
    """Rank 0: the save directory, a fresh temporary tag directory, stale ones cleared."""
    os.makedirs(save_dir, exist_ok=True)
    _recover_replaced(save_dir, tag)
    for entry in os.listdir(save_dir):  # left by saves that were killed
        if entry.startswith(f"{tag}{_TMP}"):
            shutil.rmtree(os.path.join(save_dir, entry), ignore_errors=True)
        elif entry.startswith(f"{_LATEST}{_TMP}"):
            os.remove(os.path.join(save_dir, entry))
    token = uuid.uuid4().hex[:12]
    os.mkdir(os.path.join(save_dir, f"{tag}{_TMP}{token}"))
    return token


def _recover_replaced(save_dir: str, tag: str) -> None:
    """A re-save killed between its two renames left the old ``<tag>`` as
    ``<tag>.replaced-<id>``: put it back (or drop it if the new ``<tag>`` got in place)."""
    final = os.path.join(save_dir, tag)
    for entry in sorted(os.listdir(save_dir)):
        if not entry.startswith(f"{tag}{_REPLACED}"):
            continue
        path = os.path.join(save_dir, entry)
        if os.path.isdir(final):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.rename(path, final)


def _write_rank(tmp: str, staged: _Staged) -> Dict[str, Dict[str, int]]:
    """Writes this rank's two files (fsync'ed); returns their sizes and CRC32s."""
    tensors_name = _rank_file(staged.rank, "safetensors")
    infos = {tensors_name: _write_safetensors(os.path.join(tmp, tensors_name), staged.tensors)}
    _fault("after_file")
    json_name = _rank_file(staged.rank, "json")
    infos[json_name] = write_synced(os.path.join(tmp, json_name),
                                     json.dumps(staged.rank_json).encode())
    _fault("after_file")
    if staged.client_objects is not None:
        name = _rank_file(staged.rank, "client.pt")
        infos[name] = write_synced(os.path.join(tmp, name), staged.client_objects)
    return infos


def _write_safetensors(path: str, tensors: Dict[str, torch.Tensor],
                       metadata: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """The safetensors format (an 8-byte header length, a JSON header, then each tensor's
    bytes), written straight from the tensors' memory: the library's ``save`` would first
    copy everything into one bytes object. Files are read back with safetensors itself."""
    names = sorted(tensors)
    header: Dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    views = [_raw_bytes(tensors[name]) for name in names]
    return write_synced(path, struct.pack("<Q", len(head)), head, *views)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # Little-endian bytes, as the format wants (every platform torch supports is).
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _fault(point: str) -> None:
    """Test hook: ``SHARDTRAIN_CHECKPOINT_FAULT=<point>@<rank>`` kills that rank at ``point``
    (SIGKILL: no clean-up runs), to prove a killed save leaves the previous one loadable."""
    wanted = os.environ.get(_FAULT_ENV)
    if wanted and wanted == f"{point}@{comm.get_rank()}":
        os.kill(os.getpid(), signal.SIGKILL)


def _publish(save_dir: str, tag: str, token: str, meta: Dict[str, Any],
             files: Dict[str, Dict[str, int]], save_latest: bool) -> None:
    """Rank 0, once every rank's files are on disk: meta.json, then the rename that makes
    the tag visible, then ``latest``. A kill at any point leaves a loadable checkpoint."""
    tmp = os.path.join(save_dir, f"{tag}{_TMP}{token}")
    meta = dict(meta, tag=tag, files=files)
    write_synced(os.path.join(tmp, _META), json.dumps(meta, indent=1).encode())
    fsync_dir(tmp)
    _fault("before_rename")
    final = os.path.join(save_dir, tag)
    replaced = os.path.join(save_dir, f"{tag}{_REPLACED}{token}")
    if os.path.exists(final):  # a directory cannot be renamed over a non-empty one
        os.rename(final, replaced)
        _fault("between_renames")
    os.rename(tmp, final)
    fsync_dir(save_dir)
    shutil.rmtree(replaced, ignore_errors=True)
    _fault("before_latest")
    if save_latest:
        with atomic_path(os.path.join(save_dir, _LATEST)) as latest_tmp:
            write_synced(latest_tmp, tag.encode())  # no newline: DeepSpeed's convention


# =============================================================================================
# Reading
# =============================================================================================

def _resolve(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag directory to load; None when ``tag`` is None and there is no ``latest``."""
    if not os.path.isdir(load_dir):
        raise _Problem(FileNotFoundError, f"checkpoint directory {load_dir!r} does not exist; "
                                          "check the path.")
    if tag is None:
        latest = os.path.join(load_dir, _LATEST)
        if not os.path.isfile(latest):
            return None
        with open(latest, "rb") as f:
            tag = f.read().decode("utf-8", errors="replace").strip()
        if not tag or "/" in tag or os.sep in tag:
            raise _Problem(ValueError, f"{latest} holds {tag!r}, not a tag name; pass tag= to "
                                       "name the checkpoint.")
    path = os.path.join(load_dir, str(tag))
    if os.path.isdir(path):
        return path
    for entry in sorted(os.listdir(load_dir)):
        if entry.startswith(f"{tag}{_REPLACED}") and \
                os.path.isfile(os.path.join(load_dir, entry, _META)):
            logger.warning("checkpoint %s: using %s, left by a re-save that was interrupted",
                           path, entry)
            return os.path.join(load_dir, entry)
    tags = sorted(e for e in os.listdir(load_dir) if _TMP not in e and _REPLACED not in e
                  and os.path.isfile(os.path.join(load_dir, e, _META)))
    raise _Problem(FileNotFoundError, f"checkpoint tag {str(tag)!r} not found in {load_dir!r} "
                                      f"(tags there: {tags or 'none'}).")


def _read_json(path: str, info: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise _Problem(FileNotFoundError, f"{path} is missing: the checkpoint is incomplete; "
                                          "re-save it or load another tag.") from None
    if info is not None:
        _check_blob(path, blob, info)
    try:
        value = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupted(path, f"JSON: {error}") from None
    if not isinstance(value, dict):
        raise _corrupted(path, "JSON: not an object")
    return value


def _corrupted(path: str, why: str) -> _Problem:
    return _Problem(ValueError, f"{path} is truncated or corrupted ({why}); re-save it or load "
                                "another tag.")


def _check_blob(path: str, blob: bytes, info: Dict[str, int]) -> None:
    if len(blob) != info["bytes"]:
        raise _corrupted(path, f"{len(blob)} bytes, meta.json says {info['bytes']}")
    if zlib.crc32(blob) != info["crc32"]:
        raise _corrupted(path, "its CRC32 does not match meta.json's")


def _read_meta(tag_dir: str) -> Dict[str, Any]:
    path = os.path.join(tag_dir, _META)
    if not os.path.isfile(path):
        raise _Problem(FileNotFoundError, f"{path} is missing: {tag_dir} is not a complete "
                                          "checkpoint (was its save interrupted?).")
    meta = _read_json(path)
    if meta.get("format") != _FORMAT:
        raise _corrupted(path, f"format {meta.get('format')!r}, expected {_FORMAT!r}")
    if not isinstance(meta.get("version"), int) or meta["version"] > FORMAT_VERSION:
        raise _Problem(ValueError, f"{path} has format version {meta.get('version')!r}; this "
                                   f"shardtrain reads up to {FORMAT_VERSION}: upgrade it.")
    missing = [k for k in ("world_size", "params", "buffers", "files", "counters") if k not in meta]
    if missing:
        raise _corrupted(path, f"no {missing}")
    return meta


def _file_crc32(path: str) -> int:
    # Mapped, not read: the checksum streams through the page cache without copies.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return zlib.crc32(mapped)


class _Reader:
    """Reads byte ranges of the rank files, checking each file against meta.json."""

    def __init__(self, tag_dir: str, meta: Dict[str, Any], stack: contextlib.ExitStack):
        self.dir, self.meta, self.stack = tag_dir, meta, stack
        self.handles: Dict[int, Any] = {}
        self.keys: Dict[int, set] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def info(self, name: str) -> Dict[str, int]:
        info = self.meta["files"].get(name)
        if not isinstance(info, dict) or not {"bytes", "crc32"} <= set(info):
            raise _corrupted(self.path(_META), f"no size and CRC32 for {name}")
        return info

    def verify(self, name: str) -> None:
        """Checks a whole file's size and CRC32 (streamed)."""
        path, info = self.path(name), self.info(name)
        try:
            size = os.path.getsize(path)
            if size != info["bytes"]:
                raise _corrupted(path, f"{size} bytes, meta.json says {info['bytes']}")
            crc = _file_crc32(path) if size else 0
        except FileNotFoundError:
            raise self._missing(path) from None
        if crc != info["crc32"]:
            raise _corrupted(path, "its CRC32 does not match meta.json's")

    def _missing(self, path: str) -> _Problem:
        return _Problem(FileNotFoundError, f"{path} is missing: the checkpoint is incomplete; "
                                           "re-save it or load another tag.")

    def handle(self, rank: int):
        if rank not in self.handles:
            name = _rank_file(rank, "safetensors")
            path, info = self.path(name), self.info(name)
            if not os.path.isfile(path):
                raise self._missing(path)
            if os.path.getsize(path) != info["bytes"]:  # cheap: catches truncation first
                raise _corrupted(path, f"{os.path.getsize(path)} bytes, meta.json says "
                                       f"{info['bytes']}")
            try:
                self.handles[rank] = self.stack.enter_context(safe_open(path, framework="pt"))
            except SafetensorError as error:
                raise _corrupted(path, f"safetensors: {error}") from None
        return self.handles[rank]

    def tensor_names(self, rank: int) -> set:
        if rank not in self.keys:
            self.keys[rank] = set(self.handle(rank).keys())
        return self.keys[rank]

    def read(self, key: str, entry: Dict[str, Any], lo: int, hi: int,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Elements [lo, hi) of ``key``'s flattened tensor, from the files that hold them."""
        dtype = dtype or _dtype_from(entry["dtype"], f"meta.json entry {key!r}")
        overlaps = [(rank, plo, phi, max(lo, plo), min(hi, phi))
                    for rank, plo, phi in entry["pieces"] if max(lo, plo) < min(hi, phi)]
        if sum(b - a for *_, a, b in overlaps) != hi - lo:
            raise _corrupted(self.path(_META), f"the pieces of {key!r} do not cover [{lo}, {hi})")
        if len(overlaps) == 1:  # one file holds it all: no assembly copy
            rank, plo, phi, a, b = overlaps[0]
            return self._piece(rank, key, phi - plo, dtype)[a - plo: b - plo]
        out = torch.empty(hi - lo, dtype=dtype)
        for rank, plo, phi, a, b in overlaps:
            out[a - lo: b - lo] = self._piece(rank, key, phi - plo, dtype)[a - plo: b - plo]
        return out

    def _piece(self, rank: int, key: str, numel: int, dtype: torch.dtype):
        f = self.handle(rank)
        path = self.path(_rank_file(rank, "safetensors"))
        if key not in self.tensor_names(rank):
            raise _corrupted(path, f"no tensor {key!r}")
        piece = f.get_slice(key)
        if piece.get_shape() != [numel] or _ST_DTYPES.get(piece.get_dtype()) != dtype:
            raise _corrupted(path, f"{key!r} is {piece.get_dtype()}{piece.get_shape()}, "
                                   f"meta.json says {_dtype_name(dtype)}[{numel}]")
        return piece


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


# =============================================================================================
# Loading
# =============================================================================================

@dataclass
class _LoadOptions:
    strict: bool
    optimizer: bool
    scheduler: bool
    module_only: bool


@dataclass
class _Loaded:
    """Everything a rank will apply, read and checked before the engine is touched."""

    params: Dict[str, torch.Tensor] = field(default_factory=dict)    # name -> full, 1-D
    shards: Dict[str, torch.Tensor] = field(default_factory=dict)    # stage 3: name -> own shard
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    masters: Dict[str, torch.Tensor] = field(default_factory=dict)   # name -> slice, fp32
    states: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # name -> optimizer state
    rank_json: Optional[Dict[str, Any]] = None
    rank_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    client: Dict[str, Any] = field(default_factory=dict)


def load_checkpoint(engine: "Engine", load_dir: str, tag: Optional[str] = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False
                    ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Loads a checkpoint saved on any world size and stage; call it on all ranks.

    See :meth:`shardtrain.Engine.load_checkpoint` for the arguments.
    """
    _check_stage(engine, "load_checkpoint")
    load_dir = os.fspath(load_dir)
    options = _LoadOptions(load_module_strict, load_optimizer_states and not load_module_only,
                           load_lr_scheduler_states and not load_module_only, load_module_only)
    box: List[Optional[_Problem]] = [None]
    tag_dir = meta = None
    with _capture(box):
        tag_dir = _resolve(load_dir, tag)
        meta = _read_meta(tag_dir) if tag_dir is not None else None
    found = _agree(box[0], tag_dir)
    if all(path is None for path in found):
        logger.warning("load_checkpoint: %s has no 'latest' file; nothing loaded. Pass tag= "
                       "to choose a checkpoint.", os.path.join(load_dir, _LATEST))
        return None, None
    loaded = _Loaded()
    with contextlib.ExitStack() as stack, _capture(box):
        if len(set(found)) > 1:  # e.g. node-local directories that differ
            raise _Problem(ValueError, f"ranks found different checkpoints in {load_dir!r} "
                                       f"({sorted(set(map(str, found)))}): every rank must see "
                                       "the same checkpoint directory.")
        reader = _Reader(tag_dir, meta, stack)
        _verify_share(reader, meta)
        loaded = _read_everything(engine, meta, reader, options)
    _agree(box[0])
    _apply(engine, meta, loaded, options)
    return tag_dir, loaded.client


def _verify_share(reader: _Reader, meta: Dict[str, Any]) -> None:
    """This rank's share of the whole-file checks: file k is checked by rank k mod world,
    so every file is checked once, in parallel, whatever the two world sizes are."""
    rank, world = comm.get_rank(), comm.get_world_size()
    for k, name in enumerate(sorted(meta["files"])):
        if k % world == rank:
            reader.verify(name)


def _read_everything(engine: "Engine", meta: Dict[str, Any], reader: _Reader,
                     options: _LoadOptions) -> _Loaded:
    try:
        _check_model(engine, meta, reader.path(_META), options.strict)
        loaded = _Loaded()
        _read_module(engine, meta, reader, loaded)
        _check_sampler(engine, meta, reader.path(_META), options)
        if options.optimizer and engine.optimizer is not None:
            _check_optimizer(engine, meta, reader.path(_META))
            _read_optimizer(engine, meta, reader, loaded)
        _read_rank_files(meta, reader, loaded)
        return loaded
    except (KeyError, TypeError, IndexError) as error:  # a meta.json of the wrong layout
        raise _corrupted(reader.path(_META), f"unexpected layout: {error!r}") from None


def _check_model(engine: "Engine", meta: Dict[str, Any], where: str, strict: bool) -> None:
    """Names and shapes: a checkpoint of another model is refused before anything is read."""
    ckpt_dir = os.path.dirname(where)
    for kind, saved, current in (("parameter", meta["params"], dict(_named_params(engine))),
                                 ("buffer", meta["buffers"], dict(_named_buffers(engine)))):
        for name, entry in saved.items():
            if name in current and list(entry["shape"]) != _shape(current[name]):
                raise _Problem(ValueError, (
                    f"checkpoint {ckpt_dir} has {kind} {name!r} of shape {entry['shape']} but "
                    f"the model's is {_shape(current[name])}: this checkpoint is for another "
                    "model."))
        excluded = set(meta.get("excluded_frozen", [])) if kind == "parameter" else set()
        missing = sorted(set(current) - set(saved) - excluded)
        unexpected = sorted(set(saved) - set(current))
        if strict and (missing or unexpected):
            raise _Problem(ValueError, (
                f"checkpoint {ckpt_dir} does not match the model's {kind}s: missing from the "
                f"checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, not in the model "
                f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. It is for another "
                "model; pass load_module_strict=False to load the names both have."))


def _module_key(entry: Dict[str, Any], name: str, module_dtype: torch.dtype) -> str:
    """The saved copy to restore a module parameter from: the fp32 master when the module
    is fp32 now and the checkpoint has one (the 16-bit copy lost precision)."""
    if entry.get("master") and module_dtype == torch.float32:
        return f"master/{name}"
    return f"param/{name}"


def _entry_for(entry: Dict[str, Any], key: str) -> Dict[str, Any]:
    """The meta entry of one saved tensor of a parameter (masters are fp32)."""
    return dict(entry, dtype="float32") if key.startswith("master/") else entry


def _read_module(engine: "Engine", meta: Dict[str, Any], reader: _Reader,
                 loaded: _Loaded) -> None:
    for name, p in _named_params(engine):
        entry = meta["params"].get(name)
        if entry is None:
            continue
        key = _module_key(entry, name, p.dtype)
        if is_partitioned(p):  # only this rank's shard: a rank never holds the whole model
            lo, hi = shard_range(p.ds_numel, comm.get_world_size(), comm.get_rank())
            loaded.shards[name] = reader.read(key, _entry_for(entry, key), lo, hi).to(p.dtype)
            continue
        full = reader.read(key, _entry_for(entry, key), 0, _numel(p))
        loaded.params[name] = full.to(p.dtype)
    for name, b in _named_buffers(engine):
        if name in meta["buffers"]:
            entry = meta["buffers"][name]
            loaded.buffers[name] = reader.read(f"buffer/{name}", entry, 0, b.numel()).to(b.dtype)


def _check_sampler(engine: "Engine", meta: Dict[str, Any], where: str,
                   options: _LoadOptions) -> None:
    loader, position = engine.training_dataloader, meta.get("data_sampler")
    if options.module_only or loader is None or position is None:
        return
    if int(position["dataset_len"]) != len(loader.dataset):
        raise _Problem(ValueError, (
            f"{where}: the checkpoint's data position is in a dataset of "
            f"{position['dataset_len']} samples but the engine's has {len(loader.dataset)}; "
            "load with the same training_data to resume its order."))


def _check_optimizer(engine: "Engine", meta: Dict[str, Any], where: str) -> None:
    saved = meta.get("optimizer")
    if saved is None:
        return
    current = engine.optimizer
    if saved["class"] != type(current).__name__:
        raise _Problem(ValueError, (
            f"{where}: the checkpoint's optimizer is {saved['class']} but the engine's is "
            f"{type(current).__name__}; pass load_optimizer_states=False to load the weights "
            "only."))
    if len(saved["groups"]) != len(current.param_groups):
        raise _Problem(ValueError, (
            f"{where}: the checkpoint's optimizer has {len(saved['groups'])} param groups but "
            f"the engine's has {len(current.param_groups)}; build the optimizer with the same "
            "groups, or pass load_optimizer_states=False."))


def _read_optimizer(engine: "Engine", meta: Dict[str, Any], reader: _Reader,
                    loaded: _Loaded) -> None:
    """This rank's optimizer slice [lo, hi) of each master and per-element state."""
    for name, t in _trainables(engine).items():
        entry = meta["params"].get(name)
        if t.tensor is None or entry is None:
            continue
        if t.has_master:
            key = f"master/{name}" if entry.get("master") else f"param/{name}"
            loaded.masters[name] = reader.read(key, _entry_for(entry, key), t.lo, t.hi,
                                               ).to(torch.float32)
        state = entry.get("state")
        if state is not None:
            loaded.states[name] = _read_state(engine, reader, name, entry, t)


def _read_state(engine: "Engine", reader: _Reader, name: str, entry: Dict[str, Any],
                t: _Trainable) -> Dict[str, Any]:
    group = _group_of(engine, t.tensor)
    on_device = bool(group.get("capturable") or group.get("fused")) if group else False
    state: Dict[str, Any] = {}
    for key, dtype in entry["state"]["tensors"].items():
        value = reader.read(f"optim/{name}/{key}", dict(entry, dtype=dtype), t.lo, t.hi)
        if value.is_floating_point():  # as torch's Optimizer.load_state_dict does
            value = value.to(t.tensor.dtype)
        state[key] = value.reshape(t.tensor.shape).to(t.tensor.device)
    for key, value in entry["state"]["scalars"].items():
        value = _decode(value)
        if isinstance(value, torch.Tensor) and (key != "step" or on_device):
            value = value.to(t.tensor.device)  # "step" stays on the CPU unless capturable
        state[key] = value
    return state


def _group_of(engine: "Engine", tensor: torch.Tensor) -> Optional[Dict[str, Any]]:
    for group in engine.optimizer.param_groups:
        if any(x is tensor for x in group["params"]):
            return group
    return None


def _read_rank_files(meta: Dict[str, Any], reader: _Reader, loaded: _Loaded) -> None:
    """RNG states from this rank's own file (when the saving world had this rank), and the
    client state: this rank's own, else rank 0's."""
    rank = comm.get_rank()
    source = rank if rank < int(meta["world_size"]) else 0
    name = _rank_file(source, "json")
    rank_json = _read_json(reader.path(name), reader.info(name))
    loaded.rank_json = rank_json if source == rank else None
    keys = [f"client/{k}" for k in rank_json["client"]["tensors"]]
    if source == rank:
        keys += [k for k in ("rng/torch", "rng/device") if k in reader.tensor_names(rank)]
    f = reader.handle(source)
    for key in keys:
        if key not in reader.tensor_names(source):
            raise _corrupted(reader.path(_rank_file(source, "safetensors")), f"no tensor {key!r}")
        loaded.rank_tensors[key] = f.get_tensor(key)
    loaded.client = _decode(rank_json["client"]["json"])
    loaded.client.update({k[len("client/"):]: loaded.rank_tensors[k] for k in keys
                          if k.startswith("client/")})
    if rank_json["client"].get("objects"):
        name = _rank_file(source, "client.pt")
        reader.verify(name)
        with open(reader.path(name), "rb") as f:
            loaded.client.update(_unpickle_client(reader.path(name), f.read()))


# -- applying (no reads, no collectives: every rank has already agreed it can) ---------------

def _apply(engine: "Engine", meta: Dict[str, Any], loaded: _Loaded,
           options: _LoadOptions) -> None:
    params = dict(_named_params(engine))
    for name, full in loaded.params.items():
        _set_param(engine, params[name], full)
    with torch.no_grad():
        for name, shard in loaded.shards.items():
            params[name].ds_tensor[: shard.numel()].copy_(shard)
    buffers = dict(_named_buffers(engine))
    with torch.no_grad():
        for name, value in loaded.buffers.items():
            buffers[name].copy_(value.reshape(buffers[name].shape))
    _apply_masters(engine, loaded)
    if options.optimizer and engine.optimizer is not None:
        _apply_optimizer(engine, meta, loaded)
    if options.scheduler:
        _apply_scheduler(engine, meta)
    if not options.module_only:
        _apply_training_state(engine, meta, options)
        _apply_rng(engine, loaded)


@torch.no_grad()
def _apply_masters(engine: "Engine", loaded: _Loaded) -> None:
    """The optimizer's copies of the weights: the saved fp32 masters when optimizer states
    were loaded, else rebuilt from the module's (just loaded) weights, as DeepSpeed does."""
    for name, t in _trainables(engine).items():
        if not t.is_copy(engine):
            continue
        master = loaded.masters.get(name)
        if master is None:
            master = _param_range(engine, t.param, t.lo, t.hi).float()
        t.tensor.copy_(master.reshape(t.tensor.shape))


def _apply_optimizer(engine: "Engine", meta: Dict[str, Any], loaded: _Loaded) -> None:
    opt = engine.optimizer
    saved = meta.get("optimizer")
    if saved is not None:
        for group, hyper in zip(opt.param_groups, saved["groups"]):
            for key, value in _decode(hyper).items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)  # a tensor lr is updated in place, as it was built
                else:
                    group[key] = value
    for name, t in _trainables(engine).items():
        if t.tensor is None:
            continue
        if name in loaded.states:
            opt.state[t.tensor] = loaded.states[name]
        else:  # the saved optimizer had no state for it yet (it never had a gradient)
            opt.state.pop(t.tensor, None)


def _apply_scheduler(engine: "Engine", meta: Dict[str, Any]) -> None:
    saved, sched = meta.get("lr_scheduler"), engine.lr_scheduler
    if saved is None or sched is None:
        return
    if saved["class"] != type(sched).__name__:
        logger.warning("load_checkpoint: the checkpoint's scheduler is %s but the engine's is "
                       "%s; its state is not loaded.", saved["class"], type(sched).__name__)
        return
    sched.load_state_dict(_decode(saved["state"]))


def _apply_training_state(engine: "Engine", meta: Dict[str, Any],
                          options: _LoadOptions) -> None:
    """Counters, the loss scale (with the optimizer states) and the data position."""
    counters = meta["counters"]
    engine.global_steps = int(counters["global_steps"])
    engine.global_samples = int(counters["global_samples"])
    engine.skipped_steps = int(counters["skipped_steps"])
    gas = engine.gradient_accumulation_steps()
    # The next micro-step's place in the accumulation cycle; a new gas restarts the cycle.
    same_gas = int(counters.get("gradient_accumulation_steps", gas)) == gas
    engine.micro_steps = int(counters["micro_steps"]) if same_gas else engine.global_steps * gas
    if options.optimizer and meta["precision"]["loss_scaling"] == _precision_meta(
            engine)["loss_scaling"]:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    loader, position = engine.training_dataloader, meta.get("data_sampler")
    if loader is not None and position is not None:
        loader.load_state_dict(position)


def _apply_rng(engine: "Engine", loaded: _Loaded) -> None:
    """RNG states of the rank that saved them; a rank the saving world did not have keeps its
    own (there is nothing to resume for it)."""
    if loaded.rank_json is None:
        return
    rng = loaded.rank_json["rng"]
    random.setstate(_decode(rng["python"]))
    state = rng["numpy"]
    np.random.set_state((state["kind"], np.array(state["keys"], dtype=np.uint32), state["pos"],
                         state["has_gauss"], state["cached_gaussian"]))
    torch.set_rng_state(loaded.rank_tensors["rng/torch"])
    device = _device_rng(engine)
    if device is not None and "rng/device" in loaded.rank_tensors:
        device.set_rng_state(loaded.rank_tensors["rng/device"])


# =============================================================================================
# Consolidation
# =============================================================================================

def consolidate(checkpoint_dir: str, out_path: str, tag: Optional[str] = None,
                dtype: Optional[str] = None) -> str:
    """Writes the full model weights of a checkpoint to one safetensors file.

    Runs in one CPU process with no process group, whatever world size saved the
    checkpoint. The file loads with ``model.load_state_dict(safetensors.torch.load_file(out))``
    (tied weights are written under each of their names).

    Args:
        checkpoint_dir: the ``save_dir`` given to ``save_checkpoint`` (or one tag directory).
        out_path: the safetensors file to write (replaced atomically).
        tag: the checkpoint to read; default the one named by ``latest``.
        dtype: None keeps each parameter's saved dtype; "fp32" (from the fp32 masters when the
            model trained in 16 bits), "bf16" or "fp16" casts the floating-point parameters.
            Buffers keep their dtype.

    Returns:
        ``out_path``.

    Raises:
        FileNotFoundError: no such directory or tag, or ``latest`` is missing.
        ValueError: a file is truncated or corrupted, or ``dtype`` is unknown.

    Example:
        >>> consolidate("checkpoints", "model.safetensors", dtype="bf16")
        >>> model.load_state_dict(safetensors.torch.load_file("model.safetensors"))
    """
    weights = full_weights(checkpoint_dir, tag, dtype)
    out_path = os.fspath(out_path)
    with atomic_path(out_path) as tmp:
        _write_safetensors(tmp, weights, metadata={"format": "pt"})
    return out_path


def full_weights(checkpoint_dir: str, tag: Optional[str] = None, dtype: Optional[str] = None,
                 exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
    """The full model weights of a checkpoint, as a state dict of CPU tensors.

    What :func:`consolidate` writes, without writing it: one CPU process, no process group,
    any world size and stage. Arguments and errors as :func:`consolidate`'s;
    ``exclude_frozen_parameters`` leaves out the parameters that were not trained.

    Example:
        >>> model.load_state_dict(full_weights("checkpoints", dtype="fp32"))
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of None, "
                         f"{', '.join(repr(k) for k in _DTYPES)}.")
    tag_dir = _consolidate_source(os.fspath(checkpoint_dir), tag)
    meta = _problems_raised(_read_meta, tag_dir)
    weights = _problems_raised(_full_weights, tag_dir, meta, dtype)
    if exclude_frozen_parameters:
        frozen = {n for n, e in meta["params"].items() if not e.get("trainable")}
        weights = {k: v for k, v in weights.items()
                   if k not in frozen and meta.get("aliases", {}).get(k) not in frozen}
    return weights


def _problems_raised(fn, *args):
    try:
        return fn(*args)
    except _Problem as problem:
        raise _ERRORS[problem.kind](problem.message) from None


def _consolidate_source(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, _META)):
        return checkpoint_dir  # a tag directory itself
    tag_dir = _problems_raised(_resolve, checkpoint_dir, tag)
    if tag_dir is None:
        raise FileNotFoundError(f"{os.path.join(checkpoint_dir, _LATEST)} is missing: pass tag= "
                                "to choose the checkpoint to consolidate.")
    return tag_dir


def _full_weights(tag_dir: str, meta: Dict[str, Any],
                  dtype: Optional[str]) -> Dict[str, torch.Tensor]:
    want = _DTYPES.get(dtype) if dtype else None
    out: Dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(tag_dir, meta, stack)
        for name in sorted(meta["files"]):
            if name.endswith(".safetensors"):
                reader.verify(name)  # every file is read in full anyway
        try:
            for name, entry in meta["params"].items():
                key = _module_key(entry, name, want) if want is not None else f"param/{name}"
                full = reader.read(key, _entry_for(entry, key), 0, int(entry["numel"]))
                if want is not None and full.is_floating_point():
                    full = full.to(want)
                out[name] = full.reshape(entry["shape"])
            for name, entry in meta["buffers"].items():
                out[name] = reader.read(f"buffer/{name}", entry, 0,
                                        int(entry["numel"])).reshape(entry["shape"])
        except (KeyError, TypeError, IndexError) as error:
            raise _corrupted(reader.path(_META), f"unexpected layout: {error!r}") from None
    for alias, target in meta.get("aliases", {}).items():
        if target in out:
            out[alias] = out[target].clone()  # safetensors stores no shared tensors
    return out

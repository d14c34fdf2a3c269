"""Loading: every rank reads and checks what it needs now, every rank agrees, then applies.

Each rank reads meta.json, then only its share: the full value of every module parameter and
buffer (stages 0-2 keep them whole on every rank; at stage 3 only its own shard of each
partitioned parameter), its optimizer slice ``[lo, hi)`` of each fp32 master and per-element
optimizer state, and its own RNG states and client_state (or rank 0's client_state when the
saving world had no rank of its number). Each file is checked in full by one rank (file k by
rank ``k mod world``), so every file is checked once, in parallel, on any world size.

A checkpoint of another model, optimizer or dataset is refused with what differs, and on every
rank, before the engine is touched (:mod:`._applying`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import comm
from ..state import TrainingParts
from ..log import logger
from . import _background as background
from . import _engine_state as engine_state
from . import _mesh_values as mesh
from ._agreement import Problem, agree, capture, corrupted
from ._applying import Loaded, LoadOptions, apply
from ._client_state import unpickle_objects
from ._engine_state import Trainable
from ._format import LATEST, META, decode, rank_file
from ._reading import Reader, entry_for, module_key, read_json, read_meta, resolve


__all__ = ["load_checkpoint"]


def load_checkpoint(engine: Any, load_dir: str, tag: Optional[str] = None,
                    load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False
                    ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Loads a checkpoint saved on any world size and stage; call it on all ranks.

    ``engine`` is read and restored through ``engine.training_parts()`` only. See
    :meth:`shardtrain.Engine.load_checkpoint` for the arguments.
    """
    background.wait_for_checkpoint()  # a save still being written finishes first
    parts: TrainingParts = engine.training_parts()
    engine_state.check_stage(parts, "load_checkpoint")
    load_dir = os.fspath(load_dir)
    options = LoadOptions(load_module_strict, load_optimizer_states and not load_module_only,
                          load_lr_scheduler_states and not load_module_only, load_module_only)
    found, tag_dir, meta = _locate(load_dir, tag)
    if all(path is None for path in found):
        logger.warning("load_checkpoint: %s has no 'latest' file; nothing loaded. Pass tag= "
                       "to choose a checkpoint.", os.path.join(load_dir, LATEST))
        return None, None
    everywhere = engine_state.model_names(parts)  # pipeline stages: every stage's names
    loaded = _read_and_check(parts, load_dir, found, tag_dir, meta, options, everywhere)
    apply(parts, meta, loaded, options)
    return tag_dir, loaded.client


def _locate(load_dir: str, tag: Optional[str]
            ) -> Tuple[List[Optional[str]], Optional[str], Optional[Dict[str, Any]]]:
    """Every rank's tag directory (None without ``latest``), and this rank's meta.json."""
    box: List[Optional[Problem]] = [None]
    tag_dir = meta = None
    with capture(box):
        tag_dir = resolve(load_dir, tag)
        meta = read_meta(tag_dir) if tag_dir is not None else None
    return agree(box[0], tag_dir), tag_dir, meta


def _read_and_check(parts: TrainingParts, load_dir: str, found: List[Optional[str]],
                    tag_dir: Optional[str], meta: Optional[Dict[str, Any]],
                    options: LoadOptions, everywhere: Optional[set] = None) -> Loaded:
    """Everything this rank will apply; raises on every rank if any rank cannot load."""
    box: List[Optional[Problem]] = [None]
    loaded = Loaded()
    with contextlib.ExitStack() as stack:
        with capture(box):  # first every file, and meta.json against them, on some rank
            if len(set(found)) > 1:  # e.g. node-local directories that differ
                raise Problem(ValueError, f"ranks found different checkpoints in {load_dir!r} "
                                          f"({sorted(set(map(str, found)))}): every rank must "
                                          "see the same checkpoint directory.")
            reader = Reader(tag_dir, meta, stack)
            _verify_share(reader, meta)
        agree(box[0])
        with capture(box):
            loaded = _read_everything(parts, meta, reader, options, everywhere)
        agree(box[0])
    return loaded


def _verify_share(reader: Reader, meta: Dict[str, Any]) -> None:
    """This rank's share of the whole-file checks: file k is checked by rank k mod world,
    so every file is checked once, in parallel, whatever the two world sizes are."""
    rank, world = comm.get_rank(), comm.get_world_size()
    for k, name in enumerate(sorted(meta["files"])):
        if k % world == rank:
            reader.verify(name)


def _read_everything(parts: TrainingParts, meta: Dict[str, Any], reader: Reader,
                     options: LoadOptions, everywhere: Optional[set] = None) -> Loaded:
    try:
        _check_model(parts, meta, reader.path(META), options.strict, everywhere)
        loaded = Loaded()
        _read_module(parts, meta, reader, loaded)
        _check_sampler(parts, meta, reader.path(META), options)
        if options.optimizer and engine_state.optimizer(parts) is not None:
            _check_optimizer(parts, meta, reader.path(META))
            _read_optimizer(parts, meta, reader, loaded)
        _read_rank_files(meta, reader, loaded)
        return loaded
    except (KeyError, TypeError, IndexError) as error:  # a meta.json of the wrong layout
        raise corrupted(reader.path(META), f"unexpected layout: {error!r}") from None


# -- the model ----------------------------------------------------------------------------------

def _check_model(parts: TrainingParts, meta: Dict[str, Any], where: str, strict: bool,
                 everywhere: Optional[set] = None) -> None:
    """Names and shapes: a checkpoint of another model is refused before anything is read.
    With pipeline stages (``everywhere``: every stage's names), a name another stage holds
    is not unexpected here."""
    ckpt_dir = os.path.dirname(where)
    # a split expert answers for the experts every rank of its group holds under its name
    params = {saved: p for name, p in engine_state.named_params(parts)
              for saved in engine_state.saved_names(name, p)}
    for kind, saved, current in (
            ("parameter", meta["params"], params),
            ("buffer", meta["buffers"], dict(engine_state.named_buffers(parts)))):
        for name, entry in saved.items():
            if name in current and list(entry["shape"]) != engine_state.shape(current[name]):
                raise Problem(ValueError, (
                    f"checkpoint {ckpt_dir} has {kind} {name!r} of shape {entry['shape']} but "
                    f"the model's is {engine_state.shape(current[name])}: this checkpoint is "
                    "for another model."))
        excluded = set(meta.get("excluded_frozen", [])) if kind == "parameter" else set()
        missing = sorted(set(current) - set(saved) - excluded)
        unexpected = sorted(set(saved) - (everywhere if everywhere is not None else set(current)))
        if strict and (missing or unexpected):
            raise Problem(ValueError, (
                f"checkpoint {ckpt_dir} does not match the model's {kind}s: missing from the "
                f"checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, not in the model "
                f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}. It is for another "
                "model; pass load_module_strict=False to load the names both have."))


def _read_module(parts: TrainingParts, meta: Dict[str, Any], reader: Reader,
                 loaded: Loaded) -> None:
    for name, p in engine_state.named_params(parts):
        saved = engine_state.saved_name(name, p)
        entry = meta["params"].get(saved)
        if entry is None:
            continue
        key = module_key(entry, saved, p.dtype)
        own = engine_state.own_shard(p)
        if own is not None:  # only this rank's shard: a rank never holds the whole model
            lo, hi = own
            loaded.shards[name] = mesh.read_local(reader, key, entry_for(entry, key), p, lo,
                                                  hi).to(p.dtype)
            continue
        full = mesh.read_local(reader, key, entry_for(entry, key), p, 0,
                               engine_state.local_numel(p))
        loaded.params[name] = full.to(p.dtype)
    for name, b in engine_state.named_buffers(parts):
        if name in meta["buffers"]:
            entry = meta["buffers"][name]
            loaded.buffers[name] = reader.read(f"buffer/{name}", entry, 0, b.numel()).to(b.dtype)


def _check_sampler(parts: TrainingParts, meta: Dict[str, Any], where: str,
                   options: LoadOptions) -> None:
    loader, position = engine_state.data_loader(parts), meta.get("data_sampler")
    if options.module_only or loader is None or position is None:
        return
    if int(position["dataset_len"]) != len(loader.dataset):
        raise Problem(ValueError, (
            f"{where}: the checkpoint's data position is in a dataset of "
            f"{position['dataset_len']} samples but the engine's has {len(loader.dataset)}; "
            "load with the same training_data to resume its order."))


# -- the optimizer ------------------------------------------------------------------------------

def _check_optimizer(parts: TrainingParts, meta: Dict[str, Any], where: str) -> None:
    saved = meta.get("optimizer")
    if saved is None:
        return
    current = engine_state.optimizer(parts)
    if saved["class"] != type(current).__name__:
        raise Problem(ValueError, (
            f"{where}: the checkpoint's optimizer is {saved['class']} but the engine's is "
            f"{type(current).__name__}; pass load_optimizer_states=False to load the weights "
            "only."))
    if len(saved["groups"]) != len(current.param_groups):
        raise Problem(ValueError, (
            f"{where}: the checkpoint's optimizer has {len(saved['groups'])} param groups but "
            f"the engine's has {len(current.param_groups)}; build the optimizer with the same "
            "groups, or pass load_optimizer_states=False."))


def _read_optimizer(parts: TrainingParts, meta: Dict[str, Any], reader: Reader,
                    loaded: Loaded) -> None:
    """This rank's optimizer slice [lo, hi) of each master and per-element state."""
    for name, t in engine_state.trainables(parts).items():
        saved = engine_state.saved_name(name, t.param)
        entry = meta["params"].get(saved)
        if t.tensor is None or entry is None:
            continue
        if t.has_master:
            key = f"master/{saved}" if entry.get("master") else f"param/{saved}"
            loaded.masters[name] = mesh.read_local(reader, key, entry_for(entry, key), t.param,
                                                   t.lo, t.hi).to(torch.float32)
        state = entry.get("state")
        if state is not None:
            loaded.states[name] = _read_state(parts, reader, saved, entry, t)


def _read_state(parts: TrainingParts, reader: Reader, name: str, entry: Dict[str, Any],
                t: Trainable) -> Dict[str, Any]:
    group = _group_of(parts, t.tensor)
    on_device = bool(group.get("capturable") or group.get("fused")) if group else False
    state: Dict[str, Any] = {}
    for key, dtype in entry["state"]["tensors"].items():
        value = mesh.read_local(reader, f"optim/{name}/{key}", dict(entry, dtype=dtype),
                                t.param, t.lo, t.hi)
        if value.is_floating_point():  # as torch's Optimizer.load_state_dict does
            value = value.to(t.tensor.dtype)
        state[key] = value.reshape(t.tensor.shape).to(t.tensor.device)
    for key, value in entry["state"]["scalars"].items():
        value = decode(value)
        if isinstance(value, torch.Tensor) and (key != "step" or on_device):
            value = value.to(t.tensor.device)  # "step" stays on the CPU unless capturable
        state[key] = value
    return state


def _group_of(parts: TrainingParts, tensor: torch.Tensor) -> Optional[Dict[str, Any]]:
    for group in engine_state.optimizer(parts).param_groups:
        if any(x is tensor for x in group["params"]):
            return group
    return None


# -- this rank's own file -----------------------------------------------------------------------

def _read_rank_files(meta: Dict[str, Any], reader: Reader, loaded: Loaded) -> None:
    """RNG states from this rank's own file (when the saving world had this rank), and the
    client state: this rank's own, else rank 0's."""
    rank = comm.get_rank()
    source = rank if rank < int(meta["world_size"]) else 0
    name = rank_file(source, "json")
    rank_json = read_json(reader.path(name), reader.info(name))
    loaded.rank_json = rank_json if source == rank else None
    keys = [f"client/{k}" for k in rank_json["client"]["tensors"]]
    if source == rank:
        keys += [k for k in ("rng/torch", "rng/device") if k in reader.tensor_names(rank)]
    _read_rank_tensors(reader, source, keys, loaded)
    _read_client(reader, source, rank_json, keys, loaded)


def _read_rank_tensors(reader: Reader, source: int, keys: List[str], loaded: Loaded) -> None:
    f = reader.handle(source)
    for key in keys:
        if key not in reader.tensor_names(source):
            raise corrupted(reader.path(rank_file(source, "safetensors")), f"no tensor {key!r}")
        loaded.rank_tensors[key] = f.get_tensor(key)


def _read_client(reader: Reader, source: int, rank_json: Dict[str, Any], keys: List[str],
                 loaded: Loaded) -> None:
    """The client_state: its JSON part, its tensors, and the objects pickled beside them."""
    loaded.client = decode(rank_json["client"]["json"])
    loaded.client.update({k[len("client/"):]: loaded.rank_tensors[k] for k in keys
                          if k.startswith("client/")})
    if rank_json["client"].get("objects"):
        name = rank_file(source, "client.pt")
        reader.verify(name)
        with open(reader.path(name), "rb") as f:
            loaded.client.update(unpickle_objects(reader.path(name), f.read()))

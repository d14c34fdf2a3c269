"""meta.json: the description of a checkpoint that every reader starts from.

Rank 0 writes it, last, from what it sees of the parts: everything but the tensors (format,
world size, stage, precision, config, the model's own configuration when it has one (a
Hugging Face ``config``: the export writes it as config.json), counters, the optimizer's
hyperparameters and scalar states, the scheduler, the loss scaler, the data position), and
for every tensor its shape, dtype and the pieces of its flattened elements each rank file
holds. Rank 0 holds a non-empty slice of every parameter, so it sees every parameter's scalar
optimizer states (Adam's ``step``). The sizes and CRC32s of the other files are added once
every rank has written them.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import comm
from ..state import TrainingParts
from ..layout import layout_of, shard_range
from . import _engine_state as engine_state
from ._engine_state import Trainable
from ._format import FORMAT, FORMAT_VERSION, Piece, dtype_name, encode


__all__ = ["UnnamedScheduler", "describe", "elementwise"]


class UnnamedScheduler:
    """A scheduler's state whose class is not known: DeepSpeed saves a scheduler passed to
    ``initialize`` as its bare state dict. meta.json records its class as null, and a load
    gives the state to the engine's scheduler whatever its class, when the keys agree."""

    def __init__(self, state: Dict[str, Any]):
        self._state = state

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._state)


def elementwise(value: Any, tensor: torch.Tensor) -> bool:
    """An optimizer state stored per element of the slice (Adam's moments, momentum)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == tensor.shape


def describe(parts: TrainingParts, trainables: Dict[str, Trainable],
             exclude_frozen: bool) -> Dict[str, Any]:
    """meta.json without the tag and the files' sizes and CRC32s (rank 0 adds them last).

    Every parameter is cut into even pieces over the ranks that hold it (the world; with
    pipeline stages, its stage's ranks, whose first writes the whole tensors): with stages,
    every rank calls this (a collective) and rank 0 joins the stages' parameters, buffers
    and aliases in stage order."""
    world = comm.get_world_size()
    writers = engine_state.writers(parts)
    params, excluded = _params_meta(parts, trainables, exclude_frozen, writers)
    first = writers.ranks()[0]
    buffers = {n: _tensor_meta(b, [(first, 0, b.numel())] if b.numel() else [])
               for n, b in engine_state.named_buffers(parts)}
    aliases = engine_state.aliases(parts)
    stages = None
    if engine_state.pipelined(parts):
        here = parts.mesh.coordinate()["pp"]
        for entry in list(params.values()) + list(buffers.values()):
            entry["stage"] = here  # its pieces are even over that stage's ranks
        mine = (here, writers.ranks(), params, buffers, aliases, excluded) \
            if writers.rank() == 0 else None
        params, buffers, aliases, excluded, stages = {}, {}, {}, [], []
        for stage in sorted((s for s in comm.all_gather_object(mine) if s is not None),
                            key=lambda s: s[0]):
            stages.append(stage[1])
            params.update(stage[2])
            buffers.update(stage[3])
            aliases.update(stage[4])
            excluded += stage[5]
    meta = _meta(parts, world, params, buffers, aliases, excluded)
    if stages is not None:
        meta["stages"] = stages  # the global ranks of each pipeline stage
    return meta


def _meta(parts: TrainingParts, world: int, params: Dict[str, Any], buffers: Dict[str, Any],
          aliases: Dict[str, str], excluded: List[str]) -> Dict[str, Any]:
    return {"format": FORMAT, "version": FORMAT_VERSION, "world_size": world,
            "zero_stage": engine_state.zero_stage(parts),
            "precision": engine_state.precision(parts), "config": engine_state.config_dict(parts),
            "model_config": engine_state.model_config(parts),
            "counters": engine_state.counters(parts), "params": params, "buffers": buffers,
            "aliases": aliases, "excluded_frozen": excluded,
            "optimizer": _optimizer_meta(parts), "lr_scheduler": _scheduler_meta(parts),
            "loss_scaler": engine_state.loss_scaler(parts).state_dict(),
            "data_sampler": _sampler_meta(parts)}


def _params_meta(parts: TrainingParts, trainables: Dict[str, Trainable], exclude_frozen: bool,
                 writers: comm.Group) -> Tuple[Dict[str, Any], List[str]]:
    """Every parameter's entry, and the names of the frozen ones left out."""
    params, excluded = {}, []
    for saved, name, p in _in_saved_order(engine_state.named_params(parts)):
        if name in trainables:
            params[saved] = _trainable_meta(parts, trainables[name], writers)
        elif exclude_frozen:
            excluded.append(saved)
        else:
            n = engine_state.numel(p)
            params[saved] = _tensor_meta(p, [(writers.ranks()[0], 0, n)] if n else [])
    return params, excluded


def _in_saved_order(named: List[Tuple[str, torch.nn.Parameter]]
                    ) -> List[Tuple[str, str, torch.nn.Parameter]]:
    """``(saved name, name, parameter)`` in the unsplit model's order: a split expert's
    parameter stands for one expert on each rank of its expert-parallel group, and a
    layer's experts come in their global order (rank 0's first), each one's parameters in
    the module's order."""
    out: List[Tuple[str, str, torch.nn.Parameter]] = []
    run: List[Tuple[str, torch.nn.Parameter]] = []  # one layer's expert parameters

    def flush():
        seen: Dict[int, int] = {}
        keyed = []
        for name, p in run:
            split = layout_of(p).expert
            position = seen[split.index] = seen.get(split.index, -1) + 1
            for r in range(split.ep_size):
                keyed.append(((r * split.num_local + split.index, position),
                              (split.global_name(name, r), name, p)))
        out.extend(item for _, item in sorted(keyed, key=lambda k: k[0]))
        run.clear()

    layer = None
    for name, p in named:
        split = layout_of(p).expert
        if split is not None and split.stacked:  # every expert under the unsplit name
            split = None
        here = None if split is None else name.rpartition(f"{split.marker}.")[0]
        if here != layer:
            flush()
            layer = here
        if split is None:
            out.append((name, name, p))
        else:
            run.append((name, p))
    flush()
    return out


def _tensor_meta(t: torch.Tensor, pieces: List[Piece]) -> Dict[str, Any]:
    return {"shape": engine_state.shape(t), "dtype": dtype_name(t.dtype),
            "numel": engine_state.numel(t), "trainable": False, "master": False,
            "pieces": [list(p) for p in pieces]}


def _trainable_meta(parts: TrainingParts, t: Trainable, writers: comm.Group) -> Dict[str, Any]:
    n = engine_state.numel(t.param)
    ranks = writers.ranks()
    pieces = [(rank, *shard_range(n, len(ranks), i)) for i, rank in enumerate(ranks)]
    entry = _tensor_meta(t.param, [p for p in pieces if p[2] > p[1]])
    entry.update(trainable=True, master=t.param.dtype != torch.float32)
    opt = engine_state.optimizer(parts)
    if opt is None or t.tensor is None:
        return entry
    groups = [i for i, g in enumerate(opt.param_groups) if any(x is t.tensor for x in g["params"])]
    entry["group"] = groups[0] if groups else None
    saved = opt.state.get(t.tensor)
    if saved:
        entry["state"] = {
            "tensors": {k: dtype_name(v.dtype) for k, v in saved.items()
                        if elementwise(v, t.tensor)},
            "scalars": {k: encode(v, f"optimizer state {k!r} of {t.name!r}")
                        for k, v in saved.items() if not elementwise(v, t.tensor)}}
    return entry


def _optimizer_meta(parts: TrainingParts) -> Optional[Dict[str, Any]]:
    opt = engine_state.optimizer(parts)
    if opt is None:
        return None
    groups = [encode({k: v for k, v in g.items() if k != "params"}, f"param group {i}")
              for i, g in enumerate(opt.param_groups)]
    return {"class": type(opt).__name__, "groups": groups}


def _scheduler_meta(parts: TrainingParts) -> Optional[Dict[str, Any]]:
    sched = engine_state.lr_scheduler(parts)
    if sched is None or not hasattr(sched, "state_dict"):
        return None
    name = None if isinstance(sched, UnnamedScheduler) else type(sched).__name__
    return {"class": name,
            "state": encode(sched.state_dict(), f"{type(sched).__name__}.state_dict()")}


def _sampler_meta(parts: TrainingParts) -> Optional[Dict[str, Any]]:
    loader = engine_state.data_loader(parts)
    return loader.state_dict() if loader is not None else None

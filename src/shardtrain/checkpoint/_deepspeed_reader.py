"""DeepSpeed's checkpoint layouts, read into one description of the training state.

Whatever the layout, the result is a :class:`DeepSpeedState`: for every trained parameter its
whole fp32 master, its whole per-element optimizer states (Adam's ``exp_avg``,
``exp_avg_sq``), its scalar states (``step``) and the 16-bit copy DeepSpeed saved of it; the
frozen parameters and buffers; the optimizer's param-group hyperparameters; the counters, the
scheduler's state dict, the loss scaler; the config; and the keys the user added to the saved
state (``client_state``). Facts of each layout (key names and where the elements lie):

* **stage 0**: ``mp_rank_00_model_states.pt`` holds the module and the optimizer's state dict
  (for 16-bit training, DeepSpeed's wrapper: the fp32 masters in ``fp32_groups`` beside the
  torch state dict). The optimizer numbers its parameters without names; they are matched to
  the module's parameters in order, by shape (and, where masters exist, by value), and a match
  that is not unique is refused unless the frozen parameters are named.
* **stages 1-2**: the module in ``mp_rank_00_model_states.pt`` (with ``param_shapes``: the
  names, shapes and order of each flat group); every rank's ``[bf16_]zero_pp_rank_<r>_...
  optim_states.pt`` holds its piece of each group's flat fp32 masters
  (``single_partition_of_fp32_groups``) and of the base optimizer's flat states.
* **stage 3**: every rank's ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (its
  ``frozen_param_fragments``) and optim file (``fp32_flat_groups`` and the base optimizer's
  state per sub-group); the module's own tensors are empty there.
* **universal** (``ds_to_universal``): one folder per parameter under ``zero/`` holding its
  whole ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` and ``step.pt``; hyperparameters and
  the loss scaler in ``zero/optimizer_state.pt``.

Where the elements of a parameter lie in the flat partitions is :mod:`._deepspeed_layout`'s
business. Tensors stay views of the memory-mapped files wherever the layout keeps a parameter
contiguous; only parameters split across ranks are copied into one piece.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._deepspeed_files import DeepSpeedFiles, LossScalerState, load_pickle, locate
from ._deepspeed_layout import FlatView, group_offsets, stage3_offsets, stage3_param

__all__ = ["TrainedParam", "DeepSpeedState", "read_deepspeed", "align", "DS_KEYS"]

#: The keys DeepSpeed writes into a model states file; any other key is the user's.
DS_KEYS = frozenset((
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info"))

Load = Callable[[str], Any]


@dataclass
class TrainedParam:
    """One parameter the optimizer trained: whole and flattened (views where possible)."""

    shape: List[int]
    master: torch.Tensor                  # fp32
    weight: Optional[torch.Tensor]        # the module's copy DeepSpeed saved; None at stage 3
    states: Dict[str, torch.Tensor] = field(default_factory=dict)  # per element
    scalars: Dict[str, Any] = field(default_factory=dict)          # e.g. step
    group: int = 0


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint's training state, layout aside."""

    tag_dir: str
    tag: str
    layout: str                            # e.g. "ZeRO stage 2", "universal"
    stage: int
    world_size: int
    dtype: torch.dtype                     # the module's dtype in training
    config: Dict[str, Any]
    params: Dict[str, TrainedParam]
    frozen: Dict[str, torch.Tensor]
    buffers: Dict[str, torch.Tensor]
    aliases: Dict[str, str]                # tied weights: name -> the name that holds it
    groups: List[Dict[str, Any]]           # the optimizer's hyperparameters, per group
    lr_scheduler: Optional[Dict[str, Any]]
    loss_scaler: Dict[str, Any]
    counters: Dict[str, int]
    client_state: Dict[str, Any]
    data_sampler: Any = None


def read_deepspeed(ckpt_dir: str, tag: Optional[str] = None, trust_pickle: bool = False,
                   frozen: Optional[Sequence[str]] = None) -> DeepSpeedState:
    """Reads a DeepSpeed checkpoint (stages 0-3 or universal) into a :class:`DeepSpeedState`."""
    files = locate(ckpt_dir, tag)

    def load(path: str) -> Any:
        return load_pickle(path, trust_pickle)

    model = _model_states(files.model_states[0], load)
    if not files.universal and not files.optim_states:
        return _stage0(files, model, frozen)
    if frozen:
        raise ValueError(f"{files.tag_dir}: frozen= (--frozen) is for stage-0 checkpoints, whose "
                         "optimizer does not name its parameters; this one names them: drop it.")
    if files.universal:
        return _universal(files, model, load)
    _check_world(files, model)
    optims = [_optim_states(path, load) for path in files.optim_states]
    if "fp32_flat_groups" in optims[0]:
        return _stage3(files, model, optims, load)
    return _stage12(files, model, optims)


# -- the files every layout has -----------------------------------------------------------------

def _model_states(path: str, load: Load) -> Dict[str, Any]:
    model = load(path)
    if not isinstance(model, dict) or not isinstance(model.get("module"), dict):
        raise ValueError(f"{path} is not a DeepSpeed model states file (no 'module' state "
                         "dict); pass the directory of a DeepSpeed checkpoint.")
    if int(model.get("mp_world_size") or 1) != 1:
        raise NotImplementedError(f"{path}: tensor-parallel DeepSpeed checkpoints "
                                  f"(mp_world_size {model['mp_world_size']}) are not supported.")
    return model


def _optim_states(path: str, load: Load) -> Dict[str, Any]:
    saved = load(path)
    osd = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
    if not isinstance(osd, dict) or not ({"fp32_flat_groups", "single_partition_of_fp32_groups"}
                                         & set(osd)):
        raise NotImplementedError(f"{path} is not a ZeRO optimizer states file this converter "
                                  "knows (no fp32_flat_groups or single_partition_of_fp32_groups)"
                                  "; convert a ZeRO stage 0-3 checkpoint of DeepSpeed 0.19.")
    return osd


def _check_world(files: DeepSpeedFiles, model: Dict[str, Any]) -> None:
    world = int(model.get("dp_world_size") or len(files.optim_states))
    if len(files.optim_states) != world:
        raise FileNotFoundError(
            f"{files.tag_dir} holds optimizer states of {len(files.optim_states)} rank(s) but "
            f"the checkpoint was saved by {world}: the checkpoint is incomplete; copy every "
            "rank's zero_pp_rank_*_optim_states.pt.")


def _base(files: DeepSpeedFiles, model: Dict[str, Any], layout: str, stage: int,
          world: int) -> DeepSpeedState:
    """Everything but the trained parameters, the frozen ones and the optimizer's groups."""
    config = dict(model.get("ds_config") or {})
    module = model["module"]
    buffers = {n: module[n] for n in model.get("buffer_names") or [] if n in module}
    steps = int(model.get("global_steps") or 0)
    batch = int(config.get("train_batch_size") or 0)
    counters = {"global_steps": steps, "skipped_steps": int(model.get("skipped_steps") or 0),
                "global_samples": int(model.get("global_samples") or steps * batch)}
    client = {k: v for k, v in model.items() if k not in DS_KEYS}
    return DeepSpeedState(files.tag_dir, files.tag, layout, stage, world, _dtype(config),
                          config, {}, {}, buffers, dict(model.get("shared_params") or {}), [],
                          model.get("lr_scheduler"), {}, counters, client,
                          model.get("data_sampler"))


def _dtype(config: Dict[str, Any]) -> torch.dtype:
    bf16 = config.get("bf16", config.get("bfloat16")) or {}
    if isinstance(bf16, dict) and bf16.get("enabled"):
        return torch.bfloat16
    fp16 = config.get("fp16") or {}
    return torch.float16 if isinstance(fp16, dict) and fp16.get("enabled") else torch.float32


def _whole_frozen(state: DeepSpeedState, module: Dict[str, torch.Tensor]) -> None:
    """Stages 0-2: every module tensor that is not trained, a buffer or an alias is frozen."""
    for name, value in module.items():
        if name not in state.params and name not in state.buffers \
                and name not in state.aliases and value.numel() > 0:
            state.frozen[name] = value


def _scaler(saved: Any, dynamic: Any, steps: int) -> Dict[str, Any]:
    """DeepSpeed's loss scaler (a stand-in object or the stage-0 wrapper's keys), as values."""
    attrs = dict(vars(saved)) if isinstance(saved, LossScalerState) else dict(saved or {})
    last = attrs.get("last_overflow_iter")
    return {"scale": float(attrs.get("cur_scale", 1.0)),
            "dynamic": bool(attrs.get("dynamic", dynamic)),
            "cur_iter": int(attrs.get("cur_iter", steps)),
            "last_overflow_iter": -1 if last is None else int(last),
            "window": int(attrs.get("scale_window") or 1000),
            "hysteresis": int(attrs.get("delayed_shift") or 2),
            "cur_hysteresis": int(attrs.get("cur_hysteresis") or attrs.get("delayed_shift") or 2),
            "consecutive_hysteresis": bool(attrs.get("consecutive_hysteresis", False)),
            "min_scale": float(attrs.get("min_scale") or attrs.get("min_loss_scale") or 1.0)}


def _hyper(groups: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _shapes(model: Dict[str, Any], path: str) -> List[List[Tuple[str, List[int]]]]:
    """``param_shapes``: per flat group, the names and shapes of its parameters, in order."""
    groups = model.get("param_shapes")
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{path} has no param_shapes: it is not a ZeRO checkpoint of "
                         "DeepSpeed 0.19 (or it was damaged).")
    return [[(n, [int(d) for d in s]) for n, s in g.items()] for g in groups]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- stages 1 and 2 -----------------------------------------------------------------------------

def _stage12(files: DeepSpeedFiles, model: Dict[str, Any],
             optims: List[Dict[str, Any]]) -> DeepSpeedState:
    stage = int(optims[0].get("zero_stage", 1))
    state = _base(files, model, f"ZeRO stage {stage}", stage, len(optims))
    shapes = _shapes(model, files.model_states[0])
    for g, params in enumerate(shapes):
        _read_group12(state, files, optims, g, params, model["module"])
    _whole_frozen(state, model["module"])
    base = optims[0]["base_optimizer_state"]
    state.groups = _hyper(base["param_groups"]) if isinstance(base, dict) else [{}] * len(shapes)
    state.loss_scaler = _scaler(optims[0].get("loss_scaler"), optims[0].get(
        "dynamic_loss_scale"), state.counters["global_steps"])
    return state


def _read_group12(state: DeepSpeedState, files: DeepSpeedFiles, optims: List[Dict[str, Any]],
                  g: int, params: List[Tuple[str, List[int]]],
                  module: Dict[str, torch.Tensor]) -> None:
    """One flat group: every rank's unpadded piece, end to end, cut into its parameters."""
    numels = [_numel(s) for _, s in params]
    paddings = (optims[0].get("param_alignment_paddings") or [[0] * len(params)] * (g + 1))[g]
    offsets, end = group_offsets(numels, paddings)
    lengths = [o["single_partition_of_fp32_groups"][g].numel() for o in optims]
    masters = FlatView([o["single_partition_of_fp32_groups"][g] for o in optims])
    if masters.numel != end:
        raise ValueError(f"{files.tag_dir}: flat group {g} holds {masters.numel} fp32 elements "
                         f"but its param_shapes add up to {end}: the checkpoint is damaged.")
    per_rank = [_group_state(o, g) for o in optims]
    states = {k: FlatView([s[k].reshape(-1)[:n] for s, n in zip(per_rank, lengths)])
              for k, v in per_rank[0].items() if _per_element(v)}
    scalars = {k: v for k, v in per_rank[0].items() if not _per_element(v)}
    for (name, shape), off, n in zip(params, offsets, numels):
        weight = module.get(name)
        state.params[name] = TrainedParam(
            shape, masters.slice(off, off + n), weight if _whole(weight, n) else None,
            {k: v.slice(off, off + n) for k, v in states.items()}, dict(scalars), g)


def _group_state(osd: Dict[str, Any], g: int) -> Dict[str, Any]:
    """The base optimizer's state of flat group ``g`` (plain or elastic form)."""
    base = osd["base_optimizer_state"]
    if isinstance(base, dict):  # a torch state dict: state keyed by the group's index
        saved = dict(base["state"].get(g, {}))
        group = base["param_groups"][g]
    else:  # elastic: one lean state per group, the step beside it
        saved, group = dict(base[g]), {}
        if "base_optimizer_state_step" in osd:
            saved.setdefault("step", osd["base_optimizer_state_step"])
    if "step" not in saved and "step" in group:  # optimizers that count per group
        saved["step"] = group["step"]
    return saved


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _whole(weight: Optional[torch.Tensor], numel: int) -> bool:
    return isinstance(weight, torch.Tensor) and weight.numel() == numel and numel > 0


# -- stage 3 ------------------------------------------------------------------------------------

def _stage3(files: DeepSpeedFiles, model: Dict[str, Any], optims: List[Dict[str, Any]],
            load: Load) -> DeepSpeedState:
    world = len(optims)
    if int(optims[0].get("partition_count", world)) != world:
        raise NotImplementedError(f"{files.optim_states[0]}: ZeRO-3 partitioned over "
                                  f"{optims[0]['partition_count']} of {world} ranks (hpZ/MiCS) "
                                  "is not supported.")
    state = _base(files, model, "ZeRO stage 3", 3, world)
    _stage3_params(state, files, optims, _shapes(model, files.model_states[0]))
    state.frozen = _stage3_frozen(files, model, load)
    state.groups, merged = _merge_subgroups(_hyper(optims[0]["optimizer_state_dict"]
                                                   ["param_groups"]))
    for p in state.params.values():
        p.group = merged[p.group]
    state.loss_scaler = _scaler(optims[0].get("loss_scaler"), optims[0].get(
        "dynamic_loss_scale"), state.counters["global_steps"])
    return state


def _stage3_params(state: DeepSpeedState, files: DeepSpeedFiles, optims: List[Dict[str, Any]],
                   shapes: List[List[Tuple[str, List[int]]]]) -> None:
    """Every parameter's pieces of every rank's flat vectors, put together (copies)."""
    flat = [(g, n, s) for g, params in enumerate(shapes) for n, s in params]
    offsets, length = stage3_offsets([_numel(s) for _, _, s in flat], len(optims))
    masters = [FlatView(o["fp32_flat_groups"]) for o in optims]
    if any(m.numel != length for m in masters):
        raise ValueError(f"{files.tag_dir}: a rank's fp32_flat_groups hold "
                         f"{[m.numel for m in masters]} elements, param_shapes say {length} "
                         "per rank: the checkpoint is damaged.")
    states, scalars = _stage3_states(optims, len(shapes))
    for (g, name, shape), off in zip(flat, offsets):
        n = _numel(shape)
        state.params[name] = TrainedParam(
            shape, stage3_param(masters, off, n), None,
            {k: stage3_param(v, off, n) for k, v in states.items()}, dict(scalars[g]), g)


def _stage3_states(optims: List[Dict[str, Any]], groups: int
                   ) -> Tuple[Dict[str, List[FlatView]], List[Dict[str, Any]]]:
    """Per-element states as every rank's flat vector (sub-groups end to end), and the scalar
    states of each sub-group."""
    per_rank = [[_group_state({"base_optimizer_state": o["optimizer_state_dict"]}, g)
                 for g in range(groups)] for o in optims]
    keys = [k for k, v in per_rank[0][0].items() if _per_element(v)] if groups else []
    states = {k: [FlatView([s[k] for s in rank]) for rank in per_rank] for k in keys}
    scalars = [{k: v for k, v in s.items() if not _per_element(v)} for s in per_rank[0]]
    return states, scalars


def _stage3_frozen(files: DeepSpeedFiles, model: Dict[str, Any],
                   load: Load) -> Dict[str, torch.Tensor]:
    """Frozen parameters: every rank's fragment, end to end, cut to the parameter's size."""
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    ranks = [model] + [load(p) for p in files.model_states[1:]]
    out = {}
    for name, shape in shapes.items():
        views = [FlatView([r["frozen_param_fragments"][name]]) for r in ranks]
        out[name] = stage3_param(views, 0, _numel(shape)).reshape(list(shape))
    return out


def _merge_subgroups(groups: List[Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[int]]:
    """Stage 3 splits a param group into sub-groups of equal hyperparameters: consecutive
    sub-groups with the same hyperparameters are taken as one group again."""
    merged: List[Dict[str, Any]] = []
    index = []
    for g in groups:
        if not merged or merged[-1] != g:
            merged.append(g)
        index.append(len(merged) - 1)
    return merged, index


# -- stage 0 ------------------------------------------------------------------------------------

def _stage0(files: DeepSpeedFiles, model: Dict[str, Any],
            frozen: Optional[Sequence[str]]) -> DeepSpeedState:
    path = files.model_states[0]
    saved = model.get("optimizer")
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds no optimizer state and the tag has no ZeRO optimizer "
                         "files: the checkpoint was saved without its optimizer; nothing to "
                         "resume from but the weights.")
    if "fp32_groups_flat" in saved:
        raise NotImplementedError(f"{path}: the fused fp16 optimizer's flat stage-0 layout is "
                                  "not supported; convert a checkpoint of ZeRO stage 1-3.")
    wrapped = "optimizer_state_dict" in saved
    base = saved["optimizer_state_dict"] if wrapped else saved
    state = _base(files, model, "ZeRO stage 0", 0, int(model.get("dp_world_size") or 1))
    masters = [list(g) for g in saved["fp32_groups"]] if wrapped else None
    names = _stage0_names(path, state, model["module"], base, masters, frozen)
    _stage0_params(state, model["module"], base, masters, names)
    _whole_frozen(state, model["module"])
    state.groups = _hyper(base["param_groups"])
    state.loss_scaler = _scaler(saved if wrapped else {}, saved.get("dynamic_loss_scale", False),
                                state.counters["global_steps"])
    return state


def _stage0_params(state: DeepSpeedState, module: Dict[str, torch.Tensor], base: Dict[str, Any],
                   masters: Optional[List[List[torch.Tensor]]], names: Dict[int, str]) -> None:
    """Each optimizer index's tensors under its module name (the fp32 weight is its master
    when there is no 16-bit wrapper)."""
    for g, group in enumerate(base["param_groups"]):
        for k, index in enumerate(group["params"]):
            weight = module[names[index]]
            master = masters[g][k] if masters else weight
            entry = dict(base["state"].get(index, {}))
            state.params[names[index]] = TrainedParam(
                list(weight.shape), master.reshape(-1).float(), weight.reshape(-1),
                {key: v.reshape(-1) for key, v in entry.items() if _per_element(v)},
                {key: v for key, v in entry.items() if not _per_element(v)}, g)


def _stage0_names(path: str, state: DeepSpeedState, module: Dict[str, torch.Tensor],
                  base: Dict[str, Any], masters: Optional[List[List[torch.Tensor]]],
                  frozen: Optional[Sequence[str]]) -> Dict[int, str]:
    """The module name of each optimizer index, group by group (see :func:`align`)."""
    unknown = sorted(set(frozen or ()) - set(module))
    if unknown:
        raise ValueError(f"{path}: frozen= (--frozen) names {unknown}, which the checkpoint's "
                         f"module does not have; its parameters are {sorted(module)}.")
    left = [n for n in module if n not in state.buffers and n not in state.aliases
            and n not in set(frozen or ())]
    names: Dict[int, str] = {}
    for g, group in enumerate(base["param_groups"]):
        refs = list(masters[g]) if masters else [None] * len(group["params"])
        chosen = _align_group(path, module, base, group["params"], refs, left, state.dtype)
        names.update(zip(group["params"], chosen))
        left = [n for n in left if n not in chosen]
    return names


def _align_group(path: str, module: Dict[str, torch.Tensor], base: Dict[str, Any],
                 indices: List[int], refs: List[Optional[torch.Tensor]], left: List[str],
                 dtype: torch.dtype) -> List[str]:
    """The module names of one param group's optimizer indices."""
    wanted = [_index_shape(base, i, ref) for i, ref in zip(indices, refs)]

    def fits(k: int, name: str) -> bool:
        return _fits(module[name], wanted[k], refs[k], dtype)
    return align(len(indices), left, fits, path)


def _index_shape(base: Dict[str, Any], index: int,
                 master: Optional[torch.Tensor]) -> Optional[List[int]]:
    if master is not None:
        return list(master.shape)
    states = [v for v in base["state"].get(index, {}).values() if _per_element(v)]
    return list(states[0].shape) if states else None


def _fits(weight: torch.Tensor, shape: Optional[List[int]], master: Optional[torch.Tensor],
          dtype: torch.dtype) -> bool:
    if shape is not None and list(weight.shape) != shape:
        return False
    # A 16-bit weight is its fp32 master rounded: that tells same-shaped parameters apart.
    return master is None or torch.equal(master.to(dtype), weight.to(dtype))


def align(count: int, candidates: List[str], fits: Callable[[int, str], bool],
          where: str) -> List[str]:
    """The one order-preserving choice of ``count`` of ``candidates`` such that item ``i``
    fits the ``i``-th choice; refused when there is none or more than one."""
    first, ways = _leftmost(count, candidates, fits)
    if first is None:
        raise ValueError(f"{where}: the optimizer's {count} parameters do not match the "
                         f"module's parameters {candidates} in order and shape: the checkpoint "
                         "is damaged, or its optimizer was not built over the module's "
                         "parameters in module order.")
    if ways > 1:  # the rightmost choice is the leftmost one of the reversed problem
        last, _ = _leftmost(count, candidates[::-1], lambda i, n: fits(count - 1 - i, n))
        untrained = [[n for n in candidates if n not in chosen] for chosen in (first, last)]
        raise ValueError(f"{where}: the optimizer holds {count} of the module's "
                         f"{len(candidates)} parameters and a stage-0 checkpoint does not say "
                         f"which; by shape, the ones not trained could be {untrained[0]} or "
                         f"{untrained[1]}. Name them: --frozen {','.join(untrained[0])} "
                         "(import_deepspeed(..., frozen=[...])).")
    return first


def _leftmost(count: int, candidates: List[str], fits: Callable[[int, str], bool]
              ) -> Tuple[Optional[List[str]], int]:
    """The leftmost order-preserving fit and the number of fits (counted up to 2)."""
    m = len(candidates)
    ways = [[0] * (m + 1) for _ in range(count + 1)]  # ways[i][j]: items i.. into candidates j..
    ways[count] = [1] * (m + 1)
    for i in range(count - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            fit = ways[i + 1][j + 1] if fits(i, candidates[j]) else 0
            ways[i][j] = min(2, ways[i][j + 1] + fit)
    if ways[0][0] == 0:
        return None, 0
    chosen, j = [], 0
    for i in range(count):
        while not (ways[i + 1][j + 1] > 0 and fits(i, candidates[j])):
            j += 1
        chosen.append(candidates[j])
        j += 1
    return chosen, ways[0][0]


# -- the universal form -------------------------------------------------------------------------

def _universal(files: DeepSpeedFiles, model: Dict[str, Any], load: Load) -> DeepSpeedState:
    zero = os.path.join(files.tag_dir, "zero")
    optim = load(os.path.join(zero, "optimizer_state.pt"))
    stage = int(optim.get("zero_stage", 1))
    state = _base(files, model, f"universal (from ZeRO stage {stage})", stage,
                  int(model.get("dp_world_size") or 1))
    shapes = _shapes(model, files.model_states[0])
    for g, params in enumerate(shapes):
        for name, shape in params:
            state.params[name] = _universal_param(zero, name, shape, g, model["module"], load)
    _universal_frozen(state, zero, model["module"], load)
    groups = _hyper(optim.get("param_groups") or [{}] * len(shapes))
    state.groups, merged = _merge_subgroups(groups) if stage == 3 else (groups,
                                                                          list(range(len(groups))))
    for p in state.params.values():
        p.group = merged[p.group]
    state.loss_scaler = _scaler(optim.get("loss_scaler"), optim.get("dynamic_loss_scale"),
                                state.counters["global_steps"])
    return state


def _universal_param(zero: str, name: str, shape: List[int], group: int,
                     module: Dict[str, torch.Tensor], load: Load) -> TrainedParam:
    folder = _param_folder(zero, name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing: the universal checkpoint has no folder "
                                f"for parameter {name!r}; convert it again with "
                                "ds_to_universal.")
    master = _universal_tensor(os.path.join(folder, "fp32.pt"), shape, load)
    states, scalars = {}, {}
    for entry in sorted(os.listdir(folder)):
        key = entry[:-3] if entry.endswith(".pt") else None
        if key in (None, "fp32"):
            continue
        if key == "step":
            step = load(os.path.join(folder, entry))
            scalars["step"] = step["param"] if isinstance(step, dict) else step
        else:
            states[key] = _universal_tensor(os.path.join(folder, entry), shape, load)
    weight = module.get(name)
    return TrainedParam(shape, master, weight if _whole(weight, master.numel()) else None,
                        states, scalars, group)


def _param_folder(zero: str, name: str) -> str:
    """``zero/<name>``; a name that is not one directory name is refused, never followed."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{zero}: parameter name {name!r} cannot name a folder of a universal "
                         "checkpoint; the checkpoint is damaged.")
    return os.path.join(zero, name)


def _universal_tensor(path: str, shape: List[int], load: Load) -> torch.Tensor:
    saved = load(path)
    value = saved.get("param") if isinstance(saved, dict) else saved
    if not isinstance(value, torch.Tensor) or list(value.shape) != list(shape):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{path} holds {got}, not a tensor of the parameter's shape {shape}: "
                         "padded or tensor-parallel universal slices are not supported.")
    return value.reshape(-1)


def _universal_frozen(state: DeepSpeedState, zero: str, module: Dict[str, torch.Tensor],
                      load: Load) -> None:
    """Frozen parameters from the module where it kept them, else from their fp32.pt."""
    _whole_frozen(state, module)
    for name, value in module.items():
        skip = name in state.params or name in state.buffers or name in state.aliases
        path = os.path.join(_param_folder(zero, name), "fp32.pt")
        if not skip and name not in state.frozen and os.path.isfile(path):
            saved = load(path)
            state.frozen[name] = (saved["param"] if isinstance(saved, dict) else saved).to(
                value.dtype)

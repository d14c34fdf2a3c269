"""DeepSpeed's checkpoint layouts, read into one description of the training state.

Whatever the layout, the result is a :class:`._deepspeed_state.DeepSpeedState` (every trained
parameter whole, with its master and optimizer states; frozen parameters, buffers, counters,
scheduler, loss scaler, config, client keys). Facts of each layout (key names and where the
elements lie):

* **stage 0**: ``mp_rank_00_model_states.pt`` holds the module and the optimizer's state dict,
  whose parameters are numbered, not named: :mod:`._deepspeed_stage0` names them.
* **stages 1-2**: the module in ``mp_rank_00_model_states.pt`` (with ``param_shapes``: the
  names, shapes and order of each flat group); every rank's ``[bf16_]zero_pp_rank_<r>_...
  optim_states.pt`` holds its piece of each group's flat fp32 masters
  (``single_partition_of_fp32_groups``) and of the base optimizer's flat states.
* **stage 3**: every rank's ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (its
  ``frozen_param_fragments``) and optim file (``fp32_flat_groups`` and the base optimizer's
  state per sub-group); the module's own tensors are empty there.
* **pipelines** (ZeRO stage 1): each stage's ``mp_rank_<s>_model_states.pt`` (its
  ``param_shapes`` by global names) and optimizer files, read as a stage-1 checkpoint of the
  stage's parameters; the module from the ``layer_*`` files (:mod:`._deepspeed_pipe`).
* **universal** (``ds_to_universal``): one folder per parameter under ``zero/`` holding its
  whole ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` and ``step.pt``; hyperparameters and
  the loss scaler in ``zero/optimizer_state.pt``.

Where the elements of a parameter lie in the flat partitions is :mod:`._deepspeed_layout`'s
business. Tensors stay views of the memory-mapped files wherever the layout keeps a parameter
contiguous; only parameters split across ranks are copied into one piece.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._deepspeed_files import DeepSpeedFiles, load_pickle, locate
from .deepspeed_keys import (BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP, BUFFER_NAMES,
                             FP32_FLAT_GROUPS, FP32_WEIGHT_KEY, FROZEN_PARAM_FRAGMENTS,
                             FROZEN_PARAM_SHAPES, LOSS_SCALER, OPTIMIZER_STATE_DICT, PARAM,
                             PARAM_ALIGNMENT_PADDINGS, PARAM_GROUPS, PARAM_SHAPES,
                             PARTITION_COUNT, SINGLE_PARTITION_OF_FP32_GROUPS, ZERO_STAGE)
from ._deepspeed_layout import FlatView, group_offsets, stage3_offsets, stage3_param
from ._deepspeed_pipe import check_stages, layer_weights, stage_names
from ._deepspeed_stage0 import read_stage0
from ._deepspeed_state import (DeepSpeedState, Load, TrainedParam, base_state,
                               hyperparameters, numel, per_element, scaler_state, whole,
                               whole_frozen)

__all__ = ["read_deepspeed"]


def read_deepspeed(ckpt_dir: str, tag: Optional[str] = None, trust_pickle: bool = False,
                   frozen: Optional[Sequence[str]] = None,
                   untrained: Optional[Sequence[str]] = None) -> DeepSpeedState:
    """Reads a DeepSpeed checkpoint (stages 0-3 or universal) into a :class:`DeepSpeedState`;
    ``untrained`` (the parameters a module to load into does not train) settles a stage-0
    checkpoint that shapes cannot, and is not used otherwise."""
    files = locate(ckpt_dir, tag)

    def load(path: str) -> Any:
        return load_pickle(path, trust_pickle)

    if files.layers:
        if frozen:
            raise ValueError(f"{files.tag_dir}: frozen= (--frozen) is for stage-0 checkpoints "
                             "of one stage; a pipeline's names its parameters: drop it.")
        return _pipeline(files, load)
    model = _model_states(files.model_states[0], load)
    if not files.universal and not files.optim_states:
        return read_stage0(files, model, frozen, untrained)
    if frozen:
        raise ValueError(f"{files.tag_dir}: frozen= (--frozen) is for stage-0 checkpoints, whose "
                         "optimizer does not name its parameters; this one names them: drop it.")
    if files.experts and (files.universal or not files.optim_states):
        raise NotImplementedError(f"{files.tag_dir}: a mixture-of-experts checkpoint "
                                  "converts from ZeRO stages 1-2 (DeepSpeed's MoE stages); "
                                  "this one is universal or of another stage.")
    if files.universal:
        return _universal(files, model, load)
    _check_world(files, model)
    optims = [_optim_states(path, load) for path in files.optim_states]
    if FP32_FLAT_GROUPS in optims[0]:
        return _stage3(files, model, optims, load)
    return _stage12(files, model, optims, load)


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
    osd = saved.get(OPTIMIZER_STATE_DICT) if isinstance(saved, dict) else None
    if not isinstance(osd, dict) or not ({FP32_FLAT_GROUPS, SINGLE_PARTITION_OF_FP32_GROUPS}
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


def _shapes(model: Dict[str, Any], path: str) -> List[List[Tuple[str, List[int]]]]:
    """``param_shapes``: per flat group, the names and shapes of its parameters, in order."""
    groups = model.get(PARAM_SHAPES)
    if isinstance(groups, dict):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{path} has no param_shapes: it is not a ZeRO checkpoint of "
                         "DeepSpeed 0.19 (or it was damaged).")
    return [[(n, [int(d) for d in s]) for n, s in g.items()] for g in groups]


# -- stages 1 and 2 -----------------------------------------------------------------------------

def _stage12(files: DeepSpeedFiles, model: Dict[str, Any],
             optims: List[Dict[str, Any]], load: Load) -> DeepSpeedState:
    stage = int(optims[0].get(ZERO_STAGE, 1))
    state = base_state(files, model, f"ZeRO stage {stage}", stage, len(optims))
    shapes = _shapes(model, files.model_states[0])
    base = optims[0][BASE_OPTIMIZER_STATE]
    saved_groups = base["param_groups"] if isinstance(base, dict) else [{}] * len(shapes)
    experts = _expert_weights(files, load)
    autoep = model.get("ds_autoep_layers") or []
    for g, params in enumerate(shapes):
        if g < len(saved_groups) and saved_groups[g].get("moe"):
            read = _read_autoep12 if autoep else _read_experts12
            read(state, files, optims, g, params, experts)
        else:
            _read_group12(state, files, optims, g, params, model["module"])
    if files.experts and not any(group.get("moe") for group in saved_groups):
        raise ValueError(f"{files.tag_dir} holds expert files but no optimizer group of "
                         "experts ('moe': true): the checkpoint is damaged.")
    module = model["module"]
    if autoep:
        saved_groups, module = _as_model_autoep(state, autoep, saved_groups, module)
    whole_frozen(state, module)
    state.groups = hyperparameters(saved_groups)  # the elastic form keeps none
    state.loss_scaler = scaler_state(optims[0].get(LOSS_SCALER), optims[0].get(
        "dynamic_loss_scale"), state.counters["global_steps"])
    return state


def _read_group12(state: DeepSpeedState, files: DeepSpeedFiles, optims: List[Dict[str, Any]],
                  g: int, params: List[Tuple[str, List[int]]],
                  module: Dict[str, torch.Tensor]) -> None:
    """One flat group: every rank's unpadded piece, end to end, cut into its parameters."""
    numels = [numel(s) for _, s in params]
    paddings = (optims[0].get(PARAM_ALIGNMENT_PADDINGS) or [[0] * len(params)] * (g + 1))[g]
    offsets, end = group_offsets(numels, paddings)
    lengths = [o[SINGLE_PARTITION_OF_FP32_GROUPS][g].numel() for o in optims]
    masters = FlatView([o[SINGLE_PARTITION_OF_FP32_GROUPS][g] for o in optims])
    if masters.numel != end:
        raise ValueError(f"{files.tag_dir}: flat group {g} holds {masters.numel} fp32 elements "
                         f"but its param_shapes add up to {end}: the checkpoint is damaged.")
    per_rank = [_group_state(o, g) for o in optims]
    states = {k: FlatView([s[k].reshape(-1)[:n] for s, n in zip(per_rank, lengths)])
              for k, v in per_rank[0].items() if per_element(v)}
    scalars = {k: v for k, v in per_rank[0].items() if not per_element(v)}
    for (name, shape), off, n in zip(params, offsets, numels):
        weight = module.get(name)
        state.params[name] = TrainedParam(
            shape, masters.slice(off, off + n), weight if whole(weight, n) else None,
            {k: v.slice(off, off + n) for k, v in states.items()}, dict(scalars), g)


def _expert_weights(files: DeepSpeedFiles, load: Load) -> Dict[str, torch.Tensor]:
    """The experts' module weights, from the expert files (named by global expert index)."""
    out: Dict[str, torch.Tensor] = {}
    for path in files.experts.values():
        saved = load(path)
        if not isinstance(saved, dict):
            raise ValueError(f"{path} is not a DeepSpeed expert file (no state dict).")
        out.update(saved)
    return out


def _read_experts12(state: DeepSpeedState, files: DeepSpeedFiles, optims: List[Dict[str, Any]],
                    g: int, params: List[Tuple[str, List[int]]],
                    weights: Dict[str, torch.Tensor]) -> None:
    """One flat group of experts. DeepSpeed's expert-parallel groups are adjacent ranks
    (``ep_size`` of them), each holding other experts under the same local names (those
    ``param_shapes`` lists, rank 0's); the ranks ``e, e + ep_size, ...`` hold the same experts
    and their flat group is cut over them (``partition_count``). Each expert-parallel rank's
    experts are read as a group of their own and named by their global index."""
    local = sorted({_local_expert(n) for n, _ in params})
    for e, holders in enumerate(_expert_holders(files, optims, g)):
        named = [(_global_expert(n, e * len(local)), shape) for n, shape in params]
        _read_group12(state, files, holders, g, named, weights)


def _expert_holders(files: DeepSpeedFiles, optims: List[Dict[str, Any]], g: int
                    ) -> List[List[Dict[str, Any]]]:
    """For each expert-parallel rank ``e``, the optimizer states of the ranks holding its
    experts (``e, e + ep_size, ...``: DeepSpeed's layout), over which expert group ``g`` is cut
    (``partition_count``)."""
    world = len(optims)
    edp = int((optims[0].get(PARTITION_COUNT) or [1] * (g + 1))[g])
    if edp < 1 or world % edp:
        raise ValueError(f"{files.tag_dir}: expert group {g} is partitioned over {edp} of "
                         f"{world} ranks: the checkpoint is damaged.")
    ep = world // edp
    return [[optims[e + ep * j] for j in range(edp)] for e in range(ep)]


def _read_autoep12(state: DeepSpeedState, files: DeepSpeedFiles, optims: List[Dict[str, Any]],
                   g: int, params: List[Tuple[str, List[int]]],
                   weights: Dict[str, torch.Tensor]) -> None:
    """One flat group of DeepSpeed's AutoEP experts: on each expert-parallel rank (adjacent
    ranks, as for the MoE layer) its experts stacked along the first dimension under one name
    (``<block>.experts.w1``, ``(local experts, ffn, hidden)``); the unsplit tensor stacks every
    rank's in rank order. The module's copy is in the expert files, one per expert
    (``<block>.experts.w1.<e>``)."""
    pieces = []
    for holders in _expert_holders(files, optims, g):
        scratch = DeepSpeedState.__new__(DeepSpeedState)
        scratch.params = {}
        _read_group12(scratch, files, holders, g, params, {})
        pieces.append(scratch.params)
    for name, shape in params:
        parts = [p[name] for p in pieces]
        experts = shape[0] * len(pieces)
        rows = [weights.get(f"{name}.{i}") for i in range(experts)]
        weight = torch.stack(rows).reshape(-1) if all(r is not None for r in rows) else None
        state.params[name] = TrainedParam(
            [experts] + list(shape[1:]), torch.cat([p.master for p in parts]), weight,
            {k: torch.cat([p.states[k] for p in parts]) for k in parts[0].states},
            dict(parts[0].scalars), g)


def _as_model_autoep(state: DeepSpeedState, layers: List[Dict[str, Any]],
                     groups: List[Dict[str, Any]], module: Dict[str, torch.Tensor]):
    """DeepSpeed's AutoEP layers under the names and layout of the model transformers builds
    (what shardtrain's AutoEP trains, with the model's own modules): ``<block>.experts.w1``
    (gate) and ``w3`` (up) joined into ``gate_up_proj`` along each expert's rows, ``w2`` as
    ``down_proj``, the router ``<block>.router.gate.weight`` as ``<block>.gate.weight``. The
    optimizer groups DeepSpeed made for the experts are merged into the others (the model's
    parameters are one group to the model's own optimizer), where their hyperparameters agree.
    Returns the groups and the module's tensors without AutoEP's own names."""
    dropped = set()
    for layer in layers:
        block = str(layer.get("module_path", ""))
        w1, w2, w3 = (state.params.pop(f"{block}.experts.{w}", None) for w in ("w1", "w2", "w3"))
        if w1 is None or w2 is None:
            raise NotImplementedError(f"{state.tag_dir}: AutoEP layer {block!r} has no experts "
                                      "w1/w2 in the optimizer: not a layout this converter reads.")
        if w3 is not None:  # the gate and up projections, row blocks of one weight each expert
            w1 = _joined_rows(w1, w3)
        state.params[f"{block}.experts.gate_up_proj"] = w1
        state.params[f"{block}.experts.down_proj"] = w2
        router = state.params.pop(f"{block}.router.gate.weight", None)
        if router is not None:
            state.params[f"{block}.gate.weight"] = router
        dropped |= {f"{block}.router.gate.weight", f"{block}.gate.gate.weight"}
    merged = [{k: v for k, v in g.items() if k not in ("name", "moe", "params")} for g in groups]
    if any(g != merged[0] for g in merged):
        raise NotImplementedError(f"{state.tag_dir}: AutoEP's expert optimizer group has other "
                                  "hyperparameters than the dense one: not converted.")
    for p in state.params.values():
        p.group = 0
    return merged[:1], {k: v for k, v in module.items() if k not in dropped}


def _joined_rows(first: TrainedParam, second: TrainedParam) -> TrainedParam:
    """Each expert's rows of ``first`` then of ``second`` (``(experts, a, d)`` and
    ``(experts, b, d)`` into ``(experts, a + b, d)``), for every value it carries."""
    e, a, d = first.shape
    b = second.shape[1]

    def join(x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None or y is None:
            return None
        return torch.cat([x.reshape(e, a, d), y.reshape(e, b, d)], dim=1).reshape(-1)

    return TrainedParam([e, a + b, d], join(first.master, second.master),
                        join(first.weight, second.weight),
                        {k: join(v, second.states[k]) for k, v in first.states.items()},
                        dict(first.scalars), first.group)


_MARKER = "deepspeed_experts."


def _local_expert(name: str) -> int:
    head, sep, tail = name.rpartition(_MARKER)
    if not sep:
        raise NotImplementedError(f"{name}: an expert parameter outside DeepSpeed's MoE layer "
                                  f"(no '{_MARKER}' in its name) is not supported.")
    return int(tail.split(".", 1)[0])


def _global_expert(name: str, first: int) -> str:
    """``name`` (a local expert's) with the global index of an expert-parallel rank whose
    first expert is ``first``."""
    head, _, tail = name.rpartition(_MARKER)
    local, _, rest = tail.partition(".")
    return f"{head}{_MARKER}{first + int(local)}.{rest}"


def _group_state(osd: Dict[str, Any], g: int) -> Dict[str, Any]:
    """The base optimizer's state of flat group ``g`` (plain or elastic form)."""
    base = osd[BASE_OPTIMIZER_STATE]
    if isinstance(base, dict):  # a torch state dict: state keyed by the group's index
        saved = dict(base["state"].get(g, {}))
        group = base["param_groups"][g]
    else:  # elastic: one lean state per group, the step beside it
        saved, group = dict(base[g]), {}
        if BASE_OPTIMIZER_STATE_STEP in osd:
            saved.setdefault("step", osd[BASE_OPTIMIZER_STATE_STEP])
    if "step" not in saved and "step" in group:  # optimizers that count per group
        saved["step"] = group["step"]
    return saved


# -- pipelines ----------------------------------------------------------------------------------

def _pipeline(files: DeepSpeedFiles, load: Load) -> DeepSpeedState:
    """Each stage read as a stage-1 checkpoint of its own parameters (a tied module's from the
    first stage holding it); the weights, frozen parameters and buffers from the layer files
    (:mod:`._deepspeed_pipe`)."""
    models = [load(path) for path in files.model_states]
    dp = check_stages(files, models)
    params: Dict[str, TrainedParam] = {}
    first = {}  # stage 0's optimizer states: its groups and loss scaler stand for every stage's
    for stage, (path, model) in enumerate(zip(files.model_states, models)):
        optims = [_optim_states(p, load) for p in files.stage_optim_states[stage]]
        for name, p in _stage_params(files, path, model, optims, first).items():
            params.setdefault(name, p)
        first = first or optims[0]
    names = [n for model in models for n in stage_names(model)]
    module = layer_weights(files, names, {n: p.master for n, p in params.items()}, load)
    for name, p in params.items():
        weight = module.get(name)
        p.weight = weight.reshape(-1) if whole(weight, p.master.numel()) else None
    buffers = list(dict.fromkeys(n for m in models for n in m.get(BUFFER_NAMES) or []))
    merged = dict(models[0], module=module, buffer_names=buffers, shared_params={})
    stage = int(first.get(ZERO_STAGE, 1))
    state = base_state(files, merged, f"pipeline of {len(models)} stages, ZeRO stage {stage}",
                       stage, dp)
    state.params = params
    whole_frozen(state, module)
    state.groups = hyperparameters(first[BASE_OPTIMIZER_STATE]["param_groups"])
    state.loss_scaler = scaler_state(first.get(LOSS_SCALER), first.get("dynamic_loss_scale"),
                                     state.counters["global_steps"])
    return state


def _stage_params(files: DeepSpeedFiles, path: str, model: Dict[str, Any],
                  optims: List[Dict[str, Any]], first: Dict[str, Any]) -> Dict[str, TrainedParam]:
    """One stage's trained parameters from its ranks' flat groups (weights left to the layer
    files); its optimizer must have stage 0's param groups (``first``: none yet)."""
    if FP32_FLAT_GROUPS in optims[0]:
        raise NotImplementedError(f"{path}: this stage's optimizer files are ZeRO stage 3's, "
                                  "which DeepSpeed does not run with pipelines; not converted.")
    groups = hyperparameters(optims[0][BASE_OPTIMIZER_STATE]["param_groups"])
    if first and groups != hyperparameters(first[BASE_OPTIMIZER_STATE]["param_groups"]):
        raise NotImplementedError(f"{path}: this stage's optimizer has other param groups than "
                                  "stage 0's; not converted.")
    scratch = DeepSpeedState.__new__(DeepSpeedState)
    scratch.params = {}
    for g, shapes in enumerate(_shapes(model, path)):
        _read_group12(scratch, files, optims, g, shapes, {})
    return scratch.params


# -- stage 3 ------------------------------------------------------------------------------------

def _stage3(files: DeepSpeedFiles, model: Dict[str, Any], optims: List[Dict[str, Any]],
            load: Load) -> DeepSpeedState:
    world = len(optims)
    if int(optims[0].get(PARTITION_COUNT, world)) != world:
        raise NotImplementedError(f"{files.optim_states[0]}: ZeRO-3 partitioned over "
                                  f"{optims[0][PARTITION_COUNT]} of {world} ranks (hpZ/MiCS) "
                                  "is not supported.")
    state = base_state(files, model, "ZeRO stage 3", 3, world)
    _stage3_params(state, files, optims, _shapes(model, files.model_states[0]))
    state.frozen = _stage3_frozen(files, model, load)
    saved_groups = optims[0][OPTIMIZER_STATE_DICT]["param_groups"]
    state.groups, merged = _merge_subgroups(hyperparameters(saved_groups))
    for p in state.params.values():
        p.group = merged[p.group]
    state.loss_scaler = scaler_state(optims[0].get(LOSS_SCALER), optims[0].get(
        "dynamic_loss_scale"), state.counters["global_steps"])
    return state


def _stage3_params(state: DeepSpeedState, files: DeepSpeedFiles, optims: List[Dict[str, Any]],
                   shapes: List[List[Tuple[str, List[int]]]]) -> None:
    """Every parameter's pieces of every rank's flat vectors, put together (copies)."""
    flat = [(g, n, s) for g, params in enumerate(shapes) for n, s in params]
    offsets, length = stage3_offsets([numel(s) for _, _, s in flat], len(optims))
    masters = [FlatView(o[FP32_FLAT_GROUPS]) for o in optims]
    if any(m.numel != length for m in masters):
        raise ValueError(f"{files.tag_dir}: a rank's fp32_flat_groups hold "
                         f"{[m.numel for m in masters]} elements, param_shapes say {length} "
                         "per rank: the checkpoint is damaged.")
    states, scalars = _stage3_states(optims, len(shapes))
    for (g, name, shape), off in zip(flat, offsets):
        n = numel(shape)
        state.params[name] = TrainedParam(
            shape, stage3_param(masters, off, n), None,
            {k: stage3_param(v, off, n) for k, v in states.items()}, dict(scalars[g]), g)


def _stage3_states(optims: List[Dict[str, Any]], groups: int
                   ) -> Tuple[Dict[str, List[FlatView]], List[Dict[str, Any]]]:
    """Per-element states as every rank's flat vector (sub-groups end to end), and the scalar
    states of each sub-group."""
    per_rank = [[_group_state({BASE_OPTIMIZER_STATE: o[OPTIMIZER_STATE_DICT]}, g)
                 for g in range(groups)] for o in optims]
    keys = [k for k, v in per_rank[0][0].items() if per_element(v)] if groups else []
    states = {k: [FlatView([s[k] for s in rank]) for rank in per_rank] for k in keys}
    scalars = [{k: v for k, v in s.items() if not per_element(v)} for s in per_rank[0]]
    return states, scalars


def _stage3_frozen(files: DeepSpeedFiles, model: Dict[str, Any],
                   load: Load) -> Dict[str, torch.Tensor]:
    """Frozen parameters: every rank's fragment, end to end, cut to the parameter's size."""
    shapes = model.get(FROZEN_PARAM_SHAPES) or {}
    if not shapes:
        return {}
    ranks = [model] + [load(p) for p in files.model_states[1:]]
    out = {}
    for name, shape in shapes.items():
        views = [FlatView([r[FROZEN_PARAM_FRAGMENTS][name]]) for r in ranks]
        out[name] = stage3_param(views, 0, numel(shape)).reshape(list(shape))
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


# -- the universal form -------------------------------------------------------------------------

def _universal(files: DeepSpeedFiles, model: Dict[str, Any], load: Load) -> DeepSpeedState:
    zero = os.path.join(files.tag_dir, "zero")
    optim = load(os.path.join(zero, "optimizer_state.pt"))
    stage = int(optim.get(ZERO_STAGE, 1))
    state = base_state(files, model, f"universal (from ZeRO stage {stage})", stage,
                       int(model.get("dp_world_size") or 1))
    shapes = _shapes(model, files.model_states[0])
    for g, params in enumerate(shapes):
        for name, shape in params:
            state.params[name] = _universal_param(zero, name, shape, g, model["module"], load)
    _universal_frozen(state, zero, model["module"], load)
    groups = hyperparameters(optim.get(PARAM_GROUPS) or [{}] * len(shapes))
    state.groups, merged = _merge_subgroups(groups) if stage == 3 else (groups,
                                                                          list(range(len(groups))))
    for p in state.params.values():
        p.group = merged[p.group]
    state.loss_scaler = scaler_state(optim.get(LOSS_SCALER), optim.get("dynamic_loss_scale"),
                                     state.counters["global_steps"])
    return state


def _universal_param(zero: str, name: str, shape: List[int], group: int,
                     module: Dict[str, torch.Tensor], load: Load) -> TrainedParam:
    folder = _param_folder(zero, name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder} is missing: the universal checkpoint has no folder "
                                f"for parameter {name!r}; convert it again with "
                                "ds_to_universal.")
    master = _universal_tensor(os.path.join(folder, f"{FP32_WEIGHT_KEY}.pt"), shape, load)
    states, scalars = {}, {}
    for entry in sorted(os.listdir(folder)):
        key = entry[:-3] if entry.endswith(".pt") else None
        if key in (None, FP32_WEIGHT_KEY):
            continue
        if key == "step":
            step = load(os.path.join(folder, entry))
            scalars["step"] = step[PARAM] if isinstance(step, dict) else step
        else:
            states[key] = _universal_tensor(os.path.join(folder, entry), shape, load)
    weight = module.get(name)
    return TrainedParam(shape, master, weight if whole(weight, master.numel()) else None,
                        states, scalars, group)


def _param_folder(zero: str, name: str) -> str:
    """``zero/<name>``; a name that is not one directory name is refused, never followed."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{zero}: parameter name {name!r} cannot name a folder of a universal "
                         "checkpoint; the checkpoint is damaged.")
    return os.path.join(zero, name)


def _universal_tensor(path: str, shape: List[int], load: Load) -> torch.Tensor:
    """A universal file's whole tensor, flattened (shaped from stages 1-2, flat from 3)."""
    saved = load(path)
    value = saved.get(PARAM) if isinstance(saved, dict) else saved
    if not isinstance(value, torch.Tensor) or value.numel() != numel(shape):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{path} holds {got}, not the {numel(shape)} elements of the "
                         f"parameter's shape {shape}: padded or tensor-parallel universal "
                         "slices are not supported.")
    return value.reshape(-1)


def _universal_frozen(state: DeepSpeedState, zero: str, module: Dict[str, torch.Tensor],
                      load: Load) -> None:
    """Frozen parameters from the module where it kept them, else from their fp32.pt."""
    whole_frozen(state, module)
    for name, value in module.items():
        skip = name in state.params or name in state.buffers or name in state.aliases
        path = os.path.join(_param_folder(zero, name), f"{FP32_WEIGHT_KEY}.pt")
        if not skip and name not in state.frozen and os.path.isfile(path):
            saved = load(path)
            state.frozen[name] = (saved[PARAM] if isinstance(saved, dict) else saved).to(
                value.dtype)

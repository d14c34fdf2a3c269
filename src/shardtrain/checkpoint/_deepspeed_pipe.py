"""DeepSpeed's pipeline checkpoints: what each stage's files hold, and the layers' weights
under the names of the unsplit ``PipelineModule``.

A DeepSpeed ``PipelineEngine`` saves one tag directory for all its stages:

* ``layer_<XX>-model_states.pt``: layer ``XX``'s state dict under the layer's own names
  (``fc.weight``), written by the stage holding the layer; a layer that is a plain callable,
  or a ``TiedLayerSpec`` with a ``forward_fn`` (a head reusing an embedding), has none. A tied
  layer's file holds its tied module's state dict.
* ``mp_rank_<SS>_model_states.pt``, one per stage ``SS`` (the stage is DeepSpeed's
  model-parallel rank): the counters, config and scheduler, and ``param_shapes``, the names of
  the stage's trained parameters as the ``PipelineModule`` names them (``3.fc.weight``; a tied
  module's ``tied_modules.<key>.weight``), in the order of its optimizer's flat groups;
  ``module`` is None.
* ``[bf16_]zero_pp_rank_<D>_mp_rank_<SS>_optim_states.pt``: stage ``SS``'s ZeRO-1 partitions
  over its data-parallel ranks ``D``, laid out as a data-parallel stage-1 checkpoint's.

Every stage holding a tied module trains its own copy, reduced with the others', so the copies
agree; the converter takes the first stage's, which is where shardtrain's ``PipelineModule``
keeps the parameter, under the same name. At ZeRO stage 0 DeepSpeed writes each stage's
optimizer state numbered, not named, and records no tied module's key: such a checkpoint is
refused.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Set

import torch

from ._deepspeed_files import DeepSpeedFiles
from .deepspeed_keys import BUFFER_NAMES, CHECKPOINT_PARALLEL_DIMS, PARAM_SHAPES

__all__ = ["check_stages", "stage_names", "layer_weights", "TIED"]

TIED = "tied_modules."


def check_stages(files: DeepSpeedFiles, models: Sequence[Any]) -> int:
    """Refuses what the converter does not read and a stage whose files are missing; returns
    the data-parallel size."""
    for path, model in zip(files.model_states, models):
        if not isinstance(model, dict) or not isinstance(model.get(PARAM_SHAPES) or
                                                         model.get("optimizer"), (list, dict)):
            raise ValueError(f"{path} is not a DeepSpeed pipeline stage's model states file "
                             "(no param_shapes nor optimizer): the checkpoint is damaged.")
        dims = model.get(CHECKPOINT_PARALLEL_DIMS) or {}
        if int(dims.get("tp_degree") or 1) != 1:
            raise NotImplementedError(f"{path}: pipelines with tensor parallelism (tp_degree "
                                      f"{dims['tp_degree']}) are not supported.")
        stages = int(dims.get("pp_degree") or model.get("mp_world_size") or 1)
        if stages != len(files.model_states):
            raise FileNotFoundError(
                f"{files.tag_dir} holds {len(files.model_states)} stage file(s) but the "
                f"pipeline had {stages} stages: copy every mp_rank_*_model_states.pt.")
    if not any(files.stage_optim_states) and models[0].get("optimizer") is not None:
        raise NotImplementedError(
            f"{files.tag_dir}: a pipeline checkpoint of ZeRO stage 0, whose files name neither "
            "the optimizer's parameters nor the tied layers' keys, does not convert; save it at "
            "ZeRO stage 1 (zero_optimization.stage: 1), DeepSpeed's stage for pipelines.")
    dp = int(models[0].get("dp_world_size") or 1)
    for stage, optims in enumerate(files.stage_optim_states):
        if len(optims) != dp:
            name = f"zero_pp_rank_{len(optims)}_mp_rank_{stage:02d}_optim_states.pt"
            raise FileNotFoundError(
                f"{os.path.join(files.tag_dir, name)} is missing: stage {stage} has optimizer "
                f"states of {len(optims)} of its {dp} data-parallel ranks; the DeepSpeed "
                "pipeline checkpoint is incomplete: copy every stage's optimizer files.")
    return dp


def stage_names(model: Dict[str, Any]) -> List[str]:
    """The global names of a stage's trained parameters and buffers."""
    groups = model.get(PARAM_SHAPES) or []
    return [n for g in groups for n in g] + list(model.get(BUFFER_NAMES) or [])


def layer_weights(files: DeepSpeedFiles, names: Sequence[str],
                  masters: Dict[str, torch.Tensor], load) -> Dict[str, torch.Tensor]:
    """Every layer file's tensors under the unsplit module's names: ``<XX>.<name>``, or for a
    tied layer ``tied_modules.<key>.<name>`` (the first file holding it). A layer that no
    stage names is tied when its values are those of a tied module's trained masters, and
    otherwise holds frozen parameters or buffers only. ``names``: every stage's names."""
    plain = {int(n.split(".", 1)[0]) for n in names if n.split(".", 1)[0].isdigit()}
    ties = _tied_suffixes(names)
    out: Dict[str, torch.Tensor] = {}
    found: Set[str] = set()
    for index, path in sorted(files.layers.items()):
        saved = load(path)
        if not isinstance(saved, dict):
            raise ValueError(f"{path} is not a DeepSpeed layer file (no state dict): the "
                             "checkpoint is damaged.")
        key = None if index in plain else _tie_of(path, saved, ties, masters)
        if key is not None and key in found:
            continue  # another layer running the same tied module: the first one's
        prefix = f"{index}." if key is None else f"{TIED}{key}."
        found.add(key)
        out.update({prefix + k: v for k, v in saved.items()})
    _check_complete(files, names, plain, ties, out)
    return out


def _tied_suffixes(names: Sequence[str]) -> Dict[str, Set[str]]:
    """Each tied module's key -> the names of its trained parameters inside it."""
    out: Dict[str, Set[str]] = {}
    for name in names:
        if name.startswith(TIED):
            key, _, rest = name[len(TIED):].partition(".")
            out.setdefault(key, set()).add(rest)
    return out


def _tie_of(path: str, saved: Dict[str, Any], ties: Dict[str, Set[str]],
            masters: Dict[str, torch.Tensor]):
    """The tied module a layer file holds (None: none does): its names hold every trained
    parameter of the module, with the values of their masters."""
    keys = [key for key, suffixes in ties.items()
            if suffixes <= set(saved) and all(_same(saved[s], masters.get(f"{TIED}{key}.{s}"))
                                              for s in suffixes)]
    if len(keys) > 1:
        raise ValueError(f"{path} holds the weights of tied modules {keys} alike: which one "
                         "this layer is cannot be told; the checkpoint cannot be converted.")
    return keys[0] if keys else None


def _same(value: Any, master: Any) -> bool:
    """A layer file's tensor is the module's copy of ``master`` (in the module's dtype)."""
    if not isinstance(value, torch.Tensor) or not isinstance(master, torch.Tensor) \
            or value.numel() != master.numel():
        return False
    return torch.equal(value.reshape(-1), master.reshape(-1).to(value.dtype))


def _check_complete(files: DeepSpeedFiles, names: Sequence[str], plain: Set[int],
                    ties: Dict[str, Set[str]], weights: Dict[str, torch.Tensor]) -> None:
    """Every layer the stages name has its file, and every trained name a tensor there."""
    for index in sorted(plain - set(files.layers)):
        name = next(n for n in names if n.startswith(f"{index}."))
        raise FileNotFoundError(
            f"{os.path.join(files.tag_dir, f'layer_{index:02d}-model_states.pt')} is missing "
            f"(layer {index} holds {name!r}): the DeepSpeed pipeline checkpoint is incomplete; "
            "copy every layer_*-model_states.pt.")
    for key in sorted(k for k in ties if f"{TIED}{k}.{next(iter(ties[k]))}" not in weights):
        raise FileNotFoundError(
            f"{files.tag_dir}: no layer_*-model_states.pt holds tied module {key!r} (its "
            f"{sorted(ties[key])}): the DeepSpeed pipeline checkpoint is incomplete; copy every "
            "layer file.")
    absent = [n for n in names if n not in weights]
    if absent:
        raise ValueError(f"{files.tag_dir}: the layer files lack {absent[:5]}, which the "
                         "stages' files name: the checkpoint is damaged.")

"""Importing a DeepSpeed checkpoint: its training state, written by shardtrain's own save.

:func:`import_deepspeed` reads a DeepSpeed checkpoint (:mod:`._deepspeed_reader`) and gives
what it holds the shape of an engine's :class:`shardtrain.state.TrainingParts`: a module whose
parameters are the saved weights, the optimizer that shardtrain builds from the same config
holding the fp32 masters and the Adam moments (or, for an optimizer passed to DeepSpeed's
``initialize``, the ``torch.optim`` class its param groups name), the scheduler's state dict
(which a load gives to the engine's scheduler, as DeepSpeed's does), the loss scaler, the
counters. Then
:func:`shardtrain.checkpoint.save_checkpoint` writes those parts exactly as it writes an
engine's, so the converted checkpoint is an ordinary one (meta.json, rank files, digests,
atomic publication) and any change of the format reaches the converter too.

The output is a checkpoint of **one rank** in one process, with no process group: the format
reshards at load, so a world of 1 loads on any world size and ZeRO stage (each rank reads the
byte ranges it needs from the one rank file), and the conversion needs no launcher.

Memory: the saved tensors are views of the memory-mapped DeepSpeed files wherever a
parameter's elements lie in one piece (stage 0, the universal form, and at stages 1-2 every
parameter that no rank boundary cuts); what is copied is a parameter cut across ranks (at
stage 3 with more than one rank: every parameter's master and states, about 12 bytes per
parameter in all) and the 16-bit weights that stage 3 does not save (cast from the masters,
2 bytes per parameter). Everything else is file pages that the system can evict.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import comm
from ..log import logger
from ..optim import build_optimizer
from ..precision import LossScaler, Precision
from ..state import TrainingParts, TrainState
from ..zero.strategy import ParamSlot
from ._agreement import as_plain_errors
from ._deepspeed_reader import read_deepspeed
from ._deepspeed_state import DeepSpeedState, TrainedParam
from ._format import dtype_name, encode_dict
from ._manifest import UnnamedScheduler
from ._paths import is_plain_tag
from ._saving import save_checkpoint

__all__ = ["import_deepspeed"]


def import_deepspeed(ckpt_dir: str, out_dir: str, tag: Optional[str] = None,
                     trust_pickle: bool = False,
                     frozen: Optional[Sequence[str]] = None,
                     untrained: Optional[Sequence[str]] = None) -> str:
    """Converts a DeepSpeed checkpoint into a shardtrain checkpoint.

    Reads a checkpoint that DeepSpeed 0.19 saved with ``engine.save_checkpoint`` at ZeRO stage
    0, 1, 2 or 3 (fp32, bf16 or fp16; any data-parallel world size; at stages 1-2 with the
    experts of its MoE layers split over expert-parallel ranks; a ``PipelineModule``'s stages at
    stage 1, into the unsplit module under its global layer names), or its universal form
    (``ds_to_universal``), and writes ``<out_dir>/<tag>/`` and ``<out_dir>/latest``.
    ``engine.load_checkpoint(out_dir)`` then resumes it on any world size and stage: the
    weights, the fp32 masters, the optimizer's states and hyperparameters, the counters
    (``global_steps``, ``global_samples``, ``skipped_steps``), the scheduler and the loss
    scaler, and the user's ``client_state`` keys. Runs in one process, without DeepSpeed.

    Args:
        ckpt_dir: the directory given to DeepSpeed's ``save_checkpoint`` (with ``latest`` or
            ``latest_universal``), or one tag directory.
        out_dir: where the shardtrain checkpoint goes; ``<out_dir>/<tag>`` must not exist.
        tag: the DeepSpeed tag to convert (default: the one ``latest`` names); the output
            keeps it.
        trust_pickle: DeepSpeed's files are pickles. By default they are read by torch's
            restricted unpickler, which builds tensors, containers and the few DeepSpeed types
            the converter knows, and refuses any other type by name. ``True`` unpickles
            everything, which can run code from the files: only for checkpoints you trust.
        frozen: stage 0 only, when shapes cannot tell: the names of the module's parameters
            the optimizer did not hold.
        untrained: the parameters the module that will load the checkpoint does not train
            (``requires_grad`` false); a stage-0 checkpoint that shapes cannot settle takes
            them as ``frozen`` when they fit (``engine.load_checkpoint`` passes them).

    Returns:
        The tag directory written.

    Raises:
        FileNotFoundError: no such directory, tag or file (the message names it).
        ValueError: not a DeepSpeed checkpoint, a damaged one, a pickled type outside the
            allow-list, or an output that already exists.
        NotImplementedError: a layout the converter does not read (tensor parallel, a
            pipeline at ZeRO stage 0, a mixture of experts at stage 0).

    Example:
        >>> import_deepspeed("ds_checkpoints", "checkpoints")
        'checkpoints/global_step1000'
        >>> engine.load_checkpoint("checkpoints")     # any world size, any ZeRO stage
    """
    if comm.get_world_size() > 1:
        raise ValueError("import_deepspeed runs in one process, but a process group of "
                         f"{comm.get_world_size()} ranks is active: call it before "
                         "init_distributed, or run `shardtrain import-deepspeed`.")
    state = as_plain_errors(read_deepspeed, ckpt_dir, tag, trust_pickle, frozen, untrained)
    target = _target(os.fspath(ckpt_dir), os.fspath(out_dir), state)
    parts = _parts(state)
    save_checkpoint(_Imported(parts), out_dir, tag=state.tag, client_state=state.client_state)
    logger.info("import_deepspeed: %s (%s, %d rank(s), %s) -> %s", state.tag_dir, state.layout,
                state.world_size, dtype_name(state.dtype), target)
    return target


def _target(ckpt_dir: str, out_dir: str, state: DeepSpeedState) -> str:
    """``<out_dir>/<tag>``, refused if it exists or would overwrite the DeepSpeed files."""
    if not is_plain_tag(state.tag):
        raise ValueError(f"DeepSpeed tag {state.tag!r} cannot name a shardtrain checkpoint "
                         "directory; rename the DeepSpeed tag directory first.")
    target = os.path.join(out_dir, state.tag)
    for source in (ckpt_dir, state.tag_dir, os.path.dirname(state.tag_dir)):
        if os.path.realpath(out_dir) == os.path.realpath(source):
            raise ValueError(f"out_dir {out_dir!r} is the DeepSpeed checkpoint's own directory; "
                             "writing there would replace its 'latest': choose another one.")
    if os.path.exists(target):
        raise ValueError(f"{target} already exists; remove it or choose another out_dir.")
    return target


class _Imported:
    """Stands where an engine stands for ``save_checkpoint``: it only asks for the parts."""

    def __init__(self, parts: TrainingParts):
        self._parts = parts

    def training_parts(self) -> TrainingParts:
        return self._parts


# -- the parts ----------------------------------------------------------------------------------

def _parts(state: DeepSpeedState) -> TrainingParts:
    params, slots = _params(state)
    optimizer = _optimizer(state, slots)
    scheduler = _scheduler(state)
    _set_hyperparameters(state, optimizer)
    _set_states(state, optimizer, slots)
    gas = _accumulation(state.config, state.world_size)
    counters = TrainState(micro_steps=state.counters["global_steps"] * gas, **state.counters)
    if state.data_sampler is not None:
        logger.warning("import_deepspeed: %s has a data_sampler state; DeepSpeed's data "
                       "sampler has no shardtrain counterpart, so it is not carried over.",
                       state.tag_dir)
    module = _Weights(params, state.buffers, state.aliases)
    return TrainingParts(
        module=module, optimizer=optimizer, slots=list(slots.values()),
        lr_scheduler=scheduler, loss_scaler=_loss_scaler(state.loss_scaler),
        dataloader=None, train_state=counters,
        precision=Precision(state.dtype, _autocast(state.config)),
        config=_RecordedConfig(state.config), zero_stage=state.stage,
        gradient_accumulation_steps=gas, device=torch.device("cpu"))


def _params(state: DeepSpeedState) -> Tuple[Dict[str, torch.nn.Parameter], Dict[str, ParamSlot]]:
    """Every parameter (trained ones first), and what the optimizer holds of each trained one:
    the parameter itself in fp32 training, its fp32 master in 16-bit training."""
    params: Dict[str, torch.nn.Parameter] = {}
    slots: Dict[str, ParamSlot] = {}
    for name, p in state.params.items():
        sixteen = state.dtype != torch.float32
        weight = p.weight if sixteen and p.weight is not None else p.master.to(state.dtype)
        weight = weight.detach()
        param = torch.nn.Parameter(weight.reshape(p.shape), requires_grad=True)
        master = p.master.detach().reshape(p.shape) if sixteen else param
        params[name] = param
        slots[name] = ParamSlot(param, 0, param.numel(), param.numel(), master, False, sixteen)
    for name, value in state.frozen.items():
        params[name] = torch.nn.Parameter(value, requires_grad=False)
    return params, slots


def _optimizer(state: DeepSpeedState, slots: Dict[str, ParamSlot]) -> torch.optim.Optimizer:
    """The optimizer shardtrain builds from the same config block, over the same groups; with
    no block (a client optimizer), the torch class its param groups name."""
    groups: List[List[torch.Tensor]] = [[] for _ in state.groups]
    for name, p in state.params.items():
        groups[p.group].append(slots[name].tensor)
    spec = state.config.get("optimizer")
    if spec:
        return build_optimizer(spec, [{"params": g} for g in groups])
    cls = _client_class(state)
    return cls([{"params": g, **_arguments(cls, saved)} for g, saved in zip(groups, state.groups)])


def _client_class(state: DeepSpeedState) -> type:
    """The ``torch.optim`` class of a client optimizer: each class has its own set of
    param-group keys (the largest set the saved groups hold wins); Adam and AdamW share
    theirs and differ by ``decoupled_weight_decay``."""
    saved = set(state.groups[0]) if state.groups else set()
    fits = {name: keys for name, keys in _group_keys().items() if keys <= saved}
    if not fits:
        raise NotImplementedError(
            f"{state.tag_dir}: the DeepSpeed config has no optimizer block (the optimizer was "
            f"passed to initialize) and its param groups' keys {sorted(saved)} are not those "
            "of any torch.optim class. Add the optimizer to the config and save again.")
    most = max(len(keys) for keys in fits.values())
    names = sorted(name for name, keys in fits.items() if len(keys) == most)
    if {"Adam", "AdamW"} <= set(names):
        decoupled = bool(state.groups[0].get("decoupled_weight_decay"))
        names = ["AdamW" if decoupled else "Adam"]
    return getattr(torch.optim, names[0])


def _group_keys() -> Dict[str, frozenset]:
    """Each ``torch.optim`` class's param-group keys, read off an instance over one tensor."""
    out = {}
    probe = torch.zeros(2, 2, requires_grad=True)
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) \
                and cls is not torch.optim.Optimizer:
            try:
                group = cls([probe]).param_groups[0]
            except (TypeError, ValueError, RuntimeError):  # a class that needs more to build
                continue
            out[name] = frozenset(group) - {"params"}
    return out


def _arguments(cls: type, saved: Dict[str, Any]) -> Dict[str, Any]:
    """A saved param group's hyperparameters as the class takes them (tuples stay tuples)."""
    defaults = cls([torch.zeros(1, requires_grad=True)]).defaults
    return {k: tuple(v) if isinstance(defaults.get(k), tuple) else v
            for k, v in saved.items() if k in defaults}


def _set_hyperparameters(state: DeepSpeedState, optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed's recorded values (lr, betas, ...) of the keys the built optimizer has."""
    for group, saved in zip(optimizer.param_groups, state.groups):
        for key, value in saved.items():
            if key in group and key != "params":
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _set_states(state: DeepSpeedState, optimizer: torch.optim.Optimizer,
                slots: Dict[str, ParamSlot]) -> None:
    for name, p in state.params.items():
        if p.states or p.scalars:
            optimizer.state[slots[name].tensor] = _param_state(p)


def _param_state(p: TrainedParam) -> Dict[str, Any]:
    out: Dict[str, Any] = {k: v.detach().reshape(p.shape) for k, v in p.states.items()}
    for key, value in p.scalars.items():
        if key == "step" and not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value), dtype=torch.float32)  # as torch's Adam keeps it
        out[key] = value
    return out


def _scheduler(state: DeepSpeedState) -> Optional[UnnamedScheduler]:
    """DeepSpeed's scheduler state, under no class: DeepSpeed saves a scheduler's bare state
    dict, and the one that ran may have been passed to ``initialize`` (which DeepSpeed prefers
    to the config's block), so the config cannot say which class it was."""
    return None if state.lr_scheduler is None else UnnamedScheduler(state.lr_scheduler)


def _loss_scaler(saved: Dict[str, Any]) -> LossScaler:
    scaler = LossScaler(saved["scale"], saved["dynamic"], saved["window"], saved["hysteresis"],
                        saved["consecutive_hysteresis"], saved["min_scale"])
    scaler.load_state_dict({"scale": saved["scale"], "cur_iter": saved["cur_iter"],
                            "last_overflow_iter": saved["last_overflow_iter"],
                            "cur_hysteresis": saved["cur_hysteresis"]})
    return scaler


def _accumulation(config: Dict[str, Any], world: int) -> int:
    """gradient_accumulation_steps as DeepSpeed resolves it from the batch keys."""
    gas = config.get("gradient_accumulation_steps")
    batch, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    if gas is None and batch and micro:
        gas = (int(batch) // int(micro)) // max(world, 1)
    return max(int(gas or 1), 1)


def _autocast(config: Dict[str, Any]) -> Optional[torch.dtype]:
    block = config.get("torch_autocast") or {}
    if not (isinstance(block, dict) and block.get("enabled")):
        return None
    name = str(block.get("dtype") or "bfloat16").replace("torch.", "")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}.get(
        name, getattr(torch, name, torch.bfloat16))


class _Weights:
    """The module, as much of it as a checkpoint reads: named parameters and buffers, and the
    state-dict names of tied weights. Trained parameters come first, in DeepSpeed's order."""

    def __init__(self, params: Dict[str, torch.nn.Parameter], buffers: Dict[str, torch.Tensor],
                 aliases: Dict[str, str]):
        self._params, self._buffers, self._aliases = params, buffers, aliases

    def named_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return list(self._params.items())

    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self._params.values())

    def named_buffers(self) -> List[Tuple[str, torch.Tensor]]:
        return list(self._buffers.items())

    def state_dict(self, keep_vars: bool = False) -> Dict[str, torch.Tensor]:
        out = dict(self._params, **self._buffers)
        out.update({alias: out[source] for alias, source in self._aliases.items()
                    if source in out})
        return out


class _RecordedConfig:
    """DeepSpeed's config as the run saved it, recorded in meta.json as the run's config."""

    class _Checkpoint:
        tag_validation = "Ignore"  # one process: there is no other rank's tag to compare
        async_save = False  # the converter writes and returns

    checkpoint = _Checkpoint()

    def __init__(self, config: Dict[str, Any]):
        self._config = encode_dict(config, "ds_config")

    def to_dict(self) -> Dict[str, Any]:
        return dict(self._config)

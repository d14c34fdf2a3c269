"""A model written as a list of layers, each rank building only its pipeline stage's.

:class:`PipelineModule` takes DeepSpeed's arguments: the layers (modules, callables,
:class:`LayerSpec` s built only on the stage that owns them, :class:`TiedLayerSpec` s whose
weights several stages share), ``num_stages`` or a ``topology``, the ``loss_fn`` the last
stage applies to its output and the labels, and the ``partition_method`` that splits the
layers into stages. A stage's submodules are named by their global layer index (``3.fc.weight``),
so state dicts and checkpoints carry the same names on every pipeline size; tied modules live
under ``tied_modules.<key>``.

A tied weight (an embedding that the head reuses) is a parameter on the first stage that
holds it (its owner) and a copy on the others: the copy's gradient is sent to the owner, which
adds it to its own before the data-parallel reduction, updates, and sends the new values back
(the engine does both). The whole gradient is counted once in the global norm.

Example:
    >>> net = PipelineModule(
    ...     layers=[LayerSpec(nn.Linear, 16, 64), nn.ReLU(), LayerSpec(nn.Linear, 64, 4)],
    ...     num_stages=2, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
"""
from __future__ import annotations

import re
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .. import comm
from ..activation_checkpointing import checkpoint as _checkpoint
from .partition import partition_balanced, partition_uniform
from .topology import PipeDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "TiedWeight"]


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``typename(*module_args,
    **module_kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs a torch.nn.Module class, got {typename!r}.")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` weights every layer of the same ``key`` shares (one
    module per stage and key); ``forward_fn(module, x)``, when given, runs in place of the
    module's forward (a head reusing an embedding's weight)."""

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = ("weight",), **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) \
            else list(tied_weight_attr)


class TiedWeight:
    """One tied weight on this rank: its key and attribute, the stages holding it (the first
    owns the parameter), and the tensor here (the parameter on the owner, a copy elsewhere)."""

    def __init__(self, key: str, attr: str, stages: List[int], module: nn.Module):
        self.key, self.attr, self.stages, self.module = key, attr, stages, module

    @property
    def owner(self) -> int:
        return self.stages[0]

    @property
    def tensor(self) -> torch.Tensor:
        return _getattr_dotted(self.module, self.attr)

    def __repr__(self) -> str:
        return f"TiedWeight({self.key}.{self.attr}, stages={self.stages})"


PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")


class PipelineModule(nn.Module):
    """The layers of a model split into ``num_stages`` pipeline stages; this rank builds and
    runs only its own.

    Args:
        layers: modules, callables and :class:`LayerSpec` s, applied in order (each takes the
            previous one's output: a tensor or a tuple of tensors).
        num_stages: pipeline stages (the data-parallel size is the world size over it); or
        topology: a :class:`~shardtrain.pipe.ProcessTopology` with a ``pipe`` axis (and
            ``data``, ``model``: DeepSpeed's ``PipeDataParallelTopology``,
            ``PipeModelDataParallelTopology``).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage.
        seed_layers: seed torch's RNG with ``base_seed + layer index`` before building each
            layer (``seed_fn(seed)`` when given), so a layer starts the same on any split.
        partition_method: ``"parameters"`` (balance trainable parameters), ``"uniform"``
            (balance layers) or ``"type:REGEX"`` (balance layers whose class name matches).
        activation_checkpoint_interval: recompute every run of this many layers in backward
            (0: keep every activation); ``checkpointable_layers`` limits it to those classes.
        dynamic_shape: accepted; activations of any shape are sent every time.
        virtual_stages: chunks of layers per rank for the interleaved schedule (shardtrain's;
            ``pipeline.schedule: "interleaved"``): the layers are cut into
            ``num_stages * virtual_stages`` parts and stage s holds parts s, s + num_stages,
            ... (1: one contiguous run of layers per stage, DeepSpeed's).
        chunk_placement: ``"loop"`` (the parts go round the stages, as above) or ``"v"``: two
            virtual stages placed as a V, stage s holding parts s and ``2 num_stages - 1 - s``
            (the first stage holds the first and the last layers), which the ``zbv`` schedule
            runs.
    """

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None,
                 topology: Optional[ProcessTopology] = None, loss_fn: Optional[Callable] = None,
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = _checkpoint,
                 checkpointable_layers: Optional[List[str]] = None, dynamic_shape: bool = False,
                 virtual_stages: int = 1, chunk_placement: str = "loop"):
        super().__init__()
        world, rank = comm.get_world_size(), comm.get_rank()
        self._topo = _topology(num_stages, topology, world)
        self.num_stages = self._topo.get_dim("pipe")
        if self.num_stages > 1 and not comm.is_initialized():
            raise RuntimeError(
                f"PipelineModule with {self.num_stages} stages builds only this rank's stage, "
                "so it needs the process group first: call shardtrain.init_distributed() (or "
                "deepspeed.init_distributed()) before building it, under a launcher that starts "
                f"{self._topo.world_size()} ranks.")
        self.global_rank, self.world_size = rank, world
        self.stage_id = self._topo.get_coord(rank).pipe
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError("checkpointable_layers must be a list of layer class names.")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be an integer >= 0, got "
                             f"{activation_checkpoint_interval!r}.")
        self.checkpointable_layers = checkpointable_layers
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.dynamic_shape = dynamic_shape
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise ValueError("PipelineModule needs at least one layer.")
        self._num_layers = len(self._layer_specs)
        if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool) \
                or virtual_stages < 1:
            raise ValueError(f"virtual_stages must be a positive integer, got {virtual_stages!r}.")
        if virtual_stages > 1 and self.num_stages < 2:
            raise ValueError("virtual_stages > 1 interleaves chunks of layers over pipeline "
                             "stages: it needs num_stages >= 2.")
        if chunk_placement not in ("loop", "v"):
            raise ValueError(f"chunk_placement must be 'loop' or 'v', got {chunk_placement!r}.")
        if chunk_placement == "v" and virtual_stages != 2:
            raise ValueError(f"chunk_placement='v' places two chunks per stage as a V: set "
                             f"virtual_stages=2 (got {virtual_stages}).")
        self.virtual_stages, self.chunk_placement = virtual_stages, chunk_placement
        self.parts = self._partition(partition_method)
        #: this stage's runs of layers, one per virtual stage (parts s, s + P, s + 2P, ...; as
        #: a V, parts s and 2P - 1 - s)
        self.chunk_ranges = [(self.parts[self.part_of(self.stage_id, c)],
                              self.parts[self.part_of(self.stage_id, c) + 1])
                             for c in range(virtual_stages)]
        self._local_start, self._local_stop = self.chunk_ranges[0]
        self.forward_funcs: List[Callable] = []
        self.chunk_funcs: List[List[Callable]] = []
        self.fwd_map: Dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: Dict[str, List[str]] = {}
        self._build()
        self.tied_weights: List[TiedWeight] = self._tie()
        self._mpu = None  # the engine's, once it wraps this module

    # -- building ---------------------------------------------------------------------------

    def _partition(self, method: str) -> List[int]:
        if not isinstance(method, str):
            raise TypeError(f"partition_method must be a string, got {method!r}.")
        lowered = method.lower()
        parts = self.num_stages * self.virtual_stages
        if lowered == "uniform":
            return partition_uniform(self._num_layers, parts)
        if lowered == "parameters":
            return partition_balanced(self._count_layer_params(), parts)
        if lowered.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            hits = [1 if (name := _layer_name(layer)) and pattern.search(name) else 0
                    for layer in self._layer_specs]
            if not any(hits):
                raise ValueError(f"partition_method {method!r}: no layer's class name matches "
                                 f"{pattern.pattern!r}; the layers are "
                                 f"{[_layer_name(x) for x in self._layer_specs]}.")
            return partition_balanced(hits, parts)
        raise NotImplementedError(f"partition_method {method!r} is not supported; use one of "
                                  f"{', '.join(PARTITION_METHODS)}.")

    def _count_layer_params(self) -> List[int]:
        """Each layer's trainable parameter count (LayerSpecs built on the meta device: no
        memory, no initialisation)."""
        counts = []
        for layer in self._layer_specs:
            if isinstance(layer, LayerSpec):
                with torch.device("meta"):
                    layer = layer.build()
            counts.append(sum(p.numel() for p in layer.parameters() if p.requires_grad)
                          if isinstance(layer, nn.Module) else 0)
        return counts

    def _build(self) -> None:
        for start, stop in self.chunk_ranges:
            before = len(self.forward_funcs)
            self._build_range(start, stop)
            self.chunk_funcs.append(self.forward_funcs[before:])

    def _build_range(self, start: int, stop: int) -> None:
        for index in range(start, stop):
            layer = self._layer_specs[index]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + index)
            if isinstance(layer, PipelineModule):
                raise NotImplementedError("a PipelineModule inside a PipelineModule: list its "
                                          "layers in the outer one instead.")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None
                                          else partial(layer.forward_fn, module))
                continue
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
                self.fwd_map[str(index)] = len(self.forward_funcs)
            elif not callable(layer):
                raise TypeError(f"layer {index} is {type(layer).__name__}: a PipelineModule's "
                                "layers are modules, LayerSpecs or callables.")
            self.forward_funcs.append(layer)

    def _tie(self) -> List[TiedWeight]:
        """The tied weights this stage holds; on a stage that is not their owner each becomes
        a copy (a non-persistent buffer the engine keeps equal to the owner's parameter)."""
        stages_of: Dict[str, List[int]] = {}
        for index, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stage = self.stage_owner(index)
                if stage not in stages_of.setdefault(layer.key, []):
                    stages_of[layer.key].append(stage)
        for stages in stages_of.values():  # the first stage owns: its last backward is last
            stages.sort()
        #: every tie key of the model and the stages holding it (each rank knows them all)
        self.tie_stages = {key: stages for key, stages in sorted(stages_of.items())}
        ties = []
        for key in sorted(self.tied_modules.keys()):
            stages = stages_of[key]
            for attr in self.tied_weight_attrs[key]:
                module = self.tied_modules[key]
                if len(stages) > 1 and self.stage_id != stages[0]:
                    owner, name = _owner_of(module, attr)
                    weight = getattr(owner, name)
                    if not isinstance(weight, nn.Parameter):
                        raise TypeError(f"tied_weight_attr {attr!r} of {key!r} is not a "
                                        "parameter of its module.")
                    del owner._parameters[name]
                    owner.register_buffer(name, weight.detach().clone().requires_grad_(
                        weight.requires_grad), persistent=False)
                ties.append(TiedWeight(key, attr, stages, module))
        return ties

    # -- running ----------------------------------------------------------------------------

    def forward(self, forward_input: Any, chunk: int = 0) -> Any:
        """This stage's layers (of virtual stage ``chunk``) applied in order."""
        x = forward_input
        funcs, every = self.chunk_funcs[chunk], self.activation_checkpoint_interval
        if every == 0:
            return _run(funcs, x)
        for start in range(0, len(funcs), every):
            chunk = funcs[start: start + every]
            if self._is_checkpointable(chunk):
                args = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(partial(_run_args, chunk), *args)
            else:
                x = _run(chunk, x)
        return x

    def _is_checkpointable(self, funcs: Sequence[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters())
                   for f in funcs)

    # -- queries (DeepSpeed's names) --------------------------------------------------------

    def partitions(self) -> List[int]:
        """The layer boundaries: part k is layers ``parts[k]`` to ``parts[k + 1] - 1``, held by
        stage :meth:`place` ``(k)[0]`` (with one virtual stage, part s is stage s)."""
        return list(self.parts)

    def part_of(self, stage: int, chunk: int) -> int:
        """The part of the model that ``stage`` holds as its ``chunk``."""
        if self.chunk_placement == "v" and chunk == 1:
            return 2 * self.num_stages - 1 - stage
        return stage + chunk * self.num_stages

    def place(self, part: int) -> tuple:
        """``(stage, chunk)`` holding ``part`` of the model."""
        chunk, stage = divmod(part, self.num_stages)
        if self.chunk_placement == "v" and chunk == 1:
            stage = self.num_stages - 1 - stage
        return stage, chunk

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise IndexError(f"layer {layer_idx} is outside 0..{self._num_layers - 1}.")
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= layer_idx < self.parts[part + 1]:
                return self.place(part)[0]
        raise AssertionError(f"layer {layer_idx} has no stage in {self.parts}")

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self):
        """The engine's ``mpu`` (its groups, the pipeline's included), once initialized."""
        if self._mpu is None:
            raise RuntimeError("PipelineModule.mpu() is known once shardtrain.initialize() "
                               "has wrapped the module: use engine.mpu.")
        return self._mpu

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def set_checkpoint_interval(self, interval: int) -> None:
        if not isinstance(interval, int) or interval < 0:
            raise ValueError(f"the checkpoint interval must be an integer >= 0, got {interval!r}.")
        self.activation_checkpoint_interval = interval

    def get_tied_weights_and_groups(self) -> List[tuple]:
        """``(weight, ranks)`` for each tied weight this rank holds (the ranks its tie joins,
        at this rank's data- and tensor-parallel coordinate)."""
        rank, out = self.global_rank, []
        coord = self._topo.get_coord(rank)._asdict()
        for tie in self.tied_weights:
            ranks = [self._topo.get_rank(**{**coord, "pipe": s}) for s in tie.stages]
            out.append((tie.tensor, ranks))
        return out


def _run(funcs: Sequence[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _run_args(funcs: Sequence[Callable], *args: Any) -> Any:
    return _run(funcs, args[0] if len(args) == 1 else args)


def _topology(num_stages: Optional[int], topology: Optional[ProcessTopology], world: int
              ) -> ProcessTopology:
    if topology is not None:
        if not isinstance(topology, ProcessTopology) or "pipe" not in topology.get_axis_names():
            raise TypeError(f"topology must be a ProcessTopology with a 'pipe' axis (e.g. "
                            f"PipeDataParallelTopology(num_pp, num_dp)), got {topology!r}.")
        if topology.world_size() != world:
            raise ValueError(f"the topology {topology!r} has {topology.world_size()} ranks but "
                             f"the world has {world}: launch {topology.world_size()} ranks or "
                             "size the topology to the world.")
        return topology
    if num_stages is None:
        raise ValueError("PipelineModule needs num_stages or topology.")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}.")
    if world % num_stages:
        raise ValueError(f"num_stages {num_stages} does not divide the world size {world}: "
                         f"launch a multiple of {num_stages} ranks.")
    return PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)


def _layer_name(layer: Any) -> Optional[str]:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _owner_of(module: nn.Module, attr: str):
    *path, name = attr.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def _getattr_dotted(module: nn.Module, attr: str) -> torch.Tensor:
    owner, name = _owner_of(module, attr)
    return getattr(owner, name)

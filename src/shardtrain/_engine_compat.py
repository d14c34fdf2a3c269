"""DeepSpeed's engine surface beyond shardtrain's own API: one room, a mixin of
:class:`shardtrain.Engine`.

The Hugging Face Trainer, Accelerate, Lightning and DeepSpeed's example scripts ask the
engine for its settings with DeepSpeed's getters (``bfloat16_enabled()``,
``zero_optimization()``, ``get_batch_info()``...), save weights through
``_zero3_consolidated_16bit_state_dict()`` and read DeepSpeed's attributes (``mpu``,
``dp_world_size``, ``tput_timer``...). Every member here restates, under the name DeepSpeed
gives it, something the engine already has, and reads the engine through its public members
only (the architecture test checks it): without this file shardtrain still trains, and
nothing here changes how.

A mixin rather than a facade: the clients call these names on the very object
``initialize()`` returns, check it with ``isinstance(engine, DeepSpeedEngine)`` and pass it
on as the model; a second object standing for the engine would have to forward everything
else too, and two objects would answer to one engine.
"""
from __future__ import annotations

import gc
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .full_weights import full_state_dict


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: samples per second over the steps taken so far."""

    def __init__(self, engine: Any):
        self._engine = weakref.ref(engine)
        self._start = time.perf_counter()
        self._samples0 = 0

    def start(self) -> None:
        """Restarts the measurement from now."""
        engine = self._engine()
        self._start = time.perf_counter()
        self._samples0 = engine.global_samples if engine is not None else 0

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Nothing to stop: the rate is read from the engine's counters."""

    def update_epoch_count(self) -> None:
        """DeepSpeed counts epochs here; the rate does not depend on them."""

    def avg_samples_per_sec(self) -> float:
        engine = self._engine()
        if engine is None:
            return 0.0
        elapsed = time.perf_counter() - self._start
        return (engine.global_samples - self._samples0) / elapsed if elapsed > 0 else 0.0


class DeepSpeedEngineAPI:
    """DeepSpeed's engine getters and the members its client libraries call."""

    # -- settings (DeepSpeed's getter names) ----------------------------------------------------

    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled``: the module trains in bf16 with fp32 master weights."""
        return bool(self.config.bf16.enabled)

    def fp16_enabled(self) -> bool:
        """``fp16.enabled``: the module trains in fp16 with fp32 master weights."""
        return bool(self.config.fp16.enabled)

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast``."""
        return bool(self.config.fp16.auto_cast)

    def amp_enabled(self) -> bool:
        """Always False: DeepSpeed's "amp" block was removed (``torch_autocast`` replaces it)."""
        return False  # DeepSpeed's "amp" block was removed; torch_autocast replaces it

    def torch_autocast_enabled(self) -> bool:
        """``torch_autocast.enabled``."""
        return bool(self.config.torch_autocast.enabled)

    def zero_optimization(self) -> bool:
        """True at ZeRO stages 1-3."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """Gradients are sharded (ZeRO stage 2 or 3)."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Parameters are sharded (ZeRO stage 3)."""
        return self.zero_optimization_stage() == 3

    def zero_offload_optimizer(self):
        """The ``zero_optimization.offload_optimizer`` block (None when absent)."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self):
        """The ``zero_optimization.offload_param`` block (None when absent)."""
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        """Optimizer states are offloaded to host memory."""
        offload = self.config.zero_optimization.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def zero_reduce_bucket_size(self) -> int:
        """``zero_optimization.reduce_bucket_size``, in elements."""
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        """``zero_optimization.allgather_bucket_size``, in elements."""
        return int(self.config.zero_optimization.allgather_bucket_size)

    def zero_overlap_comm(self) -> bool:
        """``zero_optimization.overlap_comm``."""
        return bool(self.config.zero_optimization.overlap_comm)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save``."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    def gradient_clipping(self) -> float:
        """``gradient_clipping``: the global norm gradients are clipped to (0: off)."""
        return float(self.config.gradient_clipping)

    def dynamic_loss_scale(self) -> bool:
        """fp16 with a dynamic loss scale (``fp16.loss_scale`` is 0)."""
        return self.fp16_enabled() and self.config.fp16.loss_scale == 0

    def loss_scale(self) -> float:
        """``fp16.loss_scale`` as configured (0: dynamic); the current scale is
        :meth:`get_loss_scale`."""
        return float(self.config.fp16.loss_scale)

    def steps_per_print(self) -> Optional[int]:
        """``steps_per_print``."""
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        """``wall_clock_breakdown``."""
        return bool(self.config.wall_clock_breakdown)

    def memory_breakdown(self) -> bool:
        """``memory_breakdown``."""
        return bool(self.config.memory_breakdown)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (``communication_data_type``, or with sequence
        parallelism ``seq_parallel_communication_data_type``); a property, as DeepSpeed's."""
        return self.config.comm_dtype(self.mesh.sp.size() > 1)

    def postscale_gradients(self) -> bool:
        """True unless ``prescale_gradients``: gradients are divided after the sum."""
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        """``gradient_predivide_factor``."""
        return float(self.config.gradient_predivide_factor)

    def get_mom(self) -> List[Any]:
        """Each param group's momentum: Adam's ``betas``, else SGD's ``momentum``."""
        if self.optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in self.optimizer.param_groups]

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Changes the global batch by changing the accumulation steps (the micro-batch
        stays); the new size must be a multiple of micro-batch x data-parallel ranks."""
        unit = self.train_micro_batch_size_per_gpu() * self.mesh.dp.size()
        if train_batch_size <= 0 or train_batch_size % unit:
            raise ValueError(f"set_train_batch_size({train_batch_size}): give a positive "
                             f"multiple of train_micro_batch_size_per_gpu x data-parallel "
                             f"ranks = {unit}.")
        self.config.gradient_accumulation_steps = train_batch_size // unit
        self.config.train_batch_size = train_batch_size

    def get_batch_info(self) -> Tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def get_data_parallel_rank(self) -> int:
        """This rank in the data-parallel group."""
        return self.mesh.dp.rank()

    def get_data_parallel_world_size(self) -> int:
        """Ranks in the data-parallel group."""
        return self.mesh.dp.size()

    def get_model_parallel_world_size(self) -> int:
        """Ranks each layer is split over (tensor parallelism; 1 without it)."""
        return self.mesh.tp.size()

    def get_sequence_parallel_world_size(self) -> int:
        """Ranks each sequence is split over (Ulysses; 1 without it)."""
        return self.mesh.sp.size()

    @property
    def inside_no_sync_ctxt(self) -> bool:
        """Whether a ``no_sync()`` block is active (DeepSpeed's attribute)."""
        return self.step_state.no_sync

    @property
    def mpu(self) -> Any:
        """DeepSpeed's model-parallel unit for the engine's mesh
        (:class:`shardtrain.parallel.mpu.MeshMPU`: ``get_{model,data}_parallel_{rank,group,
        world_size}()``, the sequence-parallel ones, and with experts split over ranks
        ``get_expert_{model,data}_parallel_{group,rank,world_size}()``); None with data
        parallelism alone."""
        return self.parallelism.mpu

    @property
    def dp_world_size(self) -> int:
        """Ranks in the data-parallel group, that read different samples: the world divided
        by the tensor- and sequence-parallel sizes."""
        return self.mesh.dp.size()

    @property
    def mp_world_size(self) -> int:
        """DeepSpeed's attribute: ranks each layer is split over (tensor parallelism)."""
        return self.mesh.tp.size()

    @property
    def sequence_parallel_size(self) -> int:
        """DeepSpeed's attribute: ranks each sequence is split over (Ulysses)."""
        return self.mesh.sp.size()

    @property
    def seq_dp_world_size(self) -> int:
        """DeepSpeed's attribute: data- x sequence-parallel ranks, the group gradients are
        averaged and ZeRO shards over."""
        return self.mesh.zero.size()

    @property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput timer: samples per second since it started."""
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            timer = self.__dict__["_tput_timer"] = ThroughputTimer(self)
        return timer

    # -- saving full weights at stage 3 (the Trainer's and Accelerate's path) --------------------

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[Dict[str, torch.Tensor]]:
        """The full 16-bit (module dtype) weights on rank 0, as CPU tensors; None on the
        other ranks (DeepSpeed's documented behaviour). Every rank must call it: at stage 3
        each module's parameters are gathered in turn, copied to rank 0's host and released,
        so no rank's device holds more than one module's parameters beyond its shards."""
        return _full_weights_on_rank_0(self.module, exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                       ) -> Optional[Dict[str, torch.Tensor]]:
        """DeepSpeed's general name: the full weights on rank 0 (None elsewhere) where they
        are partitioned (stage 3, tensor parallelism, or experts split over ranks); a
        ValueError otherwise, as there."""
        if self.zero_optimization_stage() != 3 and self.mesh.tp.size() == 1 \
                and self.parallelism.experts is None:
            raise ValueError("_consolidated_16bit_state_dict() applies where weights are "
                             "partitioned (ZeRO stage 3, tensor parallelism or experts split "
                             f"over ranks); at stage {self.zero_optimization_stage()} read "
                             "engine.module.state_dict()")
        return _full_weights_on_rank_0(self.module, exclude_frozen_parameters)

    def is_deepcompile_enabled(self) -> bool:
        """Whether the config's ``compile.deepcompile`` is true (DeepSpeed's method)."""
        return bool(self.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        """Whether DeepCompile's passes run (``engine.compile()`` applied them)."""
        return self.deepcompile is not None

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """The deprecated name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """``engine.module.state_dict()`` (at stage 3 gathered, or DeepSpeed's local
        placeholders: see ``shardtrain.zero.set_state_dict_gather``)."""
        return self.module.state_dict(destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)

    def load_module_state_dict(self, state_dict, strict: bool = True):
        """``engine.module.load_state_dict()``: full weights into the shards at every stage."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def empty_partition_cache(self) -> None:
        """Releases the stage-3 parameters forward hooks keep gathered (after ``generate()``
        or evaluation); nothing at stages 0-2."""
        self.strategy.release_all()

    def dump_state(self) -> bool:
        """``dump_state``: whether :meth:`state_report` is logged at start-up (rank 0)."""
        return bool(self.config.dump_state)

    def collect_python_gc(self) -> int:
        """Runs Python's cyclic garbage collector once (with ``disable_python_gc`` it is off
        otherwise); the number of unreachable objects found."""
        return gc.collect()


def lend_state_moves(engine: Any) -> None:
    """DeepSpeed's ZeRO optimizer has ``offload_states``/``reload_states``, and OpenRLHF calls
    them on ``engine.optimizer``: the torch optimizer gets the two as attributes that call the
    engine's own (held weakly: the optimizer keeps no engine alive). An optimizer that has
    names of its own keeps them."""
    optimizer, ref = engine.optimizer, weakref.ref(engine)
    if optimizer is None:
        return

    def offload_states(include=None, device="cpu", pin_memory=True, non_blocking=False):
        _alive(ref).offload_states(include, device, pin_memory, non_blocking)

    def reload_states(non_blocking=False):
        _alive(ref).reload_states(non_blocking)

    for method in (offload_states, reload_states):
        if not hasattr(optimizer, method.__name__):
            setattr(optimizer, method.__name__, method)


def _alive(ref: "weakref.ref") -> Any:
    engine = ref()
    if engine is None:
        raise RuntimeError("optimizer.offload_states()/reload_states(): the engine this "
                           "optimizer belonged to was released; call them on a live engine.")
    return engine


def _full_weights_on_rank_0(module: torch.nn.Module, exclude_frozen: bool
                            ) -> Optional[Dict[str, torch.Tensor]]:
    """The full weights on rank 0's host, None elsewhere; every rank calls it."""
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad] \
        if exclude_frozen else []
    return full_state_dict(module, exclude=frozen, rank=0)

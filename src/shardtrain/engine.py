"""The training engine: forward, backward and step around a user's model, and its life cycle.

The engine orchestrates and never branches on device type. Where data lives and how it moves
is the ZeRO strategy's job (:class:`shardtrain.zero.strategy.StrategyProtocol` is all the
engine asks of it), numeric formats the precision policy's, and the optimizer and schedule
come from ``optim``. Its own collectives are few and named: the start-up broadcast that makes
replicas identical, the divergence check before an update (when configured), the roll call of
which ranks' losses were not finite (on a skipped step only) and the barrier after saving
full weights. DeepSpeed's names for what it has live in ``_engine_compat``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch
from torch.utils import _pytree as pytree

from . import accelerator, activation_checkpointing as checkpointing, comm
from . import checkpoint as _ckpt
from .comm import CollectiveBounds
from ._engine_compat import DeepSpeedEngineAPI, lend_state_moves
from .config import ShardConfig, situational_notes
from .data import ShardedDataLoader, is_map_dataset
from .deepcompile import DeepCompile, check_composes
from .errors import GradientsUnavailableError, StepOrderError, UnusedParametersError
from .log import log_dist, log_dist_once, logger
from .full_weights import save_full_weights
from .layout import layout_of
from .memory import STATE_KINDS, StateOffload, count_bytes
from .moe import ExpertGroups, is_moe_param, split_experts, wire_experts
from .optim import MuonWithAuxAdam, build_optimizer, build_scheduler
from .parallel import Parallelism, build_mesh, parallelize
from .precision import LossScaler, Precision, build_loss_scaler
from .state import BackwardPass, Phase, StepState, TrainingParts, TrainState, live_engines
from .telemetry import StepWatch, build_watch
from .zero.strategy import (ParamSlot, ReducedGrads, ReduceSettings, StrategyProtocol,
                            build_strategy, build_with_experts)

__all__ = ["Engine"]

OptimizerArg = Union[None, torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]]
_BACKWARD_NEEDS = ("lp_params", "lp_grads", "contiguous_grad_buffer")  # of STATE_KINDS


class Engine(DeepSpeedEngineAPI, torch.nn.Module):
    """Wraps a model for data-parallel training; built by :func:`shardtrain.initialize`.

    Example:
        >>> engine, optimizer, loader, scheduler = shardtrain.initialize(
        ...     model=model, config={"train_batch_size": 20, "optimizer": {"type": "AdamW"}})
        >>> loss = engine(x, y)       # forward under the configured precision
        >>> engine.backward(loss)     # or loss.backward(): the same gradients
        >>> engine.step()             # updates at the accumulation boundary
    """

    def __init__(self, model: torch.nn.Module, config: ShardConfig,
                 optimizer: OptimizerArg = None, model_parameters=None,
                 lr_scheduler=None, training_data=None, collate_fn=None, mpu=None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"initialize(model=...) needs a torch.nn.Module, got "
                            f"{type(model).__name__}.")
        self.module = model
        self.config = config
        self._compiled: Optional[Callable] = None
        self._deepcompile: Optional[DeepCompile] = None  # compile() with compile.deepcompile
        _apply_logging_keys(config)
        checkpointing.configure(config=config.activation_checkpointing)
        self.global_rank = comm.get_rank()
        self.local_rank = comm.get_local_rank()
        self.world_size = comm.get_world_size()
        self.device = accelerator.device()
        self.train_state = TrainState()
        self._phase = Phase.IDLE
        engine = weakref.ref(self)  # comm holds no engine alive
        self._describe_position = (lambda: engine()._position() if engine() is not None
                                   else "after the engine was released")
        comm.set_position(self._describe_position)
        comm.set_check(config.diagnostics.divergence_check)
        self._bounds = CollectiveBounds(config.diagnostics)
        self._step = StepState()  # what the step in progress has seen (state.py)
        self._offloaded = StateOffload()  # model states offload_states() moved to the host
        self._last_print = (time.perf_counter(), 0)

        self._precision = Precision.from_config(config, self.device.type)
        self._scaler: LossScaler = build_loss_scaler(config, self._precision)
        self.mesh = self._build_mesh(config, mpu)
        self._build_module()
        before = dict(self.module.named_parameters())
        self._parallel: Parallelism = parallelize(self.module, self.mesh, config)
        # mixture-of-experts layers: their expert-parallel groups (None: no layer split)
        self._experts: Optional[ExpertGroups] = wire_experts(
            self.module, self.mesh, config.expert_parallel)
        # AutoTP and AutoEP put new parameters (this rank's slices) under the old names: an
        # optimizer or parameter groups built before initialize are pointed at them
        self._replaced = {id(old): new for name, new in self.module.named_parameters()
                          for old in [before.get(name)] if old is not None and old is not new}
        if self._experts is not None:
            comm.broadcast_coalesced(split_experts(self.module), group=self._experts.replicas)
            self._parallel.experts = self._experts  # engine.mpu's expert-parallel lookups
        if self._parallel.mpu is not None:  # partition_activations and the RNG streams read it
            checkpointing.configure(mpu_=self._parallel.mpu)
        trainable = _unique([p for p in self.module.parameters() if p.requires_grad])
        if not trainable:
            log_dist("the model has no trainable parameters (requires_grad is False everywhere): "
                     "engine.backward() and engine.step() have nothing to train. Unfreeze "
                     "parameters to train; for evaluation only, this is fine.", ranks=[0],
                     level=logging.WARNING)
        self._strategy: StrategyProtocol = self._build_strategy(trainable)
        self.optimizer = self._build_optimizer(optimizer, model_parameters)
        self._replaced = {}  # by id, of objects about to be freed: not to be read again
        lend_state_moves(self)  # DeepSpeed's optimizer.offload_states()/reload_states()
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.training_dataloader = self._build_dataloader(training_data, collate_fn)
        self._watch = build_watch(self)  # monitors, timers, profilers, autotuning (telemetry)
        self._publish_optimizer_flags(overflow=False)
        live_engines.add(self, pause_gc=bool(self.config.disable_python_gc))
        # Weights loaded into the module later must reach the fp32 masters too.
        self._load_hook = self.module.register_load_state_dict_post_hook(
            lambda module, keys: self._strategy.refresh_masters())
        if self.config.dump_state and self.global_rank == 0:
            logger.info("%s", self.state_report())

    # -- construction -----------------------------------------------------------------------

    def _build_mesh(self, config: ShardConfig, mpu: Any) -> comm.Mesh:
        return build_mesh(config, mpu)

    def _build_module(self) -> None:
        self.module.to(self.device)
        with torch.no_grad():
            if self._precision.master_weights:
                # Only parameters change dtype; buffers (e.g. norm statistics) keep theirs
                # unless data_types.buffer_dtype names one.
                for p in self.module.parameters():
                    if p.is_floating_point():
                        p.data = p.data.to(self._precision.param_dtype)
            buffer_dtype = self.config.data_types.buffer_dtype
            for b in self.module.buffers() if buffer_dtype is not None else ():
                if b.is_floating_point():
                    b.data = b.data.to(buffer_dtype)
        # Replicas must start identical; rank 0's initialisation wins (split experts: within
        # the ranks holding the same ones, once their groups exist; pipeline stages: within
        # the stage, whose first rank's wins).
        split = {id(p) for p in split_experts(self.module)}
        comm.broadcast_coalesced([p for p in self.module.parameters() if id(p) not in split]
                                 + list(self.module.buffers()),
                                 group=self.mesh.stage if self.mesh.sizes["pp"] > 1 else None)

    def _build_optimizer(self, optimizer: OptimizerArg, model_parameters):
        params = self._current(list(model_parameters)) if model_parameters is not None \
            else list(self.module.parameters())
        if isinstance(optimizer, torch.optim.Optimizer):
            built = optimizer
            for group in built.param_groups:
                group["params"] = self._current(group["params"])
        elif callable(optimizer):
            built = optimizer(params)
        elif optimizer is not None:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, a callable taking the "
                            f"parameters, or None; got {type(optimizer).__name__}.")
        elif self.config.optimizer is not None:
            spec = {"type": self.config.optimizer.type, "params": self.config.optimizer.params}
            names = {id(p): n for n, p in self.module.named_parameters()}
            built = build_optimizer(spec, params, param_names=names)
        else:
            return None
        muon = {id(p) for g in built.param_groups if g.get("use_muon") for p in g["params"]}
        self._strategy.adopt(built)  # the optimizer updates this rank's (fp32) slices
        if isinstance(built, MuonWithAuxAdam):
            self._bind_muon(built, muon)
        return built

    def _current(self, params: list) -> list:
        """``params`` (parameters, or parameter groups as dicts) with the parameters AutoTP or
        AutoEP replaced by the new ones under their names."""
        if not self._replaced:
            return params
        out = []
        for item in params:
            if isinstance(item, dict) and "params" in item:
                group = list(item["params"]) if not isinstance(item["params"], torch.Tensor) \
                    else [item["params"]]
                out.append({**item, "params": [self._replaced.get(id(p), p) for p in group]})
            else:
                out.append(self._replaced.get(id(item), item))
        return out

    def _bind_muon(self, optimizer: MuonWithAuxAdam, muon: set) -> None:
        """Muon orthogonalises whole matrices: it learns which slice of each it holds (the
        same list of matrices on every rank, including those this rank holds none of)."""
        offload = self.config.zero_optimization.offload_optimizer
        if offload is not None and offload.device == "cpu":
            raise NotImplementedError(
                "Optimizer 'muon' with zero_optimization.offload_optimizer.device 'cpu' is not "
                "supported; remove offload_optimizer or use AdamW")
        slots = [s for s in self._strategy.slots() if id(s.param) in muon]
        split = [s.param for s in slots if layout_of(s.param).tp is not None]
        if split:
            raise NotImplementedError(
                f"Optimizer 'muon' with tensor parallelism: {len(split)} Muon weight(s) are split "
                "over the tensor-parallel group, and Muon needs each whole matrix; set "
                "tensor_parallel.autotp_size to 1 or use AdamW")
        if any(s.sharded for s in slots):
            optimizer.bind([(s.tensor, s.lo, s.hi, layout_of(s.param).local_shape)
                            for s in slots], self.mesh.zero)

    def _build_scheduler(self, lr_scheduler):
        if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            if not callable(lr_scheduler):
                raise TypeError(f"lr_scheduler must be a scheduler, a callable taking the "
                                f"optimizer, or None; got {type(lr_scheduler).__name__}.")
            lr_scheduler = lr_scheduler(self.optimizer)
        if lr_scheduler is None and self.config.scheduler is not None:
            if self.optimizer is None:
                raise ValueError("The config has a 'scheduler' block but no optimizer was given "
                                 "or configured: add an 'optimizer' block or pass optimizer=.")
            spec = {"type": self.config.scheduler.type, "params": self.config.scheduler.params}
            lr_scheduler = build_scheduler(spec, self.optimizer)
        return lr_scheduler

    def _build_strategy(self, trainable: List[torch.nn.Parameter]) -> StrategyProtocol:
        cfg = self.config
        # Gradients are averaged over the ranks that hold the same parameters: data- and
        # sequence-parallel ones (a tensor-parallel rank's gradient is already its slice's whole).
        averaging = ReduceSettings(self.mesh.zero.size(), cfg.gradient_allreduce_op,
                                   cfg.prescale_gradients, cfg.gradient_predivide_factor,
                                   cfg.comm_dtype(self.mesh.sp.size() > 1),
                                   cfg.data_types.grad_accum_dtype)
        masters = torch.bfloat16 if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads \
            else torch.float32
        if self._experts is not None:
            return build_with_experts(
                self.module, [p for p in trainable if not is_moe_param(p)],
                [p for p in trainable if is_moe_param(p)], cfg.zero_optimization, averaging,
                self.mesh.zero, self._experts.edp, self._experts.ep, masters,
                self.mesh.tp if self.mesh.tp.size() > 1 else None)
        return build_strategy(self.module, trainable, cfg.zero_optimization, averaging,
                              self.mesh.zero, self.mesh.tp if self.mesh.tp.size() > 1 else None,
                              masters)

    def _build_dataloader(self, training_data, collate_fn) -> Optional[ShardedDataLoader]:
        if training_data is None:
            return None
        if not is_map_dataset(training_data):
            raise TypeError(f"training_data must be a map-style dataset (with __len__ and "
                            f"__getitem__), got {type(training_data).__name__}.")
        # Ranks of one tensor- or sequence-parallel group read the same samples.
        loader = ShardedDataLoader(training_data, self.train_micro_batch_size_per_gpu(),
                                   self.mesh.dp.rank(), self.mesh.dp.size(), collate_fn,
                                   self.config.dataloader_drop_last,
                                   transform=self._parallel.batch_transform)
        if len(loader) == 0:
            raise ValueError(_no_batches(len(training_data), self.train_micro_batch_size_per_gpu(),
                                         self.mesh.dp.size()))
        return loader

    # -- forward ----------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._require_alive("forward()")
        self._require_on_device("forward()", ("lp_params",))
        with accelerator.range("shardtrain.forward"), self._in_phase(Phase.FORWARD), \
                self._watch.forward(inputs, kwargs):
            inputs, kwargs = self._prepare_inputs(inputs, kwargs)
            grad_on = torch.is_grad_enabled()
            if self._deepcompile is not None:
                self.launch_compile_passes(self.global_steps)
                if grad_on:
                    self._deepcompile.before_forward(self.optimizer)
            if grad_on:
                self._bounds.enter_step()
                self._strategy.begin_forward()
            self._log_if_not_compiled()
            with self._precision.autocast(self.device.type):
                run = self._compiled if self._compiled is not None else self.module
                outputs = run(*inputs, **kwargs)
            self._strategy.end_forward(grad_on)
            return self._hook_outputs(outputs) if grad_on else outputs

    def _log_if_not_compiled(self) -> None:
        """Says once (rank 0) that a config asking for compilation runs eagerly."""
        if self._compiled is not None:
            return
        if self.config.compile.deepcompile:  # DeepSpeed's own message, before its compile()
            log_dist_once("DeepCompile is enabled but engine.compile() has not been called; "
                          "executing without DeepCompile until compile() runs", ranks=[0])
        elif self.config.compile.enabled:
            log_dist_once("compile.enabled is true in the config but engine.compile() was "
                          "not called: the module runs eagerly. Call engine.compile() "
                          "after initialize().", ranks=[0])

    @contextlib.contextmanager
    def _in_phase(self, phase: Phase) -> Iterator[None]:
        """``phase`` for the duration of the block, when the engine was idle (a forward
        that activation checkpointing re-runs inside backward stays in BACKWARD). An
        out-of-memory error leaving the block becomes a report of where it happened."""
        if self._phase is not Phase.IDLE:
            yield
            return
        self._phase = phase
        try:
            yield
        except Exception as error:
            report = self._watch.out_of_memory(error, phase.value)  # None: not out of memory
            if report is None:
                raise
            raise report from error
        finally:
            self._phase = Phase.IDLE

    def _prepare_inputs(self, inputs, kwargs):
        def move(x):
            if isinstance(x, torch.Tensor):
                return self._precision.cast_input(x.to(self.device, non_blocking=True))
            return x
        if not kwargs and all(isinstance(x, torch.Tensor) for x in inputs):
            return tuple(move(x) for x in inputs), kwargs  # the common case, without pytree
        return pytree.tree_map(move, (inputs, kwargs))

    def _hook_outputs(self, outputs):
        """Puts a gradient hook on each output that autograd will differentiate; the outputs
        themselves are returned as they are, ordinary tensors (``loss *= s`` works).

        The first hook a backward pass reaches starts the engine's backward
        (:meth:`_on_output_grad`), so a plain ``loss.backward()`` behaves like
        ``engine.backward(loss)``. A hook registered before an in-place change of the
        tensor still fires, with the gradient of the value the model returned.
        """
        if isinstance(outputs, torch.Tensor):
            leaves = [outputs]
        else:
            leaves = pytree.tree_leaves(outputs)
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
                x.register_hook(self._on_output_grad)
        return outputs

    def _on_output_grad(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Runs when backward reaches a model output. The first output of a plain
        ``loss.backward()`` starts the engine's backward there (one autograd graph task is
        one pass); every output's gradient gets the loss scale, which ``engine.backward``
        applies to the loss itself instead (its pass has factor 1)."""
        task = torch._C._current_graph_task_id()
        running = self._step.backward
        if self._phase is Phase.BACKWARD and running is not None and running.task in (None, task):
            running.task = task  # engine.backward's pass, or another of its outputs
        else:
            self._begin_backward(task, self._scaler.scale)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        factor = self._step.backward.factor
        if factor == 1.0 or grad is None:
            return None
        return grad * factor

    # -- backward ---------------------------------------------------------------------------

    def _synchronising(self) -> bool:
        """Whether the backward starting now averages gradients across ranks."""
        return not self._step.no_sync and self.is_gradient_accumulation_boundary()

    def _begin_backward(self, task: Optional[int], factor: float,
                        loss: Optional[torch.Tensor] = None) -> None:
        """A backward pass starts: from ``engine.backward`` (``task`` None, factor 1) or at
        the first output hook of a plain ``loss.backward()``."""
        self._require_alive("backward()")
        self._require_on_device("backward()", _BACKWARD_NEEDS)
        self._phase = Phase.BACKWARD
        self._step.backward = BackwardPass(task, factor)
        self._step.backward_calls += 1
        self._watch.backward_begin(loss)
        self._strategy.begin_backward(sync=self._synchronising())

    def _end_backward(self) -> None:
        """The pass ended (after ``loss.backward()`` returned, or as autograd's callback)."""
        self._strategy.end_backward(self.gradient_accumulation_steps())
        self._watch.backward_end()
        self._step.backward = None
        self._phase = Phase.IDLE

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagates ``loss``; gradients are averaged across ranks at the boundary.

        Gradients are averaged over ranks and accumulation steps when they are reduced, so
        ``engine.backward(loss)`` and ``loss.backward()`` give identical gradients.

        Returns:
            the loss divided by ``gradient_accumulation_steps`` (detached), as DeepSpeed does.
        """
        self._require_optimizer("backward")
        self._require_on_device("backward()", _BACKWARD_NEEDS)
        if not loss.requires_grad:
            raise RuntimeError(f"engine.backward(loss): the loss does not require gradients: "
                               f"{self._why_no_grad()}")
        self._step.losses.append(loss.detach())
        gas = self.gradient_accumulation_steps()
        factor = self._scaler.scale * (1 if scale_wrt_gas else gas)
        with accelerator.range("shardtrain.backward"), self._in_phase(Phase.BACKWARD):
            self._begin_backward(None, 1.0, loss)
            try:
                (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
            except BaseException:
                self._step.backward = None
                self._phase = Phase.IDLE
                raise
            self._end_backward()
        return loss.detach() / gas if scale_wrt_gas else loss.detach()

    def _why_no_grad(self) -> str:
        if not self._strategy.params:
            return ("the model has no trainable parameters (requires_grad is False everywhere); "
                    "unfreeze the parameters to train, e.g. p.requires_grad_(True).")
        return ("it was computed without gradients (under torch.no_grad() or "
                "torch.inference_mode(), or from detached tensors); compute it from the "
                "engine's outputs with gradients enabled.")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skips gradient averaging for backward passes inside; they accumulate locally.

        Valid at ZeRO stages 0 and 1. Stage 2 refuses it: its point is that no rank keeps
        a full gradient, and accumulating locally would need exactly that.
        """
        self._require_alive("no_sync()")
        if not self._strategy.supports_no_sync:
            raise StepOrderError(
                f"engine.no_sync() is not available at ZeRO stage {self._strategy.stage}: "
                "gradients are reduce-scattered every micro-step so that no rank holds a full "
                "gradient. Use gradient_accumulation_steps instead, or ZeRO stage 0 or 1.")
        if self._step.no_sync:
            raise StepOrderError("engine.no_sync() is already active: no_sync() blocks do not "
                               "nest (DeepSpeed refuses it too); leave the outer block first.")
        self._step.no_sync = True
        try:
            yield
        finally:
            self._step.no_sync = False

    # -- step -------------------------------------------------------------------------------

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Counts a micro-step; at the accumulation boundary also updates the parameters."""
        self._require_alive("step()")
        self._require_optimizer("step")
        self._require_on_device("step()")
        if self._step.no_sync:
            raise StepOrderError("engine.step() was called inside engine.no_sync(): leave the "
                                 "no_sync() block for the last micro-batch before stepping.")
        with accelerator.range("shardtrain.step"):
            self._step.applied = False
            with self._in_phase(Phase.STEP):
                if self.is_gradient_accumulation_boundary():
                    self._require_backward()
                    self._take_model_step(lr_kwargs)
                    self._watch.after_step()  # records, timer logs, profiles (telemetry)
                    self._bounds.leave_step()
            self.train_state.micro_steps += 1

    def _require_backward(self) -> None:
        """An update needs gradients: a step without any backward since the last one would
        apply a zero-gradient update (weight decay, moment decay) and count it."""
        if self._step.backward_calls == 0 and not self._strategy.received_grads():
            raise RuntimeError(
                f"engine.step() at the accumulation boundary (micro-step {self.micro_steps}), "
                "but no backward ran since the last update: call engine.backward(loss) (or "
                "loss.backward()) for every micro-batch before engine.step(); to drop the "
                "micro-batches since the last update, call engine.zero_grad() instead.")

    def _take_model_step(self, lr_kwargs: Optional[Dict[str, Any]]) -> None:
        self._watch.step_begin()
        grads = self._reduced_grads()
        if not self.config.zero_optimization.ignore_unused_parameters:
            self._check_unused_parameters(grads.unused)
        if comm.check_mode() != "off":  # before the update: a diverged rank changes nothing
            comm.check_agreement(f"at step {self.global_steps + 1}")
        self._watch.lap("reduce")  # the gradient reduction still in flight has landed
        overflow = self._unscale_and_clip(grads)
        if overflow:
            self.train_state.skipped_steps += 1
        else:
            self._bring_back_compiled_offload()  # DeepCompile's offload_opt_states
            self.optimizer.step()
            self._strategy.after_step()  # 16-bit copies refreshed, shards all-gathered
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self._scaler.update(overflow)
        self._step.applied = not overflow
        self._publish_optimizer_flags(overflow)
        self._watch.lap("optimizer")
        self._clear_grads()
        self._advance_counters()

    def _unscale_and_clip(self, reduced: ReducedGrads) -> bool:
        """Unscales, measures the global norm, clips; returns True on inf/NaN (overflow)."""
        scale, clip, grads = self._scaler.scale, self.config.gradient_clipping, reduced.tensors
        if scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / scale)
        checks = self._precision.on_nonfinite != "apply"
        if clip <= 0 and not self._precision.overflow_by_norm:  # a finiteness check suffices
            self._step.grad_norm = None
            if not checks or self._all_finite(reduced):
                return False
            self._step.grad_norm = float("inf")
            self._report_nonfinite()
            return True
        norm = self._global_norm(reduced)
        norm_value = norm.item()  # the one host sync of the step
        reported = self.config.zero_optimization.compute_grad_norm
        self._step.grad_norm = norm_value if reported else None
        if checks and not math.isfinite(norm_value):
            self._step.grad_norm = float("inf")
            self._report_nonfinite()
            return True
        if clip > 0 and grads:
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        return False

    def _global_norm(self, reduced: ReducedGrads) -> torch.Tensor:
        """The norm of the whole model's gradient, the same on every rank."""
        return self._strategy.global_norm(reduced, self.device)

    def _all_finite(self, reduced: ReducedGrads) -> bool:
        """Whether the whole model's gradient is finite, the same answer on every rank."""
        return self._strategy.all_finite(reduced, self.device)

    def _report_nonfinite(self) -> None:
        """The gradients hold inf/NaN (the norm is global: every rank is here). Says on which
        ranks the loss given to ``engine.backward`` was not finite, then logs the skip or, with
        ``nonfinite_gradients: "error"``, raises."""
        step, where = self.global_steps + 1, self._nonfinite_losses()
        if self._precision.on_nonfinite == "error":
            raise FloatingPointError(
                f"step {step}: the gradients hold inf/NaN ({where}) and nonfinite_gradients is "
                "\"error\". Lower the learning rate, enable gradient_clipping, check the data of "
                "those ranks, or set nonfinite_gradients to \"skip\" to skip such steps.")
        if self._precision.scales_loss:  # fp16: routine while the loss scale settles
            log_dist(f"step {step}: fp16 gradients overflow at loss scale {self._scaler.scale:g} "
                     f"({where}); the step is skipped.", ranks=[0], level=logging.INFO)
            return
        log_dist(f"step {step}: the gradients hold inf/NaN ({where}); the step is skipped "
                 f"({self.skipped_steps + 1} skipped so far). Set nonfinite_gradients to "
                 "\"error\" to stop instead.", ranks=[0], level=logging.WARNING)

    def _nonfinite_losses(self) -> str:
        """Which ranks' losses were inf/NaN this step (a collective, on the skip path only)."""
        local = None
        if self._step.losses:
            local = not all(bool(torch.isfinite(x).all()) for x in self._step.losses)
        flags = comm.all_gather_object(local)
        bad = [rank for rank, flag in enumerate(flags) if flag]
        if bad:
            return f"the loss was not finite on rank(s) {bad}"
        if all(flag is False for flag in flags):
            return "the losses were finite on every rank: inf/NaN arose in backward"
        return "which rank's loss was not finite is known when every rank calls engine.backward(loss)"

    def _reduced_grads(self) -> ReducedGrads:
        """Finishes this step's gradient reduction (once) and hands the optimizer its
        averaged gradients; they stay attached until the gradients are cleared."""
        if self._step.reduced is None:
            self._step.reduced = self._strategy.optimizer_grads(self.gradient_accumulation_steps())
        return self._step.reduced

    def reduced_gradients(self, what: str = "reduced_gradients") -> List[torch.Tensor]:
        """Completes the gradient reduction of the accumulation boundary now, before
        ``step()``: the optimizer's tensors then hold their averaged gradients (still
        multiplied by the fp16 loss scale). ``step()`` uses them as they are.

        Raises:
            RuntimeError: off an accumulation boundary, or before any backward of this step.
        """
        if not self.is_gradient_accumulation_boundary() or self._step.no_sync:
            raise GradientsUnavailableError(
                f"{what}: the averaged gradients exist between the backward of an accumulation "
                f"boundary and step(); micro-step {self.micro_steps} is not a boundary (or "
                "no_sync() is active).")
        if self._step.reduced is None and self._step.backward_calls == 0:
            raise GradientsUnavailableError(f"{what}: no backward has run since the last step.")
        return self._reduced_grads().tensors

    def accumulated_gradient(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's gradient of ``param`` accumulated since the last step and not averaged
        across ranks yet (off the accumulation boundary, or inside ``no_sync()``), as
        DeepSpeed's ``param.grad`` is then: fp32, without the fp16 loss scale, divided by
        ``gradient_accumulation_steps``. None when ``param`` has got no gradient.

        Raises:
            GradientsUnavailableError: at ZeRO stages 2-3, where gradients are reduce-scattered
                every micro-step and no rank keeps a full one (DeepSpeed raises there too), or
                once this step's gradients are averaged (:meth:`reduced_gradients` has them).
        """
        if not self._strategy.supports_no_sync:
            raise GradientsUnavailableError(
                f"the gradient accumulated before the boundary is not kept at ZeRO stage "
                f"{self._strategy.stage}: each micro-step's gradients are reduce-scattered. Read "
                "gradients between the boundary's backward and step(), or use stage 0 or 1.")
        if self._step.reduced is not None:
            raise GradientsUnavailableError("this step's gradients are averaged already: "
                                            "read them with engine.reduced_gradients().")
        grad = self._strategy.accumulated_grad(param)
        if grad is None:
            return None
        factor = 1.0 / (self._scaler.scale * self.gradient_accumulation_steps())
        return grad.detach().float() * factor

    def _check_unused_parameters(self, params: List[torch.nn.Parameter]) -> None:
        """``ignore_unused_parameters: false``: every trainable parameter must have got a
        gradient on some rank this step (the same answer on every rank: it comes from the
        reduced used-flags)."""
        unused = set(map(id, params))
        if not unused:
            return
        names = [n for n, p in self.module.named_parameters() if id(p) in unused]
        raise UnusedParametersError(
            f"step {self.global_steps + 1}: the trainable parameter(s) {names} got no gradient "
            "on any rank, and zero_optimization.ignore_unused_parameters is false. Make every "
            "trainable parameter take part in the loss, freeze the unused ones "
            "(requires_grad_(False)), or set ignore_unused_parameters to true.")

    def _publish_optimizer_flags(self, overflow: bool) -> None:
        """DeepSpeed's optimizer wrappers carry ``overflow`` and the loss scale; scripts and
        libraries (Accelerate's ``step_was_skipped``, the Trainer) read them there."""
        if self.optimizer is not None:
            self.optimizer.overflow = overflow
            self.optimizer.loss_scale = self.optimizer.cur_scale = self._scaler.scale

    def _clear_grads(self) -> None:
        self._step.clear_gradients()
        self._strategy.zero_grads()

    def _advance_counters(self) -> None:
        state = self.train_state
        state.global_steps += 1
        if self.config.managed_gradient_accumulation:
            state.global_samples += self.train_batch_size()
        else:
            per_backward = self.train_batch_size() // self.gradient_accumulation_steps()
            state.global_samples += per_backward * max(self._step.backward_calls, 1)
        self._step.backward_calls = 0
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0:
            self._print_progress()

    def _print_progress(self) -> None:
        now, samples = time.perf_counter(), self.global_samples
        then, before = self._last_print
        self._last_print = (now, samples)
        rate = (samples - before) / max(now - then, 1e-9)
        lrs = ", ".join(f"{lr:.4g}" for lr in self.get_lr())
        log_dist(f"step={self.global_steps} skipped={self.skipped_steps} lr=[{lrs}] "
                 f"loss_scale={self._scaler.scale:g} samples/s={rate:.1f}", ranks=[0])

    def zero_grad(self) -> None:
        """Drops the gradients accumulated since the last step."""
        self._require_on_device("zero_grad()", ("lp_grads", "contiguous_grad_buffer"))
        self._clear_grads()

    # -- monitoring (the rest lives in telemetry/) -------------------------------------------

    def log_metrics(self, step: Optional[int] = None, **values: Any) -> None:
        """Writes ``values`` (numbers or one-element tensors) to the enabled monitors, rank 0.

        Use it for what the engine cannot see: an evaluation loss, or the training loss when
        the script calls ``loss.backward()`` instead of ``engine.backward(loss)``.

        Args:
            step: the x value in ``metrics.jsonl``; default ``global_steps``.
            values: name -> value; a name without ``/`` becomes ``Train/Samples/<name>`` in
                TensorBoard and CSV.

        Example:
            >>> engine.log_metrics(eval_loss=1.83)
        """
        self._watch.log_metrics(step, values)

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"engine.{what}() needs an optimizer: pass optimizer= to "
                               f"initialize() or add an 'optimizer' block to the config.")

    # -- counters (DeepSpeed names; they live in ``train_state``) ----------------------------

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped overflow steps included."""
        return self.train_state.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.train_state.global_steps = int(value)

    @property
    def global_samples(self) -> int:
        """Samples consumed by the steps taken, over all ranks."""
        return self.train_state.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self.train_state.global_samples = int(value)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on an fp16 overflow."""
        return self.train_state.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.train_state.skipped_steps = int(value)

    @property
    def micro_steps(self) -> int:
        """``step()`` calls so far (one per micro-batch)."""
        return self.train_state.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.train_state.micro_steps = int(value)

    # -- queries (DeepSpeed names) ----------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` updates the parameters (and the backward before it
        averages gradients across ranks)."""
        if not self.config.managed_gradient_accumulation:
            return self._phase is Phase.STEP
        if self._step.boundary_override is not None:
            return self._step.boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the boundary (sticky: set it before every backward)."""
        if not self.config.managed_gradient_accumulation:
            raise RuntimeError("set_gradient_accumulation_boundary() needs "
                               "managed_gradient_accumulation: true.")
        self._step.boundary_override = bool(is_boundary)

    def get_lr(self) -> List[float]:
        """Each param group's learning rate."""
        if self.optimizer is None:
            return []
        return [float(g.get("lr", 0.0)) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The unscaled global gradient norm before clipping at the last step (inf after an
        overflow); None before the first step or when nothing needed the norm."""
        return self._step.grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last boundary ``step()`` updated the parameters (False after an fp16
        overflow)."""
        return self._step.applied

    def get_loss_scale(self) -> float:
        """The current loss scale (1 unless fp16)."""
        return self._scaler.scale

    @property
    def loss_scaler(self) -> LossScaler:
        """The loss scaler (``state_dict``/``load_state_dict``; ``scale``)."""
        return self._scaler

    def train_batch_size(self) -> int:
        """The global batch: micro-batch x accumulation steps x ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per rank per forward."""
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self._strategy.stage

    @property
    def monitor(self) -> StepWatch:
        """What the engine reports each step to (read-only): the configured monitors,
        timers and profilers. ``monitor.summary()`` is the last loss, learning rate and
        throughput; ``monitor.close()`` flushes and closes the metric files."""
        return self._watch

    @property
    def strategy(self) -> StrategyProtocol:
        """The ZeRO strategy (read-only): where model states live and how they move. The
        engine calls the members of :class:`shardtrain.zero.strategy.StrategyProtocol`;
        ``strategy.stats()`` and ``strategy.units()`` are for diagnostics."""
        return self._strategy

    @property
    def step_state(self) -> StepState:
        """What the optimizer step in progress has seen, and how the last one ended
        (read-only: :class:`shardtrain.state.StepState`)."""
        return self._step

    @property
    def phase(self) -> Phase:
        """Where the engine is in a training step (:class:`shardtrain.state.Phase`)."""
        return self._phase

    @property
    def parallelism(self) -> Parallelism:
        """The model parallelism applied to the module (tensor, sequence): its ``mpu`` and
        the batch transform of sequence parallelism."""
        return self._parallel

    def optimizer_slots(self) -> List[ParamSlot]:
        """What this rank's optimizer holds of each trainable parameter: its slice
        ``[lo, hi)`` of the flattened parameter and the tensor the optimizer updates (see
        :class:`shardtrain.zero.strategy.ParamSlot`); checkpoints read the model states
        through these."""
        return self._strategy.slots()

    def training_parts(self) -> TrainingParts:
        """The engine's stateful parts (references): the module, optimizer, what the
        optimizer holds of each parameter, scheduler, loss scaler, data loader, counters,
        precision and config. Checkpoints save and restore the engine through these alone.

        Example:
            >>> parts = engine.training_parts()
            >>> parts.train_state.global_steps, [s.hi - s.lo for s in parts.slots]
        """
        return TrainingParts(
            module=self.module, optimizer=self.optimizer, slots=self._strategy.slots(),
            lr_scheduler=self.lr_scheduler, loss_scaler=self._scaler,
            dataloader=self.training_dataloader, train_state=self.train_state,
            precision=self._precision, config=self.config,
            zero_stage=self._strategy.stage,
            gradient_accumulation_steps=self.gradient_accumulation_steps(), device=self.device,
            mesh=self.mesh)

    def _position(self) -> str:
        """Where training is, for the message of a failed collective."""
        gas = self.gradient_accumulation_steps()
        phase = "between engine calls" if self._phase is Phase.IDLE else f"in {self._phase.value}"
        return f"step {self.global_steps + 1}, micro-step {self.micro_steps % gas + 1} of {gas}, {phase}"

    def model_state_bytes(self) -> Dict[str, int]:
        """Bytes of model states this rank holds: parameters, gradients, optimizer states
        and master weights, each distinct storage counted once."""
        held = self._strategy.held_tensors()
        params = list(self.module.parameters()) + held["params"]
        grads = [p.grad for p in params if p.grad is not None] + held["grads"]
        masters = held["master"]
        states = [v for s in (self.optimizer.state.values() if self.optimizer else [])
                  for v in s.values() if isinstance(v, torch.Tensor)]
        return count_bytes({"params": params, "grads": grads, "master": masters,
                            "optimizer": states})

    def compile(self, backend: Optional[str] = None,
                compile_kwargs: Optional[Dict[str, Any]] = None,
                schedule: Optional[List[Any]] = None) -> None:
        """Compiles the module with ``torch.compile``; forward and backward then run the
        compiled graphs. Defaults come from the config's ``compile`` block.

        At stages 0-2 the whole module is compiled: gradient reduction hooks sit on the
        parameters' gradient accumulation, outside the graphs. At stage 3 each block (the
        modules inside an ``nn.ModuleList`` or ``nn.Sequential``) is compiled on its own and
        its parameters are gathered as one unit around it, so no gather breaks a graph.

        With ``compile.deepcompile`` true (stages 1-3), DeepCompile: ZeRO's collectives go
        inside the compiled graphs (stage 3's all-gathers before first use and again in
        backward, the gradients' reduce-scatters as backward produces them), and the passes
        of ``schedule`` apply from the steps it names (:mod:`shardtrain.deepcompile`).

        Args:
            backend: ``torch.compile``'s backend (default ``compile.backend``).
            compile_kwargs: other ``torch.compile`` arguments (over ``compile.kwargs``).
            schedule: DeepCompile only: ``[(step, [passes]), ...]`` from step 0 (default:
                stage 3 ``[(0, ["z3"]), (5, ["z3", "prefetch", "selective_gather"])]``,
                stages 1-2 ``[(0, ["z1"])]``).

        Example:
            >>> engine.compile(backend="inductor", compile_kwargs={"mode": "default"})
        """
        options = {**self.config.compile.kwargs, **(compile_kwargs or {})}
        backend = backend or self.config.compile.backend
        if self.config.compile.deepcompile:
            check_composes(self.config, self.mesh, self._strategy.params)
            self._deepcompile = DeepCompile(self._strategy, self._strategy.stage, backend,
                                            options, schedule,
                                            bool(self.config.compile.offload_opt_states))
            self._compiled = self._deepcompile.forward
            return
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...) schedules DeepCompile's passes: set "
                             "compile.deepcompile true, or leave schedule out.")
        self._compiled = self._strategy.compile(self.module, backend, options)

    def launch_compile_passes(self, global_steps: int) -> None:
        """DeepCompile: applies the passes the schedule gives ``global_steps`` (the next
        forward compiles anew when they change); forward calls it. Nothing without
        DeepCompile."""
        if self._deepcompile is not None:
            self._deepcompile.launch(global_steps)

    @property
    def deepcompile(self) -> Optional[DeepCompile]:
        """DeepCompile's schedule and compiled module once ``engine.compile()`` applied it
        (``compile.deepcompile`` true), else None."""
        return self._deepcompile

    def _bring_back_compiled_offload(self) -> None:
        if self._deepcompile is not None:
            self._deepcompile.bring_back()

    @property
    def is_compiled(self) -> bool:
        """Whether ``engine.compile()`` has compiled the module."""
        return self._compiled is not None

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Writes the full module weights (in the module's dtype) to one file; call it on
        every rank, rank 0 writes. The write is atomic.

        A name ending in ``.safetensors`` writes safetensors as the weights arrive: at stage 3
        they are gathered one module at a time, so any rank's device holds at most one more
        module's parameters and rank 0's host one tensor at a time. Any other name is a
        ``torch.save`` file (loadable with ``torch.load(..., weights_only=True)``), for which
        rank 0 holds the whole state dict on the host. Experts split over ranks are written
        whole, under the unsplit model's names.

        Example:
            >>> engine.save_16bit_model("out", "model.safetensors")
        """
        frozen = [n for n, p in self.module.named_parameters() if not p.requires_grad] \
            if exclude_frozen_parameters else []
        save_full_weights(self.module, os.path.join(save_dir, save_filename), exclude=frozen)
        comm.barrier()
        return True

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine lacks come from the module, as DeepSpeed's engine does:
        ``engine.gradient_checkpointing_enable()`` reaches a Transformers model."""
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules and not name.startswith("__"):
                try:
                    return getattr(modules["module"], name)
                except AttributeError:
                    pass
            raise AttributeError(f"{type(self).__name__} (the engine) and its module "
                                 f"{type(modules.get('module')).__name__} have no attribute "
                                 f"{name!r}") from None

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        self.training = mode
        return self

    # -- life cycle and the parameters the engine trains ----------------------------------

    def destroy(self) -> None:
        """Detaches the engine from its model: gradient hooks removed, stage-3 parameters
        released, the engine leaves the registry of live engines. The process group stays
        (``shardtrain.destroy()`` ends it). A second call does nothing; any training call
        afterwards raises."""
        if self._phase is Phase.DESTROYED:
            return
        self._offloaded.reload()  # the model is left usable
        self._bring_back_compiled_offload()
        self._strategy.release_all()
        self._strategy.remove_hooks()
        self._load_hook.remove()
        live_engines.discard(self)
        checkpointing.release_mpu(self._parallel.mpu)
        comm.set_position(None, replacing=self._describe_position)
        self._phase = Phase.DESTROYED

    # -- model states off the device ----------------------------------------------------

    def offload_states(self, include: Optional[Iterable[str]] = None, device: str = "cpu",
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Moves this rank's model states to host memory until :meth:`reload_states`, to
        free the device between training phases (generation, another model's turn).

        Every tensor keeps its identity (the optimizer, its state dict and the module see the
        same objects), and :meth:`reload_states` restores the bytes exactly, so training goes
        on as if nothing moved. While states are away, a call that needs them (``forward``
        needs ``lp_params``; ``backward`` and ``zero_grad`` the gradients; ``step`` and
        checkpoints everything) raises and says to reload. A forward without gradients only
        needs ``lp_params``. On a CPU-only run the host copies share the same memory: the
        engine's storages are freed, but nothing is saved.

        Args:
            include: kinds of state, by the names of DeepSpeed's ``OffloadStateTypeEnum``
                (its members or their strings): ``optim_states`` (optimizer states),
                ``hp_params`` (fp32 masters of 16-bit parameters; none in fp32 training),
                ``lp_params`` (the module's trainable parameters; stage 3: the shards),
                ``lp_grads`` (gradients kept between micro-steps), ``contiguous_grad_buffer``
                (the flat reduction buffers). Default: all.
            device: ``"cpu"`` (host memory). ``"none"`` moves nothing, with a warning.
            pin_memory: page-locked host buffers (CUDA only; ignored elsewhere).
            non_blocking: copies that do not wait for the device.

        Example:
            >>> engine.offload_states(include=["optim_states", "hp_params", "lp_grads"])
            >>> ...                                   # generation with the device free
            >>> engine.reload_states()
        """
        self._require_alive("offload_states()")
        kinds = _state_kinds(include)
        where = str(getattr(device, "value", device)).lower()
        if where == "none":
            logger.warning("offload_states(device='none'): no device to move the states to; "
                           "nothing moved.")
            return
        if where != "cpu":
            raise ValueError(f"offload_states(device={where!r}): states move to host memory "
                             "only; use device='cpu' (OffloadDeviceEnum.cpu).")
        if self._phase is not Phase.IDLE:
            raise StepOrderError(f"engine.offload_states() during {self._phase.value}: call it "
                                 "between training steps.")
        self._bring_back_compiled_offload()  # one owner of what is on the host
        if "lp_params" in kinds:
            self._strategy.release_all()  # stage 3: nothing gathered stays on the device
        self._offloaded.offload(self._model_states(), kinds,
                                pin_memory=pin_memory and accelerator.is_cuda(),
                                non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings back every state :meth:`offload_states` moved, bit for bit.

        Example:
            >>> engine.reload_states()
        """
        self._require_alive("reload_states()")
        self._offloaded.reload(non_blocking=non_blocking)

    @property
    def offloaded_states(self) -> List[str]:
        """The kinds of model state now in host memory (:meth:`offload_states`)."""
        return sorted(self._offloaded.kinds)

    def _model_states(self) -> Dict[str, List[torch.Tensor]]:
        """This rank's model states on its device, by kind (``STATE_KINDS``)."""
        states = dict(self._strategy.model_states())
        states["optim_states"] = [v for s in (self.optimizer.state.values() if self.optimizer
                                              else []) for v in s.values()
                                  if isinstance(v, torch.Tensor)]
        return {kind: [t for t in tensors if t.device == self.device]
                for kind, tensors in states.items()}

    def _require_on_device(self, what: str, kinds: Iterable[str] = STATE_KINDS) -> None:
        away = sorted(self._offloaded.kinds.intersection(kinds))
        if away:
            raise StepOrderError(
                f"engine.{what} needs {', '.join(away)}, which engine.offload_states() moved "
                "to host memory: call engine.reload_states() first.")

    def _require_alive(self, what: str) -> None:
        if self._phase is Phase.DESTROYED:
            raise RuntimeError(f"engine.{what}: this engine was destroyed (engine.destroy()); "
                               "build a new one with shardtrain.initialize().")

    @staticmethod
    def of_parameter(param: torch.Tensor) -> Optional["Engine"]:
        """The live engine that trains ``param``, or None."""
        return live_engines.of_parameter(param)

    def optimizer_slot(self, param: torch.Tensor) -> Optional[ParamSlot]:
        """What this rank's optimizer holds of ``param`` (None if the engine does not train it)."""
        index = self.__dict__.get("_slot_index")
        if index is None:
            index = self.__dict__["_slot_index"] = {id(s.param): s for s in self.optimizer_slots()}
        return index.get(id(param))

    def parameters_changed(self, param: torch.Tensor) -> None:
        """The optimizer's fp32 copy of ``param`` was written: refresh the module's weight.

        At stages 1-3 each rank refreshes its own slice; the others follow at the next
        step's all-gather (stages 1-2) or are this rank's shard already (stage 3).
        """
        self._strategy.copy_masters_to_params()

    def state_report(self) -> str:
        """What the engine was built into, one ``name .... value`` line each: the mesh and
        world sizes, the ZeRO stage, the dtypes, the batch triple, the optimizer and scheduler,
        the parameters and this rank's model-state bytes (``dump_state`` logs it at start)."""
        params = list({id(p): p for p in self.module.parameters()}.values())
        trainable = sum(layout_of(p).local_numel for p in params if p.requires_grad)
        floats = [p.dtype for p in params if p.is_floating_point()]
        rows = {
            "world_size": self.world_size, "mesh": repr(self.mesh),
            "dp_world_size": self.mesh.dp.size(), "mp_world_size": self.mesh.tp.size(),
            "sequence_parallel_size": self.mesh.sp.size(),
            "zero_optimization.stage": self.zero_optimization_stage(),
            "param dtype": floats[0] if floats else None,
            "communication_data_type": self.config.comm_dtype(self.mesh.sp.size() > 1),
            "grad_accum_dtype": self.config.data_types.grad_accum_dtype or (floats[0] if floats else None),
            "train_batch_size": self.train_batch_size(),
            "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": self.gradient_accumulation_steps(),
            "gradient_clipping": self.config.gradient_clipping,
            "optimizer": type(self.optimizer).__name__ if self.optimizer is not None else None,
            "lr_scheduler": type(self.lr_scheduler).__name__ if self.lr_scheduler is not None else None,
            "trainable parameters": f"{trainable:,}",
            "device": self.device,
            **{f"model states: {k}": f"{v:,} B" for k, v in self.model_state_bytes().items()},
        }
        width = max(len(k) for k in rows) + 4
        return "\n".join(["Engine state:"] + [f"  {k} {'.' * (width - len(k))} {v}" for k, v in rows.items()])

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[Dict[str, Any]] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Saves the full training state to ``<save_dir>/<tag>/``; call it on every rank.

        Saved: the model, optimizer states and fp32 masters, scheduler, loss scaler, step and
        sample counters, each rank's RNG states, the data loader's position, ``client_state``
        and the config. The write is atomic: until it completes, the previous checkpoint and
        ``latest`` stay as they were. The format is described in ``docs/checkpoints.md``.

        Args:
            save_dir: the directory holding the tags (created if needed).
            tag: default ``global_step<global_steps>``.
            client_state: your own values, returned by :meth:`load_checkpoint`: JSON values
                and tensors are stored as such; other values (a trainer's whole state) are
                pickled, and loaded back with torch's restricted unpickler (a type it does
                not know is refused with its name: allow it with
                ``torch.serialization.add_safe_globals``). A value that cannot be pickled
                is refused with a TypeError, before any write.
            save_latest: point ``<save_dir>/latest`` at this tag.
            exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

        Returns:
            True.

        Example:
            >>> engine.save_checkpoint("checkpoints", client_state={"epoch": 3})
        """
        self._require_alive("save_checkpoint()")
        self._require_on_device("save_checkpoint()")
        self._bring_back_compiled_offload()
        return _ckpt.save_checkpoint(self, save_dir, tag, client_state, save_latest,
                                     exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False
                        ) -> tuple[Optional[str], Optional[Dict[str, Any]]]:
        """Loads a checkpoint saved on any world size and ZeRO stage; call it on every rank.

        Each rank reads only the slices it needs now: no conversion step is needed to change
        the number of ranks or the stage. Every file is checked; a missing or damaged file,
        or a checkpoint of another model, raises the same error on every rank, before the
        engine is changed.

        Args:
            load_dir: the ``save_dir`` of :meth:`save_checkpoint`, or a DeepSpeed checkpoint
                directory (as DeepSpeed saved it, or its universal form), converted on the
                way (:mod:`shardtrain.checkpoint._universal`).
            tag: default: the tag named by ``<load_dir>/latest`` (a DeepSpeed directory with
                the config's ``checkpoint.load_universal``: ``latest_universal``, else
                ``latest``).
            load_module_strict: refuse parameter or buffer names that only one side has.
            load_optimizer_states: also restore optimizer states, fp32 masters and the loss
                scale (otherwise masters are rebuilt from the loaded weights).
            load_lr_scheduler_states: also restore the scheduler.
            load_module_only: restore the module weights only (no counters, RNG, data
                position, optimizer or scheduler).

        Returns:
            ``(path of the loaded tag directory, client_state)``, or ``(None, None)`` with a
            warning when ``tag`` is None and there is no ``latest`` file.

        Raises:
            FileNotFoundError: the directory, the tag or one of its files is missing.
            ValueError: a file is truncated or corrupted, or the checkpoint is for another model.

        Example:
            >>> path, client_state = engine.load_checkpoint("checkpoints")
        """
        self._require_alive("load_checkpoint()")
        self._require_on_device("load_checkpoint()")
        self._bring_back_compiled_offload()
        path, client_state = _ckpt.load_universal(
            self, load_dir, tag, load_module_strict, load_optimizer_states,
            load_lr_scheduler_states, load_module_only,
            prefer_universal=self.config.checkpoint.load_universal)
        if path is not None and not self.config.zero_optimization.load_from_fp32_weights:
            # DeepSpeed's false: the fp32 masters start again from the loaded 16-bit weights
            self._strategy.refresh_masters()
        return path, client_state


def _apply_logging_keys(config: ShardConfig) -> None:
    if config.log_level:
        logger.setLevel(config.log_level)
    world, local = comm.get_world_size(), comm.get_local_world_size()
    # Once per process: TRL builds a reference model's engine beside the trained one's.
    for note in situational_notes(config, nodes=-(-world // max(local, 1))):
        log_dist_once(note, ranks=[0], level=logging.WARNING)
    if config.vocabulary_size is not None and config.vocabulary_size % 8:
        log_dist_once(f"vocabulary_size {config.vocabulary_size} is not a multiple of 8: "
                      "padding it to one makes matrix products faster on tensor cores.")


def _no_batches(samples: int, micro: int, world: int) -> str:
    if samples == 0:
        return "training_data is empty (0 samples): the loader would yield no batch; give it data."
    return (f"training_data has {samples} samples but a micro-batch takes {micro} on each of "
            f"{world} rank(s) ({micro * world} per micro-step) and dataloader_drop_last is true: "
            "the loader would yield no batch. Lower train_micro_batch_size_per_gpu, set "
            "dataloader_drop_last to false, or give more data.")


def _state_kinds(include: Optional[Iterable[Any]]) -> List[str]:
    """``offload_states``' ``include`` as kind names (enum members give their values)."""
    if include is None:
        return list(STATE_KINDS)
    if isinstance(include, str):
        include = [include]
    kinds = [str(getattr(kind, "value", kind)) for kind in include]
    unknown = [kind for kind in kinds if kind not in STATE_KINDS]
    if unknown:
        raise ValueError(f"offload_states(include=...): unknown kind(s) {unknown}; the kinds "
                         f"are {list(STATE_KINDS)} (DeepSpeed's OffloadStateTypeEnum).")
    return kinds


def _unique(params: List[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out

"""The engine of a pipeline-parallel model: ``train_batch()`` runs one step of every
micro-batch through the stages, on top of the engine's forward, backward and step.

Each rank runs its stage's list of actions (:mod:`shardtrain.pipe.schedule`): a forward
receives its input from the previous stage (the first stage reads the data iterator), runs
the stage's layers through :class:`~shardtrain.engine.Engine`'s forward (precision, ZeRO,
telemetry as for any model) and sends the output on (the last stage applies ``loss_fn``); a
backward receives the output's gradient, backpropagates through the stage and sends the
input's gradient back (with virtual stages, a rank's chunks feed each other across the
stages, or within the last stage at the turn of a V). The zero-bubble V splits a backward
into its input half (plain autograd, outside the engine's passes) and its weight half (the
engine's backward pass; :mod:`shardtrain.pipe.split_backward`). Gradients reduce over the
stage's data-parallel group at the rank's last pass (the accumulation boundary), as without
stages; the global norm adds every stage's part; tied weights reach their owner's gradient
before that reduction, and their new values go back to the other stages after the step.
Each channel's next receive is posted ahead (:mod:`shardtrain.pipe.p2p`).

The schedules run on shardtrain's own point-to-point sends rather than on
``torch.distributed.pipelining``'s stage objects: those drive backward themselves and keep no
place for the engine's gradient reduction at the accumulation boundary, for the tied weights'
gradient before it, or for the collective bounds and reports of ``shardtrain.comm``; the action
lists are the same 1F1B, GPipe and interleaved 1F1B orders, and the zero-bubble V's is a
simulation of its own (torch's ``ScheduleZBVZeroBubble`` places the chunks the same way).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional

import torch

from . import comm
from .config import ShardConfig
from .data import RepeatingLoader
from .engine import Engine
from .errors import PipelineError
from .files import write_weights
from .full_weights import full_state_dict
from .layout import layout_of
from .pipe import PipelineModule, read_settings, train_actions, eval_actions
from .pipe import PipeModelDataParallelTopology
from .pipe import split_backward
from .pipe.p2p import Posted, recv_tensors, send_tensors
from .pipe.schedule import SPLIT_BACKWARD
from .state import BackwardPass, Phase
from .zero.strategy import ReducedGrads
from .zero.values import GatheredParameters

__all__ = ["PipelineEngine"]



def _tag(chunk: int, forward: bool) -> int:
    """The point-to-point tag of what a rank's ``chunk`` receives: its input (forward) or its
    output's gradient; one order of messages per tag between two ranks."""
    return 2 + 2 * chunk + (0 if forward else 1)


class PipelineEngine(Engine):
    """The engine :func:`shardtrain.initialize` returns for a :class:`PipelineModule`.

    Example:
        >>> engine, _, _, _ = shardtrain.initialize(model=pipeline_module, config=config)
        >>> loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches
    """

    def __init__(self, model: torch.nn.Module, config: ShardConfig, **kwargs: Any):
        if not isinstance(model, PipelineModule):
            raise TypeError(f"PipelineEngine trains a PipelineModule, got {type(model).__name__}.")
        self._settings = read_settings(config.pipeline)
        if "schedule" not in config.pipeline and model.virtual_stages > 1:
            # the schedule the module's chunks are placed for (a DualPipeVModule's V)
            self._settings = dataclasses.replace(
                self._settings, schedule="zbv" if model.chunk_placement == "v" else "interleaved")
        if self._settings.schedule in SPLIT_BACKWARD and config.zero_optimization.stage == 3:
            raise NotImplementedError(
                f"pipeline.schedule {self._settings.schedule!r} with ZeRO stage 3 is not "
                "supported yet (a weight half runs apart from the backward that gathered its "
                "parameters): use ZeRO stage 0, 1 or 2, or the '1f1b', 'gpipe' or "
                "'interleaved' schedule at stage 3.")
        super().__init__(model, config, **kwargs)
        stages = self.mesh.sizes["pp"]
        self.num_stages, self.stage_id = stages, self.mesh.coordinate()["pp"]
        self.micro_batches = self.gradient_accumulation_steps()
        self._check_schedule(model)
        self._train_actions()  # the schedule's conditions, refused now rather than at a step
        #: the stage holding the model's last layers, which computes the loss
        self.loss_stage = model.place(model.num_stages * model.virtual_stages - 1)[0]
        if self._settings.activation_checkpoint_interval > 0:
            model.set_checkpoint_interval(self._settings.activation_checkpoint_interval)
        model._mpu = self.mpu
        self.prev_stage = self.mesh.rank_at(pp=self.stage_id - 1) if self.stage_id else None
        self.next_stage = self.mesh.rank_at(pp=self.stage_id + 1) \
            if self.stage_id < stages - 1 else None
        self._ties = self._wire_ties(model)
        self._action: Optional[str] = None  # what the stage is doing, for a failure's report
        self.data_iterator: Optional[Iterator] = None
        self.batch_fn = None
        self.agg_train_loss: Optional[torch.Tensor] = None
        if self.training_dataloader is not None:
            self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))

    # -- construction -----------------------------------------------------------------------

    def _build_mesh(self, config: ShardConfig, mpu: Any) -> comm.Mesh:
        module = self.module
        topo = module.topology()
        axes = topo.get_axis_names()
        if axes not in (["pipe", "data"], ["pipe", "data", "model"]):
            raise ValueError(f"a PipelineModule's topology has axes {axes}; shardtrain lays out "
                             "['pipe', 'data'] (PipeDataParallelTopology) and ['pipe', 'data', "
                             "'model'] (PipeModelDataParallelTopology).")
        if mpu is not None:
            raise ValueError("initialize(mpu=...) with a PipelineModule: its topology is the "
                             "mesh; pass mpu=None.")
        if config.sequence_parallel_size and config.sequence_parallel_size > 1:
            raise NotImplementedError("sequence_parallel_size with a PipelineModule is not "
                                      "supported yet: set it to 1.")
        stages, model_dim = topo.get_dim("pipe"), max(topo.get_dim("model"), 1)
        tp = config.tensor_parallel_size()
        if model_dim > 1 and tp > 1 and model_dim != tp:
            raise ValueError(f"the topology's model axis is {model_dim} but "
                             f"tensor_parallel.autotp_size is {tp}: make them equal.")
        tp = max(tp, model_dim)
        if self.world_size % (stages * tp):
            raise ValueError(f"world size {self.world_size} is not divisible by {stages} "
                             f"pipeline stages x tensor-parallel size {tp}.")
        dp = self.world_size // (stages * tp)
        if (model_dim, topo.get_dim("data")) != (tp, dp):  # the config's AutoTP split the stage
            module._topo = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=dp)
        return comm.init_mesh(tp=tp, pp=stages)

    def _wire_ties(self, module: PipelineModule) -> List[Dict[str, Any]]:
        """The groups of each tied weight (every rank creates every group, in key order), and
        on this rank's copies the hook that keeps their gradient for the owner."""
        sizes, ties = self.mesh.sizes, []
        for key, stages in module.tie_stages.items():
            if len(stages) < 2:
                continue
            partition = [[self.mesh.rank_at(pp=s, dp=d, sp=q, tp=t) for s in stages]
                         for d in range(sizes["dp"]) for q in range(sizes["sp"])
                         for t in range(sizes["tp"])]
            group = comm.split_groups(partition, name=f"tie:{key}")
            for tie in module.tied_weights:
                if tie.key != key:
                    continue
                tensor = tie.tensor
                owner = self.stage_id == tie.owner
                if not owner:  # a copy: the owner's values and dtype, gradients kept in fp32
                    tensor.data = tensor.data.to(self.device, self._precision.param_dtype)
                    tensor.grad_sum = torch.zeros(tensor.shape, dtype=torch.float32,
                                                  device=self.device)
                    tensor.register_post_accumulate_grad_hook(_keep_grad)
                with torch.no_grad(), GatheredParameters([tensor]):  # whole at ZeRO-3 too
                    comm.broadcast(tensor.data, 0, group=group)
                ties.append({"tie": tie, "group": group, "owner": owner})
        return ties

    # -- what DeepSpeed's pipeline engine refuses -------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise PipelineError("a pipeline engine runs its stages in engine.train_batch(data_iter) "
                            "(engine.eval_batch(data_iter) to evaluate): calling the engine on "
                            "inputs is not available in pipeline mode.")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        raise PipelineError("a pipeline engine backpropagates inside engine.train_batch(): "
                            "engine.backward() is not available in pipeline mode.")

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        raise PipelineError("a pipeline engine steps at the end of engine.train_batch(): "
                            "engine.step() is not available in pipeline mode.")

    # -- DeepSpeed's pipeline-engine names --------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this stage holds the model's last layers and computes the loss (the
        first stage too when its chunks are placed as a V)."""
        return self.stage_id == self.loss_stage

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Where the first and last stages read their micro-batches (``(inputs, labels)``)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn) -> None:
        """Applies ``fn`` to each micro-batch read from the data iterator."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Activations carry their shape with them every time: nothing to reset."""

    # -- a step -----------------------------------------------------------------------------

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """Forward and backward of ``gradient_accumulation_steps`` micro-batches through the
        stages, then the optimizer step. Returns the mean loss over the micro-batches and the
        data-parallel ranks, on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled: use eval_batch() under "
                               "torch.no_grad().")
        self._require_optimizer("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        actions = self._train_actions()
        run = _Run(self, self.micro_batches, actions)
        base = self.train_state.micro_steps
        split = self._settings.schedule in SPLIT_BACKWARD
        passes, total = 0, self.micro_batches * run.chunks
        for kind, index, *chunk in actions:
            if kind == "F":
                run.forward(index, True, *chunk)
            elif kind == "B" and split:
                run.input_backward(index, *chunk)
            else:  # a whole backward, or a split one's weight half: the engine's pass
                last = passes == total - 1
                # the accumulation boundary is this rank's last pass, and only that one
                # (with virtual stages a rank runs micro-batches x chunks of them)
                self.train_state.micro_steps = base + (self.micro_batches - 1 if last else
                                                       min(passes, self.micro_batches - 2))
                passes += 1
                if kind == "B":
                    run.backward(index, last, *chunk)
                else:
                    run.weight_backward(index, last, *chunk)
        run.finish()
        self.train_state.micro_steps = base + self.micro_batches - 1
        Engine.step(self)
        if self.was_step_applied():
            self._send_tied_weights()
        self.agg_train_loss = self._aggregate(run.losses)
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: Optional[str] = "avg",
                   bcast_loss: bool = True, num_micro_batches: Optional[int] = None) -> Any:
        """The forward of ``num_micro_batches`` (default ``gradient_accumulation_steps``)
        micro-batches without gradients; returns the mean loss (``reduce_output="avg"``) on
        every rank (``bcast_loss``), with the last stage's outputs when ``return_logits``."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None.")
        training_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        was_training = self.module.training
        self.module.eval()
        micro = num_micro_batches or self.micro_batches
        actions = eval_actions(micro, self.module.virtual_stages)
        run = _Run(self, micro, actions, compute_loss=compute_loss, keep_outputs=return_logits)
        try:
            with torch.no_grad():
                for _, index, *chunk in actions:
                    run.forward(index, False, *chunk)
                run.finish()
        finally:
            self.module.train(was_training)
            self.data_iterator = training_iterator
        if not compute_loss:
            loss = None
        elif reduce_output is None:
            loss = run.losses if self.is_last_stage() else None
        else:
            loss = self._aggregate(run.losses, broadcast=bcast_loss)
        if return_logits:
            return loss, run.outputs if self.is_last_stage() else None
        return loss

    def _check_schedule(self, model: PipelineModule) -> None:
        schedule = self._settings.schedule
        placement = "v" if schedule == "zbv" else "loop"
        if model.virtual_stages > 1 and model.chunk_placement != placement:
            raise ValueError(f"pipeline.schedule {schedule!r} runs chunks placed as "
                             f"{'a V' if placement == 'v' else 'a loop'}; the PipelineModule "
                             f"places them as chunk_placement={model.chunk_placement!r}: build "
                             f"it with chunk_placement={placement!r}.")
        if schedule in SPLIT_BACKWARD:
            why = split_backward.supported()
            if why is not None:
                raise NotImplementedError(f"pipeline.schedule {schedule!r} splits each backward "
                                          f"in two, which needs torch >= 2.5: {why}.")

    def _train_actions(self) -> list:
        return train_actions(self.stage_id, self.num_stages, self.micro_batches,
                             self._settings.schedule, self.module.virtual_stages)

    def _aggregate(self, losses: List[torch.Tensor], broadcast: bool = True) -> torch.Tensor:
        """The last stage's mean loss, averaged over its data-parallel ranks, sent to every
        stage."""
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            out = torch.stack([x.float() for x in losses]).mean()
            comm.all_reduce(out, "avg", group=self.mesh.dp)
        if broadcast and self.num_stages > 1:
            comm.broadcast(out, self.loss_stage, group=self.mesh.pp)
        return out

    def _send_tied_weights(self) -> None:
        """The owners' updated tied weights into every other stage's copy."""
        with torch.no_grad():
            for tie in self._ties:
                tensor = tie["tie"].tensor
                with GatheredParameters([tensor]):  # the owner's, whole at ZeRO-3 too
                    comm.broadcast(tensor.data, 0, group=tie["group"])

    def _owned_tied_grads(self) -> List[tuple]:
        """Before the owner's last backward: the copies' gradients summed over the stages
        holding them (a later stage's last backward runs before an earlier one's), as
        ``(tied weight, gradient)`` for that backward to add (it reads the parameter inside
        its pass, where ZeRO-3 gathers it)."""
        owned = []
        for tie in self._ties:
            if tie["owner"]:
                tensor = tie["tie"].tensor
                shape = layout_of(tensor).local_shape  # this rank's whole, at ZeRO-3 too
                total = torch.zeros(shape, dtype=torch.float32, device=self.device)
                comm.all_reduce(total, group=tie["group"])
                owned.append((tie["tie"], total))
        return owned

    def _give_tied_grads(self) -> None:
        """After a copy holder's last backward: its copies' gradients to the owner."""
        for tie in self._ties:
            if not tie["owner"]:
                grad_sum = tie["tie"].tensor.grad_sum
                comm.all_reduce(grad_sum, group=tie["group"])
                grad_sum.zero_()

    def _position(self) -> str:
        """Where training is, for the report of a failed send, receive or collective: the
        stage, the micro-batch, forward or backward, and whom it waits for."""
        if "_action" not in self.__dict__:  # while the engine is being built
            return super()._position()
        where = f"step {self.global_steps + 1}, pipeline stage {self.stage_id} of {self.num_stages}"
        return f"{where}, {self._action}" if self._action else f"{where}, {self._phase.value}"

    # -- across stages ----------------------------------------------------------------------

    def _global_norm(self, reduced: ReducedGrads) -> torch.Tensor:
        norm = super()._global_norm(reduced)
        if self.num_stages == 1:
            return norm
        squared = norm.detach().float().square().reshape(1)
        comm.all_reduce(squared, group=self.mesh.pp)
        return squared.sqrt()[0]

    def _all_finite(self, reduced: ReducedGrads) -> bool:
        finite = super()._all_finite(reduced)
        if self.num_stages == 1:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], device=self.device)
        comm.all_reduce(flag, group=self.mesh.pp)
        return flag.item() == 0.0

    # -- checkpoints ------------------------------------------------------------------------

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, **kwargs: Any):
        """As the engine's (each stage reads its layers of the unsplit model the checkpoint
        holds, saved on any pipeline size); the tied weights' copies then take the owners'
        loaded values."""
        out = super().load_checkpoint(load_dir, tag, **kwargs)
        self._send_tied_weights()
        return out

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """As the engine's, for the whole model: each stage's first rank gathers its layers
        (with its data- and tensor-parallel ranks) and sends them to rank 0, which writes one
        file of every stage's weights under the unsplit model's names (a tied weight once)."""
        if self.num_stages == 1:
            return super().save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
        frozen = [n for n, p in self.module.named_parameters() if not p.requires_grad] \
            if exclude_frozen_parameters else []
        leaders = [self.mesh.rank_at(pp=s, dp=0, sp=0, tp=0) for s in range(self.num_stages)]
        mine = full_state_dict(self.module, exclude=frozen, rank=leaders[self.stage_id])
        names = comm.all_gather_object(list(mine) if mine is not None else None)
        if self.global_rank == 0:
            state = dict(mine)
            for leader in leaders[1:]:
                for name in names[leader]:
                    state[name] = recv_tensors(leader, self.device, _SAVE_TAG)[0].cpu()
            write_weights(state, os.path.join(save_dir, save_filename))
        elif mine is not None:
            for name in names[self.global_rank]:  # one at a time: the device holds one tensor
                for work in send_tensors([mine[name].to(self.device)], 0, self.device,
                                         _SAVE_TAG):
                    work.wait()
        comm.barrier()
        return True


#: the point-to-point tag of save_16bit_model's tensors (a step's use 2 and up)
_SAVE_TAG = 1


def _keep_grad(tensor: torch.Tensor) -> None:
    """A tied copy's gradient, added in fp32 and then dropped from ``.grad``."""
    tensor.grad_sum.add_(tensor.grad.float())
    tensor.grad = None


class _Run:
    """One train_batch or eval_batch on this stage: each micro-batch's input and output
    while its backward is pending, the sends in flight, the losses."""

    def __init__(self, engine: PipelineEngine, micro_batches: int, actions: List[tuple],
                 compute_loss: bool = True, keep_outputs: bool = False):
        self.engine, self.micro = engine, micro_batches
        self.compute_loss, self.keep_outputs = compute_loss, keep_outputs
        self.module: PipelineModule = engine.module
        self.chunks = self.module.virtual_stages
        self.parts = self.module.num_stages * self.chunks
        self.inputs: Dict[tuple, List[torch.Tensor]] = {}   # (micro-batch, chunk) ->
        self.outputs_alive: Dict[tuple, Any] = {}
        self.weight_halves: Dict[tuple, split_backward.WeightGrads] = {}
        #: what a weight half accumulates into: the trainable parameters and the tied
        #: weights' copies (listed once a run, not at every input half)
        self.leaves = [t for t in (*self.module.parameters(), *self.module.buffers())
                       if t.requires_grad]
        self.labels: Dict[int, Any] = {}  # read with the inputs, when this stage is the last
        self.local: Dict[int, Deque[List[torch.Tensor]]] = {}  # by tag: what a chunk of this
        # rank sends to another chunk of it (the turn of a V)
        # Each channel (a peer and a tag) has its next receive posted ahead, from the start of
        # the run and again as soon as one is taken, while the actions expect more on it.
        self.left: Dict[tuple, int] = {}
        for kind, _, *chunk in actions:
            channel = self._channel(kind, *chunk)
            if channel is not None:
                self.left[channel] = self.left.get(channel, 0) + 1
        self.ahead = {channel: Posted(channel[0], engine.device, channel[1])
                      for channel in self.left}
        self.losses: List[torch.Tensor] = []
        self.outputs: List[Any] = []
        self.sends: List[comm.Work] = []

    def _read(self) -> Any:
        engine = self.engine
        if engine.data_iterator is None:
            raise PipelineError(
                f"stage {engine.stage_id} reads micro-batches but has no data iterator: pass "
                "train_batch(data_iter) (an iterator of (inputs, labels); RepeatingLoader "
                "restarts a loader) or training_data= to initialize().")
        batch = next(engine.data_iterator)
        if engine.batch_fn is not None:
            batch = engine.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise PipelineError(f"each micro-batch must be (inputs, labels), got "
                                f"{type(batch).__name__} of {len(batch) if hasattr(batch, '__len__') else '?'} "
                                "items.")
        return batch

    # where a chunk's input comes from and its output goes: the parts of the model before
    # and after its own (one chunk: the stages before and after; interleaved, the last
    # stage's chunk c feeds the first stage's chunk c + 1; as a V, the last stage's chunk 0
    # feeds its own chunk 1)

    def _part(self, chunk: int) -> int:
        return self.module.part_of(self.engine.stage_id, chunk)

    def _first(self, chunk: int) -> bool:
        return self._part(chunk) == 0

    def _last(self, chunk: int) -> bool:
        return self._part(chunk) == self.parts - 1

    def _before(self, chunk: int) -> tuple:
        """(global rank, stage, chunk) that feeds this rank's ``chunk``."""
        return self._holder(self._part(chunk) - 1)

    def _after(self, chunk: int) -> tuple:
        """(global rank, stage, chunk) that this rank's ``chunk`` feeds."""
        return self._holder(self._part(chunk) + 1)

    def _holder(self, part: int) -> tuple:
        stage, chunk = self.module.place(part)
        return self.engine.mesh.rank_at(pp=stage), stage, chunk

    def _send(self, tensors: List[torch.Tensor], rank: int, tag: int) -> None:
        if rank == self.engine.global_rank:
            self.local.setdefault(tag, deque()).append([t.detach() for t in tensors])
        else:
            self.sends += send_tensors(tensors, rank, self.engine.device, tag)

    def _channel(self, kind: str, chunk: int = 0) -> Optional[tuple]:
        """(peer rank, tag) an action receives on; None: it receives from no other rank."""
        if kind == "F" and not self._first(chunk):
            rank, forward = self._before(chunk)[0], True
        elif kind == "B" and not self._last(chunk):
            rank, forward = self._after(chunk)[0], False
        else:
            return None
        return None if rank == self.engine.global_rank else (rank, _tag(chunk, forward))

    def _recv(self, rank: int, tag: int) -> List[torch.Tensor]:
        if rank == self.engine.global_rank:
            return self.local[tag].popleft()
        channel = (rank, tag)
        got = recv_tensors(rank, self.engine.device, tag, self.ahead.pop(channel))
        self.left[channel] -= 1
        if self.left[channel]:
            self.ahead[channel] = Posted(rank, self.engine.device, tag)
        return got

    def _label(self, index: int, chunk: int, what: str) -> str:
        mb = f"micro-batch {index + 1} of {self.micro}"
        return (f"{mb}, chunk {chunk + 1} of {self.chunks}, {what}" if self.chunks > 1
                else f"{mb}, {what}")

    def forward(self, index: int, grad: bool, chunk: int = 0) -> None:
        engine = self.engine
        labels = None
        if self._first(chunk):
            batch = self._read()
            inputs, labels = batch[0], batch[1]
            if engine.is_last_stage() and not self._last(chunk):  # for this rank's last chunk
                self.labels[index] = labels
        else:
            rank, stage, _ = self._before(chunk)
            engine._action = self._label(index, chunk, f"forward: receiving its input from stage "
                                                        f"{stage} (rank {rank})")
            received = self._recv(rank, _tag(chunk, forward=True))
            if grad:
                for t in received:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            inputs = received[0] if len(received) == 1 else tuple(received)
            if self._last(chunk):
                labels = self.labels.pop(index) if index in self.labels else self._read()[1]
            self.inputs[index, chunk] = received
        engine._action = self._label(index, chunk, "forward")
        outputs = Engine.forward(engine, inputs, chunk=chunk) if self.chunks > 1 \
            else Engine.forward(engine, inputs)
        if self._last(chunk):
            if self.keep_outputs:
                self.outputs.append(outputs)
            if self.compute_loss:
                loss = _loss(engine.module, outputs, labels)
                self.losses.append(loss.detach())
                if grad:
                    self.outputs_alive[index, chunk] = loss
            return
        sent = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        if not all(isinstance(t, torch.Tensor) for t in sent):
            raise PipelineError(f"stage {engine.stage_id} returned "
                                f"{[type(t).__name__ for t in sent]}: a stage passes a tensor or "
                                "a tuple of tensors to the next.")
        rank, _, to_chunk = self._after(chunk)
        self._send(sent, rank, _tag(to_chunk, forward=True))
        if grad:
            self.outputs_alive[index, chunk] = sent

    def backward(self, index: int, last: bool, chunk: int = 0) -> None:
        """The whole backward of a micro-batch's chunk: one pass of the engine."""
        engine = self.engine
        tied = self._tied_before(index, chunk, last)
        produced = self.outputs_alive.pop((index, chunk))
        engine._action = self._label(index, chunk, "backward")
        if self._last(chunk) and not tied:
            Engine.backward(engine, produced)
        else:
            if self._last(chunk):  # the loss, scaled as engine.backward scales it
                engine._step.losses.append(produced.detach())
                pairs = [(produced, torch.full_like(produced, engine._scaler.scale))]
            else:
                pairs = self._output_grads(index, chunk, produced)

            def run() -> None:
                # the tied weights' added gradients are already scaled, as the copies' were
                extra = [(t.tensor * g.to(t.tensor.dtype)).sum() for t, g in tied]
                torch.autograd.backward([t for t, _ in pairs] + extra,
                                        [g for _, g in pairs] + [torch.ones_like(x)
                                                                 for x in extra])
            _engine_pass(engine, run)
        self._send_input_grads(index, chunk)
        self._tied_after(index, chunk, last)

    def input_backward(self, index: int, chunk: int) -> None:
        """The input half of a split backward: only the gradient of the chunk's input, sent
        to the chunk before; the weight half waits for :meth:`weight_backward`."""
        engine = self.engine
        produced = self.outputs_alive.pop((index, chunk))
        engine._action = self._label(index, chunk, "backward of the input")
        if self._last(chunk):
            engine._step.losses.append(produced.detach())
            pairs = [(produced, torch.full_like(produced, engine._scaler.scale))]
        else:
            pairs = self._output_grads(index, chunk, produced)
        received = [t for t in self.inputs.get((index, chunk), []) if t.is_floating_point()]
        with _outside_engine_pass(engine):
            self.weight_halves[index, chunk] = split_backward.input_grads(
                [t for t, _ in pairs], [g for _, g in pairs], received, self.leaves)
        self._send_input_grads(index, chunk)

    def weight_backward(self, index: int, last: bool, chunk: int) -> None:
        """The weight half of a split backward: the chunk's parameters' gradients, as one
        pass of the engine."""
        tied = self._tied_before(index, chunk, last)
        half = self.weight_halves.pop((index, chunk))
        self.engine._action = self._label(index, chunk, "backward of the weights")
        _engine_pass(self.engine, lambda: half.run(extra=[(t.tensor, g) for t, g in tied]))
        self._tied_after(index, chunk, last)

    def _output_grads(self, index: int, chunk: int, produced: List[torch.Tensor]) -> list:
        """(output, its gradient from the chunk after) for each output that needs one."""
        engine = self.engine
        rank, stage, _ = self._after(chunk)
        engine._action = self._label(index, chunk, f"backward: receiving its output's "
                                                   f"gradient from stage {stage} (rank {rank})")
        grads = self._recv(rank, _tag(chunk, forward=False))
        engine._action = self._label(index, chunk, "backward")
        floats = [t for t in produced if t.is_floating_point()]
        if len(grads) != len(floats) or any(g.shape != t.shape for g, t in zip(grads, floats)):
            raise PipelineError(
                f"stage {engine.stage_id}, micro-batch {index}: the next stage sent back "
                f"gradients of shapes {[tuple(g.shape) for g in grads]} for outputs of shapes "
                f"{[tuple(t.shape) for t in floats]}: the stages disagree on what flows "
                "between them (a stage must take the previous stage's outputs as they are).")
        return [(t, g.to(t.dtype)) for t, g in zip(floats, grads) if t.requires_grad]

    def _send_input_grads(self, index: int, chunk: int) -> None:
        if self._first(chunk):
            return
        received = self.inputs.pop((index, chunk))
        back = [t.grad if t.grad is not None else torch.zeros_like(t)
                for t in received if t.is_floating_point()]
        rank, _, from_chunk = self._before(chunk)
        self._send(back, rank, _tag(from_chunk, forward=False))

    def _tied_before(self, index: int, chunk: int, last: bool) -> List[tuple]:
        """At the rank's last pass: the tied weights' gradients from the stages holding
        copies, as (tied weight, gradient) for the pass to add."""
        if not last:
            return []
        self.engine._action = self._label(index, chunk, "backward: the tied weights' gradients "
                                                        "from the stages holding copies")
        return self.engine._owned_tied_grads()

    def _tied_after(self, index: int, chunk: int, last: bool) -> None:
        if last:
            self.engine._action = self._label(index, chunk, "backward: the tied weights' "
                                                            "gradients to the stage that owns them")
            self.engine._give_tied_grads()

    def finish(self) -> None:
        if self.ahead:
            raise AssertionError(f"receives posted for messages that never came: "
                                 f"{sorted(self.ahead)}")
        self.engine._action = "the last sends of the step"
        for work in self.sends:
            work.wait()
        self.sends.clear()
        self.engine._action = None


def _loss(module: PipelineModule, outputs: Any, labels: Any) -> torch.Tensor:
    if module.loss_fn is not None:
        return module.loss_fn(outputs, labels)
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs
    raise PipelineError("the last stage's output is not a loss and the PipelineModule has no "
                        "loss_fn: pass loss_fn=... (called as loss_fn(outputs, labels)).")


def _engine_pass(engine: PipelineEngine, run) -> None:
    """``run()`` (autograd from a stage's outputs, or a weight half) as one backward pass of
    the engine: its reduction at the accumulation boundary included."""
    with engine._in_phase(Phase.BACKWARD):
        engine._begin_backward(None, 1.0)
        try:
            run()
        except BaseException:
            engine._step.backward = None
            engine._phase = Phase.IDLE
            raise
        engine._end_backward()


@contextlib.contextmanager
def _outside_engine_pass(engine: PipelineEngine) -> Iterator[None]:
    """The input half of a split backward: autograd alone, as no parameter's gradient
    arrives in it; the outputs' hooks find a pass running and leave their gradients be."""
    engine._phase, engine._step.backward = Phase.BACKWARD, BackwardPass(None, 1.0)
    try:
        yield
    finally:
        engine._step.backward, engine._phase = None, Phase.IDLE

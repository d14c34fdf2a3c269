"""Pipeline parallelism: shardtrain's ``PipelineEngine`` and ``torch.distributed.pipelining``
driving the same split of the same model, side by side in one run, for four schedules
(1F1B, GPipe, interleaved 1F1B and the zero-bubble V): step time, the share of a step each stage idles against
the schedule's theoretical bubble, the bytes each rank sends per step against the analytic
volume, and the activations each stage keeps at its peak.

The model: an embedding (vocabulary V, width H), L blocks ``x + W2(gelu(W1(LayerNorm(x))))``
(W1: H -> 4H) and a head (LayerNorm, then H -> V) with the cross-entropy. For 1F1B and GPipe
it is cut into P stages with ``partition_method="type:Block"`` (the blocks shared out evenly,
the embedding on the first stage, the head and the loss on the last); for the interleaved
schedule and the zero-bubble V into 2P parts the same way (``virtual_stages=2``: L >= 2P).
Interleaved places them in a loop (``chunk_placement="loop"``, the default): stage s holds
parts s (its chunk 0) and s + P (its chunk 1), a micro-batch goes round the stages twice,
the last stage's chunk 0 sending to the first stage's chunk 1, and the loss is on stage
P - 1; shardtrain's order runs the micro-batches in groups of P, so M must be a multiple of
P. The zero-bubble V (``chunk_placement="v"``): stage s holds parts s (its chunk 0) and
2P - 1 - s (its chunk 1), so stage 0 holds the embedding and the head and computes the loss,
and stage P - 1 hands its chunk 0's output to its own chunk 1 without a send. The ranks: W
(gloo, CPU, one torch thread each; ``W / P`` data-parallel replicas). A step is M
micro-batches of B rows of T tokens per replica, then AdamW (lr 1e-3, no weight decay, no
clipping).

Eight setups run in the same processes, one step each in turn (the order rotating every
round, a barrier before every step), so drift on a shared machine hits all of them alike:

* ``shardtrain 1f1b``, ``gpipe``, ``interleaved`` and ``zbv``: ``shardtrain.initialize`` on a
  ``PipelineModule(..., seed_layers=True)`` (two chunks, in a loop for interleaved, as a V for
  zbv) with ``"pipeline": {"schedule": ...}``,
  ``engine.train_batch(iterator of M (inputs, labels))``;
* ``torch 1f1b``, ``gpipe``, ``interleaved`` and ``zbv``: the same layers built with the same
  seeds (checked equal to the engine's of the same schedule, weight for weight) in a plain
  module per part, each wrapped in ``torch.distributed.pipelining.PipelineStage`` (stage
  index = the part; two per rank for interleaved, parts s and s + P of 2P, and for zbv, parts
  s and 2P - 1 - s) and driven by ``Schedule1F1B``, ``ScheduleGPipe``,
  ``ScheduleInterleaved1F1B`` or ``ScheduleZBVZeroBubble`` (``step(x)`` on the rank holding
  the first part, ``step(target=y, losses=...)`` on the rank holding the last: one call with
  both on stage 0 in a V; the same loss function, gradients scaled by 1/M), gradients
  averaged over the replicas by ``all_reduce`` when there are several, then
  ``torch.optim.AdamW``.

Every setup starts from the same weights and reads the same batches, so their losses agree;
the first step's loss (no update yet) must agree to rounding between the two engines of a
schedule.

What is measured, per rank and per step (the first step of each setup is a warm-up, not
counted; figures are medians over the timed steps, per stage the mean over replicas):

* **step**: from the barrier to the end of the optimizer step; the table shows the slowest
  rank's. shardtrain's step also holds the loss broadcast and the gradient norm's reduction
  across stages, which torch's loop does not do.
* **span**: the pipelined part of the step, the schedule's forwards and backwards: for torch
  ``schedule.step()``; for shardtrain from entering ``train_batch`` to the end of waiting for
  its last sends (the engine's private ``_Run.finish``, wrapped in this process only).
* **busy**: time in the stage's own forward and backward compute: for shardtrain the engine's
  per-micro-batch ``_Run.forward`` (a chunk's layers, and the loss in the last part),
  ``_Run.backward`` and, for zbv, the two halves of a split backward,
  ``_Run.input_backward`` and ``_Run.weight_backward``, less the time spent inside them in
  ``recv_tensors``; for torch each stage object's ``forward_one_chunk``,
  ``backward_one_chunk`` (whole, or the input half) and ``backward_weight_one_chunk``, and the
  schedule's loss computation.
* **idle** = ``1 - busy / span``: everything in the span that is not the stage's compute:
  waiting for a neighbour (the bubble), and the bookkeeping around the compute (issuing sends,
  allocating receive buffers; for torch also splitting the batch into micro-batches, merging
  the outputs and dividing the gradients by M). Beside it, **wait**: the share of the span
  spent blocked in receives and send completions alone (shardtrain:
  ``pipeline_engine.recv_tensors`` and ``_Run.finish``; torch: ``schedules._wait_batch_p2p``).
  All of these are wall-clock times, so time a rank spends descheduled counts where it falls.
  The theoretical bubble, printed per schedule: ``(P - 1) / (M + P - 1)`` for 1F1B and GPipe
  (every stage idles ``P - 1`` of ``M + P - 1`` slots of one forward and backward, with equal
  stage times and free communication); for interleaved
  ``shardtrain.pipe.bubble_fraction(P, M, chunks=2)`` = ``(P - 1) / (2 M + P - 1)`` (the
  same ``P - 1`` slots, each half as long, as a stage runs two chunks of half the layers);
  for zbv ``shardtrain.pipe.bubble_fraction(P, M, schedule="zbv")``, the idle share of the
  simulation shardtrain's zbv order comes from (equal forward, input-backward and
  weight-backward times; torch's ZBV order is its own).
  Here the ranks share 2 cores, so a stage's compute is slower while the others compute and
  faster while they idle, and the measured idle departs from the theory.

* **bytes sent per rank per step**: shardtrain: the sizes of the tensors handed to
  ``shardtrain.comm.send`` (a ``comm.add_observer``); torch: the tensors of the ``isend``
  operations its schedules batch (``schedules._batch_p2p`` wrapped). The analytic volume, per
  micro-batch: a stage that is not the last sends its output activation ``[B, T, H]`` forward
  once, a stage that is not the first sends its input's gradient ``[B, T, H]`` back once,
  ``4 B T H`` bytes each (fp32); shardtrain's message starts with its 64-int64 header (512
  bytes) saying the dtype and shape of what follows (header and tensors travel as one
  message; a channel's first message, in the warm-up step, is announced by one more):
  ``M * (not last + not first) * (4 B T H + 512)`` bytes (torch: without the 512; its shapes
  are agreed once, on its first step). With two chunks, each part a stage holds sends its
  output forward unless it is the model's last, and its input's gradient back unless it is
  the first, when the neighbouring part is on another rank. Interleaved (loop): chunk 0
  always sends forward (to stage s + 1's chunk 0, or from s = P - 1 to stage 0's chunk 1),
  chunk 1 unless s = P - 1 (the loss); chunk 1 always sends a gradient back (from s = 0 to
  stage P - 1's chunk 0), chunk 0 unless s = 0 (the data):
  ``M * (2 + not last + not first) * (4 B T H + 512)``. zbv sends twice the one-chunk
  volume: chunk 0's output forward and chunk 1's input gradient back unless s = P - 1 (the
  turn of the V, local), chunk 1's output forward and chunk 0's input gradient back unless
  s = 0 (the loss and the data are there): ``M * 2 * (not last + not first) * (4 B T H +
  512)``. The other collectives (the loss, the norm) are counted apart.

* **peak activation memory per stage**: the bytes one micro-batch keeps in each part of the
  model (the tensors autograd saves for backward in one forward of the part's layers, and the
  loss in the last part, counted with ``torch.autograd.graph.saved_tensors_hooks``: distinct
  storages, parameters left out; plus the part's output held until its gradient comes back
  when the next part is on another rank: the output handed to the next chunk on the same rank
  is that chunk's saved input, counted there once), summed over the (micro-batch, chunk) pairs
  alive at once on the stage, at its most. A pair is alive from its forward to its whole
  backward, or, when the backward is split (zbv), to its weight half: between the two halves
  part of what it saved is already free, so for zbv the figure is an upper bound. Counted
  while the schedule runs, on each engine (the most pairs alive and the most bytes), next to
  what the schedule's own action list implies (shardtrain's lists; torch's interleaved and
  ZBV ``pipeline_order``; 1F1B: ``min(P - s, M)`` at stage s, GPipe ``M``). This is the CPU
  stand-in: the CPU has no allocator peak to read; on CUDA one would read
  ``torch.cuda.max_memory_allocated`` over the step instead.

torch's pipelining runs on gloo and the CPU as is in torch 2.13 (shapes inferred on the first
step, then ``isend``/``irecv``), ``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble``
included. Should one of its schedules fail to build or to step here, the run reports the
error in its place instead of stopping. M must be a multiple of P (shardtrain's interleaved
order); that meets torch's conditions too (``Schedule1F1B`` wants M >= P,
``ScheduleInterleaved1F1B`` M a multiple of its rounds, ``max(1, M // P)``).

    python benchmarks/bench_pipe.py                     # 4 ranks, 4 stages, 8 micro-batches
    python benchmarks/bench_pipe.py --tiny              # the smoke run: 2 ranks, seconds
    python benchmarks/bench_pipe.py --world 4 --stages 2 --micro-batches 4 --json pipe.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from _ranks import run_ranks  # noqa: E402  (next to this file)

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbv")
CHUNKED = ("interleaved", "zbv")  # the schedules that run two chunks of layers per rank
SPLIT = ("zbv",)  # the schedules that split a backward into its input and weight halves
HEADER_BYTES = 64 * 8  # shardtrain's header before each message: 64 int64 words
BASE_SEED = 1234  # PipelineModule's default base_seed: layer i is built after seeding 1234 + i
DATA_SEED = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="processes (default 4)")
    p.add_argument("--stages", type=int, help="pipeline stages P (default: the world)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches M per step "
                                                                "(default 8)")
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch B (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row T (default 64)")
    p.add_argument("--hidden", type=int, default=256, help="width H (default 256)")
    p.add_argument("--layers", type=int, default=8, help="blocks L (default 8)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary V (default 512)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per setup, after one "
                                                        "warm-up (default 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--tiny", action="store_true",
                   help="2 ranks, 2 stages, a tiny model, 2 steps (smoke run)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.tiny:
        args.world, args.stages, args.micro_batches, args.batch = 2, 2, 4, 2
        args.seq, args.hidden, args.layers, args.vocab, args.steps = 8, 16, 4, 32, 2
    args.stages = args.stages or args.world
    if args.stages < 2 or args.world % args.stages:
        p.error(f"--stages must be at least 2 and divide --world {args.world}")
    if args.layers < 2 * args.stages:
        p.error(f"--layers {args.layers}: interleaved and zbv cut the blocks into "
                f"2 x {args.stages} parts (two chunks a stage), one block at least each: give "
                f"--layers {2 * args.stages} or more")
    if args.micro_batches % args.stages:
        p.error(f"--micro-batches {args.micro_batches}: shardtrain's interleaved schedule runs "
                f"the micro-batches in groups of the {args.stages} stages: give a multiple of "
                f"{args.stages}")
    return args


# -- the model ---------------------------------------------------------------------------------

class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, ids):
        return self.embed(ids)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(args) -> List[Any]:
    from shardtrain.pipe import LayerSpec
    return ([LayerSpec(Embed, args.vocab, args.hidden)]
            + [LayerSpec(Block, args.hidden) for _ in range(args.layers)]
            + [LayerSpec(Head, args.hidden, args.vocab)])


class StageLayers(nn.Module):
    """A stage's layers for torch's pipelining: built as ``PipelineModule(seed_layers=True)``
    builds them (seed ``1234 + i`` before layer i) and named by their global index, so the
    weights and their names are the engine's."""

    def __init__(self, specs: List[Any], start: int, stop: int):
        super().__init__()
        self.order: List[str] = []
        for index in range(start, stop):
            torch.manual_seed(BASE_SEED + index)
            self.add_module(str(index), specs[index].build())
            self.order.append(str(index))

    def forward(self, x):
        for name in self.order:
            x = getattr(self, name)(x)
        return x


def saved_bytes_per_micro_batch(module: nn.Module, args, first: bool, last: bool,
                                holds_output: bool) -> int:
    """The bytes one micro-batch keeps alive in this part of the model until its backward:
    what autograd saves in one forward (distinct storages, parameters left out; the loss's
    in the last part), plus the output held until its gradient arrives (``holds_output``)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq)
    x = torch.randint(0, args.vocab, shape, generator=g) if first else \
        torch.randn(*shape, args.hidden, generator=g).requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
        if last:
            out = lm_loss(out, torch.randint(0, args.vocab, shape, generator=g))
    if holds_output:
        seen[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(seen.values())


def part_saved_bytes(args, parts: List[int], part: int, mine: List[int]) -> int:
    """:func:`saved_bytes_per_micro_batch` of ``part`` of the model cut at ``parts``, on the
    rank holding the parts ``mine``. An output handed to the next part on the same rank (the
    turn of a V) is that part's input, which its first LayerNorm saves: counted there once."""
    total = len(parts) - 1
    module = StageLayers(layer_specs(args), parts[part], parts[part + 1])
    return saved_bytes_per_micro_batch(module, args, first=part == 0, last=part == total - 1,
                                       holds_output=part + 1 < total and part + 1 not in mine)


def planned_peak(actions: List[tuple], chunk_bytes: List[int]) -> List[int]:
    """``[most chunk activations alive at once, most bytes alive at once]`` in a list of
    ``(kind, micro-batch, chunk)``: "F" a forward (+1), "B" a whole backward (-1), "I" a
    backward's input half (activations kept for the weight half), "W" its weight half (-1)."""
    alive = [0] * len(chunk_bytes)
    peak = [0, 0]
    for kind, _, chunk in actions:
        alive[chunk] += {"F": 1, "B": -1, "I": 0, "W": -1}[kind]
        peak = [max(peak[0], sum(alive)),
                max(peak[1], sum(n * b for n, b in zip(alive, chunk_bytes)))]
    return peak


def batches(args, replicas: int) -> List[List[List[tuple]]]:
    """``[step][replica][micro-batch] -> (ids, labels)``, the same on every rank and setup."""
    g = torch.Generator().manual_seed(DATA_SEED)
    shape = (args.batch, args.seq)
    return [[[(torch.randint(0, args.vocab, shape, generator=g),
               torch.randint(0, args.vocab, shape, generator=g))
              for _ in range(args.micro_batches)] for _ in range(replicas)]
            for _ in range(args.steps + 1)]


# -- measuring inside the ranks ----------------------------------------------------------------

class Probe:
    """The figures of the step being run (``rec``; None between steps), filled by the wrappers
    :meth:`install` puts around the engines' functions in this process."""

    def __init__(self):
        self.rec: Optional[Dict[str, Any]] = None
        self.chunk_bytes: List[int] = []

    def start(self, chunk_bytes: List[int]) -> Dict[str, Any]:
        """A step's record; ``chunk_bytes``: what one micro-batch keeps alive in each of this
        rank's chunks of layers (one chunk but with interleaved and zbv)."""
        self.chunk_bytes = chunk_bytes
        self.rec = {"busy": 0.0, "wait": 0.0, "alive": [0] * len(chunk_bytes), "in_flight": 0,
                    "peak_bytes": 0, "sent": 0, "other": 0, "span_end": 0.0}
        return self.rec

    def add(self, key: str, value: float) -> None:
        if self.rec is not None:
            self.rec[key] += value

    def alive(self, change: int, chunk: int) -> None:
        """``change`` to the micro-batches whose activations ``chunk`` keeps; the peaks of
        their count and of their bytes, over the rank's chunks together."""
        rec = self.rec
        if rec is None or not change:
            return
        rec["alive"][chunk] += change
        rec["in_flight"] = max(rec["in_flight"], sum(rec["alive"]))
        held = sum(n * b for n, b in zip(rec["alive"], self.chunk_bytes))
        rec["peak_bytes"] = max(rec["peak_bytes"], held)

    def observe(self, op: str, tensor: torch.Tensor, group) -> None:
        """shardtrain's comm observer: bytes handed to sends, and to every other collective
        over two ranks or more (receives are the other side of a send: not counted)."""
        if self.rec is None or op == "recv" or (group is not None and group.size() == 1):
            return
        self.rec["sent" if op == "send" else "other"] += tensor.numel() * tensor.element_size()

    def _timed_wait(self, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add("wait", time.perf_counter() - start)
        return wrapper

    def _timed_compute(self, fn, effect: Callable[[Dict[str, Any]], tuple]):
        """``fn`` counted as compute, less the waits inside it; ``effect(its arguments by
        name)`` gives ``(change, chunk)``: the change to the micro-batches alive in that chunk
        (+1 a training forward, -1 a whole backward or a weight half, 0 an input half)."""
        signature = inspect.signature(fn)

        def wrapper(*a, **k):
            rec = self.rec
            waited = rec["wait"] if rec is not None else 0.0
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if rec is not None:
                    rec["busy"] += time.perf_counter() - start - (rec["wait"] - waited)
                    bound = signature.bind(*a, **k)
                    bound.apply_defaults()
                    self.alive(*effect(bound.arguments))
        return wrapper

    def install(self) -> None:
        """Wraps, in this process only, shardtrain's point-to-point receive and per-micro-batch
        actions and torch's pipelining waits and sends (see the module docstring)."""
        from shardtrain import comm, pipeline_engine
        import torch.distributed.pipelining.schedules as torch_schedules
        comm.add_observer(self.observe, with_group=True)
        pipeline_engine.recv_tensors = self._timed_wait(pipeline_engine.recv_tensors)
        run = pipeline_engine._Run
        run.forward = self._timed_compute(run.forward, lambda a: (int(a["grad"]), a["chunk"]))
        run.backward = self._timed_compute(run.backward, lambda a: (-1, a["chunk"]))
        run.input_backward = self._timed_compute(run.input_backward, lambda a: (0, a["chunk"]))
        run.weight_backward = self._timed_compute(run.weight_backward,
                                                  lambda a: (-1, a["chunk"]))
        finish = run.finish

        def finished(run_self):
            start = time.perf_counter()
            try:
                return finish(run_self)
            finally:
                self.add("wait", time.perf_counter() - start)
                if self.rec is not None:
                    self.rec["span_end"] = time.perf_counter()
        run.finish = finished
        torch_schedules._wait_batch_p2p = self._timed_wait(torch_schedules._wait_batch_p2p)
        batch_p2p = torch_schedules._batch_p2p

        def counted(ops, *a, **k):
            import torch.distributed as dist
            for op in ops:
                if op.op is dist.isend:
                    self.add("sent", op.tensor.numel() * op.tensor.element_size())
            return batch_p2p(ops, *a, **k)
        torch_schedules._batch_p2p = counted

    def wrap_torch_stage(self, stage, chunk: int) -> None:
        """torch's per-micro-batch compute of one stage object (``chunk`` of this rank): its
        forward, its backward (whole, or the input half) and its weight half."""
        stage.forward_one_chunk = self._timed_compute(stage.forward_one_chunk,
                                                      lambda a: (1, chunk))
        stage.backward_one_chunk = self._timed_compute(
            stage.backward_one_chunk, lambda a: (-1 if a["full_backward"] else 0, chunk))
        stage.backward_weight_one_chunk = self._timed_compute(stage.backward_weight_one_chunk,
                                                              lambda a: (-1, chunk))

    def wrap_torch_loss(self, schedule) -> None:
        """torch's loss, computed by the schedule after the last stage's forward."""
        schedule._maybe_compute_loss = self._timed_compute(schedule._maybe_compute_loss,
                                                           lambda a: (0, 0))


# -- the setups --------------------------------------------------------------------------------

class ShardtrainSetup:
    def __init__(self, args, schedule: str, probe: Probe):
        import shardtrain
        from shardtrain.pipe import PipelineModule
        self.name, self.engine_name, self.schedule = f"shardtrain {schedule}", "shardtrain", schedule
        self.probe = probe
        chunks = 2 if schedule in CHUNKED else 1
        module = PipelineModule(layer_specs(args), num_stages=args.stages, loss_fn=lm_loss,
                                seed_layers=True, base_seed=BASE_SEED,
                                partition_method="type:Block", virtual_stages=chunks,
                                chunk_placement="v" if schedule == "zbv" else "loop")
        config = {"train_micro_batch_size_per_gpu": args.batch,
                  "gradient_accumulation_steps": args.micro_batches,
                  "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0,
                                                            "eps": 1e-8}},
                  "pipeline": {"schedule": schedule}}
        self.engine, *_ = shardtrain.initialize(model=module, config=config)
        self.parts = module.partitions()
        self.stage_id = self.engine.stage_id
        #: the parts of the model this rank holds, in the order of its chunks
        self.part_ids = [module.part_of(self.stage_id, c) for c in range(chunks)]
        self.replica = self.engine.mesh.coordinate()["dp"]
        self.chunk_bytes: List[int] = []

    def actions(self) -> List[tuple]:
        """This rank's action list as ``(kind, micro-batch, chunk)`` (see :func:`planned_peak`)."""
        from shardtrain.pipe import train_actions
        split = self.schedule in SPLIT
        listed = train_actions(self.stage_id, self.engine.num_stages, self.engine.micro_batches,
                               self.schedule, chunks=len(self.part_ids))
        return [("I" if kind == "B" and split else kind, i, *(chunk or [0]))
                for kind, i, *chunk in listed]

    def step(self, data) -> float:
        rec = self.probe.rec
        start = time.perf_counter()
        loss = float(self.engine.train_batch(iter(data[self.replica])))
        end = time.perf_counter()
        rec["span"] = rec["span_end"] - start
        rec["step"] = end - start
        return loss

    def close(self) -> None:
        self.engine.destroy()


class TorchSetup:
    """torch's pipelining on the split of ``twin`` (the shardtrain setup of the same
    schedule): one ``PipelineStage`` per part this rank holds (two for interleaved and zbv)."""

    def __init__(self, args, schedule: str, probe: Probe, layout: Dict[str, Any],
                 twin: ShardtrainSetup):
        import torch.distributed as dist
        from torch.distributed import pipelining
        self.name, self.engine_name, self.schedule = f"torch {schedule}", "torch", schedule
        self.probe, self.args, self.replica = probe, args, layout["replica"]
        self.dp_group, self.dp = layout["dp_group"], args.world // args.stages
        parts, total = twin.parts, len(twin.parts) - 1
        self.part_ids, self.chunk_bytes = twin.part_ids, twin.chunk_bytes
        self.first, self.last = 0 in self.part_ids, total - 1 in self.part_ids
        specs = layer_specs(args)
        self.modules = [StageLayers(specs, parts[k], parts[k + 1]) for k in self.part_ids]
        stages = [pipelining.PipelineStage(m, k, total, torch.device("cpu"),
                                           group=layout["pp_group"])
                  for m, k in zip(self.modules, self.part_ids)]
        kinds = {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe,
                 "interleaved": pipelining.ScheduleInterleaved1F1B,
                 "zbv": pipelining.ScheduleZBVZeroBubble}
        if schedule not in kinds:
            raise ValueError(f"no torch schedule for {schedule!r}: one of {', '.join(kinds)}")
        # the multi-stage schedules take the rank's stages as a list
        self.runner = kinds[schedule](stages if len(stages) > 1 else stages[0],
                                      args.micro_batches, loss_fn=lm_loss)
        for chunk, stage in enumerate(stages):
            probe.wrap_torch_stage(stage, chunk)
        probe.wrap_torch_loss(self.runner)
        self.group_rank = stages[0].group_rank
        self._twin = twin
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0,
                                           eps=1e-8)
        self._dist = dist

    def parameters(self) -> List[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def actions(self) -> List[tuple]:
        """The order torch's schedule runs on this rank, as ``(kind, micro-batch, chunk)``;
        the single-stage schedules keep no list, and run the same order as shardtrain's."""
        order = getattr(self.runner, "pipeline_order", None)
        if order is None:
            return self._twin.actions()
        compute = [a for a in order[self.group_rank]
                   if a is not None and a.computation_type.value in "FIWB"]  # no REDUCE_GRAD
        return [(a.computation_type.value, a.microbatch_index, self.part_ids.index(a.stage_index))
                for a in compute]

    def weight_diff(self) -> float:
        """The largest difference between these weights and the twin engine's."""
        same = self._twin.engine.module.state_dict()
        return max((same[k] - v).abs().max().item()
                   for m in self.modules for k, v in m.state_dict().items())

    def step(self, data) -> float:
        rec = self.probe.rec
        mine = data[self.replica]
        start = time.perf_counter()
        losses: List[torch.Tensor] = []
        inputs = (torch.cat([x for x, _ in mine]),) if self.first else ()
        targets = {"target": torch.cat([y for _, y in mine]), "losses": losses} \
            if self.last else {}
        self.runner.step(*inputs, **targets)
        rec["span"] = time.perf_counter() - start
        if self.dp > 1:
            for p in self.parameters():
                self._dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(self.dp)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        rec["step"] = time.perf_counter() - start
        return float(torch.stack([x.detach() for x in losses]).mean()) if losses else float("nan")

    def close(self) -> None:
        pass


def _torch_layout(args, mesh) -> Dict[str, Any]:
    """torch's groups on shardtrain's rank layout: each replica's stages in order (its pipeline
    group) and each stage's replicas (for the gradient average). Every rank creates every
    group, in the same order."""
    import torch.distributed as dist
    dp = args.world // args.stages
    coord = mesh.coordinate()
    out = {"stage": coord["pp"], "replica": coord["dp"], "pp_group": None, "dp_group": None}
    if dp == 1:
        return out
    for d in range(dp):
        group = dist.new_group([mesh.rank_at(pp=s, dp=d) for s in range(args.stages)])
        if d == coord["dp"]:
            out["pp_group"] = group
    for s in range(args.stages):
        group = dist.new_group([mesh.rank_at(pp=s, dp=d) for d in range(dp)])
        if s == coord["pp"]:
            out["dp_group"] = group
    return out


def _agreed(ok: bool, error: str) -> Optional[str]:
    """None when every rank succeeded, else the first error any rank saw."""
    from shardtrain import comm
    seen = comm.all_gather_object(None if ok else error)
    return next((e for e in seen if e), None)


def _worker(rank, world, port, args, queue):
    torch.set_num_threads(args.threads)
    import shardtrain
    import torch.distributed as dist
    shardtrain.init_distributed()
    probe = Probe()
    probe.install()
    ours = {s: ShardtrainSetup(args, s, probe) for s in SCHEDULES}
    for setup in ours.values():
        setup.chunk_bytes = [part_saved_bytes(args, setup.parts, k, setup.part_ids)
                             for k in setup.part_ids]
    setups: List[Any] = list(ours.values())
    layout = _torch_layout(args, setups[0].engine.mesh)
    errors: Dict[str, str] = {}
    for schedule in SCHEDULES:
        error = ""
        try:
            setups.append(TorchSetup(args, schedule, probe, layout, ours[schedule]))
        except Exception as exc:  # reported, not fatal: see the module docstring
            error = f"{type(exc).__name__}: {exc}"
        failed = _agreed(not error, error)
        if failed:
            errors[f"torch {schedule}"] = failed
            if not error:
                setups.pop()
    weight_diff = max((s.weight_diff() for s in setups if isinstance(s, TorchSetup)),
                      default=0.0)
    data = batches(args, world // args.stages)
    records: Dict[str, List[Dict[str, Any]]] = {s.name: [] for s in setups}
    losses: Dict[str, List[float]] = {s.name: [] for s in setups}
    for step in range(args.steps + 1):
        order = setups[step % len(setups):] + setups[:step % len(setups)]
        for setup in order:
            if setup.name in errors:
                continue
            dist.barrier()
            rec = probe.start(setup.chunk_bytes)
            error = ""
            try:
                losses[setup.name].append(setup.step(data[step]))
            except Exception as exc:  # a torch schedule that cannot step here: reported
                if isinstance(setup, ShardtrainSetup):
                    raise
                error = f"{type(exc).__name__}: {exc}"
            probe.rec = None
            failed = _agreed(not error, error) if isinstance(setup, TorchSetup) else None
            if failed:
                errors[setup.name] = failed
            elif step > 0:
                rec.pop("span_end")
                rec.pop("alive")
                records[setup.name].append(rec)
    mine = {"rank": rank, "stage": layout["stage"], "replica": layout["replica"],
            "records": records, "losses": losses, "weight_diff": weight_diff,
            "parts": {s.name: s.parts for s in ours.values()},
            "chunk_bytes": {s.name: s.chunk_bytes for s in setups},
            "planned": {s.name: planned_peak(s.actions(), s.chunk_bytes) for s in setups}}
    everyone = shardtrain.comm.all_gather_object(mine)
    if rank == 0:
        queue.put({"ranks": everyone, "errors": errors})
    for setup in setups:
        setup.close()
    shardtrain.destroy()


# -- the report --------------------------------------------------------------------------------

def theory_bubble(stages: int, micro: int, schedule: str = "1f1b") -> float:
    """The share of a step each stage idles with equal stage times and free sends."""
    from shardtrain.pipe import bubble_fraction
    if schedule == "zbv":
        return bubble_fraction(stages, micro, schedule="zbv")
    if schedule == "interleaved":
        return bubble_fraction(stages, micro, chunks=2)
    return (stages - 1) / (micro + stages - 1)


def held_parts(stage: int, stages: int, schedule: str) -> List[int]:
    """The parts of the model ``stage`` holds, chunk by chunk: one part, or of 2P parts
    ``s`` and ``s + P`` (interleaved, in a loop) or ``s`` and ``2P - 1 - s`` (zbv, a V)."""
    if schedule == "interleaved":
        return [stage, stage + stages]
    if schedule == "zbv":
        return [stage, 2 * stages - 1 - stage]
    return [stage]


def loss_stage(stages: int, schedule: str) -> int:
    """The stage holding the model's last part, where the loss is computed."""
    last = stages * len(held_parts(0, stages, schedule)) - 1
    return next(t for t in range(stages) if last in held_parts(t, stages, schedule))


def analytic_sent(args, stage: int, schedule: str, header: bool) -> int:
    """Bytes a rank of ``stage`` sends per step (see the module docstring): per micro-batch,
    each part it holds sends its output forward unless it is the model's last part, and its
    input's gradient back unless it is the first, each time the neighbouring part is on
    another rank (the turn of a V stays on the rank)."""
    mine = held_parts(stage, args.stages, schedule)
    total = len(mine) * args.stages
    per_micro = sum((k + 1 < total and k + 1 not in mine) + (k > 0 and k - 1 not in mine)
                    for k in mine)
    return args.micro_batches * per_micro * (4 * args.batch * args.seq * args.hidden
                                             + (HEADER_BYTES if header else 0))


def _stage_figures(ranks: List[Dict[str, Any]], name: str, stages: int) -> Dict[str, list]:
    """Per stage, over its replicas' timed steps: the medians of the shares and times, the
    largest byte counts and peaks."""
    out: Dict[str, List[Any]] = {k: [] for k in ("idle", "wait", "busy_s", "span_s", "sent",
                                                  "other", "in_flight", "peak_activation_bytes",
                                                  "schedule_in_flight", "schedule_peak_bytes",
                                                  "saved_bytes_per_chunk")}
    for s in range(stages):
        at = [r for r in ranks if r["stage"] == s]
        steps = [rec for r in at for rec in r["records"][name]]
        out["idle"].append(statistics.median(1 - x["busy"] / x["span"] for x in steps))
        out["wait"].append(statistics.median(x["wait"] / x["span"] for x in steps))
        out["busy_s"].append(statistics.median(x["busy"] for x in steps))
        out["span_s"].append(statistics.median(x["span"] for x in steps))
        for key, field in (("sent", "sent"), ("other", "other"), ("in_flight", "in_flight"),
                           ("peak_activation_bytes", "peak_bytes")):
            out[key].append(max(x[field] for x in steps))
        out["schedule_in_flight"].append(max(r["planned"][name][0] for r in at))
        out["schedule_peak_bytes"].append(max(r["planned"][name][1] for r in at))
        out["saved_bytes_per_chunk"].append(at[0]["chunk_bytes"][name])
    return out


def summarize(args, result: Dict[str, Any]) -> Dict[str, Any]:
    """Per setup and per stage, from every rank's records."""
    ranks, errors = result["ranks"], result["errors"]
    stages = args.stages
    rows = []
    for name in ranks[0]["records"]:
        if name in errors:
            continue
        engine, schedule = name.split()
        slowest = [max(r["records"][name][i]["step"] for r in ranks)
                   for i in range(len(ranks[0]["records"][name]))]
        # torch's loss is on the stage holding the model's last part: stage 0 in a V
        loss_ranks = [r for r in ranks if r["stage"] == loss_stage(stages, schedule)]
        losses = [statistics.fmean(r["losses"][name][i] for r in loss_ranks)
                  for i in range(len(loss_ranks[0]["losses"][name]))]
        rows.append({
            "engine": engine, "schedule": schedule, "step_s": statistics.median(slowest),
            "step_times_s": slowest, "losses": losses,
            "theory_bubble": theory_bubble(stages, args.micro_batches, schedule),
            **_stage_figures(ranks, name, stages),
            "analytic_sent": [analytic_sent(args, s, schedule, engine == "shardtrain")
                              for s in range(stages)]})
    ratios, first_loss = {}, {}
    for schedule in SCHEDULES:
        pair = {r["engine"]: r for r in rows if r["schedule"] == schedule}
        if len(pair) == 2:
            ratios[schedule] = pair["shardtrain"]["step_s"] / pair["torch"]["step_s"]
            first_loss[schedule] = {
                "shardtrain": pair["shardtrain"]["losses"][0],
                "torch": pair["torch"]["losses"][0],
                "diff": abs(pair["shardtrain"]["losses"][0] - pair["torch"]["losses"][0]),
                "max_diff_all_steps": max(abs(a - b) for a, b in zip(
                    pair["shardtrain"]["losses"], pair["torch"]["losses"]))}
    return {"world": args.world, "stages": stages, "dp": args.world // stages,
            "micro_batches": args.micro_batches, "batch": args.batch, "seq": args.seq,
            "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
            "steps": args.steps, "parts": ranks[0]["parts"], "torch": torch.__version__,
            "theory_bubble": theory_bubble(stages, args.micro_batches),
            "rows": rows, "ratios": ratios, "first_step_loss": first_loss, "errors": errors,
            "weight_diff": max(r["weight_diff"] for r in ranks)}


def report(s: Dict[str, Any]) -> None:
    p, m = s["stages"], s["micro_batches"]
    print(f"\nmodel: embedding + {s['layers']} blocks (hidden {s['hidden']}, MLP x4) + head, "
          f"vocabulary {s['vocab']}; {p} stages x {s['dp']} replica(s) on {s['world']} ranks "
          f"(gloo, CPU); {m} micro-batches of {s['batch']} x {s['seq']} tokens; "
          f"torch {s['torch']}")
    print("layer boundaries of the parts: " + "; ".join(
        f"{name.split()[1]} {parts}" for name, parts in s["parts"].items())
        + f" (interleaved: stage s holds parts s and s + {p}; zbv: s and {2 * p - 1} - s); "
        f"torch's stage weights equal the engine's: max |diff| {s['weight_diff']:.1e}")
    for name, error in s["errors"].items():
        print(f"  {name}: did not run here: {error}")
    _report_steps(s)
    _report_idle(s)
    _report_bytes(s)
    _report_activations(s)


def _report_steps(s: Dict[str, Any]) -> None:
    print(f"\nstep time (median over {s['steps']} steps of the slowest rank)")
    print(f"  {'schedule':11} {'shardtrain ms':>13} {'torch ms':>9} {'ratio':>6}  "
          f"{'step-1 loss shardtrain':>22} {'torch':>9} {'|diff|':>8} {'max |diff| all':>14}")
    for schedule in SCHEDULES:
        pair = {r["engine"]: r for r in s["rows"] if r["schedule"] == schedule}
        ours, theirs = pair.get("shardtrain"), pair.get("torch")
        if ours is None:
            continue
        loss = s["first_step_loss"].get(schedule)
        print(f"  {schedule:11} {ours['step_s'] * 1e3:13.1f} "
              + (f"{theirs['step_s'] * 1e3:9.1f} {s['ratios'][schedule]:6.3f}  "
                 f"{loss['shardtrain']:22.6f} {loss['torch']:9.6f} {loss['diff']:8.1e} "
                 f"{loss['max_diff_all_steps']:14.1e}" if theirs else f"{'-':>9} {'-':>6}"))
    print("  ratio: shardtrain / torch; shardtrain's step also reduces the loss and the "
          "gradient norm across stages")


def _report_idle(s: Dict[str, Any]) -> None:
    p = s["stages"]
    print("\nidle share of the pipelined span per stage (1 - busy / span), wait share in "
          "brackets; theory: (P-1)/(M+P-1) for 1f1b and gpipe, (P-1)/(2M+P-1) for "
          "interleaved, the simulated zbv schedule's for zbv")
    print(f"  {'setup':22} " + " ".join(f"{'stage ' + str(i):>16}" for i in range(p))
          + f" {'theory':>7} {'span ms':>8} {'busy ms':>8}")
    for r in s["rows"]:
        cells = " ".join(f"{r['idle'][i]:8.3f} ({r['wait'][i]:.3f})" for i in range(p))
        print(f"  {r['engine'] + ' ' + r['schedule']:22} {cells} {r['theory_bubble']:7.3f} "
              f"{max(r['span_s']) * 1e3:8.1f} {statistics.fmean(r['busy_s']) * 1e3:8.1f}")
    print("  span: the longest stage's median; busy: the stages' mean of their median compute "
          "time per step")


def _report_bytes(s: Dict[str, Any]) -> None:
    p, kib = s["stages"], 1024
    print("\nbytes sent per rank per step, measured / analytic (KiB); shardtrain's include a "
          "512-byte header per message")
    print(f"  {'setup':22} " + " ".join(f"{'stage ' + str(i):>19}" for i in range(p))
          + "  other collectives")
    for r in s["rows"]:
        cells = " ".join(f"{r['sent'][i] / kib:9.1f} / {r['analytic_sent'][i] / kib:7.1f}"
                         for i in range(p))
        exact = "exact" if r["sent"] == r["analytic_sent"] else "DIFFERS"
        other = f"{max(r['other'])} B" if r["engine"] == "shardtrain" else "-"
        print(f"  {r['engine'] + ' ' + r['schedule']:22} {cells}  {other:>17}  ({exact})")
    print("  other collectives: the largest rank's bytes to shardtrain's other collectives "
          "(loss, norm, and with replicas the gradient reduction); torch's all-reduce of "
          "gradients over replicas is not counted")


def _report_activations(s: Dict[str, Any]) -> None:
    p, kib = s["stages"], 1024
    print("\nactivations kept per stage at the peak (CPU stand-in: the bytes saved per "
          "micro-batch in each chunk, summed over the micro-batches alive at once)")
    splits: Dict[str, List[str]] = {}  # the saved bytes of a split -> its schedules
    for r in s["rows"]:
        schedules = splits.setdefault(json.dumps(r["saved_bytes_per_chunk"]), [])
        if r["schedule"] not in schedules:
            schedules.append(r["schedule"])
    for saved, schedules in splits.items():
        print(f"  saved per micro-batch (KiB), {', '.join(schedules)}: " + ", ".join(
            f"stage {i} " + " + ".join(f"{b / kib:.1f}" for b in chunks)
            for i, chunks in enumerate(json.loads(saved))))
    print(f"  {'setup':22} " + " ".join(f"{'stage ' + str(i) + ' alive, KiB':>20}"
                                        for i in range(p)))
    for r in s["rows"]:
        cells = " ".join(f"{r['in_flight'][i]:3d} {'(' + str(r['schedule_in_flight'][i]) + ')':>4} "
                         f"{r['peak_activation_bytes'][i] / kib:11.1f}" for i in range(p))
        same = r["peak_activation_bytes"] == r["schedule_peak_bytes"]
        print(f"  {r['engine'] + ' ' + r['schedule']:22} {cells}"
              + ("" if same else "  (bytes differ from the action list's)"))
    print("  alive: the most micro-batches' chunk activations alive at once, counted while the "
          "schedule ran (in brackets: as its own action list implies); zbv keeps a chunk's "
          "activations from its forward to its weight half")


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    result = run_ranks(_worker, args.world, args, timeout=900)
    summary = summarize(args, result)
    report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

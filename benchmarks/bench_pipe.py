"""Pipeline parallelism: shardtrain's ``PipelineEngine`` and ``torch.distributed.pipelining``
driving the same split of the same model, side by side in one run: step time, the share of a
step each stage idles against the theoretical bubble, the bytes each rank sends per step
against the analytic volume, and the activations each stage keeps at its peak.

The model: an embedding (vocabulary V, width H), L blocks ``x + W2(gelu(W1(LayerNorm(x))))``
(W1: H -> 4H) and a head (LayerNorm, then H -> V) with the cross-entropy on the last stage.
It is cut into P stages with ``partition_method="type:Block"`` (the blocks shared out evenly,
the embedding on the first stage and the head on the last), on W ranks (gloo, CPU, one torch
thread each; ``W / P`` data-parallel replicas). A step is M micro-batches of B rows of T
tokens per replica, then AdamW (lr 1e-3, no weight decay, no clipping).

Four setups run in the same processes, one step each in turn (the order rotating every
round, a barrier before every step), so drift on a shared machine hits all of them alike:

* ``shardtrain 1f1b`` and ``shardtrain gpipe``: ``shardtrain.initialize`` on a
  ``PipelineModule(..., seed_layers=True)`` with ``"pipeline": {"schedule": ...}``,
  ``engine.train_batch(iterator of M (inputs, labels))``;
* ``torch 1f1b`` and ``torch gpipe``: the same layers built with the same seeds (checked equal
  to the engine's, weight for weight) in a plain module per stage, wrapped in
  ``torch.distributed.pipelining.PipelineStage`` and driven by ``Schedule1F1B`` /
  ``ScheduleGPipe`` (``step(x)`` on the first stage, ``step(target=y, losses=...)`` on the
  last, the same loss function, gradients scaled by 1/M), gradients averaged over the
  replicas by ``all_reduce`` when there are several, then ``torch.optim.AdamW``.

Every setup starts from the same weights and reads the same batches, so their losses agree;
the first step's loss (no update yet) must agree to rounding.

What is measured, per rank and per step (the first step of each setup is a warm-up, not
counted; figures are medians over the timed steps, per stage the mean over replicas):

* **step**: from the barrier to the end of the optimizer step; the table shows the slowest
  rank's. shardtrain's step also holds the loss broadcast and the gradient norm's reduction
  across stages, which torch's loop does not do.
* **span**: the pipelined part of the step, the schedule's forwards and backwards: for torch
  ``schedule.step()``; for shardtrain from entering ``train_batch`` to the end of waiting for
  its last sends (the engine's private ``_Run.finish``, wrapped in this process only).
* **busy**: time in the stage's own forward and backward compute: for shardtrain the engine's
  per-micro-batch ``_Run.forward`` (the stage's layers, and the loss on the last stage) and
  ``_Run.backward``, less the time spent inside them in ``recv_tensors``; for torch the stage's
  ``forward_one_chunk``, ``backward_one_chunk`` and the schedule's loss computation.
* **idle** = ``1 - busy / span``: everything in the span that is not the stage's compute:
  waiting for a neighbour (the bubble), and the bookkeeping around the compute (issuing sends,
  allocating receive buffers; for torch also splitting the batch into micro-batches, merging
  the outputs and dividing the gradients by M). Beside it, **wait**: the share of the span
  spent blocked in receives and send completions alone (shardtrain:
  ``pipeline_engine.recv_tensors`` and ``_Run.finish``; torch: ``schedules._wait_batch_p2p``).
  All of these are wall-clock times, so time a rank spends descheduled counts where it falls.
  The theoretical bubble of both schedules is ``(P - 1) / (M + P - 1)``: every stage idles
  ``P - 1`` of ``M + P - 1`` slots of one forward and backward, with equal stage times and free
  communication. Here the ranks share 2 cores, so a stage's compute is slower while the
  others compute and faster while they idle, and the measured idle departs from the theory.

* **bytes sent per rank per step**: shardtrain: the sizes of the tensors handed to
  ``shardtrain.comm.send`` (a ``comm.add_observer``); torch: the tensors of the ``isend``
  operations its schedules batch (``schedules._batch_p2p`` wrapped). The analytic volume, per
  micro-batch: a stage that is not the last sends its output activation ``[B, T, H]`` forward
  once, a stage that is not the first sends its input's gradient ``[B, T, H]`` back once,
  ``4 B T H`` bytes each (fp32); shardtrain adds to each message its 64-int64 header (512
  bytes) saying the dtype and shape of what follows:
  ``M * (not last + not first) * (4 B T H + 512)`` bytes (torch: without the 512; its shapes
  are agreed once, on its first step). The other collectives (the loss, the norm) are counted
  apart.

* **peak activation memory per stage**: the most micro-batches whose activations a stage
  keeps alive at once (forwards run minus backwards run, counted while the schedule runs, on
  each engine, next to the count the schedule implies: ``min(P - s, M)`` for 1F1B at stage s,
  ``M`` for GPipe) times the bytes one micro-batch keeps on that stage: the tensors autograd
  saves for backward in one forward of the stage's layers (and the loss on the last stage),
  counted with ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters
  left out), plus the stage's output held until its gradient comes back (not the last stage).
  This is the CPU stand-in: the CPU has no allocator peak to read; on CUDA one would read
  ``torch.cuda.max_memory_allocated`` over the step instead.

torch's pipelining runs on gloo and the CPU as is in torch 2.13 (shapes inferred on the first
step, then ``isend``/``irecv``). Should one of its schedules fail to build or to step here, the
run reports the error in its place instead of stopping (``Schedule1F1B`` wants M >= P).

    python benchmarks/bench_pipe.py                     # 4 ranks, 4 stages, 8 micro-batches
    python benchmarks/bench_pipe.py --tiny              # the smoke run: 2 ranks, seconds
    python benchmarks/bench_pipe.py --world 4 --stages 2 --micro-batches 4 --json pipe.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from _ranks import run_ranks  # noqa: E402  (next to this file)

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "gpipe")
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
        args.seq, args.hidden, args.layers, args.vocab, args.steps = 8, 16, 2, 32, 2
    args.stages = args.stages or args.world
    if args.stages < 2 or args.world % args.stages:
        p.error(f"--stages must be at least 2 and divide --world {args.world}")
    if args.layers < args.stages:
        p.error(f"--layers {args.layers} gives a stage no block with {args.stages} stages")
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


def saved_bytes_per_micro_batch(module: nn.Module, first: bool, last: bool, args) -> int:
    """The bytes one micro-batch keeps alive on this stage until its backward: what autograd
    saves in one forward (distinct storages, parameters left out; the loss's on the last
    stage), plus the output the stage holds until its gradient arrives (not the last)."""
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
    if not last:
        seen[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(seen.values())


def schedule_in_flight(stage: int, stages: int, micro: int, schedule: str) -> int:
    """The most micro-batches alive at once on ``stage`` in shardtrain's action list."""
    from shardtrain.pipe import train_actions
    alive = peak = 0
    for kind, _ in train_actions(stage, stages, micro, schedule):
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
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
        self.rec: Optional[Dict[str, float]] = None

    def start(self) -> Dict[str, float]:
        self.rec = {"busy": 0.0, "wait": 0.0, "alive": 0, "in_flight": 0, "sent": 0,
                    "other": 0, "span_end": 0.0}
        return self.rec

    def add(self, key: str, value: float) -> None:
        if self.rec is not None:
            self.rec[key] += value

    def alive(self, change: int) -> None:
        if self.rec is not None:
            self.rec["alive"] += change
            self.rec["in_flight"] = max(self.rec["in_flight"], self.rec["alive"])

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

    def _timed_compute(self, fn, change: int):
        """``fn`` counted as compute, less the waits inside it; ``change`` to the micro-batches
        alive (+1 a training forward, -1 a backward)."""
        def wrapper(*a, **k):
            rec = self.rec
            waited = rec["wait"] if rec is not None else 0.0
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if rec is not None:
                    rec["busy"] += time.perf_counter() - start - (rec["wait"] - waited)
                    if change > 0 and k.get("grad", True):  # not an evaluation forward
                        self.alive(1)
                    elif change < 0:
                        self.alive(-1)
        return wrapper

    def install(self) -> None:
        """Wraps, in this process only, shardtrain's point-to-point receive and per-micro-batch
        actions and torch's pipelining waits and sends (see the module docstring)."""
        from shardtrain import comm, pipeline_engine
        import torch.distributed.pipelining.schedules as torch_schedules
        comm.add_observer(self.observe, with_group=True)
        pipeline_engine.recv_tensors = self._timed_wait(pipeline_engine.recv_tensors)
        run = pipeline_engine._Run
        run.forward = self._timed_compute(run.forward, +1)
        run.backward = self._timed_compute(run.backward, -1)
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

    def wrap_torch_stage(self, stage, schedule) -> None:
        """torch's per-micro-batch compute: the stage's forward and backward of one chunk and
        the schedule's loss, on these objects only."""
        stage.forward_one_chunk = self._timed_compute(stage.forward_one_chunk, +1)
        stage.backward_one_chunk = self._timed_compute(stage.backward_one_chunk, -1)
        schedule._maybe_compute_loss = self._timed_compute(schedule._maybe_compute_loss, 0)


# -- the setups --------------------------------------------------------------------------------

class ShardtrainSetup:
    def __init__(self, args, schedule: str, probe: Probe):
        import shardtrain
        from shardtrain.pipe import PipelineModule
        self.name, self.engine_name, self.schedule = f"shardtrain {schedule}", "shardtrain", schedule
        self.probe = probe
        module = PipelineModule(layer_specs(args), num_stages=args.stages, loss_fn=lm_loss,
                                seed_layers=True, base_seed=BASE_SEED,
                                partition_method="type:Block")
        config = {"train_micro_batch_size_per_gpu": args.batch,
                  "gradient_accumulation_steps": args.micro_batches,
                  "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0,
                                                            "eps": 1e-8}},
                  "pipeline": {"schedule": schedule}}
        self.engine, *_ = shardtrain.initialize(model=module, config=config)
        self.parts = module.partitions()
        self.replica = self.engine.mesh.coordinate()["dp"]

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
    def __init__(self, args, schedule: str, probe: Probe, layout: Dict[str, Any], parts):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.name, self.engine_name, self.schedule = f"torch {schedule}", "torch", schedule
        self.probe, self.args = probe, args
        self.stage_id, self.replica = layout["stage"], layout["replica"]
        self.first, self.last = self.stage_id == 0, self.stage_id == args.stages - 1
        self.dp_group = layout["dp_group"]
        self.dp = args.world // args.stages
        self.module = StageLayers(layer_specs(args), parts[self.stage_id], parts[self.stage_id + 1])
        stage = PipelineStage(self.module, self.stage_id, args.stages, torch.device("cpu"),
                              group=layout["pp_group"])
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.runner = kind(stage, args.micro_batches, loss_fn=lm_loss)
        probe.wrap_torch_stage(stage, self.runner)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3, weight_decay=0.0,
                                           eps=1e-8)
        self._dist = dist

    def step(self, data) -> float:
        rec = self.probe.rec
        mine = data[self.replica]
        start = time.perf_counter()
        losses: List[torch.Tensor] = []
        if self.first:
            self.runner.step(torch.cat([x for x, _ in mine]))
        elif self.last:
            self.runner.step(target=torch.cat([y for _, y in mine]), losses=losses)
        else:
            self.runner.step()
        rec["span"] = time.perf_counter() - start
        if self.dp > 1:
            for p in self.module.parameters():
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
    setups = [ShardtrainSetup(args, s, probe) for s in SCHEDULES]
    mesh, parts = setups[0].engine.mesh, setups[0].parts
    layout = _torch_layout(args, mesh)
    errors: Dict[str, str] = {}
    for schedule in SCHEDULES:
        error = ""
        try:
            setups.append(TorchSetup(args, schedule, probe, layout, parts))
        except Exception as exc:  # reported, not fatal: see the module docstring
            error = f"{type(exc).__name__}: {exc}"
        failed = _agreed(not error, error)
        if failed:
            errors[f"torch {schedule}"] = failed
            if not error:
                setups.pop()
    same = setups[0].engine.module.state_dict()
    weight_diff = max((max((same[k] - v).abs().max().item() for k, v in s.module.state_dict()
                           .items()) for s in setups if isinstance(s, TorchSetup)), default=0.0)
    stage_module = StageLayers(layer_specs(args), parts[layout["stage"]],
                               parts[layout["stage"] + 1])
    saved = saved_bytes_per_micro_batch(stage_module, layout["stage"] == 0,
                                        layout["stage"] == args.stages - 1, args)
    data = batches(args, world // args.stages)
    records: Dict[str, List[Dict[str, float]]] = {s.name: [] for s in setups}
    losses: Dict[str, List[float]] = {s.name: [] for s in setups}
    for step in range(args.steps + 1):
        order = setups[step % len(setups):] + setups[:step % len(setups)]
        for setup in order:
            if setup.name in errors:
                continue
            dist.barrier()
            rec = probe.start()
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
            "saved": saved, "records": records, "losses": losses, "weight_diff": weight_diff,
            "parts": parts}
    everyone = shardtrain.comm.all_gather_object(mine)
    if rank == 0:
        queue.put({"ranks": everyone, "errors": errors})
    for setup in setups:
        setup.close()
    shardtrain.destroy()


# -- the report --------------------------------------------------------------------------------

def theory_bubble(stages: int, micro: int) -> float:
    return (stages - 1) / (micro + stages - 1)


def analytic_sent(args, stage: int, header: bool) -> int:
    """Bytes a rank of ``stage`` sends per step (see the module docstring)."""
    messages = args.micro_batches * ((stage < args.stages - 1) + (stage > 0))
    return messages * (4 * args.batch * args.seq * args.hidden + (HEADER_BYTES if header else 0))


def summarize(args, result: Dict[str, Any]) -> Dict[str, Any]:
    """Per setup and per stage, from every rank's records."""
    ranks, errors = result["ranks"], result["errors"]
    stages = args.stages
    saved = [max(r["saved"] for r in ranks if r["stage"] == s) for s in range(stages)]
    rows = []
    for name in ranks[0]["records"]:
        if name in errors:
            continue
        engine, schedule = name.split()
        per_stage: Dict[str, List[float]] = {k: [] for k in
                                             ("idle", "wait", "busy_s", "span_s", "sent",
                                              "other", "in_flight")}
        for s in range(stages):
            mine = [r["records"][name] for r in ranks if r["stage"] == s]
            steps = [rec for recs in mine for rec in recs]
            per_stage["idle"].append(statistics.median(1 - x["busy"] / x["span"] for x in steps))
            per_stage["wait"].append(statistics.median(x["wait"] / x["span"] for x in steps))
            per_stage["busy_s"].append(statistics.median(x["busy"] for x in steps))
            per_stage["span_s"].append(statistics.median(x["span"] for x in steps))
            per_stage["sent"].append(max(x["sent"] for x in steps))
            per_stage["other"].append(max(x["other"] for x in steps))
            per_stage["in_flight"].append(max(x["in_flight"] for x in steps))
        slowest = [max(r["records"][name][i]["step"] for r in ranks)
                   for i in range(len(ranks[0]["records"][name]))]
        last_ranks = [r for r in ranks if r["stage"] == stages - 1]
        losses = [statistics.fmean(r["losses"][name][i] for r in last_ranks)
                  for i in range(len(last_ranks[0]["losses"][name]))]
        rows.append({
            "engine": engine, "schedule": schedule, "step_s": statistics.median(slowest),
            "step_times_s": slowest, "losses": losses, **per_stage,
            "analytic_sent": [analytic_sent(args, s, engine == "shardtrain")
                              for s in range(stages)],
            "schedule_in_flight": [schedule_in_flight(s, stages, args.micro_batches, schedule)
                                   for s in range(stages)],
            "peak_activation_bytes": [n * b for n, b in zip(per_stage["in_flight"], saved)]})
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
            "saved_bytes_per_micro_batch": saved, "rows": rows, "ratios": ratios,
            "first_step_loss": first_loss, "errors": errors,
            "weight_diff": max(r["weight_diff"] for r in ranks)}


def report(s: Dict[str, Any]) -> None:
    p, m = s["stages"], s["micro_batches"]
    kib = 1024
    print(f"\nmodel: embedding + {s['layers']} blocks (hidden {s['hidden']}, MLP x4) + head, "
          f"vocabulary {s['vocab']}; {p} stages x {s['dp']} replica(s) on {s['world']} ranks "
          f"(gloo, CPU); {m} micro-batches of {s['batch']} x {s['seq']} tokens; "
          f"torch {s['torch']}")
    print(f"layers per stage (boundaries): {s['parts']}; torch's stage weights equal the "
          f"engine's: max |diff| {s['weight_diff']:.1e}")
    for name, error in s["errors"].items():
        print(f"  {name}: did not run here: {error}")
    print(f"\nstep time (median over {s['steps']} steps of the slowest rank)")
    print(f"  {'schedule':8} {'shardtrain ms':>13} {'torch ms':>9} {'ratio':>6}  "
          f"{'step-1 loss shardtrain':>22} {'torch':>9} {'|diff|':>8} {'max |diff| all':>14}")
    for schedule in SCHEDULES:
        pair = {r["engine"]: r for r in s["rows"] if r["schedule"] == schedule}
        ours, theirs = pair.get("shardtrain"), pair.get("torch")
        if ours is None:
            continue
        loss = s["first_step_loss"].get(schedule)
        print(f"  {schedule:8} {ours['step_s'] * 1e3:13.1f} "
              + (f"{theirs['step_s'] * 1e3:9.1f} {s['ratios'][schedule]:6.3f}  "
                 f"{loss['shardtrain']:22.6f} {loss['torch']:9.6f} {loss['diff']:8.1e} "
                 f"{loss['max_diff_all_steps']:14.1e}" if theirs else f"{'-':>9} {'-':>6}"))
    print("  ratio: shardtrain / torch; shardtrain's step also reduces the loss and the "
          "gradient norm across stages")
    print(f"\nidle share of the pipelined span per stage (1 - busy / span), wait share in "
          f"brackets; theory (P-1)/(M+P-1) = {s['theory_bubble']:.3f}")
    print(f"  {'setup':16} " + " ".join(f"{'stage ' + str(i):>16}" for i in range(p))
          + f" {'span ms':>8} {'busy ms':>8}")
    for r in s["rows"]:
        cells = " ".join(f"{r['idle'][i]:8.3f} ({r['wait'][i]:.3f})" for i in range(p))
        print(f"  {r['engine'] + ' ' + r['schedule']:16} {cells} "
              f"{max(r['span_s']) * 1e3:8.1f} {statistics.fmean(r['busy_s']) * 1e3:8.1f}")
    print("  span: the longest stage's median; busy: the stages' mean of their median compute "
          "time per step")
    print("\nbytes sent per rank per step, measured / analytic (KiB); shardtrain's include a "
          "512-byte header per message")
    print(f"  {'setup':16} " + " ".join(f"{'stage ' + str(i):>19}" for i in range(p))
          + "  other collectives")
    for r in s["rows"]:
        cells = " ".join(f"{r['sent'][i] / kib:9.1f} / {r['analytic_sent'][i] / kib:7.1f}"
                         for i in range(p))
        exact = "exact" if r["sent"] == r["analytic_sent"] else "DIFFERS"
        other = f"{max(r['other'])} B" if r["engine"] == "shardtrain" else "-"
        print(f"  {r['engine'] + ' ' + r['schedule']:16} {cells}  {other:>17}  ({exact})")
    print("  other collectives: the largest rank's bytes to shardtrain's other collectives "
          "(loss, norm, and with replicas the gradient reduction); torch's all-reduce of "
          "gradients over replicas is not counted")
    print("\nactivations kept per stage at the peak (CPU stand-in: micro-batches alive at once "
          "x bytes saved per micro-batch)")
    print("  saved per micro-batch (KiB): "
          + ", ".join(f"stage {i} {b / kib:.1f}" for i, b in
                      enumerate(s["saved_bytes_per_micro_batch"])))
    print(f"  {'setup':16} " + " ".join(f"{'stage ' + str(i) + ' alive, KiB':>20}"
                                        for i in range(p)))
    for r in s["rows"]:
        cells = " ".join(f"{r['in_flight'][i]:3d} ({r['schedule_in_flight'][i]}) "
                         f"{r['peak_activation_bytes'][i] / kib:10.1f}" for i in range(p))
        print(f"  {r['engine'] + ' ' + r['schedule']:16} {cells}")
    print("  alive: counted while the schedule ran (in brackets: shardtrain's action list)")


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

"""DeepCompile: ZeRO's collectives compiled into the graphs, and the schedule of passes.

``engine.compile()`` with ``compile.deepcompile`` true hands the forward to the compiled
module of :mod:`shardtrain.zero._in_graph`, whose traced forward and backward hold the
stage's all-gathers and reductions. Which passes apply changes with the step, as in
DeepSpeed: a schedule of ``(step, [passes])``; the engine's forward calls
:meth:`DeepCompile.launch` (``engine.launch_compile_passes(global_steps)``) first, and at a
step the schedule names the module is compiled anew with that step's passes.

The passes (:data:`shardtrain.zero.PASSES`):

* ``z3`` (stage 3) / ``z1`` (stages 1-2): the collectives in the graphs (the base; every
  schedule entry has the stage's one);
* ``prefetch`` (stage 3): each all-gather is issued ahead of its use, by up to eager ZeRO-3's
  prefetch bound (``stage3_prefetch_bucket_size`` elements, at most
  ``stage3_max_live_parameters``) and, where a memory budget is known, within what it leaves
  above the profiled peak; inductor waits for it where the weights are first used;
* ``selective_gather`` (stage 3): the groups whose gathered weights fit in what the memory
  budget leaves after the profiled steps stay gathered from forward to backward (smallest
  first) instead of being gathered again; the budget is the device's memory (CUDA) or
  ``SHARDTRAIN_MEMORY_BUDGET``, and the peak is the device's peak allocated bytes (CUDA) or
  the process's resident memory (CPU), measured over the steps before the pass starts; with
  neither budget known nothing is kept;
* ``offload_opt_states``: where the profiled peak leaves less than :data:`MARGIN` of the
  memory budget free (or no budget is known), the optimizer states live in host memory from
  each step's first forward to its optimizer step (:class:`shardtrain.memory.StateOffload`).

The budget decisions are agreed by the ranks (the least room of any), so that every rank
compiles the same collectives. Default schedule: stage 3 ``[(0, ["z3"]), (5, ["z3",
"prefetch", "selective_gather"])]``, stages 1-2 ``[(0, ["z1"])]``;
``compile.offload_opt_states`` adds ``offload_opt_states`` at step 5 (after the warm-up that
profiles the peak).

Example:
    >>> engine.compile(schedule=[(0, ["z3"]), (2, ["z3", "selective_gather"])])
"""
from __future__ import annotations

import logging
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch

from . import accelerator, comm
from .autotune.budget import memory_budget_from_env
from .log import log_dist
from .memory import StateOffload, resident_bytes
from .zero import PASSES, gathered_bytes

__all__ = ["DeepCompile", "MARGIN", "WARMUP_STEPS", "check_composes", "default_schedule"]

#: The steps profiled before the later passes start (DeepSpeed's warm-up).
WARMUP_STEPS = 5
#: The share of the memory budget kept free: above it, ``offload_opt_states`` offloads.
MARGIN = 0.1

Schedule = List[Tuple[int, FrozenSet[str]]]


def default_schedule(stage: int, offload_opt_states: bool = False) -> Schedule:
    """DeepSpeed's: the base pass from step 0, the later ones (stage 3's, and the offload
    that ``compile.offload_opt_states`` asks for) after the profiled warm-up."""
    base = "z3" if stage == 3 else "z1"
    later = {"prefetch", "selective_gather"} if stage == 3 else set()
    later |= {"offload_opt_states"} if offload_opt_states else set()
    first = [(0, frozenset({base}))]
    return first + [(WARMUP_STEPS, frozenset({base} | later))] if later else first


def _schedule(given: Optional[Sequence[Tuple[int, Iterable[Any]]]], stage: int,
              offload_opt_states: bool) -> Schedule:
    """``engine.compile(schedule=...)`` checked: steps from 0, known passes (by name, or a
    function of that name), the stage's base pass in every entry."""
    if given is None:
        return default_schedule(stage, offload_opt_states)
    base = "z3" if stage == 3 else "z1"
    out: Schedule = []
    for entry in given:
        step, passes = entry
        names = frozenset(getattr(p, "__name__", p) for p in passes)
        unknown = sorted(names - set(PASSES))
        if unknown:
            raise ValueError(f"engine.compile(schedule=...): unknown pass(es) {unknown} at step "
                             f"{step}; the passes are {list(PASSES)}.")
        if base not in names:
            raise ValueError(f"engine.compile(schedule=...): step {step} lacks {base!r}, the pass "
                             f"that puts ZeRO stage {stage}'s collectives in the graphs; add it.")
        if "selective_gather" in names and stage != 3:
            raise ValueError("engine.compile(schedule=...): selective_gather keeps stage 3's "
                             f"gathered weights; at stage {stage} nothing is gathered.")
        out.append((int(step), names))
    out.sort(key=lambda item: item[0])
    if not out or out[0][0] != 0:
        raise ValueError("engine.compile(schedule=...): the schedule must start at step 0 "
                         "(e.g. [(0, ['z3'])]).")
    return out


def check_composes(config: Any, mesh: Any, trainable: Sequence[torch.nn.Parameter]) -> None:
    """What DeepCompile does not compose with here (``config``: the engine's, ``mesh``: its
    device mesh, ``trainable``: the strategy's parameters), refused by name before anything
    changes."""
    zero = config.zero_optimization
    params = [p for p in trainable if p.is_floating_point()]
    dtype = params[0].dtype if params else torch.float32
    problems = []
    if zero.stage == 0:
        problems.append("zero_optimization.stage 0 (DeepCompile needs ZeRO stage 1-3, as "
                        "DeepSpeed's)")
    if mesh.tp.size() > 1 or mesh.sp.size() > 1:
        problems.append("tensor or sequence parallelism (their layers' collectives are not "
                        "traced into the compiled ZeRO graphs)")
    if zero.offload_param is not None and zero.offload_param.device != "none":
        problems.append("zero_optimization.offload_param (a shard in host memory cannot be "
                        "gathered inside the graph)")
    if config.comm_dtype() not in (dtype, None):
        problems.append(f"communication_data_type {config.comm_dtype()} (the graphs "
                        f"reduce gradients in the parameters' {dtype})")
    block = config.compile
    for key in ("offload_activation", "offload_parameters", "symmetric_memory"):
        if getattr(block, key):
            problems.append(f"compile.{key} true (not provided by the compiled ZeRO here)")
    base = "z3" if zero.stage == 3 else "z1"
    if block.passes is not None and list(block.passes) != [base]:
        problems.append(f"compile.passes {list(block.passes)} (at ZeRO stage {zero.stage} "
                        f"the base pass is [{base!r}]; autosp and autotp are not provided)")
    if config.data_types.grad_accum_dtype not in (None, dtype):
        problems.append("data_types.grad_accum_dtype (the graphs' gradients accumulate in "
                        "the parameters' dtype)")
    if problems:
        raise NotImplementedError(
            "engine.compile() with compile.deepcompile true does not compose with "
            + "; ".join(problems) + ". Set compile.deepcompile false for per-block "
            "torch.compile, or change the config.")


class DeepCompile:
    """The compiled module of an engine and its pass schedule.

    Args:
        strategy: the engine's ZeRO strategy (``compile_in_graph`` builds the module).
        stage: the ZeRO stage.
        backend, options: ``torch.compile``'s.
        schedule: ``(step, [passes])`` pairs, or None for :func:`default_schedule`.
        offload_opt_states: ``compile.offload_opt_states``.
    """

    def __init__(self, strategy: Any, stage: int, backend: str, options: Dict[str, Any],
                 schedule: Optional[Sequence[Tuple[int, Iterable[Any]]]] = None,
                 offload_opt_states: bool = False):
        self.stage = stage
        self.schedule = _schedule(schedule, stage, offload_opt_states)
        self.forward = strategy.compile_in_graph(backend, options)
        self.active: Optional[FrozenSet[str]] = None
        self.events: List[Tuple[int, List[str]]] = []  # (step, passes) each time they change
        self._offload = StateOffload()
        self.offloading = False  # offload_opt_states active and the budget tight
        self._graph: Any = None  # what the compiled graphs were built with
        self._peak = 0
        accelerator.reset_peak_memory()

    def launch(self, global_steps: int) -> bool:
        """Applies the passes the schedule gives ``global_steps`` if they changed (the next
        call compiles anew); True when they did."""
        if self.schedule[-1][0] > global_steps:  # a later pass is still ahead: profile
            self._profile()
        passes = [p for step, p in self.schedule if step <= global_steps][-1]
        if passes == self.active:
            return False
        room, tight = self._room()
        kept = self._kept_groups(room) if "selective_gather" in passes else []
        if room is not None:
            room -= sum(gathered_bytes(self.forward.groups[i]) for i in kept)
        ahead = self._ahead(room) if "prefetch" in passes else 0
        graph = (passes - {"offload_opt_states"}, frozenset(kept), ahead)
        if graph != self._graph:  # the offload alone changes no graph: no recompiling
            self.forward.set_passes(graph[0], kept, ahead)
            self._graph = graph
        self.offloading = "offload_opt_states" in passes and tight
        self.active = passes
        self.events.append((global_steps, sorted(passes)))
        log_dist(f"DeepCompile: step {global_steps}: passes {sorted(passes)}"
                 + (f", {len(kept)} group(s) kept gathered" if kept else "")
                 + (f", gathers up to {ahead} elements ahead" if ahead else "")
                 + self._offload_note(passes), ranks=[0], level=logging.INFO)
        return True

    def _offload_note(self, passes: FrozenSet[str]) -> str:
        if "offload_opt_states" not in passes:
            return ""
        if self.offloading:
            return ", optimizer states off the device from forward to step"
        return (f", optimizer states kept (the profiled peak leaves over {MARGIN:.0%} of the "
                "memory budget)")

    def _profile(self) -> None:
        """The peak memory so far (the profiled steps before the later passes)."""
        stats = accelerator.memory_stats()
        now = stats.get("peak") if stats else resident_bytes()
        self._peak = max(self._peak, now or 0)

    def _room(self) -> Tuple[Optional[int], bool]:
        """The bytes the memory budget leaves above the profiled peak, and whether that is
        under :data:`MARGIN` of it; (None, True) where no budget is known (the device's
        memory on CUDA, ``SHARDTRAIN_MEMORY_BUDGET`` elsewhere). The least over the ranks,
        so that every rank compiles the same collectives."""
        limit = accelerator.total_memory()
        if limit is None:
            limit = memory_budget_from_env()
        room = -1 if limit is None else max(0, limit - self._peak)
        roomy = limit is not None and room >= MARGIN * limit
        room, roomy = self._least(room, int(roomy))
        return (None if room < 0 else room), not roomy

    def _least(self, *values: int) -> Tuple[int, ...]:
        group = self.forward.group
        if group.solo or group.size() == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=accelerator.device())
        comm.all_reduce(t, op="min", group=group)
        return tuple(int(v) for v in t.tolist())

    def _kept_groups(self, room: Optional[int]) -> List[int]:
        """The groups ``selective_gather`` keeps gathered: the smallest first, while their
        gathered bytes fit in ``room``."""
        if room is None:
            return []
        kept = []
        sizes = sorted((gathered_bytes(g), i) for i, g in enumerate(self.forward.groups))
        for size, index in sizes:
            if size > room:
                break
            room -= size
            kept.append(index)
        return kept

    def _ahead(self, room: Optional[int]) -> int:
        """The elements ``prefetch`` may gather ahead of their use: eager ZeRO-3's prefetch
        bound (``stage3_prefetch_bucket_size``, within ``stage3_max_live_parameters``), and
        within ``room`` where a budget is known."""
        ahead = self.forward.prefetch_numel
        groups = self.forward.groups
        if room is not None and groups:
            ahead = min(ahead, room // groups[0].flat.element_size())
        return max(0, int(ahead))

    # -- offload_opt_states ------------------------------------------------------------------

    def before_forward(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """A forward with gradients starts: with ``offload_opt_states`` the optimizer states
        leave the device until the optimizer step."""
        if optimizer is None or not self.offloading:
            return
        states = [v for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.device.type == accelerator.device_type()]
        self._offload.offload({"optim_states": states}, ["optim_states"],
                              pin_memory=accelerator.is_cuda(), non_blocking=True)

    def bring_back(self) -> None:
        """The optimizer states are needed (the step, a checkpoint): back on the device."""
        self._offload.reload(non_blocking=True)

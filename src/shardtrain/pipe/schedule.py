"""The order in which one pipeline stage runs its micro-batches: pure lists of actions.

An action is ``("F", i)`` (forward of micro-batch ``i``: receive its input from the stage
before, run, send the output on) or ``("B", i)`` (backward: receive the output's gradient
from the stage after, run, send the input's gradient back); with virtual stages,
``("F", i, c)`` and ``("B", i, c)`` name the chunk ``c`` of this rank's layers as well. Sends never wait, receives do;
every stage following its list and sending in that order cannot deadlock, because each
receive waits on an action that an earlier-or-equal step of another stage's list performs.

``1f1b`` (DeepSpeed's default, PipeDream-Flush): a stage runs ``stages - stage - 1``
forwards ahead, then alternates one forward and one backward, then drains; at most
``stages - stage`` micro-batches' activations are alive on a stage at once. ``gpipe``:
every forward, then every backward (as many activations alive as micro-batches). Both idle
``(stages - 1) / (micro_batches + stages - 1)`` of a step on each stage.

``interleaved`` (Megatron's interleaved 1F1B): each rank holds V chunks of layers (chunk c
of stage s is part ``s + c * stages`` of the model), a micro-batch visits every rank V times,
and forwards go in groups of ``stages`` micro-batches through chunk 0, then chunk 1, ...
(backwards through the chunks in reverse). A rank runs ``2 (stages - stage - 1) + (V - 1)
stages`` forwards ahead, then one forward and one backward in turn. The idle share falls to
``(stages - 1) / (V micro_batches + stages - 1)``, for V times the sends; the micro-batches
must be a multiple of the stages.

``zbv`` (zero bubble, V-shaped, after Qi et al., "Zero Bubble Pipeline Parallelism"): each
rank holds two chunks placed as a V (stage s: parts s and ``2 stages - 1 - s``, so the first
stage also computes the loss), and a backward is split in two: ``("B", i, c)`` computes only
the gradient of the chunk's input, which the chunk before waits for, and ``("W", i, c)`` its
weights' gradients, which nobody waits for and which fill what would be bubbles. The order
comes from a simulation with equal forward, input-backward and weight-backward times in
which each idle rank runs the first ready of: an input backward, a forward (while fewer than
``2 stages`` chunk activations are alive, 1F1B's peak), a weight backward. The idle share is
the simulation's (:func:`bubble_fraction`): 0.059 on 4 stages and 8 micro-batches, against
0.273 for 1F1B.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Tuple

__all__ = ["SCHEDULES", "train_actions", "eval_actions", "bubble_fraction"]

Action = Tuple  # ("F" or "B", micro-batch) or, with chunks, ("F", "B" or "W", micro-batch, chunk)

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zbv")

#: the schedules that split a backward into its input ("B") and weight ("W") halves
SPLIT_BACKWARD = ("zbv",)


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}.")
    if micro_batches < 1:
        raise ValueError(f"a pipeline step needs at least one micro-batch, got {micro_batches}.")


def train_actions(stage: int, stages: int, micro_batches: int,
                  schedule: str = "1f1b", chunks: int = 1) -> List[Action]:
    """The forward and backward actions of ``stage`` for one training step (``chunks``: the
    virtual stages per rank of the interleaved schedule)."""
    _check(stage, stages, micro_batches)
    if schedule == "interleaved":
        return _interleaved(stage, stages, micro_batches, chunks)
    if schedule == "zbv":
        if chunks != 2:
            raise ValueError("the 'zbv' schedule runs two chunks per rank placed as a V: build "
                             "the PipelineModule with virtual_stages=2, chunk_placement=\"v\".")
        return list(_zbv(stages, micro_batches)[0][stage])
    if chunks != 1:
        raise ValueError(f"{chunks} virtual stages per rank run the 'interleaved' schedule, "
                         f"not {schedule!r}: set pipeline.schedule to \"interleaved\".")
    if schedule == "gpipe":
        return [("F", i) for i in range(micro_batches)] + \
               [("B", i) for i in range(micro_batches)]
    if schedule != "1f1b":
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}.")
    ahead = min(stages - stage - 1, micro_batches)
    actions = [("F", i) for i in range(ahead)]
    for i in range(micro_batches - ahead):
        actions += [("F", ahead + i), ("B", i)]
    actions += [("B", i) for i in range(micro_batches - ahead, micro_batches)]
    return actions


def _interleaved(stage: int, stages: int, micro_batches: int, chunks: int) -> List[Action]:
    if chunks < 2:
        raise ValueError("the 'interleaved' schedule needs virtual stages: build the "
                         "PipelineModule with virtual_stages >= 2.")
    if micro_batches % stages:
        raise ValueError(f"the 'interleaved' schedule runs the micro-batches in groups of "
                         f"{stages} (the stages): gradient_accumulation_steps "
                         f"{micro_batches} must be a multiple of {stages}.")
    total = micro_batches * chunks
    ahead = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)

    def at(k: int, kind: str) -> Action:
        chunk = (k // stages) % chunks
        index = (k // (stages * chunks)) * stages + k % stages
        return (kind, index, chunk if kind == "F" else chunks - 1 - chunk)

    actions = [at(k, "F") for k in range(ahead)]
    for k in range(total - ahead):
        actions += [at(ahead + k, "F"), at(k, "B")]
    actions += [at(k, "B") for k in range(total - ahead, total)]
    return actions


@lru_cache(maxsize=32)
def _zbv(stages: int, micro_batches: int) -> Tuple[Tuple[Tuple[Action, ...], ...], int]:
    """Every stage's actions and the length of the step, in action times, from the
    simulation the module docstring describes."""
    parts = 2 * stages

    def rank(part: int) -> int:
        return part if part < stages else parts - 1 - part

    def chunk(part: int) -> int:
        return 0 if part < stages else 1

    mine = [[k for k in range(parts) if rank(k) == r] for r in range(stages)]
    finished: Dict[Tuple[str, int, int], int] = {}  # (kind, micro-batch, part) -> end time
    following = {kind: [0] * parts for kind in "FBW"}  # each part's next micro-batch
    alive, free_at = [0] * stages, [0] * stages
    lists: List[List[Action]] = [[] for _ in range(stages)]
    left, now = 3 * parts * micro_batches, 0

    def done(kind: str, i: int, part: int) -> bool:
        return finished.get((kind, i, part), now + 1) <= now

    def ready(kind: str, part: int) -> bool:
        i = following[kind][part]
        if i >= micro_batches:
            return False
        if kind == "F":
            return part == 0 or done("F", i, part - 1)
        if kind == "B":
            return done("F", i, part) and (part == parts - 1 or done("B", i, part + 1))
        return done("B", i, part)

    while left:
        for r in range(stages):
            if free_at[r] > now:
                continue
            for kind in "BFW":
                if kind == "F" and alive[r] >= parts:
                    continue
                # the oldest micro-batch first, then the part nearer the loss
                options = [(following[kind][k], -k) for k in mine[r] if ready(kind, k)]
                if options:
                    i, part = min(options)[0], -min(options)[1]
                    break
            else:
                continue
            finished[kind, i, part] = now + 1
            free_at[r] = now + 1
            following[kind][part] += 1
            alive[r] += {"F": 1, "B": 0, "W": -1}[kind]
            lists[r].append((kind, i, chunk(part)))
            left -= 1
        now += 1
    return tuple(tuple(x) for x in lists), max(finished.values())


def eval_actions(micro_batches: int, chunks: int = 1) -> List[Action]:
    """Evaluation: forwards only, in order, on every stage (each chunk in turn with virtual
    stages: a micro-batch's chunk c needs the last stage's chunk c - 1)."""
    if chunks == 1:
        return [("F", i) for i in range(micro_batches)]
    return [("F", i, c) for c in range(chunks) for i in range(micro_batches)]


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1,
                    schedule: str = "1f1b") -> float:
    """The share of a step each stage idles with equal stage times: 1F1B and GPipe, the
    interleaved schedule with ``chunks`` virtual stages per rank, and ``zbv`` (its
    simulation's, with equal forward, input-backward and weight-backward times)."""
    if schedule == "zbv":
        return 1 - 6 * micro_batches / _zbv(stages, micro_batches)[1]
    return (stages - 1) / (chunks * micro_batches + stages - 1)

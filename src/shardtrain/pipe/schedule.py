"""The order in which one pipeline stage runs its micro-batches: pure lists of actions.

An action is ``("F", i)`` (forward of micro-batch ``i``: receive its input from the stage
before, run, send the output on) or ``("B", i)`` (backward: receive the output's gradient
from the stage after, run, send the input's gradient back). Sends never wait, receives do;
every stage following its list and sending in that order cannot deadlock, because each
receive waits on an action that an earlier-or-equal step of another stage's list performs.

``1f1b`` (DeepSpeed's default, PipeDream-Flush): a stage runs ``stages - stage - 1``
forwards ahead, then alternates one forward and one backward, then drains; at most
``stages - stage`` micro-batches' activations are alive on a stage at once. ``gpipe``:
every forward, then every backward (as many activations alive as micro-batches). Both idle
``(stages - 1) / (micro_batches + stages - 1)`` of a step on each stage.
"""
from __future__ import annotations

from typing import List, Tuple

__all__ = ["SCHEDULES", "train_actions", "eval_actions", "bubble_fraction"]

Action = Tuple[str, int]

SCHEDULES = ("1f1b", "gpipe")


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}.")
    if micro_batches < 1:
        raise ValueError(f"a pipeline step needs at least one micro-batch, got {micro_batches}.")


def train_actions(stage: int, stages: int, micro_batches: int,
                  schedule: str = "1f1b") -> List[Action]:
    """The forward and backward actions of ``stage`` for one training step."""
    _check(stage, stages, micro_batches)
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


def eval_actions(micro_batches: int) -> List[Action]:
    """Evaluation: forwards only, in order, on every stage."""
    return [("F", i) for i in range(micro_batches)]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The share of a step each stage idles in 1F1B or GPipe with equal stage times."""
    return (stages - 1) / (micro_batches + stages - 1)

"""DeepSpeed's names for the values of a step record: the TensorBoard tag and the CSV file of
each, with global samples on the x-axis. One table serves the writers (:mod:`.monitors`) and
the reader (:mod:`.metrics`), so that what one writes the other reads back."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple


#: Record key -> DeepSpeed's event name (TensorBoard tag, CSV file). DeepSpeed's own names
#: where it has one; x-axis: global samples, as in DeepSpeed.
EVENTS = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
    "grad_norm": "Train/Samples/grad_norm",
    "samples_per_s": "Train/Samples/samples_per_sec",
    "tokens_per_s": "Train/Samples/tokens_per_sec",
    "tflops": "Train/Samples/tflops_per_rank",
    "mfu": "Train/Samples/mfu",
}
TIMER_EVENTS = {
    "forward": "Train/Samples/elapsed_time_ms_forward",
    "backward": "Train/Samples/elapsed_time_ms_backward",
    "reduce": "Train/Samples/elapsed_time_ms_backward_allreduce",
    "optimizer": "Train/Samples/elapsed_time_ms_step",
}
PER_RANK = {"memory_allocated": "Train/Samples/memory_allocated_rank{}",
             "memory_peak": "Train/Samples/memory_peak_rank{}"}
_NOT_EVENTS = {"step", "samples", "time", "skipped"}


def events(record: Dict[str, Any]) -> List[Tuple[str, float]]:
    """A record as (event name, value) pairs, in DeepSpeed's naming."""
    events = []
    for key, value in record.items():
        if key in _NOT_EVENTS or value is None:
            continue
        if key == "time_ms":
            events += [(TIMER_EVENTS.get(name, f"Train/Samples/elapsed_time_ms_{name}"), ms)
                       for name, ms in value.items()]
        elif key in PER_RANK:
            events += [(PER_RANK[key].format(rank), v) for rank, v in enumerate(value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            events.append((EVENTS.get(key, key if "/" in key else f"Train/Samples/{key}"), value))
    return events

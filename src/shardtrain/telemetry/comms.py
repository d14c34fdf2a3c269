"""The communication log (DeepSpeed's ``comms_logger``): every collective's latency and
bandwidth, by operation and message size.

Turned on by the config's ``comms_logger`` block (``enabled``, ``prof_all``, ``prof_ops``,
``verbose``, ``debug``) or by :func:`configure`. It times the engine's collectives (those of
:mod:`shardtrain.comm`) and those a script issues through ``deepspeed.comm``. The time of a
collective runs from its call to its completion (an asynchronous one completes at its
``wait()``); on a GPU the device is synchronised at both ends, as DeepSpeed does, so logging
serialises communication with computation: turn it on to look, not for the runs you time.

Bandwidths follow nccl-tests: the algorithm bandwidth is the size of the data the operation
produces per rank over the time (an all-gather's output, an all-reduce's tensor, a
reduce-scatter's input), the bus bandwidth scales it to what each link carried: ``2 (n - 1) / n``
for an all-reduce, ``(n - 1) / n`` for an all-gather, reduce-scatter or all-to-all, 1 otherwise.

Example:
    >>> from shardtrain.telemetry import comms
    >>> comms.configure(enabled=True)
    >>> ...                                    # train
    >>> comms.log_summary()                    # rank 0 logs the table
    >>> comms.summary()["all_reduce"]          # {message bytes: {"count": ..., ...}}
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from .. import accelerator, comm
from ..memory import format_bytes
from ..log import logger

__all__ = ["CommsLog", "configure", "enabled", "timed", "summary", "log_summary", "reset",
           "format_summary", "busbw_factor"]


def busbw_factor(op: str, ranks: int) -> float:
    """What each link carries, per byte of the operation's data (nccl-tests' factors)."""
    if ranks <= 1:
        return 0.0
    if op.startswith("all_reduce"):
        return 2 * (ranks - 1) / ranks
    if op.startswith(("all_gather", "reduce_scatter", "all_to_all")):
        return (ranks - 1) / ranks
    return 1.0


def _data_bytes(op: str, tensor: torch.Tensor, ranks: int) -> int:
    """The operation's data per rank: an all-gather produces ``ranks`` times its input."""
    size = tensor.numel() * tensor.element_size()
    return size * ranks if op.startswith("all_gather") else size


#: DeepSpeed's names of operations, as ``prof_ops`` may list them, and the names logged here.
_ALIASES = {"all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
            "all_gather_base": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "reduce_scatter_fn": "reduce_scatter", "reduce_scatter_base": "reduce_scatter",
            "all_to_all_single": "all_to_all", "inference_all_reduce": "all_reduce"}


class CommsLog(comm.CollectiveTiming):
    """Latencies by operation and message size (bytes of the tensor handed to the
    collective); installed into :mod:`shardtrain.comm` by :func:`configure`."""

    def __init__(self, prof_all: bool = True, prof_ops: Iterable[str] = (), verbose: bool = False,
                 debug: bool = False):
        self.prof_all, self.prof_ops = prof_all, {_ALIASES.get(op, op) for op in prof_ops}
        self.verbose, self.debug = verbose, debug
        # op -> message bytes -> {"count", "total", "data", "ranks"}
        self.rows: Dict[str, Dict[int, Dict[str, Any]]] = {}

    def wants(self, op: str) -> bool:
        return self.prof_all or op in self.prof_ops

    def start(self, op: str) -> Optional[float]:
        if not self.wants(op):
            return None
        accelerator.synchronize()
        return time.perf_counter()

    def stop(self, op: str, tensor: torch.Tensor, group: Optional[comm.Group], mark: float) -> None:
        accelerator.synchronize()
        self.record(op, tensor, comm.get_world_size(group), time.perf_counter() - mark)

    def record(self, op: str, tensor: torch.Tensor, ranks: int, seconds: float) -> None:
        """One completed collective of ``ranks`` ranks that took ``seconds``."""
        if not self.wants(op):
            return
        name = f"{op} [{_caller()}]" if self.debug else op
        size = tensor.numel() * tensor.element_size()
        row = self.rows.setdefault(name, {}).setdefault(
            size, {"count": 0, "total": 0.0, "data": _data_bytes(op, tensor, ranks), "ranks": ranks})
        row["count"] += 1
        row["total"] += seconds
        if self.verbose:
            algbw = row["data"] / max(seconds, 1e-12)
            logger.info("comm op: %s | time (ms): %.3f | msg size: %s | algbw (GB/s): %.3f | "
                        "busbw (GB/s): %.3f", name, seconds * 1e3, format_bytes(size), algbw / 1e9,
                        algbw * busbw_factor(op, ranks) / 1e9)

    def summary(self) -> Dict[str, Dict[int, Dict[str, float]]]:
        """``{op: {message bytes: {count, total_latency_ms, avg_latency_ms, algbw_gbps,
        busbw_gbps}}}`` (bandwidths in GB/s, averaged over the calls)."""
        out: Dict[str, Dict[int, Dict[str, float]]] = {}
        for name, sizes in self.rows.items():
            for size, row in sorted(sizes.items()):
                avg = row["total"] / row["count"]
                algbw = row["data"] / max(avg, 1e-12) / 1e9
                out.setdefault(name, {})[size] = {
                    "count": row["count"], "total_latency_ms": row["total"] * 1e3,
                    "avg_latency_ms": avg * 1e3, "algbw_gbps": algbw,
                    "busbw_gbps": algbw * busbw_factor(name.split(" ")[0], row["ranks"])}
        return out


def _caller() -> str:
    """The first function outside the communication modules on the stack (``debug``)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("shardtrain.comm", "shardtrain.telemetry.comms",
                                  "shardtrain.deepspeed.comm")):
            return frame.f_code.co_name
        frame = frame.f_back
    return "?"


_log: Optional[CommsLog] = None
_on = False


def configure(enabled: bool = True, prof_all: bool = True, prof_ops: Iterable[str] = (),
              verbose: bool = False, debug: bool = False) -> None:
    """Starts (``enabled``) or stops the log; starting again keeps what was recorded."""
    global _log, _on
    _on = bool(enabled)
    if not _on:
        comm.time_collectives(None)
        return
    kept = _log.rows if _log is not None else {}
    _log = CommsLog(prof_all, prof_ops, verbose, debug)
    _log.rows = kept
    comm.time_collectives(_log)


def enabled() -> bool:
    """Whether collectives are being logged."""
    return _on


def timed(op: str, tensor: torch.Tensor, ranks: Callable[[], int], call: Callable[[], Any]) -> Any:
    """``call()``, logged as one ``op`` over ``ranks()`` ranks when the log is on (for
    collectives that do not pass through :mod:`shardtrain.comm`, as ``deepspeed.comm``'s);
    an asynchronous call is timed to its launch."""
    mark = _log.start(op) if _on else None
    if mark is None:
        return call()
    result = call()
    accelerator.synchronize()
    _log.record(op, tensor, ranks(), time.perf_counter() - mark)
    return result


def summary() -> Dict[str, Dict[int, Dict[str, float]]]:
    """This rank's log (see :meth:`CommsLog.summary`); empty when nothing was logged."""
    return _log.summary() if _log is not None else {}


def reset() -> None:
    """Forgets what was recorded (the log stays on)."""
    if _log is not None:
        _log.rows = {}


def log_summary(show_straggler: bool = False) -> Dict[str, Dict[int, Dict[str, float]]]:
    """Logs the table on rank 0 and returns this rank's summary. With ``show_straggler``
    (a collective: every rank calls it) each row also gets ``straggler_ms``: this rank's
    total latency minus the smallest over ranks, the time spent waiting for the slowest."""
    rows = summary()
    if show_straggler:
        every = comm.all_gather_object(rows)
        for name, sizes in rows.items():
            for size, row in sizes.items():
                fastest = min(r.get(name, {}).get(size, row)["total_latency_ms"] for r in every)
                row["straggler_ms"] = row["total_latency_ms"] - fastest
    if comm.get_rank() == 0:
        logger.info("%s", format_summary(rows))
    return rows


def format_summary(rows: Dict[str, Dict[int, Dict[str, float]]]) -> str:
    """The summary as a table, one line per operation and message size."""
    straggler = any("straggler_ms" in r for sizes in rows.values() for r in sizes.values())
    head = (f"{'Comm. Op':<28}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>19}"
            f"{'Avg Latency(ms)':>17}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}")
    lines: List[str] = [head + (f"{'Straggler(ms)':>15}" if straggler else "")]
    for name in sorted(rows):
        for size, r in rows[name].items():
            line = (f"{name:<28}{format_bytes(size):>14}{r['count']:>8}{r['total_latency_ms']:>19.3f}"
                    f"{r['avg_latency_ms']:>17.3f}{r['algbw_gbps']:>14.3f}{r['busbw_gbps']:>14.3f}")
            lines.append(line + (f"{r.get('straggler_ms', 0.0):>15.3f}" if straggler else ""))
    if len(lines) == 1:
        lines.append("(no collective logged)")
    return "\n".join(lines)

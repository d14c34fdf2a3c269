"""FLOPs per module, and the device's peak, for model FLOPs utilisation (MFU).

Counting is ``torch.utils.flop_counter.FlopCounterMode``'s: operations with a FLOP formula in
torch (matrix products, convolutions, attention) count, element-wise work counts zero, as in
most MFU reports. :class:`FlopsProfiler` tells forward from backward by the forward regions it
is shown, and times each module's forward with hooks. :func:`peak_flops` knows the common
data-centre GPUs, or reads ``SHARDTRAIN_PEAK_TFLOPS``.

Example:
    >>> profiler = FlopsProfiler(model)
    >>> with profiler, profiler.forward():
    ...     model(x)
    >>> profiler.result().forward_flops  # 2 * batch * in * out for one nn.Linear
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .. import accelerator
from ..layout import layout_of

__all__ = ["FlopsProfiler", "FlopsProfile", "ModuleCost", "peak_flops", "PEAK_TFLOPS_ENV"]


#: Peak dense TFLOP/s of one device, for model FLOPs utilisation when the table below does
#: not know the device (or to override it).
PEAK_TFLOPS_ENV = "SHARDTRAIN_PEAK_TFLOPS"


@dataclasses.dataclass(frozen=True)
class ModuleCost:
    """One module's share of a profiled step.

    Attributes:
        name: the module's name in ``named_modules()`` (``""`` for the model itself).
        depth: 0 for the model, 1 for its children, ...
        params: parameters it holds, its submodules' included (full sizes at ZeRO-3).
        forward_flops: FLOPs of its forward passes, submodules included.
        backward_flops: FLOPs of its backward passes, submodules included.
        forward_latency_s: seconds inside its forward passes, submodules included.
    """

    name: str
    depth: int
    params: int
    forward_flops: int
    backward_flops: int
    forward_latency_s: float


@dataclasses.dataclass(frozen=True)
class FlopsProfile:
    """FLOPs, parameters and latency of the code a :class:`FlopsProfiler` watched.

    ``forward_flops`` count what ran inside :meth:`FlopsProfiler.forward` regions,
    ``backward_flops`` everything else (backward, and the loss if computed outside the
    model). Only operations with a FLOP formula in torch count (matrix products,
    convolutions, attention): element-wise work counts zero, as in most MFU reports.
    """

    forward_flops: int
    backward_flops: int
    params: int
    forward_latency_s: float
    modules: Tuple[ModuleCost, ...]

    @property
    def total_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def table(self, module_depth: int = -1, top_modules: int = 1, detailed: bool = True) -> str:
        """The per-module report: the top modules by forward FLOPs at each depth, then (with
        ``detailed``) every module down to ``module_depth`` (-1: all), as a tree."""
        lines = []
        deepest = max((m.depth for m in self.modules), default=0)
        last = deepest if module_depth < 0 else min(deepest, module_depth)
        if top_modules > 0:
            lines.append(f"Top {top_modules} module(s) by forward FLOPs at each depth:")
            for depth in range(1, last + 1):
                ranked = sorted((m for m in self.modules if m.depth == depth),
                                key=lambda m: -m.forward_flops)[:top_modules]
                names = ", ".join(f"{m.name} ({_si(m.forward_flops)}FLOPs, {_si(m.params)} params)"
                                  for m in ranked)
                lines.append(f"  depth {depth}: {names}")
        if detailed:
            lines.append(f"{'module':<40}{'params':>10}{'fwd FLOPs':>12}{'bwd FLOPs':>12}"
                         f"{'fwd latency':>13}{'% fwd FLOPs':>13}")
            for m in self.modules:
                if module_depth >= 0 and m.depth > module_depth:
                    continue
                label = ("  " * m.depth + (m.name.rsplit(".", 1)[-1] if m.name else "(model)"))[:39]
                share = 100.0 * m.forward_flops / self.forward_flops if self.forward_flops else 0.0
                lines.append(f"{label:<40}{_si(m.params):>10}{_si(m.forward_flops):>12}"
                             f"{_si(m.backward_flops):>12}{m.forward_latency_s * 1e3:>10.2f} ms"
                             f"{share:>12.1f}%")
        return "\n".join(lines)


class FlopsProfiler:
    """Counts FLOPs per module with ``torch.utils.flop_counter.FlopCounterMode`` and times
    each module's forward.

    Enter it around the code to profile (forward and backward); mark forward passes with
    :meth:`forward` so that forward and backward FLOPs are told apart. Module latencies are
    measured with forward hooks that synchronise the device; they include the counter's own
    per-operation overhead, which is small next to large matrix products.

    Args:
        module: the model.

    Example:
        >>> profiler = FlopsProfiler(model)
        >>> with profiler:
        ...     with profiler.forward():
        ...         loss = model(x).sum()
        ...     loss.backward()
        >>> p = profiler.result(); p.forward_flops, p.backward_flops
    """

    def __init__(self, module: torch.nn.Module):
        from torch.utils.flop_counter import FlopCounterMode

        self.module = module
        self._counter = FlopCounterMode(display=False, depth=None)
        self._forward: Dict[str, int] = {}
        self._before: Optional[Dict[str, int]] = None
        self._latency: Dict[str, float] = {}
        self._began: Dict[int, float] = {}
        self._handles: List[Any] = []
        self._names = {id(m): name for name, m in module.named_modules()}
        self._active = False

    def start(self) -> None:
        """Starts counting (what :meth:`__enter__` does)."""
        if self._active:
            return
        self._active = True
        self._counter.__enter__()
        for m in self.module.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward, always_call=True))

    def stop(self) -> None:
        """Stops counting (what :meth:`__exit__` does)."""
        if not self._active:
            return
        self._active = False
        if self._before is not None:
            self.forward_end()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._counter.__exit__(None, None, None)

    def __enter__(self) -> "FlopsProfiler":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def forward_begin(self) -> None:
        self._before = self._counts()

    def forward_end(self) -> None:
        if self._before is None:
            return
        for name, count in self._counts().items():
            self._forward[name] = self._forward.get(name, 0) + count - self._before.get(name, 0)
        self._before = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Marks a forward pass: FLOPs inside count as forward FLOPs."""
        self.forward_begin()
        try:
            yield
        finally:
            self.forward_end()

    def _counts(self) -> Dict[str, int]:
        """FLOPs so far per module name (``named_modules`` names; ``"Global"`` for the total)."""
        out: Dict[str, int] = {}
        for key, per_op in self._counter.get_flop_counts().items():
            # The counter names modules "<RootClass>.<path>"; "Global" is everything.
            name = key if key == "Global" else key.partition(".")[2]
            out[name] = out.get(name, 0) + sum(per_op.values())
        return out

    def _pre_forward(self, m: torch.nn.Module, args: Any) -> None:
        accelerator.synchronize()
        self._began[id(m)] = time.perf_counter()

    def _post_forward(self, m: torch.nn.Module, args: Any, output: Any) -> None:
        began = self._began.pop(id(m), None)
        if began is not None:
            accelerator.synchronize()
            name = self._names.get(id(m), "?")
            self._latency[name] = self._latency.get(name, 0.0) + time.perf_counter() - began

    def result(self) -> FlopsProfile:
        """The profile of what ran so far."""
        total = self._counts()
        fwd = dict(self._forward)
        bwd = {name: count - self._forward.get(name, 0) for name, count in total.items()}
        latency = dict(self._latency)
        # A container that is never called (an nn.ModuleList) shows what its children cost.
        # named_modules() lists parents first, so walking it backwards sums children first.
        for name, _ in reversed(list(self.module.named_modules())):
            if name and name not in self._latency:
                for table in (fwd, bwd, latency):
                    table[name] = sum(v for k, v in table.items() if k.rpartition(".")[0] == name)
        modules = []
        for name, m in self.module.named_modules():
            modules.append(ModuleCost(
                name=name, depth=0 if not name else name.count(".") + 1,
                params=sum(layout_of(p).local_numel for p in m.parameters()),
                forward_flops=fwd.get(name, 0), backward_flops=bwd.get(name, 0),
                forward_latency_s=latency.get(name, 0.0)))
        fwd_total = self._forward.get("Global", 0)
        return FlopsProfile(forward_flops=fwd_total, backward_flops=total.get("Global", 0) - fwd_total,
                            params=modules[0].params if modules else 0,
                            forward_latency_s=self._latency.get("", 0.0), modules=tuple(modules))


#: Dense peak TFLOP/s per device: (16-bit tensor cores, TF32, plain fp32), by name fragment.
#: First match wins, so the more specific names come first.
_PEAK_TFLOPS: Tuple[Tuple[str, Tuple[float, float, float]], ...] = (
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.0, 378.0, 51.2)),
    ("H100", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
    ("L4", (121.0, 60.0, 30.3)),
    ("V100", (125.0, 15.7, 15.7)),
    ("T4", (65.0, 8.1, 8.1)),
)


def peak_flops(dtype: torch.dtype = torch.bfloat16) -> Optional[float]:
    """Peak dense FLOP/s of one device of this process for matrix products in ``dtype``.

    ``SHARDTRAIN_PEAK_TFLOPS`` (TFLOP/s) wins when set; otherwise a table of common data-centre
    GPUs is used. None when unknown (always on the CPU unless given).

    Example:
        >>> peak_flops(torch.bfloat16)     # 9.894e14 on an H100 SXM
    """
    given = os.environ.get(PEAK_TFLOPS_ENV)
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ValueError(f"{PEAK_TFLOPS_ENV}={given!r}: expected TFLOP/s as a number, "
                             f"e.g. 989.4") from None
        if value <= 0:
            raise ValueError(f"{PEAK_TFLOPS_ENV}={given!r}: expected a positive number")
        return value * 1e12
    name = accelerator.device_name()
    for fragment, (half, tf32, fp32) in _PEAK_TFLOPS:
        if fragment in name:
            if dtype in (torch.float16, torch.bfloat16):
                return half * 1e12
            return (tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32) * 1e12
    return None


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} "

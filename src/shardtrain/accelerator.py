"""The device this process computes on: the only module that branches on device type.

CUDA when it is available (one device per local rank), else the CPU. Set
``SHARDTRAIN_ACCELERATOR=cpu`` to stay on the CPU on a machine with GPUs.
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import os
from typing import Iterator, Optional

import torch

__all__ = ["device", "device_type", "default_backend", "synchronize", "memory_stats",
           "range", "is_cuda", "set_local_device", "reset_peak_memory", "total_memory",
           "device_name", "limit_memory", "is_out_of_memory", "device_count", "nccl_version",
           "device_inventory", "record_memory_history", "dump_memory_snapshot", "get_rng_state",
           "set_rng_state", "manual_seed"]

_ENV = "SHARDTRAIN_ACCELERATOR"


@functools.lru_cache(maxsize=None)
def is_cuda() -> bool:
    """True when this process computes on CUDA (decided once per process)."""
    wanted = os.environ.get(_ENV, "").lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{_ENV}={wanted!r}: expected 'cpu' or 'cuda'.")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{_ENV}=cuda but torch sees no CUDA device "
                           f"(torch {torch.__version__}); unset it to train on the CPU.")
    return wanted != "cpu" and torch.cuda.is_available()


def device_type() -> str:
    return "cuda" if is_cuda() else "cpu"


def device() -> torch.device:
    """This process's device: ``cuda:<current>`` or ``cpu``."""
    if is_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_local_device(local_rank: int) -> None:
    if is_cuda():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def default_backend() -> str:
    return "nccl" if is_cuda() else "gloo"


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


def get_rng_state() -> torch.Tensor:
    """The device generator's state (CUDA's current device, else the CPU's)."""
    return torch.cuda.get_rng_state() if is_cuda() else torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if is_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    """Seeds the device generator (CUDA's current device, else the CPU's)."""
    if is_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def memory_stats() -> dict:
    """Allocated and peak bytes on the device (CUDA only; empty on the CPU)."""
    if not is_cuda():
        return {}
    return {"allocated": torch.cuda.memory_allocated(),
            "peak": torch.cuda.max_memory_allocated()}


@contextlib.contextmanager
def range(name: str) -> Iterator[None]:  # noqa: A001 - mirrors profiler vocabulary
    """A named range: shows in ``torch.profiler`` traces, and as NVTX on CUDA.

    The profiler range is entered only while a profiler runs (a C flag read), so ranges
    cost next to nothing otherwise; NVTX is pushed only on CUDA, where Nsight reads it.
    """
    cuda = is_cuda()
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(name):
                yield
        else:
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


# -- memory and identity, for profiling and the autotuner ----------------------------------------


def reset_peak_memory() -> None:
    """Starts a new peak for :func:`memory_stats` (CUDA; nothing to do on the CPU)."""
    if is_cuda():
        torch.cuda.reset_peak_memory_stats()


def total_memory() -> Optional[int]:
    """Bytes of memory of this process's device, or None on the CPU (the host is shared)."""
    if not is_cuda():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def device_name() -> str:
    """The device's marketing name (``NVIDIA H100 80GB HBM3``), or ``cpu``."""
    return torch.cuda.get_device_name() if is_cuda() else "cpu"


def limit_memory(nbytes: int) -> None:
    """Makes the caching allocator refuse to grow past ``nbytes`` (CUDA), so that a budget
    smaller than the device raises a real out-of-memory error; nothing on the CPU."""
    total = total_memory()
    if total:
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total))


def is_out_of_memory(error: BaseException) -> bool:
    """True for the device's out-of-memory error."""
    return isinstance(error, torch.cuda.OutOfMemoryError)


def record_memory_history(max_entries: int = 100_000) -> bool:
    """Starts recording the CUDA allocator's history (each allocation and free, with its
    stack) for :func:`dump_memory_snapshot`; the oldest of more than ``max_entries`` events
    are dropped. Returns False on the CPU, which has no such allocator."""
    if not is_cuda():
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    return True


def dump_memory_snapshot(path: str) -> bool:
    """Writes the allocator's recorded history and its segments now to ``path`` (a pickle
    that https://pytorch.org/memory_viz draws); False on the CPU, where nothing is written."""
    if not is_cuda():
        return False
    torch.cuda.memory._dump_snapshot(path)
    return True


def device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_version():
    """NCCL's version as text, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def device_inventory() -> list:
    """Each CUDA device: index, name, total and free memory, compute capability."""
    devices = []
    for index in builtins.range(device_count()):  # range() here is the profiler range
        props = torch.cuda.get_device_properties(index)
        try:
            free = torch.cuda.mem_get_info(index)[0]
        except RuntimeError:  # busy in exclusive mode, or a broken device: still list it
            free = None
        devices.append({"index": index, "name": props.name, "total_memory": props.total_memory,
                        "free_memory": free, "capability": f"{props.major}.{props.minor}"})
    return devices

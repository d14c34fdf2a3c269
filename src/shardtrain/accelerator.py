"""The device this process computes on: the only module that branches on device type.

CUDA when it is available (one device per local rank), else the CPU. Set
``SHARDTRAIN_ACCELERATOR=cpu`` to stay on the CPU on a machine with GPUs.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

__all__ = ["device", "device_type", "default_backend", "synchronize", "memory_stats",
           "range", "is_cuda", "set_local_device"]

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

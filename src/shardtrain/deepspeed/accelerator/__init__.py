"""``deepspeed.accelerator``: ``get_accelerator()`` and the object DeepSpeed scripts ask about
the device (``device_name``, ``current_device_name``, ``set_device``, memory queries, ...).

The device is the one the engine computes on, decided once by
:func:`shardtrain.accelerator.is_cuda` (CUDA when available, unless
``SHARDTRAIN_ACCELERATOR=cpu``). Besides :mod:`shardtrain.accelerator`, this is the one module
that calls ``torch.cuda``: a pass-through with DeepSpeed's method names, for scripts.

Example:
    >>> from deepspeed.accelerator import get_accelerator
    >>> x = torch.ones(2, device=get_accelerator().current_device_name())
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, List, Optional

import torch

from ... import accelerator as _acc

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator",
           "is_current_accelerator_supported"]


def _proc_meminfo(key: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return None


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class DeepSpeedAccelerator:
    """DeepSpeed's accelerator interface for the device this process trains on.

    On CUDA each method is torch.cuda's; on the CPU the memory queries describe host memory
    (allocated: this process's resident memory), streams and graphs do not exist and
    synchronisation does nothing.
    """

    def __init__(self) -> None:
        self._cuda = _acc.is_cuda()
        self._name = "cuda" if self._cuda else "cpu"
        self._communication_backend_name = _acc.default_backend()
        self._compile_backend = "inductor"

    # -- identity ------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def device_name(self, device_index: Optional[int] = None) -> str:
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def device(self, device_index: Optional[int] = None):
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    # -- random numbers --------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds CUDA's current device too

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._cuda:
            torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- streams and events (CUDA; the CPU has none) ----------------------------------------
    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: Optional[int] = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else None

    def is_current_stream_capturing(self) -> bool:
        return bool(self._cuda and torch.cuda.is_current_stream_capturing())

    # -- memory ----------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss()

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else _rss()

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else _rss()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: Optional[int] = None) -> dict:
        return torch.cuda.memory_stats(device_index) if self._cuda else {}

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return _proc_meminfo("MemTotal") or 0

    def available_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return _proc_meminfo("MemAvailable") or 0

    # -- data types --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True  # shardtrain trains fp16 on the CPU too (slowly)

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> List[torch.dtype]:
        out = [torch.float32, torch.float16]
        return out + [torch.bfloat16] if self.is_bf16_supported() else out

    def _tensor(dtype: torch.dtype):  # noqa: N805 - builds the properties below
        return property(lambda self: functools.partial(torch.tensor, dtype=dtype,
                                                       device=self._name))

    BFloat16Tensor = _tensor(torch.bfloat16)
    ByteTensor = _tensor(torch.uint8)
    DoubleTensor = _tensor(torch.float64)
    FloatTensor = _tensor(torch.float32)
    HalfTensor = _tensor(torch.float16)
    IntTensor = _tensor(torch.int32)
    LongTensor = _tensor(torch.int64)
    del _tensor

    # -- host memory -----------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- profiling ranges and callbacks -------------------------------------------------------
    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> None:
        if self._cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    # -- compiled ops and launch environment ---------------------------------------------------
    def is_triton_supported(self) -> bool:
        return False

    def op_builder_dir(self) -> Optional[str]:
        return None  # shardtrain compiles nothing

    def create_op_builder(self, class_name: str):
        return None

    def get_op_builder(self, class_name: str):
        return None

    def export_envs(self) -> List[str]:
        return ["NCCL"] if self._cuda else []

    def visible_devices_envs(self) -> List[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: List[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    def __repr__(self) -> str:
        return f"<deepspeed accelerator {self._name!r} (shardtrain)>"


_accelerator: Optional[DeepSpeedAccelerator] = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator of this process (made on first use)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = DeepSpeedAccelerator()
    return _accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Replaces the object :func:`get_accelerator` returns (DeepSpeed's hook for tests and
    out-of-tree devices): a :class:`DeepSpeedAccelerator`, or an instance of a subclass that
    overrides some of its methods.

    It changes what scripts get from ``get_accelerator()``, not the device shardtrain trains on,
    which :mod:`shardtrain.accelerator` decides (CUDA when available, ``SHARDTRAIN_ACCELERATOR=cpu``
    for the CPU).

    Raises:
        TypeError: ``accel_obj`` is not a :class:`DeepSpeedAccelerator` (DeepSpeed's own
            accelerator classes, such as ``CUDA_Accelerator``, are not part of the alias).
    """
    global _accelerator
    if not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(
            f"set_accelerator() takes a deepspeed.accelerator.DeepSpeedAccelerator, got "
            f"{type(accel_obj).__module__}.{type(accel_obj).__qualname__}: pass "
            "get_accelerator() (or an instance of a subclass of DeepSpeedAccelerator). The "
            "training device is chosen by shardtrain itself (SHARDTRAIN_ACCELERATOR=cpu for the CPU).")
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    return True

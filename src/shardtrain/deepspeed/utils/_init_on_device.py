"""``deepspeed.OnDevice``: build a model's tensors on a given device (``meta`` to allocate
nothing) and, optionally, in a given floating-point dtype."""
from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """A context under which new tensors are created on ``device`` (default ``meta``) and
    floating-point ones in ``dtype`` when given.

    Example:
        >>> with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        ...     model = build()            # shapes only, no memory
    """

    def __init__(self, dtype: Optional[torch.dtype] = None,
                 device: Union[str, torch.device] = "meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._device_ctx = None
        self._old_dtype: Optional[torch.dtype] = None

    def __enter__(self) -> "OnDevice":
        if self.enabled:
            self._device_ctx = torch.device(self.device)
            self._device_ctx.__enter__()
            if self.dtype is not None:
                self._old_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc) -> None:
        if self._device_ctx is not None:
            self._device_ctx.__exit__(*exc)
            self._device_ctx = None
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None

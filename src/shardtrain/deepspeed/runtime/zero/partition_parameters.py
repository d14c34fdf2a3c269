"""``deepspeed.runtime.zero.partition_parameters``: ZeRO-3 parameters as DeepSpeed names them.

``Init``, ``GatheredParameters`` and ``ZeroParamStatus`` are shardtrain's own
(:mod:`shardtrain.zero`): one class each, whichever path imports them.

DeepSpeed's ``Init`` replaces torch's tensor constructors while it is active, through
:func:`zero_wrapper_for_fp_tensor_constructor`, to create tensors on the device in the
training dtype. shardtrain's ``Init`` replaces no constructor (it partitions each module's
parameters when the module's ``__init__`` ends), so the function is here for code that
wraps or swaps it (the Hugging Face ``prevent_arange_dtype_change``) and is never called
by ``Init`` itself.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ....zero import GatheredParameters, Init, ZeroParamStatus
from ....zero.values import is_partitioned
from ...accelerator import get_accelerator

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "zero_wrapper_for_fp_tensor_constructor",
           "register_external_parameter", "unregister_external_parameter", "get_accelerator",
           "is_zero_param"]

#: torch's own ``arange``, as DeepSpeed keeps it before wrapping constructors
_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: Optional[torch.device] = None) -> Callable:
    """``fn`` with floating-point results cast to ``target_fp_dtype`` and created on
    ``target_device`` when the caller names none (DeepSpeed's constructor wrapper)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None:
            kwargs["device"] = target_device or torch.device(get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


def is_zero_param(parameter) -> bool:
    """True for a parameter partitioned by ZeRO-3."""
    return is_partitioned(parameter)


def _check_external(module, parameter, what: str) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{what}: module must be a torch.nn.Module, got {type(module).__name__}.")
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"{what}: parameter must be a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}.")


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed needs to be told when ``module``'s forward reads a parameter another module
    owns. shardtrain does not: a partitioned parameter read outside its own module's forward
    is gathered when it is accessed, so this only checks its arguments."""
    _check_external(module, parameter, "register_external_parameter")


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """The counterpart of :func:`register_external_parameter` (nothing to undo)."""
    _check_external(module, parameter, "unregister_external_parameter")

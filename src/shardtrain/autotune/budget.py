"""A memory budget per process: the limit the autotuner gives each of its runs.

The autotuner passes the budget in ``SHARDTRAIN_MEMORY_BUDGET`` (a person may set it too, to
reproduce a smaller device). On CUDA the allocator is capped there, so an oversized
micro-batch fails as it would on a smaller device; on the CPU, where it would swap instead of
failing, a forward or step whose measured model states plus activations exceed the budget
raises :class:`OutOfMemoryError` (see :mod:`shardtrain.telemetry._memory_probe`).
"""
from __future__ import annotations

import os
from typing import Optional

from ..memory import parse_size

__all__ = ["MEMORY_BUDGET_ENV", "OutOfMemoryError", "memory_budget_from_env", "parse_size"]


#: Environment variable that gives a process a memory budget in bytes. The autotuner sets it
#: for its trials: on CUDA the allocator is capped there; on the CPU a forward or step whose
#: model states plus activations exceed it raises :class:`OutOfMemoryError`, as a GPU would.
MEMORY_BUDGET_ENV = "SHARDTRAIN_MEMORY_BUDGET"


class OutOfMemoryError(RuntimeError):
    """A step needed more memory than the budget (``SHARDTRAIN_MEMORY_BUDGET``) allows.

    Raised on the CPU, where an oversized batch would swap instead of failing; on CUDA the
    allocator raises ``torch.cuda.OutOfMemoryError`` itself.
    """


def memory_budget_from_env() -> Optional[int]:
    """The budget the autotuner gave this process (``SHARDTRAIN_MEMORY_BUDGET``), if any."""
    text = os.environ.get(MEMORY_BUDGET_ENV)
    if not text:
        return None
    return parse_size(text)

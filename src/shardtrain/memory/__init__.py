"""Memory, in bytes: what a rank's model states take and what the ZeRO formula predicts for
them, how far a block of code raised memory, and byte sizes as people write and read them.

* :mod:`._model_states`: :func:`count_bytes` (distinct storages per category), the ZeRO
  formula (:func:`zero_formula_bytes`), and ``shardtrain estimate``'s rules
  (:class:`BytesPerParam`, :func:`bytes_per_param`, :func:`estimate_model_states`);
* :mod:`._offload`: :class:`StateOffload`, model states moved to host memory and back in
  place (``engine.offload_states()``);
* :mod:`._peak`: :func:`peak_memory`, the host's and the device's peak over a block, and
  :func:`resident_bytes`, the host's now;
* :mod:`._sizes`: :func:`parse_size` (``20GiB`` in options and environment variables) and
  :func:`format_bytes` (``1.5 GiB`` in log lines and tables).

:func:`write_weights` keeps its old import path here; it lives in :mod:`shardtrain.files`.

Example:
    >>> from shardtrain.memory import format_bytes, zero_formula_bytes
    >>> format_bytes(zero_formula_bytes(1_000_000, world_size=8, stage=3))
    '1.9 MiB'
"""
from ..files import write_weights
from ._model_states import (BytesPerParam, bytes_per_param, count_bytes, estimate_model_states,
                            zero_formula_bytes)
from ._offload import STATE_KINDS, StateOffload
from ._peak import peak_memory, resident_bytes
from ._sizes import format_bytes, parse_size

__all__ = ["count_bytes", "zero_formula_bytes", "BytesPerParam", "bytes_per_param",
           "estimate_model_states", "STATE_KINDS", "StateOffload", "write_weights",
           "peak_memory", "resident_bytes", "format_bytes", "parse_size"]

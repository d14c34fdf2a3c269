"""``shardtrain.checkpointing``: DeepSpeed's name (``deepspeed.checkpointing``) for
:mod:`shardtrain.activation_checkpointing`.

It is the very same module object, not a copy of its names: :func:`configure` through one
name sets what :func:`checkpoint` through the other does, and ``reset()``, which rebinds the
module's settings, is seen under both names.
"""
import sys

from . import activation_checkpointing as _activation_checkpointing

__all__ = _activation_checkpointing.__all__

sys.modules[__name__] = _activation_checkpointing

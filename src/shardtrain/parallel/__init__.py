"""Model parallelism on a device mesh: tensor parallelism (AutoTP) and Ulysses sequence
parallelism, composed with ZeRO's data parallelism by the engine.

Tensor parallelism: every split parameter is a plain ``nn.Parameter`` holding this rank's
slice and carries ``tp_split``, a :class:`SplitSpec` (:func:`is_tp_split` tells).
"""
from ._layout import SplitSpec, is_tp_split

__all__ = ["SplitSpec", "is_tp_split"]

"""The device mesh a config asks for: how many ranks split each layer (``tensor_parallel``),
how many split each sequence (``sequence_parallel_size``), and the data-parallel ranks left,
which the batch arithmetic counts (DeepSpeed's rule: the world divided by the model- and
sequence-parallel sizes)."""

from typing import Optional

from ._model import ConfigError
from ._values import _show

__all__ = ["tensor_parallel_size", "data_parallel_world"]


def tensor_parallel_size(block: dict) -> int:
    """The tensor-parallel size of a ``tensor_parallel`` block: ``autotp_size`` (or DeepSpeed's
    older ``tp.tp_size``); 1 when neither asks for more."""
    sizes = [("tensor_parallel.autotp_size", block.get("autotp_size")),
             ("tensor_parallel.tp.tp_size", (block.get("tp") or {}).get("tp_size"))]
    for key, size in sizes:
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ConfigError(f"{key} must be a non-negative integer (the ranks each layer is split "
                              f"over); got {_show(size)}.")
    given = [size for _, size in sizes if size is not None and size > 1]
    if len(set(given)) > 1:
        raise ConfigError(f"tensor_parallel.autotp_size {sizes[0][1]} and tensor_parallel.tp.tp_size "
                          f"{sizes[1][1]} disagree; set one of them.")
    return given[0] if given else 1


def data_parallel_world(world_size: int, tp: int, sp: int, data_parallel_size: Optional[int]) -> int:
    """The data-parallel ranks of a ``world_size`` mesh of ``tp`` x ``sp`` model-parallel ranks."""
    if world_size % (tp * sp):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor_parallel.autotp_size {tp} x "
            f"sequence_parallel_size {sp} = {tp * sp}: launch a multiple of {tp * sp} ranks, or "
            f"choose sizes whose product divides {world_size}.")
    dp = world_size // (tp * sp)
    if data_parallel_size is not None and data_parallel_size != dp:
        raise ConfigError(
            f"data_parallel_size {data_parallel_size} does not match the mesh: world size {world_size} / "
            f"(tensor-parallel {tp} x sequence-parallel {sp}) = {dp} data-parallel ranks; set it to "
            f"{dp} or remove it.")
    return dp

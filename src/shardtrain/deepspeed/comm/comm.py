"""``deepspeed.comm``: DeepSpeed's communication functions, with its signatures.

They pass straight to ``torch.distributed`` on the group the caller names (None: the
world), so a script's own collectives, groups and point-to-point calls work as under
DeepSpeed. The engine itself never calls these: its collectives live in
:mod:`shardtrain.comm`. Besides :mod:`shardtrain.comm`, this is the one module that talks to
``torch.distributed``, because it is a pass-through with DeepSpeed's names.

Before a process group exists (no ``init_distributed`` or ``initialize`` yet), the rank
queries answer for a world of one, as the engine does; a collective then raises
torch's "Default process group has not been initialized".
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as _dist

from ... import comm as _comm
from ...telemetry import comms as _comms
from ... import destroy as _destroy
from ... import init_distributed

__all__ = [
    "ReduceOp", "init_distributed", "is_initialized", "is_available", "destroy_process_group",
    "new_group", "get_world_group", "get_rank", "get_world_size", "get_local_rank",
    "get_global_rank", "get_all_ranks_from_group", "barrier", "monitored_barrier", "broadcast",
    "broadcast_object_list", "all_reduce", "inference_all_reduce", "all_reduce_coalesced",
    "reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "allgather_fn",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
    "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "gather", "scatter", "has_all_gather_into_tensor", "has_reduce_scatter_tensor",
    "has_all_reduce_coalesced", "has_coalescing_manager", "configure", "log_summary",
    "reset_log", "get_backend",
]

ReduceOp = _dist.ReduceOp


def is_initialized() -> bool:
    return _comm.is_initialized()


def is_available() -> bool:
    return _dist.is_available()


def destroy_process_group(group=None) -> None:
    """The world group: shardtrain's orderly teardown (ranks meet first); another group:
    torch's."""
    if group is None or group is _dist.group.WORLD:
        _destroy()
    else:
        _dist.destroy_process_group(group)


def new_group(ranks: Optional[List[int]] = None, **kwargs: Any):
    return _dist.new_group(ranks=ranks, **kwargs)


def get_world_group():
    return _dist.group.WORLD


def get_backend(group=None) -> Optional[str]:
    return _dist.get_backend(group) if is_initialized() else None


def get_rank(group=None) -> int:
    if not is_initialized():
        return 0
    return _dist.get_rank(group) if group is not None else _dist.get_rank()


def get_world_size(group=None) -> int:
    if not is_initialized():
        return 1
    return _dist.get_world_size(group) if group is not None else _dist.get_world_size()


def get_local_rank() -> int:
    return _comm.get_local_rank()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    if group is None:
        return group_rank
    return _dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> List[int]:
    if group is None or group is _dist.group.WORLD:
        return list(range(get_world_size()))
    return list(_dist.get_process_group_ranks(group))


def barrier(group=None, async_op: bool = False, device_ids=None):
    if not is_initialized():
        return None
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    return _dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def _logged(op: str, tensor: torch.Tensor, group, call):
    """``call()``, timed into the communication log when it is on (``comms_logger``)."""
    return _comms.timed(op, tensor, lambda: _dist.get_world_size(group), call)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, **_: Any):
    return _logged("broadcast", tensor, group,
                   lambda: _dist.broadcast(tensor, src, group=group, async_op=async_op))


def broadcast_object_list(object_list: List[Any], src: int, group=None, device=None):
    return _dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
               **_: Any):
    """DeepSpeed's ``all_reduce``; ``op`` may also be a name (``"sum"``, ``"avg"``, ...), and
    ``AVG`` works on gloo too (a sum, then a division)."""
    if group is None and (isinstance(op, str) or op == ReduceOp.AVG):
        work = _comm.all_reduce(tensor, op=op, async_op=async_op)
        return work if async_op else None
    return _logged("all_reduce", tensor, group,
                   lambda: _dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None):
    return _dist.all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(tensors: List[torch.Tensor], op=ReduceOp.SUM, group=None,
                         async_op: bool = False):
    handles = [_dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return handles[-1] if async_op and handles else None


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False,
           **_: Any):
    return _logged("reduce", tensor, group,
                   lambda: _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op))


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False, **_: Any):
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: List[Any], obj: Any, group=None):
    return _dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False, **_: Any):
    return _logged("all_gather", tensor, group, lambda: _dist.all_gather_into_tensor(
        output_tensor, tensor, group=group, async_op=async_op))


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                 async_op: bool = False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor],
                         group=None, async_op: bool = False):
    handles = [_dist.all_gather_into_tensor(o, i, group=group, async_op=async_op)
               for o, i in zip(output_tensors, input_tensors)]
    return handles[-1] if async_op and handles else None


def reduce_scatter(output: torch.Tensor, input_list: List[torch.Tensor], op=ReduceOp.SUM,
                   group=None, async_op: bool = False, **_: Any):
    return _dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                          op=ReduceOp.SUM, group=None, async_op: bool = False, **_: Any):
    return _logged("reduce_scatter", input_tensor, group, lambda: _dist.reduce_scatter_tensor(
        output_tensor, input_tensor, op=op, group=group, async_op=async_op))


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM,
                      group=None, async_op: bool = False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False, **_: Any):
    return _logged("all_to_all", tensor, group, lambda: _dist.all_to_all_single(
        output, tensor, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
        group=group, async_op=async_op))


def all_to_all(output_tensor_list: List[torch.Tensor], input_tensor_list: List[torch.Tensor],
               group=None, async_op: bool = False):
    return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    return _dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0):
    return _dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    return _dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0):
    return _dist.irecv(tensor, src, group=group, tag=tag)


def batch_isend_irecv(p2p_op_list):
    return _dist.batch_isend_irecv(p2p_op_list)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None,
           async_op: bool = False):
    return _dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None,
            async_op: bool = False):
    return _dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group,
                         async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None,
              debug=None) -> None:
    """Starts or stops the communication log (:mod:`shardtrain.telemetry.comms`): the
    ``comms_logger`` block of ``deepspeed_config`` (a config dict or a loaded config), then
    the arguments given."""
    block: Any = {}
    if deepspeed_config is not None:
        block = deepspeed_config.get("comms_logger", {}) if isinstance(deepspeed_config, dict) \
            else getattr(deepspeed_config, "comms_logger", {})
    if not isinstance(block, dict):
        block = block.model_dump()
    given = {"enabled": enabled, "prof_all": prof_all, "prof_ops": prof_ops,
             "verbose": verbose, "debug": debug}
    settings = {**{"enabled": False, "prof_all": True, "prof_ops": [], "verbose": False,
                   "debug": False}, **block, **{k: v for k, v in given.items() if v is not None}}
    _comms.configure(bool(settings["enabled"]), bool(settings["prof_all"]),
                     settings["prof_ops"] or (), bool(settings["verbose"]), bool(settings["debug"]))


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Logs the communication log's table on rank 0 (see :mod:`shardtrain.telemetry.comms`;
    with ``show_straggler`` every rank must call it); with ``return_dict`` returns this
    rank's summary."""
    rows = _comms.log_summary(show_straggler)
    return rows if return_dict else None


def reset_log() -> None:
    """Forgets what the communication log recorded."""
    _comms.reset()


"""Process groups and collectives.

This is the only module that imports ``torch.distributed``. Everything else asks it for
ranks and calls its named collectives, so that the rules (how a process finds its rank,
what a world of one process does, how a collective is counted) live in one place.

Example:
    >>> import shardtrain
    >>> shardtrain.init_distributed()     # reads torchrun / SLURM / OpenMPI variables
    >>> shardtrain.comm.get_world_size()
    1
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

__all__ = [
    "init_distributed", "destroy", "is_initialized", "get_rank", "get_world_size",
    "get_local_rank", "get_local_world_size", "get_backend", "available_backends", "barrier",
    "ReduceOp", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "broadcast_coalesced",
    "scatter",
    "all_gather_object", "broadcast_object", "Work", "add_observer", "remove_observer",
    "LaunchEnv", "detect_launch_env", "SideGroup", "side_group", "before_destroy",
]

logger = logging.getLogger("shardtrain")

# DeepSpeed reads its timeout (in minutes) from this variable; we honour the same name.
_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"
_DEFAULT_TIMEOUT_MIN = 10


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from its launcher's variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "openmpi", "explicit" or "single"


_owns_group = False  # True when this module created the default group (and must destroy it)
_observers: List[Callable[[str, torch.Tensor], None]] = []


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _master(default_addr: str, port: int) -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR") or default_addr
    return addr, _env_int("MASTER_PORT") or port


def detect_launch_env(distributed_port: int = 29500) -> LaunchEnv:
    """Reads rank, world size and rendezvous address from the launcher's variables.

    Order: torchrun (RANK/WORLD_SIZE/LOCAL_RANK), SLURM (SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID), OpenMPI (OMPI_COMM_WORLD_*); with none of these, a single process.
    """
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None:
        addr, port = _master("127.0.0.1", distributed_port)
        return LaunchEnv(rank, world, _env_int("LOCAL_RANK") or 0, addr, port, "torchrun")
    if _env_int("SLURM_PROCID") is not None and _env_int("SLURM_NTASKS") is not None:
        # srun starts every task itself; the first node is the rendezvous host.
        default = os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
        addr, port = _master(default, distributed_port)
        return LaunchEnv(_env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS"),
                         _env_int("SLURM_LOCALID") or 0, addr, port, "slurm")
    if _env_int("OMPI_COMM_WORLD_RANK") is not None:
        addr, port = _master("127.0.0.1", distributed_port)
        return LaunchEnv(_env_int("OMPI_COMM_WORLD_RANK"), _env_int("OMPI_COMM_WORLD_SIZE") or 1,
                         _env_int("OMPI_COMM_WORLD_LOCAL_RANK") or 0, addr, port, "openmpi")
    return LaunchEnv(0, 1, 0, "127.0.0.1", distributed_port, "single")


def _timeout() -> datetime.timedelta:
    minutes = float(os.environ.get(_TIMEOUT_ENV, _DEFAULT_TIMEOUT_MIN))
    return datetime.timedelta(minutes=minutes)


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None,
                     init_method: Optional[str] = None, dist_init_required: Optional[bool] = None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """Joins (or creates) the default process group.

    Reads torchrun's, SLURM's or OpenMPI's variables; with none of them, runs as a world of
    one process with no launcher and no network port. If ``torch.distributed`` is already
    initialised, that group is adopted as it is.

    Args:
        dist_backend: "nccl", "gloo", ...; default: NCCL when CUDA is used, else gloo.
        distributed_port: rendezvous port when the launcher gives none (MASTER_PORT wins).
        timeout: collective timeout; default 10 minutes or ``$DEEPSPEED_TIMEOUT`` minutes.
        init_method: a torch init URL (``tcp://host:port``, ``file://...``) to use instead of env.
        rank, world_size: explicit values; both must be given together.

    Example:
        >>> shardtrain.init_distributed()            # under torchrun, srun, mpirun or alone
    """
    global _owns_group
    del auto_mpi_discovery, verbose, config  # accepted for DeepSpeed compatibility
    if dist.is_initialized() or dist_init_required is False:
        return
    from . import accelerator  # local import: accelerator does not depend on comm
    backend = dist_backend or accelerator.default_backend()
    timeout = timeout or _timeout()
    env = detect_launch_env(distributed_port)
    if (rank >= 0) != (world_size > 0):
        raise ValueError(f"init_distributed: give rank and world_size together (got rank={rank}, "
                         f"world_size={world_size}).")
    if rank >= 0:
        env = LaunchEnv(rank, world_size, env.local_rank, env.master_addr, env.master_port,
                        "explicit")
    accelerator.set_local_device(env.local_rank)
    _import_dynamo_first()
    if env.world_size == 1 and init_method is None:
        # A world of one needs no rendezvous: an in-process store avoids taking a port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(backend, init_method=init_method or "env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout)
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    _owns_group = True
    atexit.register(_destroy_at_exit)
    logger.debug("process group: backend=%s rank=%d world=%d via %s", backend, env.rank,
                 env.world_size, env.source)


def _import_dynamo_first() -> None:
    """Imports torch._dynamo before the group exists. Imported later (torch.optim and
    torch.compile import it), it keeps references to the default group (torch 2.13), so the
    group outlives destroy() and is torn down while the interpreter exits; a gloo worker
    thread that then drops its last collective's tensors needs the GIL, cannot take it and
    aborts the process ("terminate called without an active exception") after the script
    has finished."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as err:  # a broken optional dependency must not stop training
        logger.debug("torch._dynamo not imported before the process group: %s", err)


def _destroy_at_exit() -> None:
    # A script may end without destroy(); tearing the group down here keeps NCCL and gloo
    # from complaining (or aborting) while the interpreter shuts down.
    if _owns_group and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError as err:  # another atexit handler may have torn it down
            logger.debug("destroy at exit: %s", err)


def destroy() -> None:
    """Tears down the default process group (safe to call twice); call it on every rank.

    The ranks meet first: a rank that finished its last collective may otherwise close its
    connections while a peer is still receiving that collective's final bytes, and the peer
    aborts.
    """
    global _owns_group, _side
    for fn in list(_before_destroy):
        fn()
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    _owns_group, _side = False, None


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", detect_launch_env().local_rank))


def get_local_world_size() -> int:
    """Processes on this machine: torchrun's LOCAL_WORLD_SIZE (SLURM's and OpenMPI's too),
    else the whole world."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        # SLURM writes "4" or, for uneven nodes, "4(x2),3": the first node's count is enough
        # to tell one machine from several.
        digits = re.match(r"\d+", os.environ.get(name, ""))
        if digits and int(digits.group()):
            return int(digits.group())
    return get_world_size()


def get_backend() -> Optional[str]:
    return dist.get_backend() if is_initialized() else None


def available_backends() -> dict:
    """Which communication backends this torch build has (read-only flags)."""
    if not dist.is_available():
        return {"distributed": False}
    checks = {"nccl": "is_nccl_available", "gloo": "is_gloo_available",
              "mpi": "is_mpi_available", "ucc": "is_ucc_available", "xccl": "is_xccl_available"}
    return {name: bool(getattr(dist, fn)()) for name, fn in checks.items() if hasattr(dist, fn)}


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


class Work:
    """A handle on an asynchronous collective; ``wait()`` is idempotent."""

    def __init__(self, handle=None, then: Optional[Callable[[], None]] = None):
        self._handle, self._then = handle, then

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def add_observer(fn: Callable[[str, torch.Tensor], None]) -> None:
    """Calls ``fn(op_name, tensor)`` for every collective issued (for tests and profiling)."""
    _observers.append(fn)


def remove_observer(fn: Callable[[str, torch.Tensor], None]) -> None:
    _observers.remove(fn)


def _notify(op: str, tensor: torch.Tensor) -> None:
    for fn in _observers:
        fn(op, tensor)


#: torch's reduction operations, so that ``comm.ReduceOp.SUM`` reads as in DeepSpeed scripts.
ReduceOp = dist.ReduceOp

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


def _reduce_op(op) -> "dist.ReduceOp":
    if isinstance(op, str) and op.lower() in _REDUCE_OPS:
        return _REDUCE_OPS[op.lower()]
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        for known in _REDUCE_OPS.values():
            if op == known:
                return known
    raise ValueError(f"all_reduce: op {op!r} is not supported; use one of {', '.join(_REDUCE_OPS)} "
                     "or the matching comm.ReduceOp.")


def _check_group(group) -> None:
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("shardtrain's collectives run on the world group only; pass group=None.")


def all_reduce(tensor: torch.Tensor, op="sum", group=None, async_op: bool = False) -> Work:
    """Reduces ``tensor`` in place across ranks: ``op`` is ``"sum"`` (default), ``"max"``,
    ``"min"``, ``"product"`` or ``"avg"``, or the matching :data:`ReduceOp`; ``group`` must be
    None (the world). A world of one returns at once."""
    reduce_op = _reduce_op(op)
    _check_group(group)
    _notify("all_reduce", tensor)
    if get_world_size() == 1:
        return Work()
    if reduce_op == dist.ReduceOp.AVG and dist.get_backend() != "nccl":  # gloo has no AVG: sum, divide
        world = get_world_size()
        handle = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=async_op)
        if not async_op:
            tensor.div_(world)
            return Work()
        return Work(handle, then=lambda: tensor.div_(world))
    handle = dist.all_reduce(tensor, op=reduce_op, async_op=async_op)
    return Work(handle)


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
    """Sums ``input`` (``world`` equal rows, flattened) across ranks; rank r receives row r
    in ``output``."""
    _notify("reduce_scatter", input)
    if get_world_size() == 1:
        output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return Work()
    return Work(_reduce_scatter_flat(output, input, async_op=async_op))


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
    """Concatenates every rank's ``input`` into ``output`` (rank order)."""
    _notify("all_gather", input)
    if get_world_size() == 1:
        output.view(-1).copy_(input.view(-1))
        return Work()
    return Work(_all_gather_flat(output, input, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    _notify("broadcast", tensor)
    if get_world_size() > 1:
        dist.broadcast(tensor, src=src)


def scatter(output: torch.Tensor, rows: Optional[torch.Tensor], src: int = 0,
            async_op: bool = False) -> Work:
    """Rank ``src`` sends row r of ``rows`` (``[world, n]``, read on ``src`` only; None
    elsewhere) to rank r, which receives it in ``output`` (``n`` elements)."""
    _notify("scatter", output)
    if get_world_size() == 1:
        output.view(-1).copy_(rows[0].view(-1))
        return Work()
    chunks = list(rows.unbind(0)) if get_rank() == src else None
    return Work(dist.scatter(output, chunks, src=src, async_op=async_op))


def all_gather_object(obj, group: Optional["SideGroup"] = None) -> list:
    """Gathers one picklable object from every rank (small metadata only); over ``group``
    (a :func:`side_group`) when given."""
    if get_world_size() == 1:
        return [obj]
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=group.handle if group is not None else None)
    return out


class SideGroup:
    """A second process group over every rank (gloo), for work that runs beside training in
    another thread: collectives on the default group are matched by order, so a background
    thread must never issue one there."""

    def __init__(self, handle):
        self.handle = handle


_side: Optional[SideGroup] = None
_before_destroy: List[Callable[[], None]] = []


def side_group() -> SideGroup:
    """The process's side group, created on first use (a collective: every rank calls it at
    the same point, from the main thread)."""
    global _side
    if _side is None:
        _side = SideGroup(dist.new_group(backend="gloo") if get_world_size() > 1 else None)
    return _side


def before_destroy(fn: Callable[[], None]) -> None:
    """Runs ``fn`` at the start of :func:`destroy` (to finish work that uses the groups)."""
    if fn not in _before_destroy:
        _before_destroy.append(fn)


def broadcast_object(obj, src: int = 0):
    """Sends rank ``src``'s picklable object to every rank (small metadata only)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_coalesced(tensors: List[torch.Tensor], src: int = 0,
                        chunk_numel: int = 64 * 1024 * 1024) -> None:
    """Broadcasts many tensors in place from ``src`` with one collective per dtype chunk."""
    if get_world_size() == 1 or not tensors:
        return
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        chunk: List[torch.Tensor] = []
        size = 0
        for t in group + [None]:
            if t is None or (chunk and size + t.numel() > chunk_numel):
                _broadcast_flat(chunk, src)
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += t.numel()


def _broadcast_flat(chunk: List[torch.Tensor], src: int) -> None:
    if not chunk:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    broadcast(flat, src)
    offset = 0
    with torch.no_grad():
        for t in chunk:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

"""The default process group: joining it, leaving it, who this process is in it, how long a
collective may wait by default, and the rendezvous store it was made through.

:func:`init_distributed` reads torchrun's, SLURM's or OpenMPI's variables (a world of one
needs none) and creates the group, or adopts one a caller created; :func:`destroy` leaves it.
Modules above register what must happen around that (:func:`before_destroy`, and the
groups and the trail forgetting themselves after it).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

import torch.distributed as dist

if TYPE_CHECKING:
    from ._groups import Group

logger = logging.getLogger("shardtrain")

# DeepSpeed reads its timeout (in minutes) from this variable; we honour the same name.
_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"
_TIMEOUT_SECONDS_ENV = "SHARDTRAIN_COLLECTIVE_TIMEOUT"  # seconds; wins over DEEPSPEED_TIMEOUT
_DEFAULT_TIMEOUT_MIN = 10

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Set by the first failed collective: the group is broken, destroy() holds no meeting.
broken = False
_before_destroy: List[Callable[[], None]] = []
_after_destroy: List[Callable[[], None]] = []  # the layers above forget their state


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


def timeout_override() -> Optional[float]:
    """``$SHARDTRAIN_COLLECTIVE_TIMEOUT`` in seconds, which wins over every configured bound."""
    seconds = os.environ.get(_TIMEOUT_SECONDS_ENV)
    return float(seconds) if seconds else None


def default_timeout() -> float:
    """Seconds a collective may wait by default: ``$SHARDTRAIN_COLLECTIVE_TIMEOUT``, else
    ``$DEEPSPEED_TIMEOUT`` minutes, else 10 minutes (DeepSpeed's default)."""
    return _timeout().total_seconds()


def _timeout() -> datetime.timedelta:
    seconds = os.environ.get(_TIMEOUT_SECONDS_ENV)
    if seconds:
        return datetime.timedelta(seconds=float(seconds))
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
    from .. import accelerator  # local import: accelerator does not depend on comm
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
    if backend == "nccl":
        _set_up_flight_recorder()
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


#: NCCL's flight recorder (torch's names, old and new): a ring of the last collectives each
#: rank issued, written to ``<prefix><rank>`` when the watchdog times a collective out. A
#: value the user set wins.
FLIGHT_RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
_FR_PREFIX_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_prefix() -> str:
    """Where NCCL's flight recorder writes its dumps (the rank number is appended)."""
    for name in _FR_PREFIX_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return os.path.join(tempfile.gettempdir(), "shardtrain-nccl-trace", "rank_")


def _set_up_flight_recorder() -> None:
    """Turns NCCL's flight recorder on before the process group exists (it reads these
    variables when it is made)."""
    for name, value in FLIGHT_RECORDER_ENV.items():
        os.environ.setdefault(name, value)
    prefix = flight_recorder_prefix()
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
    for name in _FR_PREFIX_ENV:
        os.environ.setdefault(name, prefix)


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
    aborts. After a :class:`CollectiveError` the group is broken: no meeting, and the group is
    torn down as far as it can be.
    """
    global _owns_group
    for fn in list(_before_destroy):
        fn()
    if dist.is_initialized():
        if broken:
            try:
                dist.destroy_process_group()
            except RuntimeError as err:  # the peers are gone: nothing left to say to them
                logger.debug("destroy after a failed collective: %s", err)
        else:
            if dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()
    _owns_group = False
    for fn in list(_after_destroy):
        fn()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Optional["Group"] = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    if not is_initialized() or (group is not None and group.solo):
        return 0
    return dist.get_rank(group.handle) if group is not None and group.handle is not None \
        else dist.get_rank()


def get_world_size(group: Optional["Group"] = None) -> int:
    """Ranks in ``group`` (default: the world)."""
    if not is_initialized() or (group is not None and group.solo):
        return 1
    return dist.get_world_size(group.handle) if group is not None and group.handle is not None \
        else dist.get_world_size()


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



def default_store():
    """The rendezvous store every rank joined at start (it still answers after the group
    broke, while its host lives); None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as err:
        logger.debug("no rendezvous store: %s", err)
        return None


def before_destroy(fn: Callable[[], None]) -> None:
    """Runs ``fn`` at the start of :func:`destroy` (to finish work that uses the groups)."""
    if fn not in _before_destroy:
        _before_destroy.append(fn)


def after_destroy(fn: Callable[[], None]) -> None:
    """Runs ``fn`` at the end of :func:`destroy` (for the modules of this package)."""
    if fn not in _after_destroy:
        _after_destroy.append(fn)

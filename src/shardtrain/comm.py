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
import contextlib
import datetime
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _failure, _trail

__all__ = [
    "init_distributed", "destroy", "is_initialized", "get_rank", "get_world_size",
    "get_local_rank", "get_local_world_size", "get_backend", "available_backends", "barrier",
    "ReduceOp", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "broadcast_coalesced",
    "scatter", "all_to_all_single",
    "all_gather_object", "broadcast_object", "Work", "add_observer", "remove_observer",
    "split_groups", "CollectiveError", "DivergenceError", "set_position", "labelled", "mark",
    "set_check", "check_agreement", "set_timeout", "timeout_override", "default_timeout",
    "trail", "trail_dir", "keep_trail", "CHECK_MODES", "check_mode", "flight_recorder_prefix", "FLIGHT_RECORDER_ENV",
    "LaunchEnv", "detect_launch_env", "Group", "WORLD", "SideGroup", "side_group",
    "before_destroy", "MESH_DIMS", "Mesh", "init_mesh",
]

logger = logging.getLogger("shardtrain")

# DeepSpeed reads its timeout (in minutes) from this variable; we honour the same name.
_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"
_TIMEOUT_SECONDS_ENV = "SHARDTRAIN_COLLECTIVE_TIMEOUT"  # seconds; wins over DEEPSPEED_TIMEOUT
_failures = 0  # collectives that failed in this process: the group is broken after one
_ROLL_CALL_SECONDS = 5.0  # how long the survivors of a failed collective wait for each other
_DEFAULT_TIMEOUT_MIN = 10
_TRAIL_LENGTH_ENV = "SHARDTRAIN_TRAIL_LENGTH"  # collectives each rank remembers; 0: none
_TRAIL_DIR_ENV = "SHARDTRAIN_TRAIL_DIR"
_CHECK_ENV = "SHARDTRAIN_DIVERGENCE_CHECK"  # "off", "step" or "collective"; wins over config
CHECK_MODES = ("off", "step", "collective")


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
_observers: List[Tuple[Callable[..., None], bool]] = []


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


def set_timeout(seconds: float) -> None:
    """Bounds how long each collective issued from now on may wait, over the world and every
    group made here but the side group (whose work waits on I/O); a call that waits longer
    fails with a :class:`CollectiveError`."""
    if not is_initialized() or get_world_size() == 1:
        return
    bound = datetime.timedelta(seconds=seconds)
    dist.distributed_c10d._set_pg_timeout(bound, None)
    for group in _made:
        if group.name != "side":
            dist.distributed_c10d._set_pg_timeout(bound, group.handle)


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
    global _owns_group, _side
    for fn in list(_before_destroy):
        fn()
    if dist.is_initialized():
        if _failures:
            try:
                dist.destroy_process_group()
            except RuntimeError as err:  # the peers are gone: nothing left to say to them
                logger.debug("destroy after a failed collective: %s", err)
        else:
            if dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()
    # Every rank got here (the barrier): no peer will need this trail. A rank that ends
    # without destroy() leaves its file for a waiting peer; the next job removes it.
    _close_trail(remove=not _failures)
    _owns_group, _side = False, None
    _made.clear()


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


def barrier(group: Optional["Group"] = None) -> None:
    if get_world_size(group) > 1:
        _trace("barrier", None, group)
        _guarded("barrier", group, None, lambda: dist.barrier(group=_handle(group)))


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within the timeout: the message names this
    rank, the collective, where training was (:func:`set_position`), the first collective at
    which the ranks' trails differ, and the ranks of the group that did not answer the
    survivors' roll call through the rendezvous store."""


class DivergenceError(CollectiveError):
    """The ranks issued different collectives (found by :func:`check_agreement` or the
    per-collective check while the group still worked): the message names the first one."""


_position: Optional[Callable[[], str]] = None
_label = ""  # the module a ZeRO-3 gather fetches (labelled())


def set_position(describe: Optional[Callable[[], str]],
                 replacing: Optional[Callable[[], str]] = None) -> None:
    """``describe()`` says where this rank is (``"step 3, micro-step 2, backward"``) when a
    collective fails; the engine sets it. With ``replacing``, only if that is the one set
    (an engine released after a newer one was built leaves the newer one's)."""
    global _position
    if replacing is None or _position is replacing:
        _position = describe


@contextlib.contextmanager
def labelled(name: str) -> Iterator[None]:
    """Collectives issued inside the block carry ``name`` in the trail (the module whose
    parameters a ZeRO-3 gather fetches), so that a rank that skipped it is named with it.

    Example:
        >>> with comm.labelled("blocks.1"):
        ...     comm.all_gather(out, mine)
    """
    global _label
    outer, _label = _label, name
    try:
        yield
    finally:
        _label = outer


def mark(event: str, label: str, group: Optional["Group"] = None) -> None:
    """Records in the trail a point that every rank of ``group`` passes in the same order,
    though no collective (ZeRO-3 marks the forward of each module: its gathers are matched
    by order, and a rank that skips a module is named with it).

    Example:
        >>> comm.mark("forward", "blocks.1", zero_group)
    """
    g = WORLD if group is None else group
    if _trail_off or g.solo:
        return
    t = _trail_now if _trail_now is not None else trail()
    if t is not None:
        t.record(g.name, g.pg_name() + _trail.ORDER, g.spans(), event, 0, "", label,
                 _position() if _position is not None else "")


def _guarded(op: str, group: Optional["Group"], tensor: Optional[torch.Tensor],
             call: Callable[[], object]):
    """``call()``; a failure of torch's collective becomes a :class:`CollectiveError` that
    says who and where."""
    global _in_collective
    _in_collective += 1
    try:
        return call()
    except RuntimeError as err:  # torch's DistBackendError and gloo's timeouts included
        if isinstance(err, CollectiveError):
            raise
        error = CollectiveError(_explain(op, group, tensor, err))
        _end_if_stopped(str(error))
        raise error from err
    finally:
        _in_collective -= 1
        if not _in_collective:
            _end_if_stopped(None)


# torchrun stops the other workers with SIGTERM as soon as one fails; a survivor blocked in
# a collective with the dead one would end before saying what it was doing. While a
# collective runs (or its failure is being explained), SIGTERM therefore waits: afterwards the
# report is printed and the process ends by the same signal. Anywhere else it ends the
# process at once, as before.
_in_collective = 0
_stop_pending = False


def _install_stop_handler() -> None:
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the script's own handler stays
    signal.signal(signal.SIGTERM, _on_stop)


def _on_stop(signum, frame) -> None:
    global _stop_pending
    if _in_collective:
        _stop_pending = True
        return
    _end(signum)


def _end_if_stopped(report: Optional[str]) -> None:
    if _stop_pending:
        if report:
            sys.stderr.write(report + "\n")
            sys.stderr.flush()
        _end(signal.SIGTERM)


def _end(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _explain(op: str, group: Optional["Group"], tensor: Optional[torch.Tensor],
             err: BaseException) -> str:
    global _failures
    _failures += 1
    me = get_rank()
    ranks = group.ranks() if group is not None else list(range(get_world_size()))
    what = op if tensor is None else (f"{op} of {tensor.numel():,} {_dtype_name(tensor.dtype)} "
                                      f"elements")
    where = _position() if _position is not None else "outside a training step"
    name = group.name if group is not None else "world"
    cause = " ".join(str(err).split())[:300]
    head = (f"rank {me}: {what} over the {name} group (ranks {_trail.spans(ranks)}) failed at "
            f"{where}: {cause}")
    found = _failure.inquire(_short_store(), _failures, ranks, me, _own_entries(), _ROLL_CALL_SECONDS)
    lines = [head]
    diff = _trail.first_difference(found.trails, order=found.trails.get(me))
    if diff is not None:
        lines.append(diff.explain(found.ended))
    lines.append(_who_is_gone(found, diff is not None))
    if get_backend() == "nccl":
        lines.append(f"NCCL's flight recorder writes each rank's last collectives to "
                     f"{flight_recorder_prefix()}<rank> when its watchdog times one out; "
                     f"compare them with: python -m torch.distributed.flight_recorder.fr_trace "
                     f"{os.path.dirname(flight_recorder_prefix())} --prefix "
                     f"{os.path.basename(flight_recorder_prefix())}")
    return "\n".join([lines[0]] + ["  " + line.replace("\n", "\n  ") for line in lines[1:]])


def _who_is_gone(found: "_failure.Findings", differ: bool) -> str:
    if found.missing is None:
        return ("The rendezvous store, which rank 0 hosts, does not answer: rank 0 ended or "
                "its node cannot be reached; its output says why.")
    ended = sorted(found.ended)
    silent = [r for r in found.missing if r not in found.ended]
    parts = []
    if ended:
        parts.append(f"Rank(s) {_trail.spans(ended)} ended (their process is gone); their "
                     "output says why.")
    if silent:
        parts.append(f"Rank(s) {_trail.spans(silent)} did not answer within "
                     f"{_ROLL_CALL_SECONDS:.0f} s: ended, or stuck before this collective (in "
                     "a different branch, a data loader, I/O); their output says where.")
    if not parts and differ:
        parts.append("Every rank of the group answered: the difference above is the cause.")
    elif not parts:
        parts.append("Every rank of the group answered: they issued different collectives, "
                     "the network between them failed, or torch refused the call itself (see "
                     "the cause).")
    return " ".join(parts)


def _default_store():
    """The rendezvous store; None when there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as err:
        logger.debug("no rendezvous store: %s", err)
        return None


def _short_store():
    """The rendezvous store with a short timeout, after a failure (a dead host must not
    stall the report; the broken group needs no rendezvous any more)."""
    store = _default_store()
    if store is not None:
        store.set_timeout(datetime.timedelta(seconds=_ROLL_CALL_SECONDS))
    return store


# -- the collective trail ------------------------------------------------------------------

_trail_now: Optional[_trail.Trail] = None
_trail_off = False  # SHARDTRAIN_TRAIL_LENGTH=0, a world of one, or the file could not be made
_check = "off"


def trail() -> Optional[_trail.Trail]:
    """This rank's :class:`~shardtrain._trail.Trail` of collectives (None in a world of one
    or with ``SHARDTRAIN_TRAIL_LENGTH=0``); made at the first collective."""
    global _trail_now, _trail_off
    if _trail_now is not None or _trail_off:
        return _trail_now
    if not is_initialized():
        return None
    slots = int(os.environ.get(_TRAIL_LENGTH_ENV, "1024"))
    if get_world_size() == 1 or slots <= 0:
        _trail_off = True
        return None
    folder = trail_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        _remove_stale_trails(folder)
        path = os.path.join(folder, f"rank{get_rank()}-pid{os.getpid()}.trail")
        _trail_now = _trail.Trail(slots, path)
        store = _default_store()  # its timeout stays: later groups rendezvous through it
        if store is not None:
            _failure.announce_trail(store, get_rank(), path)
    except OSError as err:  # a read-only or full temp dir: keep the trail in memory
        logger.debug("trail file: %s; the trail stays in memory", err)
        _trail_now = _trail.Trail(slots)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun (shardtrain run)
        _install_stop_handler()
    return _trail_now


def trail_dir() -> str:
    """Where the ranks of this machine keep their trail files (``rank<R>-pid<P>.trail``):
    ``$SHARDTRAIN_TRAIL_DIR``, else a folder of this user's in the temporary directory."""
    return os.environ.get(_TRAIL_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), f"shardtrain-trails-{os.getuid() if hasattr(os, 'getuid') else 0}")


def keep_trail(on: bool) -> None:
    """Turns this process's collective trail on (the default) or off. Off, a failed
    collective names no differing collective and the divergence check has nothing to
    compare; every rank must switch at the same point (the positions count from there)."""
    global _trail_off
    _trail_off = not on


_STALE_TRAIL_S = 24 * 3600  # a trail a dead process left is kept a day (shardtrain trails)


def _remove_stale_trails(folder: str) -> None:
    """Trail files that processes which ended without removing theirs (killed, aborted)
    left more than a day ago."""
    old = time.time() - _STALE_TRAIL_S
    for name in os.listdir(folder):
        match = re.fullmatch(r"rank\d+-pid(\d+)\.trail", name)
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            if match and os.path.getmtime(path) < old and _failure.process_gone(int(match.group(1))):
                os.remove(path)


def _close_trail(remove: bool) -> None:
    global _trail_now, _trail_off
    if _trail_now is not None:
        _trail_now.close(remove=remove)
    _trail_now, _trail_off = None, False


def _own_entries() -> List[_trail.Entry]:
    return _trail_now.entries() if _trail_now is not None else []


_DTYPES: Dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).replace("torch.", "")
    return name


def _trace(op: str, tensor: Optional[torch.Tensor], group: Optional["Group"]) -> None:
    """Writes the collective into the trail (and checks it in the per-collective mode)."""
    g = WORLD if group is None else group
    if g.solo or g.name == "side":  # the side group's calls come from other threads
        return
    t = _trail_now if _trail_now is not None else trail()
    if t is None:
        return
    ranks = g.spans()
    if "," not in ranks and "-" not in ranks:
        return  # a group of one rank
    t.record(g.name, g.pg_name(), ranks, op, 0 if tensor is None else tensor.numel(),
             "" if tensor is None else _dtype_name(tensor.dtype), _label,
             _position() if _position is not None else "")
    if _check == "collective":
        _check_group(g, f"before {op} over the {g.name} group")


# -- the divergence check ----------------------------------------------------------------

def set_check(mode: str) -> None:
    """How the ranks compare their collectives while the group works: ``"off"``; ``"step"``
    (:func:`check_agreement` at each optimizer step: one small all-gather); ``"collective"``
    (before every collective, over its group: for debugging, it doubles the collectives).
    ``$SHARDTRAIN_DIVERGENCE_CHECK`` wins over ``mode``."""
    global _check
    mode = os.environ.get(_CHECK_ENV) or mode
    if mode not in CHECK_MODES:
        raise ValueError(f"divergence check {mode!r} is not one of {', '.join(CHECK_MODES)} "
                         f"(from {_CHECK_ENV} or diagnostics.divergence_check).")
    _check = mode


def check_mode() -> str:
    return _check


_MAX_GROUPS = 16  # rows per rank in the step check: more groups than a mesh ever makes


def check_agreement(where: str = "at the end of a step") -> None:
    """Compares every rank's count and checksum of the collectives it issued over each group
    (one all-gather of a small tensor over the world); raises :class:`DivergenceError` on
    every rank, naming the first differing collective, when they disagree."""
    t = trail()
    if t is None:
        return
    rows = sorted((zlib.crc32(f"{pg}|{ranks}".encode()), count, crc)
                  for (pg, ranks), (count, crc) in t.fingerprints().items())[:_MAX_GROUPS]
    mine = torch.zeros(_MAX_GROUPS, 3, dtype=torch.int64)
    if rows:
        mine[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
    table = _gather_rows(mine, WORLD)
    agreed: Dict[int, Tuple[int, int]] = {}
    for key, count, crc in table.view(-1, 3).tolist():
        if key and agreed.setdefault(key, (count, crc)) != (count, crc):
            _raise_divergence(WORLD, where)


def _check_group(group: "Group", where: str) -> None:
    table = _gather_rows(torch.tensor(_group_fingerprint(group), dtype=torch.int64), group)
    if (table != table[0]).any():
        _raise_divergence(group, where)


def _group_fingerprint(group: "Group") -> List[int]:
    """Count and checksum of this rank's collectives over ``group``'s process group, and of
    its marks (:func:`mark`)."""
    prints = _trail_now.fingerprints() if _trail_now is not None else {}
    pg, ranks = group.pg_name(), group.spans()
    return [*prints.get((pg, ranks), (0, 0)), *prints.get((pg + _trail.ORDER, ranks), (0, 0))]


def _gather_rows(mine: torch.Tensor, group: "Group") -> torch.Tensor:
    """Every rank's ``mine`` (not traced: the check is not part of the program compared)."""
    from . import accelerator  # local import: accelerator does not depend on comm
    dev = accelerator.device() if get_backend() == "nccl" else torch.device("cpu")
    flat = mine.to(dev).reshape(-1)
    out = torch.empty(group.size() * flat.numel(), dtype=flat.dtype, device=dev)
    _guarded("divergence check", group, flat,
             lambda: _all_gather_flat(out, flat, group=_handle(group)))
    return out.view((group.size(),) + tuple(mine.shape)).cpu()


def _raise_divergence(group: "Group", where: str) -> None:
    size = get_world_size(group)
    trails: List = [None] * size
    _guarded("divergence check", group, None, lambda: dist.all_gather_object(
        trails, (get_rank(), _trail.encode(_own_entries())), group=_handle(group)))
    by_rank = {rank: _trail.decode(text) for rank, text in trails}
    diff = _trail.first_difference(by_rank, order=by_rank.get(get_rank()))
    detail = diff.explain() if diff is not None else (
        "Their counts or checksums differ, but the differing collective is older than the "
        f"trails hold (raise {_TRAIL_LENGTH_ENV}).")
    raise DivergenceError(f"rank {get_rank()}: the ranks of the {group.name} group (ranks "
                          f"{group.spans()}) issued different collectives, found by the check "
                          f"{where}:\n  " + detail.replace("\n", "\n  "))


class Work:
    """A handle on an asynchronous collective; ``wait()`` is idempotent."""

    def __init__(self, handle=None, then: Optional[Callable[[], None]] = None,
                 op: str = "collective", group: Optional["Group"] = None,
                 tensor: Optional[torch.Tensor] = None):
        self._handle, self._then = handle, then
        self._op, self._group, self._tensor = op, group, tensor

    def wait(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _guarded(self._op, self._group, self._tensor, handle.wait)
        if self._then is not None:
            then, self._then = self._then, None
            then()


def add_observer(fn: Callable[..., None], with_group: bool = False) -> None:
    """Calls ``fn(op_name, tensor)`` for every collective issued (for tests and profiling);
    with ``with_group``, ``fn(op_name, tensor, group)``, ``group`` the :class:`Group` given
    to the collective (None: the world)."""
    _observers.append((fn, with_group))


def remove_observer(fn: Callable[..., None]) -> None:
    _observers[:] = [(f, g) for f, g in _observers if f is not fn]


def _notify(op: str, tensor: torch.Tensor, group: Optional["Group"] = None) -> None:
    for fn, with_group in _observers:
        if with_group:
            fn(op, tensor, group)
        else:
            fn(op, tensor)
    if not _trail_off:
        _trace(op, tensor, group)


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


def _handle(group: Optional["Group"]):
    if group is None or isinstance(group, Group):
        return group.handle if group is not None else None
    if group is dist.group.WORLD:
        return None
    raise TypeError(f"group must be a shardtrain.comm.Group (from a Mesh or side_group()), got "
                    f"{type(group).__name__}.")


def all_reduce(tensor: torch.Tensor, op="sum", group: Optional["Group"] = None,
               async_op: bool = False) -> Work:
    """Reduces ``tensor`` in place across the ranks of ``group`` (default: the world): ``op``
    is ``"sum"`` (default), ``"max"``, ``"min"``, ``"product"`` or ``"avg"``, or the matching
    :data:`ReduceOp`. A group of one returns at once."""
    reduce_op = _reduce_op(op)
    handle = _handle(group)
    _notify("all_reduce", tensor, group)
    size = get_world_size(group)
    if size == 1:
        return Work()
    if reduce_op == dist.ReduceOp.AVG and dist.get_backend() != "nccl":  # gloo has no AVG: sum, divide
        work = _guarded("all_reduce", group, tensor, lambda: dist.all_reduce(
            tensor, op=dist.ReduceOp.SUM, group=handle, async_op=async_op))
        if not async_op:
            tensor.div_(size)
            return Work()
        return Work(work, then=lambda: tensor.div_(size), op="all_reduce", group=group,
                    tensor=tensor)
    return Work(_guarded("all_reduce", group, tensor, lambda: dist.all_reduce(
        tensor, op=reduce_op, group=handle, async_op=async_op)), op="all_reduce", group=group,
        tensor=tensor)


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   group: Optional["Group"] = None) -> Work:
    """Sums ``input`` (one equal row per rank of ``group``, flattened) across the group; the
    rank of group rank r receives row r in ``output``."""
    _notify("reduce_scatter", input, group)
    if get_world_size(group) == 1:
        output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return Work()
    return Work(_guarded("reduce_scatter", group, input, lambda: _reduce_scatter_flat(
        output, input, group=_handle(group), async_op=async_op)), op="reduce_scatter",
        group=group, tensor=input)


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
               group: Optional["Group"] = None) -> Work:
    """Concatenates every rank's ``input`` into ``output`` (in the group's rank order)."""
    _notify("all_gather", input, group)
    if get_world_size(group) == 1:
        output.view(-1).copy_(input.view(-1))
        return Work()
    return Work(_guarded("all_gather", group, input, lambda: _all_gather_flat(
        output, input, group=_handle(group), async_op=async_op)), op="all_gather",
        group=group, tensor=input)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional["Group"] = None) -> None:
    """``src``'s values (``src`` a rank of ``group``) into ``tensor`` on every rank of it."""
    _notify("broadcast", tensor, group)
    if get_world_size(group) > 1:
        _guarded("broadcast", group, tensor,
                 lambda: dist.broadcast(tensor, src=_global(group, src), group=_handle(group)))


def scatter(output: torch.Tensor, rows: Optional[torch.Tensor], src: int = 0,
            async_op: bool = False, group: Optional["Group"] = None) -> Work:
    """Rank ``src`` (of ``group``) sends row r of ``rows`` (``[size, n]``, read on ``src``
    only; None elsewhere) to the group's rank r, which receives it in ``output``."""
    _notify("scatter", output, group)
    if get_world_size(group) == 1:
        output.view(-1).copy_(rows[0].view(-1))
        return Work()
    chunks = list(rows.unbind(0)) if get_rank(group) == src else None
    return Work(_guarded("scatter", group, output, lambda: dist.scatter(
        output, chunks, src=_global(group, src), group=_handle(group), async_op=async_op)),
        op="scatter", group=group, tensor=output)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      group: Optional["Group"] = None) -> None:
    """Splits ``input`` into the group's size equal parts along dim 0 and sends part r to
    the group's rank r; ``output`` receives the parts from every rank in rank order."""
    _notify("all_to_all", input, group)
    if get_world_size(group) == 1:
        output.copy_(input)
        return
    _guarded("all_to_all", group, input,
             lambda: dist.all_to_all_single(output, input, group=_handle(group)))


def all_gather_object(obj, group: Optional["Group"] = None) -> list:
    """Gathers one picklable object from every rank of ``group`` (small metadata only)."""
    size = get_world_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    _trace("all_gather_object", None, group)
    _guarded("all_gather_object", group, None,
             lambda: dist.all_gather_object(out, obj, group=_handle(group)))
    return out


class Group:
    """Ranks that collectives run over: the world (:data:`WORLD`), a dimension of a
    :class:`Mesh`, or the :func:`side_group`. ``handle`` is torch's process group (None: the
    default, world group); a ``solo`` group is this rank alone (no process group: every
    collective over it returns at once)."""

    def __init__(self, handle=None, name: str = "world", solo: bool = False):
        self.handle, self.name, self.solo = handle, name, solo
        self._spans: Optional[str] = None
        self._pg: Optional[str] = None
        if handle is not None and not solo:
            _made.append(self)

    def size(self) -> int:
        return get_world_size(self)

    def rank(self) -> int:
        return get_rank(self)

    def ranks(self) -> List[int]:
        """The global ranks of the group, in its rank order."""
        if self.solo:
            return [get_rank()]
        if self.handle is None:
            return list(range(get_world_size()))
        return dist.get_process_group_ranks(self.handle)

    def spans(self) -> str:
        """The global ranks as spans (``"0-3"``); fixed once the group exists."""
        if self._spans is None:
            self._spans = _trail.spans(self.ranks())
        return self._spans

    def pg_name(self) -> str:
        """torch's name for the process group under this group (equal on every rank)."""
        if self._pg is None:
            self._pg = (self.handle or dist.group.WORLD).group_name
        return self._pg

    @property
    def process_group(self):
        """torch's process group, for code that calls ``torch.distributed`` itself (the
        world group for :data:`WORLD`; None for a solo group or without a process group)."""
        if self.solo or not is_initialized():
            return None
        return self.handle if self.handle is not None else dist.group.WORLD

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks()})"


_made: List["Group"] = []  # groups with a process group of their own (for set_timeout)

#: The world: every rank.
WORLD = Group()
#: The name :func:`side_group` used to have.
SideGroup = Group


def _global(group: Optional[Group], rank: int) -> int:
    handle = _handle(group)
    return rank if handle is None else dist.get_global_rank(handle, rank)


_side: Optional[Group] = None
_before_destroy: List[Callable[[], None]] = []


def side_group() -> Group:
    """A second group over every rank (gloo), for work that runs beside training in another
    thread: collectives on the default group are matched by order, so a background thread
    must never issue one there. Created on first use (a collective: every rank calls it at
    the same point, from the main thread)."""
    global _side
    if _side is None:
        _side = Group(dist.new_group(backend="gloo") if get_world_size() > 1 else None, "side")
    return _side


def split_groups(partition: List[List[int]], name: str = "split") -> Group:
    """Creates a group for each list of global ranks in ``partition`` (a collective: every
    rank calls it with the same lists) and returns this rank's, or a solo group when this
    rank is in none of them.

    Example:
        >>> pair = comm.split_groups([[0, 1], [2, 3]], name="pair")
    """
    if not is_initialized() or get_world_size() == 1:
        return Group(None, name, solo=True)
    handle = _own_group(partition)
    return Group(None, name, solo=True) if handle is None else Group(handle, name)


def before_destroy(fn: Callable[[], None]) -> None:
    """Runs ``fn`` at the start of :func:`destroy` (to finish work that uses the groups)."""
    if fn not in _before_destroy:
        _before_destroy.append(fn)


def broadcast_object(obj, src: int = 0, group: Optional[Group] = None):
    """Sends rank ``src``'s (of ``group``) picklable object to every rank of the group
    (small metadata only)."""
    if get_world_size(group) == 1:
        return obj
    box = [obj]
    _trace("broadcast_object", None, group)
    _guarded("broadcast_object", group, None, lambda: dist.broadcast_object_list(
        box, src=_global(group, src), group=_handle(group)))
    return box[0]


def broadcast_coalesced(tensors: List[torch.Tensor], src: int = 0,
                        chunk_numel: int = 64 * 1024 * 1024,
                        group: Optional[Group] = None) -> None:
    """Broadcasts many tensors in place from ``src`` (a rank of ``group``) with one
    collective per dtype chunk."""
    if get_world_size(group) == 1 or not tensors:
        return
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        chunk: List[torch.Tensor] = []
        size = 0
        for t in same + [None]:
            if t is None or (chunk and size + t.numel() > chunk_numel):
                _broadcast_flat(chunk, src, group)
                chunk, size = [], 0
            if t is not None:
                chunk.append(t)
                size += t.numel()


def _broadcast_flat(chunk: List[torch.Tensor], src: int, group: Optional[Group]) -> None:
    if not chunk:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in chunk])
    broadcast(flat, src, group)
    offset = 0
    with torch.no_grad():
        for t in chunk:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


MESH_DIMS = ("dp", "sp", "tp")


class Mesh:
    """The ranks laid out on three named dimensions: data parallel (``dp``), sequence
    parallel (``sp``) and tensor parallel (``tp``), ``tp`` innermost, so a tensor-parallel
    group is adjacent ranks (ranks 0 and 1 form the first group of ``tp=2``).

    Rank ``r`` sits at ``(r // (sp * tp), r // tp % sp, r % tp)``. Each dimension is a
    :class:`Group` of the ranks that differ only in that coordinate; :attr:`zero` is the
    ``dp`` x ``sp`` group, over which ZeRO shards model states and gradients are averaged
    (a sequence-parallel rank holds the whole model, like a data-parallel one; a
    tensor-parallel rank holds its shard's whole gradient already). A dimension that spans
    every rank is :data:`WORLD` itself. ``device_mesh`` is torch's ``DeviceMesh`` of the
    same layout, for DTensor and ``parallelize_module`` (None without a process group, or
    with data parallelism alone: then ``sp`` and ``tp`` are solo groups and nothing is
    created).
    """

    def __init__(self, sizes: dict, groups: dict, zero: Group, device_mesh=None):
        self.sizes, self._groups, self.zero = dict(sizes), groups, zero
        self.device_mesh = device_mesh

    @classmethod
    def from_groups(cls, dp, tp=None, sp=None) -> "Mesh":
        """The mesh of process groups a caller built itself (torch ``ProcessGroup`` s, e.g.
        from a DeepSpeed ``mpu``): ``dp`` the data-parallel group, ``tp`` the tensor
        (model) parallel one and ``sp`` the sequence-parallel one (None: this rank alone)."""
        groups = {"dp": _wrap(dp, "dp"), "sp": _wrap(sp, "sp"), "tp": _wrap(tp, "tp")}
        sizes = {d: g.size() for d, g in groups.items()}
        if sizes["dp"] * sizes["sp"] * sizes["tp"] != get_world_size():
            raise ValueError(
                f"the given groups do not cover the world: data-parallel {sizes['dp']} x "
                f"sequence-parallel {sizes['sp']} x tensor-parallel {sizes['tp']} != world "
                f"size {get_world_size()}.")
        zero = groups["dp"] if sizes["sp"] == 1 else None
        if zero is None:
            raise NotImplementedError("a caller-built mesh with sequence parallelism: pass "
                                      "sequence_parallel_size in the config instead.")
        return cls(sizes, groups, Group(zero.handle, "zero", zero.solo))

    @property
    def dp(self) -> Group:
        return self._groups["dp"]

    @property
    def sp(self) -> Group:
        return self._groups["sp"]

    @property
    def tp(self) -> Group:
        return self._groups["tp"]

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coordinate(self, rank: Optional[int] = None) -> dict:
        """``rank``'s (default: this process's) position on each dimension."""
        r = get_rank() if rank is None else rank
        sp, tp = self.sizes["sp"], self.sizes["tp"]
        return {"dp": r // (sp * tp), "sp": r // tp % sp, "tp": r % tp}

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{d}={self.sizes[d]}" for d in MESH_DIMS) + ")"


def init_mesh(tp: int = 1, sp: int = 1, device_type: Optional[str] = None) -> Mesh:
    """Arranges the world on a :class:`Mesh` of ``world / (tp * sp)`` data-parallel x ``sp``
    x ``tp`` ranks (a collective: every rank calls it, at the same point)."""
    world = get_world_size()
    for name, n in (("tensor-parallel size", tp), ("sequence-parallel size", sp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"the {name} must be a positive integer, got {n!r}.")
    if world % (tp * sp):
        raise ValueError(
            f"world size {world} is not divisible by tensor-parallel size {tp} x "
            f"sequence-parallel size {sp} = {tp * sp}: launch a multiple of {tp * sp} "
            f"ranks, or choose sizes whose product divides {world}.")
    sizes = {"dp": world // (tp * sp), "sp": sp, "tp": tp}
    if not is_initialized() or world == 1:
        return Mesh(sizes, {d: Group(None, d) for d in MESH_DIMS}, Group(None, "zero"))
    if tp == sp == 1:  # data parallelism alone: the world, and no sub-groups to create
        solo = {d: Group(None, d, solo=True) for d in ("sp", "tp")}
        return Mesh(sizes, {"dp": Group(None, "dp"), **solo}, Group(None, "zero"))
    from torch.distributed.device_mesh import init_device_mesh
    from . import accelerator  # local import: accelerator does not depend on comm
    kind = device_type or ("cuda" if accelerator.is_cuda() else "cpu")
    shape = tuple(sizes[d] for d in MESH_DIMS)
    device_mesh = init_device_mesh(kind, shape, mesh_dim_names=MESH_DIMS)
    layout = torch.arange(world).view(shape)
    groups = {d: Group(None if sizes[d] == world else device_mesh.get_group(d), d)
              for d in MESH_DIMS}
    if sp == 1:
        zero = Group(groups["dp"].handle, "zero")
    elif tp == 1:
        zero = Group(None, "zero")
    else:  # dp x sp: one group per tensor-parallel coordinate, created by every rank
        zero = Group(_own_group([layout[:, :, t].reshape(-1).tolist() for t in range(tp)]),
                     "zero")
    return Mesh(sizes, groups, zero, device_mesh)


def _wrap(handle, name: str) -> Group:
    """A caller's process group as a :class:`Group` (None: this rank alone)."""
    if handle is None:
        return Group(None, name, solo=True)
    if handle is dist.group.WORLD:
        return Group(None, name)
    return Group(handle, name)


def _own_group(candidates: List[List[int]]):
    """Creates every group of ``candidates`` (each rank must create each) and returns the
    one this rank belongs to."""
    mine = None
    for ranks in candidates:
        handle = dist.new_group(ranks=ranks)
        if get_rank() in ranks:
            mine = handle
    return mine

"""Groups of ranks: the world, the dimensions of a device mesh, split groups and the side
group, each a :class:`Group` over one of torch's process groups, and the timeout that bounds
their collectives."""
from __future__ import annotations

import datetime
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from . import _trail
from . import _process
from ._process import get_rank, get_world_size, is_initialized


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

    @classmethod
    def of(cls, process_group, name: str = "group") -> "Group":
        """The :class:`Group` of a torch process group a caller holds (the world group:
        :data:`WORLD`'s kind; None: this rank alone)."""
        return _wrap(process_group, name)

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



def _handle(group: Optional["Group"]):
    if group is None or isinstance(group, Group):
        return group.handle if group is not None else None
    if group is dist.group.WORLD:
        return None
    raise TypeError(f"group must be a shardtrain.comm.Group (from a Mesh or side_group()), got "
                    f"{type(group).__name__}.")



_side: Optional[Group] = None
_before_destroy: List[Callable[[], None]] = []




def _forget() -> None:
    """After destroy(): the groups made so far belong to the old process group."""
    global _side
    _side = None
    _made.clear()


_process.after_destroy(_forget)


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


MESH_DIMS = ("dp", "sp", "tp")
#: With pipeline stages, the pipeline dimension comes first (outermost).
PIPELINE_DIMS = ("pp",) + MESH_DIMS


class Mesh:
    """The ranks laid out on named dimensions: pipeline stages (``pp``, outermost, size 1
    unless a pipeline-parallel model asks for more), data parallel (``dp``), sequence
    parallel (``sp``) and tensor parallel (``tp``), ``tp`` innermost, so a tensor-parallel
    group is adjacent ranks (ranks 0 and 1 form the first group of ``tp=2``).

    Rank ``r`` sits at ``(r // (dp * sp * tp), r // (sp * tp) % dp, r // tp % sp, r % tp)``
    (DeepSpeed's ``pipe``, ``data``, ``model`` order for its pipeline topologies). Each
    dimension is a :class:`Group` of the ranks that differ only in that coordinate;
    :attr:`zero` is the ``dp`` x ``sp`` group, over which ZeRO shards model states and
    gradients are averaged (a sequence-parallel rank holds the whole model, like a
    data-parallel one; a tensor-parallel rank holds its shard's whole gradient already);
    :attr:`stage` is every rank of this pipeline stage (the world without pipeline stages).
    A dimension that spans every rank is :data:`WORLD` itself. ``device_mesh`` is torch's
    ``DeviceMesh`` of the same layout, for DTensor and ``parallelize_module`` (None without
    a process group, or with data parallelism alone: then ``sp`` and ``tp`` are solo groups
    and nothing is created).
    """

    def __init__(self, sizes: dict, groups: dict, zero: Group, device_mesh=None,
                 stage: Optional[Group] = None):
        self.sizes, self._groups, self.zero = {"pp": 1, **sizes}, groups, zero
        self._groups.setdefault("pp", Group(None, "pp", solo=True))
        self.stage = stage if stage is not None else Group(None, "stage")
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
    def pp(self) -> Group:
        return self._groups["pp"]

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
        dp, sp, tp = self.sizes["dp"], self.sizes["sp"], self.sizes["tp"]
        return {"pp": r // (dp * sp * tp), "dp": r // (sp * tp) % dp, "sp": r // tp % sp,
                "tp": r % tp}

    def rank_at(self, **coordinate: int) -> int:
        """The global rank at ``coordinate`` (dimensions left out: this rank's)."""
        at = {**self.coordinate(), **coordinate}
        dp, sp, tp = self.sizes["dp"], self.sizes["sp"], self.sizes["tp"]
        return ((at["pp"] * dp + at["dp"]) * sp + at["sp"]) * tp + at["tp"]

    def __repr__(self) -> str:
        dims = PIPELINE_DIMS if self.sizes["pp"] > 1 else MESH_DIMS
        return "Mesh(" + ", ".join(f"{d}={self.sizes[d]}" for d in dims) + ")"


def init_mesh(tp: int = 1, sp: int = 1, device_type: Optional[str] = None,
              pp: int = 1) -> Mesh:
    """Arranges the world on a :class:`Mesh` of ``pp`` pipeline stages x ``world / (pp * tp *
    sp)`` data-parallel x ``sp`` x ``tp`` ranks (a collective: every rank calls it, at the
    same point)."""
    world = get_world_size()
    for name, n in (("tensor-parallel size", tp), ("sequence-parallel size", sp),
                    ("pipeline-parallel size", pp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"the {name} must be a positive integer, got {n!r}.")
    if world % (pp * tp * sp):
        what = " x ".join(f"{label} size {n}" for label, n in (
            ("pipeline-parallel", pp), ("tensor-parallel", tp), ("sequence-parallel", sp))
            if n > 1 or label != "pipeline-parallel")
        raise ValueError(
            f"world size {world} is not divisible by {what} = {pp * tp * sp}: launch a "
            f"multiple of {pp * tp * sp} ranks, or choose sizes whose product divides {world}.")
    sizes = {"pp": pp, "dp": world // (pp * tp * sp), "sp": sp, "tp": tp}
    if not is_initialized() or world == 1:
        return Mesh(sizes, {d: Group(None, d) for d in PIPELINE_DIMS}, Group(None, "zero"))
    if pp == tp == sp == 1:  # data parallelism alone: the world, and no sub-groups to create
        solo = {d: Group(None, d, solo=True) for d in ("sp", "tp")}
        return Mesh(sizes, {"dp": Group(None, "dp"), **solo}, Group(None, "zero"))
    from torch.distributed.device_mesh import init_device_mesh
    from .. import accelerator  # local import: accelerator does not depend on comm
    kind = device_type or ("cuda" if accelerator.is_cuda() else "cpu")
    dims = PIPELINE_DIMS if pp > 1 else MESH_DIMS
    shape = tuple(sizes[d] for d in dims)
    device_mesh = init_device_mesh(kind, shape, mesh_dim_names=dims)
    layout = torch.arange(world).view((pp,) + shape[-3:])
    groups = {d: Group(None if sizes[d] == world else device_mesh.get_group(d), d)
              for d in dims}
    if sp == 1:
        zero = Group(groups["dp"].handle, "zero", groups["dp"].solo)
    elif tp == 1 and pp == 1:
        zero = Group(None, "zero")
    else:  # dp x sp: one group per (stage, tensor-parallel coordinate), created by every rank
        zero = Group(_own_group([layout[s, :, :, t].reshape(-1).tolist()
                                 for s in range(pp) for t in range(tp)]), "zero")
    stage = None
    if pp > 1:  # every rank of a stage (None: the world, without pipeline stages)
        stage = Group(_own_group([layout[s].reshape(-1).tolist() for s in range(pp)]), "stage") \
            if world > pp else Group(None, "stage", solo=True)
    return Mesh(sizes, groups, zero, device_mesh, stage)


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


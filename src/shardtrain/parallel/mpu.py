"""DeepSpeed's model-parallel unit (``mpu``): the process groups of a device mesh under the
names DeepSpeed and Megatron-style code call.

``engine.mpu`` is a :class:`MeshMPU` of the mesh the engine built (None with data parallelism
alone, as in DeepSpeed). Its groups are torch ``ProcessGroup`` s, for code that calls
``torch.distributed`` itself; "model parallel" means tensor parallel, "pipe parallel" the
pipeline stages (DeepSpeed's ``PipelineParallelGrid`` names, for a ``PipelineModule``).
A user's own ``mpu`` passed to ``initialize(mpu=...)`` is read by :func:`mesh_from_mpu`.

Example:
    >>> mpu = engine.mpu
    >>> mpu.get_model_parallel_world_size(), mpu.get_data_parallel_rank()
    (2, 0)
    >>> torch.distributed.all_reduce(t, group=mpu.get_data_parallel_group())
"""
from __future__ import annotations

from typing import Any

from .. import comm

__all__ = ["MeshMPU", "mesh_from_mpu"]


class MeshMPU:
    """The groups of ``mesh`` (a :class:`shardtrain.comm.Mesh`) as DeepSpeed's ``mpu``; with
    ``experts`` (the expert-parallel groups of a model whose experts are split over ranks:
    ``.ep`` and ``.edp``), Megatron's expert-parallel lookups too."""

    def __init__(self, mesh: comm.Mesh, experts: Any = None):
        self.mesh, self.experts = mesh, experts

    # tensor (model) parallel
    def get_model_parallel_group(self):
        return self.mesh.tp.process_group

    def get_model_parallel_rank(self) -> int:
        return self.mesh.tp.rank()

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.tp.size()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    # data parallel (the ranks that read different samples)
    def get_data_parallel_group(self):
        return self.mesh.dp.process_group

    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp.rank()

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.dp.size()

    # sequence parallel, and the data x sequence group ZeRO shards over
    def get_sequence_parallel_group(self):
        return self.mesh.sp.process_group

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.sp.rank()

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.sp.size()

    def get_sequence_data_parallel_group(self):
        return self.mesh.zero.process_group

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.zero.rank()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.zero.size()

    # pipeline stages (the ranks that hold other layers), and the grid's lookups
    def get_pipe_parallel_group(self):
        return self.mesh.pp.process_group

    def get_pipe_parallel_rank(self) -> int:
        return self.mesh.coordinate()["pp"]

    def get_pipe_parallel_world_size(self) -> int:
        return self.mesh.sizes["pp"]

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_stage_id = get_pipe_parallel_rank

    def get_data_parallel_id(self) -> int:
        return self.mesh.coordinate()["dp"]

    def get_global_rank(self) -> int:
        return comm.get_rank()

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` at this rank's coordinate (``data=``, ``model=``
        move along those axes)."""
        return self.mesh.rank_at(pp=stage_id, **{_AXES[k]: v for k, v in kwargs.items()})

    # within a stage: the tensor-parallel ranks (DeepSpeed's "slice")
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    # expert parallel (the ranks that hold other experts), and the ranks holding the same
    # ones; without split experts, every rank holds every expert
    def _expert(self, which: str) -> comm.Group:
        if self.experts is None:
            return comm.Group(None, "ep", solo=True) if which == "ep" else self.mesh.zero
        return getattr(self.experts, which)

    def get_expert_model_parallel_group(self):
        return self._expert("ep").process_group

    def get_expert_model_parallel_rank(self) -> int:
        return self._expert("ep").rank()

    def get_expert_model_parallel_world_size(self) -> int:
        return self._expert("ep").size()

    def get_expert_data_parallel_group(self):
        return self._expert("edp").process_group

    def get_expert_data_parallel_rank(self) -> int:
        return self._expert("edp").rank()

    def get_expert_data_parallel_world_size(self) -> int:
        return self._expert("edp").size()

    get_expert_parallel_group = get_expert_model_parallel_group
    get_expert_parallel_rank = get_expert_model_parallel_rank
    get_expert_parallel_world_size = get_expert_model_parallel_world_size

    def __repr__(self) -> str:
        return f"MeshMPU({self.mesh!r})"


_NEEDED = ("get_data_parallel_group", "get_model_parallel_group")
_AXES = {"data": "dp", "model": "tp", "pipe": "pp"}  # DeepSpeed's topology axes


def mesh_from_mpu(mpu: Any) -> comm.Mesh:
    """The mesh of a user's ``mpu``: its data-parallel group, and its model-parallel group as
    the tensor-parallel one (parameters flagged ``tensor_model_parallel`` or
    ``model_parallel``, as Megatron-style layers mark them, are counted as slices in the
    gradient norm)."""
    if isinstance(mpu, MeshMPU):  # one of ours: its mesh as it is, sequence parallelism included
        return mpu.mesh
    missing = [name for name in _NEEDED if not callable(getattr(mpu, name, None))]
    if missing:
        raise TypeError(f"initialize(mpu=...) needs an object with DeepSpeed's "
                        f"{', '.join(n + '()' for n in _NEEDED)}; {type(mpu).__name__} lacks "
                        f"{', '.join(missing)}.")
    return comm.Mesh.from_groups(dp=mpu.get_data_parallel_group(),
                                 tp=mpu.get_model_parallel_group())

"""``deepspeed.utils.groups``: DeepSpeed's lookups of the data- and sequence-parallel groups,
answered from shardtrain's mesh.

The mesh is the one ``UlyssesSPAttentionHF.register_with_transformers`` built (its ``mpu``
is kept here as ``mpu``, as DeepSpeed keeps the one its engine was given), else that of the
only engine alive in this process; with neither, the world is one data-parallel group and
there is no sequence parallelism (DeepSpeed's answers without an ``mpu``). Accelerate's
``deepspeed_ulysses_dl_adapter`` (the Hugging Face Trainer's route) reads the
``_get_sequence_parallel_*`` ones. The expert-parallel lookups take an expert parameter's
``group_name`` (``ep_size_<N>``) and answer for the groups the engine made around the model's
MoE layers (:mod:`shardtrain.moe`).
"""
from typing import Any, Optional

from shardtrain import comm
from shardtrain.moe import find_expert_groups
from shardtrain.state import live_engines

__all__ = ["mpu", "_get_sequence_parallel_group", "_get_sequence_parallel_world_size",
           "_get_sequence_parallel_rank", "_get_sequence_data_parallel_group",
           "_get_sequence_data_parallel_world_size", "_get_sequence_data_parallel_rank",
           "_get_data_parallel_group", "_get_data_parallel_world_size", "_get_data_parallel_rank",
           "_get_model_parallel_world_size", "get_tensor_model_parallel_world_size",
           "get_tensor_model_parallel_rank", "_get_expert_parallel_group",
           "_get_expert_parallel_world_size", "_get_expert_parallel_rank",
           "_get_expert_data_parallel_group", "_get_expert_data_parallel_world_size",
           "_get_expert_data_parallel_rank"]

#: the ``MeshMPU`` of the last ``register_with_transformers`` (None before)
mpu: Any = None


def _mesh() -> Optional[comm.Mesh]:
    if mpu is not None:
        return mpu.mesh
    meshes = [m for m in (getattr(e, "mesh", None) for e in live_engines) if m is not None]
    return meshes[0] if len(meshes) == 1 else None


def _group(dim: str) -> Optional[comm.Group]:
    mesh = _mesh()
    if mesh is None:
        return comm.WORLD if dim in ("dp", "zero") else None
    return mesh.zero if dim == "zero" else getattr(mesh, dim)


def _process_group(dim: str, what: str) -> Any:
    group = _group(dim)
    if group is None or group.solo or group.process_group is None:
        raise KeyError(f"No {what} group found: shardtrain's mesh has none of more than one rank here "
                       "(register_with_transformers or an engine with sequence_parallel_size builds one)")
    return group.process_group


def _size(dim: str) -> int:
    group = _group(dim)
    return 1 if group is None else group.size()


def _rank(dim: str) -> int:
    group = _group(dim)
    return 0 if group is None else group.rank()


def _get_sequence_parallel_group() -> Any:
    """torch's process group of this rank's sequence-parallel group (KeyError without one)."""
    return _process_group("sp", "sequence parallel")


def _get_sequence_parallel_world_size() -> int:
    return _size("sp")


def _get_sequence_parallel_rank() -> int:
    return _rank("sp")


def _get_sequence_data_parallel_group() -> Any:
    """The data x sequence-parallel group (where ZeRO shards and averages gradients)."""
    return _process_group("zero", "sequence-data parallel")


def _get_sequence_data_parallel_world_size() -> int:
    return _size("zero")


def _get_sequence_data_parallel_rank() -> int:
    return _rank("zero")


def _get_data_parallel_group() -> Any:
    return _process_group("dp", "data parallel")


def _get_data_parallel_world_size() -> int:
    return _size("dp")


def _get_data_parallel_rank() -> int:
    return _rank("dp")


def _get_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def _expert(group_name: str, dim: str) -> comm.Group:
    return getattr(find_expert_groups(group_name), dim)


def _get_expert_parallel_group(group_name: str) -> Any:
    """torch's process group over which ``group_name``'s experts are split (None: the world)."""
    return _expert(group_name, "ep").process_group


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert(group_name, "ep").size()


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert(group_name, "ep").rank()


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """torch's process group of the ranks holding the same experts of ``group_name``."""
    return _expert(group_name, "edp").process_group


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert(group_name, "edp").size()


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert(group_name, "edp").rank()

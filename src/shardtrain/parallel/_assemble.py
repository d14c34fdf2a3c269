"""What the engine does with a device mesh: the mesh from the config (or a user's ``mpu``),
and the model parallelised over it before ZeRO sees the parameters.

Order matters, and the engine follows it: every rank holds rank 0's full weights first (one
broadcast over the world), then tensor parallelism cuts each split layer into this rank's
slice (so the slices of a tensor-parallel group come from the same full tensor), then ZeRO
shards what is left over the data-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import comm
from .mpu import MeshMPU, mesh_from_mpu

__all__ = ["Parallelism", "build_mesh", "parallelize"]


@dataclass
class Parallelism:
    """The mesh and what was done to the model over it."""

    mesh: comm.Mesh
    tensor: Any = None     # the AutoTP plan (tensor_parallel), or None
    sequence: Any = None   # the Ulysses plan (sequence_parallel_size), or None
    batch_transform: Optional[Callable[[Any], Any]] = None  # each loader batch, per rank
    experts: Any = None    # the expert-parallel groups (moe.ExpertGroups), or None

    @property
    def mpu(self) -> Optional[MeshMPU]:
        """DeepSpeed's ``mpu`` for this mesh; None with data parallelism alone."""
        sizes = self.mesh.sizes
        if sizes["tp"] * sizes["sp"] * sizes["pp"] == 1 and self.experts is None:
            return None
        return MeshMPU(self.mesh, self.experts)

    @property
    def tensor_group(self) -> Optional[comm.Group]:
        """The group tensor-parallel slices are split over (None: no tensor parallelism)."""
        return self.mesh.tp if self.mesh.sizes["tp"] > 1 else None


def build_mesh(config: Any, mpu: Any = None) -> comm.Mesh:
    """The mesh a config asks for, or the one a user's ``mpu`` describes."""
    tp, sp = config.tensor_parallel_size(), config.sequence_parallel_size or 1
    if mpu is None:
        return comm.init_mesh(tp=tp, sp=sp)
    if tp > 1 or sp > 1:
        raise ValueError(f"initialize(mpu=...) brings its own groups, but the config also asks "
                         f"for tensor_parallel size {tp} and sequence_parallel_size {sp}: keep "
                         f"one of them.")
    return mesh_from_mpu(mpu)


def parallelize(module: torch.nn.Module, mesh: comm.Mesh, config: Any) -> Parallelism:
    """Splits ``module``'s layers over the mesh's tensor-parallel group (AutoTP) and routes a
    Hugging Face model's attention through the sequence-parallel exchange (Ulysses)."""
    out = Parallelism(mesh)
    if mesh.sizes["tp"] > 1 and config.tensor_parallel_size() > 1:
        from .autotp import apply_autotp
        out.tensor = apply_autotp(module, mesh.tp, dict(config.tensor_parallel))
    if mesh.sizes["sp"] > 1:
        from .ulysses import enable_ulysses, shard_sequence
        out.sequence = enable_ulysses(module, mesh.sp, mesh.sizes["tp"] if out.tensor else 1)
        out.batch_transform = lambda batch: shard_sequence(batch, mesh.sp)
    return out

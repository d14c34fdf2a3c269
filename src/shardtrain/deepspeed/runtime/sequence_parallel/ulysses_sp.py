"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's names for long-sequence
training (ALST), its tiling, Ulysses registration and loader adapter, backed by
:mod:`shardtrain.parallel`.

* the tiling: ``TiledMLP``, ``sequence_tiled_compute``, ``TiledFusedLogitsLoss`` (the same
  arguments; exact gradients, each parameter's once);
* ``UlyssesSPAttentionHF.register_with_transformers``: the mesh with a sequence-parallel
  dimension, returned as the ``mpu`` to hand to ``initialize``, whose engine then routes the
  model's attention through shardtrain's Ulysses (``enable_ulysses``) and installs its loss
  (the mean over every valid token of the whole sequences, the same on every rank);
* ``UlyssesSPDataLoaderAdapter``: :class:`shardtrain.parallel.SequenceParallelLoader`.

What Accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=S)`` calls.
"""
from typing import Any, Optional

from shardtrain import comm
from shardtrain.parallel import (MeshMPU, SequenceParallelLoader, TiledFusedLogitsLoss, TiledMLP,
                                 sequence_tiled_compute)

from ..._missing import unsupported_class

__all__ = ["TiledMLP", "sequence_tiled_compute", "TiledFusedLogitsLoss", "SequenceTiledCompute",
           "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

_HERE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
_SP = ("UlyssesSPAttentionHF.register_with_transformers(...) and pass the mpu it returns to "
       "initialize (or sequence_parallel_size: S in the config) (docs/parallelism.md)")
_ATTENTION = ("sdpa", "eager")


class SequenceTiledCompute:
    """DeepSpeed's autograd function behind :func:`sequence_tiled_compute`; call that."""

    @staticmethod
    def apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
              compute_params, output_unshard_dimension, output_reduction, *args):
        to_shard = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        return sequence_tiled_compute(fn, seqlen, shards, to_shard, to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction)


class UlyssesSPAttentionHF(unsupported_class(
        f"{_HERE}.UlyssesSPAttentionHF", "DeepSpeed's attention module object itself", _SP)):
    """DeepSpeed's Ulysses attention for Hugging Face models: only
    :meth:`register_with_transformers` is used (the engine wraps the attention itself)."""

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: Optional[int] = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False,
                                   max_length: Optional[int] = None) -> Optional[MeshMPU]:
        """The ``mpu`` of a mesh with ``sequence_parallel_size`` ranks per sequence (None
        for 1); ``initialize(model=..., mpu=mpu)`` then runs the model's attention through
        Ulysses. ``model_name_or_path`` must be the model object (its config names the
        attention); the sequence lengths are read from each batch."""
        if sequence_parallel_size == 1:
            return None
        if not hasattr(model_name_or_path, "config"):
            raise NotImplementedError(
                f"register_with_transformers got {type(model_name_or_path).__name__}; shardtrain "
                "needs the loaded Hugging Face model (its config), not a name or path: load it first.")
        if core_attn_implementation not in _ATTENTION:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r}: shardtrain's "
                             f"Ulysses runs the model's {' or '.join(_ATTENTION)} attention; choose one "
                             "(Accelerate: DeepSpeedSequenceParallelConfig(sp_attn_implementation='sdpa')).")
        # The lengths and batch size are read from each batch. disable_in_eval (Accelerate
        # always passes True) is not honoured: the attention stays sequence-parallel in eval,
        # so evaluation batches must be sliced too (through the adapter), as in training.
        del micro_batch_size, seq_length, seq_length_is_variable, disable_in_eval, max_length
        from ...utils import groups  # DeepSpeed's global registry reads it from here
        groups.mpu = MeshMPU(comm.init_mesh(sp=sequence_parallel_size))
        return groups.mpu


class UlyssesSPDataLoaderAdapter(SequenceParallelLoader):
    """DeepSpeed's loader adapter: every rank of the sequence-parallel group yields each of
    the group's batches in turn, as its slice of the sequences, with ``shift_labels``."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any):
        group = comm.Group.of(sp_group, "sp")
        if (group.size(), group.rank()) != (sp_world_size, sp_rank):
            raise ValueError(f"sp_group has {group.size()} ranks and this is its rank {group.rank()}, "
                             f"but sp_world_size={sp_world_size} and sp_rank={sp_rank} were given: pass "
                             "the mpu's get_sequence_parallel_{group,world_size,rank}()")
        super().__init__(dl, group, device)

"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's names for the tiling of
long-sequence training, backed by :mod:`shardtrain.parallel`'s tiling (``TiledMLP``,
``sequence_tiled_compute``, ``TiledFusedLogitsLoss``: the same arguments, exact gradients).

DeepSpeed's Ulysses classes of this module (``UlyssesSPAttentionHF``,
``UlyssesSPDataLoaderAdapter``) are stand-ins that refuse on use, naming shardtrain's own
Ulysses sequence parallelism instead.
"""
from shardtrain.parallel import TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

from ..._missing import unsupported_class, unsupported_function

__all__ = ["TiledMLP", "sequence_tiled_compute", "TiledFusedLogitsLoss", "SequenceTiledCompute",
           "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

_HERE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
_SP = ("Ulysses sequence parallelism from the config: sequence_parallel_size: S (the engine's "
       "loader gives each rank its slice of every sequence; engine.mpu has the groups); "
       "shardtrain.parallel.enable_ulysses and shard_sequence outside the engine "
       "(docs/parallelism.md)")


class SequenceTiledCompute:
    """DeepSpeed's autograd function behind :func:`sequence_tiled_compute`; call that."""

    @staticmethod
    def apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
              compute_params, output_unshard_dimension, output_reduction, *args):
        to_shard = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        to_pass = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        return sequence_tiled_compute(fn, seqlen, shards, to_shard, to_pass, grad_requiring_tensor_key,
                                      compute_params, output_unshard_dimension, output_reduction)


UlyssesSPAttentionHF = unsupported_class(
    f"{_HERE}.UlyssesSPAttentionHF", "DeepSpeed's Ulysses attention for Hugging Face models", _SP)
# Accelerate reads this method's signature, then calls it: both must reach the refusal.
UlyssesSPAttentionHF.register_with_transformers = staticmethod(unsupported_function(
    f"{_HERE}.UlyssesSPAttentionHF.register_with_transformers",
    "DeepSpeed's Ulysses attention for Hugging Face models (Accelerate's "
    "ParallelismConfig(sp_backend='deepspeed', sp_size>1))", _SP))
UlyssesSPDataLoaderAdapter = unsupported_class(
    f"{_HERE}.UlyssesSPDataLoaderAdapter", "DeepSpeed's sequence-sharding data loader", _SP)

"""Model parallelism on a device mesh: tensor parallelism (AutoTP) and Ulysses sequence
parallelism, composed with ZeRO's data parallelism by the engine.

Tensor parallelism: :func:`apply_autotp` splits a model in place by DeepSpeed's
``tensor_parallel`` rules, with the layers of :mod:`.tensor`; every split parameter is a
plain ``nn.Parameter`` holding this rank's slice, whose layout record
(:func:`shardtrain.layout.layout_of`) holds its :class:`SplitSpec` (:func:`is_tp_split`
tells). The autograd functions that move
activations in and out of the tensor-parallel group are exported for hand-written layers, and
the differentiable all-to-all (:func:`all_to_all`) that Ulysses and the mixture-of-experts
layer (:mod:`shardtrain.moe`) move activations with.
:mod:`.rng` holds the random streams their dropout draws from (the same mask on every rank
of the group, or a different one per rank: Megatron's RNG tracker).

Sequence parallelism: :func:`enable_ulysses` routes a Hugging Face model's attention
through an all-to-all over the sequence-parallel group; :func:`shard_sequence` gives a rank
its slice of a batch (the engine's loader applies it; call it on batches from a loader of
your own; :class:`SequenceParallelLoader` wraps such a loader).

Tiling (:mod:`.tiling`): the MLP and the logits+loss computed a tile of the sequence at a
time (:class:`TiledMLP`, :func:`tiled_logits_loss`), so that long sequences' largest
activations exist for one tile only; exact, with DeepSpeed's ALST names as well.

The engine does both from its config (``tensor_parallel``, ``sequence_parallel_size``);
``engine.mpu`` (:class:`MeshMPU`) exposes the mesh's groups under DeepSpeed's names.
"""
from ._assemble import Parallelism, build_mesh, parallelize
from ..layout import SplitSpec, is_tp_split
from ._seq_autograd import all_to_all
from ._tp_autograd import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from .autotp import TPEntry, TPPlan, apply_autotp, autotp_splits
from .mpu import MeshMPU, mesh_from_mpu
from .tensor import (ColumnParallelLinear, RowParallelLinear, SharedInput,
                     VocabParallelEmbedding, vocab_parallel_cross_entropy)
from .tiling import (TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute, tiled_logits_loss,
                     tiled_loss, tiled_map)
from .ulysses import SequenceParallelLoader, UlyssesPlan, enable_ulysses, shard_sequence

__all__ = ["SplitSpec", "is_tp_split", "copy_to_group", "reduce_from_group", "gather_from_group",
           "scatter_to_group", "ColumnParallelLinear", "RowParallelLinear", "SharedInput",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "apply_autotp",
           "autotp_splits", "TPPlan", "TPEntry", "UlyssesPlan", "enable_ulysses",
           "shard_sequence", "MeshMPU", "mesh_from_mpu", "Parallelism", "build_mesh",
           "parallelize", "tiled_map", "tiled_loss", "tiled_logits_loss", "TiledMLP",
           "sequence_tiled_compute", "TiledFusedLogitsLoss", "SequenceParallelLoader",
           "all_to_all"]

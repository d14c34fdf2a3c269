"""The keys of DeepSpeed's checkpoint files that the importer reads, under DeepSpeed's own names
for them.

One source of truth: the reader looks these keys up, and the alias's
``deepspeed.checkpoint.constants`` re-exports them beside DeepSpeed's other checkpoint
constants, so a script that reads a DeepSpeed checkpoint with the alias's names reads it as
the importer does. Only names DeepSpeed 0.19.8 defines in its ``checkpoint/constants.py``
belong here, with its values (``tests/test_deepspeed_constants.py`` holds the alias module
against a record of them); the importer's other keys (``module``, ``dp_world_size``, ...)
have no DeepSpeed constant and stay where they are read. A public module, because the alias
tree imports it.
"""

# -- the optimizer states files ([bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt) ----------------
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"                          # stage 0 in 16 bits: the masters
FP32_FLAT_GROUPS = "fp32_flat_groups"                # stage 3: this rank's flat masters
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"   # stages 1-2
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
PARAM_GROUPS = "param_groups"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
LOSS_SCALER = "loss_scaler"

# -- the model states files (mp_rank_00_model_states.pt, zero_pp_rank_<r>_..._model_states.pt) ----
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
DS_VERSION = "ds_version"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"

# -- the universal form's per-parameter files (zero/<name>/<state>.pt) ----------------------------
PARAM = "param"                                      # the tensor in each file's dict
FP32_WEIGHT_KEY = "fp32"                             # the master's state: zero/<name>/fp32.pt

__all__ = [name for name in list(globals()) if name.isupper()]  # every key above, in order

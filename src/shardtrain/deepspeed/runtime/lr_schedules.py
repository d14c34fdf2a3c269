"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (shardtrain's own classes, in
:mod:`shardtrain.optim`) and DeepSpeed 0.19.8's names for them and their parameters.

The constants are the strings a ``scheduler`` block holds: a config built from them is the
config DeepSpeed reads, and shardtrain's schedules take the same keys.

Example:
    >>> from deepspeed.runtime.lr_schedules import WARMUP_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS
    >>> config["scheduler"] = {"type": WARMUP_LR,
    ...                        "params": {WARMUP_MAX_LR: 1e-3, WARMUP_NUM_STEPS: 100}}
"""
from ...optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from .._constants import constant_names

# -- the schedules' ``type`` names ----------------------------------------------------------------
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
#: the scheduler ``type`` names a config may use besides torch's own
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# -- LRRangeTest's parameters -------------------------------------------------------------------
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

# -- OneCycle's parameters: the cycle's shape, then the learning rate and the momentum --------------
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

# -- the warm-up schedules' parameters, and the two values of ``warmup_type`` ----------------------
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"

__all__ = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
           *constant_names(globals())]

"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedules (shardtrain's own classes, in
:mod:`shardtrain.optim`) and the names libraries check a config's scheduler against."""
from ...optim import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
#: the scheduler ``type`` names a config may use besides torch's own
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
           "WarmupCosineLR", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
           "WARMUP_COSINE_LR", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE"]

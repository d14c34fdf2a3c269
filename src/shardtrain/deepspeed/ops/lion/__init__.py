"""``deepspeed.ops.lion``: Lion is not provided (torch has no Lion optimizer)."""
from ..._missing import unsupported_class

_INSTEAD = "torch.optim.AdamW, or a Lion implementation passed as initialize(optimizer=...)"
DeepSpeedCPULion = unsupported_class("deepspeed.ops.lion.DeepSpeedCPULion", "the Lion optimizer", _INSTEAD)
FusedLion = unsupported_class("deepspeed.ops.lion.FusedLion", "the Lion optimizer", _INSTEAD)

__all__ = ["DeepSpeedCPULion", "FusedLion"]

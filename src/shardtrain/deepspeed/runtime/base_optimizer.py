"""``deepspeed.runtime.base_optimizer``: the base class of DeepSpeed's optimizer wrappers.

shardtrain does not wrap the optimizer: ``engine.optimizer`` is the torch optimizer itself
(updating this rank's fp32 slices at ZeRO stages 1-3), which also carries DeepSpeed's
``overflow``, ``loss_scale`` and ``cur_scale`` attributes. So nothing is an instance of
this class; code that asks ``isinstance(x, (torch.optim.Optimizer, DeepSpeedOptimizer))``
gets the right answer.
"""

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer:
    """DeepSpeed's optimizer-wrapper base; shardtrain's optimizers are plain torch ones."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's ZeRO optimizer base; shardtrain's optimizers are plain torch ones."""

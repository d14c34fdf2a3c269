"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is :class:`shardtrain.Engine`."""
from typing import Callable, Iterable, Union

import torch

from ... import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]

#: what ``initialize(optimizer=...)`` may be besides an optimizer: a callable of the parameters
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[torch.nn.Parameter], dict]], torch.optim.Optimizer]
#: what ``initialize(lr_scheduler=...)`` may be besides a scheduler: a callable of the optimizer
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], object]

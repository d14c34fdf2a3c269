"""``deepspeed.launcher``: the ``deepspeed`` command, over ``shardtrain run`` (torchrun)."""
from . import runner

__all__ = ["runner"]

"""``deepspeed.runtime.dataloader``: ``RepeatingLoader``, a loader restarted at its end."""
from ...data import RepeatingLoader

__all__ = ["RepeatingLoader"]

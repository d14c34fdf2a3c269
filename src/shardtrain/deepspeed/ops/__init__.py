"""``deepspeed.ops``: DeepSpeed's optimizers as plain torch optimizers (nothing is compiled).

``FusedAdam`` and ``DeepSpeedCPUAdam`` are ``torch.optim.Adam`` with DeepSpeed's defaults
and argument names (``adam_w_mode``/``adamw_mode`` choose decoupled weight decay, the
default); ``DeepSpeedCPUAdagrad`` is ``torch.optim.Adagrad``. They run wherever their
parameters are: on the device, or on host memory under ZeRO-Offload.
"""
from . import adagrad, adam, lion

__all__ = ["adam", "adagrad", "lion"]

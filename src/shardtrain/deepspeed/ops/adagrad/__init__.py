"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` as a torch optimizer."""
import torch

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's ``DeepSpeedCPUAdagrad``: ``torch.optim.Adagrad`` with its defaults.
    ``adamw_mode`` (which Accelerate passes to every CPU optimizer) has no meaning for
    Adagrad and is ignored."""

    def __init__(self, model_params, lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True, adamw_mode: bool = False):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no amsgrad variant.")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states

"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch optimizers."""
from __future__ import annotations

import inspect

import torch

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]

# torch 2.6 gave Adam the decoupled (AdamW) mode; before it, Adam had L2 decay only.
_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


def _adam_kwargs(name: str, bias_correction: bool, adamw_mode: bool, weight_decay: float) -> dict:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always "
                         f"corrects the moment estimates' bias.")
    if _HAS_DECOUPLED:
        return {"decoupled_weight_decay": bool(adamw_mode)}
    if adamw_mode and weight_decay:
        raise NotImplementedError(f"{name} with decoupled weight decay needs torch>=2.6 "
                                  f"(torch {torch.__version__}); use torch.optim.AdamW.")
    return {}


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam``: ``torch.optim.Adam`` (foreach kernels; ``fused=True`` is
    torch's choice to make), decoupled weight decay unless ``adam_w_mode=False``."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        extra = _adam_kwargs("FusedAdam", bias_correction, adam_w_mode, weight_decay)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **extra)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam``: ``torch.optim.Adam`` on whatever memory the
    parameters are in (ZeRO-Offload keeps this rank's slices in host memory), decoupled
    weight decay unless ``adamw_mode=False``."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        extra = _adam_kwargs("DeepSpeedCPUAdam", bias_correction, adamw_mode, weight_decay)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, **extra)
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states

"""Numeric precision: what dtype the model lives in, autocast, master weights, loss scaling.

Three modes, chosen by the config:

* fp32 (default): parameters, gradients and optimizer states in fp32.
* ``bf16`` / ``fp16``: module parameters are stored in 16 bits; the optimizer updates fp32
  master copies, which are copied back into the module after every step. fp16 adds dynamic
  loss scaling. Floating inputs are cast to the parameter dtype in forward.
* ``torch_autocast``: the module stays in fp32 and forward runs under ``torch.autocast``;
  fp16 autocast also gets loss scaling.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch

__all__ = ["Precision", "LossScaler", "build_loss_scaler"]

logger = logging.getLogger("shardtrain")


class LossScaler:
    """Loss scale with DeepSpeed's dynamic rules (window, hysteresis, floor).

    On overflow the scale halves (once hysteresis is spent) and the step is skipped; after
    ``window`` clean steps since the last overflow it doubles. A static scaler only skips.
    """

    def __init__(self, init_scale: float = 1.0, dynamic: bool = False, window: int = 1000,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False,
                 min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self._cur_iter = 0
        self._last_overflow_iter = -1
        self._cur_hysteresis = hysteresis

    def update(self, overflow: bool) -> None:
        """Advances the scale after a boundary step that did (or did not) overflow."""
        if self.dynamic:
            self._update_dynamic(overflow)
        self._cur_iter += 1

    def _update_dynamic(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self._cur_hysteresis == 1:
                if self.scale <= self.min_scale:
                    raise RuntimeError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g}: "
                        "training diverged. Lower the learning rate, enable gradient_clipping, "
                        "use bf16, or lower fp16.min_loss_scale.")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._cur_hysteresis -= 1
            self._last_overflow_iter = self._cur_iter
            return
        if self.consecutive_hysteresis:
            self._cur_hysteresis = self.hysteresis
        clean = self._cur_iter - self._last_overflow_iter - 1
        if clean > 0 and clean % self.window == 0:
            self.scale *= 2
            if not self.consecutive_hysteresis:
                self._cur_hysteresis = self.hysteresis

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "cur_iter": self._cur_iter,
                "last_overflow_iter": self._last_overflow_iter,
                "cur_hysteresis": self._cur_hysteresis}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._cur_iter = int(state["cur_iter"])
        self._last_overflow_iter = int(state["last_overflow_iter"])
        self._cur_hysteresis = int(state["cur_hysteresis"])


@dataclass(frozen=True)
class Precision:
    """The precision policy the engine follows; built once from the config.

    ``on_nonfinite`` is what a step whose gradients hold inf/NaN does: ``"skip"`` (fp16
    always; every precision by default), ``"apply"`` (``nonfinite_gradients: "apply"``, or
    ``bf16.check_grad_overflow: false``) or ``"error"``.
    """

    param_dtype: torch.dtype = torch.float32
    autocast_dtype: Optional[torch.dtype] = None
    on_nonfinite: str = "skip"

    @property
    def master_weights(self) -> bool:
        """16-bit module parameters: the optimizer updates fp32 master copies."""
        return self.param_dtype != torch.float32

    @property
    def overflow_by_norm(self) -> bool:
        """16-bit training decides a skip from the global gradient norm every step (and
        reports it), as DeepSpeed's fp16/bf16 optimizers do; fp32 without clipping only needs
        a cheaper finiteness check."""
        return self.on_nonfinite != "apply" and (self.scales_loss or self.master_weights)

    @property
    def scales_loss(self) -> bool:
        """fp16 in the module or under autocast: the loss is scaled (and overflows skip)."""
        return torch.float16 in (self.param_dtype, self.autocast_dtype)

    @classmethod
    def from_config(cls, cfg, device_type: str) -> "Precision":
        mode = cfg.nonfinite_gradients or "skip"
        if cfg.fp16.enabled:
            return cls(torch.float16, None, "skip")
        if cfg.bf16.enabled:
            return cls(torch.bfloat16, None, mode if cfg.bf16.check_grad_overflow else "apply")
        if cfg.torch_autocast.enabled:
            # No dtype means torch.autocast's own default: bf16 on the CPU, fp16 on CUDA.
            dtype = cfg.torch_autocast.dtype or torch.get_autocast_dtype(device_type)
            return cls(torch.float32, dtype, "skip" if dtype == torch.float16 else mode)
        return cls(on_nonfinite=mode)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The forward context. With autocast off in the config it is switched off, so a
        caller's surrounding autocast does not leak into the model (DeepSpeed does the same).
        """
        if self.autocast_dtype is None:
            return torch.autocast(device_type, enabled=False)
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def cast_input(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.master_weights and tensor.is_floating_point():
            return tensor.to(self.param_dtype)
        return tensor


def build_loss_scaler(cfg, precision: Precision) -> LossScaler:
    """fp16 (and fp16 autocast) get a loss scale; everything else a constant 1."""
    if not precision.scales_loss:
        return LossScaler()
    fp16 = cfg.fp16
    if fp16.loss_scale > 0:
        return LossScaler(init_scale=fp16.loss_scale, dynamic=False)
    return LossScaler(init_scale=2.0 ** fp16.initial_scale_power, dynamic=True,
                      window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                      consecutive_hysteresis=fp16.consecutive_hysteresis,
                      min_scale=fp16.min_loss_scale)

"""Expert parameters beside the dense ones: two strategies answering as one.

The experts of an expert-parallel MoE layer differ from rank to rank of its expert-parallel
group and repeat on the ranks of its expert-data-parallel group. Each expert's gradient on the
rank that holds it already sums what every rank's tokens contributed (they travelled to it),
so it is summed over the expert-data-parallel group only and divided by the whole
data-parallel size, as the dense gradients are: single-process training's gradient
(DeepSpeed's rule since its fix of expert gradient scaling). ZeRO shards the experts'
gradients and optimizer states over the expert-data-parallel group; at stage 3 the experts
stay whole on their ranks (each holds its share of the layer already), trained as at stage 2. The global norm adds the
experts' squares, summed over the expert-parallel group (each expert counted once), to the
dense ones'.

:class:`WithExperts` is one strategy to the engine (:class:`StrategyProtocol`): each call
goes to both parts, the dense one first (the same order on every rank, so collectives of
different groups never wait on each other out of turn).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from .. import comm
from ..comm import Group

__all__ = ["WithExperts", "ExpertReducedGrads"]


@dataclasses.dataclass
class ExpertReducedGrads:
    """The dense part's and the experts' reduced gradients; ``tensors``, ``split`` and
    ``unused`` are both parts' together (what the engine reads)."""

    dense: Any
    experts: Any

    @property
    def tensors(self) -> List[torch.Tensor]:
        return self.dense.tensors + self.experts.tensors

    @property
    def split(self) -> List[bool]:
        return self.dense.split + self.experts.split

    @property
    def unused(self) -> List[torch.nn.Parameter]:
        return self.dense.unused + self.experts.unused


class WithExperts:
    """The dense parameters' strategy (over the data-parallel group) and the experts'
    (over ``edp``, averaged by the data-parallel size), as one.

    Args:
        dense, experts: the two strategies (the same stage).
        ep: the expert-parallel group (the experts' squares add up over it in the norm).
    """

    def __init__(self, dense: Any, experts: Any, ep: Group):
        self.dense, self.experts, self.ep = dense, experts, ep
        self.stage = dense.stage
        self.supports_no_sync = dense.supports_no_sync and experts.supports_no_sync
        self.params = dense.params + experts.params
        self._parts = (dense, experts)
        self._owner = {id(p): experts for p in experts.params}

    def _of(self, param: torch.nn.Parameter) -> Any:
        return self._owner.get(id(param), self.dense)

    # -- optimizer ----------------------------------------------------------------------------

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        for part in self._parts:
            part.adopt(optimizer)

    def slots(self) -> list:
        return self.dense.slots() + self.experts.slots()

    def received_grads(self) -> bool:
        return any(part.received_grads() for part in self._parts)

    def refresh_masters(self, params: Optional[List[torch.nn.Parameter]] = None) -> None:
        if params is None:
            for part in self._parts:
                part.refresh_masters()
            return
        for part in self._parts:
            mine = [p for p in params if self._of(p) is part]
            if mine:
                part.refresh_masters(mine)

    def copy_masters_to_params(self) -> None:
        for part in self._parts:
            part.copy_masters_to_params()

    # -- forward and backward -----------------------------------------------------------------

    def begin_forward(self) -> None:
        for part in self._parts:
            part.begin_forward()

    def end_forward(self, grad_enabled: bool) -> None:
        for part in self._parts:
            part.end_forward(grad_enabled)

    def begin_backward(self, sync: bool) -> None:
        for part in self._parts:
            part.begin_backward(sync)

    def end_backward(self, accumulation_steps: int) -> None:
        for part in self._parts:
            part.end_backward(accumulation_steps)

    # -- the step -----------------------------------------------------------------------------

    def optimizer_grads(self, accumulation_steps: int) -> ExpertReducedGrads:
        return ExpertReducedGrads(self.dense.optimizer_grads(accumulation_steps),
                                  self.experts.optimizer_grads(accumulation_steps))

    def accumulated_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        return self._of(param).accumulated_grad(param)

    def global_norm(self, grads: ExpertReducedGrads, device: torch.device) -> torch.Tensor:
        dense = self.dense.global_norm(grads.dense, device)
        experts = self.experts.global_norm(grads.experts, device).square().reshape(1)
        experts = experts.to(device)
        if self.ep.size() > 1:
            comm.all_reduce(experts, group=self.ep)
        return (dense.to(device).square() + experts[0]).sqrt()

    def all_finite(self, grads: ExpertReducedGrads, device: torch.device) -> bool:
        dense = self.dense.all_finite(grads.dense, device)
        experts = torch.tensor([float(self.experts.all_finite(grads.experts, device))],
                               device=device)
        if self.ep.size() > 1:
            comm.all_reduce(experts, op="min", group=self.ep)
        return dense and bool(experts.item())

    def after_step(self) -> None:
        for part in self._parts:
            part.after_step()

    def zero_grads(self) -> None:
        for part in self._parts:
            part.zero_grads()

    # -- the rest -----------------------------------------------------------------------------

    def compile(self, module: torch.nn.Module, backend: str, options: dict) -> Any:
        return self.dense.compile(module, backend, options)

    def compile_in_graph(self, backend: str, options: dict) -> Any:
        raise NotImplementedError("DeepCompile with expert-parallel MoE layers (ep_size > 1) is "
                                  "not provided: set compile.deepcompile false, or build the "
                                  "layers with ep_size=1.")

    def held_tensors(self) -> Dict[str, List[torch.Tensor]]:
        return _merged(part.held_tensors() for part in self._parts)

    def model_states(self) -> Dict[str, List[torch.Tensor]]:
        return _merged(part.model_states() for part in self._parts)

    def release_all(self) -> None:
        for part in self._parts:
            part.release_all()

    def stats(self) -> Dict[str, Any]:
        return {**self.dense.stats(), "experts": self.experts.stats()}

    def units(self) -> List[torch.nn.Module]:
        return self.dense.units()

    def remove_hooks(self) -> None:
        for part in self._parts:
            part.remove_hooks()


def _merged(dicts) -> Dict[str, List[torch.Tensor]]:
    out: Dict[str, List[torch.Tensor]] = {}
    for d in dicts:
        for key, tensors in d.items():
            out.setdefault(key, []).extend(tensors)
    return out

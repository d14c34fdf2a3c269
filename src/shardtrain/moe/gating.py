"""Token routing for a mixture of experts: DeepSpeed's top-1 and top-2 gating rules
(Switch Transformer, GShard), as pure functions of the router's logits.

Each rule returns a :class:`Routing`: the load-balancing loss ``l_aux``, the combine weights
``[tokens, experts, capacity]`` (a token's gate value at its slot in an expert's buffer),
the dispatch mask (where the weights are non-zero) and ``exp_counts`` (tokens each expert was
chosen by, before any was dropped). An expert takes at most ``capacity`` tokens:
``ceil(tokens / experts * capacity_factor)`` (twice the factor for top-2), at least
``min_capacity``; the tokens over it are dropped (their output is zero, or the residual's).
Dropless routing (``drop_tokens=False``) sizes the buffers by the most tokens any expert got,
agreed over the expert-parallel group (``agree``), so nothing is dropped and every rank's
buffers have one shape.

Which tokens an over-full expert keeps:

* top-1 with random token selection (``use_rts``, DeepSpeed's default): the tokens of the
  highest uniform draws from ``generator``;
* top-1 without it, and top-2: the first ones in order (DeepSpeed's top-1 takes ``topk`` of
  a 0/1 mask there, whose choice among equal values torch leaves open; the first ones are
  the order it documents for top-2, which uses positions by cumulative count).

Random draws (RTS, the ``RSample`` noisy policy, top-2's Gumbel sampling of the second
expert) come from ``generator`` (torch's default one if None): a run repeats exactly with
the same generator state, and a single-process reference that gates each rank's tokens with
the same draws gives the same routing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["Routing", "capacity", "top1", "top2", "gumbel", "uniform"]


@dataclass
class Routing:
    """Where each token goes: ``combine`` ``[S, E, C]`` float, ``dispatch`` its non-zeros,
    ``l_aux`` the load-balancing loss, ``exp_counts`` ``[E]`` (on the CPU, as DeepSpeed)."""

    l_aux: torch.Tensor
    combine: torch.Tensor
    dispatch: torch.Tensor
    exp_counts: torch.Tensor

    def as_tuple(self):
        """DeepSpeed's order: (l_aux, combine_weights, dispatch_mask, exp_counts)."""
        return self.l_aux, self.combine, self.dispatch, self.exp_counts


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """Tokens one expert takes: ``ceil(tokens / experts * factor)``, at least ``min_capacity``."""
    return max(int(math.ceil(tokens / experts * factor)), int(min_capacity))


def uniform(shape: torch.Size, device: torch.device,
            generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Uniform draws in [0, 1) on ``device``: from ``generator`` where it lives (then moved),
    else from ``device``'s default generator."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def gumbel(shape: torch.Size, device: torch.device,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Gumbel(0, 1) noise: ``-log(-log(u))`` of uniform draws."""
    u = uniform(shape, device, generator)
    tiny = torch.finfo(u.dtype).tiny
    return -torch.log(-torch.log(u.clamp_min(tiny)).clamp_min(tiny))


def _same(value: int) -> int:
    return value


def top1(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4,
         used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
         drop_tokens: bool = True, use_rts: bool = True,
         generator: Optional[torch.Generator] = None,
         agree: Callable[[int], int] = _same) -> Routing:
    """Top-1 gating of ``logits`` ``[S, E]``.

    Args:
        logits: the router's output for each token (fp32).
        capacity_factor, min_capacity: the buffer size (:func:`capacity`).
        used_token: ``[S]`` 0/1: tokens that take part (None: all).
        noisy_gate_policy: ``"RSample"``: the expert is chosen on logits plus Gumbel noise.
        drop_tokens: False: dropless (buffers as large as the fullest expert's, agreed).
        use_rts: random token selection among an over-full expert's tokens.
        generator: where random draws come from.
        agree: the largest of a value over the expert-parallel group (dropless sizing).
    """
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = gates
    if noisy_gate_policy == "RSample":
        chooser = logits + gumbel(logits.shape, logits.device, generator)
    mask = F.one_hot(torch.argmax(chooser, dim=1), num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts
    cap = _buffer(exp_counts, tokens, experts, capacity_factor, min_capacity, drop_tokens, agree)
    if use_rts:
        draws = uniform(mask.shape, logits.device, generator)
        keep = _highest(mask * draws, mask, cap)
    else:
        keep = mask * (torch.cumsum(mask, dim=0) <= cap)
    location = torch.sum((torch.cumsum(keep, dim=0) - 1) * keep, dim=1)
    weights = gates * keep.float()
    combine = weights.unsqueeze(2) * F.one_hot(location, num_classes=cap).float().unsqueeze(1)
    return Routing(l_aux, combine, combine.bool(), exp_counts.cpu())


def top2(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4,
         drop_tokens: bool = True, second_sampling: bool = True,
         generator: Optional[torch.Generator] = None,
         agree: Callable[[int], int] = _same) -> Routing:
    """Top-2 gating of ``logits`` ``[S, E]``: each token to its two best experts, the two
    gate values renormalised to sum to 1; the second expert chosen on logits plus Gumbel
    noise with ``second_sampling`` (DeepSpeed's ``top2_2nd_expert_sampling``). Buffers hold
    every first choice before any second one; ``capacity_factor`` counts twice. Other
    arguments as :func:`top1`."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=experts)
    second = logits + gumbel(logits.shape, logits.device, generator) if second_sampling \
        else logits
    mask2 = F.one_hot(torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1),
                      num_classes=experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    cap = _buffer(exp_counts, tokens, experts, 2 * capacity_factor, min_capacity,
                  drop_tokens, agree)
    mask1 = mask1 * (locations1 < cap)
    mask2 = mask2 * (locations2 < cap)
    gate1 = (gates * mask1.float()).sum(dim=1)
    gate2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    combine = torch.zeros(tokens, experts, cap, dtype=gates.dtype, device=gates.device)
    for gate, mask, locations in ((gate1, mask1, locations1), (gate2, mask2, locations2)):
        location = torch.sum(locations * mask, dim=1)
        weights = (gate / denom).unsqueeze(1) * mask.float()
        combine = combine + weights.unsqueeze(2) * \
            F.one_hot(location, num_classes=cap).float().unsqueeze(1)
    return Routing(l_aux, combine, combine.bool(), exp_counts.cpu())


def _buffer(exp_counts: torch.Tensor, tokens: int, experts: int, factor: float,
            min_capacity: int, drop_tokens: bool, agree: Callable[[int], int]) -> int:
    """The buffer size: the capacity, or dropless the most tokens any expert got anywhere."""
    if drop_tokens:
        return capacity(tokens, experts, factor, min_capacity)
    return max(1, agree(int(exp_counts.max().item())))


def _highest(priority: torch.Tensor, mask: torch.Tensor, cap: int) -> torch.Tensor:
    """``mask`` kept where a token's priority is among its expert's ``cap`` highest."""
    k = min(cap, priority.shape[0])
    top = torch.topk(priority, k=k, dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, top, 1)

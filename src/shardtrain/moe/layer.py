"""The mixture-of-experts layer, with DeepSpeed's names and semantics
(``deepspeed.moe.layer.MoE``): a router picks one or two experts per token
(:mod:`.gating`), the tokens travel to the ranks that hold their experts (all-to-all over
the expert-parallel group), the experts run, and the outputs travel back and are combined
with the gate values.

``MoE(hidden_size, expert, num_experts, ep_size)`` keeps ``num_experts / ep_size`` copies of
``expert`` on each rank (expert-parallel rank ``r`` holds the global experts
``r * local .. (r + 1) * local - 1``); its parameters are marked as DeepSpeed marks them
(``allreduce = False``, ``group_name = "ep_size_<N>"``), so ``is_moe_param`` and the
optimizer-group helpers find them. The forward returns ``(output, l_aux, exp_counts)``.

Example:
    >>> expert = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
    ...                              torch.nn.Linear(256, 64))
    >>> moe = MoE(64, expert, num_experts=4, ep_size=2, k=2)
    >>> out, l_aux, exp_counts = moe(hidden)      # hidden: [batch, seq, 64]
    >>> loss = task_loss(out) + 0.01 * l_aux
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import comm
from ..layout import ExpertSplit, place
from ..parallel import all_to_all
from . import gating
from ._auto_config import parse_block
from ._groups import ExpertGroups, expert_groups
from .auto import auto_ep

__all__ = ["MoE", "MOELayer", "TopKGate", "Experts", "largest_over", "split_experts",
           "wire_experts"]

_NOISY = (None, "Jitter", "RSample")


def largest_over(group: Optional[comm.Group], device: Any = "cpu") -> Callable[[int], int]:
    """``agree`` for the gating rules: the largest of a value over ``group`` (dropless buffer
    sizes; None or one rank: the value itself)."""
    def agree(value: int) -> int:
        if group is None or group.size() == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        comm.all_reduce(t, op="max", group=group)
        return int(t.item())
    return agree


class _Router(torch.nn.Linear):
    """The router's bias-free linear map, computed in fp32 whatever the weight's dtype (a
    module of its own, so that ZeRO-3 gathers its weight around its forward)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input.float(), self.weight.float())


class TopKGate(torch.nn.Module):
    """The router: a bias-free fp32 linear map to one logit per expert, then top-1 or top-2
    gating (:func:`shardtrain.moe.gating.top1` / ``top2``) with the training or evaluation
    capacity factor. ``Jitter`` multiplies the router's input by uniform noise in
    ``[1 - 1e-2, 1 + 1e-2]`` while training; ``RSample`` adds Gumbel noise to the logits that
    choose the expert while training. Random draws come from :attr:`generator` (None:
    torch's default generator)."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if k not in (1, 2):
            raise NotImplementedError(f"MoE k={k}: top-1 and top-2 gating are provided; use k=1 "
                                      "or k=2.")
        if noisy_gate_policy not in _NOISY:
            raise ValueError(f"MoE noisy_gate_policy {noisy_gate_policy!r}: use one of {_NOISY}.")
        self.wg = _Router(model_dim, num_experts, bias=False).float()
        self.k, self.num_experts = k, num_experts
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ep_group: Optional[comm.Group] = ep_group
        self.generator: Optional[torch.Generator] = None

    def forward(self, input: torch.Tensor, used_token: Optional[torch.Tensor] = None,
                use_tutel: bool = False):
        """``(l_aux, combine_weights, dispatch_mask, exp_counts)`` for ``input`` ``[S, M]``."""
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            eps = 1e-2
            noise = gating.uniform(x.shape, x.device, self.generator)
            x = x * (1.0 - eps + 2 * eps * noise)
        logits = self.wg(x)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            routing = gating.top1(
                logits, factor, self.min_capacity, used_token,
                self.noisy_gate_policy if self.training else None, self.drop_tokens,
                self.use_rts, self.generator, self._agree)
        else:
            routing = gating.top2(logits, factor, self.min_capacity, self.drop_tokens,
                                   self.top2_2nd_expert_sampling, self.generator, self._agree)
        return routing.as_tuple()

    def _agree(self, value: int) -> int:
        return largest_over(self.ep_group, self.wg.weight.device)(value)


class Experts(torch.nn.Module):
    """``num_local_experts`` copies of ``expert`` (``deepspeed_experts``), each run on its own
    slice of the tokens; their parameters marked as expert parameters."""

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1,
                 expert_group_name: Optional[str] = None):
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList(
            copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False
                p.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` ``[ranks, local experts, capacity, M]``: expert ``i`` takes ``[:, i]``."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)


class MOELayer(torch.nn.Module):
    """Gate, dispatch, experts, combine: DeepSpeed's ``MOELayer``. The expert-parallel group
    is set by :meth:`MoE.set_deepspeed_parallelism` (before it, only ``ep_size`` 1 runs)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size = ep_group_name, ep_size
        self.num_local_experts = num_local_experts
        self.ep_group: Optional[comm.Group] = None
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def _set_ep_group(self, ep_group: comm.Group) -> None:
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = input[0]
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MoE with ep_size {self.ep_size} has no expert-parallel group yet: build the "
                "engine with shardtrain.initialize (or deepspeed.initialize), or call "
                "moe.set_deepspeed_parallelism() on every rank first.")
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        used = input[1] if len(input) > 1 else None
        self.l_aux, combine, dispatch, self.exp_counts = self.gate(tokens, used)
        # [experts, capacity, M]: each expert's buffer of tokens
        dispatched = torch.einsum("sec,sm->ecm", dispatch.type_as(hidden), tokens)
        if self.ep_size > 1:
            dispatched = all_to_all(dispatched, self.ep_group, 0, 0)
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_out = self.experts(dispatched)
        if self.ep_size > 1:
            expert_out = all_to_all(expert_out.contiguous(), self.ep_group, 0, 0)
        expert_out = expert_out.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined = torch.einsum("sec,ecm->sm", combine.type_as(hidden), expert_out)
        return combined.reshape(hidden.shape)


class MoE(torch.nn.Module):
    """A mixture-of-experts layer (DeepSpeed's ``deepspeed.moe.layer.MoE``).

    Args:
        hidden_size: the model dimension of the tokens.
        expert: the expert module (``[..., hidden_size] -> [..., hidden_size]``), copied
            ``num_experts / ep_size`` times.
        num_experts: experts in the layer, over all ranks.
        ep_size: ranks the experts are split over (each holds ``num_experts / ep_size``).
        k: experts per token, 1 or 2.
        capacity_factor, eval_capacity_factor: tokens an expert takes, as a multiple of
            ``tokens / experts`` (training, evaluation).
        min_capacity: at least this many.
        use_residual: a residual MoE: ``expert`` also runs on every token, and a learned
            two-way softmax mixes the two outputs.
        noisy_gate_policy: None, ``"Jitter"`` or ``"RSample"``.
        drop_tokens: False: dropless routing (buffers sized by the fullest expert).
        use_rts: random selection of the tokens an over-full expert keeps (top-1).
        use_tutel, enable_expert_tensor_parallelism: DeepSpeed's kernels and expert slicing,
            not provided (refused when true).
        top2_2nd_expert_sampling: top-2's second expert chosen with Gumbel noise.

    The forward returns ``(output, l_aux, exp_counts)``.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"MoE num_experts must be a positive integer, got {num_experts!r}.")
        if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"MoE num_experts {num_experts} is not divisible by ep_size "
                             f"{ep_size!r}: each expert-parallel rank holds num_experts / "
                             "ep_size experts; choose an ep_size that divides num_experts.")
        for name, value in (("use_tutel", use_tutel),
                            ("enable_expert_tensor_parallelism",
                             enable_expert_tensor_parallelism)):
            if value:
                raise NotImplementedError(f"MoE {name}=True is not provided; leave it False.")
        self.use_residual, self.enable_expert_tensor_parallelism = use_residual, False
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                        min_capacity, noisy_gate_policy, drop_tokens, use_rts, None,
                        top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size,
                                      self.num_local_experts)
        self.groups: Optional[ExpertGroups] = None
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  mesh: Optional[comm.Mesh] = None) -> None:
        """Creates (or finds) the expert-parallel groups of ``ep_size`` (on ``mesh``: over
        the ranks of each tensor-parallel coordinate) and gives the layer its group: a
        collective, every rank at the same point (the engine calls it)."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError("use_data_before_expert_parallel_: the expert-parallel "
                                      "groups are adjacent ranks here; leave it False.")
        self.groups = expert_groups(self.ep_size, mesh)
        self.deepspeed_moe._set_ep_group(self.groups.ep)
        if self.ep_size > 1:  # each expert's parameters record which expert they are
            for index, expert in enumerate(self.deepspeed_moe.experts.deepspeed_experts):
                split = ExpertSplit(index, self.num_local_experts, self.ep_size,
                                    self.groups.ep_rank)
                for p in expert.parameters():
                    place(p, expert=split, expert_groups=(self.groups.ep, self.groups.edp))

    @property
    def global_expert_ids(self) -> range:
        """The layer's experts this rank holds, by their index among all ``num_experts``."""
        rank = self.groups.ep_rank if self.groups is not None else 0
        return range(rank * self.num_local_experts, (rank + 1) * self.num_local_experts)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, l_aux, exp_counts)``: the combined experts' output (with
        ``use_residual``, mixed with ``expert``'s own), the load-balancing loss and the tokens
        each expert was chosen by."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp_out = self.mlp(hidden_states)
            if isinstance(mlp_out, tuple):
                mlp_out = mlp_out[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp_out * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def split_experts(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The expert parameters of ``module``'s layers split over ranks (``ep_size`` > 1): each
    rank holds other experts, so they are not the same on every rank."""
    return [p for m in module.modules() if isinstance(m, MoE) and m.ep_size > 1
            for p in m.deepspeed_moe.experts.parameters()]


def wire_experts(module: torch.nn.Module, mesh: Optional[comm.Mesh] = None,
                 auto: Optional[Dict[str, Any]] = None) -> Optional[ExpertGroups]:
    """Gives each :class:`MoE` layer of ``module`` its expert-parallel group, and with an
    enabled ``expert_parallel`` block ``auto`` splits the experts of the model's own MoE
    blocks (:func:`~shardtrain.moe.auto.auto_ep`): a collective, every rank at the same
    point. Returns the groups of the experts split over ranks (``ep_size`` > 1), or None when
    none are. On a mesh with tensor parallelism the layers' experts are split over the ranks
    of each tensor-parallel coordinate. Refused by name: experts split over different sizes
    in one model, and split experts with sequence parallelism."""
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]
    config = parse_block(auto)
    sizes = sorted({m.ep_size for _, m in layers if m.ep_size > 1}
                   | ({config.autoep_size} if config.enabled and config.autoep_size > 1 else set()))
    if len(sizes) > 1:
        raise NotImplementedError(f"experts split over different sizes {sizes} in one model "
                                  "(MoE layers' ep_size, expert_parallel.autoep_size): use one.")
    for _, m in layers:
        m.set_deepspeed_parallelism(mesh=mesh)
    auto_ep(module, auto, mesh)
    return expert_groups(sizes[0], mesh) if sizes else None

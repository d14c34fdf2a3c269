"""AutoEP: the experts of a Hugging Face MoE model split over an expert-parallel group.

The engine calls :func:`auto_ep` when the config's ``expert_parallel`` block is enabled. It
finds the model's MoE blocks by a preset (``mixtral``, ``qwen2_moe``, ``qwen3_moe``,
``deepseek_v2``, ``deepseek_v3``) or the custom patterns, and in each replaces the experts
module (the experts' weights stacked along their first dimension, called as
``experts(hidden_states, top_k_index, top_k_weights)`` by the block: transformers' own MoE
classes) with :class:`SplitExperts`, which keeps this rank's ``num_experts / autoep_size``
experts. Everything else of the block stays the model's: the router (its routing rule and the
router logits its auxiliary loss is computed from), shared experts, the block's forward. With
DeepSpeed's routing keys (``top_k``, ``score_func``, ``route_norm``, ``route_scale``) each
router's forward follows DeepSpeed's rule instead (:class:`RoutingRule`), on its own weight.

Routing is dropless: every (token, expert) pair the router chose travels to the rank holding
the expert (an all-to-all of uneven sizes, agreed by a first all-to-all of the counts), is
computed there, and comes back to be weighted and summed as the model's own experts module
does. So the outputs, the loss and every gradient are those of the unsplit model.

Example:
    >>> config = {..., "expert_parallel": {"enabled": True, "autoep_size": 2,
    ...                                    "preset_model": "mixtral"}}
    >>> engine, *_ = shardtrain.initialize(model=MixtralForCausalLM(cfg), config=config)
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import comm
from ..layout import ExpertSplit, layout_of, place
from ..zero import values
from ._auto_config import PRESETS, AutoEPConfig, Preset, parse_block
from ._groups import ExpertGroups, expert_groups

__all__ = ["MoEBlock", "RoutingRule", "SplitExperts", "auto_ep", "find_moe_blocks", "parse_block",
           "route_by_rule"]


class SplitExperts(torch.nn.Module):
    """This rank's experts of one MoE block, stacked as the model's experts module stacks all
    of them (the same attribute names, so the parameters keep the model's names), called as
    it is: ``(hidden_states (tokens, hidden), top_k_index (tokens, k), top_k_weights (tokens,
    k)) -> (tokens, hidden)``; an index of ``num_experts`` routes its slot nowhere (as
    transformers' eager experts loop skips it).

    Args:
        experts: the model's experts module (every expert).
        preset: the weights' names.
        groups: the expert-parallel groups; this rank keeps experts ``ep_rank * n`` to
            ``(ep_rank + 1) * n`` of ``num_experts``, ``n = num_experts / ep_size``.
    """

    def __init__(self, experts: torch.nn.Module, preset: Preset, num_experts: int,
                 groups: ExpertGroups):
        super().__init__()
        self.num_experts, self.groups = num_experts, groups
        self.num_local = num_experts // groups.ep_size
        self.names = (preset.expert_w1, preset.expert_w2, preset.expert_w3)
        first = groups.ep_rank * self.num_local
        split = ExpertSplit(None, self.num_local, groups.ep_size, groups.ep_rank)
        for name in filter(None, self.names):
            whole = getattr(experts, name)  # with AutoTP: this rank's slice of each expert
            # built under zero.Init: gathered (a collective, every rank in the same order)
            value = values.read_whole(whole).view(layout_of(whole).local_shape)
            mine = torch.nn.Parameter(value[first:first + self.num_local].clone(),
                                      requires_grad=whole.requires_grad)
            # DeepSpeed's marks of an expert parameter (its ZeRO groups and optimizer groups)
            mine.allreduce, mine.group_name = False, groups.name
            tp = layout_of(whole)
            place(mine, local_shape=mine.shape, tp=tp.tp, tp_group=tp.tp_group, expert=split,
                  expert_groups=(groups.ep, groups.edp))
            self.register_parameter(name, mine)
        self.act_fn = getattr(experts, "act_fn", None) or F.silu
        if any(layout_of(p).tp is not None for p in self.parameters()):
            # AutoTP's entry into and exit from the tensor-parallel group, which split them
            self._forward_pre_hooks.update(experts._forward_pre_hooks)
            self._forward_pre_hooks_with_kwargs.update(experts._forward_pre_hooks_with_kwargs)
            self._forward_hooks.update(experts._forward_hooks)
            self._forward_hooks_with_kwargs.update(experts._forward_hooks_with_kwargs)

    def extra_repr(self) -> str:
        return (f"experts {self.groups.ep_rank * self.num_local}.."
                f"{(self.groups.ep_rank + 1) * self.num_local - 1} of {self.num_experts}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # the (token, slot) pairs by expert
        # an index of num_experts (a slot routed nowhere) sorts last and is left out
        counts = torch.bincount(chosen, minlength=self.num_experts + 1)[:self.num_experts]
        sent = _sizes(self.groups, counts)
        order = order[:sum(sent.to_ranks)]
        tokens = order // k
        rows = _exchange(hidden_states[tokens], self.groups.ep, sent.to_ranks, sent.from_ranks)
        # what arrived, source rank by source rank, each in its expert order: by expert
        local = torch.repeat_interleave(
            torch.arange(self.num_local, device=rows.device).repeat(self.groups.ep_size),
            sent.received.reshape(-1).to(rows.device))
        by_expert = torch.argsort(local, stable=True)
        done = self._compute(rows[by_expert], sent.received.sum(0).tolist())
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        out = _exchange(done[back], self.groups.ep, sent.from_ranks, sent.to_ranks)
        weighted = out * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(
            0, tokens, weighted.to(hidden_states.dtype))

    def _compute(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """Each local expert on its rows (``counts[e]`` of them, in expert order)."""
        w1, w2, w3 = (getattr(self, n) if n else None for n in self.names)
        outs = []
        for e, x in enumerate(rows.split(counts)):
            if w3 is None:
                gate, up = F.linear(x, w1[e]).chunk(2, dim=-1)
            else:
                gate, up = F.linear(x, w1[e]), F.linear(x, w3[e])
            outs.append(F.linear(self.act_fn(gate) * up, w2[e]))
        return torch.cat(outs) if outs else rows


class _Sizes:
    """How many rows go to each rank of the expert-parallel group, how many come from each,
    and (``received``, ``(ep_size, num_local)``) how many of those for each local expert."""

    def __init__(self, to_ranks: List[int], from_ranks: List[int], received: torch.Tensor):
        self.to_ranks, self.from_ranks, self.received = to_ranks, from_ranks, received


def _sizes(groups: ExpertGroups, counts: torch.Tensor) -> _Sizes:
    per_rank = counts.reshape(groups.ep_size, -1)
    received = torch.empty_like(per_rank)
    comm.all_to_all_single(received, per_rank.contiguous(), group=groups.ep)
    received = received.cpu()
    return _Sizes(per_rank.sum(1).tolist(), received.sum(1).tolist(), received)


class _Exchange(torch.autograd.Function):
    """All-to-all of rows in uneven parts; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: comm.Group, send: List[int], recv: List[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return _all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def _all_to_all(x: torch.Tensor, group: comm.Group, send: List[int], recv: List[int]):
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), group=group, output_split_sizes=recv,
                           input_split_sizes=send)
    return out


def _exchange(x: torch.Tensor, group: comm.Group, send: List[int], recv: List[int]):
    if group.size() == 1:
        return x
    return _Exchange.apply(x, group, send, recv)


# -- finding the blocks -----------------------------------------------------------------------

@dataclasses.dataclass
class MoEBlock:
    """One MoE block found: its full name, the module, its experts module, the expert count."""

    name: str
    module: torch.nn.Module
    experts: torch.nn.Module
    num_experts: int


def find_moe_blocks(model: torch.nn.Module, preset: Preset) -> List[MoEBlock]:
    """The MoE blocks of ``model`` ``preset`` describes: modules whose full name matches its
    ``moe_layer_pattern`` and that have its router and experts children, the experts' weights
    stacked ``(num_experts, ...)``. A module that matches the name but lacks the parts raises
    ValueError naming what is missing."""
    blocks = []
    pattern = re.compile(preset.moe_layer_pattern)
    for name, module in model.named_modules():
        if not name or not pattern.fullmatch(name):
            continue
        router = getattr(module, preset.router_pattern, None)
        experts = getattr(module, preset.experts_pattern, None)
        if router is None and experts is None:
            continue  # a dense MLP among the MoE layers (DeepSeek's first layers)
        if router is None or experts is None:
            raise ValueError(
                f"expert_parallel: {name} ({type(module).__name__}) matches moe_layer_pattern "
                f"{preset.moe_layer_pattern!r} but has no child "
                f"{preset.router_pattern if router is None else preset.experts_pattern!r} "
                f"({'router_pattern' if router is None else 'expert_pattern'}); its "
                f"children: {[n for n, _ in module.named_children()]}.")
        blocks.append(MoEBlock(name, module, experts, _check_experts(name, experts, preset)))
    return blocks


def _check_experts(name: str, experts: torch.nn.Module, preset: Preset) -> int:
    where = f"expert_parallel: the experts of {name} ({type(experts).__name__})"
    weights = [w for w in (preset.expert_w1, preset.expert_w2, preset.expert_w3) if w]
    own = dict(experts.named_parameters())
    missing = [w for w in weights if w not in own]
    if isinstance(experts, torch.nn.ModuleList) or missing:
        raise ValueError(
            f"{where} have no stacked weights {missing or weights} (expert_w1/w2/w3); their "
            f"parameters: {sorted(own)[:6]}. AutoEP splits experts held as weights of shape "
            "(num_experts, ...) in one module (transformers' MoE models since v5); name them "
            "with expert_w1 (gate and up, or gate alone with expert_w3 the up projection) and "
            "expert_w2 (down).")
    extra = sorted(set(own) - set(weights))
    if extra:
        raise NotImplementedError(f"{where} have parameters {extra} besides {weights}: experts "
                                  "with biases or other weights are not provided.")
    shapes = {w: layout_of(own[w]).full_shape for w in weights}  # partitioned: the whole's
    counts = {shape[0] for shape in shapes.values() if shape}
    if len(counts) != 1 or any(len(shape) != 3 for shape in shapes.values()):
        raise ValueError(f"{where}: {weights} are not all of shape (num_experts, out, in): "
                         f"{shapes}.")
    params = list(inspect.signature(experts.forward).parameters)
    if len(params) != 3:
        raise ValueError(f"{where} are called with {params}; AutoEP replaces experts called as "
                         "experts(hidden_states, top_k_index, top_k_weights).")
    return counts.pop()


# -- splitting them ---------------------------------------------------------------------------

def auto_ep(model: torch.nn.Module, block: Dict[str, Any], mesh: Optional[comm.Mesh] = None
            ) -> Optional[ExpertGroups]:
    """Splits the experts of ``model``'s MoE blocks over ``autoep_size`` ranks as the
    ``expert_parallel`` ``block`` says (a collective: the groups are made on every rank);
    returns the groups, or None when the block is not enabled."""
    config = parse_block(block)
    if not config.enabled:
        return None
    blocks = _blocks(model, config)
    groups = expert_groups(config.autoep_size, mesh)
    for b in blocks:
        if b.num_experts % config.autoep_size:
            raise ValueError(f"expert_parallel: {b.name} has {b.num_experts} experts, which "
                             f"autoep_size {config.autoep_size} does not divide: choose an "
                             f"autoep_size among {_divisors(b.num_experts)}.")
    preset = config.preset_for(_model_type(model))
    expected = getattr(getattr(model, "config", None), preset.num_experts_attr, None)
    for b in blocks:
        if isinstance(expected, int) and expected != b.num_experts:
            raise ValueError(f"expert_parallel: {b.name} holds {b.num_experts} experts but the "
                             f"model config's {preset.num_experts_attr} is {expected}: set "
                             "num_experts_attr to the attribute that counts them.")
    for b in blocks:
        name = preset.experts_pattern
        setattr(b.module, name, SplitExperts(b.experts, preset, b.num_experts, groups))
        if config.routing:
            route_by_rule(getattr(b.module, preset.router_pattern), b.name,
                          _rule(config.routing, preset, model, b.num_experts))
    return groups


# -- DeepSpeed's routing rule -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """DeepSpeed AutoEP's router: scores of the router's logits (``softmax`` or ``sigmoid``,
    in fp32), the ``top_k`` experts of the highest scores (plus the router's
    ``e_score_correction_bias`` where it has one, for the choice only), their scores divided by
    their sum when ``route_norm``, times ``route_scale``."""

    top_k: int
    score_func: str
    route_norm: bool
    route_scale: float


def _rule(routing: Dict[str, Any], preset: Preset, model: torch.nn.Module,
          num_experts: int) -> RoutingRule:
    """The rule the routing keys ask for; what they leave out comes from the model config
    (its top-k attribute, ``scoring_func``, ``norm_topk_prob``), else the preset."""
    config = getattr(model, "config", None)
    top_k = routing.get("top_k", getattr(config, preset.top_k_attr, None))
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"expert_parallel.top_k: {top_k!r} experts per token, of "
                         f"{num_experts}: set top_k between 1 and {num_experts} (the model "
                         f"config's {preset.top_k_attr} is {getattr(config, preset.top_k_attr, None)!r}).")
    scoring = getattr(config, "scoring_func", None)
    score_func = routing.get("score_func", scoring if scoring in ("softmax", "sigmoid")
                             else preset.score_func)
    norm = getattr(config, "norm_topk_prob", None)
    route_norm = routing.get("route_norm", norm if isinstance(norm, bool) else preset.route_norm)
    return RoutingRule(top_k, score_func, route_norm, float(routing.get("route_scale", 1.0)))


def route_by_rule(router: torch.nn.Module, where: str, rule: RoutingRule) -> None:
    """Makes ``router`` (a module with the ``(experts, hidden)`` ``weight`` of its logits)
    route by ``rule``, returning what transformers' routers return: ``(logits, weights of the
    chosen experts, their indices)``. Its parameters, its name and the hooks on it (the router
    logits transformers records for the auxiliary loss) stay."""
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"expert_parallel: the router of {where} ({type(router).__name__}) has "
                         "no (experts, hidden) weight for DeepSpeed's rule (top_k, score_func, "
                         "route_norm, route_scale): leave those keys out to keep its own.")
    router.forward = functools.partial(_route, router, rule)


def _route(router: torch.nn.Module, rule: RoutingRule, hidden_states: torch.Tensor):
    weight = router.weight
    logits = F.linear(hidden_states.reshape(-1, weight.shape[1]), weight,
                      getattr(router, "bias", None))
    scores = logits.float()
    scores = scores.sigmoid() if rule.score_func == "sigmoid" else scores.softmax(dim=-1)
    choice = scores
    correction = getattr(router, "e_score_correction_bias", None)
    if isinstance(correction, torch.Tensor):
        choice = scores + correction
    index = torch.topk(choice, rule.top_k, dim=-1, sorted=False).indices
    top = scores.gather(1, index)
    if rule.route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, top * rule.route_scale, index


def _blocks(model: torch.nn.Module, config: AutoEPConfig) -> List[MoEBlock]:
    model_type = _model_type(model)
    preset = config.preset_for(model_type)
    if preset is None:
        raise ValueError(
            f"expert_parallel: no preset for {type(model).__name__} (model_type "
            f"{model_type!r}): set preset_model to one of {sorted(PRESETS)}, or describe the "
            "model's MoE blocks with moe_layer_pattern, router_pattern, expert_pattern and "
            "expert_w1/expert_w2/expert_w3.")
    blocks = find_moe_blocks(model, preset)
    if not blocks:
        which = f"preset_model {config.preset_model!r}" if config.preset_model else \
            "moe_layer_pattern"
        raise ValueError(
            f"expert_parallel: {which} matches no MoE block of {type(model).__name__}: no "
            f"module's name matches {preset.moe_layer_pattern!r} with children "
            f"{preset.router_pattern!r} and {preset.experts_pattern!r}. Modules with stacked "
            f"expert weights here: {_candidates(model)[:4]}; set moe_layer_pattern (and the "
            "other patterns) to describe them.")
    return blocks


def _model_type(model: torch.nn.Module) -> Optional[str]:
    return getattr(getattr(model, "config", None), "model_type", None)


def _candidates(model: torch.nn.Module) -> List[str]:
    return [name for name, m in model.named_modules()
            if any(p.dim() == 3 for p in m.parameters(recurse=False))]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

"""The ``expert_parallel`` config block (AutoEP), read and checked before the model is touched.

Key names and defaults are DeepSpeed's, so that a DeepSpeed config works unchanged::

    "expert_parallel": {"enabled": true, "autoep_size": 2, "preset_model": "mixtral"}

or, for a model no preset knows, the custom patterns::

    "expert_parallel": {"enabled": true, "autoep_size": 2,
                        "moe_layer_pattern": "model\\\\.layers\\\\.\\\\d+\\\\.moe",
                        "router_pattern": "router", "expert_pattern": "experts",
                        "expert_w1": "w_in", "expert_w2": "w_out", "expert_w3": null,
                        "num_experts_attr": "n_experts", "top_k_attr": "k"}

The MoE blocks keep their own router (the model's routing rule, exactly, and its
router-auxiliary loss) unless one of DeepSpeed's routing keys (``top_k``, ``score_func``,
``route_norm``, ``route_scale``) is set: then each router's forward follows DeepSpeed's rule
with those values (see :mod:`.auto`). ``routed_scaling_factor``, ``num_expert_groups``,
``num_limited_groups`` and ``load_balance_coeff`` are accepted at their defaults only. Every
mistake raises ValueError naming the key, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, Optional

__all__ = ["AutoEPConfig", "Preset", "PRESETS", "parse_block"]

_BLOCK = "expert_parallel"


@dataclasses.dataclass(frozen=True)
class Preset:
    """Where a model family keeps its MoE blocks and their parts.

    Attributes:
        moe_layer_pattern: a regular expression the block's full module name matches.
        router_pattern, experts_pattern: the block's children: the router, the experts.
        expert_w1: the experts' first weight, ``(num_experts, 2 * ffn, hidden)`` when the gate
            and up projections are fused (``expert_w3`` None), else ``(num_experts, ffn,
            hidden)``; ``expert_w2`` the down projection ``(num_experts, hidden, ffn)``;
            ``expert_w3`` the separate up projection.
        num_experts_attr, top_k_attr: the model config's attributes for the expert count and
            the experts each token is routed to.
        shared_experts_pattern: the block's child of experts every token goes through (kept
            whole on every rank), "" when the family has none.
        score_func, route_norm: DeepSpeed's defaults for the family's rule (used when a routing
            key replaces the model's router and the model config does not say).
    """

    moe_layer_pattern: str
    router_pattern: str = "gate"
    experts_pattern: str = "experts"
    expert_w1: str = "gate_up_proj"
    expert_w2: str = "down_proj"
    expert_w3: Optional[str] = None
    num_experts_attr: str = "num_experts"
    top_k_attr: str = "num_experts_per_tok"
    shared_experts_pattern: str = ""
    score_func: str = "softmax"  # DeepSpeed's rule, when a routing key asks for it
    route_norm: bool = True


_LAYERS = r"model\.layers\.\d+\.mlp"

#: The families transformers builds (the names are its ``model_type``s).
PRESETS: Dict[str, Preset] = {
    "mixtral": Preset(_LAYERS, num_experts_attr="num_local_experts"),
    "qwen2_moe": Preset(_LAYERS, shared_experts_pattern="shared_expert"),
    "qwen3_moe": Preset(_LAYERS),
    "deepseek_v2": Preset(_LAYERS, num_experts_attr="n_routed_experts",
                          shared_experts_pattern="shared_experts"),
    "deepseek_v3": Preset(_LAYERS, num_experts_attr="n_routed_experts",
                          shared_experts_pattern="shared_experts", score_func="sigmoid",
                          route_norm=False),
}

#: Routing keys not provided: accepted at these values only.
_ROUTING_DEFAULTS: Dict[str, tuple] = {
    "score_apply": ("auto", "post"), "routed_scaling_factor": ("auto",),
    "num_expert_groups": (None,), "num_limited_groups": (None,),
    "load_balance_coeff": (1e-3, None),
}
#: Routing keys that replace the model's rule with DeepSpeed's, and their "keep it" values.
_RULE_KEYS: Dict[str, Any] = {"top_k": "auto", "score_func": "auto", "route_norm": None,
                              "route_scale": 1.0}
#: Keys that choose DeepSpeed's kernels for the local experts: accepted, no effect.
_KERNEL_KEYS = ("use_grouped_mm", "grouped_mm_backend")
_CUSTOM_KEYS = ("moe_layer_pattern", "router_pattern", "expert_pattern", "expert_w1",
                "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts",
                "shared_experts_pattern")
_KEYS = ("enabled", "autoep_size", "preset_model") + _CUSTOM_KEYS + _KERNEL_KEYS \
    + tuple(_ROUTING_DEFAULTS) + tuple(_RULE_KEYS)


@dataclasses.dataclass(frozen=True)
class AutoEPConfig:
    """The block, checked: ``preset`` is the named preset with the custom keys applied over
    it (None: neither a preset nor ``moe_layer_pattern`` was given; the model's
    ``model_type`` picks one)."""

    enabled: bool = False
    autoep_size: int = 1
    preset_model: Optional[str] = None
    preset: Optional[Preset] = None
    overrides: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the routing keys set away from "keep the model's router" (empty: the model's rule)
    routing: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def preset_for(self, model_type: Optional[str]) -> Optional[Preset]:
        """The preset to detect blocks with: the configured one, else the one named by the
        model's ``model_type`` (with the custom keys over it), else None."""
        if self.preset is not None:
            return self.preset
        base = PRESETS.get(str(model_type))
        return None if base is None else dataclasses.replace(base, **self.overrides)


def parse_block(block: Optional[Dict[str, Any]]) -> AutoEPConfig:
    """The ``expert_parallel`` block as an :class:`AutoEPConfig` (disabled when absent)."""
    block = dict(block or {})
    unknown = sorted(set(block) - set(_KEYS))
    if unknown:
        raise ValueError(f"{_BLOCK} has unknown keys {unknown}: the keys are {sorted(_KEYS)}.")
    enabled = block.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{_BLOCK}.enabled must be true or false, got {enabled!r}.")
    size = block.get("autoep_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{_BLOCK}.autoep_size must be a positive integer (the ranks one "
                         f"layer's experts are split over), got {size!r}.")
    for key, allowed in _ROUTING_DEFAULTS.items():
        if key in block and block[key] not in allowed:
            raise NotImplementedError(
                f"{_BLOCK}.{key} = {block[key]!r} is not provided (AutoEP routes by the "
                "model's router, or by DeepSpeed's rule with top_k, score_func, route_norm "
                f"and route_scale): remove {key}, or set it to {allowed[0]!r}.")
    routing = _routing(block)
    preset_name = block.get("preset_model")
    if preset_name is not None and preset_name not in PRESETS:
        raise ValueError(f"{_BLOCK}.preset_model {preset_name!r} is not a preset: choose one of "
                         f"{sorted(PRESETS)}, or describe the model with moe_layer_pattern, "
                         "router_pattern, expert_pattern and expert_w1/w2/w3.")
    overrides = _overrides(block)
    preset = None
    if preset_name is not None:
        preset = dataclasses.replace(PRESETS[preset_name], **overrides)
    elif "moe_layer_pattern" in overrides:
        preset = Preset(**overrides)
    return AutoEPConfig(enabled, size, preset_name, preset, overrides, routing)


def _routing(block: Dict[str, Any]) -> Dict[str, Any]:
    """The routing keys set to something else than keeping the model's router, checked."""
    out = {k: block[k] for k, keep in _RULE_KEYS.items() if k in block and block[k] != keep}
    top_k = out.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"{_BLOCK}.top_k must be a positive integer or 'auto', got {top_k!r}.")
    if out.get("score_func", "softmax") not in ("softmax", "sigmoid"):
        raise ValueError(f"{_BLOCK}.score_func must be 'auto', 'softmax' or 'sigmoid', got "
                         f"{out['score_func']!r}.")
    if "route_norm" in out and not isinstance(out["route_norm"], bool):
        raise ValueError(f"{_BLOCK}.route_norm must be true, false or null (the model's), got "
                         f"{out['route_norm']!r}.")
    scale = out.get("route_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"{_BLOCK}.route_scale must be a positive number, got {scale!r}.")
    return out


def _overrides(block: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    pattern = block.get("moe_layer_pattern")
    if pattern is not None:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"{_BLOCK}.moe_layer_pattern {pattern!r} is not a regular "
                             f"expression ({e}): write one the MoE blocks' full names match, "
                             "e.g. 'model\\\\.layers\\\\.\\\\d+\\\\.mlp'.") from None
        out["moe_layer_pattern"] = pattern
    names = {"router_pattern": "router_pattern", "expert_pattern": "experts_pattern",
             "expert_w1": "expert_w1", "expert_w2": "expert_w2",
             "num_experts_attr": "num_experts_attr", "top_k_attr": "top_k_attr",
             "shared_experts_pattern": "shared_experts_pattern"}
    for key, field in names.items():
        value = block.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value or "." in value:
            raise ValueError(f"{_BLOCK}.{key} must be the name of one attribute (no dots), "
                             f"got {value!r}.")
        out[field] = value
    if "expert_w3" in block:  # null: the gate and up projections are fused in expert_w1
        w3 = block["expert_w3"]
        if w3 is not None and (not isinstance(w3, str) or not w3 or "." in w3):
            raise ValueError(f"{_BLOCK}.expert_w3 must be null (gate and up fused in expert_w1) "
                             f"or the name of the up projection, got {w3!r}.")
        out["expert_w3"] = w3
    shared = block.get("has_shared_experts")
    if shared is not None and not isinstance(shared, bool):
        raise ValueError(f"{_BLOCK}.has_shared_experts must be true or false, got {shared!r}.")
    if shared is False:
        out["shared_experts_pattern"] = ""
    return out

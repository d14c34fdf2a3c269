"""The planned-feature gate: a key of a feature shardtrain has not implemented yet is accepted
only at its default (disabled) value.

This keeps DeepSpeed's promise that a config either trains as written or fails at start-up: a
config that asks for NVMe offload or expert parallelism is refused with the feature named, not
run without it. The gate runs on the validated config, so it compares typed values with typed
defaults; an object block that shardtrain does not model counts as disabled when it asks for
nothing (:func:`_block_disabled`).
"""

from typing import TYPE_CHECKING, Any, Dict, Tuple

from pydantic import BaseModel

from ._model import ConfigError, _submodel
from ._status import _ALSO_DISABLED, IMPLEMENTED_ZERO_STAGES, PLANNED
from ._values import _show

if TYPE_CHECKING:
    from ._root import ShardConfig

_PLANNED_HINTS: Dict[str, str] = {
    "zero_optimization.offload_optimizer.device": " (the deprecated zero_optimization.cpu_offload true also sets it)",
    "zero_optimization.offload_param.device": " (the deprecated zero_optimization.cpu_offload_param true also sets it)",
}


def _check_planned(cfg: "ShardConfig") -> None:
    problems = []
    for key, feature in PLANNED.items():
        found, value = _value_at(cfg, key)
        if not found:
            continue
        if key == "zero_optimization.stage":
            if value not in IMPLEMENTED_ZERO_STAGES:
                allowed = " or ".join(str(stage) for stage in sorted(IMPLEMENTED_ZERO_STAGES))
                problems.append(f"{key} {value} is not implemented yet in shardtrain (planned); remove it or set it "
                                f"to {allowed}. Feature: {feature}.")
            continue
        default = _default_at(type(cfg), key)
        disabled = value == default or value in _ALSO_DISABLED.get(key, ()) or _block_disabled(key, value)
        if not disabled:
            problems.append(f"{key} is not implemented yet in shardtrain (planned); remove it or set it to "
                            f"{_show(default)}. Got {_show(value)}{_PLANNED_HINTS.get(key, '')}; feature: {feature}.")
    if problems:
        raise ConfigError("\n".join(problems))


def _block_disabled(key: str, value: Any) -> bool:
    """Whether a planned object block asks for nothing, so that DeepSpeed would not run the feature
    either: ``{}``, ``"enabled": false`` whatever settings come with it (``hybrid_engine``,
    ``data_efficiency``, ...), or only disabled sub-blocks (``timers.throughput``)."""
    if not isinstance(value, dict):
        return False
    if not value or value.get("enabled") is False:
        return True
    if "enabled" not in value and all(isinstance(sub, dict) for sub in value.values()):
        return all(_block_disabled("", sub) for sub in value.values())
    return False


def _value_at(cfg: BaseModel, dotted: str) -> Tuple[bool, Any]:
    """Follow a dotted key through the models; (False, None) when a parent block is absent."""
    node: Any = cfg
    for key in dotted.split("."):
        if node is None:
            return False, None
        node = getattr(node, _field_name(type(node), key))
    return True, node


def _default_at(root: type, dotted: str) -> Any:
    """The default of a dotted key, found through the model classes from ``root`` down."""
    model: Any = root
    *parents, last = dotted.split(".")
    for key in parents:
        model = _submodel(model.model_fields[_field_name(model, key)].annotation)
    field = model.model_fields[_field_name(model, last)]
    return field.get_default(call_default_factory=True)


def _field_name(model: type, key: str) -> str:
    return model._input_keys()[key]

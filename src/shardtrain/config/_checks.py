"""Rules that span blocks: combinations that cannot work, and keys that are valid but change
nothing here.

A block validates its own keys where it is built; whether fp16 and bf16 are both on, or an
offload block meets a ZeRO stage that has nothing to offload, can only be decided on the whole
config. Impossible combinations raise :class:`ConfigError` while the config is built;
:func:`situational_notes` needs the job's shape (the number of machines) and is called by the
engine at start-up, so a config stays valid on its own and the notes say why a key is idle.
"""

from typing import TYPE_CHECKING, List

import torch

from ._dotted import dotted_keys
from ._model import ConfigError
from ._values import _show

if TYPE_CHECKING:
    from ._root import ShardConfig

__all__ = ["situational_notes"]

_PRECISION_CHOICE = ("bf16/fp16 keep the model in 16-bit with fp32 master weights; torch_autocast keeps the model "
                     "in fp32 and runs forward under torch.autocast")


def _check_combinations(cfg: "ShardConfig") -> None:
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one 16-bit mode.")
    if cfg.torch_autocast.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        mode = "fp16" if cfg.fp16.enabled else "bf16"
        raise ConfigError(f"torch_autocast.enabled and {mode}.enabled are both true; choose one: {_PRECISION_CHOICE}.")
    if cfg.gradient_allreduce_op == "sum":
        users = [name for name, active in (
            ("zero_optimization.stage 3", cfg.zero_optimization.stage == 3),
            ("zero_optimization.zenflow", cfg.zero_optimization.zenflow is not None),
            ) if active]
        if users:
            raise ConfigError(f"gradient_allreduce_op \"sum\" cannot be used with {users[0]}; set "
                              "gradient_allreduce_op to \"mean\" (the default).")
    _check_nonfinite(cfg)
    mode = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None and param_dtype != mode:
        raise ConfigError(f"data_types.param_dtype {_show(param_dtype)} does not match the precision mode "
                          f"({_show(mode)}); remove it or make it {_show(mode)}.")
    if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads:
        if cfg.zero_optimization.stage == 0:
            raise ConfigError("bf16.bf16_master_weights_and_grads needs ZeRO (zero_optimization.stage 1, 2 or "
                              "3), as in DeepSpeed; set a stage or remove the key.")
        if not cfg.bf16.bf16_optimizer_states:
            raise ConfigError("bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states (fp32 "
                              "optimizer states over bf16 masters) is not supported: a torch optimizer keeps "
                              "its states in its tensors' dtype. Set bf16.bf16_optimizer_states to true too "
                              "(bf16 states), or remove the key (fp32 masters).")
    accum = cfg.data_types.grad_accum_dtype
    if accum not in (None, mode, torch.float32):
        raise ConfigError(f"data_types.grad_accum_dtype {_show(accum)}: gradients accumulate in the model's "
                          f"dtype ({_show(mode)}) or in fp32; set it to \"fp32\" or remove it.")


def _check_nonfinite(cfg: "ShardConfig") -> None:
    mode = cfg.nonfinite_gradients
    fp16 = cfg.fp16.enabled or (cfg.torch_autocast.enabled and cfg.torch_autocast.dtype == torch.float16)
    if fp16 and mode in ("apply", "error"):
        raise ConfigError(f"nonfinite_gradients \"{mode}\" cannot be used with fp16: loss scaling skips a step "
                          "whose gradients overflow and lowers the scale, by design. Remove the key (fp16 "
                          "skips), or train in bf16 or fp32.")
    if cfg.bf16.enabled and not cfg.bf16.check_grad_overflow and mode is not None and mode != "apply":
        raise ConfigError(f"bf16.check_grad_overflow is false (apply non-finite steps) but nonfinite_gradients "
                          f"is \"{mode}\"; keep one of the two keys.")


def situational_notes(cfg: "ShardConfig", nodes: int) -> List[str]:
    """Keys that are valid but change nothing in this configuration, as DeepSpeed accepts
    them, and dotted top-level keys read as nested ones: one warning line each, saying why.
    Raises ConfigError for the combinations that cannot work here (node-local checkpoints
    across machines)."""
    zero, notes = cfg.zero_optimization, []
    dotted = dotted_keys(cfg.raw)
    if dotted:
        notes.append(f"The top-level keys {', '.join(map(repr, dotted))} are read as the nested keys they name "
                     "(TRL's prepare_deepspeed writes them so; DeepSpeed ignores dotted top-level keys). A "
                     "fractional value of an integer key is read as its integer part.")
    if zero.offload_optimizer is not None and zero.offload_optimizer.device != "none" and zero.stage == 0:
        notes.append("zero_optimization.offload_optimizer has no effect at ZeRO stage 0: there are no "
                     "sharded optimizer states to move to host memory (DeepSpeed ignores it too); set "
                     "zero_optimization.stage to 1, 2 or 3 to offload them.")
    if zero.offload_param is not None and zero.offload_param.device != "none" and zero.stage != 3:
        notes.append(f"zero_optimization.offload_param has no effect at ZeRO stage {zero.stage}: "
                     "parameters are partitioned only at stage 3 (DeepSpeed ignores it too); use "
                     "offload_optimizer at stages 1-2, or stage 3.")
    if cfg.checkpoint.use_node_local_storage:
        if nodes > 1:
            raise ConfigError(f"checkpoint.use_node_local_storage is true and the job spans {nodes} "
                              "machines: shardtrain writes one checkpoint directory that every rank "
                              "reads on load; put save_dir on storage every node sees and set it to "
                              "false.")
        notes.append("checkpoint.use_node_local_storage has no effect on one machine: every rank "
                     "writes to the same directory.")
    return notes

"""DeepSpeed's two calls that prepare AutoTP before ``initialize``, over shardtrain's AutoTP,
which ``initialize`` applies from the config's ``tensor_parallel`` block and nothing else.

``set_autotp_mode(training=True)`` switches DeepSpeed's layers to their training behaviour;
shardtrain's layers have only that one, so it changes nothing.

``tp_model_init(model, tp_size, dtype, config)`` only records its arguments in DeepSpeed 0.19.8:
``initialize`` merges them into the config, the config winning and a disagreement being an
error. shardtrain keeps no such record, so the call is accepted when the config it is given
already asks for the same AutoTP (the Hugging Face Trainer passes the config it then hands to
``initialize``) and returns the model unchanged; anything else is refused with the config key
that does the same, since a request ``initialize`` never sees would train without tensor
parallelism.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .. import comm, load_config

_DOC = "docs/parallelism.md"
#: the config block that enables each 16-bit dtype, as DeepSpeed infers the config's dtype
_DTYPE_BLOCKS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def set_autotp_mode(training: bool = False) -> None:
    """Accepts ``training=True`` (shardtrain's AutoTP is the training one); refuses the
    inference mode, which belongs to DeepSpeed-Inference."""
    if not training:
        raise NotImplementedError(
            "deepspeed.set_autotp_mode(training=False) selects AutoTP for DeepSpeed-Inference, "
            "which shardtrain's DeepSpeed alias does not provide. To train with tensor "
            "parallelism, call set_autotp_mode(training=True) (or nothing) and set "
            f"tensor_parallel.autotp_size in the config ({_DOC}).")


def tp_model_init(model: Any, tp_size: int, dtype: Optional[torch.dtype] = None,
                  config: Any = None, **kwargs: Any) -> Any:
    """``model`` unchanged, when ``config`` (the config later given to ``initialize``) asks
    for AutoTP over ``tp_size`` ranks in ``dtype``: ``initialize`` splits the model then.

    Raises:
        NotImplementedError: no config, or one without ``tensor_parallel.autotp_size``
            (the message gives the block to add), or ``tp_group=`` (shardtrain builds the
            groups from the config).
        ValueError: the config asks for another size, or enables another 16-bit dtype.
    """
    if kwargs.get("tp_group") is not None:
        raise NotImplementedError(
            "deepspeed.tp_model_init(tp_group=...): shardtrain builds the tensor-parallel groups "
            "itself from tensor_parallel.autotp_size in the config; drop tp_group.")
    raw = _read(config)
    asked = _autotp_size(raw)
    if asked is None and tp_size != 1:
        raise NotImplementedError(
            f"deepspeed.tp_model_init(tp_size={tp_size}) without a config that asks for it: "
            "shardtrain's initialize applies automatic tensor parallelism (AutoTP) from the "
            "config only. Put \"tensor_parallel\": {\"autotp_size\": "
            f"{tp_size}}} in the config passed to initialize (and to this call, or drop the "
            f"call) ({_DOC}).")
    if (asked or 1) != tp_size:
        raise ValueError(f"deepspeed.tp_model_init(tp_size={tp_size}) disagrees with the config's "
                         f"tensor_parallel.autotp_size {asked}: make them equal (the config "
                         "decides the split).")
    _check_dtype(raw, dtype)
    return model


def _read(config: Any) -> Mapping[str, Any]:
    """The config as a mapping: a dict as it is; a path or base64 text as initialize reads it."""
    if config is None or isinstance(config, Mapping):
        return config or {}
    return load_config(config, comm.get_world_size())


def _autotp_size(raw: Mapping[str, Any]) -> Optional[int]:
    """``tensor_parallel.autotp_size``, or its alias ``tensor_parallel.tp.tp_size``."""
    block = raw.get("tensor_parallel") or {}
    size = block.get("autotp_size", (block.get("tp") or {}).get("tp_size"))
    return None if size is None else int(size)


def _check_dtype(raw: Mapping[str, Any], dtype: Optional[torch.dtype]) -> None:
    enabled = [d for d, key in _DTYPE_BLOCKS.items() if (raw.get(key) or {}).get("enabled")]
    if dtype is not None and enabled and enabled[0] != dtype:
        raise ValueError(f"deepspeed.tp_model_init(dtype={dtype}) disagrees with the config, which "
                         f"trains in {enabled[0]} ({_DTYPE_BLOCKS[enabled[0]]}.enabled): pass "
                         f"dtype={enabled[0]} or change the config.")

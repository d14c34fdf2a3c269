"""DeepSpeed's two calls that prepare AutoTP before ``initialize``, over shardtrain's AutoTP,
which ``initialize`` applies from the config's ``tensor_parallel`` block and nothing else.

``set_autotp_mode(training=True)`` switches DeepSpeed's layers to their training behaviour;
shardtrain's layers have only that one, so it changes nothing. ``tp_model_init`` records a
tensor-parallel size for DeepSpeed's ``initialize`` to merge into the config; shardtrain does
not merge a request made elsewhere than the config, and refusing the call (with the config key
that does the same) is what keeps a script from training without the tensor parallelism it
asked for.
"""
from __future__ import annotations

from typing import Any

_DOC = "docs/parallelism.md"


def set_autotp_mode(training: bool = False) -> None:
    """Accepts ``training=True`` (shardtrain's AutoTP is the training one); refuses the
    inference mode, which belongs to DeepSpeed-Inference."""
    if not training:
        raise NotImplementedError(
            "deepspeed.set_autotp_mode(training=False) selects AutoTP for DeepSpeed-Inference, "
            "which shardtrain's DeepSpeed alias does not provide. To train with tensor "
            "parallelism, call set_autotp_mode(training=True) (or nothing) and set "
            f"tensor_parallel.autotp_size in the config ({_DOC}).")


def tp_model_init(model: Any, tp_size: int, dtype: Any = None, config: Any = None,
                  **kwargs: Any) -> Any:
    """Refused with the config that does the same: shardtrain applies AutoTP in
    ``initialize``, from ``tensor_parallel`` only."""
    raise NotImplementedError(
        f"deepspeed.tp_model_init(tp_size={tp_size}) is not used by shardtrain's DeepSpeed "
        "alias: initialize applies automatic tensor parallelism (AutoTP) from the config. Remove "
        "the call, pass the model to initialize as it is and put "
        f"\"tensor_parallel\": {{\"autotp_size\": {tp_size}}} in the config (add \"preset_model\" "
        "or \"partition_config\" for a model without a preset; the dtype comes from bf16/fp16) "
        f"({_DOC}).")

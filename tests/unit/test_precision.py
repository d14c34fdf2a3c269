"""The precision policy the engine builds from a config: dtypes, loss scaling, and what a step
with non-finite gradients does."""
from __future__ import annotations

import pytest
import torch

from shardtrain.config import load_config
from shardtrain.precision import Precision


@pytest.mark.parametrize("extra, expected", [
    ({}, (torch.float32, None, "skip", False)),
    ({"nonfinite_gradients": "apply"}, (torch.float32, None, "apply", False)),
    ({"nonfinite_gradients": "error"}, (torch.float32, None, "error", False)),
    ({"bf16": {"enabled": True}}, (torch.bfloat16, None, "skip", False)),
    ({"bf16": {"enabled": True, "check_grad_overflow": False}}, (torch.bfloat16, None, "apply", False)),
    ({"bf16": {"enabled": True}, "nonfinite_gradients": "error"}, (torch.bfloat16, None, "error", False)),
    ({"fp16": {"enabled": True}}, (torch.float16, None, "skip", True)),
    ({"torch_autocast": {"enabled": True, "dtype": "bf16"}, "nonfinite_gradients": "apply"},
     (torch.float32, torch.bfloat16, "apply", False)),
    ({"torch_autocast": {"enabled": True, "dtype": "fp16"}}, (torch.float32, torch.float16, "skip", True)),
])
def test_the_policy_follows_the_config(extra, expected):
    policy = Precision.from_config(load_config({"train_batch_size": 4, **extra}, 1), "cpu")
    assert (policy.param_dtype, policy.autocast_dtype, policy.on_nonfinite,
            policy.scales_loss) == expected

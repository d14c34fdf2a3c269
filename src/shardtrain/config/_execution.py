"""How the module runs: ``activation_checkpointing`` and ``compile``.

Both blocks change what forward and backward execute, not what the step computes; the code that
honours them is :mod:`shardtrain.checkpointing` and ``Engine.compile``.
"""

from typing import Any, ClassVar, Dict, Optional

from pydantic import Field

from ._model import _ConfigModel
from ._values import _Bool, _Int, _Str

__all__ = ["ActivationCheckpointingConfig", "CompileConfig"]


class ActivationCheckpointingConfig(_ConfigModel):
    """``activation_checkpointing``: how ``shardtrain.checkpointing.checkpoint`` behaves."""

    config_path: ClassVar[str] = "activation_checkpointing"
    drops_auto: ClassVar[bool] = False

    partition_activations: _Bool = Field(
        False, description="split checkpointed regions' saved inputs over the tensor-parallel ranks")
    contiguous_memory_optimization: _Bool = Field(False, description="copy checkpoints into one buffer")
    cpu_checkpointing: _Bool = Field(False, description="keep checkpoints in CPU memory")
    number_checkpoints: Optional[_Int] = Field(None, description="number of checkpoints for the contiguous buffer")
    synchronize_checkpoint_boundary: _Bool = Field(False, description="synchronize at checkpoint boundaries")
    profile: _Bool = Field(False, description="time checkpointed forward/backward")


class CompileConfig(_ConfigModel):
    """``compile``: ``torch.compile`` of the module once ``engine.compile()`` is called."""

    config_path: ClassVar[str] = "compile"

    enabled: _Bool = Field(False, description="compile the module (call engine.compile())")
    backend: _Str = Field("inductor", description="torch.compile backend")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description="other torch.compile arguments")

"""``checkpoint``: how checkpoints are saved and loaded.

Only ``tag_validation`` and ``checkpoint_serialization`` change what shardtrain does; the other
keys are planned or have no effect (see the status tables), and are modelled so that their
values are still checked.
"""

from typing import Any, ClassVar, Literal, Optional

from pydantic import BeforeValidator, Field
from typing_extensions import Annotated

from ._model import ConfigError, _ConfigModel
from ._values import _Bool, _Int, _show, _upper

__all__ = ["CheckpointConfig", "CheckpointParallelWriteConfig", "CheckpointWriterConfig"]


def _tag_validation_value(value: Any) -> str:
    if isinstance(value, str) and value.upper() in ("WARN", "IGNORE", "FAIL"):
        return value.capitalize()
    raise ConfigError(f"checkpoint.tag_validation must be one of Warn, Ignore, Fail (any case); got {_show(value)}.")


class CheckpointParallelWriteConfig(_ConfigModel):
    """``checkpoint.parallel_write``."""

    config_path: ClassVar[str] = "checkpoint.parallel_write"
    drops_auto: ClassVar[bool] = False

    pipeline_stage: _Bool = Field(False, description="each pipeline stage writes its own layers")


class CheckpointWriterConfig(_ConfigModel):
    """``checkpoint.writer`` (planned)."""

    config_path: ClassVar[str] = "checkpoint.writer"
    drops_auto: ClassVar[bool] = False

    type: Annotated[Literal["FAST", "PYTHON", "MOCK"], BeforeValidator(_upper)] = Field(
        "FAST", description="FAST, PYTHON or MOCK (any case)")
    io_buffer_size: _Int = Field(64 * 1024**2, gt=0, description="bytes per I/O buffer")
    io_buffer_double: _Bool = Field(True, description="double-buffered I/O")
    io_multiplier: _Int = Field(1, gt=0, description="I/O parallelism multiplier")
    show_statistics: _Bool = Field(False, description="print write statistics")
    data_parallel: Annotated[Optional[Literal["REPLICA", "SOCKET", "MACHINE"]], BeforeValidator(_upper)] = Field(
        None, description="replica, socket or machine (any case)")
    decoupled: _Bool = Field(False, description="write in a background process")


class CheckpointConfig(_ConfigModel):
    """``checkpoint``: checkpoint saving and loading."""

    config_path: ClassVar[str] = "checkpoint"
    drops_auto: ClassVar[bool] = False

    tag_validation: Annotated[str, BeforeValidator(_tag_validation_value)] = Field(
        "Warn", description="tags differing across ranks: Warn, Ignore or Fail (any case)")
    load_universal: _Bool = Field(
        False, description="a DeepSpeed checkpoint directory loads the tag latest_universal names "
                           "(else latest's), converted on the way")
    use_node_local_storage: _Bool = Field(False, description="every node saves to local storage")
    parallel_write: CheckpointParallelWriteConfig = Field(default_factory=CheckpointParallelWriteConfig,
                                                          description="parallel writing")
    checkpoint_serialization: _Bool = Field(True, description="torch.save's zipfile serialization")
    async_save: _Bool = Field(False, description="write the files in the background while training goes on; "
                                                 "the next save, a load or the end waits (shardtrain only)")
    writer: Optional[CheckpointWriterConfig] = Field(None, description="alternative checkpoint writer")

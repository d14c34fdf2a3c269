"""``autotuning``: what ``shardtrain autotune`` reads, and what makes a run one of its trials.

The same block serves two readers: the autotune command (search bounds, where results go) and
the engine of a trial or model-info profile run it starts (which steps to measure, where to
write the metrics, when to exit).
"""

import os
from typing import ClassVar, Dict, Literal, Optional

from pydantic import BeforeValidator, Field, model_validator
from typing_extensions import Annotated

from ._model import ConfigError, _ConfigModel
from ._values import _Bool, _Int, _lower, _Str

__all__ = ["AutotuningConfig", "AutotuningModelInfoConfig"]


class AutotuningModelInfoConfig(_ConfigModel):
    """``autotuning.model_info``: ``profile: true`` makes the run a model-info profile."""

    config_path: ClassVar[str] = "autotuning.model_info"
    drops_auto: ClassVar[bool] = False

    profile: _Bool = Field(False, description="measure parameters and activation memory, write "
                                              "model_info_path (rank 0), then exit")
    num_params: Optional[_Int] = Field(None, ge=0, description="parameter count, if known")
    hidden_size: Optional[_Int] = Field(None, ge=0, description="hidden size, if known")
    num_layers: Optional[_Int] = Field(None, ge=0, description="number of layers, if known")


class AutotuningConfig(_ConfigModel):
    """``autotuning``: what ``shardtrain autotune`` reads, and the trial and profile runs it
    starts (see docs/monitoring.md). With ``enabled`` the run is a trial: it measures steps
    ``start_profile_step``..``end_profile_step``, writes ``metric_path`` (rank 0) and exits."""

    config_path: ClassVar[str] = "autotuning"
    drops_auto: ClassVar[bool] = False

    enabled: _Bool = Field(False, description="this run is an autotuning trial: measure, write metric_path, exit")
    fast: _Bool = Field(True, description="tune only the micro-batch size per ZeRO stage")
    results_dir: _Str = Field("autotuning_results", description="where shardtrain autotune writes its results")
    exps_dir: _Str = Field("autotuning_exps", description="where shardtrain autotune writes trial configs and logs")
    overwrite: _Bool = Field(True, description="false: reuse the result of a trial that already ran")
    start_profile_step: _Int = Field(3, ge=0, description="first step of a trial's measurement")
    end_profile_step: _Int = Field(5, gt=0, description="last step of a trial's measurement; the trial exits after it")
    metric_path: Optional[_Str] = Field(None, description="JSON file a trial writes its metrics to")
    metric: Annotated[Literal["throughput", "latency", "flops"], BeforeValidator(_lower)] = Field(
        "throughput", description="what shardtrain autotune optimises")
    tuner_type: Annotated[Literal["gridsearch", "random", "model_based"], BeforeValidator(_lower)] = Field(
        "gridsearch", description="search strategy")
    tuner_early_stopping: _Int = Field(5, gt=0, description="stop after this many trials without improvement")
    tuner_num_trials: _Int = Field(50, gt=0, description="at most this many trials")
    arg_mappings: Optional[Dict[str, _Str]] = Field(
        None, description="config key -> script argument that also receives the trial's value")
    model_info: Optional[AutotuningModelInfoConfig] = Field(None, description="model-info profile settings")
    model_info_path: Optional[_Str] = Field(
        None, description="JSON file of the model-info profile; null = results_dir/profile_model_info/model_info.json")
    mp_size: _Int = Field(1, gt=0, description="model-parallel size")
    max_train_batch_size: Optional[_Int] = Field(None, gt=0, description="largest global batch tried")
    min_train_batch_size: _Int = Field(1, gt=0, description="smallest global batch tried")
    max_train_micro_batch_size_per_gpu: _Int = Field(1024, gt=0, description="largest micro-batch tried")
    min_train_micro_batch_size_per_gpu: _Int = Field(1, gt=0, description="smallest micro-batch tried")
    num_tuning_micro_batch_sizes: _Int = Field(3, gt=0, description="trials per ZeRO stage")

    @model_validator(mode="after")
    def _check(self) -> "AutotuningConfig":
        if self.start_profile_step >= self.end_profile_step:
            raise ConfigError(f"autotuning.start_profile_step ({self.start_profile_step}) must be below "
                              f"autotuning.end_profile_step ({self.end_profile_step}).")
        low, high = self.min_train_micro_batch_size_per_gpu, self.max_train_micro_batch_size_per_gpu
        if low > high:
            raise ConfigError(f"autotuning.min_train_micro_batch_size_per_gpu ({low}) is above "
                              f"autotuning.max_train_micro_batch_size_per_gpu ({high}).")
        return self

    @property
    def profiles_model_info(self) -> bool:
        """True when this run is a model-info profile."""
        return self.model_info is not None and self.model_info.profile

    def resolved_model_info_path(self) -> str:
        """Where the model-info profile is written."""
        return self.model_info_path or os.path.join(self.results_dir, "profile_model_info", "model_info.json")

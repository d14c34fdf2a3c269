"""What the run measures and where it reports: the FLOPs profiler, the metric monitors
(TensorBoard, CSV, JSON lines, Weights & Biases, MLflow, Comet) and the communication logger.

The file monitor blocks share DeepSpeed's layout (``enabled``, ``output_path``, ``job_name``);
``jsonl_monitor`` and ``mlflow`` are shardtrain's own and DeepSpeed ignores them. The planned
monitors are modelled in full so that their keys are checked even while the feature is refused.
"""

from typing import ClassVar, List, Optional

from pydantic import Field

from ._model import _ConfigModel
from ._values import _Bool, _Float, _Int, _Str

__all__ = [
    "CSVMonitorConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "FlopsProfilerConfig",
    "JSONLMonitorConfig",
    "MLflowConfig",
    "TensorBoardConfig",
    "WandbConfig",
]


class FlopsProfilerConfig(_ConfigModel):
    """``flops_profiler``: FLOPs, parameters and latency per module at one step (see docs/monitoring.md)."""

    config_path: ClassVar[str] = "flops_profiler"
    drops_auto: ClassVar[bool] = False

    enabled: _Bool = Field(False, description="profile one step")
    recompute_fwd_factor: _Float = Field(0.0, description="extra forward passes from recomputation")
    profile_step: _Int = Field(1, ge=0, description="global step to profile (0 = the first)")
    module_depth: _Int = Field(-1, ge=-1, description="module depth shown; -1 = all")
    top_modules: _Int = Field(1, ge=0, description="number of top modules shown per depth")
    detailed: _Bool = Field(True, description="per-module breakdown")
    output_file: Optional[_Str] = Field(None, description="file for the profile; null = stdout")


class TensorBoardConfig(_ConfigModel):
    """``tensorboard`` monitor: TensorBoard events under ``output_path/job_name`` (rank 0)."""

    config_path: ClassVar[str] = "tensorboard"

    enabled: _Bool = Field(False, description="write TensorBoard events")
    output_path: _Str = Field("", description="directory for the events (\"\" = the working directory)")
    job_name: _Str = Field("DeepSpeedJobName", description="sub-directory of output_path")


class CSVMonitorConfig(_ConfigModel):
    """``csv_monitor``: one CSV file per metric under ``output_path/job_name`` (rank 0)."""

    config_path: ClassVar[str] = "csv_monitor"

    enabled: _Bool = Field(False, description="write CSV files")
    output_path: _Str = Field("", description="directory for the files (\"\" = the working directory)")
    job_name: _Str = Field("DeepSpeedJobName", description="sub-directory of output_path")


class JSONLMonitorConfig(_ConfigModel):
    """``jsonl_monitor`` (shardtrain's own; DeepSpeed ignores the key): one JSON object per step
    in ``output_path/job_name/metrics.jsonl`` (rank 0); ``shardtrain plot`` reads it."""

    config_path: ClassVar[str] = "jsonl_monitor"

    enabled: _Bool = Field(False, description="write metrics.jsonl (shardtrain only)")
    output_path: _Str = Field("", description="directory for the file (\"\" = the working directory)")
    job_name: _Str = Field("DeepSpeedJobName", description="sub-directory of output_path")


class WandbConfig(_ConfigModel):
    """``wandb`` monitor: the run's scalars and its resolved config to Weights & Biases (rank 0;
    ``WANDB_MODE=offline`` writes them locally, and wandb's other variables apply)."""

    config_path: ClassVar[str] = "wandb"

    enabled: _Bool = Field(False, description="log to Weights & Biases")
    group: Optional[_Str] = Field(None, description="run group")
    team: Optional[_Str] = Field(None, description="team")
    project: _Str = Field("deepspeed", description="project")


class MLflowConfig(_ConfigModel):
    """``mlflow`` monitor (shardtrain's own; DeepSpeed ignores the key): the run's scalars and its
    resolved config (as parameters) to an MLflow run (rank 0)."""

    config_path: ClassVar[str] = "mlflow"

    enabled: _Bool = Field(False, description="log to MLflow (shardtrain only)")
    tracking_uri: Optional[_Str] = Field(None, description="tracking server or store; null = MLflow's own "
                                                           "default (MLFLOW_TRACKING_URI)")
    experiment_name: _Str = Field("DeepSpeedJobName", description="experiment the run goes to")
    run_name: Optional[_Str] = Field(None, description="run name; null = MLflow picks one")


class CometConfig(_ConfigModel):
    """``comet`` monitor (planned)."""

    config_path: ClassVar[str] = "comet"

    enabled: _Bool = Field(False, description="log to Comet")
    samples_log_interval: _Int = Field(100, description="samples between submissions")
    project: Optional[_Str] = Field(None, description="project")
    workspace: Optional[_Str] = Field(None, description="workspace")
    api_key: Optional[_Str] = Field(None, description="API key")
    experiment_name: Optional[_Str] = Field(None, description="experiment name")
    experiment_key: Optional[_Str] = Field(None, description="existing experiment key")
    online: Optional[_Bool] = Field(None, description="log to the server (else offline)")
    mode: Optional[_Str] = Field(None, description="get, create or get_or_create")


class CommsLoggerConfig(_ConfigModel):
    """``comms_logger``: the communication log (:mod:`shardtrain.telemetry.comms`)."""

    config_path: ClassVar[str] = "comms_logger"

    enabled: _Bool = Field(False, description="log collective calls")
    verbose: _Bool = Field(False, description="log every call")
    prof_all: _Bool = Field(True, description="profile every operation")
    debug: _Bool = Field(False, description="include the caller")
    prof_ops: List[_Str] = Field(default_factory=list, description="operations to profile when prof_all is false")

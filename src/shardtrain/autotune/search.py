"""The search: the fastest micro-batch and ZeRO stage for a script within a memory budget.

A profile run measures the model; :mod:`.fits` predicts the largest micro-batch per stage;
short trials run around each prediction, smallest first, and a trial that runs out of memory
ends its stage. The search stops after ``tuner_num_trials`` trials, or after
``tuner_early_stopping`` trials without a better one. Within 5% of the best, the larger
micro-batch and then the lower stage win: as fast within noise, and fewer steps per epoch.

Each run is the user's own script in its own processes (:mod:`._runner`), told what to measure
by its config (:mod:`._configs`) and measured from inside by :class:`~.probe.TuningProbe`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import accelerator
from ..memory import format_bytes
from ._configs import base_config, tuned_config
from ..files import write_json
from ._runner import Runner
from .budget import MEMORY_BUDGET_ENV
from .fits import StageFit, stage_fits
from .trials import AutotuneResult, Trial, write_table

__all__ = ["autotune", "AutotuneError"]


class AutotuneError(RuntimeError):
    """The autotuner cannot go on: a bad argument, or a profile run that failed."""


#: Tolerance within which two trials count as equally fast (DeepSpeed's autotuner uses 5%);
#: then the larger micro-batch wins, then the lower stage.
_TIE = 0.05
_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def autotune(script: str, config: str, script_args: Sequence[str] = (), budget: Optional[int] = None,
             stages: Optional[Sequence[int]] = None, metric: Optional[str] = None, nproc: int = 1,
             results_dir: Optional[str] = None, exps_dir: Optional[str] = None, timeout: float = 600.0,
             config_arg: str = "--config", log: Callable[[str], None] = print) -> AutotuneResult:
    """Finds the fastest micro-batch and ZeRO stage for ``script`` within a memory budget.

    1. A profile run of the script (``autotuning.model_info.profile``) measures the parameters,
       the model-state bytes per parameter and the activation memory per sample.
    2. Per stage, the largest micro-batch whose model states (ZeRO formula) plus activations
       fit ``budget`` is computed.
    3. Short trials (``autotuning.enabled``) run around it; each writes samples/s and peak
       memory. A trial that runs out of memory (on the CPU: whose measured model states plus
       activations exceed the budget) stops, and the stage's larger micro-batches are skipped.
    4. The fastest trial that fits becomes ``results_dir/best_config.json``; every trial is
       listed in ``results_dir/trials.csv``.

    The script must take its config path from the ``config_arg`` option (``--config`` by
    default; ``--deepspeed_config`` for DeepSpeed scripts) and call ``engine.step()``.

    Args:
        script: the training script.
        config: its JSON config; the ``autotuning`` block sets defaults for what follows.
        script_args: more arguments for the script.
        budget: bytes per rank; default the device's memory (CUDA), or the host's available
            memory shared by ``nproc`` processes (CPU).
        stages: ZeRO stages to try; default 0, 1, 2, 3.
        metric: ``throughput``, ``latency`` or ``flops``; default ``autotuning.metric``.
        nproc: processes per trial (through torchrun when above 1).
        results_dir, exps_dir: default ``autotuning.results_dir`` / ``exps_dir``.
        timeout: seconds per run before it is stopped.
        config_arg: the script's option that takes the config path.
        log: where progress lines go.

    Returns:
        An :class:`AutotuneResult`.

    Example:
        >>> result = autotune("train.py", "train.json", budget=parse_size("16GiB"), stages=[0, 2])
        >>> result.best.micro_batch, result.best_config_path
    """
    from ..config import ConfigError, load_config

    try:
        cfg = load_config(config, world_size=nproc)
    except ConfigError as err:
        raise AutotuneError(f"--config {config}: {err}") from None
    tuning = cfg.autotuning
    metric = metric or tuning.metric
    stages = list(stages) if stages is not None else [0, 1, 2, 3]
    results = Path(results_dir or tuning.results_dir)
    exps = Path(exps_dir or tuning.exps_dir)
    results.mkdir(parents=True, exist_ok=True)
    budget = budget or _default_budget(nproc)
    runner = Runner(script, list(script_args), config_arg, nproc, timeout, exps, tuning.arg_mappings)

    info = _profile(runner, cfg, results, log)
    fits = stage_fits(info, budget, nproc, stages, tuning.min_train_micro_batch_size_per_gpu,
                      _max_micro_batch(tuning, cfg.gradient_accumulation_steps, nproc))
    for fit in fits:
        log(f"stage {fit.stage}: model states {format_bytes(fit.model_state_bytes)} per rank; largest "
            f"micro-batch within {format_bytes(budget)}: {fit.max_micro_batch or 'none'}")
    trials = _run_trials(runner, cfg, fits, budget, metric, log)
    best = _choose(trials, metric)
    table = results / "trials.csv"
    write_table(trials, table)
    best_path = None
    if best is not None:
        best_path = str(results / "best_config.json")
        write_json(best_path, tuned_config(cfg.raw, best.stage, best.micro_batch,
                                            cfg.gradient_accumulation_steps, nproc))
    return AutotuneResult(best, best_path, trials, fits, info, budget, str(table))


def _max_micro_batch(tuning: Any, gas: int, nproc: int) -> int:
    largest = tuning.max_train_micro_batch_size_per_gpu
    if tuning.max_train_batch_size:
        largest = min(largest, tuning.max_train_batch_size // (gas * nproc))
    return largest


def _default_budget(nproc: int) -> int:
    device = accelerator.total_memory()
    if device:
        return device
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // max(1, nproc)
    except OSError:
        pass
    raise AutotuneError("cannot tell how much memory this machine has; give --memory-budget")


def _profile(runner: Runner, cfg: Any, results: Path, log: Callable[[str], None]) -> Dict[str, Any]:
    path = (results / "profile_model_info" / "model_info.json").resolve()
    if path.exists():
        path.unlink()
    config = base_config(cfg.raw, cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu,
                          cfg.gradient_accumulation_steps)
    config["autotuning"] = {"enabled": False, "model_info_path": str(path), "model_info": {"profile": True}}
    log(f"profile run: micro-batch {cfg.train_micro_batch_size_per_gpu}, stage "
        f"{cfg.zero_optimization.stage}, {runner.nproc} process(es)")
    status, tail, _ = runner.run("profile_model_info", config, {})
    if not path.exists():
        oom = any(marker in tail for marker in _OOM_MARKERS)
        hint = (" It ran out of memory: lower train_micro_batch_size_per_gpu in the config." if oom
                else "")
        raise AutotuneError(f"the profile run wrote no {path} (exit status {status}).{hint} Its output "
                            f"ends with:\n{tail}")
    info = json.loads(path.read_text())
    log(f"profile: {info['num_params']:,} parameters, {format_bytes(info['activation_mem_per_sample'])} of "
        f"activations per sample ({info['activation_method']}), bytes per parameter "
        f"{info['bytes_per_param']}")
    return info


def _run_trials(runner: Runner, cfg: Any, fits: List[StageFit], budget: int, metric: str,
                log: Callable[[str], None]) -> List[Trial]:
    tuning = cfg.autotuning
    trials: List[Trial] = []
    best: Optional[float] = None
    stale = 0
    for fit in fits:
        sizes = _candidates(fit.max_micro_batch, tuning.num_tuning_micro_batch_sizes,
                            tuning.min_train_micro_batch_size_per_gpu,
                            _max_micro_batch(tuning, cfg.gradient_accumulation_steps, runner.nproc))
        for micro_batch in sizes:
            if len(trials) >= tuning.tuner_num_trials or stale >= tuning.tuner_early_stopping:
                return trials
            trial = _trial(runner, cfg, fit.stage, micro_batch, budget, metric)
            trials.append(trial)
            log(f"trial {trial.name}: {trial.status}" + (
                f", {trial.samples_per_s:.1f} samples/s, peak {format_bytes(trial.peak_memory)}"
                if trial.status == "ok" else ""))
            value = trial.value(metric)
            if value is not None and (best is None or value > best + abs(best) * _TIE):
                best, stale = value, 0
            else:
                stale += 1
            if trial.status == "oom":
                break  # larger micro-batches at this stage need more memory still
    return trials


def _trial(runner: Runner, cfg: Any, stage: int, micro_batch: int, budget: int, metric: str) -> Trial:
    tuning = cfg.autotuning
    trial = Trial(f"z{stage}_mbs{micro_batch}", stage, micro_batch)
    metrics = (runner.exps / trial.name / "metrics.json").resolve()
    if not tuning.overwrite and metrics.exists():
        return _read_trial(trial, metrics, budget, 0, "")
    if metrics.exists():
        metrics.unlink()
    config = base_config(cfg.raw, stage, micro_batch, cfg.gradient_accumulation_steps)
    config["autotuning"] = {"enabled": True, "start_profile_step": tuning.start_profile_step,
                            "end_profile_step": tuning.end_profile_step, "metric_path": str(metrics),
                            "metric": metric}
    status, tail, _ = runner.run(trial.name, config, {MEMORY_BUDGET_ENV: str(budget)})
    return _read_trial(trial, metrics, budget, status, tail)


def _read_trial(trial: Trial, metrics: Path, budget: int, status: int, tail: str) -> Trial:
    if metrics.exists():
        data = json.loads(metrics.read_text())
        trial.samples_per_s, trial.latency_ms = data["throughput"], data["latency"]
        trial.flops_per_s, trial.peak_memory = data.get("FLOPS_per_gpu"), data.get("peak_memory")
        over = trial.peak_memory is not None and trial.peak_memory > budget
        trial.status = "oom" if over else "ok"
        trial.detail = f"peak {trial.peak_memory} > budget {budget}" if over else ""
    elif status == 124:
        trial.status, trial.detail = "timeout", tail
    elif any(marker in tail for marker in _OOM_MARKERS):
        trial.status, trial.detail = "oom", tail
    else:
        trial.status, trial.detail = "error", tail
    return trial


def _choose(trials: List[Trial], metric: str) -> Optional[Trial]:
    """The best trial; within 5% of the best value the larger micro-batch, then the lower
    stage, wins (a bigger batch is as fast within noise and needs fewer steps)."""
    scored = [(t.value(metric), t) for t in trials if t.value(metric) is not None]
    if not scored:
        return None
    top = max(value for value, _ in scored)
    margin = abs(top) * _TIE
    close = [t for value, t in scored if value >= top - margin]
    return max(close, key=lambda t: (t.micro_batch, -t.stage))


def _candidates(largest: int, count: int, low: int, high: int) -> List[int]:
    """Micro-batches to try around the predicted largest: it, one step above (the estimate may
    be cautious) and halvings below, ``count`` in all, ascending."""
    if largest < low:
        return []
    above = min(high, largest + max(1, largest // 8))
    picks = [above] if above > largest else []
    value = largest
    while value >= low and len(picks) < count:
        if value not in picks:
            picks.append(value)
        value //= 2
    return sorted(picks[:count])

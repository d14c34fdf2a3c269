"""``engine.offload_states()`` / ``reload_states()`` on every rank, at ZeRO stages 0-3, fp32 and
bf16: what each kind frees, that training goes on exactly as a run without the offload, and
the calls refused while states are away."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

import shardtrain
from shardtrain import comm

MICRO, STEPS = 2, 3
KINDS = ["optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
                               torch.nn.Linear(16, 3))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(MICRO * 2, 6, generator=g), torch.randn(MICRO * 2, 3, generator=g)
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def config(stage: int, bf16: bool) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": bf16}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def train_step(engine, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    loss = (engine(x.to(engine.device)).float() - y.to(engine.device)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def weights(engine) -> List[torch.Tensor]:
    return [v.float().clone() for v in engine.module.state_dict().values()]


def run(stage: int, bf16: bool, include: Any) -> Dict[str, Any]:
    """Step 0, offload ``include`` (with a forward without gradients while away), reload,
    steps 1-2; each stage also without the offload."""
    engine, *_ = shardtrain.initialize(model=build(), config=config(stage, bf16))
    rank = comm.get_rank()
    out: Dict[str, Any] = {"losses": [train_step(engine, 0, rank)]}
    if include == "never":
        with torch.no_grad():
            out["eval"] = engine(batch(0, rank)[0].to(engine.device)).float().sum().item()
        engine.empty_partition_cache()
    else:
        before = engine.model_state_bytes()
        identity = [id(t) for s in engine.optimizer.state.values() for t in s.values()]
        engine.offload_states(include=include, device="cpu", pin_memory=True,
                              non_blocking=True)
        out["away"] = engine.offloaded_states
        out["before"], out["after"] = before, engine.model_state_bytes()
        if "lp_params" not in out["away"]:
            with torch.no_grad():
                out["eval"] = engine(batch(0, rank)[0].to(engine.device)).float().sum().item()
            engine.empty_partition_cache()  # stage 3: what the forward gathered goes
        out["refused"] = _refusals(engine, rank)
        engine.reload_states(non_blocking=True)
        out["reloaded"] = engine.model_state_bytes()
        out["same_objects"] = identity == [id(t) for s in engine.optimizer.state.values()
                                           for t in s.values()]
    out["losses"] += [train_step(engine, step, rank) for step in range(1, STEPS)]
    out["weights"] = weights(engine)
    engine.destroy()
    return out


def _refusals(engine, rank: int) -> Dict[str, str]:
    """The message each training call raises while states are away ('' where it ran; a
    forward is only tried when it would be refused: one that runs waits for its backward)."""
    x, y = batch(1, rank)
    calls: Dict[str, Callable[[], Any]] = {
        "forward": lambda: engine(x.to(engine.device)),
        "step": engine.step, "zero_grad": engine.zero_grad,
        "save_checkpoint": lambda: engine.save_checkpoint("/nonexistent/never-written")}
    out = {}
    for name, call in calls.items():
        if name == "forward" and "lp_params" not in engine.offloaded_states:
            continue
        try:
            call()
            out[name] = ""
        except RuntimeError as err:
            out[name] = str(err)
    return out


def case_bad_arguments(rank: int, world: int) -> Dict[str, str]:
    engine, *_ = shardtrain.initialize(model=build(), config=config(2, False))
    out = {}
    for name, kwargs in {"kind": {"include": ["optim_states", "weights"]},
                         "nvme": {"device": "nvme"}}.items():
        try:
            engine.offload_states(**kwargs)
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    engine.offload_states(device="none")
    out["none_moved"] = engine.offloaded_states
    engine.offload_states(include=["lp_params"])
    engine.destroy()  # reloads: the module is left usable
    out["after_destroy"] = float(sum(p.float().sum() for p in engine.module.parameters()))
    return out


def all_cases(rank: int, world_size: int) -> Dict[str, Any]:
    from _dist import run_cases
    cases: Dict[str, Callable[[int, int], Any]] = {"bad_arguments": case_bad_arguments}
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            for include in ("never", None, *KINDS):
                name = f"s{stage}-{'bf16' if bf16 else 'fp32'}-{include}"
                cases[name] = (lambda s, b, i: lambda r, w: run(s, b, i))(stage, bf16, include)
    return run_cases(cases, rank, world_size)


def case_cuda_memory(rank: int, world_size: int) -> Dict[str, int]:
    """On CUDA, bf16 at stage 2: the device's allocated bytes before, while and after the
    states are away, and the model-state bytes the engine counts as gone."""
    engine, *_ = shardtrain.initialize(model=build(), config=config(2, True))
    train_step(engine, 0, rank)
    torch.cuda.synchronize()
    before, held = torch.cuda.memory_allocated(), engine.model_state_bytes()["total"]
    engine.offload_states(pin_memory=True, non_blocking=True)
    torch.cuda.synchronize()
    away, counted = torch.cuda.memory_allocated(), held - engine.model_state_bytes()["total"]
    engine.reload_states(non_blocking=True)
    torch.cuda.synchronize()
    out = {"before": before, "away": away, "after": torch.cuda.memory_allocated(),
           "counted": counted, "loss": train_step(engine, 1, rank)}
    engine.destroy()
    return out

"""What DeepSpeed's client libraries and scripts do to the engine, checked on every rank of
one process group per ZeRO stage (``test_compat_dist.py``), against single-process PyTorch.

* forward outputs are ordinary tensors: in-place arithmetic on the loss (the Trainer's
  ``loss *= n``), then a plain ``loss.backward()``, equals ``engine.backward(loss)`` at every
  precision;
* ``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` and the ``_local_`` variants;
* ``deepspeed.comm`` on the world and on a new group;
* DeepSpeed's optimizer attributes (``overflow``, ``cur_scale``), the config as a dict, module
  attributes through the engine, nested ``no_sync``, ``destroy()``, ``empty_partition_cache()``;
* what DeepSpeed's own unit tests rely on: safe_get_full_grad inside several ``no_sync()``
  blocks, the exceptions of misplaced calls, ``ignore_unused_parameters: false``,
  ``checkpoint.tag_validation: "Fail"``, OneCycle's momentum through the engine.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F

import cases_engine as ce
import shardtrain
import shardtrain.deepspeed as deepspeed  # the tree `import deepspeed` gives with the alias
from shardtrain import comm
from shardtrain.deepspeed import utils as dsu

STEPS, GAS, MICRO = 2, 2, 3


def guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # one failing case must not hide the others
        return {"error": traceback.format_exc()}


def config(precision: str = "fp32", gas: int = GAS, **extra) -> dict:
    cfg = ce.base_config(micro=MICRO, gas=gas, **extra)
    if precision in ("bf16", "fp16"):
        cfg[precision] = {"enabled": True}
    return cfg


def in_place_loss(rank: int, world: int) -> Dict[str, Any]:
    """``loss *= world; loss /= world`` on the forward output, ``loss.div_(1)``, then
    ``loss.backward()``: the same weights as ``engine.backward(loss)``, every precision."""
    data = ce.make_data(STEPS, GAS, world, MICRO)
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        got = {}
        for path in ("engine", "plain_in_place"):
            engine = ce.engine_for(ce.make_model(), config(precision))
            x, y = data
            for s in range(STEPS):
                for k in range(GAS):
                    loss = F.cross_entropy(engine(x[s, k, rank]).float(), y[s, k, rank])
                    if path == "engine":
                        engine.backward(loss)
                    else:
                        loss *= world          # as the Trainer does with the forward output
                        loss /= world
                        loss.div_(1.0)
                        loss.backward()
                    engine.step()
            got[path] = ce._params(engine.module)
        out[precision] = got
    return out


def _reference_grads(world: int, data, params_before=None):
    """The gradient of the mean loss over the first global batch, one process."""
    model = ce.make_model()
    x, y = data
    for k in range(GAS):
        for r in range(world):
            (F.cross_entropy(model(x[0, k, r]), y[0, k, r]) / (GAS * world)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, model


def safe_get_set(rank: int, world: int) -> Dict[str, Any]:
    data = ce.make_data(STEPS, GAS, world, MICRO)
    x, y = data
    ref_grads, ref_model = _reference_grads(world, data)
    out = {"ref_grads": ref_grads}
    for precision in ("fp32", "bf16"):
        engine = ce.engine_for(ce.make_model(), config(precision, optimizer={
            "type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}))
        named = dict(engine.module.named_parameters())
        got: Dict[str, Any] = {}
        loss = F.cross_entropy(engine(x[0, 0, rank]).float(), y[0, 0, rank])
        engine.backward(loss)
        try:  # mid-accumulation: this rank's gradient so far (stages 0-1), none at 2-3
            got["mid"] = dsu.safe_get_full_grad(named["fc1.weight"]).cpu()
            got["mid_local"] = dsu.safe_get_local_grad(named["fc1.weight"]).cpu()
            got["mid_error"] = None
        except ValueError as err:  # DeepSpeed's class; shardtrain's is also a RuntimeError
            got["mid_error"] = (type(err).__name__, isinstance(err, RuntimeError), str(err))
        engine.step()
        loss = F.cross_entropy(engine(x[0, 1, rank]).float(), y[0, 1, rank])
        engine.backward(loss)
        got["grads"] = {n: dsu.safe_get_full_grad(p).cpu() for n, p in named.items()}
        got["fp32"] = {n: dsu.safe_get_full_fp32_param(p).cpu() for n, p in named.items()}
        got["local"] = {n: dsu.safe_get_local_fp32_param(p).numel() for n, p in named.items()}
        # Zero one gradient before the step: with a fresh AdamW it then does not move.
        dsu.safe_set_full_grad(named["mid.weight"], torch.zeros_like(ref_grads["mid.weight"]))
        engine.step()
        got["exp_avg"] = {n: dsu.safe_get_full_optimizer_state(p, "exp_avg").cpu()
                          for n, p in named.items()}
        got["after_step"] = {n: dsu.safe_get_full_fp32_param(p).cpu() for n, p in named.items()}
        value = torch.full_like(ref_grads["fc2.weight"], 0.25)
        dsu.safe_set_full_fp32_param(named["fc2.weight"], value)
        with shardtrain.zero.GatheredParameters([named["fc2.weight"]]):
            got["set_fp32"] = named["fc2.weight"].detach().float().cpu().clone()
        got["unknown"] = dsu.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
        out[precision] = got
    return out


def comm_passthrough(rank: int, world: int) -> Dict[str, Any]:
    dist = deepspeed.comm
    out: Dict[str, Any] = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    t = torch.tensor([float(rank)])
    parts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(parts, t)
    out["all_gather"] = [p.item() for p in parts]
    flat = torch.zeros(world)
    dist.all_gather_into_tensor(flat, t)
    out["all_gather_into_tensor"] = flat.tolist()
    b = torch.tensor([rank + 10.0])
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.item()
    s = torch.tensor([rank + 1.0])
    dist.all_reduce(s)  # DeepSpeed's default op: a sum
    out["all_reduce"] = s.item()
    avg = torch.tensor([rank + 1.0])
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)  # gloo has no AVG: a sum and a division
    out["avg"] = avg.item()
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.arange(world, dtype=torch.float32))
    out["reduce_scatter_tensor"] = rs.item()
    group = dist.new_group(ranks=list(range(world)))
    out["group"] = (dist.get_rank(group), dist.get_world_size(group),
                    dist.get_all_ranks_from_group(group))
    dist.barrier()
    out["initialized"] = dist.is_initialized()
    return out


def engine_surface(rank: int, world: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    engine = ce.engine_for(ce.make_model(), config(steps_per_print=float("inf")))
    out["steps_per_print"] = engine.steps_per_print()
    out["config_get"] = (engine.config.get("zero_optimization", {}).get("stage"),
                         engine.config["train_micro_batch_size_per_gpu"],
                         "optimizer" in engine.config, engine.config.get("nope", "dflt"))
    out["getters"] = (engine.get_batch_info(), engine.zero_optimization(),
                      engine.bfloat16_enabled(), engine.fp16_enabled(), engine.gradient_clipping(),
                      engine.zero_gather_16bit_weights_on_model_save())
    out["passthrough"] = engine.fc1 is engine.module.fc1 and \
        engine.make_model_attr() if hasattr(engine.module, "make_model_attr") else \
        (engine.fc1 is engine.module.fc1, type(engine.mid).__name__)
    try:
        _ = engine.no_such_attribute
    except AttributeError as err:
        out["missing"] = str(err)
    if engine.zero_optimization_stage() < 2:
        with engine.no_sync():
            try:
                with engine.no_sync():
                    pass
                out["nested"] = None
            except AssertionError as err:  # DeepSpeed's class (and a RuntimeError)
                out["nested"] = str(err)
    out["flags_initial"] = (engine.optimizer.overflow, engine.optimizer.cur_scale,
                            engine.optimizer.loss_scale)
    return out


def fp16_overflow_flags(rank: int, world: int) -> Dict[str, Any]:
    cfg = config("fp16")
    cfg["fp16"].update(initial_scale_power=4, hysteresis=1)  # the first overflow halves it
    engine = ce.engine_for(ce.make_model(), cfg)
    x, y = ce.make_data(2, GAS, world, MICRO)
    seen = []
    for s in range(2):
        for k in range(GAS):
            loss = F.cross_entropy(engine(x[s, k, rank]).float(), y[s, k, rank])
            if s == 0 and rank == world - 1:
                loss = loss * float("inf")  # one rank overflows: every rank skips
            engine.backward(loss)
            engine.step()
        seen.append((engine.optimizer.overflow, engine.optimizer.cur_scale,
                     engine.optimizer.loss_scale, engine.was_step_applied()))
    return {"seen": seen}


def destroy_then_train_again(rank: int, world: int) -> Dict[str, Any]:
    """Test suites call engine.destroy() after every run and build the next engine."""
    data = ce.make_data(STEPS, GAS, world, MICRO)
    first = ce.engine_for(ce.make_model(), config())
    ce.train(first, data, rank)
    first.empty_partition_cache()
    first.destroy()
    leftover = _hooks_left(first.module)
    second = ce.engine_for(ce.make_model(), config())
    return {"after": ce.train(second, data, rank)["params"], "leftover": leftover}


def _hooks_left(model: torch.nn.Module) -> Dict[str, Any]:
    """What an engine installed on a model and did not remove."""
    return {"module_hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                                for m in model.modules()),
            "grad_hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
            "load_hooks": len(model._load_state_dict_post_hooks),
            "swapped_classes": [type(m).__name__ for m in model.modules()
                                if getattr(type(m), "_zero_access_class", False)]}


def stage3_partition_cache(rank: int, world: int) -> Dict[str, Any]:
    """After a first step has taught the engine the order, a forward with gradients on and no
    backward (an evaluation written without no_grad) keeps its parameters gathered for the
    backward that never comes (stage3_max_reuse_distance)."""
    engine = ce.engine_for(ce.make_model(), config(gas=1, zero_optimization={
        "stage3_param_persistence_threshold": 0}))
    engine.backward(engine(torch.randn(2, ce.IN)).sum())
    engine.step()
    engine(torch.randn(2, ce.IN))
    partitioned = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    before = sum(p.ds_status == shardtrain.zero.ZeroParamStatus.AVAILABLE for p in partitioned)
    engine.empty_partition_cache()
    after = sum(p.ds_status == shardtrain.zero.ZeroParamStatus.AVAILABLE for p in partitioned)
    state = engine._zero3_consolidated_16bit_state_dict()
    return {"before": before, "after": after, "count": len(partitioned),
            "state": None if state is None else sorted(state)}


def _local_reference(data, rank: int, micro_steps: int) -> Dict[str, torch.Tensor]:
    """This rank's gradient summed over its first ``micro_steps`` micro-batches of step 0,
    each divided by GAS: DeepSpeed's ``param.grad`` before the boundary, one process."""
    model = ce.make_model()
    x, y = data
    for k in range(micro_steps):
        (F.cross_entropy(model(x[0, k, rank]), y[0, k, rank]) / GAS).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def no_sync_contexts(rank: int, world: int) -> Dict[str, Any]:
    """DeepSpeed's own no_sync checks: several no_sync() blocks, each backward followed by
    safe_get_full_grad (this rank's gradient accumulated so far), zero_grad between them and
    the same again; step() inside no_sync(), nested blocks, and no_sync at stages 2-3 raise
    what DeepSpeed raises (AssertionError)."""
    data = ce.make_data(STEPS, GAS, world, MICRO)
    x, y = data
    engine = ce.engine_for(ce.make_model(), config())
    named = dict(engine.module.named_parameters())
    out: Dict[str, Any] = {"refs": [_local_reference(data, rank, k + 1) for k in range(GAS)]}
    rounds = []
    try:
        for _ in range(2):
            seen = []
            for k in range(GAS):
                with engine.no_sync():
                    loss = F.cross_entropy(engine(x[0, k, rank]).float(), y[0, k, rank])
                    engine.backward(loss)
                    seen.append({n: dsu.safe_get_full_grad(p).cpu() for n, p in named.items()})
            rounds.append(seen)
            engine.zero_grad()
        out["rounds"] = rounds
        with engine.no_sync():
            for what, call in (("step", engine.step), ("nested", engine.no_sync().__enter__)):
                try:
                    call()
                    out[what] = None
                except AssertionError as err:
                    out[what] = (type(err).__name__, isinstance(err, RuntimeError), str(err))
    except AssertionError as err:  # stages 2-3: no_sync itself is refused
        out["refused"] = (type(err).__name__, isinstance(err, RuntimeError), str(err))
    return out


def unused_parameters(rank: int, world: int) -> Dict[str, Any]:
    """zero_optimization.ignore_unused_parameters false: a step where a trainable parameter
    got no gradient on any rank raises on every rank, naming it; one used on one rank only
    is used; with the default the same model trains."""
    x, y = ce.make_data(STEPS, GAS, world, MICRO)
    out: Dict[str, Any] = {}
    runs = [("strict", False, -1), ("one_rank", False, 0), ("default", True, -1)]
    if ce.STAGE == 3:  # stage 3 gathers each module with a collective: every rank runs `mid`
        runs.remove(("one_rank", False, 0))
    for name, ignore, skip_rank in runs:
        engine = ce.engine_for(ce.make_model(unused=True), config(zero_optimization={
            "ignore_unused_parameters": ignore}))
        try:
            for k in range(GAS):
                skip = rank == skip_rank  # this rank leaves `mid` out of its forward
                out_k = engine(x[0, k, rank], skip_mid=True) if skip else engine(x[0, k, rank])
                engine.backward(F.cross_entropy(out_k.float(), y[0, k, rank]))
                engine.step()
            out[name] = {"steps": engine.global_steps, "error": None}
        except AssertionError as err:
            out[name] = {"steps": engine.global_steps, "error": (
                type(err).__name__, isinstance(err, RuntimeError), str(err))}
        engine.destroy()
    return out


def one_cycle_momentum(rank: int, world: int) -> Dict[str, Any]:
    """OneCycle with cycle_momentum through the engine: the scheduler's get_mom() and the
    optimizer's betas before each step, as DeepSpeed gives them."""
    engine, _, _, scheduler = shardtrain.initialize(model=ce.make_model(), config=config(
        gas=1, scheduler={"type": "OneCycle", "params": {
            "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_min_mom": 0.08,
            "cycle_max_mom": 0.09, "decay_mom_rate": 1e-3, "cycle_first_step_size": 4,
            "decay_step_size": 4}}))
    x, y = ce.make_data(12, 1, world, MICRO)
    rows = []
    for s in range(12):
        rows.append((scheduler.get_mom(), [tuple(g["betas"]) for g in engine.optimizer.param_groups]))
        engine.backward(F.cross_entropy(engine(x[s, 0, rank]).float(), y[s, 0, rank]))
        engine.step()
    return {"rows": rows}


def tag_validation(rank: int, world: int) -> Dict[str, Any]:
    """Ranks passing different tags: "Fail" raises on every rank and writes nothing (the
    class DeepSpeed raises, AssertionError, and ValueError); "Warn" saves rank 0's tag."""
    import os
    import tempfile
    root = comm.broadcast_object(tempfile.mkdtemp() if rank == 0 else None)
    out: Dict[str, Any] = {}
    for mode in ("Fail", "Warn"):
        engine = ce.engine_for(ce.make_model(), config(checkpoint={"tag_validation": mode}))
        save_dir = os.path.join(root, mode)
        try:
            engine.save_checkpoint(save_dir, tag=f"tag-of-rank-{rank}")
            out[mode] = {"error": None}
        except AssertionError as err:
            out[mode] = {"error": (type(err).__name__, isinstance(err, ValueError), str(err))}
        comm.barrier()
        out[mode]["written"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
        engine.destroy()
    comm.barrier()
    return out


def run_all(rank: int, world_size: int, stage: int) -> Dict[str, Any]:
    ce.STAGE = stage
    out = {"in_place": guarded(lambda: in_place_loss(rank, world_size)),
           "safe": guarded(lambda: safe_get_set(rank, world_size)),
           "surface": guarded(lambda: engine_surface(rank, world_size)),
           "fp16_flags": guarded(lambda: fp16_overflow_flags(rank, world_size)),
           "destroy": guarded(lambda: destroy_then_train_again(rank, world_size)),
           "no_sync": guarded(lambda: no_sync_contexts(rank, world_size)),
           "unused": guarded(lambda: unused_parameters(rank, world_size))}
    if stage == 0:
        out["comm"] = guarded(lambda: comm_passthrough(rank, world_size))
        out["one_cycle"] = guarded(lambda: one_cycle_momentum(rank, world_size))
        out["tag_validation"] = guarded(lambda: tag_validation(rank, world_size))
    if stage == 3:
        out["partition_cache"] = guarded(lambda: stage3_partition_cache(rank, world_size))
    comm.barrier()
    return out

"""Engine cases run on every rank of one process group, and their single-process references.

``run_all`` runs each case on every rank and returns ``{case: result or traceback}``. The
test module compares the results with ``reference(...)`` computed in plain PyTorch on the
same global batch.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_cases
import shardtrain
from shardtrain import comm

IN, HIDDEN, OUT = 8, 16, 4


class Net(nn.Module):
    """A small MLP; optionally with a frozen bias and a parameter no forward uses."""

    def __init__(self, frozen: bool = False, unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.gain = nn.Parameter(torch.ones(1))  # fewer elements than ranks: empty shards
        if frozen:
            self.fc1.bias.requires_grad_(False)
        self.spare = nn.Linear(OUT, OUT) if unused else None

    def forward(self, x, skip_mid: bool = False):
        h = torch.tanh(self.fc1(x))
        if not skip_mid:
            h = torch.tanh(self.mid(h))
        return self.fc2(h) * self.gain


def make_model(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def make_data(steps: int, gas: int, world: int, micro: int, seed: int = 1):
    """Inputs [steps, gas, world, micro, IN] and labels; the global batch of (step, micro
    step) is the concatenation over ranks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, gas, world, micro, IN, generator=g)
    y = torch.randint(0, OUT, (steps, gas, world, micro), generator=g)
    return x, y


STAGE = 0  # the ZeRO stage every case runs at; run_all sets it


def base_config(micro: int = 5, gas: int = 1, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}}
    cfg.update(extra)
    zero = {"stage": STAGE}
    if STAGE == 3:  # biases (16 and 4 elements) stay whole, weights are partitioned
        zero["stage3_param_persistence_threshold"] = 16
    cfg["zero_optimization"] = {**zero, **cfg.get("zero_optimization", {})}
    return cfg


# -- the reference ---------------------------------------------------------------------------

def reference(model: nn.Module, data, optimizer: Callable, clip: float = 0.0,
              scheduler: Optional[Callable] = None, skip_mid_rank: int = -1) -> Dict[str, Any]:
    """Plain single-process training on each global batch: the mean loss over all ranks'
    and micro-steps' samples, one optimizer step per global batch."""
    x, y = data
    steps, gas, world = x.shape[:3]
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    losses, lrs, norms = torch.zeros(steps, gas, world), [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        lrs.append([g["lr"] for g in opt.param_groups])
        for k in range(gas):
            for r in range(world):
                out = model(x[s, k, r], skip_mid=(r == skip_mid_rank))
                loss = F.cross_entropy(out, y[s, k, r])
                (loss / (gas * world)).backward()
                losses[s, k, r] = loss.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        if sched:
            sched.step()
    return {"losses": losses, "params": _params(model), "lrs": lrs, "norms": norms}


def _params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


# -- running the engine ----------------------------------------------------------------------

def train(engine, data, rank: int, use_engine_backward: bool = True,
          inject: Optional[Callable] = None, skip_mid: bool = False) -> Dict[str, Any]:
    x, y = data
    steps, gas = x.shape[:2]
    losses = torch.zeros(steps, gas)
    lrs, norms, applied = [], [], []
    for s in range(steps):
        lrs.append(engine.get_lr())
        for k in range(gas):
            if inject:
                inject(engine, s, k)
            target = y[s, k, rank].to(engine.device)
            out = engine(x[s, k, rank], skip_mid=skip_mid) if skip_mid else engine(x[s, k, rank])
            loss = F.cross_entropy(out.float(), target)
            if use_engine_backward:
                engine.backward(loss)
            else:
                loss.backward()
            engine.step()
            losses[s, k] = loss.detach().cpu()
        norms.append(engine.get_global_grad_norm())
        applied.append(engine.was_step_applied())
    return {"losses": losses, "params": _params(engine.module), "lrs": lrs, "norms": norms,
            "applied": applied, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "skipped": engine.skipped_steps,
            "micro_steps": engine.micro_steps, "scale": engine.get_loss_scale()}


def engine_for(model, config, **kw):
    engine, *_ = shardtrain.initialize(model=model, config=config, **kw)
    return engine


# -- cases -----------------------------------------------------------------------------------

CASES: Dict[str, Callable] = {}


def case(fn):
    CASES[fn.__name__[len("case_"):]] = fn
    return fn


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


@case
def case_plain(rank, world):
    data = make_data(4, 1, world, 5)
    return train(engine_for(make_model(), base_config()), data, rank)


@case
def case_accum_engine_backward(rank, world):
    data = make_data(3, 4, world, 3)
    return train(engine_for(make_model(), base_config(micro=3, gas=4)), data, rank)


@case
def case_accum_plain_backward(rank, world):
    data = make_data(3, 4, world, 3)
    return train(engine_for(make_model(), base_config(micro=3, gas=4)), data, rank,
                 use_engine_backward=False)


@case
def case_accum3_both_paths(rank, world):
    """engine.backward and loss.backward give bit-identical training, gas not a power of 2."""
    data = make_data(2, 3, world, 3)
    a = train(engine_for(make_model(), base_config(micro=3, gas=3)), data, rank)
    b = train(engine_for(make_model(), base_config(micro=3, gas=3)), data, rank,
              use_engine_backward=False)
    return {"same": all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
            and torch.equal(a["losses"], b["losses"])}


@case
def case_clipping(rank, world):
    data = make_data(4, 2, world, 3)
    cfg = base_config(micro=3, gas=2, gradient_clipping=0.05,
                      optimizer={"type": "SGD", "params": {"lr": 2.0}})
    return train(engine_for(make_model(), cfg), data, rank)


@case
def case_frozen(rank, world):
    data = make_data(3, 1, world, 4)
    return train(engine_for(make_model(frozen=True), base_config(micro=4)), data, rank)


@case
def case_unused(rank, world):
    data = make_data(3, 1, world, 4)
    engine = engine_for(make_model(unused=True), base_config(micro=4))
    out = train(engine, data, rank)
    held = {id(s.param): s.tensor for s in engine.optimizer_slots()}
    spare = held.get(id(engine.module.spare.weight))  # None: this rank holds none of it
    out["spare_state"] = len(engine.optimizer.state.get(spare, {})) if spare is not None else 0
    out["spare_held"] = spare is not None
    return out


@case
def case_rank_dependent_unused(rank, world):
    """Rank 1 never uses ``mid``: its buckets fill in another order than rank 0's, yet the
    collectives must still line up (buckets leave in a fixed order). Not at stage 3, which
    gathers each module's parameters with a collective: every rank must run every module."""
    if STAGE == 3:
        return {"not_applicable": "stage 3 needs the same modules on every rank"}
    data = make_data(3, 2, world, 3)
    cfg = base_config(micro=3, gas=2, gradient_clipping=1.0,
                      zero_optimization={"reduce_bucket_size": 40, "overlap_comm": True})
    return train(engine_for(make_model(), cfg), data, rank, skip_mid=(rank == 1))


@case
def case_tied_gpt(rank, world):
    import gpt
    cfg = gpt.gpt_config("tiny")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (3, world, 2, cfg.block_size + 1), generator=g)
    engine = engine_for(model, base_config(micro=2))
    losses = []
    for s in range(3):
        batch = tokens[s, rank]
        loss = engine(batch[:, :-1], batch[:, 1:].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    tied = engine.module.lm_head.weight is engine.module.tok_emb.weight
    return {"losses": losses, "params": _params(engine.module), "tied": tied}


@case
def case_schedulers(rank, world):
    data = make_data(6, 1, world, 2)
    out = {}
    for name, params in SCHEDULES.items():
        cfg = base_config(micro=2, scheduler={"type": name, "params": params})
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.01}}
        out[name] = train(engine_for(make_model(), cfg), data, rank)
    return out


SCHEDULES = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                 "warmup_type": "linear"},
    "WarmupDecayLR": {"total_num_steps": 6, "warmup_max_lr": 0.01, "warmup_num_steps": 2},
    "WarmupCosineLR": {"total_num_steps": 6, "warmup_num_steps": 2},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2,
                 "cycle_momentum": False},
    "StepLR": {"step_size": 2, "gamma": 0.5},
}


@case
def case_fp16_overflow(rank, world):
    """The last rank (only) gets an inf gradient on step 2: every rank must skip that step."""
    data = make_data(4, 1, world, 4)
    cfg = base_config(micro=4, fp16={"enabled": True, "initial_scale_power": 8,
                                     "hysteresis": 1})
    engine = engine_for(make_model(), cfg)
    params_before = {}

    def inject(engine, s, k):
        if s == 2:
            params_before.update(_params(engine.module))
            if rank == world - 1:
                w = engine.module.fc2.weight
                handle = w.register_hook(lambda g: torch.full_like(g, math.inf))
                inject.handle = handle
        elif s == 3 and getattr(inject, "handle", None):
            inject.handle.remove()

    out = train(engine, data, rank, inject=inject)
    out["before_skip"] = params_before
    return out


@case
def case_fp16_static(rank, world):
    data = make_data(3, 1, world, 4)
    cfg = base_config(micro=4, fp16={"enabled": True, "loss_scale": 128})
    return train(engine_for(make_model(), cfg), data, rank)


@case
def case_bf16_vs_fp32(rank, world):
    x, y = make_data(1, 1, world, 8, seed=5)  # one batch, seen 30 times: learnable
    data = (x.expand(30, *x.shape[1:]), y.expand(30, *y.shape[1:]))
    ref = train(engine_for(make_model(), base_config(micro=8)), data, rank)
    bf = train(engine_for(make_model(), base_config(micro=8, bf16={"enabled": True})),
               data, rank)
    e = engine_for(make_model(), base_config(micro=8, bf16={"enabled": True}))
    dtypes = {str(p.dtype) for p in e.module.parameters()}
    master = {str(p.dtype) for g in e.optimizer.param_groups for p in g["params"]}
    return {"fp32": ref["losses"], "bf16": bf["losses"], "param_dtypes": dtypes,
            "master_dtypes": master}


def linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(IN, OUT)


@case
def case_autocast(rank, world):
    cfg = base_config(torch_autocast={"enabled": True, "dtype": "bfloat16"})
    engine = engine_for(linear(), cfg)
    out = engine(torch.randn(2, IN))
    cast = engine_for(linear(), base_config(fp16={"enabled": True}))
    half_out = cast(torch.randn(2, IN))
    plain = engine_for(linear(), base_config())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_out = plain(torch.randn(2, IN))
    return {"autocast_out": str(out.dtype), "param_dtype": str(engine.module.weight.dtype),
            "fp16_out": str(half_out.dtype), "outer_autocast_off": str(plain_out.dtype)}


@case
def case_comm_pattern(rank, world):
    """All-reduces happen only on the boundary micro-step, one per bucket, and with
    overlap_comm the first bucket leaves before backward has produced every gradient."""
    out = {}
    for overlap in (True, False):
        cfg = base_config(micro=2, gas=3, zero_optimization={
            "reduce_bucket_size": 70, "overlap_comm": overlap})
        engine = engine_for(make_model(), cfg)
        log: List[tuple] = []

        def observe(op, tensor, engine=engine, log=log):
            arrived = engine.strategy.stats()["arrived"]
            log.append((op, engine.micro_steps, arrived, tensor.numel()))

        comm.add_observer(observe)
        try:
            train(engine, make_data(2, 3, world, 2), rank)
        finally:
            comm.remove_observer(observe)
        stats = engine.strategy.stats()
        out[overlap] = {"log": log, "buckets": stats["buckets"], "nparams": stats["params"]}
    return out


@case
def case_no_sync(rank, world):
    data = make_data(2, 2, world, 3)
    x, y = data
    engine = engine_for(make_model(), base_config(micro=3, gas=2))
    raised = None
    for s in range(2):
        with engine.no_sync():
            loss = F.cross_entropy(engine(x[s, 0, rank]), y[s, 0, rank].to(engine.device))
            engine.backward(loss)
            try:
                engine.step()
            except RuntimeError as err:
                raised = str(err)
        engine.step()  # the refused step() counted nothing: count the micro-step outside
        loss = F.cross_entropy(engine(x[s, 1, rank]), y[s, 1, rank].to(engine.device))
        engine.backward(loss)
        engine.step()
    return {"params": _params(engine.module), "raised": raised}


@case
def case_dataloader(rank, world):
    dataset = torch.utils.data.TensorDataset(torch.arange(40).float().unsqueeze(1))
    _, _, loader, _ = shardtrain.initialize(model=make_model(), training_data=dataset,
                                            config=base_config(micro=4))
    seen = [batch[0].squeeze(1).long().tolist() for batch in loader]
    return {"seen": seen, "len": len(loader)}


@case
def case_counters(rank, world):
    engine = engine_for(make_model(), base_config(micro=2, gas=2))
    trace = []
    x = torch.randn(2, IN)
    for _ in range(4):
        loss = engine(x).sum()
        engine.backward(loss)
        engine.step()
        trace.append((engine.micro_steps, engine.global_steps, engine.global_samples,
                      engine.was_step_applied()))
    return {"trace": trace, "tb": engine.train_batch_size(), "stage":
            engine.zero_optimization_stage()}


@case
def case_client_objects(rank, world):
    data = make_data(3, 1, world, 4)
    cfg = base_config(micro=4)
    cfg.pop("optimizer")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    a = train(engine_for(model, cfg, optimizer=opt, lr_scheduler=sched), data, rank)
    b = train(engine_for(make_model(), cfg,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                         lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)),
              data, rank)
    return {"instance": a, "callable": b}


@case
def case_reduce_scatter_off(rank, world):
    data = make_data(3, 2, world, 3)
    cfg = base_config(micro=3, gas=2, zero_optimization={"reduce_scatter": False})
    return train(engine_for(make_model(), cfg), data, rank)


@case
def case_comm_dtype(rank, world):
    """bf16 gradients reduced in fp32: the wire carries fp32."""
    data = make_data(3, 1, world, 4)
    cfg = base_config(micro=4, bf16={"enabled": True}, communication_data_type="fp32")
    engine = engine_for(make_model(), cfg)
    dtypes = set()
    observer = lambda op, tensor: dtypes.add((op, str(tensor.dtype)))  # noqa: E731
    comm.add_observer(observer)
    try:
        out = train(engine, data, rank)
    finally:
        comm.remove_observer(observer)
    out["wire"] = sorted(dtypes)
    return out


@case
def case_grad_accum_fp32(rank, world):
    """bf16 gradients of 4 micro-steps, reduced in fp32, accumulated in fp32
    (``data_types.grad_accum_dtype``) and in bf16 (the default): the global norm of each
    against the fp32 sum of the same bf16 micro-step gradients, then a few steps' losses."""
    gas, micro = 4, 3
    data = make_data(2, gas, world, micro)
    x, y = data
    base = dict(micro=micro, gas=gas, bf16={"enabled": True}, communication_data_type="fp32",
                gradient_clipping=1e9)
    model = make_model().to(torch.bfloat16)
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    for k in range(gas):  # the first global batch, micro-step by micro-step, rank by rank
        for r in range(world):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[0, k, r].to(torch.bfloat16)).float(), y[0, k, r]).backward()
            for n, p in model.named_parameters():
                total[n] += p.grad.float()
    want = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(t / (gas * world)) for t in total.values()])).item()
    out = {"want": want}
    for name, extra in (("fp32", {"data_types": {"grad_accum_dtype": "fp32"}}), ("bf16", {})):
        engine = engine_for(make_model(), base_config(**base, **extra))
        got = train(engine, data, rank)
        out[name] = {"norm": got["norms"][0], "losses": got["losses"], "params": got["params"],
                     "bytes": engine.model_state_bytes()}
        engine.destroy()
    return out


@case
def case_bf16_masters(rank, world):
    """``bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` (stages 1-3): the
    optimizer steps the bf16 weights in place with bf16 Adam states, against the default
    (fp32 masters and states) on the same data, and a plain bf16 model stepped by torch's
    AdamW in one process."""
    if STAGE == 0:  # refused at stage 0, as DeepSpeed refuses it
        try:
            engine_for(make_model(), base_config(micro=4, bf16={
                "enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}))
        except ValueError as err:
            return {"refused": str(err)}
        return {"refused": None}
    data = make_data(3, 1, world, 4)
    out = {}
    for name, extra in (("bf16", {"bf16_master_weights_and_grads": True,
                                  "bf16_optimizer_states": True}), ("fp32", {})):
        engine = engine_for(make_model(), base_config(micro=4, bf16={"enabled": True, **extra}))
        got = train(engine, data, rank)
        slots = [s for s in engine.optimizer_slots() if s.tensor is not None]
        got["in_place"] = all(not s.is_copy and s.tensor.dtype == torch.bfloat16 for s in slots)
        got["state_dtypes"] = sorted({str(v.dtype) for s in slots
                                      for v in engine.optimizer.state[s.tensor].values()
                                      if isinstance(v, torch.Tensor) and v.dim()})
        got["bytes"] = engine.model_state_bytes()
        path = os.path.join(tempfile.gettempdir(), f"bf16-masters-{os.getppid()}-s{STAGE}-w{world}")
        engine.save_checkpoint(path)
        again = engine_for(make_model(), base_config(micro=4, bf16={"enabled": True, **extra}))
        again.load_checkpoint(path)
        got["reloaded"] = _params(again.module)
        again.destroy()
        engine.destroy()
        comm.barrier()
        if rank == 0:
            shutil.rmtree(path)
        out[name] = got
    model = make_model().to(torch.bfloat16)
    opt = adamw(model.parameters())
    x, y = data
    for s in range(x.shape[0]):
        opt.zero_grad(set_to_none=True)
        loss = sum(F.cross_entropy(model(x[s, 0, r].to(torch.bfloat16)).float(), y[s, 0, r])
                   for r in range(world)) / world
        loss.backward()
        opt.step()
    out["reference"] = _params(model)
    return out


@contextlib.contextmanager
def captured_warnings():
    """The warnings the shardtrain logger prints inside the block (a list of messages)."""
    seen: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("shardtrain")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


@case
def case_offload(rank, world):
    """Optimizer states and masters in host memory (stages 1-3), and at stage 3 the
    parameter shards too; bf16 exercises the copies back into 16-bit slices."""
    if STAGE == 0:  # accepted, with a warning that says why it changes nothing (as DeepSpeed)
        with captured_warnings() as seen:
            engine = engine_for(make_model(), base_config(micro=3, gas=2, gradient_clipping=1.0,
                zero_optimization={"offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu"}}))
        out = {"fp32": train(engine, make_data(3, 2, world, 3), rank), "warnings": seen}
        out["fp32"]["host_states"] = False
        return out
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if STAGE == 3:
        zero["offload_param"] = {"device": "cpu"}
    data = make_data(3, 2, world, 3)
    out = {}
    for mode, extra in (("fp32", {}), ("bf16", {"bf16": {"enabled": True}})):
        cfg = base_config(micro=3, gas=2, gradient_clipping=1.0, zero_optimization=zero, **extra)
        engine = engine_for(make_model(), cfg)
        out[mode] = train(engine, data, rank)
        out[mode]["host_states"] = all(s.tensor.device.type == "cpu"
                                       for s in engine.optimizer_slots() if s.is_copy)
        out[mode]["foreach"] = [g.get("foreach") for g in engine.optimizer.param_groups]
    return out


@case
def case_offload_memory(rank, world):
    """Device bytes after a step with and without optimizer offload (meaningful on CUDA,
    where host memory is not device memory)."""
    if STAGE == 0 or not torch.cuda.is_available() or engine_device() != "cuda":
        return {"skipped": True}
    out = {}
    for offload in (False, True):
        torch.manual_seed(0)
        zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
        engine = engine_for(Wide(), base_config(micro=2, zero_optimization=zero))
        for _ in range(2):
            loss = engine(torch.randn(2, 257)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        out[offload] = torch.cuda.memory_allocated()
        out["numel"] = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        del engine
    return out


def engine_device() -> str:
    return shardtrain.accelerator.device_type()


class Wide(nn.Module):
    """About 0.4M parameters, so that flags and padding are noise next to the states."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(257, 257) for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


@case
def case_memory(rank, world):
    out = {}
    for mode in ("fp32", "bf16"):
        torch.manual_seed(0)
        extra = {"bf16": {"enabled": True}} if mode == "bf16" else {}
        extra["zero_optimization"] = {"stage3_param_persistence_threshold": 0}
        engine = engine_for(Wide(), base_config(micro=2, **extra))
        for _ in range(2):
            loss = engine(torch.randn(2, 257)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        out[mode] = {"bytes": engine.model_state_bytes(),
                     "numel": sum(getattr(p, "ds_numel", p.numel())
                                  for p in engine.module.parameters())}
    return out


def run_all(rank: int, world_size: int, only: Optional[List[str]] = None,
            stage: int = 0) -> Dict[str, Any]:
    global STAGE
    STAGE = stage
    return run_cases(CASES, rank, world_size, only)

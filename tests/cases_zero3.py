"""ZeRO-3 cases run on every rank of one process group, with their references."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gpt
from _dist import run_cases
import shardtrain
from cases_engine import adamw, make_data
from shardtrain import comm
from shardtrain.zero import GatheredParameters, Init

IN, OUT, H = 8, 4, 16


class Twice(nn.Module):
    """A module whose parameter is used twice, and whose child runs twice, per forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, H))

    def forward(self, x):
        h = self.fc(torch.tanh(self.fc(x)))
        return h * self.scale * self.scale


class ZNet(nn.Module):
    """Frozen layer, a buffer, a repeated module; the path may skip ``twice``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(IN, H)
        self.frozen = nn.Linear(H, H)
        self.frozen.requires_grad_(False)
        self.twice = Twice()
        self.head = nn.Linear(H, OUT)
        self.register_buffer("shift", torch.full((H,), 0.1))

    def forward(self, x, skip: bool = False):
        h = torch.tanh(self.frozen(self.emb(x) + self.shift))
        if not skip:
            h = self.twice(h)
        return self.head(h)


def znet(seed: int = 0) -> ZNet:
    torch.manual_seed(seed)
    return ZNet()


def loss_of(model, out, y, penalty: bool) -> torch.Tensor:
    """Cross-entropy, plus (optionally) a penalty on the head's weight read outside any
    module's forward: at stage 3 that read must gather it."""
    loss = F.cross_entropy(out, y)
    if penalty:
        loss = loss + 1e-2 * model.head.weight.pow(2).sum()
    return loss


def skip_at(step: int) -> bool:
    return step % 3 == 2  # the forward path changes from step to step (same on every rank)


def zero3_config(micro: int, gas: int = 1, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4, **zero}}


def reference_znet(data, penalty: bool, clip: float = 1.0) -> Dict[str, Any]:
    x, y = data
    steps, gas, world = x.shape[:3]
    model = znet()
    opt = adamw([p for p in model.parameters()])
    losses = torch.zeros(steps, gas, world)
    for s in range(steps):
        opt.zero_grad()
        for k in range(gas):
            for r in range(world):
                loss = loss_of(model, model(x[s, k, r], skip=skip_at(s)), y[s, k, r], penalty)
                (loss / (gas * world)).backward()
                losses[s, k, r] = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {"losses": losses, "params": _state(model)}


def _state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def run_znet(rank: int, world: int, data, penalty: bool, forwards_first: bool = False,
             **zero) -> Dict[str, Any]:
    """``forwards_first``: each step runs every micro-batch's forward, then their backwards
    in turn (as a pipeline stage does)."""
    x, y = data
    steps, gas = x.shape[:2]
    engine, *_ = shardtrain.initialize(model=znet(), config=zero3_config(x.shape[3], gas, **zero))
    losses = torch.zeros(steps, gas)
    shard_only = []
    for s in range(steps):
        pending = []
        for k in range(gas):
            out = engine(x[s, k, rank], skip=skip_at(s))
            loss = loss_of(engine.module, out, y[s, k, rank], penalty)
            losses[s, k] = loss.detach()
            pending.append(loss)
            if not forwards_first:
                engine.backward(pending.pop())
                engine.step()
        for loss in pending:
            engine.backward(loss)
            engine.step()
        shard_only.append(_holds_shards_only(engine))
    persistent = {n: tuple(p.shape) for n, p in engine.module.named_parameters()
                  if getattr(p, "ds_persist", False)}
    return {"losses": losses, "params": _state(engine.module), "shard_only": shard_only,
            "buffer": engine.module.shift.clone(),
            "stats": {k: engine.strategy.stats()[k] for k in ("prefetched", "on_demand")},
            "persistent": persistent}


def _holds_shards_only(engine) -> bool:
    """Between steps every partitioned parameter holds nothing but its shard."""
    for p in engine.module.parameters():
        if getattr(p, "ds_persist", False):
            continue
        if p.data.numel() != 0 or p.ds_full.untyped_storage().nbytes() != 0:
            return False
    return True


CASES: Dict[str, Callable] = {}


def case(fn):
    CASES[fn.__name__[len("case_"):]] = fn
    return fn


@case
def case_znet(rank, world):
    """Frozen layer, buffer, module called twice, parameter used twice, a weight read in the
    loss, a path that changes between steps; accumulation 2, clipping."""
    return run_znet(rank, world, make_data(4, 2, world, 3), penalty=True)


@case
def case_znet_forwards_first(rank, world):
    """The same with both micro-batches' forwards before their backwards: each backward
    counts its own gradients' arrival before releasing a group."""
    return run_znet(rank, world, make_data(4, 2, world, 3), penalty=True, forwards_first=True)


@case
def case_znet_tight(rank, world):
    """The same with no prefetching, no reuse and a tiny live budget: slower, still exact."""
    return run_znet(rank, world, make_data(3, 1, world, 3), penalty=True,
                    stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0,
                    stage3_max_live_parameters=1)


class CheckpointedGPT(gpt.GPT):
    """GPT whose blocks run under activation checkpointing."""

    reentrant = True

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_tokens(world: int, steps: int = 3, micro: int = 2):
    cfg = gpt.gpt_config("tiny")
    g = torch.Generator().manual_seed(3)
    return cfg, torch.randint(0, cfg.vocab_size, (steps, world, micro, cfg.block_size + 1),
                              generator=g)


def train_gpt(engine, tokens, rank) -> Dict[str, Any]:
    losses = []
    for s in range(tokens.shape[0]):
        batch = tokens[s, rank]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _state(engine.module)}


@case
def case_checkpointing(rank, world):
    cfg, tokens = gpt_tokens(world)
    out = {}
    for reentrant in (True, False):
        torch.manual_seed(0)
        model = CheckpointedGPT(cfg)
        model.reentrant = reentrant
        engine, *_ = shardtrain.initialize(model=model, config=zero3_config(2))
        out[reentrant] = train_gpt(engine, tokens, rank)
    return out


@case
def case_init(rank, world):
    """A GPT built under zero.Init: never whole, initialised as a plain build, trains the same."""
    cfg, tokens = gpt_tokens(world)
    torch.manual_seed(0)
    with Init():
        model = gpt.GPT(cfg)
    partitioned = all(p.data.numel() == 0 and p.ds_tensor.numel() < p.ds_numel
                      for p in model.parameters() if p.ds_numel >= world)
    shapes = {n: tuple(p.ds_shape) for n, p in model.named_parameters()}
    with GatheredParameters(list(model.parameters())):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = shardtrain.initialize(model=model, config=zero3_config(2))
    out = train_gpt(engine, tokens, rank)
    out.update(partitioned=partitioned, shapes=shapes, initial=initial)
    return out


@case
def case_gathered_parameters(rank, world):
    engine, *_ = shardtrain.initialize(model=znet(), config=zero3_config(2))
    weight = engine.module.head.weight
    info = {"ds_shape": tuple(weight.ds_shape), "ds_numel": weight.ds_numel,
            "released_shape": tuple(weight.shape)}
    with GatheredParameters(weight):
        info["read_shape"] = tuple(weight.shape)
        weight.data.fill_(5.0)  # read-only block: discarded on exit
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.copy_(torch.arange(weight.numel(), dtype=weight.dtype).view_as(weight))
    info["after"] = _state(engine.module)["head.weight"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        shared = comm.broadcast_object(path)
        engine.save_16bit_model(os.path.dirname(shared), os.path.basename(shared))
        if rank == 0:
            from safetensors.torch import load_file
            info["saved"] = load_file(shared)["head.weight"]
        comm.barrier()
    info["state"] = _state(engine.module)
    return info


def _tally(seen: List[tuple]) -> Dict[str, int]:
    """Elements per collective kind, from ``comm`` observer records."""
    out: Dict[str, int] = {}
    for op, numel in seen:
        out[op] = out.get(op, 0) + numel
    return out


@case
def case_modifier_traffic(rank, world):
    """What a rank receives while zero.Init partitions and at the end of
    GatheredParameters(modifier_rank=...): its shards, or the whole tensor of a parameter
    that stays gathered after the block."""
    seen: List[tuple] = []

    def record(op: str, tensor: torch.Tensor) -> None:
        seen.append((op, tensor.numel()))

    comm.add_observer(record)
    try:
        with Init():
            model = znet()
        built = _tally(seen)
        seen.clear()
        params = list(model.parameters())
        with GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                for p in params:
                    p.data.fill_(2.0)
        written = _tally(seen)
        seen.clear()
        head = model.head.weight
        with GatheredParameters([head]):
            with GatheredParameters([head], modifier_rank=world - 1):
                if rank == world - 1:
                    head.data.fill_(-1.0)
            inside = head.detach().clone()
        nested = _tally(seen)
    finally:
        comm.remove_observer(record)
    return {"built": built, "written": written, "nested": nested, "inside": inside,
            "chunks": sum(p.ds_tensor.numel() for p in params),
            "head": (head.ds_tensor.numel(), head.ds_numel),
            "shards": {n: p.ds_tensor.clone() for n, p in model.named_parameters()}}


@case
def case_gathered_parameters_reach_masters(rank, world):
    """Weights written with GatheredParameters(modifier_rank=0) after the engine was built
    reach its fp32 masters (bf16) and its offloaded copies: a step with lr 0 keeps them.
    ``head.bias`` (4 elements) is kept whole on every rank: the modifier's value reaches the
    other ranks' copies too."""
    out = {}
    for name, extra in (("bf16", {"bf16": {"enabled": True}}),
                        ("offload", {"zero_optimization": {"stage": 3, "offload_optimizer": {
                            "device": "cpu"}, "stage3_param_persistence_threshold": 4}})):
        config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, **extra}
        torch.manual_seed(0)
        model = nn.Sequential()
        model.emb, model.act, model.head = nn.Linear(IN, H), nn.Tanh(), nn.Linear(H, OUT)
        engine, *_ = shardtrain.initialize(model=model, config=config)
        weight, bias = engine.module.head.weight, engine.module.head.bias
        with GatheredParameters([weight], modifier_rank=0):
            if rank == 0:
                weight.data.fill_(0.25)
        with GatheredParameters([bias], modifier_rank=0):  # a block of whole ones only
            if rank == 0:
                bias.data.fill_(0.5)
        x, y = make_data(1, 1, world, 3)
        dtype = torch.bfloat16 if name == "bf16" else torch.float32  # bf16 modules take bf16 inputs
        loss = F.cross_entropy(engine(x[0, 0, rank].to(dtype)).float(), y[0, 0, rank])
        engine.backward(loss)
        engine.step()
        state = _state(engine.module)
        out[name] = {"weight": state["head.weight"], "bias": state["head.bias"],
                     "bias_whole": not hasattr(bias, "ds_tensor")}
    return out


@case
def case_gather_count(rank, world):
    """A GPT whose tied embedding is sharded, no reuse: every step gathers each module's
    parameters at most once in forward and once in backward."""
    cfg, data = gpt_tokens(world)
    torch.manual_seed(0)
    engine, *_ = shardtrain.initialize(model=gpt.GPT(cfg), config=zero3_config(
        2, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0))
    return {"counts": _gathers_per_step(engine, data, rank)["counts"]}


def _gathers_per_step(engine, data, rank) -> Dict[str, Any]:
    """Trains on ``data`` counting all-gathers: (forward, whole step) per step."""
    counts, losses = [], []
    for s in range(data.shape[0]):
        seen = []
        observer = lambda op, t, seen=seen: seen.append(op)  # noqa: E731
        comm.add_observer(observer)
        try:
            batch = data[s, rank]
            loss = engine(batch[:, :-1], batch[:, 1:])
            forward = seen.count("all_gather")
            engine.backward(loss)
            engine.step()
        finally:
            comm.remove_observer(observer)
        counts.append((forward, seen.count("all_gather")))
        losses.append(loss.item())
    return {"counts": counts, "losses": losses, "params": _state(engine.module)}


@case
def case_leaf_blocks(rank, world):
    """GPT blocks as leaf modules (config, by class name): one gather per block, same training."""
    cfg, data = gpt_tokens(world)
    out = {}
    for leaves in ([], ["Block"]):
        torch.manual_seed(0)
        model = gpt.GPT(cfg)
        engine, *_ = shardtrain.initialize(model=model, config=zero3_config(
            2, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
            leaf_module={"classes": leaves}))
        out[bool(leaves)] = _gathers_per_step(engine, data, rank)
        out[bool(leaves)]["leaves"] = [n for n, m in model.named_modules()
                                       if shardtrain.zero.z3_leaf_module(m)]
    return out


@case
def case_leaf_selection(rank, world):
    """Leaves by name, by name suffix and by the granularity threshold, outermost first."""
    cfg, data = gpt_tokens(world)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    engine, *_ = shardtrain.initialize(model=model, config=zero3_config(
        2, stage3_param_persistence_threshold=0, stage3_module_granularity_threshold=900,
        leaf_module={"classes": [], "names": "blocks.0", "name_suffixes": ["mlp"]}))
    out = _gathers_per_step(engine, data, rank)
    out["leaves"] = [n for n, m in model.named_modules() if shardtrain.zero.z3_leaf_module(m)]
    units = {id(m) for m in engine.strategy.units()}
    out["units"] = sorted(n for n, m in model.named_modules() if id(m) in units)
    return out


@case
def case_leaf_init_offload_checkpoint(rank, world):
    """Leaf blocks with zero.Init and parameter offload; the checkpoint they write loads into
    an engine without leaves, and the other way round: the same training as without leaves."""
    cfg, data = gpt_tokens(world, steps=6)
    zero = {"stage3_param_persistence_threshold": 0}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = comm.broadcast_object(tmp)
        for name, leaf, extra in (("plain", [], {}), ("leaf", ["Block"], {
                "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})):
            torch.manual_seed(0)
            with Init(enabled=bool(leaf)):
                model = gpt.GPT(cfg)
            engine, *_ = shardtrain.initialize(model=model, config=zero3_config(
                2, leaf_module={"classes": leaf}, **zero, **extra))
            first = train_gpt(engine, data[:3], rank)["losses"]
            path = os.path.join(root, name)
            engine.save_checkpoint(path)
            rest = train_gpt(engine, data[3:], rank)
            torch.manual_seed(1)  # other weights: all must come from the checkpoint
            other, *_ = shardtrain.initialize(model=gpt.GPT(cfg), config=zero3_config(
                2, leaf_module={"classes": [] if leaf else ["Block"]}, **zero))
            other.load_checkpoint(path)
            out[name] = {"losses": first + rest["losses"], "params": rest["params"],
                         "resumed": train_gpt(other, data[3:], rank)}
        comm.barrier()
    return out


class TinyMoE(nn.Module):
    """Top-1 routing to one of four experts: which experts run depends on the data, so it
    differs from rank to rank."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, 4)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        weights = torch.softmax(self.gate(x), dim=-1)
        choice = weights.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():  # an expert no sample chose does not run
                out = out.index_add(0, rows, expert(x[rows]) * weights[rows, e:e + 1])
        return out


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, H)
        self.moe = TinyMoE()
        self.head = nn.Linear(H, OUT)

    def forward(self, x):
        return self.head(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def moe_net() -> MoENet:
    torch.manual_seed(0)
    return MoENet()


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)  # an expert left out has no gradient: no change


@case
def case_leaf_moe(rank, world):
    """A mixture of experts whose experts differ between ranks trains at stage 3 once its
    block is a leaf (marked with shardtrain.utils.set_z3_leaf_modules, DeepSpeed's call)."""
    from shardtrain.utils import set_z3_leaf_modules
    x, y = make_data(4, 1, world, 6, seed=5)
    model = moe_net()
    set_z3_leaf_modules(model, [TinyMoE])
    engine, *_ = shardtrain.initialize(model=model, optimizer=sgd, config={
        "train_micro_batch_size_per_gpu": 6, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    losses, experts = [], []
    for s in range(x.shape[0]):
        with torch.no_grad(), GatheredParameters(list(engine.module.inp.parameters())
                                                 + list(engine.module.moe.gate.parameters())):
            h = torch.tanh(engine.module.inp(x[s, 0, rank]))  # the experts this rank will run
            experts.append(sorted(set(engine.module.moe.gate(h).argmax(-1).tolist())))
        out = engine(x[s, 0, rank])
        loss = F.cross_entropy(out, y[s, 0, rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _state(engine.module), "experts": experts}


def run_all(rank: int, world_size: int, only: Optional[List[str]] = None) -> Dict[str, Any]:
    return run_cases(CASES, rank, world_size, only)

"""Muon (``"type": "Muon"``) at ZeRO stages 0-3 on 2 ranks against a plain single-process Muon +
AdamW written here (DeepSpeed 0.19.8's formulas, fp32), on the same global batch: per-step
losses and the parameters after each step; the parameter split; a stage-2 checkpoint resumed
at stage 2 and at stage 0."""
from __future__ import annotations

import math
import tempfile
from typing import Any, Dict, List

import torch

import shardtrain
from shardtrain import comm
from shardtrain.zero import GatheredParameters

MICRO, ACCUM, STEPS, WORLD = 2, 2, 3, 2
CLIP, WD, MUON_LR, ADAM_LR, BETAS, EPS, MOMENTUM = 0.5, 0.01, 0.05, 0.01, (0.9, 0.95), 1e-8, 0.9


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 5)

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.norm(self.fc1(self.embed(tokens).mean(1)))))


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def batches():
    g = torch.Generator().manual_seed(1)
    glob = MICRO * ACCUM * WORLD
    return [(torch.randint(0, 11, (glob, 3), generator=g), torch.randn(glob, 5, generator=g))
            for _ in range(2 * STEPS)]


def loss_fn(model, tokens, target):
    return (model(tokens) - target).pow(2).mean()


def config(stage: int, accum: int = ACCUM, bf16: bool = False) -> Dict[str, Any]:
    # bf16: gradients reduced and accumulated in fp32, so that stages 0 and 2 sum alike
    fp32_grads = {"communication_data_type": "fp32",
                  "data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum,
            "bf16": {"enabled": bf16}, **fp32_grads,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "Muon", "params": {
                "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM,
                "weight_decay": WD, "betas": list(BETAS), "eps": EPS}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


# -- the reference: one process, the whole batch, Muon and AdamW written out -----------------

def newton_schulz(u: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    x = x.T if u.shape[0] > u.shape[1] else x
    return x * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))


def is_muon(name: str, p: torch.Tensor) -> bool:
    return p.ndim >= 2 and "embed" not in name and "lm_head" not in name


def reference(data, steps: int) -> List[Dict[str, Any]]:
    model = build()
    state: Dict[str, Dict[str, torch.Tensor]] = {}
    out = []
    for step, (tokens, target) in enumerate(data[:steps], start=1):
        model.zero_grad()
        loss = loss_fn(model, tokens, target)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        coef = min(1.0, CLIP / (float(norm) + 1e-6))
        with torch.no_grad():
            for n, p in model.named_parameters():
                g, s = grads[n] * coef, state.setdefault(n, {})
                if is_muon(n, p):
                    buf = s.setdefault("m", torch.zeros_like(p))
                    buf.mul_(MOMENTUM).add_(g, alpha=1 - MOMENTUM)
                    u = (1 - MOMENTUM) * g + MOMENTUM * buf
                    p.mul_(1 - MUON_LR * WD).sub_(MUON_LR * newton_schulz(u))
                else:
                    m = s.setdefault("m", torch.zeros_like(p))
                    v = s.setdefault("v", torch.zeros_like(p))
                    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                    v.mul_(BETAS[1]).add_(g * g, alpha=1 - BETAS[1])
                    mh, vh = m / (1 - BETAS[0] ** step), v / (1 - BETAS[1] ** step)
                    p.mul_(1 - ADAM_LR * WD).sub_(ADAM_LR * mh / (vh.sqrt() + EPS))
        out.append({"loss": loss.item(), "params": {n: p.detach().clone()
                                                    for n, p in model.named_parameters()}})
    return out


# -- the engine on 2 ranks -------------------------------------------------------------------

def train(engine, data, rank: int, world: int = WORLD) -> List[float]:
    """Each step's global batch, cut into micro-batches over ``world`` ranks."""
    losses, accum = [], ACCUM * WORLD // world
    for tokens, target in data:
        total = 0.0
        for k in range(accum):
            lo = (k * world + rank) * MICRO
            loss = loss_fn(engine, tokens[lo:lo + MICRO], target[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            total += float(loss)
        summed = torch.tensor([total / accum])
        comm.all_reduce(summed)
        losses.append(float(summed) / world)
    return losses


def full_params(engine) -> Dict[str, torch.Tensor]:
    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def check_stage(stage: int, rank: int, data, ref) -> Dict[str, Any]:
    engine, optimizer, _, _ = shardtrain.initialize(model=build(), config=config(stage))
    split = [g["use_muon"] for g in optimizer.param_groups]
    muon_numel = sum(p.numel() for g in optimizer.param_groups if g["use_muon"]
                     for p in g["params"])
    losses, diffs = [], []
    for step in range(STEPS):
        losses += train(engine, data[step:step + 1], rank)
        diffs.append(max_diff(full_params(engine), ref[step]["params"]))
    engine.destroy()
    return {"losses": losses, "diffs": diffs, "split": split, "muon_numel": muon_numel}


def check_resume(rank: int, data, directory: str) -> Dict[str, Any]:
    engine, _, _, _ = shardtrain.initialize(model=build(), config=config(2))
    train(engine, data[:STEPS], rank)
    engine.save_checkpoint(directory, tag="t")
    train(engine, data[STEPS:], rank)
    want = full_params(engine)
    engine.destroy()
    out = {}
    for stage in (2, 0):
        other, _, _, _ = shardtrain.initialize(model=build(), config=config(stage))
        other.load_checkpoint(directory, tag="t")
        train(other, data[STEPS:], rank)
        out[stage] = max_diff(full_params(other), want)
        other.destroy()
    return {"diffs": out, "want": want}


def resume_alone(rank: int, world_size: int, directory: str) -> Dict[str, torch.Tensor]:
    """The stage-2 checkpoint of 2 ranks resumed on 1 rank (stage 1), trained as before."""
    data = batches()
    engine, _, _, _ = shardtrain.initialize(
        model=build(), config=config(1, accum=ACCUM * WORLD // world_size))
    engine.load_checkpoint(directory, tag="t")
    train(engine, data[STEPS:], rank, world_size)
    got = full_params(engine)
    engine.destroy()
    return got


def check_bf16(rank: int, data) -> float:
    """bf16 parameters with fp32 masters: stage 2's update is stage 0's (the same gradients,
    reduced in fp32, in; the same fp32 Muon step on the masters)."""
    params = []
    for stage in (0, 2):
        engine, _, _, _ = shardtrain.initialize(model=build(), config=config(stage, bf16=True))
        train(engine, data[:STEPS], rank)
        params.append({n: p.float() for n, p in full_params(engine).items()})
        engine.destroy()
    return max_diff(params[0], params[1])


def check_offload_refused() -> str:
    cfg = config(2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    try:
        shardtrain.initialize(model=build(), config=cfg)
    except NotImplementedError as error:
        return str(error)
    return "accepted"


def run_all(rank: int, world_size: int) -> Dict[str, Any]:
    data = batches()
    ref = reference(data, STEPS)
    out: Dict[str, Any] = {"ref_losses": [r["loss"] for r in ref]}
    for stage in (0, 1, 2, 3):
        out[stage] = check_stage(stage, rank, data, ref)
    shared = comm.broadcast_object(tempfile.mkdtemp(prefix="muon-ckpt-") if rank == 0 else None)
    out["resume"] = check_resume(rank, data, shared)
    out["directory"] = shared
    out["bf16"] = check_bf16(rank, data)
    out["offload"] = check_offload_refused()
    return out

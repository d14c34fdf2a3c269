"""The mixture-of-experts layer over ranks: its experts split over an expert-parallel group of
2 (tokens travel by all-to-all), against the same layer with every expert in one process,
applied to each rank's tokens in turn with the same random draws (the gating rule routes
each rank's tokens on their own). Also the engine with a layer of ``ep_size`` 1 (experts on
every rank) against single-process training, and the refusal of ``ep_size`` 2 in training."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

import shardtrain
from shardtrain import comm
from shardtrain.moe import MoE

M, E, B, T = 8, 4, 2, 5


def layer(ep: int, **cfg: Any) -> MoE:
    """The layer with distinct experts: global expert ``e`` initialised from seed ``1000 + e``
    whichever rank holds it; the router (and the residual parts) from seed 0."""
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(M, 2 * M), torch.nn.GELU(),
                                 torch.nn.Linear(2 * M, M))
    moe = MoE(M, expert, num_experts=E, ep_size=ep, **cfg)
    if ep > 1:
        moe.set_deepspeed_parallelism()
    for local, e in zip(moe.deepspeed_moe.experts.deepspeed_experts, moe.global_expert_ids):
        torch.manual_seed(1000 + e)
        for p in local.parameters():
            p.data.normal_(0, 0.5)
    return moe


def tokens(world: int) -> torch.Tensor:
    return torch.randn(world * B, T, M, generator=torch.Generator().manual_seed(7))


def run_layer(moe: MoE, x: torch.Tensor, rank: int, proj: torch.Tensor):
    moe.deepspeed_moe.gate.generator = torch.Generator().manual_seed(100 + rank)
    out, l_aux, counts = moe(x)
    ((out * proj).sum() + 0.1 * l_aux).backward()
    return out.detach(), l_aux.detach(), counts


def case_layer(**cfg: Any) -> Callable[[int, int], Dict[str, Any]]:
    def case(rank: int, world: int) -> Dict[str, Any]:
        x, proj = tokens(world), torch.randn(M, generator=torch.Generator().manual_seed(8))
        split, whole = layer(world, **cfg), layer(1, **cfg)
        mine = slice(rank * B, (rank + 1) * B)
        got = run_layer(split, x[mine], rank, proj)
        ref = [run_layer(whole, x[r * B:(r + 1) * B], r, proj) for r in range(world)]
        out: Dict[str, Any] = {
            "out": (got[0] - ref[rank][0]).abs().max().item(),
            "l_aux": abs(got[1].item() - ref[rank][1].item()),
            "counts": (got[2].tolist(), ref[rank][2].tolist()),
            "dropped": int((got[0].abs().sum(-1) == 0).sum())}
        # each expert's gradient on the rank that holds it: all ranks' tokens' contributions
        diffs = [(p.grad - whole.deepspeed_moe.experts.deepspeed_experts[e].get_parameter(n).grad)
                 .abs().max().item()
                 for local, e in zip(split.deepspeed_moe.experts.deepspeed_experts,
                                     split.global_expert_ids)
                 for n, p in local.named_parameters()]
        out["experts"] = max(diffs)
        # the replicated parts: their gradients summed over the ranks
        dense, same = [], dict(whole.named_parameters())
        for n, p in split.named_parameters():
            if "deepspeed_experts" in n:
                continue
            g = p.grad.clone()
            comm.all_reduce(g)
            dense.append((g - same[n].grad).abs().max().item())
        out["dense"] = max(dense)
        return out
    return case


def case_engine_ep1(rank: int, world: int) -> Dict[str, List[float]]:
    """ZeRO-2 with a layer of ep_size 1 in the model, against one process on the global batch
    (the task loss alone: the load-balancing loss is a statistic of each rank's tokens), both
    clipped at the global norm 1.0."""
    def model():
        torch.manual_seed(0)
        moe = layer(1, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
        return torch.nn.ModuleDict({"moe": moe, "head": torch.nn.Linear(M, 1)})

    def loss_of(net, x, y):
        out, _, _ = net["moe"](x)
        return torch.nn.functional.mse_loss(net["head"](out).squeeze(-1), y)

    x, y = tokens(world), torch.randn(world * B, T, generator=torch.Generator().manual_seed(9))
    config = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    engine, *_ = shardtrain.initialize(model=model(), config=config)
    mine = slice(rank * B, (rank + 1) * B)
    losses = []
    for _ in range(3):
        loss = loss_of(engine.module, x[mine], y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(_mean(loss.detach(), world))
    got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    ref_net = model()
    opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-2, weight_decay=0.0)
    ref_losses = []
    for _ in range(3):
        loss = loss_of(ref_net, x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 1.0)  # the config's default clip
        opt.step()
        ref_losses.append(loss.item())
    diff = max((got[n] - p.detach()).abs().max().item() for n, p in ref_net.named_parameters())
    return {"losses": losses, "ref_losses": ref_losses, "weights": diff}


def _mean(loss: torch.Tensor, world: int) -> float:
    t = loss.clone()
    comm.all_reduce(t)
    return t.item() / world


def case_engine_refuses_ep2(rank: int, world: int) -> str:
    try:
        shardtrain.initialize(model=torch.nn.Sequential(layer(2)),
                              config={"train_micro_batch_size_per_gpu": B})
    except NotImplementedError as err:
        return str(err)
    return ""


def all_cases(rank: int, world_size: int) -> Dict[str, Any]:
    from _dist import run_cases
    cases = {
        "top1_rts": case_layer(k=1, min_capacity=0),
        "top1_first": case_layer(k=1, min_capacity=0, use_rts=False, capacity_factor=0.5),
        "top1_dropless": case_layer(k=1, drop_tokens=False),
        "top2": case_layer(k=2, min_capacity=0, capacity_factor=0.5,
                           top2_2nd_expert_sampling=False),
        "top2_sampled_residual": case_layer(k=2, drop_tokens=False, use_residual=True,
                                            noisy_gate_policy="Jitter"),
        "engine_ep1": case_engine_ep1, "refuses_ep2": case_engine_refuses_ep2}
    return run_cases(cases, rank, world_size)

"""The mixture-of-experts layer over ranks: its experts split over an expert-parallel group of
2 (tokens travel by all-to-all), against the same layer with every expert in one process,
applied to each rank's tokens in turn with the same random draws (the gating rule routes
each rank's tokens on their own). Also the engine training a layer with every expert on every
rank and one split over the ranks, at ZeRO stages 0-2, against single-process training, and
what it refuses with split experts."""
from __future__ import annotations

import tempfile
from typing import Any, Callable, Dict

import torch

import shardtrain
from shardtrain import comm
from shardtrain.layout import layout_of
from shardtrain.moe import MoE, find_expert_groups

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
        split, whole = layer(2, **cfg), layer(1, **cfg)
        mine = slice(rank * B, (rank + 1) * B)
        got = run_layer(split, x[mine], rank, proj)
        ref = [run_layer(whole, x[r * B:(r + 1) * B], r, proj) for r in range(world)]
        out: Dict[str, Any] = {
            "out": (got[0] - ref[rank][0]).abs().max().item(),
            "l_aux": abs(got[1].item() - ref[rank][1].item()),
            "counts": (got[2].tolist(), ref[rank][2].tolist()),
            "dropped": int((got[0].abs().sum(-1) == 0).sum())}
        # each expert's gradient on the rank that holds it (all its expert-parallel group's
        # tokens' contributions), summed over the ranks holding the same experts
        diffs = []
        for local, e in zip(split.deepspeed_moe.experts.deepspeed_experts,
                            split.global_expert_ids):
            for n, p in local.named_parameters():
                g = p.grad.clone()
                comm.all_reduce(g, group=split.groups.edp)
                ref_grad = whole.deepspeed_moe.experts.deepspeed_experts[e].get_parameter(n).grad
                diffs.append((g - ref_grad).abs().max().item())
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


class Net(torch.nn.Module):
    """A MoE layer and a head."""

    def __init__(self, ep: int):
        super().__init__()
        torch.manual_seed(0)
        self.moe = layer(ep, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
        torch.manual_seed(1)
        self.head = torch.nn.Linear(M, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _, _ = self.moe(x)
        return self.head(out).squeeze(-1)


def _model(ep: int) -> Net:
    return Net(ep)


def _loss(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y)


def case_engine(stage: int, ep: int, bf16: bool = False) -> Callable[[int, int], Dict[str, Any]]:
    """The engine at ``stage`` with a layer of ``ep_size`` ``ep``, against one process on the
    global batch with every expert (the task loss alone: the load-balancing loss is a
    statistic of each rank's tokens), both clipped at the global norm 1.0: losses, and each
    weight against the one-process weight of the same global expert."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        x, y = _batches(world)
        config = {"train_micro_batch_size_per_gpu": B,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
                  "bf16": {"enabled": bf16}}
        engine, *_ = shardtrain.initialize(model=_model(ep), config=config)
        held = []  # after the last backward: every model state exists

        def probe(step: int) -> None:
            if step == 2:
                held.append(engine.model_state_bytes()["total"])
        losses, norms = _train(engine, x, y, rank * B, world, 3, probe)
        moe = engine.module.moe
        split = [p for p in engine.module.parameters() if layout_of(p).expert is not None]
        numel = {"dense": sum(layout_of(p).numel for p in engine.module.parameters()
                              if layout_of(p).expert is None),
                 "experts": sum(layout_of(p).numel for p in split), "bytes": held[0]}
        got = {_global_name(n, moe): v.detach().float().clone()  # stage 3: gathered
               for n, v in engine.module.state_dict().items()}
        engine.destroy()
        ref_losses, ref_norms, ref_weights = _one_process(_model(1), x, y, 3)
        diff = max((p - ref_weights[-1][n]).abs().max().item() for n, p in got.items())
        return {"losses": losses, "ref_losses": ref_losses, "norms": norms,
                "ref_norms": ref_norms, "weights": diff, "checked": len(got), "memory": numel}
    return case


def _batches(world: int):
    """The global batch: inputs and targets of every rank's micro-batch."""
    return tokens(world), torch.randn(world * B, T, generator=torch.Generator().manual_seed(9))


def _train(engine, x, y, first: int, world: int, steps: int, probe=None):
    """``steps`` steps of the engine on this rank's ``B`` rows from ``first``: the global
    batch's losses (the mean over ranks) and the clipped global norms."""
    losses, norms = [], []
    for step in range(steps):
        loss = _loss(engine, x[first:first + B], y[first:first + B])
        engine.backward(loss)
        if probe is not None:
            probe(step)
        engine.step()
        losses.append(_mean(loss.detach(), world))
        norm = engine.get_global_grad_norm()  # None when nothing clips
        norms.append(None if norm is None else float(norm))
    return losses, norms


def _one_process(net, x, y, steps: int, clip: float = 1.0):
    """The reference: ``net`` trained on the global batch in this process with the configs'
    AdamW (lr 1e-2, no weight decay), clipped at ``clip`` (0: not clipped); the losses, the
    norms and the weights after each step."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    losses, norms, weights = [], [], []
    for _ in range(steps):
        loss = _loss(net, x, y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(),
                                                          clip or float("inf"))))
        opt.step()
        losses.append(loss.item())
        weights.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, norms, weights


def case_checkpoint(saved_with=(2, 2), loads=(("split_s1", 2, 1), ("dense_s3", 1, 3))):
    """Two steps with ``saved_with`` (ep_size, stage), saved; loaded by an engine of each of
    ``loads`` (name, ep_size, stage), each training the third step; the checkpoint
    consolidated into one model's weights."""
    def case(rank: int, world: int) -> Dict[str, Any]:
        return _checkpoint(rank, world, saved_with, loads)
    return case


def _checkpoint(rank: int, world: int, saved_with, loads) -> Dict[str, Any]:
    from shardtrain.checkpoint import full_weights
    x, y = _batches(world)
    ref_losses, _, ref_weights = _one_process(_model(1), x, y, 3)
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="moe-ckpt-") if rank == 0 else "")

    def engine_for(ep: int, stage: int):
        config = {"train_micro_batch_size_per_gpu": B,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
        return shardtrain.initialize(model=_model(ep), config=config)[0]

    engine = engine_for(*saved_with)
    first, _ = _train(engine, x, y, rank * B, world, 2)
    engine.save_checkpoint(root, tag="two")
    engine.save_16bit_model(root, "model.safetensors")  # every expert, whole
    engine.destroy()
    out: Dict[str, Any] = {"first": first, "ref_losses": ref_losses,
                           "16bit": _against(_read(f"{root}/model.safetensors"), ref_weights[1])}
    for name, ep, stage in loads:
        resumed = engine_for(ep, stage)
        resumed.load_checkpoint(root, tag="two")
        out[name] = _train(resumed, x, y, rank * B, world, 1)[0][0]
        resumed.destroy()
    out["names"], out["weights"] = _against(full_weights(root, tag="two"), ref_weights[1])
    return out


def case_frozen_experts(rank: int, world: int) -> Dict[str, Any]:
    """The experts frozen and split over the ranks (ZeRO-2): saved under their global names
    and loaded back, into every expert on every rank (ZeRO-0) from other starting values,
    equal to the saving engine's."""
    x, y = _batches(world)
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="moe-frozen-") if rank == 0 else "")

    def frozen(ep: int, shift: float) -> Net:
        net = _model(ep)
        for p in net.moe.deepspeed_moe.experts.parameters():
            p.requires_grad_(False)
            p.data.add_(shift)
        return net

    config = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = shardtrain.initialize(model=frozen(world, 0.0), config=config)[0]
    _train(engine, x, y, rank * B, world, 2)
    engine.save_checkpoint(root, tag="t")
    engine.save_16bit_model(root, "model.safetensors")
    engine.destroy()
    want = _read(f"{root}/model.safetensors")  # every expert, under its global name
    config["zero_optimization"]["stage"] = 0
    resumed = shardtrain.initialize(model=frozen(1, 1.0), config=config)[0]
    resumed.load_checkpoint(root, tag="t")
    got = {n: v.detach() for n, v in resumed.module.state_dict().items()}
    resumed.destroy()
    return {"names": sorted(got) == sorted(want),
            "weights": max((got[n] - w).abs().max().item() for n, w in want.items())}


def _read(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(path)


def _against(weights: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]):
    """Whether ``weights`` has ``ref``'s names, and the largest difference."""
    return (sorted(weights) == sorted(ref),
            max((weights[n].float() - w).abs().max().item() for n, w in ref.items()))


def case_pretrained(rank: int, world: int) -> Dict[str, Any]:
    """The whole model's weights in a safetensors file (every expert under its global name,
    other values than the engine's model starts from), loaded by ``load_pretrained`` into an
    engine with the experts split over the ranks: each local expert gets its global expert's."""
    from safetensors.torch import save_file
    from shardtrain.pretrained import load_pretrained
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="moe-hf-") if rank == 0 else "")
    whole = _model(1)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(1.0)
    want = {n: v.clone() for n, v in whole.state_dict().items()}
    if rank == 0:
        save_file(want, f"{root}/model.safetensors")
    comm.barrier()
    config = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = shardtrain.initialize(model=_model(world), config=config)[0]
    loaded = load_pretrained(engine, root)
    moe = engine.module.moe
    got = {_global_name(n, moe): v for n, v in engine.module.state_dict().items()}
    engine.destroy()
    return {"missing": loaded.missing_keys, "unexpected": loaded.unexpected_keys,
            "weights": max((v - want[n]).abs().max().item() for n, v in got.items())}


def _global_name(name: str, moe: MoE) -> str:
    """A local expert's parameter name under its global expert index."""
    marker = "deepspeed_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    local, rest = tail.split(".", 1)
    return f"{head}{marker}{moe.global_expert_ids[int(local)]}.{rest}"


def _mean(loss: torch.Tensor, world: int) -> float:
    t = loss.clone()
    comm.all_reduce(t)
    return t.item() / world


def case_deepspeed_script(rank: int, world: int) -> Dict[str, Any]:
    """DeepSpeed's MoE pattern (DeepSpeedExamples' CIFAR-10 script with --moe
    --moe-param-group): deepspeed.moe.layer.MoE with ep_size 2, the parameters split into
    expert groups by deepspeed.moe.utils, deepspeed.initialize at ZeRO-2; against one process
    with every expert and torch's AdamW on one group."""
    import deepspeed
    from deepspeed.moe.layer import MoE as DSMoE
    from deepspeed.moe.utils import (is_moe_param,
                                     split_params_into_different_moe_groups_for_optimizer)

    class Net(torch.nn.Module):
        def __init__(self, ep: int):
            super().__init__()
            torch.manual_seed(0)
            self.fc1 = torch.nn.Linear(M, M)
            self.moe = DSMoE(hidden_size=M, expert=torch.nn.Linear(M, M), num_experts=E,
                             ep_size=ep, k=1, drop_tokens=False, use_rts=False)
            self.fc3 = torch.nn.Linear(M, 1)
            local = self.moe.deepspeed_moe.experts.deepspeed_experts
            first = rank % ep * len(local)  # this rank's experts, distinct ones
            for e, expert in enumerate(local, start=first):
                torch.manual_seed(1000 + e)
                for p in expert.parameters():
                    p.data.normal_(0, 0.5)

        def forward(self, x):
            out, _, _ = self.moe(torch.relu(self.fc1(x)))
            return self.fc3(out).squeeze(-1)

    x, y = _batches(world)
    net = Net(2)
    parameters = {"params": [p for p in net.parameters() if p.requires_grad],
                  "name": "parameters"}
    groups = split_params_into_different_moe_groups_for_optimizer(parameters)
    config = {"train_batch_size": B * world, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "gradient_clipping": 0.0}
    engine, optimizer, _, _ = deepspeed.initialize(model=net, model_parameters=groups,
                                                   config=config)
    losses, _ = _train(engine, x, y, rank * B, world, 3)
    names = [g.get("name") for g in optimizer.param_groups]
    moe_groups = [bool(g.get("moe")) for g in optimizer.param_groups]
    expert_params = sum(is_moe_param(p) for p in net.parameters())
    engine.destroy()
    ref_losses, _, _ = _one_process(Net(1), x, y, 3, clip=0.0)
    return {"losses": losses, "ref_losses": ref_losses, "names": names, "moe": moe_groups,
            "expert_params": expert_params}


def case_refusals(rank: int, world: int) -> Dict[str, str]:
    out = {}
    for name, stage, action in (("deepcompile", 1, "compile"),):
        try:
            config = {"train_micro_batch_size_per_gpu": B,
                      "zero_optimization": {"stage": stage},
                      "compile": {"deepcompile": action == "compile"},
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
            engine, *_ = shardtrain.initialize(model=_model(world), config=config)
            try:
                engine.compile(backend="aot_eager")
                out[name] = ""
            finally:
                engine.destroy()
        except NotImplementedError as err:
            out[name] = str(err)
    return out


def case_lookups(rank: int, world: int) -> Dict[str, Any]:
    """DeepSpeed's expert-group lookups (deepspeed.utils.groups) for a layer of ep_size 2."""
    from shardtrain.deepspeed.utils import groups
    layer(2)
    name = "ep_size_2"
    return {"ep": (groups._get_expert_parallel_world_size(name),
                   groups._get_expert_parallel_rank(name)),
            "edp": (groups._get_expert_data_parallel_world_size(name),
                    groups._get_expert_data_parallel_rank(name)),
            "ranks": (find_expert_groups(name).ep.ranks(), find_expert_groups(name).edp.ranks())}


class NetTP(torch.nn.Module):
    """A dense MLP that AutoTP splits (column, then row), a MoE layer and a head."""

    def __init__(self, ep: int, ep_rank: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.fc_in, self.fc_out = torch.nn.Linear(M, 2 * M), torch.nn.Linear(2 * M, M)
        self.moe = MoE(M, torch.nn.Linear(M, M), num_experts=E, ep_size=ep, k=2,
                       drop_tokens=False, top2_2nd_expert_sampling=False)
        local = self.moe.deepspeed_moe.experts.deepspeed_experts
        for e, expert in enumerate(local, start=ep_rank * len(local)):
            torch.manual_seed(1000 + e)
            for p in expert.parameters():
                p.data.normal_(0, 0.5)
        torch.manual_seed(1)
        self.head = torch.nn.Linear(M, 1)

    def forward(self, x):
        h = x + self.fc_out(torch.relu(self.fc_in(x)))
        out, _, _ = self.moe(h)
        return self.head(out).squeeze(-1)


def case_tp2_ep2(rank: int, world: int) -> Dict[str, Any]:
    """tensor parallel 2 x data parallel 2, the experts split over the 2 data-parallel ranks of
    each tensor-parallel coordinate (ep 2), ZeRO-2: against one process on the global batch;
    then a checkpoint of it loaded with every expert on every rank and no tensor parallelism."""
    specs = [{"patterns": [r".*fc_in\.weight$"], "partition_type": "column"},
             {"patterns": [r".*fc_out\.weight$"], "partition_type": "row"}]
    config = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": specs}}}
    dp, tp = rank // 2, rank % 2
    engine, *_ = shardtrain.initialize(model=NetTP(2, ep_rank=dp), config=config)
    x, y = _batches(2)
    # the two ranks of a tensor-parallel group read one micro-batch
    losses, _ = _train(engine, x, y, dp * B, world, 3)
    groups = engine.module.moe.groups
    out = {"losses": losses, "ep": groups.ep.ranks(), "replicas": groups.replicas.ranks(),
           "tp": tp, "fc_in": list(engine.module.fc_in.weight.shape)}
    root = comm.broadcast_object(tempfile.mkdtemp(prefix="moe-tp-") if rank == 0 else "")
    engine.save_checkpoint(root, tag="t")
    engine.destroy()
    from shardtrain.checkpoint import full_weights
    out["ref_losses"], _, ref_weights = _one_process(NetTP(1), x, y, 3)
    weights = full_weights(root, tag="t")
    out["weights"] = max((weights[n].float() - w).abs().max().item()
                         for n, w in ref_weights[-1].items())
    return out


def four_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    """ep 2 x expert-data-parallel 2: experts summed over their replicas as well."""
    from _dist import run_cases
    cases = {"top2": case_layer(k=2, min_capacity=0, capacity_factor=0.5,
                                top2_2nd_expert_sampling=False), "lookups": case_lookups,
             # saved with 2 replicas of each expert; loaded with each expert on one rank
             "checkpoint": case_checkpoint((2, 2), (("ep4_s1", 4, 1), ("dense_s0", 1, 0))),
             "tp2_ep2": case_tp2_ep2}
    cases.update({f"engine_s{stage}_ep2": case_engine(stage, 2) for stage in (0, 2, 3)})
    return run_cases(cases, rank, world_size)


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
        "refusals": case_refusals, "checkpoint": case_checkpoint(),
        "deepspeed_script": case_deepspeed_script, "pretrained": case_pretrained,
        "frozen_experts": case_frozen_experts}
    cases.update({f"engine_s{stage}_ep{ep}": case_engine(stage, ep)
                  for stage, ep in ((2, 1), (0, 2), (1, 2), (2, 2), (3, 2))})
    cases.update(engine_s2_ep2_bf16=case_engine(2, 2, bf16=True),
                 engine_s2_ep1_bf16=case_engine(2, 1, bf16=True))
    return run_cases(cases, rank, world_size)

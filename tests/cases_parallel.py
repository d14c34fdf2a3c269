"""Rank bodies for test_parallel.py: the engine on a device mesh (tensor- and sequence-parallel
ranks composed with ZeRO's data parallelism) against plain single-process training of the same
model on the same global batch.

Each case trains a tiny model through ``shardtrain.initialize`` with ``training_data=``: the
collate function records every batch this rank's loader handed out (before the
sequence-parallel slicing), so the reference can train on exactly the global batches the
data-parallel ranks read. The reference of a step is the mean over data-parallel replicas and
micro-steps of each replica's loss, as data parallelism without a mesh defines it.

Adam's ``eps`` is 1e-6: a split layer sums its products in another order, and an element whose
gradient is near ``eps`` turns that last-bit difference into a visible update difference with
torch's default of 1e-8 (``lr / (4 eps)`` times the rounding); the losses and the global norm
are compared as they are.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Set

import torch
from torch.utils.data import default_collate

from _dist import run_cases
import shardtrain
from shardtrain import comm
from shardtrain.full_weights import full_state_dict

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 2, 128, 16


def llama(**overrides: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    fields = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                  max_position_embeddings=64, attn_implementation="sdpa")
    fields.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**fields))


class Tokens(torch.utils.data.Dataset):
    """Random token rows with causal-LM labels; some rows have a prompt without targets, so
    the valid tokens differ between rows and between slices of a row."""

    def __init__(self, rows: int = 32, seq: int = SEQ, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        self.prompt = torch.randint(0, seq - 2, (rows,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: int(self.prompt[i]) * (i % 2)] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def config(stage: int, micro: int = 2, gas: int = 2, **extra: Any) -> Dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0.5, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.01, "eps": 1e-6}}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    cfg.update(extra)
    return cfg


def hf_loss(model: Callable, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def gpt_loss(model: Callable, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["input_ids"], batch["labels"].clamp(min=0))


def train(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], steps: int,
          loss_of: Callable = hf_loss, **init: Any) -> Dict[str, Any]:
    """Trains through the engine; returns the losses, the batches read, the full weights."""
    seen: List[Dict[str, torch.Tensor]] = []

    def collate(items):
        batch = default_collate(items)
        seen.append({k: v.clone() for k, v in batch.items()})
        return batch

    engine, *_ = shardtrain.initialize(model=build(), config=cfg, training_data=Tokens(),
                                       collate_fn=collate, **init)
    batches = iter(engine.training_dataloader)
    losses, shapes = [], []
    wire: Set[str] = set()  # the dtypes gradients were reduced in (the larger reductions)

    def reductions(op: str, tensor: torch.Tensor) -> None:
        if op in ("all_reduce", "reduce_scatter") and tensor.numel() >= 1024:
            wire.add(str(tensor.dtype).replace("torch.", ""))

    comm.add_observer(reductions)
    try:
        for _ in range(steps * engine.gradient_accumulation_steps()):
            batch = next(batches)
            shapes.append(tuple(batch["input_ids"].shape))
            loss = loss_of(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        comm.remove_observer(reductions)
    weights = {k: v.float().clone() for k, v in full_state_dict(engine.module, rank=None).items()}
    out = {"losses": losses, "seen": seen, "shapes": shapes, "weights": weights,
           "coordinate": engine.mesh.coordinate(), "dp": engine.dp_world_size,
           "norm": engine.get_global_grad_norm(), "wire": sorted(wire),
           "sizes": {name: getattr(engine, name) for name in (
               "world_size", "dp_world_size", "mp_world_size", "sequence_parallel_size",
               "seq_dp_world_size")},
           "comm_dtype": str(engine.communication_data_type).replace("torch.", "")}
    engine.destroy()
    return out


def reference(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any],
              replicas: List[List[Dict[str, torch.Tensor]]], loss_of: Callable = hf_loss
              ) -> Dict[str, Any]:
    """Single-process training on the global batches: ``replicas[d]`` is the list of batches
    data-parallel replica ``d`` read, in order."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **cfg["optimizer"]["params"])
    gas, dp = cfg["gradient_accumulation_steps"], len(replicas)
    losses: List[List[float]] = [[] for _ in range(dp)]
    norm = None
    for step in range(len(replicas[0]) // gas):
        for micro in range(gas):
            for d in range(dp):
                loss = loss_of(model, replicas[d][step * gas + micro])
                (loss / (gas * dp)).backward()
                losses[d].append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"]).item()
        opt.step()
        opt.zero_grad()
    weights = {k: v.float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "norm": norm}


def compare(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], steps: int = 2,
            loss_of: Callable = hf_loss, **init: Any) -> Dict[str, Any]:
    """This rank's training against the reference on the batches every replica read
    (``init``: more arguments for ``shardtrain.initialize``)."""
    try:
        got = train(build, cfg, steps, loss_of, **init)
    except Exception:  # every rank still meets the gather below, then all fail together
        comm.all_gather_object(None)
        raise
    every = comm.all_gather_object((got["coordinate"], got["seen"]))
    if any(e is None for e in every):
        raise RuntimeError("another rank failed in this case (see its output)")
    replicas: Dict[int, List] = {}
    same_in_group = True
    for coord, seen in every:
        if coord["dp"] in replicas:  # another rank of the same replica: the same samples
            same_in_group &= all(torch.equal(a["input_ids"], b["input_ids"])
                                 for a, b in zip(seen, replicas[coord["dp"]]))
        replicas.setdefault(coord["dp"], seen)
    ref = reference(build, cfg, [replicas[d] for d in sorted(replicas)], loss_of)
    mine = ref["losses"][got["coordinate"]["dp"]]
    loss_err = max(abs(a - b) for a, b in zip(got["losses"], mine))
    errs = {k: (got["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items()}
    worst = max(errs, key=errs.get)
    weight_err = errs[worst]
    return {"loss_err": loss_err, "weight_err": weight_err, "same_in_group": same_in_group,
            "norm_err": abs(got["norm"] - ref["norm"]), "shapes": got["shapes"],
            "replicas": len(replicas), "dp": got["dp"], "moved": _moved(ref["weights"], build),
            "norms": (got["norm"], ref["norm"]), "worst": worst, "wire": got["wire"],
            "comm_dtype": got["comm_dtype"], "sizes": got["sizes"]}


def _moved(weights: Dict[str, torch.Tensor], build: Callable[[], torch.nn.Module]) -> float:
    """How far training moved the weights (a parity check is only telling if they moved)."""
    start = build().state_dict()
    return max((weights[k] - v.float()).abs().max().item() for k, v in start.items())


# -- the cases --------------------------------------------------------------------------------

def sequence_parallel(rank: int, world_size: int, stages=(0, 1, 2, 3)) -> Dict[str, Any]:
    """``sequence_parallel_size: 2`` at each ZeRO stage (world 2: sp 2; world 4: dp 2 x sp 2)."""
    cases = {f"stage{s}": (lambda r, w, s=s: compare(llama, config(s, sequence_parallel_size=2)))
             for s in stages}
    return run_cases(cases, rank, world_size)


def gpt() -> torch.nn.Module:
    from gpt import GPT, gpt_config
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", n_head=4, vocab_size=VOCAB, block_size=SEQ))


#: layer_specs for the GPT example (DeepSpeed's partition_config form).
GPT_SPECS = [{"patterns": [r".*\.attn\.(query|key|value)\.(weight|bias)$"], "partition_type": "column"},
             {"patterns": [r".*\.attn\.proj\.weight$"], "partition_type": "row"},
             {"patterns": [r".*\.mlp\.fc\.weight$"], "partition_type": "column"},
             {"patterns": [r".*\.mlp\.proj\.weight$"], "partition_type": "row"}]
#: The Llama preset plus a vocabulary-parallel head (its loss never gathers the vocabulary).
HEAD_SPECS = [{"patterns": [r"lm_head\.weight$"], "partition_type": "column"}]


def tensor_parallel(rank: int, world_size: int, tp: int, stages=(0, 1, 2, 3)) -> Dict[str, Any]:
    """``tensor_parallel.autotp_size: tp`` at each ZeRO stage, for the GPT example with
    layer_specs and for Llama with the preset its model_type picks."""
    block = {"autotp_size": tp}
    # (key/value heads split too: tp 4 needs 4 of them)
    llama_tp = functools.partial(llama, num_key_value_heads=max(KV_HEADS, tp))
    gpt_block = {**block, "partition_config": {"layer_specs": GPT_SPECS}}
    cases: Dict[str, Callable] = {}
    for s in stages:
        cases[f"gpt_stage{s}"] = (lambda r, w, s=s: compare(
            gpt, config(s, tensor_parallel=gpt_block), loss_of=gpt_loss))
        cases[f"llama_stage{s}"] = (lambda r, w, s=s: compare(
            llama_tp, config(s, tensor_parallel=block)))
    cases["llama_head_split"] = lambda r, w: compare(llama_tp, config(
        1, tensor_parallel={**block, "partition_config": {"layer_specs": HEAD_SPECS}}))
    cases["llama_tied_head_split"] = lambda r, w: compare(
        functools.partial(llama_tp, tie_word_embeddings=True),
        config(2, tensor_parallel={**block, "partition_config": {"layer_specs": HEAD_SPECS}}))
    return run_cases(cases, rank, world_size)


class EvenTokens(Tokens):
    """Every token a target: every replica's loss is a mean over as many tokens, so the global
    batch's loss is the same however the data-parallel ranks divide it."""

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


MESHES = {"dp4": {}, "dp2xtp2": {"tensor_parallel": {"autotp_size": 2}},
          "tp4": {"tensor_parallel": {"autotp_size": 4}}, "dp2xsp2": {"sequence_parallel_size": 2},
          "tp2xsp2": {"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2}}


def _mesh_config(mesh: str, stage: int, bf16: bool = False) -> Dict[str, Any]:
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": stage}, **MESHES[mesh],
           "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "eps": 1e-6}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _steps(engine, steps: int, batches=None) -> List[float]:
    losses, batches = [], batches or iter(engine.training_dataloader)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(**next(batches)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _engine(mesh: str, stage: int, bf16: bool = False):
    build = functools.partial(llama, num_key_value_heads=4)  # tp 4 splits the kv heads too
    engine, *_ = shardtrain.initialize(model=build(), config=_mesh_config(mesh, stage, bf16),
                                       training_data=EvenTokens())
    return engine


def _global_losses(engine, losses: List[float]) -> List[float]:
    """Per optimizer step, the loss of the global batch (the mean over replicas and
    micro-steps: every replica's loss covers as many tokens)."""
    gas = engine.gradient_accumulation_steps()
    per_step = torch.tensor(losses).view(-1, gas).mean(1)
    comm.all_reduce(per_step, "avg")  # tensor- and sequence-parallel ranks hold their group's
    return per_step.tolist()


def resume_on_another_mesh(rank: int, world_size: int, save_dir: str, pairs, stages=(1, 3)
                           ) -> Dict[str, Any]:
    """Trains 2 steps on mesh A and saves, trains 2 more (the uninterrupted run); mesh B loads
    the checkpoint and trains the same 2 steps: its losses and weights must be A's. The files
    hold the unsplit model: ``full_weights`` (what ``consolidate`` writes) needs no mesh."""
    from shardtrain.checkpoint import full_weights
    out: Dict[str, Any] = {}
    for a, b in pairs:
        for stage in stages:
            name = f"{a}->{b}@{stage}"
            tag = name.replace(">", "").replace("@", "_s")
            first = _engine(a, stage)
            batches = iter(first.training_dataloader)
            _steps(first, 2, batches)
            first.save_checkpoint(save_dir, tag=tag)
            saved = {k: v.float().clone() for k, v in full_state_dict(first.module, rank=None).items()}
            after = _global_losses(first, _steps(first, 2, batches))
            want = {k: v.float().clone() for k, v in full_state_dict(first.module, rank=None).items()}
            first.destroy()
            second = _engine(b, stage)
            second.load_checkpoint(save_dir, tag=tag)
            got_losses = _global_losses(second, _steps(second, 2))
            got = {k: v.float() for k, v in full_state_dict(second.module, rank=None).items()}
            second.destroy()
            out[name] = {"loss_err": max(abs(x - y) for x, y in zip(after, got_losses)),
                         "weight_err": max((got[k] - v).abs().max().item() for k, v in want.items()),
                         "names": sorted(got) == sorted(want), "losses": (after, got_losses)}
            if rank == 0:
                files = full_weights(save_dir, tag=tag)
                out[name]["consolidated"] = sorted(files) == sorted(saved) and max(
                    (files[k].float() - v).abs().max().item() for k, v in saved.items()) < 1e-7
    return out


# -- the mesh's contract: refusals, bytes per rank, a user's groups, bf16 ----------------------

def _refusal(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any], **init: Any) -> Dict[str, Any]:
    """The error ``initialize`` raises, and whether the model it was given is left as it was."""
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        shardtrain.initialize(model=model, config=cfg, **init)
    except Exception as err:  # the message the user reads
        after = model.state_dict()
        untouched = sorted(after) == sorted(before) and all(
            torch.equal(after[k], v) for k, v in before.items())
        return {"error": f"{type(err).__name__}: {err}", "untouched": untouched}
    return {"error": None}


class UserMPU:
    """A user's own groups, DeepSpeed's ``mpu`` interface: model-parallel pairs of adjacent
    ranks, data-parallel ranks across them."""

    def __init__(self, rank: int, world_size: int, tp: int = 2):
        import torch.distributed as dist
        self._tp, self._dp = tp, world_size // tp
        for first in range(0, world_size, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                self.model = group
        for offset in range(tp):
            group = dist.new_group(list(range(offset, world_size, tp)))
            if rank % tp == offset:
                self.data = group
        self._rank = rank

    def get_model_parallel_group(self):
        return self.model

    def get_model_parallel_rank(self) -> int:
        return self._rank % self._tp

    def get_model_parallel_world_size(self) -> int:
        return self._tp

    def get_data_parallel_group(self):
        return self.data

    def get_data_parallel_rank(self) -> int:
        return self._rank // self._tp

    def get_data_parallel_world_size(self) -> int:
        return self._dp


def _param_bytes(mesh: str, stage: int) -> Dict[str, Any]:
    """The parameter bytes this rank holds against the formula: each split weight holds 1/tp
    of its elements; stage 3 keeps an even shard (padded to ``chunk_size``) over the
    data-parallel x sequence-parallel group of every parameter above the persistence
    threshold."""
    from shardtrain.zero._shards import chunk_size
    cfg = _mesh_config(mesh, stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 4096  # the norms stay whole
    engine, *_ = shardtrain.initialize(model=llama(num_key_value_heads=4), config=cfg)
    full = {n: p.numel() for n, p in llama(num_key_value_heads=4).named_parameters()}
    tp = engine.mesh.sizes["tp"]
    zero = engine.mesh.zero.size()
    threshold = engine.config.zero_optimization.param_persistence_threshold
    split = sorted(n for n, p in engine.module.named_parameters() if hasattr(p, "tp_split"))
    want = 0
    for name, n in full.items():
        local = n // tp if name in split else n
        want += chunk_size(local, zero) if stage == 3 and local > threshold else local
    got = engine.model_state_bytes()["params"]
    engine.destroy()
    return {"got": got, "want": want * 4, "split": split, "full": sum(full.values()) * 4}


def _pretrained_into(mesh: str, stage: int, path: str) -> Dict[str, Any]:
    """``load_pretrained`` into an engine already on ``mesh``: each rank keeps its slice (and
    at stage 3 its shard of it) of the file's unsplit tensors."""
    import os
    from shardtrain.pretrained import load_pretrained
    if comm.get_rank() == 0 and not os.path.exists(path):
        llama(num_key_value_heads=4).save_pretrained(path, safe_serialization=True)
    comm.barrier()
    model = llama(num_key_value_heads=4)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    for p in model.parameters():  # the engine starts from other weights
        torch.nn.init.normal_(p, std=0.5)
    engine, *_ = shardtrain.initialize(model=model, config=_mesh_config(mesh, stage))
    load_pretrained(engine, path)
    got = full_state_dict(engine.module, rank=None)
    ids = torch.arange(16).view(1, 16) % VOCAB
    loss = engine(input_ids=ids, labels=ids).loss.item()
    engine.destroy()
    ref = llama(num_key_value_heads=4)(input_ids=ids, labels=ids).loss.item()
    return {"err": max((got[k].float() - v).abs().max().item() for k, v in want.items()),
            "names": sorted(got) == sorted(want), "loss_err": abs(loss - ref)}


def _zero_init_then_tp() -> Dict[str, Any]:
    with shardtrain.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = llama()
    before = {n: (type(m), [p.ds_tensor.clone() for p in m.parameters(recurse=False)])
              for n, m in model.named_modules()}
    try:
        shardtrain.initialize(model=model, config=config(3, tensor_parallel={"autotp_size": 2}))
    except ValueError as err:
        after = {n: (type(m), list(m.parameters(recurse=False))) for n, m in model.named_modules()}
        untouched = sorted(after) == sorted(before) and all(
            after[n][0] is kind and all(torch.equal(p.ds_tensor, t) for p, t in zip(after[n][1], shards))
            for n, (kind, shards) in before.items())
        return {"error": f"ValueError: {err}", "untouched": untouched}
    return {"error": None}


def mesh_contract(rank: int, world_size: int, save_dir: str) -> Dict[str, Any]:
    """On 4 ranks: the mistakes ``initialize`` refuses, the parameter bytes per rank for
    each mesh, a user's own groups through ``mpu=``, bf16 on tensor- and sequence-parallel
    meshes, both together, and pretrained weights loaded into a tensor-parallel engine."""
    llama_tp4 = functools.partial(llama, num_key_value_heads=4)
    gpt_specs = {"autotp_size": 2, "partition_config": {"layer_specs": GPT_SPECS}}
    cases: Dict[str, Callable] = {
        "world": lambda r, w: _refusal(llama, config(1, tensor_parallel={"autotp_size": 3})),
        "tp_heads": lambda r, w: _refusal(llama, config(1, tensor_parallel={"autotp_size": 4})),
        "sp_heads": lambda r, w: _refusal(functools.partial(llama, num_attention_heads=2,
                                                            num_key_value_heads=2),
                                          config(1, sequence_parallel_size=4)),
        "unmatched": lambda r, w: _refusal(gpt, config(1, tensor_parallel={
            "autotp_size": 2, "partition_config": {"layer_specs": [
                {"patterns": [r".*\.attention\.q\.weight$"], "partition_type": "column"}]}})),
        "not_splittable": lambda r, w: _refusal(gpt, config(1, tensor_parallel={
            "autotp_size": 2, "partition_config": {"layer_specs": [
                {"patterns": [r".*\.ln1\.weight$"], "partition_type": "column"}]}})),
        "mpu_and_tp": lambda r, w: _refusal(gpt, config(1, tensor_parallel=gpt_specs),
                                            mpu=UserMPU(r, w)),
        "zero_init": lambda r, w: _zero_init_then_tp(),
    }
    for mesh, stage in (("dp2xtp2", 1), ("dp2xtp2", 3), ("tp4", 2)):
        cases[f"pretrained_{mesh}_{stage}"] = (lambda r, w, m=mesh, s=stage: _pretrained_into(
            m, s, f"{save_dir}/llama"))
    for mesh in ("dp4", "dp2xtp2", "tp4", "dp2xsp2"):
        for stage in (0, 3):
            cases[f"bytes_{mesh}_{stage}"] = (lambda r, w, m=mesh, s=stage: _param_bytes(m, s))
    for stage in (1, 3):
        cases[f"mpu_stage{stage}"] = (lambda r, w, s=stage: {
            **compare(gpt, config(s), loss_of=gpt_loss, mpu=UserMPU(r, w)),
            "mpu": _mpu_view(UserMPU(r, w))})
    bf16 = {"bf16": {"enabled": True}}
    cases["bf16_dp2xtp2"] = lambda r, w: compare(llama_tp4, config(
        2, tensor_parallel={"autotp_size": 2}, **bf16))
    cases["bf16_dp2xsp2"] = lambda r, w: compare(llama, config(2, sequence_parallel_size=2, **bf16))
    cases["bf16_dp2xsp2_bf16_wire"] = lambda r, w: compare(llama, config(
        2, sequence_parallel_size=2, seq_parallel_communication_data_type="bf16", **bf16), steps=1)
    cases["clip_with_mpu"] = lambda r, w: _clip_with_mpu(llama_tp4)
    cases["client_optimizer"] = lambda r, w: _client_optimizer(llama_tp4, config(
        1, gas=1, tensor_parallel={"autotp_size": 2}))
    for stage in (1, 3):  # both model-parallel dimensions: heads split by TP, then by SP
        cases[f"tp2xsp2_stage{stage}"] = (lambda r, w, s=stage: compare(llama_tp4, config(
            s, tensor_parallel={"autotp_size": 2}, sequence_parallel_size=2)))
    return run_cases(cases, rank, world_size)


def _client_optimizer(build: Callable[[], torch.nn.Module], cfg: Dict[str, Any]
                      ) -> Dict[str, List[float]]:
    """The same training with the config's optimizer and with one built from the model's
    parameters before initialize (AutoTP replaces the split ones: it must be pointed at
    them)."""
    out = {}
    for name in ("config", "client"):
        model, init, run = build(), {}, dict(cfg)
        if name == "client":
            init["optimizer"] = torch.optim.AdamW(model.parameters(), **run.pop("optimizer")["params"])
        engine = shardtrain.initialize(model=model, config=run, **init)[0]
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        out[name] = losses
    return out


def _clip_with_mpu(build: Callable[[], torch.nn.Module]) -> Dict[str, Any]:
    """DeepSpeed's ``clip_grad_norm_(..., mpu=engine.mpu)`` on dp 2 x tp 2 after one
    backward (stage 0, gradients averaged over data-parallel ranks), against torch's norms of
    the whole model on the global batch in one process."""
    from deepspeed.runtime.utils import clip_grad_norm_, is_model_parallel_parameter
    engine, *_ = shardtrain.initialize(model=build(), config=config(
        0, gas=1, tensor_parallel={"autotp_size": 2}), training_data=Tokens())
    batch = next(iter(engine.training_dataloader))
    engine.backward(hf_loss(engine, batch))
    params = list(engine.module.parameters())
    got = {kind: clip_grad_norm_(params, 1e9, norm_type=kind, mpu=engine.mpu).item()
           for kind in (2.0, float("inf"))}
    split = sum(is_model_parallel_parameter(p) for p in params)
    clip_grad_norm_(params, 0.25, mpu=engine.mpu)
    after = clip_grad_norm_(params, 1e9, mpu=engine.mpu).item()
    seen = dict(comm.all_gather_object((engine.mesh.coordinate()["dp"], batch)))  # per replica
    engine.destroy()
    model = build()
    for b in seen.values():
        (hf_loss(model, b) / len(seen)).backward()
    grads = [p.grad for p in model.parameters()]
    want = {kind: torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, kind)
                                                        for g in grads]), kind).item()
            for kind in (2.0, float("inf"))}
    return {"got": got, "want": want, "after": after, "split": split, "params": len(params)}


def _mpu_view(mpu: UserMPU) -> Dict[str, int]:
    """What the engine built from a user's groups reports through ``engine.mpu``."""
    engine, *_ = shardtrain.initialize(model=gpt(), config=config(1), mpu=mpu)
    got = {name: getattr(engine.mpu, f"get_{name}")() for name in (
        "model_parallel_rank", "model_parallel_world_size", "data_parallel_rank",
        "data_parallel_world_size")}
    got["dp_world_size"] = engine.dp_world_size
    engine.destroy()
    return got

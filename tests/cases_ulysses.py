"""Rank bodies for test_ulysses.py: Ulysses sequence parallelism on tiny Hugging Face models
against the same model in one process.

Each case builds a randomly initialised model (nothing is downloaded), copies it, runs the
copy with ``enable_ulysses`` on this rank's ``shard_sequence`` slice of the batch and the
original on the whole batch, and reports the losses and, per parameter, the largest
difference between the reference gradient and this rank's gradient summed over the
sequence-parallel group and divided by S (the average over the group, what ZeRO's averaging
over data-parallel x sequence-parallel ranks makes of it within one data-parallel replica).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

import torch

from _dist import run_cases
from shardtrain import comm
from shardtrain.parallel.ulysses import (causal_lm_loss_function, enable_ulysses,
                                         heads_to_seq, seq_to_heads, shard_sequence)

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 2, 128, 16, 2


def llama(impl: str = "sdpa", heads: int = HEADS, kv_heads: int = KV_HEADS,
          hidden: int = HIDDEN, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=impl)
    return LlamaForCausalLM(config).to(dtype)


def qwen2(impl: str = "sdpa") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=64, attn_implementation=impl)
    return Qwen2ForCausalLM(config)


def tokens(seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def uneven_labels(ids: torch.Tensor) -> torch.Tensor:
    """Most of the first half without targets (a prompt), so the two slices of S = 2 hold
    very different numbers of valid tokens: a mean of the slices' means would be wrong."""
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, :5] = -100
    labels[1, 12] = -100
    return labels


def right_padded(ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0
    mask[1, 14:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _loss_and_grads(model: torch.nn.Module, batch: Dict[str, Any]):
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compare(build: Callable[[], torch.nn.Module], batch: Dict[str, Any], group: comm.Group,
            reference_batch: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The sharded model's loss and group-averaged gradients against the reference's."""
    reference = build()
    sharded = copy.deepcopy(reference)
    plan = enable_ulysses(sharded, group)
    ref_loss, ref_grads = _loss_and_grads(reference, reference_batch or batch)
    loss, grads = _loss_and_grads(sharded, shard_sequence(batch, group))
    errors = {}
    for name, grad in grads.items():
        comm.all_reduce(grad, "sum", group=group)
        errors[name] = (grad / group.size() - ref_grads[name]).abs().max().item()
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_errors": errors,
            "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
            "plan": str(plan), "kv_replicas": plan.kv_replicas}


# -- 2 ranks: sp = 2 ------------------------------------------------------------------------------

def _primitives(group: comm.Group) -> Dict[str, Any]:
    """seq_to_heads/heads_to_seq against slices of one full tensor, values and gradients."""
    size, rank = group.size(), group.rank()
    g = torch.Generator().manual_seed(3)
    full, weight = torch.randn(2, 8, 4, 3, generator=g), torch.randn(2, 8, 4, 3, generator=g)
    seq, heads = slice(rank * 8 // size, (rank + 1) * 8 // size), slice(rank * 4 // size,
                                                                        (rank + 1) * 4 // size)
    x = full[:, seq].clone().requires_grad_(True)
    y = seq_to_heads(x, group, seq_dim=1, head_dim=2)
    (y * weight[:, :, heads]).sum().backward()
    back = heads_to_seq(y.detach(), group, seq_dim=1, head_dim=2)
    # the HF layout [batch, heads, seq, dim]
    hf = seq_to_heads(full[:, seq].transpose(1, 2), group, seq_dim=2, head_dim=1)
    return {"forward": torch.equal(y, full[:, :, heads]), "inverse": torch.equal(back, x.detach()),
            "grad": torch.equal(x.grad, weight[:, seq]),
            "hf_layout": torch.equal(hf, full[:, :, heads].transpose(1, 2)),
            "shape": list(y.shape)}


def _sharded_batch(group: comm.Group) -> Dict[str, Any]:
    ids = tokens()
    labels = uneven_labels(ids)
    return {"ids": ids, "labels": labels, "out": shard_sequence({"input_ids": ids,
                                                                 "labels": labels}, group)}


def _bf16(group: comm.Group) -> Dict[str, Any]:
    ids = tokens()
    reference = llama()
    sharded = copy.deepcopy(reference).to(torch.bfloat16)
    enable_ulysses(sharded, group)
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=ids).loss
        loss = sharded(**shard_sequence({"input_ids": ids, "labels": ids}, group)).loss
    return {"loss": loss.item(), "ref_loss": ref.item(), "dtype": str(loss.dtype)}


def _message(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _errors(group: comm.Group) -> Dict[str, str]:
    ids = tokens()
    left = torch.ones_like(ids)
    left[0, :3] = 0
    padded = right_padded(ids)
    enabled = llama()
    enable_ulysses(enabled, group)
    mask_4d = torch.zeros(BATCH, 1, SEQ // 2, SEQ // 2)
    return {
        "heads": _message(lambda: enable_ulysses(llama(heads=3, kv_heads=3, hidden=48), group)),
        "kv_heads": _message(lambda: enable_ulysses(llama(heads=6, kv_heads=3, hidden=48),
                                                    group)),
        "exchange": _message(lambda: seq_to_heads(torch.zeros(1, 8, 3, 4), group)),
        "length": _message(lambda: shard_sequence({"input_ids": tokens(seq=15)}, group)),
        "left_padding": _message(lambda: shard_sequence({"input_ids": ids, "labels": ids,
                                                          "attention_mask": left}, group)),
        "padding_labels": _message(lambda: shard_sequence(
            {**padded, "labels": ids}, group)),
        "implementation": _message(lambda: enable_ulysses(_flex(llama()), group)),
        "twice": _message(lambda: enable_ulysses(enabled, group)),
        "unshifted": _message(lambda: causal_lm_loss_function(group)(
            torch.zeros(BATCH, SEQ // 2, VOCAB), ids[:, :8], VOCAB)),
        "mask_4d": _message(lambda: enabled(input_ids=ids[:, :8], attention_mask=mask_4d)),
    }


def _flex(model: torch.nn.Module) -> torch.nn.Module:
    model.config._attn_implementation = "flex_attention"  # as if loaded with it
    return model


def sp2(rank: int, world_size: int) -> Dict[str, Any]:
    mesh = comm.init_mesh(sp=2)
    group = mesh.sp
    ids = tokens()
    cases = {
        "primitives": lambda r, w: _primitives(group),
        "sharded_batch": lambda r, w: _sharded_batch(group),
        "bf16": lambda r, w: _bf16(group),
        "errors": lambda r, w: _errors(group),
        "qwen2": lambda r, w: compare(qwen2, {"input_ids": ids, "labels": uneven_labels(ids)},
                                      group),
        "right_padded": lambda r, w: compare(llama, right_padded(ids), group),
        "num_items": lambda r, w: compare(
            llama, {"input_ids": ids, "labels": uneven_labels(ids), "num_items_in_batch": 40},
            group),
    }
    for impl in ("sdpa", "eager"):
        cases[f"{impl}"] = _case(lambda impl=impl: llama(impl), ids, ids, group)
        cases[f"{impl}_ignored"] = _case(lambda impl=impl: llama(impl), ids, uneven_labels(ids),
                                         group)
        cases[f"{impl}_replicated_kv"] = _case(lambda impl=impl: llama(impl, kv_heads=1), ids,
                                               uneven_labels(ids), group)
        # the reference: Transformers' own block-causal mask for packed rows, on one process
        cases[f"{impl}_packed"] = lambda r, w, impl=impl: _packed(impl, ids, group)
    return run_cases(cases, rank, world_size)


def packed_positions() -> torch.Tensor:
    """Rows of several documents: positions restart inside rank 1's slice (row 0), and twice,
    once inside rank 0's slice and once at the slices' boundary (row 1)."""
    return torch.stack([torch.cat([torch.arange(10), torch.arange(6)]),
                        torch.cat([torch.arange(5), torch.arange(3), torch.arange(8)])])


def _packed(impl: str, ids: torch.Tensor, group: comm.Group) -> Dict[str, Any]:
    """Packed rows against Transformers' own handling of them on one process (it detects the
    restarts when there is no cache and no attention mask, and masks each document off)."""
    batch = {"input_ids": ids, "labels": uneven_labels(ids), "position_ids": packed_positions()}
    out = compare(lambda: llama(impl), batch, group, reference_batch={**batch, "use_cache": False})
    with torch.no_grad():  # one mask over the whole row: what packing must not give
        out["unmasked_loss"] = llama(impl)(**batch, use_cache=False,
                                           attention_mask=torch.ones_like(ids)).loss.item()
    return out


def _case(build, ids, labels, group):
    return lambda r, w: compare(build, {"input_ids": ids, "labels": labels}, group)


# -- 4 ranks: dp = 2 x sp = 2 ---------------------------------------------------------------------

def dp2_sp2(rank: int, world_size: int) -> Dict[str, Any]:
    mesh = comm.init_mesh(sp=2)
    replica = mesh.coordinate()["dp"]
    batches = [{"input_ids": tokens(seed), "labels": uneven_labels(tokens(seed))}
               for seed in (11, 12)]
    cases = {f"{impl}": _engine_contract(impl, mesh, batches, replica)
             for impl in ("sdpa", "eager")}
    out = run_cases(cases, rank, world_size)
    out["sp_ranks"], out["zero_ranks"] = mesh.sp.ranks(), mesh.zero.ranks()
    return out


def _engine_contract(impl: str, mesh: comm.Mesh, batches, replica: int):
    """Each data-parallel replica trains on its own batch; the sp group's average matches
    that batch's reference, and the average over mesh.zero (what ZeRO does) matches the
    gradient of the mean of the replicas' reference losses."""
    def run(rank: int, world_size: int) -> Dict[str, Any]:
        out = compare(lambda: llama(impl), batches[replica], mesh.sp)
        reference = llama(impl)
        loss = sum(reference(**b).loss for b in batches) / len(batches)
        loss.backward()
        sharded = copy.deepcopy(llama(impl))
        enable_ulysses(sharded, mesh.sp)
        sharded(**shard_sequence(batches[replica], mesh.sp)).loss.backward()
        errors = {}
        for (name, p), ref in zip(sharded.named_parameters(), reference.parameters()):
            comm.all_reduce(p.grad, "avg", group=mesh.zero)
            errors[name] = (p.grad - ref.grad).abs().max().item()
        out["zero_avg_errors"] = errors
        return out
    return run

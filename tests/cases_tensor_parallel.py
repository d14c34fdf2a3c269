"""Tensor-parallel cases run on every rank of one process group (see test_tensor_parallel.py).

Each case builds a model twice from the same seed: a plain single-process reference and a
copy made tensor-parallel with ``apply_autotp`` over the mesh's tp group. Both run the same
batch (one batch per data-parallel coordinate, so a collective over the wrong group shows);
the case returns the largest differences: outputs (or this rank's vocabulary slice of
them), losses, and every gradient (a shard against the matching ``SplitSpec.shard`` of the
reference's, a replicated parameter against the reference's whole).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

import gpt
from _dist import run_cases
from shardtrain import comm
from shardtrain.parallel import (ColumnParallelLinear, RowParallelLinear, SharedInput, SplitSpec,
                                 apply_autotp, gather_from_group, is_tp_split,
                                 scatter_to_group, vocab_parallel_cross_entropy)

VOCAB, SEQ, BATCH = 128, 8, 2
GPT_SPECS = [
    {"patterns": [r".*\.attn\.(query|key|value)\.weight$", r".*\.mlp\.fc\.weight$"],
     "partition_type": "column"},
    {"patterns": [r".*\.attn\.proj\.weight$", r".*\.mlp\.proj\.weight$"], "partition_type": "row"},
]
HEAD = {"patterns": [r"lm_head\.weight$"], "partition_type": "column"}


def gpt_model(n_head: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return gpt.GPT(gpt.gpt_config("tiny", vocab_size=64, n_head=n_head))


def llama_model(tied: bool = False, kv_heads: int = 2, dtype=torch.float32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=VOCAB,
                         tie_word_embeddings=tied, max_position_embeddings=64, use_cache=False,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype)


def phi3_model() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2))


def qwen2_model() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=1))


def mixtral_model() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, use_cache=False, bos_token_id=0, eos_token_id=1,
        pad_token_id=0))


def batch(mesh: comm.Mesh, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids shared by a tensor-parallel group, different for each data-parallel one."""
    g = torch.Generator().manual_seed(100 + mesh.coordinate()["dp"])
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def hf_loss(model: nn.Module, ids: torch.Tensor, **kw: Any):
    labels = ids.clone()
    labels[0, :3] = -100  # ignored labels: neither loss nor gradient
    out = model(input_ids=ids, labels=labels, **kw)
    return out.logits, out.loss


def gpt_loss(model: nn.Module, ids: torch.Tensor):
    return model(ids), model(ids[:, :-1], ids[:, 1:])


def _grad_gaps(model: nn.Module, ref: nn.Module, group: comm.Group) -> Dict[str, tuple]:
    """Each gradient's largest difference from the reference's (its shard, if split), and
    that difference over the reference gradient's largest element."""
    ref_params = dict(ref.named_parameters())
    gaps = {}
    for name, p in model.named_parameters():
        expected = ref_params[name].grad
        if is_tp_split(p):
            expected = p.tp_split.shard(expected, group.rank(), group.size())
        gap = (p.grad.float() - expected.float()).abs().max().item()
        gaps[name] = (gap, gap / max(expected.abs().max().item(), 1e-12))
    return gaps


def _output_gap(out: torch.Tensor, ref_out: torch.Tensor, group: comm.Group) -> float:
    if out.shape != ref_out.shape:  # local logits: this rank's slice of the vocabulary
        ref_out = SplitSpec(ref_out.dim() - 1, (ref_out.shape[-1],)).shard(
            ref_out, group.rank(), group.size())
    return (out.float() - ref_out.float()).abs().max().item()


def compare(build: Callable[[], nn.Module], block: dict, run: Callable, mesh: comm.Mesh,
            vocab: int = VOCAB) -> Dict[str, Any]:
    """Forward and backward of a model made tensor-parallel against its reference."""
    ref = build()
    model = copy.deepcopy(ref)
    plan = apply_autotp(model, mesh.tp, block)
    ids = batch(mesh, vocab)
    ref_out, ref_loss = run(ref, ids)
    ref_loss.backward()
    out, loss = run(model, ids)
    loss.backward()
    gaps = _grad_gaps(model, ref, mesh.tp)
    worst = max(gaps, key=lambda n: gaps[n][0])
    return {"output": _output_gap(out, ref_out, mesh.tp),
            "loss": abs(loss.item() - ref_loss.item()), "grad": gaps[worst][0], "worst": worst,
            "grad_rel": max(g[1] for g in gaps.values()), "splits": plan.splits,
            "head": plan.head, "loss_function": plan.loss, "describe": plan.describe(),
            "split_params": sorted(n for n, p in model.named_parameters() if is_tp_split(p)),
            "model": model_facts(model)}


def model_facts(model: nn.Module) -> Dict[str, Any]:
    """Ties and head counts after the split."""
    facts: Dict[str, Any] = {}
    if hasattr(model, "lm_head"):
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
            else model.tok_emb
        facts["tied"] = emb.weight is model.lm_head.weight
        facts["embedding"] = type(emb).__name__
        facts["lm_head"] = type(model.lm_head).__name__
    attn = next((m for n, m in model.named_modules() if n.endswith("attn")), None)
    for attr in ("n_head", "num_key_value_heads"):
        if attn is not None and hasattr(attn, attr):
            facts[attr] = getattr(attn, attr)
    config = getattr(attn, "config", None)
    if config is not None:
        facts["attn_config_heads"] = (config.num_attention_heads, config.num_key_value_heads)
        facts["model_config_heads"] = (model.config.num_attention_heads,
                                       model.config.num_key_value_heads)
    return facts


def gpt_cases(mesh: comm.Mesh, n_head: int) -> Dict[str, Callable]:
    specs = {"partition_config": {"layer_specs": GPT_SPECS}}
    gathered = {"partition_config": {"layer_specs": GPT_SPECS + [dict(HEAD, gather_output=True)]}}
    local = {"partition_config": {"layer_specs": GPT_SPECS + [HEAD]}}

    def local_loss(model, ids):
        logits = model(ids)
        if isinstance(model.lm_head, nn.Linear):  # the reference
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        else:
            loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], mesh.tp)
        return logits, loss
    build = lambda: gpt_model(n_head)  # noqa: E731
    return {"gpt": lambda: compare(build, specs, gpt_loss, mesh, 64),
            "gpt_head_gathered": lambda: compare(build, gathered, gpt_loss, mesh, 64),
            "gpt_head_local": lambda: compare(build, local, local_loss, mesh, 64)}


def hf_cases(mesh: comm.Mesh) -> Dict[str, Callable]:
    head = {"partition_config": {"layer_specs": [HEAD]}}

    def counted(model, ids):  # Transformers' Trainer path: a sum over num_items_in_batch
        return hf_loss(model, ids, num_items_in_batch=torch.tensor(11))
    return {"llama": lambda: compare(llama_model, {"autotp_size": mesh.tp.size()}, hf_loss, mesh),
            "llama_head_tied": lambda: compare(lambda: llama_model(tied=True), head, hf_loss, mesh),
            "llama_head_untied": lambda: compare(llama_model, head, counted, mesh),
            "phi3": lambda: compare(phi3_model, {}, hf_loss, mesh),
            "phi3_head": lambda: compare(phi3_model, head, hf_loss, mesh),
            "qwen2": lambda: compare(qwen2_model, {"preset_model": "qwen2"}, hf_loss, mesh),
            "mixtral": lambda: compare(mixtral_model, {}, hf_loss, mesh),
            "llama_bf16": lambda: compare(lambda: llama_model(dtype=torch.bfloat16), head,
                                          hf_loss, mesh)}


def _per_rank(fn: Callable[[], Any]) -> Callable[[int, int], Any]:
    return lambda rank, world: fn()


def _as_cases(cases: Dict[str, Callable]) -> Dict[str, Callable]:
    """run_cases' form (a function of rank and world size) of argument-free cases."""
    return {name: _per_rank(fn) for name, fn in cases.items()}


def two_ranks(rank: int, world_size: int, only: Optional[list] = None) -> Dict[str, Any]:
    """tp=2: every model, the building blocks and the errors."""
    mesh = comm.init_mesh(tp=2)
    cases = dict(gpt_cases(mesh, 2), **hf_cases(mesh))
    cases.update(blocks=lambda: building_blocks(mesh), errors=lambda: errors(mesh))
    return run_cases(_as_cases(cases), rank, world_size, only)


def four_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    """tp=4 for the GPT-style model, then tp=2 x dp=2 for Llama: the groups are the tp ones."""
    tp4 = comm.init_mesh(tp=4)
    out = run_cases(_as_cases(gpt_cases(tp4, 4)), rank, world_size)
    dp2 = comm.init_mesh(tp=2)
    cases = {"llama_dp2": lambda: compare(llama_model, {}, hf_loss, dp2),
             "llama_head_tied_dp2": lambda: compare(
                 lambda: llama_model(tied=True), {"partition_config": {"layer_specs": [HEAD]}},
                 hf_loss, dp2),
             "tp_ranks": lambda: dp2.tp.ranks()}
    out.update(run_cases(_as_cases(cases), rank, world_size))
    return out


def building_blocks(mesh: comm.Mesh) -> Dict[str, Any]:
    """The autograd functions' gradients, and the collectives a layer pair costs."""
    group, rank, size = mesh.tp, mesh.tp.rank(), mesh.tp.size()
    torch.manual_seed(1)
    full, weights = torch.randn(3, 4 * size), torch.randn(3, 4 * size)
    x = full[:, 4 * rank: 4 * rank + 4].clone().requires_grad_()
    (gather_from_group(x, group, dim=1) * weights).sum().backward()
    gather_ok = torch.equal(x.grad, weights[:, 4 * rank: 4 * rank + 4])
    y = full.clone().requires_grad_()
    scatter_to_group(y, group, dim=-1).sum().backward()
    scatter_ok = torch.equal(y.grad, torch.ones_like(full))  # every rank's slice, gathered
    seen = []
    observer = lambda op, t: seen.append(op)  # noqa: E731
    up = ColumnParallelLinear.from_linear(nn.Linear(8, 16), group)
    down = RowParallelLinear.from_linear(nn.Linear(16, 8), group)
    comm.add_observer(observer)
    try:
        out = down(torch.relu(up(torch.randn(2, 8, requires_grad=True))))
        forward = list(seen)
        out.sum().backward()
    finally:
        comm.remove_observer(observer)
    shared = _shared_input(group)
    return {"gather_backward": gather_ok, "scatter_backward": scatter_ok,
            "forward_ops": forward, "backward_ops": seen[len(forward):],
            "up_repr": repr(up), "down_repr": repr(down), **shared}


def _shared_input(group: comm.Group) -> Dict[str, Any]:
    """Three column layers reading one input (q, k, v) and a row layer after them: one
    all-reduce in backward for the three input gradients, and the input's gradient is the
    plain layers' (computed without any split)."""
    torch.manual_seed(2)
    plain = [nn.Linear(8, 16) for _ in range(3)]
    proj = nn.Linear(16, 8)
    x = torch.randn(2, 8, requires_grad=True)
    (proj(sum(layer(x) for layer in plain))).pow(2).sum().backward()
    block = _Summed([ColumnParallelLinear.from_linear(layer, group) for layer in plain])
    shared = SharedInput().attach(block)
    for layer in block.layers:
        layer.shared = shared
    row = RowParallelLinear.from_linear(proj, group)
    x_split = x.detach().clone().requires_grad_()
    seen = []
    observer = lambda op, t: seen.append(op)  # noqa: E731
    comm.add_observer(observer)
    try:
        out = row(block(x_split))
        forward = len(seen)
        out.pow(2).sum().backward()
    finally:
        comm.remove_observer(observer)
    return {"shared_backward_ops": seen[forward:], "entries_left": len(shared._entries),
            "shared_grad_err": (x_split.grad - x.grad).abs().max().item()}


class _Summed(nn.Module):
    """Layers that read one input, their outputs summed (a stand-in for q, k and v)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 5)
        self.down = nn.Linear(5, 8)


def errors(mesh: comm.Mesh) -> Dict[str, str]:
    """Each mistake's message, and that the model is left untouched."""
    group = mesh.tp
    specs = lambda *s: {"partition_config": {"layer_specs": list(s)}}  # noqa: E731
    strict = {"partition_config": {"strict_mode": True,
                                   "layer_specs": [{"patterns": [r".*\.attn\.query\.weight$"]}]}}
    untouched = gpt_model()
    out = {
        "no_rules": _error(lambda: apply_autotp(gpt_model(), group, {})),
        "unmatched_pattern": _error(lambda: apply_autotp(gpt_model(), group, specs(
            {"patterns": [r".*\.attention\.q\.weight$"]}))),
        "not_linear": _error(lambda: apply_autotp(Tiny(), group, specs(
            {"patterns": [r"norm\.weight$"]}))),
        "not_divisible": _error(lambda: apply_autotp(Tiny(), group, specs(
            {"patterns": [r"up\.weight$"]}))),
        "heads": _error(lambda: apply_autotp(llama_model(kv_heads=1), group, {})),
        "strict": _error(lambda: apply_autotp(untouched, group, strict)),
        "unknown_key": _error(lambda: apply_autotp(gpt_model(), group, {"autotp": 2})),
        "bad_type": _error(lambda: apply_autotp(gpt_model(), group, specs(
            {"patterns": ["x"], "partition_type": "columns"}))),
        "size": _error(lambda: apply_autotp(gpt_model(), group, {"autotp_size": 8})),
        "row_head": _error(lambda: apply_autotp(gpt_model(), group, specs(
            {"patterns": [r"lm_head"], "partition_type": "row"}))),
        "tied_replicated_head": _error(lambda: apply_autotp(gpt_model(), group, specs(
            {"patterns": [r"tok_emb\.weight$"]}))),
        "split_spec": _error(lambda: SplitSpec(0, (6, 3)).shard(torch.zeros(9), 0, 2)),
    }
    out["untouched"] = not any(is_tp_split(p) for p in untouched.parameters()) and all(
        type(m) in (nn.Linear,) for n, m in untouched.named_modules() if n.endswith("query"))
    return out

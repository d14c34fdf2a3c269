"""Tiling along the sequence (shardtrain.parallel.tiling and DeepSpeed's names for it in the
alias): exact against the untiled computation, forward and gradients; the full-size
intermediate is never saved for backward; each parameter's gradient arrives once."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.parallel import (TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute,
                                 tiled_logits_loss)

HIDDEN, INTER, VOCAB = 8, 64, 96


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grads(leaves):
    out = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out


def _saved_numels(run):
    """Element counts of every tensor autograd saves for backward while ``run`` builds its graph."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sizes


@pytest.mark.parametrize("shards,shape", [(4, (2, 13, HIDDEN)), (3, (17, HIDDEN)), (1, (1, 6, HIDDEN)),
                                          (4, (1, 9, HIDDEN))])  # 9 in 4: torch.chunk gives 3 tiles
def test_tiled_mlp_is_exact_forward_and_backward(shards, shape):
    torch.manual_seed(0)
    mlp, x = MLP(), torch.randn(*shape, requires_grad=True)
    leaves = [x, *mlp.parameters()]
    ref = mlp(x)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    ref_grads = _grads(leaves)
    got = TiledMLP.apply(lambda m, t: m(t), mlp, x, shards)
    got.backward(grad_out)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    for a, b in zip(_grads(leaves), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_saves_only_its_input_and_grads_arrive_once():
    torch.manual_seed(0)
    mlp, x = MLP(), torch.randn(2, 32, HIDDEN, requires_grad=True)
    full_intermediate = 2 * 32 * INTER
    _, untiled = _saved_numels(lambda: mlp(x))
    assert max(untiled) >= full_intermediate  # the reference does keep it
    out, tiled = _saved_numels(lambda: TiledMLP.apply(lambda m, t: m(t), mlp, x, 4))
    assert max(tiled) == x.numel(), tiled  # nothing larger than the input itself
    calls = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: calls.append(p)) for p in mlp.parameters()]
    out.sum().backward()
    for h in hooks:
        h.remove()
    assert len(calls) == len(list(mlp.parameters()))  # one gradient per parameter, not per tile


@pytest.mark.parametrize("shards", [1, 3, 5])
def test_tiled_logits_loss_is_exact_and_keeps_no_logits(shards):
    torch.manual_seed(1)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, 11, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 11))
    labels[0, :7] = -100  # tiles with different numbers of valid labels: the mean stays exact
    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    (2.5 * ref).backward()
    ref_grads = _grads([hidden, head.weight])
    got, saved = _saved_numels(lambda: tiled_logits_loss(head, hidden, labels, shards))
    if shards > 1:  # a tile's logits exist for a while; the whole [batch, seq, vocab] never
        assert max(saved) < 2 * 11 * VOCAB, saved
    (2.5 * got).backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads([hidden, head.weight]), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_tiled_loss_without_grad_is_the_value():
    head, hidden = nn.Linear(HIDDEN, VOCAB, bias=False), torch.randn(1, 9, HIDDEN)
    labels = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        got = tiled_logits_loss(head, hidden, labels, 4)
        torch.testing.assert_close(got, F.cross_entropy(head(hidden)[0], labels[0]))


def test_deepspeed_style_fused_loss_and_sequence_tiled_compute():
    torch.manual_seed(2)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(2, 12, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 12))

    def loss_fn(module, x, y):
        return F.cross_entropy(module(x), y)

    ref = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten())
    ref.backward()
    ref_grads = _grads([hidden, head.weight])
    got = TiledFusedLogitsLoss.apply(loss_fn, head, hidden, labels, None, 4, [head.weight], "mean")
    got.backward()
    torch.testing.assert_close(got, ref)
    for a, b in zip(_grads([hidden, head.weight]), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    mlp = MLP()
    ref = mlp(hidden).sum()
    ref.backward()
    ref_grads = _grads([hidden, *mlp.parameters()])
    got = sequence_tiled_compute(lambda x, scale: mlp(x) * scale, 12, 5, {"x": hidden}, {"scale": 1.0},
                                 "x", list(mlp.parameters()), output_reduction="sum")
    got.backward()
    torch.testing.assert_close(got, ref)
    for a, b in zip(_grads([hidden, *mlp.parameters()]), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_named():
    mlp, x = MLP(), torch.randn(1, 4, HIDDEN)
    with pytest.raises(ValueError, match="shards must be a positive int"):
        TiledMLP.apply(lambda m, t: m(t), mlp, x, 0)
    with pytest.raises(ValueError, match="output_reduction"):
        sequence_tiled_compute(lambda x: x, 4, 2, {"x": x}, {}, "x", output_reduction="max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        sequence_tiled_compute(lambda x: x, 4, 2, {"x": x}, {}, "y")
    with pytest.raises(ValueError, match="must agree"):
        tiled_logits_loss(nn.Linear(HIDDEN, VOCAB), x, torch.zeros(1, 5, dtype=torch.long), 2)


def test_alias_module_exposes_deepspeed_names():
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    assert ulysses_sp.TiledMLP is TiledMLP and ulysses_sp.sequence_tiled_compute is sequence_tiled_compute
    register = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers
    assert register(model_name_or_path=None, core_attn_implementation="sdpa", sequence_parallel_size=1,
                    micro_batch_size=1) is None
    with pytest.raises(NotImplementedError, match="loaded Hugging Face model"):
        register(model_name_or_path="org/name", core_attn_implementation="sdpa",
                 sequence_parallel_size=2, micro_batch_size=1)
    model = nn.Linear(1, 1)
    model.config = object()
    with pytest.raises(ValueError, match="sdpa or eager"):
        register(model_name_or_path=model, core_attn_implementation="flash_attention_2",
                 sequence_parallel_size=2, micro_batch_size=1)
    with pytest.raises(NotImplementedError, match="register_with_transformers"):
        ulysses_sp.UlyssesSPAttentionHF()

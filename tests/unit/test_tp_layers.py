"""Tensor-parallel layers and the vocabulary-parallel loss on a group of one rank (no process
group): the arithmetic and the attributes; over real processes in tests/test_tensor_parallel.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtrain import comm
from shardtrain.parallel import (ColumnParallelLinear, RowParallelLinear, SplitSpec,
                                 VocabParallelEmbedding, is_tp_split,
                                 vocab_parallel_cross_entropy)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy_on_one_rank_is_cross_entropy(reduction):
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 1] = -100
    got = vocab_parallel_cross_entropy(logits, labels, comm.WORLD, reduction=reduction)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction=reduction)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(got, ref.view_as(got))
    torch.testing.assert_close(grad, ref_grad)


def test_layers_from_full_modules_keep_dtype_device_and_values():
    linear = nn.Linear(4, 6, dtype=torch.float64)
    column = ColumnParallelLinear.from_linear(linear, comm.WORLD, SplitSpec(0, (2, 4)))
    assert column.weight.dtype == torch.float64 and column.weight.device == linear.weight.device
    assert (column.in_features, column.out_features) == (4, 6)
    assert column.weight.tp_split == column.bias.tp_split == SplitSpec(0, (2, 4))
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(column(x), linear(x))
    row = RowParallelLinear.from_linear(linear, comm.WORLD)
    assert row.weight.tp_split == SplitSpec(1, (4,)) and not is_tp_split(row.bias)
    assert row.bias is linear.bias  # replicated: the same parameter
    torch.testing.assert_close(row(x), linear(x))


def test_vocab_parallel_embedding_keeps_padding_rows_out_of_the_gradient():
    embedding = nn.Embedding(10, 3, padding_idx=2)
    vocab = VocabParallelEmbedding.from_embedding(embedding, comm.WORLD)
    ids = torch.tensor([[1, 2, 9]])
    torch.testing.assert_close(vocab(ids), embedding(ids))
    vocab(ids).sum().backward()
    assert vocab.weight.grad[2].abs().sum() == 0 and vocab.weight.grad[1].abs().sum() > 0
    with pytest.raises(NotImplementedError, match="does not support nn.Embedding's {'max_norm'"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(4, 2, max_norm=1.0), comm.WORLD)


def test_gathered_output_refuses_fused_parts():
    with pytest.raises(ValueError, match=r"gather_output cannot rebuild fused parts \(2, 2\)"):
        ColumnParallelLinear.from_linear(nn.Linear(2, 4), comm.WORLD, SplitSpec(0, (2, 2)),
                                         gather_output=True)

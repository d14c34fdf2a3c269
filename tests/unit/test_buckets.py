"""Gradient buckets (shardtrain.zero._buckets): grouping, the flat buffer and its flags, and
the local gradient norm against torch.nn.utils.clip_grad_norm_."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import List, Sequence

import pytest
import torch

from shardtrain.layout import place
from shardtrain.zero._buckets import FlatBucket, local_norm, split_into_buckets


def params_of(sizes: Sequence[int], dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> List[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) for n in sizes]


def numel(bucket) -> int:
    return sum(p.numel() for p in bucket)


# -- split_into_buckets -------------------------------------------------------------------------


def test_split_known_example():
    a, b, c, d = params_of([3, 5, 2, 7])
    assert split_into_buckets([a, b, c, d], 8) == [[d], [c, b], [a]]
    assert split_into_buckets([], 8) == []


@pytest.mark.parametrize("seed", range(20))
def test_split_properties(seed):
    rng = random.Random(seed)
    kinds = [(torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float32, "meta")]
    params = []
    for _ in range(rng.randint(1, 25)):
        dtype, device = kinds[rng.randrange(3)] if rng.random() < 0.3 else kinds[0]
        params += params_of([rng.randint(1, 40)], dtype, device)
    cap = rng.randint(1, 60)
    buckets = split_into_buckets(params, cap)

    flat = [p for bucket in buckets for p in bucket]
    assert [id(p) for p in flat] == [id(p) for p in reversed(params)]  # each once, reversed
    for bucket in buckets:
        assert numel(bucket) <= cap or len(bucket) == 1
        assert len({(p.dtype, p.device) for p in bucket}) == 1
    for bucket, following in zip(buckets, buckets[1:]):  # a new bucket only when needed
        first = following[0]
        changed = (first.dtype, first.device) != (bucket[0].dtype, bucket[0].device)
        assert changed or numel(bucket) + first.numel() > cap


def test_a_parameter_larger_than_the_cap_is_alone():
    small, big, tiny = params_of([2, 50, 1])
    assert split_into_buckets([small, big, tiny], 10) == [[tiny], [big], [small]]


@pytest.mark.parametrize("other", [dict(dtype=torch.bfloat16), dict(device="meta")])
def test_dtype_or_device_change_starts_a_bucket(other):
    (a,), (b,), (c,) = params_of([1]), params_of([1], **other), params_of([1])
    assert split_into_buckets([a, b, c], 1000) == [[c], [b], [a]]


def test_partitioned_parameters_count_their_full_size():
    a, b = params_of([0, 0])
    two_ranks = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    for p in (a, b):  # ZeRO-3: the parameter's own data is released; its layout says 6
        place(p, local_shape=(6,), zero_group=two_ranks)
    assert split_into_buckets([a, b], 10) == [[b], [a]]
    assert split_into_buckets([a, b], 12) == [[b, a]]


# -- FlatBucket -----------------------------------------------------------------------------------


def shaped_params(dtype: torch.dtype = torch.float32) -> List[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*shape).to(dtype)) for shape in [(3, 4), (5,), (2, 1, 3)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_alias_the_buffer_then_the_flags(dtype):
    params = shaped_params(dtype)
    bucket = FlatBucket(params)
    assert bucket.numel == 12 + 5 + 6
    assert bucket.buffer.shape == (23 + 3,) and bucket.buffer.dtype == dtype
    assert bucket.grads.shape == (23,) and bucket.flags.shape == (3,)
    offset = 0
    for p, view in zip(params, bucket.views):
        assert view.shape == p.shape
        view.fill_(offset + 1)
        assert (bucket.buffer[offset: offset + p.numel()] == offset + 1).all()
        offset += p.numel()
    bucket.flags.fill_(-1)
    assert (bucket.grads > 0).all()  # the flags sit after the gradients, never over them


def test_reset_zeroes_and_attaches_views_that_backward_accumulates_into():
    params = shaped_params()
    bucket = FlatBucket(params)
    bucket.buffer.fill_(9)
    bucket.used, bucket.arrived, bucket.launched = [True] * 3, 3, True
    bucket.reset()
    assert not bucket.buffer.any()
    assert all(p.grad is view for p, view in zip(params, bucket.views))
    assert (bucket.used, bucket.arrived, bucket.launched) == ([False] * 3, 0, False)

    reference = [p.detach().clone().requires_grad_() for p in params]
    for _ in range(2):  # two backward passes: autograd adds into the attached views
        sum((q * q.sum()).sum() for q in params).backward()
        sum((q * q.sum()).sum() for q in reference).backward()
    assert all(p.grad is view for p, view in zip(params, bucket.views))
    assert torch.equal(bucket.grads, torch.cat([q.grad.view(-1) for q in reference]))
    assert not bucket.flags.any()


def test_a_bucket_in_another_dtype_leaves_grad_to_autograd():
    """fp32 accumulation of bf16 gradients: the views are fp32 and not the parameters'
    ``.grad`` (which must be bf16); the bucket is marked not attached."""
    params = shaped_params(torch.bfloat16)
    bucket = FlatBucket(params, dtype=torch.float32)
    assert not bucket.attached and bucket.buffer.dtype == torch.float32
    assert [v.shape for v in bucket.views] == [p.shape for p in params]
    p0 = params[0]
    p0.grad = torch.ones_like(p0)
    bucket.reset()
    assert all(p.grad is None for p in params) and not bucket.buffer.any()
    assert FlatBucket(params, dtype=torch.bfloat16).attached


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("used", [[True] * 3, [True, False, True], [False] * 3, [False, False, True]])
def test_write_flags_writes_the_used_list(dtype, used):
    bucket = FlatBucket(shaped_params(dtype))
    bucket.reset()
    bucket.grads.fill_(2)
    bucket.flags.fill_(5)
    bucket.used = list(used)
    bucket.write_flags()
    assert bucket.flags.tolist() == [float(u) for u in used]
    assert (bucket.grads == 2).all()


def test_a_readiness_only_bucket_has_no_buffer():
    params = shaped_params()
    bucket = FlatBucket(params, flat=False)
    assert bucket.buffer is None and bucket.grads is None and bucket.flags is None
    assert bucket.views == [] and bucket.numel == 23
    assert (bucket.used, bucket.arrived, bucket.launched) == ([False] * 3, 0, False)
    assert all(p.grad is None for p in params)


# -- local_norm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_local_norm_is_clip_grad_norm_bit_for_bit(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(*[rng.randint(1, 9) for _ in range(rng.randint(1, 3))], generator=gen)
             * 10 ** rng.uniform(-3, 3) for _ in range(rng.randint(1, 12))]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(params, max_norm=math.inf)
    got = local_norm(grads, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.shape == ()
    assert torch.equal(got, want)


def test_local_norm_of_nothing_is_zero():
    norm = local_norm([], torch.device("cpu"))
    assert norm.shape == () and norm.dtype == torch.float32 and norm.item() == 0.0

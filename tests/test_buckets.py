"""Bucket assignment is torch's, and bucket views are real views. No processes needed."""

from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.distributed as dist

from mini_ddp.engine.buckets import Bucket, assign_buckets, build_buckets
from mini_ddp.engine.config import DataParallelConfig

DTYPES = [torch.float32, torch.float64, torch.float16]


def _random_params(rng: random.Random, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    return [torch.empty(rng.randint(1, 3000), dtype=rng.choice(dtypes))
            for _ in range(rng.randint(1, 14))]


LIMITS = [[sys.maxsize], [1000], [1024, 4096], [2000, 8000, 16000], [1, 10**9]]


@pytest.mark.parametrize("seed", range(40))
def test_definition_order_layout_equals_torch(seed):
    rng = random.Random(seed)
    params = _random_params(rng, DTYPES)
    limits = rng.choice(LIMITS)
    expected, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    assert assign_buckets(params, limits) == [list(b) for b in expected]


@pytest.mark.parametrize("seed", range(40))
def test_ready_order_layout_equals_torch_for_one_dtype(seed):
    rng = random.Random(seed)
    params = _random_params(rng, [torch.float32])
    order = list(range(len(params)))
    rng.shuffle(order)
    limits = rng.choice(LIMITS)
    # torch takes the tensors already in ready order, plus their original indices.
    expected, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), order)
    assert assign_buckets(params, limits, order) == [list(b) for b in expected]


@pytest.mark.parametrize("seed", range(20))
def test_ready_order_layout_with_mixed_dtypes_has_torchs_buckets(seed):
    """With several dtypes, torch appends the still-open buckets in hash-map order; every
    bucket's *contents* (which decide the numerics) are the same, only whole buckets may swap."""
    rng = random.Random(seed)
    params = _random_params(rng, DTYPES)
    order = list(range(len(params)))
    rng.shuffle(order)
    limits = rng.choice(LIMITS)
    expected, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), order)
    ours = assign_buckets(params, limits, order)
    assert sorted(ours) == sorted(list(b) for b in expected)


def test_a_bucket_closes_when_it_reaches_the_cap_and_may_exceed_it():
    params = [torch.empty(100), torch.empty(200), torch.empty(50)]  # 400, 800, 200 bytes
    assert assign_buckets(params, [500]) == [[0, 1], [2]]
    assert assign_buckets(params, [400]) == [[0], [1], [2]]


def test_config_limits_follow_ddp():
    default = DataParallelConfig()
    assert default.initial_size_limits() == [sys.maxsize]
    assert default.rebuild_size_limits() == [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    explicit = DataParallelConfig(bucket_cap_mb=2, find_unused_parameters=True)
    assert explicit.initial_size_limits() == [2 * 2**20]
    assert explicit.rebuild_size_limits() == [2 * 2**20, 2 * 2**20]
    unused = DataParallelConfig(find_unused_parameters=True)
    assert unused.initial_size_limits() == [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]
    # torch DDP accepts caps of zero and below: zero closes a bucket after every parameter,
    # a negative cap wraps around (size_t) to one bucket per dtype.
    params = [torch.zeros(3), torch.zeros(5), torch.zeros(2)]
    zero = DataParallelConfig(bucket_cap_mb=0, find_unused_parameters=True)
    assert assign_buckets(params, zero.initial_size_limits()) == [[0], [1], [2]]
    assert assign_buckets(params, zero.initial_size_limits()) == [
        list(b) for b in dist._compute_bucket_assignment_by_size(params, [0])[0]]
    negative = DataParallelConfig(bucket_cap_mb=-1, find_unused_parameters=True)
    assert assign_buckets(params, negative.initial_size_limits()) == [[0, 1, 2]]


def test_views_alias_the_flat_buffer_with_the_parameters_strides():
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    transposed = torch.nn.Parameter(torch.randn(4, 6).t())  # dense, not contiguous
    params = [conv.weight, conv.bias, transposed]
    buckets, locator = build_buckets([[2, 0, 1]], params)
    (bucket,) = buckets
    assert isinstance(bucket, Bucket) and bucket.buffer.numel() == sum(p.numel() for p in params)
    assert locator == [(0, 1), (0, 2), (0, 0)]
    for p, view in zip(bucket.params, bucket.views, strict=True):
        assert view.shape == p.shape and view.stride() == p.stride()
        assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
        view.fill_(1.0)
    assert bool((bucket.buffer == 1).all())


class _Layout:
    """A stand-in for a BucketLayout: what the armed-by registry sees of one."""

    def __init__(self, registry, params):
        self.params = params
        self.ref = registry.register(self)
        self.cycle = self  # dies only in a garbage collection, as a model in a cycle may


def test_armed_by_tells_shared_wrappers_apart_and_forgets_dead_ones():
    import gc

    from mini_ddp.engine.buckets import _ArmedBy

    registry = _ArmedBy()
    shared, own = torch.zeros(2), torch.zeros(3)
    first, second = _Layout(registry, [shared, own]), _Layout(registry, [shared])
    assert registry.claim(first.params, first.ref) is False  # nobody armed before
    assert registry.claim(first.params, first.ref) is False  # the same layout again
    assert registry.claim(second.params, second.ref) is True  # `shared` was first's
    assert registry.holder(shared) is second and registry.holder(own) is first
    assert registry.claim(first.params, first.ref) is True  # and now second's
    del second
    gc.collect()
    assert registry.holder(shared) is first  # second's entries went with it
    first_ref = first.ref
    del first
    gc.collect()
    assert first_ref() is None and registry.holder(shared) is None
    assert registry.holder(own) is None
    assert not registry._entries  # nothing left of dead layouts, cycles included
    third = _Layout(registry, [shared, own])
    assert registry.claim(third.params, third.ref) is False  # dead holders do not count

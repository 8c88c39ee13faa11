"""The cost model on synthetic profiles (no processes), and its profiler on a real tiny model."""

from __future__ import annotations

import pytest
from helpers.ranks import run_ranks

from mini_ddp.engine.config import MIB
from mini_ddp.tools.costmodel import Network, Profile, allreduce_s, buckets_for_cap, predict
from mini_ddp.tools.costmodel_profile import profile_rank

ZERO = Network(0.0, 0.0)
LAN = Network(50e-6, 1 / 1e9)  # 50 us, 1 GB/s


def _profile(copy_out_s: float = 0.0) -> Profile:
    """4 parameters of 2 MiB arriving every 10 ms of a 40 ms backward, in 2 buckets."""
    size = 2 * MIB
    return Profile(forward_s=0.02, backward_s=0.04, copy_out_s=copy_out_s, optimizer_s=0.005,
                   param_ready_s=[0.0, 0.01, 0.02, 0.03], param_bytes=[size] * 4,
                   bucket_ready_s=[0.01, 0.03], bucket_bytes=[2 * size, 2 * size],
                   bucket_params=[[0, 1], [2, 3]])


def test_zero_communication_step_is_the_computation():
    p = _profile()
    for n in (1, 2, 64, 1024):
        got = predict(p, n, ZERO)
        assert got.step_s == pytest.approx(p.forward_s + p.backward_s + p.optimizer_s)
        assert got.exposed_s == 0.0 and got.comm_s == 0.0


def test_one_rank_needs_no_communication_on_any_network():
    assert allreduce_s(1, 1e9, LAN) == 0.0
    assert predict(_profile(), 1, LAN).step_s == pytest.approx(0.065)


def test_ring_formula():
    m = 4 * MIB
    assert allreduce_s(2, m, LAN) == pytest.approx(2 * 50e-6 + m / 1e9)
    assert allreduce_s(8, m, LAN) == pytest.approx(14 * 50e-6 + 2 * 7 / 8 * m / 1e9)


def test_step_and_exposed_grow_monotonically_with_world_size():
    p = _profile(copy_out_s=0.002)
    steps = [predict(p, n, LAN) for n in (2, 4, 8, 16, 64, 256, 1024)]
    for a, b in zip(steps, steps[1:], strict=False):
        assert b.step_s >= a.step_s and b.exposed_s >= a.exposed_s and b.comm_s > a.comm_s


def test_overlap_hides_communication_until_it_outlasts_backward():
    p = _profile()
    fast = predict(p, 2, Network(0.0, 1 / 100e9))  # 4 MiB in 84 us: hidden behind backward
    assert fast.exposed_s == 0.0
    slow = predict(p, 2, Network(0.0, 1 / 0.1e9))   # 42 ms per bucket: serialised, exposed
    # bucket 0 starts at 10 ms, bucket 1 waits for it: ends 10 + 2*41.9 ms after backward start
    assert slow.exposed_s == pytest.approx(0.01 + 2 * 4 * MIB / 0.1e9 - 0.04)


def test_copy_back_after_backward_costs_more_than_overlapped():
    p = _profile(copy_out_s=0.004)
    assert predict(p, 4, LAN, overlap=False).step_s > predict(p, 4, LAN, overlap=True).step_s


def test_rebucketing_keeps_every_byte_and_follows_the_cap():
    p = _profile()
    for cap, expect in ((None, 2), (1.0, 4), (4.0, 2), (100.0, 1)):
        ready, sizes = buckets_for_cap(p, cap)
        assert sum(sizes) == sum(p.param_bytes) and len(sizes) == expect
        assert ready == sorted(ready)
    # Many small buckets pay alpha many times: on a latency-bound network 1 MiB caps lose.
    latency = Network(5e-3, 0.0)
    assert predict(p, 64, latency, cap_mb=1.0).step_s > predict(p, 64, latency,
                                                                  cap_mb=100.0).step_s


@pytest.mark.timeout(180)
def test_profile_of_a_real_tiny_model_is_consistent():
    (prof,) = run_ranks(profile_rank, 1, args=("tiny", 3), timeout_s=150)
    p = Profile(**prof)
    assert len(p.param_ready_s) == len(p.param_bytes) == 6  # 3 layers x (weight, bias)
    assert sum(p.bucket_bytes) == sum(p.param_bytes)
    assert sorted(i for b in p.bucket_params for i in b) == list(range(6))
    assert p.param_ready_s == sorted(p.param_ready_s)
    assert 0 <= max(p.bucket_ready_s) <= p.backward_s
    assert min(p.forward_s, p.backward_s, p.copy_out_s, p.optimizer_s) > 0

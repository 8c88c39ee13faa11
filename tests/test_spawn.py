"""The rank harness reports results, every rank's traceback, dead ranks and hangs."""

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound

from mini_ddp import RanksFailed, run_ranks


def _sum_ranks(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    return ctx.rank


def _hang_on_rank0(ctx):
    if ctx.rank == 0:
        while True:
            time.sleep(0.1)
    return ctx.rank


def _die_on_rank2(ctx):
    if ctx.rank == 2:
        os._exit(7)
    return ctx.rank


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum_ranks, 3, timeout_s=hang_bound(60)) == [3.0, 3.0, 3.0]


def test_a_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RanksFailed) as err:
        run_ranks(_raise_on_rank1, 2, timeout_s=hang_bound(60))
    assert set(err.value.failures) == {1}
    assert "boom on rank 1" in err.value.failures[1]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The harness's temporary folders go here, where no other test run adds any."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_no_folder_is_left_behind_on_success_or_failure(private_tmp):
    assert run_ranks(_sum_ranks, 2, timeout_s=hang_bound(60)) == [1.0, 1.0]
    with pytest.raises(RanksFailed):
        run_ranks(_raise_on_rank1, 2, timeout_s=hang_bound(60))
    assert list(private_tmp.iterdir()) == []


def test_a_hang_becomes_a_failure_with_the_stack(private_tmp):
    start = time.monotonic()
    with pytest.raises(RanksFailed) as err:
        run_ranks(_hang_on_rank0, 2, timeout_s=8)
    assert time.monotonic() - start < hang_bound(30)
    assert "_hang_on_rank0" in err.value.failures[0]
    assert list(private_tmp.iterdir()) == []  # the stack dumps were read, then removed


def test_a_dead_rank_is_named_with_its_exit_code():
    with pytest.raises(RanksFailed) as err:
        run_ranks(_die_on_rank2, 3, timeout_s=hang_bound(60))
    assert "exit code 7" in err.value.failures[2]


def _return_a_tensor(ctx):
    return torch.full((3,), float(ctx.rank))


def test_tensors_come_back_after_the_ranks_exit():
    results = run_ranks(_return_a_tensor, 2, timeout_s=hang_bound(60))
    assert [r.tolist() for r in results] == [[0.0] * 3, [1.0] * 3]


def _store_listeners(ctx):
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore -> the TCPStore client
        store = store.underlying_store
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == store.port:  # 0A: LISTEN
                listening.append(local.split(":")[0])
    return listening


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_harness_store_listens_on_loopback_only():
    for listening in run_ranks(_store_listeners, 2, timeout_s=hang_bound(60)):
        assert listening == ["0100007F"]  # 127.0.0.1, and nothing on tcp6 (no "::")

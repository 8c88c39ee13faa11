"""The shared-memory all-reduce (mini_ddp.transport.shm) is bitwise Gloo's SUM, and fails loudly, not slowly.

Process start-up is the expensive part, so every case that leaves the peers alive runs inside
one ``run_ranks`` call per world size (2, where each element is one addition, and 3, where the
ring's order of additions decides the bits): the ranks compare against ``dist.all_reduce``
themselves (``torch.equal`` and the raw bits) and return verdicts plus a digest of each result,
so the parent can also check that every rank ended with the same bytes. Another call kills
rank 1; a tiny one checks that a single rank gets no transport.
"""

from __future__ import annotations

import errno
import gc
import glob
import hashlib
import json
import os
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks

import mini_ddp.transport.shm as shm_transport
from mini_ddp.engine.buckets import storage_use_count
from mini_ddp.transport import shm_files, shm_sync
from mini_ddp.transport.shm import (
    FILE_PREFIX,
    SHM_DIR,
    SharedMemoryAllreduce,
    ShmAllocationError,
    ShmDesyncError,
    ShmError,
    shm_supported,
)
from mini_ddp.transport.shm_sum import ring_chunk

DTYPES = (torch.float32, torch.float64)
STEPS = 3  # the same buffers reduced again, with new data, step after step
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def _sizes(dtype: torch.dtype) -> list[int]:
    """Empty, tiny (fewer elements than ring chunks), odd, a prime above 2**16, and about
    4 MiB (odd, and more than one 1 MiB ring segment per chunk)."""
    return [0, 1, 2, 3, 5, 1000, 65537, (4 << 20) // dtype.itemsize + 3]


def _data(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Different random values per rank over the whole exponent range, subnormals included,
    plus -0.0, infinities and pairs whose sum overflows, never inf + -inf (NaN payloads are
    the one thing commutativity does not pin down)."""
    g = torch.Generator().manual_seed(10_000 * seed + rank)
    finfo = torch.finfo(dtype)
    low, high = (-149, 127) if dtype == torch.float32 else (-1074, 1023)  # subnormal..max
    mantissa = torch.rand(numel, generator=g, dtype=torch.float64) * 2 - 1  # |m| < 1: finite
    wide = torch.randint(low, high + 1, (numel,), generator=g)
    narrow = torch.randint(-8, 9, (numel,), generator=g)  # similar exponents: real roundings
    use_wide = torch.rand(numel, generator=g) < 0.3
    x = torch.ldexp(mantissa, torch.where(use_wide, wide, narrow)).to(dtype)
    i = torch.arange(numel)
    x[i % 97 == 0] = -0.0  # -0 + -0 = -0
    if rank == 0:
        x[i % 97 == 1] = -0.0  # -0 + x
        x[i % 89 == 5] = float("inf")  # inf + finite
    else:
        x[i % 89 == 7] = -float("inf")  # finite + -inf
    x[i % 89 == 6] = -float("inf")  # -inf + -inf
    x[i % 83 == 3] = finfo.max * 0.75  # overflows to inf
    x[i % 83 == 4] = finfo.tiny / 4  # subnormal + subnormal
    return x


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def _token_maps(token: str) -> int:
    """How many of this process's memory mappings are files of the transport ``token``."""
    with open("/proc/self/maps") as f:
        return sum(f"{FILE_PREFIX}{token}_" in line for line in f)


def _open_segments(files: list[tuple[int, int]]) -> int:
    """This process's open descriptors of the memory files ``files`` (device, inode): a
    segment made again for the same slot has the label of the one before it, not its inode."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            stat = os.stat(f"/proc/self/fd/{fd}")
            count += (stat.st_dev, stat.st_ino) in files
        except OSError:  # the listing's own descriptor, gone
            pass
    return count


def _outcome(fn) -> tuple[str, str, float]:
    """(exception type or 'ok', message, seconds) of ``fn()``."""
    started = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return type(err).__name__, str(err), time.monotonic() - started
    return "ok", "", time.monotonic() - started


def _all_ranks(ctx) -> dict:
    """Rank body: parity with Gloo, then free/close/bad input, then the desync cases."""
    rank, out = ctx.rank, {"tokens": []}
    group = dist.new_group(list(range(ctx.world_size)))
    sub = SharedMemoryAllreduce.create(group)  # a group of every rank: a transport of its own
    assert sub is not None and sub.rank == rank
    sub.close()
    shm = SharedMemoryAllreduce.create()
    assert shm is not None
    out["tokens"].append(shm.token)

    cases = [(n, dtype) for dtype in DTYPES for n in _sizes(dtype)]
    bufs = [shm.allocate(n, dtype) for n, dtype in cases]
    out["fresh"] = [(tuple(b.shape), str(b.dtype), bool(b.eq(0).all()), b.is_contiguous())
                    for b in bufs]
    out["parity"] = []
    for step in range(STEPS):
        wants = []
        for i, ((n, dtype), buf) in enumerate(zip(cases, bufs, strict=True)):
            buf.copy_(_data(rank, n, dtype, seed=100 * step + i))
            wants.append(buf.clone())
        futs = [shm.all_reduce(buf) for buf in bufs]  # all in flight before any wait
        for want in wants:  # Gloo on the default group, from this thread, meanwhile
            dist.all_reduce(want)
        for fut, buf, want, (n, dtype) in zip(futs, bufs, wants, cases, strict=True):
            value = fut.wait()
            bits_equal = torch.equal(buf.view(_BITS[dtype]), want.view(_BITS[dtype]))
            out["parity"].append({
                "case": f"step {step}, {n} x {dtype}", "same_object": value[0] is buf,
                "equal": torch.equal(buf, want), "bits_equal": bits_equal,
                "mismatches": int((buf.view(_BITS[dtype]) != want.view(_BITS[dtype])).sum()),
                "digest": _digest(buf), "use_count": storage_use_count(buf)})
            del value
        del futs

    # Bad input fails at the call, naming what was passed.
    out["bad"] = [_outcome(lambda: shm.all_reduce(torch.zeros(3)))[:2],
                  _outcome(lambda view=bufs[4][1:]: shm.all_reduce(view))[:2],
                  _outcome(lambda: shm.allocate(-1, torch.float32))[:2]]

    # free() drops the transport's references: the own and the peer mapping both go away.
    extra = shm.allocate(1000, torch.float32)
    extra.fill_(rank + 1)
    shm.all_reduce(extra).wait()
    out["extra"] = extra[:3].tolist()
    maps_before = _token_maps(shm.token)
    shm.free(extra)
    out["after_free"] = _outcome(lambda t=extra: shm.all_reduce(t))[:2]
    del extra
    gc.collect()
    out["maps_freed"] = maps_before - _token_maps(shm.token)

    # An allocation that fails on one rank (it cannot create its segment) fails on both; the
    # transport stays usable.
    def no_memory(*_args):
        raise OSError(errno.ENOMEM, "out of memory (injected)")

    with mock.patch.object(shm_files.os, "memfd_create",
                           no_memory if rank == 1 else os.memfd_create):
        out["alloc_error"] = _outcome(lambda: shm.allocate(10, torch.float64))[:2]
    after = shm.allocate(5, torch.float64)
    after.fill_(rank + 0.5)
    shm.all_reduce(after).wait()
    out["after_alloc_error"] = after.tolist()
    del after

    # Segments reserved ahead (a model's constructor does it during its broadcast): taken by
    # the allocation of the same size and dtype, made afresh for another, and a reservation
    # that failed on one rank fails the allocation on every rank.
    made_at_allocation, reserved_files = [], []

    def counted(*args):
        made_at_allocation.append(args[1])
        return shm_files.create_segment(*args)

    def recorded(*args):
        segment = shm_files.create_segment(*args)
        stat = os.fstat(segment.fd)
        reserved_files.append((stat.st_dev, stat.st_ino))
        return segment

    reserving = mock.patch.object(shm_transport, "create_segment", recorded)
    reserving.start()  # until the transport is closed: its last reservation is never taken
    with mock.patch.object(shm_sync, "create_segment", counted):
        shm.reserve([(1000, torch.float32), (7, torch.float64)])
        taken, remade = shm.allocate(1000, torch.float32), shm.allocate(8, torch.float64)
    for t in (taken, remade):
        t.fill_(rank + 1)
        shm.all_reduce(t).wait()
    # The segment taken stays mapped (Python's mmap holds a descriptor of its own); the one
    # reserved for 7 elements is closed.
    out["reserved"] = (made_at_allocation, taken[:2].tolist(), remade[:2].tolist(),
                       _open_segments(reserved_files[1:]))
    with mock.patch.object(shm_files.os, "memfd_create",
                           no_memory if rank == 1 else os.memfd_create):
        shm.reserve([(10, torch.float64)])
        out["reserve_error"] = _outcome(lambda: shm.allocate(10, torch.float64))[:2]
    shm.free(taken)
    shm.free(remade)
    del taken, remade
    shm.reserve([(100, torch.float32)])  # never allocated: closed with the transport

    shm.close()
    shm.close()  # idempotent
    out["closed"] = _outcome(lambda t=bufs[0]: shm.all_reduce(t))[:2]
    reserving.stop()
    out["open_after_close"] = _open_segments(reserved_files[-1:])
    del bufs

    # Desync 1: the ranks reduce different buffers. Both futures fail; so does the next call.
    shm = SharedMemoryAllreduce.create()
    out["tokens"].append(shm.token)
    a, b = shm.allocate(10, torch.float32), shm.allocate(20, torch.float32)
    fut = shm.all_reduce(a if rank == 0 else b)
    out["desync_reduce"] = _outcome(fut.wait)
    out["desync_next"] = _outcome(shm.all_reduce(a).wait)
    shm.close()
    # Desync 2: allocate with different arguments raises at once on both ranks.
    shm = SharedMemoryAllreduce.create()
    out["tokens"].append(shm.token)
    out["desync_allocate"] = _outcome(
        lambda: shm.allocate(10, torch.float32) if rank == 0 else shm.allocate(11, torch.float64))
    shm.close()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict]:
    return run_ranks(_all_ranks, request.param, timeout_s=180)


def test_bitwise_equal_to_gloo_on_both_ranks(ranks: list[dict]) -> None:
    for rank, out in enumerate(ranks):
        for row in out["parity"]:
            assert row["same_object"], (rank, row["case"])
            assert row["equal"] and row["bits_equal"], (rank, row["case"], row["mismatches"])
            assert row["use_count"] == 2, (rank, row["case"], "a view of the buffer lingers")
    expected_rows = STEPS * sum(len(_sizes(d)) for d in DTYPES)
    assert len(ranks[0]["parity"]) == expected_rows
    digests = [[row["digest"] for row in out["parity"]] for out in ranks]
    assert all(d == digests[0] for d in digests), "the ranks ended with different bytes"


def test_allocate_gives_zeroed_flat_buffers(ranks: list[dict]) -> None:
    want = [((n,), str(d), True, True) for d in DTYPES for n in _sizes(d)]
    for out in ranks:
        assert [tuple(x) for x in out["fresh"]] == want
        world = len(ranks)
        assert out["extra"] == [world * (world + 1) / 2] * 3


def test_bad_input_free_and_close(ranks: list[dict]) -> None:
    for out in ranks:
        (kind0, msg0), (kind1, msg1), (kind2, _) = out["bad"]
        assert kind0 == "ValueError" and "shape (3,)" in msg0
        assert kind1 == "ValueError" and "not a view" in msg1
        assert kind2 == "ValueError"
        assert out["after_free"][0] == "ValueError"
        assert out["maps_freed"] == len(ranks), "free() left a mapping alive"
        assert out["closed"][0] == "ShmError" and "closed" in out["closed"][1]


def test_failed_allocation_fails_on_both_ranks_and_transport_survives(
        ranks: list[dict]) -> None:
    for out in ranks:
        kind, message = out["alloc_error"]
        assert kind == ShmAllocationError.__name__, message
        assert "rank 1 could not create" in message
        world = len(ranks)
        assert out["after_alloc_error"] == [sum(r + 0.5 for r in range(world))] * 5


def test_reserved_segments_are_taken_or_closed(ranks: list[dict]) -> None:
    world = len(ranks)
    for out in ranks:
        made_at_allocation, taken, remade, still_open = out["reserved"]
        assert made_at_allocation == [8], made_at_allocation  # only the size not reserved
        assert taken == remade == [world * (world + 1) / 2] * 2
        assert still_open == 0  # the reservation for another size is closed
        kind, message = out["reserve_error"]
        assert kind == ShmAllocationError.__name__, message
        assert "rank 1 could not create" in message and "out of memory (injected)" in \
            " ".join(r["reserve_error"][1] for r in ranks)
        assert out["open_after_close"] == 0


def test_desync_is_a_clear_error_on_both_ranks(ranks: list[dict]) -> None:
    for out in ranks:
        kind, message, _ = out["desync_reduce"]
        assert kind == ShmDesyncError.__name__, message
        assert "rank 0 called all_reduce on slot 0 (10 elements of float32)" in message
        for rank in range(1, len(ranks)):
            assert f"rank {rank} called all_reduce on slot 1 (20 elements of float32)" in message
        kind, message, _ = out["desync_next"]
        assert kind == ShmError.__name__ and "failed earlier" in message
        kind, message, _ = out["desync_allocate"]
        assert kind == ShmDesyncError.__name__, message
        assert "rank 0 called allocate on slot 0 (10 elements of float32)" in message
        for rank in range(1, len(ranks)):
            assert f"rank {rank} called allocate on slot 0 (11 elements of float64)" in message


def test_no_files_left_in_dev_shm(ranks: list[dict]) -> None:
    assert len(set(ranks[0]["tokens"])) == 3
    assert all(out["tokens"] == ranks[0]["tokens"] for out in ranks)
    for token in ranks[0]["tokens"]:
        assert glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{token}*")) == []


def _other_world_size(ctx) -> bool:
    return SharedMemoryAllreduce.create() is None


def test_no_transport_for_one_rank() -> None:
    assert run_ranks(_other_world_size, 1, timeout_s=60) == [True]


def _dead_peer(ctx, outdir: str) -> None:
    shm = SharedMemoryAllreduce.create()
    buf = shm.allocate(1000, torch.float32)
    Path(outdir, f"token{ctx.rank}").write_text(shm.token)
    if ctx.rank == 1:
        time.sleep(0.5)  # rank 0 is waiting in the ready sync by now
        os._exit(1)
    buf.fill_(1.0)
    first = _outcome(shm.all_reduce(buf).wait)
    second = _outcome(shm.all_reduce(buf).wait)
    Path(outdir, f"rank{ctx.rank}.json").write_text(json.dumps({"first": first,
                                                                "second": second}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_dead_peer_fails_the_future_in_bounded_time(tmp_path: Path, world_size: int) -> None:
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_dead_peer, world_size, args=(str(tmp_path),), timeout_s=60,
                  collective_timeout_s=hang_bound(20))
    assert set(failed.value.failures) == {1}, failed.value.failures
    for survivor in set(range(world_size)) - {1}:
        report = json.loads(Path(tmp_path, f"rank{survivor}.json").read_text())
        kind, message, seconds = report["first"]
        assert kind == "CollectiveError" and "shared-memory all-reduce" in message, message
        assert "rank 1 closed its connection" in message, message
        assert seconds < hang_bound(30), seconds
        kind, message, seconds = report["second"]
        assert kind == "ShmError" and "failed earlier" in message, message
        assert seconds < hang_bound(30), seconds
    token = Path(tmp_path, "token0").read_text()
    assert glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{token}*")) == []


def _dead_peer_with_a_forked_child(ctx, outdir: str) -> None:
    shm = SharedMemoryAllreduce.create()
    buf = shm.allocate(1000, torch.float32)
    shm.all_reduce(buf).wait()
    if ctx.rank == 1:
        child = os.fork()  # a DataLoader worker, say: it outlives its parent here
        if child == 0:
            deadline = time.monotonic() + 60
            while not Path(outdir, "done").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)
        Path(outdir, "child").write_text(str(child))
        time.sleep(0.5)  # rank 0 is waiting in the ready sync by now
        os._exit(1)
    try:
        report = _outcome(shm.all_reduce(buf).wait)
    finally:
        Path(outdir, "done").write_text("")
    Path(outdir, f"rank{ctx.rank}.json").write_text(json.dumps(report))


def test_a_forked_child_does_not_keep_its_dead_parents_connection_open(tmp_path: Path) -> None:
    """The child's copies of the transport's sockets are closed at the fork: once the rank is
    gone its peers see the connection close, not wait for the group's timeout."""
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_dead_peer_with_a_forked_child, 2, args=(str(tmp_path),), timeout_s=90,
                  collective_timeout_s=20)
    assert set(failed.value.failures) == {1}, failed.value.failures
    kind, message, _ = json.loads(Path(tmp_path, "rank0.json").read_text())
    assert kind == "CollectiveError" and "rank 1 closed its connection" in message \
        and "most likely died" in message, message


def test_shm_supported() -> None:
    assert shm_supported(torch.float32) and shm_supported(torch.float64)
    assert not shm_supported(torch.float16) and not shm_supported(torch.int64)


def _renewals(ctx) -> dict:
    """Step by step, some rank renews its buffer (keeping a view of the old one); every step's
    result must still equal Gloo's, and the old buffer must keep what it held."""
    shm = SharedMemoryAllreduce.create()
    buf = shm.allocate(1001, torch.float32)
    renew_on = {1: {0}, 2: {1}, 3: {0, 1}, 4: {0}, 5: set()}  # step -> ranks that renew first
    kept, verdicts = [], []
    for step in range(6):
        if ctx.rank in renew_on.get(step, set()):
            old = buf[1:]  # someone still looks at last step's result
            kept.append((old, old.clone()))
            buf = shm.renew(buf)
            assert torch.count_nonzero(buf) == 0 and not shm.owns(old._base)
        data = _data(ctx.rank, buf.numel(), buf.dtype, seed=step)
        buf.copy_(data)
        expected = data.clone()
        dist.all_reduce(expected)
        shm.all_reduce(buf).wait()
        verdicts.append(torch.equal(buf.view(torch.int32), expected.view(torch.int32)))
    intact = all(torch.equal(a, b) for a, b in kept)
    shm.close()
    return {"verdicts": verdicts, "intact": intact, "kept": len(kept), "token": shm.token}


@pytest.mark.parametrize("world_size", [2, 3])
def test_renew_keeps_old_buffer_and_stays_bitwise(world_size: int) -> None:
    results = run_ranks(_renewals, world_size, timeout_s=60)
    for rank, result in enumerate(results):
        assert all(result["verdicts"]), (rank, result["verdicts"])
        assert result["intact"] and result["kept"] == (3, 2, 0)[rank], (rank, result)
    assert glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{results[0]['token']}*")) == []


def _rss_kib(token: str) -> int:
    """Resident KiB of this process's mappings of the transport ``token``'s segments."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = f"{FILE_PREFIX}{token}_" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def _threads(prefix: str) -> int:
    import threading

    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _channel_reuse(ctx) -> dict:
    """Transports on one group share its channel: no vote, one worker thread, their own
    tokens and slots; a rank that names no channel makes every rank open a fresh one."""
    out: dict = {}
    calls: dict[str, int] = {}
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real[name](*args, **kwargs)
        return call

    first = SharedMemoryAllreduce.create()
    with mock.patch.object(dist, "all_reduce", counting("all_reduce")), \
            mock.patch.object(dist, "all_gather", counting("all_gather")):
        second = SharedMemoryAllreduce.create()
    out["reuse_collectives"] = dict(calls)
    out["tokens_differ"] = first.token != second.token
    # Allocation is one exchange and maps nothing of the peers; nothing is populated.
    numel = (4 << 20) // 4
    a, b = first.allocate(numel, torch.float32), second.allocate(1000, torch.float32)
    out["maps_after_allocate"] = _token_maps(first.token)
    out["rss_after_allocate_kib"] = _rss_kib(first.token)
    a.fill_(ctx.rank + 1)
    b.fill_(ctx.rank + 1)
    futs = [first.all_reduce(a), second.all_reduce(b)]
    for fut in futs:
        fut.wait()
    world = ctx.world_size
    out["sums"] = [a[:2].tolist(), b[:2].tolist()]
    out["maps_after_reduce"] = _token_maps(first.token)
    # This rank touched its whole buffer and only its chunk of each peer's.
    out["rss_after_reduce_kib"] = _rss_kib(first.token)
    out["buffer_kib"] = numel * 4 // 1024
    lo, hi = ring_chunk(numel, 4, world, ctx.rank)
    out["chunk_kib"] = (hi - lo) * 4 // 1024
    out["worker_threads"] = _threads("mini_ddp-shm-")
    # Both ranks reduce one buffer of each transport, in different orders: named, not summed.
    fut = (first.all_reduce(a) if ctx.rank == 0 else second.all_reduce(b))
    out["cross_desync"] = _outcome(fut.wait)[:2]
    other = second.all_reduce(b) if ctx.rank == 0 else first.all_reduce(a)
    out["after_desync"] = _outcome(other.wait)[:2]
    # The failed channel is not offered again: the next transport opens a fresh one (votes).
    calls.clear()
    with mock.patch.object(dist, "all_reduce", counting("all_reduce")):
        third = SharedMemoryAllreduce.create()
    out["fresh_after_failure_votes"] = calls.get("all_reduce", 0)
    # A rank that names no channel (as if its own had gone): every rank opens a fresh one,
    # and the channel it replaces is closed on every rank.
    real_offer = SharedMemoryAllreduce.offer

    def forgetful(group=None):
        offer = real_offer(group)
        offer.fields[-1] = 0
        return offer

    calls.clear()
    with mock.patch.object(dist, "all_reduce", counting("all_reduce")), \
            mock.patch.object(SharedMemoryAllreduce, "offer",
                              forgetful if ctx.rank == world - 1 else real_offer):
        fourth = SharedMemoryAllreduce.create()
    out["fresh_when_one_forgets_votes"] = calls.get("all_reduce", 0)
    out["replaced_is_closed"] = _outcome(lambda: third.allocate(3, torch.float32))[:2]
    c = fourth.allocate(7, torch.float64)
    c.fill_(1.0)
    fourth.all_reduce(c).wait()
    out["fourth_sum"] = c[0].item()
    out["worker_threads_end"] = _threads("mini_ddp-shm-")
    for t in (first, second, third, fourth):
        t.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_transports_of_one_group_share_its_channel(world_size: int) -> None:
    for rank, out in enumerate(run_ranks(_channel_reuse, world_size, timeout_s=120)):
        assert out["reuse_collectives"] == {"all_gather": 1}, out  # the offers; no vote
        assert out["tokens_differ"]
        assert out["maps_after_allocate"] == 1 and out["rss_after_allocate_kib"] == 0, out
        assert out["sums"] == [[world_size * (world_size + 1) / 2] * 2] * 2, out
        assert out["maps_after_reduce"] == world_size, out
        # Own buffer whole, of each peer's only the chunk this rank sums (plus the kernel's
        # fault-around, 64 KiB by default, and a page each side), never a peer's whole buffer.
        assert out["rss_after_reduce_kib"] <= out["buffer_kib"] + (world_size - 1) * (
            out["chunk_kib"] + 64 + 8), out
        assert out["worker_threads"] == 1, out
        kind, message = out["cross_desync"]
        assert kind == ShmDesyncError.__name__ and "of the transport" in message, message
        assert out["after_desync"][0] == ShmError.__name__, out
        assert out["fresh_after_failure_votes"] == 2, out
        assert out["fresh_when_one_forgets_votes"] == 2, out
        kind, message = out["replaced_is_closed"]
        assert kind == ShmError.__name__ and "closed" in message, (rank, message)
        assert out["fourth_sum"] == world_size
        assert out["worker_threads_end"] == 1, out  # the replaced channels' threads ended

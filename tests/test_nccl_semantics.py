"""NCCL's semantics, checked on CPU through the logic each one relies on.

NCCL marks a collective's future done when the collective is *enqueued*; only the work's
``is_completed()`` (or a CUDA event behind the future) says the GPU has run it. Fakes stand in
for that here: a future that is done at once and a work / event whose completion flips late.
The same code paths on a real GPU are rows of ``scripts/gpu_check.sh`` (docs/gpus.md).
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers.deadlines import hang_bound, slowdown
from helpers.ranks import run_ranks
from torch import nn

import mini_ddp.engine.model as model_module
from mini_ddp import DataParallelModel
from mini_ddp.engine import comm
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.unused import UnusedSearch
from mini_ddp.transport import wait as wait_module
from mini_ddp.transport.wait import device_probe, wait_done

LATE_S = 0.4


class _LateWork:
    """A ``dist.Work`` as NCCL's looks from the host: its future is done at launch, the GPU
    finishes ``late_s`` later (``late_s`` None: never)."""

    def __init__(self, late_s: float | None, value: object = None):
        self.finish_at = None if late_s is None else time.monotonic() + late_s
        self.future = torch.futures.Future()
        self.future.set_result([torch.zeros(2)] if value is None else value)
        self.polls = self.waits = 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.finish_at is not None and time.monotonic() >= self.finish_at

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self, timeout: object = None) -> bool:
        self.waits += 1
        return True


def test_a_done_future_is_not_enough_when_the_work_is_still_running():
    work = _LateWork(LATE_S)
    start = time.monotonic()
    assert wait_done(work.future, 30.0, work=work)
    assert time.monotonic() - start >= LATE_S - 0.01  # waited for is_completed, not done()
    assert work.polls > 1


def test_the_deadline_fires_on_a_future_done_at_launch():
    work = _LateWork(None)  # a peer that never arrives: NCCL's future is still done at once
    start = time.monotonic()
    assert not wait_done(work.future, 0.3, work=work)
    assert 0.3 <= time.monotonic() - start < hang_bound(2.0)


def test_the_stall_warning_fires_once_while_the_gpu_has_not_finished():
    unit = slowdown()  # the work ends later on a slow machine: the warning still comes first
    work, slow = _LateWork(1.0 * unit), []
    start = time.monotonic()
    assert wait_done(work.future, hang_bound(30.0), stall_after_s=0.2, work=work,
                     on_slow=lambda: slow.append(time.monotonic() - start))
    assert len(slow) == 1 and 0.2 <= slow[0] < 0.9 * unit
    slow.clear()  # a deadline shorter than the warning comes first, alone
    assert not wait_done(_LateWork(None).future, 0.2, stall_after_s=5.0,
                         work=_LateWork(None), on_slow=lambda: slow.append(0.0))
    assert slow == []


def test_cpu_results_have_no_second_layer():
    done = torch.futures.Future()
    done.set_result([torch.ones(3), (torch.zeros(1), {"x": torch.zeros(1)})])
    assert device_probe(done) is None  # Gloo on CPU: the host's done flag is the answer
    failed = torch.futures.Future()
    failed.set_exception(RuntimeError("peer closed"))
    assert device_probe(failed) is None  # the caller's future.wait() raises it
    assert wait_done(failed, 1.0)


class _FakeEvent:
    """A CUDA event whose query() turns True ``LATE_S`` after it was recorded."""

    recorded: list = []

    def record(self, stream: object) -> None:
        self.at = time.monotonic() + LATE_S
        _FakeEvent.recorded.append((stream, _FakeStreamContext.current))

    def query(self) -> bool:
        return time.monotonic() >= self.at


class _FakeStreamContext:
    current: object = "default"

    def __init__(self, stream: object):
        self.stream = stream

    def __enter__(self) -> None:
        self.saved, _FakeStreamContext.current = _FakeStreamContext.current, self.stream

    def __exit__(self, *exc: object) -> None:
        _FakeStreamContext.current = self.saved


class _OrderedFuture:
    """A done future that remembers on which stream ``wait()`` ordered the work."""

    def __init__(self):
        self.waited_on: list = []

    def done(self) -> bool:
        return True

    def value(self) -> list:
        return [torch.zeros(1)]

    def wait(self) -> list:
        self.waited_on.append(_FakeStreamContext.current)
        return self.value()


def test_a_bare_future_on_a_gpu_is_polled_through_an_event_on_a_side_stream(monkeypatch):
    """The reducer's path (a comm hook's future, no work): the event must be recorded on a side
    stream *after* that stream was made to wait for the future, and polled until it fires."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(wait_module, "_cuda_devices", lambda value: [cuda])
    monkeypatch.setattr(wait_module, "_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: f"side stream of {device}")
    monkeypatch.setattr(torch.cuda, "stream", _FakeStreamContext)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.recorded.clear()
    future = _OrderedFuture()
    start = time.monotonic()
    assert wait_done(future, 30.0)
    assert time.monotonic() - start >= LATE_S - 0.01
    side = "side stream of cuda:0"
    assert future.waited_on == [side]  # Future.wait() ordered the side stream, not the caller's
    assert _FakeEvent.recorded == [(side, side)]
    assert _FakeStreamContext.current == "default"  # the caller's stream is restored
    assert not wait_done(_OrderedFuture(), 0.1)  # and the deadline holds on that path too


def test_bounded_broadcast_waits_for_the_work_unbounded_one_never_polls():
    work = _LateWork(None)
    with pytest.raises(RuntimeError, match="no answer within 0.2 s"):
        comm._wait_bounded(work, 0.2)  # done at launch, never completed: a hung peer
    assert work.polls > 0 and work.waits == 0
    quiet = _LateWork(None)
    comm._wait_bounded(quiet, None)  # torch DDP's wait: stream-ordered, no host polling
    assert (quiet.polls, quiet.waits) == (0, 1)
    fine = _LateWork(0.05)
    comm._wait_bounded(fine, 5.0)
    assert fine.waits == 1  # the collective's own error, if any, surfaces from wait()


def test_sync_timeout_resolution_remembers_who_set_it(monkeypatch):
    monkeypatch.setattr("mini_ddp.engine.config.process_group_timeout_s", lambda group: 1800.0)
    default = DataParallelConfig()
    default.resolve_sync_timeout(None)
    default.resolve_sync_timeout(None)  # a second call must not make it "set by the user"
    assert (default.sync_timeout_s, default.sync_timeout_from_user) == (1800.0, False)
    assert default.buffer_sync_timeout_s is None  # gradient waits bounded, buffers not
    mine = DataParallelConfig(sync_timeout_s=5.0)
    mine.resolve_sync_timeout(None)
    assert (mine.sync_timeout_s, mine.buffer_sync_timeout_s) == (5.0, 5.0)


def _buffer_broadcast_timeouts(ctx, sync_timeout_s):
    seen = []
    real = model_module.dist_broadcast_coalesced

    def recording(*args, **kwargs):
        seen.append(kwargs.get("timeout_s"))
        return real(*args, **kwargs)

    model_module.dist_broadcast_coalesced = recording
    torch.manual_seed(0)
    model = DataParallelModel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
                              sync_timeout_s=sync_timeout_s)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    return seen, model.config.sync_timeout_s


@pytest.mark.parametrize("sync_timeout_s", [None, 7.0])
def test_forward_buffer_broadcast_is_bounded_only_when_the_user_said_so(sync_timeout_s):
    # The process group's timeout (what the gradient waits default to) is set, not left to
    # follow the harness's deadline, which grows on a slow machine.
    (seen, resolved), _ = run_ranks(_buffer_broadcast_timeouts, 2, args=(sync_timeout_s,),
                                    timeout_s=90, collective_timeout_s=90)
    # The start-up broadcast (unbounded, as torch DDP's), then the two forwards' broadcasts.
    assert seen == [None, sync_timeout_s, sync_timeout_s]
    assert resolved == (sync_timeout_s or 90.0)  # the gradient waits keep a number


def test_used_map_is_a_host_tensor_and_the_summed_map_a_separate_copy(monkeypatch):
    config = DataParallelConfig(find_unused_parameters=True)
    search = UnusedSearch(3, torch.device("cpu"), config, None, 0)
    assert search.local_used.device.type == "cpu" and not search.local_used.is_pinned()
    search.mark_used(1)
    futures = []

    def wait(future, bucket):
        futures.append(future)

    class _Summed:
        def get_future(self):
            return "the map's future"

    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, group=None, async_op=False: _Summed())
    search.launch_map_reduce(lambda: "the used map")
    # The host map re-zeroed before the (asynchronous) sum has read it: DDP's race, which the
    # staged copy rules out — the summed map still says parameter 1 was used.
    search.local_used.zero_()
    assert not search.globally_unused(1, wait) and search.globally_unused(0, wait)
    assert futures == ["the map's future"]  # waited for once, through the reducer's wait
    search.finish(wait)
    assert search.global_used is None and search.local_used.tolist() == [0, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu_check covers it)")
def test_used_map_for_a_gpu_model_is_pinned_on_the_host():
    search = UnusedSearch(3, torch.device("cuda", 0),
                          DataParallelConfig(find_unused_parameters=True), None, 0)
    assert search.local_used.device.type == "cpu" and search.local_used.is_pinned()

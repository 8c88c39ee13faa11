"""The default stall warning and the default deadline.

A rank that is alive but late is named early — a WARNING on every waiting rank, naming it, the
bucket and its parameters — and the job goes on when it arrives. The hard error waits as long
as torch DDP does: the process group's timeout, unless ``sync_timeout_s`` says otherwise.
"""

import datetime
import logging
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound, slowdown
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp import DataParallelModel, MiniDDPError
from mini_ddp.engine.config import process_group_timeout_s
from mini_ddp.engine.observer import Observers
from mini_ddp.transport.wait import wait_done
from mini_ddp.watch.stall import StallMonitor, StallWatchdog

LATE_RANK, LATE_S, WARN_S = 1, 3.0, 0.5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _capture() -> list[logging.LogRecord]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("mini_ddp").addHandler(handler)
    return records


def _late_rank(ctx, stall_warning_s):
    model = DataParallelModel(_net(), stall_warning_s=stall_warning_s)
    records = _capture()
    x = torch.randn(4, 4)
    for step in range(4):  # steps 1-2 settle the buckets; rank 1 is late in step 3
        if step == 2:  # the happy path so far: the monitor has not even opened the store
            untouched = model.stall_monitor is None or model.stall_monitor._store is None
        loss = model(x * (ctx.rank + 1)).sum()
        if step == 2 and ctx.rank == LATE_RANK:
            time.sleep(LATE_S)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if model.stall_monitor is not None:  # the report runs beside the wait: let it finish
        model.stall_monitor.settle(30)
    return {"warnings": [(r.levelno, r.getMessage()) for r in records], "grads": grads,
            "untouched": untouched}


def test_waiting_ranks_warn_naming_the_late_rank_bucket_and_parameters_then_go_on():
    results = run_ranks(_late_rank, 3, args=(WARN_S,), timeout_s=90)
    for rank in (0, 2):
        warnings = results[rank]["warnings"]
        assert len(warnings) == 1, warnings
        level, message = warnings[0]
        assert level == logging.WARNING
        assert f"stall report from rank {rank} (step 3)" in message
        assert "bucket 0 (2.bias, 2.weight, 0.bias, 0.weight)" in message
        assert f"rank {LATE_RANK}: has not reached bucket 0 of step 3" in message
        assert f"ranks that reached bucket 0: [{2 - rank}]" in message  # the other waiter
    assert results[LATE_RANK]["warnings"] == []  # the late rank waited for nobody
    assert all(r["untouched"] for r in results)
    for rank in (1, 2):  # training went on: every rank holds the same averaged gradients
        for mine, theirs in zip(results[0]["grads"], results[rank]["grads"], strict=True):
            assert torch.equal(mine, theirs)


def test_no_warning_when_turned_off():
    results = run_ranks(_late_rank, 2, args=(None,), timeout_s=90)
    assert [r["warnings"] for r in results] == [[], []]


def _timeouts(ctx):
    default = DataParallelModel(_net()).config.sync_timeout_s
    explicit = DataParallelModel(_net(), sync_timeout_s=12.0).config.sync_timeout_s
    sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=4))
    return default, explicit, process_group_timeout_s(sub)


def test_sync_timeout_defaults_to_the_process_group_timeout():
    for default, explicit, sub in run_ranks(_timeouts, 2, collective_timeout_s=7, timeout_s=60):
        assert (default, explicit, sub) == (7.0, 12.0, 4.0)


def _hang_past_the_group_timeout(ctx):
    model = DataParallelModel(_net())
    x = torch.randn(4, 4)
    model(x).sum().backward()
    start = time.monotonic()
    try:
        loss = model(x).sum()
        if ctx.rank == 1:
            time.sleep(12.0)  # past the group's 4 s: rank 0 must give up, not wait 30 min
        loss.backward()
    except MiniDDPError as error:
        return type(error).__name__, time.monotonic() - start, str(error)
    return None, time.monotonic() - start, ""


def test_a_rank_late_past_the_group_timeout_fails_the_wait_at_that_timeout():
    results = run_ranks(_hang_past_the_group_timeout, 2, collective_timeout_s=4, timeout_s=60)
    kind, waited, message = results[0]
    assert kind is not None, "rank 0 waited out the late rank"
    assert 3.5 < waited < hang_bound(10.0), (waited, message)
    assert "bucket 0" in message


# ---- no processes ----------------------------------------------------------------------------
def test_a_watchdog_puts_the_default_warning_back_when_removed():
    reducer = SimpleNamespace(on_stall=None, stall_after_s=None, observers=Observers())
    default = StallMonitor(reducer, None, 60.0, store=object()).install()
    assert (reducer.on_stall, reducer.stall_after_s) == (default.on_stall, 60.0)
    model = SimpleNamespace(reducer=reducer, process_group=None)
    watchdog = StallWatchdog(model, limit_s=5.0, store=object())
    watchdog.install()
    watchdog.install()  # idempotent
    assert (reducer.on_stall, reducer.stall_after_s) == (watchdog.on_stall, 5.0)
    assert reducer.observers.members == [watchdog]  # it listens to the engine's events
    watchdog.remove()
    assert (reducer.on_stall, reducer.stall_after_s) == (default.on_stall, 60.0)
    default.remove()
    assert (reducer.on_stall, reducer.stall_after_s, reducer.observers.members) == (None, None, [])


def test_the_deadline_counts_from_the_start_of_the_wait_report_included():
    # Every time here is a multiple of one unit, longer on a slow machine, so that the margins
    # (a third of the deadline) hold whatever else the machine runs.
    unit = slowdown()
    slow: list[float] = []
    start = time.monotonic()
    never = torch.futures.Future()
    assert not wait_done(never, 0.6 * unit, stall_after_s=0.2 * unit,
                         on_slow=lambda: (slow.append(time.monotonic() - start),
                                          time.sleep(0.1 * unit)))
    waited = time.monotonic() - start
    assert len(slow) == 1 and 0.2 * unit <= slow[0] < 0.4 * unit
    # not 0.2 + 0.1 + 0.6: the warning does not stretch it
    assert 0.6 * unit <= waited < 0.9 * unit
    slow.clear()
    assert not wait_done(never, 0.2, stall_after_s=5.0, on_slow=lambda: slow.append(0.0))
    assert slow == []  # a deadline shorter than the warning comes first, alone
    done = torch.futures.Future()
    done.set_result(1)
    assert wait_done(done, 0.0, stall_after_s=0.0, on_slow=lambda: slow.append(0.0))
    assert slow == []


if __name__ == "__main__":  # the figures in docs/reliability.md
    late = run_ranks(_late_rank, 3, args=(WARN_S,), timeout_s=90)
    print(f"rank 1 sleeps {LATE_S} s before backward, stall_warning_s={WARN_S}; rank 0 logs:")
    print(late[0]["warnings"][0][1])
    kind, waited, message = run_ranks(_hang_past_the_group_timeout, 2, collective_timeout_s=4,
                                      timeout_s=60)[0]
    print(f"\ngroup timeout 4 s, rank 1 sleeps 12 s: rank 0 raised {kind} after {waited:.2f} s:")
    print(message)

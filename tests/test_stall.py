"""The stall report: a rank that skips a parameter's gradient is named, with the parameter.

The real case: rank 1's loss leaves out one branch. Its bucket never fills, rank 1 never
launches it, its backward returns and its next forward fails; rank 0 launched the bucket and
waits. Both must say "rank 1, parameters branch.weight/branch.bias" — rank 0 within the limit.
"""

import logging
import time

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp import DataParallelModel, MiniDDPError
from mini_ddp.watch.stall import ARRIVAL_GRACE_S, StallReport, StallWatchdog, holds_up

LIMIT_S = 3.0
SYNC_TIMEOUT_S = 60.0  # far above the limit: a report before it comes from the watchdog


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, skip_branch=False):
        h = torch.relu(self.trunk(x))
        if not skip_branch:
            h = h + self.branch(h)
        return self.head(h)


def _skip_on_rank1(ctx, action, peer_stays, sync_timeout_s=SYNC_TIMEOUT_S):
    torch.manual_seed(0)
    # ~52-byte buckets: [head], [branch], [trunk] after the rebuild, in that launch order
    model = DataParallelModel(Branchy(), bucket_cap_mb=0.00005, sync_timeout_s=sync_timeout_s)
    watchdog = StallWatchdog(model, limit_s=LIMIT_S, action=action).install()
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("mini_ddp").addHandler(handler)
    x = torch.randn(4, 4)
    for _ in range(2):  # step 1, then step 2 on the rebuilt buckets
        model(x).sum().backward()
    buckets = [[model.reducer.names[i] for i in b.param_indices] for b in model.reducer.layout.buckets]
    outcome, start = None, time.monotonic()
    try:
        model(x, skip_branch=ctx.rank == 1).sum().backward()  # step 3: rank 1 skips the branch
        model(x).sum().backward()
    except MiniDDPError as error:
        outcome = error
    waited = time.monotonic() - start
    store = dist.distributed_c10d._get_default_store()
    if peer_stays:  # rank 1 stays alive until rank 0 has reported (a stall, not a crash)
        if ctx.rank == 0:
            store.set("test/reported", "1")
        else:
            store.wait(["test/reported"])
    watchdog.remove()
    report = getattr(outcome, "report", None)
    return {"type": type(outcome).__name__, "message": str(outcome), "report": report,
            "waited": waited, "warnings": warnings, "buckets": buckets}


@pytest.fixture(scope="module")
def stalled():
    return run_ranks(_skip_on_rank1, 2, args=("raise", True), timeout_s=120)


def test_waiting_rank_names_the_skipping_rank_and_parameter_within_the_limit(stalled):
    rank0 = stalled[0]
    assert rank0["type"] == "StallError", rank0["message"]
    report: StallReport = rank0["report"]
    assert report.error is None and report.waited_s == LIMIT_S  # the limit fired, no timeout
    assert rank0["waited"] < SYNC_TIMEOUT_S
    assert report.step == 3
    assert report.missing_params == [] and report.pending_buckets == []
    assert set(report.culprits) == {1}
    assert "branch.weight" in report.culprits[1] and "branch.bias" in report.culprits[1]
    assert "rank 1" in rank0["message"] and "branch.weight" in rank0["message"]
    # rank 1 launched bucket 0 (the head) and stopped at the branch's bucket, where rank 0 waits
    assert [sorted(b) for b in rank0["buckets"]] == [
        ["head.bias", "head.weight"], ["branch.bias", "branch.weight"],
        ["trunk.bias", "trunk.weight"]]
    assert report.waiting_for == 1 and "launched 1 of 3" in report.culprits[1]
    assert report.marks[1]["pending"] == [1, 2]


def test_the_skipping_rank_reports_itself_at_its_next_forward(stalled):
    rank1 = stalled[1]
    assert rank1["type"] == "StallError", rank1["message"]
    report: StallReport = rank1["report"]
    assert sorted(report.missing_params) == ["branch.bias", "branch.weight"]
    assert report.rank == 1 and report.waiting_for is None
    assert "rank 1: no gradient for" in rank1["message"]


def test_a_peer_that_died_is_named_from_its_marks():
    rank0, rank1 = run_ranks(_skip_on_rank1, 2, args=("raise", False), timeout_s=120)
    assert rank1["type"] == "StallError"  # ... and then it exits, closing its connections
    assert rank0["type"] == "StallError", rank0["message"]
    report: StallReport = rank0["report"]
    assert report.error is not None or report.waited_s == LIMIT_S  # failed, or stalled
    assert "branch.weight" in report.culprits[1]


def test_warn_mode_logs_the_report_and_keeps_waiting():
    # sync_timeout_s counts from the start of the wait: rank 0 warns at the limit (3 s), waits
    # on, and times out at 4 s.
    rank0, rank1 = run_ranks(_skip_on_rank1, 2, args=("warn", True, LIMIT_S + 1.0),
                             timeout_s=120)
    assert rank0["type"] == "GradSyncTimeout", rank0["message"]
    assert LIMIT_S + 0.9 < rank0["waited"] < LIMIT_S + 1.0 + hang_bound(ARRIVAL_GRACE_S)
    assert any("stall report from rank 0" in w and "branch.weight" in w
               for w in rank0["warnings"])
    assert rank1["type"] == "UnfinishedReductionError"  # the engine's own error, after ...
    assert any("stall report from rank 1" in w for w in rank1["warnings"])  # ... the report


# ---- no processes ----------------------------------------------------------------------------
def test_which_marks_hold_a_bucket_up():
    now = time.time()
    assert "left no mark" in holds_up(None, 3, 1)
    assert "behind" in holds_up({"step": 2, "state": "finalized", "time": now}, 3, 1)
    unfinished = {"step": 3, "state": "ended_unfinished", "launched": 1, "buckets": 4,
                  "missing": ["w"], "pending": [1, 2, 3], "time": now}
    assert "without a gradient for w" in holds_up(unfinished, 3, 1)
    running = {"step": 3, "state": "backward", "launched": 1, "buckets": 4, "time": now}
    assert "not yet bucket 2" in holds_up(running, 3, 2)
    assert holds_up(running, 3, 0) is None  # it launched bucket 0: not the culprit

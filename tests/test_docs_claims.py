"""What the pages say happens, measured, torch DDP beside mini_ddp in the same processes.

* docs/buckets.md, docs/recipes.md and the ladder's rung 3: which collectives a forward under
  ``torch.no_grad()`` issues (the wrapper and torch DDP broadcast buffers there; the rungs
  never do) — why an evaluation on one rank goes through ``model.module``.
* docs/tutorial.md's stall report: a rank that skips a branch fails at its next forward, and
  when it exits the others' all-reduce fails too, at once, not at a timeout.
* docs/recipes.md: shards of different lengths without ``join()`` fail fast.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.ladder import (
    BucketedDataParallel,
    NaiveDataParallel,
    OverlappedDataParallel,
    UnusedAndNoSyncDataParallel,
)

ENGINES = {"torch DDP": DDP, "DataParallelModel": DataParallelModel}
RUNGS = {"naive": NaiveDataParallel, "bucketed": BucketedDataParallel,
         "overlapped": OverlappedDataParallel, "unused_and_no_sync": UnusedAndNoSyncDataParallel}


# ---- a forward under no_grad: which collectives ------------------------------------------
def _collectives_in_no_grad_forward(model: nn.Module, x: torch.Tensor) -> int:
    """How many collectives this rank issued during one forward under no_grad (the process
    group's sequence number counts every collective, broadcasts of buffers included)."""
    group = dist.group.WORLD
    before = group._get_sequence_number_for_group()
    with torch.no_grad():
        model(x)
    return group._get_sequence_number_for_group() - before


def _no_grad_rank(ctx) -> dict[tuple, tuple[int, int, int]]:
    """Every rank runs the same forwards (so nothing hangs) and counts its own collectives:
    a no_grad forward right after wrapping, after a training step, and a second in a row."""
    warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 deprecates broadcast_buffers
    out = {}
    for buffers in (False, True):
        for name, wrap in {**ENGINES, **RUNGS}.items():
            for broadcast in ((True, False) if name in ENGINES else (None,)):
                torch.manual_seed(0)
                net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8) if buffers else nn.ReLU(),
                                    nn.Linear(8, 2))
                model = wrap(net) if broadcast is None else wrap(net, broadcast_buffers=broadcast)
                x = torch.randn(4, 4)
                first = _collectives_in_no_grad_forward(model, x)
                model(x).sum().backward()
                if hasattr(model, "sync_grads"):  # rungs 1 and 2
                    model.sync_grads()
                out[name, buffers, broadcast] = (first, _collectives_in_no_grad_forward(model, x),
                                                 _collectives_in_no_grad_forward(model, x))
    return out


def test_which_no_grad_forwards_issue_a_collective():
    counts = run_ranks(_no_grad_rank, 2, timeout_s=120)[0]
    for buffers in (False, True):
        for broadcast in (True, False):
            torch_ddp = counts["torch DDP", buffers, broadcast]
            assert counts["DataParallelModel", buffers, broadcast] == torch_ddp
            if buffers and broadcast:  # after wrapping and after a training forward, not again
                assert torch_ddp[0] > 0 and torch_ddp[1] > 0 and torch_ddp[2] == 0, torch_ddp
            else:  # no buffers, or broadcast_buffers=False: none
                assert torch_ddp == (0, 0, 0), (buffers, broadcast, torch_ddp)
        for rung in RUNGS:  # the rungs average gradients only: never a buffer broadcast
            assert counts[rung, buffers, None] == (0, 0, 0), (rung, counts[rung, buffers, None])


def _evaluate_through_the_wrapper_on_rank_0(ctx, engine: str) -> str:
    """The mistake: rank 0 evaluates through the wrapper (a BatchNorm model), then every rank
    trains on; rank 0's extra buffer broadcast pairs with the other rank's next collective."""
    torch.manual_seed(0)
    model = ENGINES[engine](nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(ctx.rank * 10 + step))
        model(x).sum().backward()
        if step == 0 and ctx.rank == 0:
            with torch.no_grad():
                model(x)
    return "finished"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_evaluating_through_the_wrapper_on_one_rank_breaks_the_collective_order(engine):
    """Gloo aborts a rank on the mismatch ("Received data size doesn't match expected size"),
    in torch DDP as in mini_ddp: the page's recipe goes through model.module instead."""
    with pytest.raises(RanksFailed) as info:
        run_ranks(_evaluate_through_the_wrapper_on_rank_0, 2, args=(engine,), timeout_s=60,
                  collective_timeout_s=hang_bound(30))
    assert "Timed out" not in str(info.value), str(info.value)


# ---- docs/tutorial.md: one rank skips a branch ---------------------------------------------
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.branch = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, skip):
        h = self.body(x)
        return h if skip else self.branch(h)


def _skips_a_branch(ctx, engine: str) -> str:
    torch.manual_seed(0)
    model = ENGINES[engine](_Branchy())
    try:
        for step in range(3):
            model(torch.randn(2, 4), ctx.rank == 1 and step == 1).sum().backward()
    except RuntimeError as err:  # the rank ends here, as a training script would
        return str(err)
    return "finished"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_rank_that_skips_a_branch_fails_at_its_next_forward_and_the_others_at_once(engine):
    """Rank 1 skips the branch in step 2: its backward returns, its next forward raises torch
    DDP's "Expected to have finished reduction…"; its exit makes rank 0's pending all-reduce
    fail (connection closed or reset by the peer), not wait for the process group's timeout
    (60 s)."""
    rank0, rank1 = run_ranks(_skips_a_branch, 2, args=(engine,), timeout_s=90,
                             collective_timeout_s=hang_bound(60))
    assert "Expected to have finished reduction in the prior iteration" in rank1, rank1
    assert "Timed out" not in rank0, rank0
    assert "closed by peer" in rank0 or "reset by peer" in rank0, rank0  # Gloo says either


# ---- docs/recipes.md: shards of different lengths without join() -------------------------
def _uneven(ctx, engine: str, then_all_reduce: bool) -> str:
    torch.manual_seed(0)
    model = ENGINES[engine](nn.Linear(4, 2))
    try:
        for _ in range(3 if ctx.rank == 0 else 5):  # rank 1 has two batches more
            model(torch.randn(2, 4)).sum().backward()
        if then_all_reduce:  # e.g. a metric, averaged over the ranks
            dist.all_reduce(torch.ones(1))
    except RuntimeError as err:
        return str(err)
    return "finished"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_uneven_inputs_without_join_fail_fast(engine):
    """Without join(): if the short rank exits, the long rank's next all-reduce fails at once
    (its peer is gone), not at the process group's timeout (60 s here)."""
    short, long = run_ranks(_uneven, 2, args=(engine, False), timeout_s=90,
                            collective_timeout_s=hang_bound(60))
    assert short == "finished" and "Timed out" not in long, (short, long)
    assert "closed by peer" in long or "reset by peer" in long, long


def test_uneven_inputs_then_a_metric_all_reduce():
    """Without join(), the short rank goes on to a metric all-reduce. Under torch DDP it pairs
    with the long rank's gradient bucket and Gloo aborts a rank on the size mismatch, at once.
    Under mini_ddp at two ranks on one host the bucket goes through shared memory, so the two
    never pair: the long rank fails at its deadline (``sync_timeout_s``, here the process
    group's 5 s) naming the rank that has not reached the bucket; the short one at Gloo's,
    and where the short rank's timeout ends its group first, the long one fails naming its
    finish mark (docs/recipes.md)."""
    started = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_uneven, 2, args=("torch DDP", True), timeout_s=90,
                  collective_timeout_s=hang_bound(60))
    assert "Timed out" not in str(info.value) and "died" in str(info.value), str(info.value)
    assert time.monotonic() - started < hang_bound(45)  # not the group's timeout
    short, long = run_ranks(_uneven, 2, args=("DataParallelModel", True), timeout_s=90,
                            collective_timeout_s=5)
    assert "Timed out" in short, short
    # Which comes first depends on the machine's load, not on the engine: rank 1's deadline
    # (it waited), or rank 0's own timeout ending its group (its finish mark names uneven
    # inputs). Either names the rank and the bucket it has not reached.
    assert ("waited more than 5.0 s for the all-reduce of bucket 0" in long
            or ("rank 0 finished" in long and "uneven inputs" in long)), long
    assert "rank 0: has not reached bucket 0 of step 4" in long, long

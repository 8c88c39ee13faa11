"""Errors name what they can: the late rank of a timeout with default settings, and what an
interrupted backward left undone.

* Rank 1 of 3 is SIGSTOPped mid-step for longer than a short process-group timeout, with
  ``DataParallelModel``'s defaults (no ``sync_timeout_s``, the stall warning at 60 s): the
  survivors' error — ours at the deadline, or Gloo's own timeout, whichever fires first —
  names rank 1 as the rank that had not arrived, and says it did not answer.
* A communication hook raises once on rank 1; the user catches it and retries: the next
  forward's ``UnfinishedReductionError`` names the bucket whose reduction never finished,
  never an empty list of parameters.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn

from mini_ddp import (
    DataParallelModel,
    MiniDDPError,
    UnfinishedReductionError,
)

PG_TIMEOUT_S = 4.0


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _frozen_rank(ctx) -> dict:
    model = DataParallelModel(_net())  # every setting the default
    x = torch.randn(4, 4)
    for _ in range(2):
        model(x).sum().backward()
    pids = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    try:
        loss = model(x).sum()
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen until a survivor kills it
        loss.backward()
    except MiniDDPError as err:
        try:
            os.kill(pids[1], signal.SIGKILL)  # else this rank's exit waits on its sockets
        except ProcessLookupError:
            pass  # the other survivor was first
        raise RuntimeError(f"caught {type(err).__name__}: {err}") from err
    return {}


@pytest.mark.timeout(200)
def test_a_timeout_with_default_settings_names_the_frozen_rank():
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_frozen_rank, 3, timeout_s=90, collective_timeout_s=PG_TIMEOUT_S)
    failures = failed.value.failures
    for rank in (0, 2):
        text = failures[rank]
        assert "caught GradSyncTimeout" in text or "caught CollectiveError" in text, text
        assert "rank 1: has not reached" in text, text  # the late rank, named
        assert "rank 1 did not answer within" in text, text  # ... and why it says nothing


class _Once:
    """A comm hook that raises the first time it runs on rank 1, then all-reduces."""

    def __init__(self, rank: int):
        self.armed = rank == 1

    def __call__(self, state, bucket):
        if self.armed:
            self.armed = False
            raise RuntimeError("the hook failed once")
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


def _retry(ctx) -> dict:
    model = DataParallelModel(_net())
    x = torch.randn(4, 4)
    model(x).sum().backward()
    model.register_comm_hook(None, _Once(ctx.rank))
    seen = {}
    try:
        model(x).sum().backward()
    except RuntimeError as err:
        seen["first"] = str(err)
    if ctx.rank == 1:
        try:
            model(x).sum().backward()  # the user's retry
        except UnfinishedReductionError as err:
            seen["retry"] = str(err)
        return seen
    # Rank 0 waits for rank 1's all-reduce, which never comes: it fails when rank 1 leaves.
    time.sleep(0.1)
    return seen


@pytest.mark.timeout(200)
def test_the_error_after_a_failed_and_retried_step_names_the_unfinished_bucket():
    results = run_ranks(_retry, 2, timeout_s=90, collective_timeout_s=hang_bound(30))
    assert "the hook failed once" in results[1]["first"], results[1]
    message = results[1]["retry"]
    # torch's sentence first, then what was left undone, never "(indices [])".
    assert message.startswith("mini_ddp: Expected to have finished reduction in the prior "
                              "iteration before starting a new one."), message
    assert "indices []" not in message and "parameters on rank 1: " not in message, message
    assert "every parameter got its gradient" in message, message
    assert "bucket 0 of 1" in message and "was never launched" in message, message
    assert "communication hook" in message, message

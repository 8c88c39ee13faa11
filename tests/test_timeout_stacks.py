"""``GradSyncTimeout`` names the late rank and says where it is, with no stall warning first.

Two ranks; rank 1 is stuck in a gradient hook inside its backward for longer than rank 0's
``sync_timeout_s``. The stall warning is set far later than the deadline, so no warning fires
and nothing has asked rank 1 anything when rank 0 gives up: the timeout itself asks rank 1's
stack responder (through the stall monitor's verbs, bounded by its answer deadline) and the
error message carries the answer after its usual text. With ``stall_warning_s=None`` no rank
runs a responder: the message says the late ranks were not asked.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp import DataParallelModel, GradSyncTimeout
from mini_ddp.watch.flight_log import flight_recorder, read_dumps

TIMEOUT_S = 1.0
STUCK_S = 4.5  # > TIMEOUT_S + the peers' grace to leave their marks (2 s) + the ask
_STUCK = {"on": False, "seconds": STUCK_S}


def slow_grad_hook(grad: torch.Tensor) -> torch.Tensor:
    if _STUCK["on"]:
        time.sleep(_STUCK["seconds"])  # rank 1 is stuck here, inside its backward
    return grad


STUCK_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                  if "time.sleep(_STUCK" in line)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _timed_out(ctx, model: nn.Module, stuck_s: float) -> str | None:
    """One step in which rank 1's gradient hook sleeps ``stuck_s``; rank 0's error text."""
    x = torch.randn(4, 4)
    model(x).sum().backward()  # a first step, so the hang is in a later one
    dist.barrier()
    _STUCK["on"], _STUCK["seconds"] = ctx.rank == 1, stuck_s
    try:
        model(x).sum().backward()
        message = None
    except GradSyncTimeout as err:
        message = str(err)
    _STUCK["on"] = False
    dist.barrier()  # rank 1's late all-reduce has met rank 0's abandoned one
    return message


def _job(ctx, outdir: str) -> dict:
    model = DataParallelModel(_net(), sync_timeout_s=TIMEOUT_S, stall_warning_s=600.0)
    model.module[2].weight.register_hook(slow_grad_hook)
    flight_recorder(model, dump_dir=outdir)
    asked = _timed_out(ctx, model, STUCK_S)
    off = DataParallelModel(_net(), sync_timeout_s=0.5, stall_warning_s=None)
    off.module[2].weight.register_hook(slow_grad_hook)
    not_asked = _timed_out(ctx, off, 1.0)
    return {"asked": asked, "not_asked": not_asked}


def test_a_timeout_without_a_warning_asks_the_late_rank_where_it_is(tmp_path):
    rank0, rank1 = run_ranks(_job, 2, args=(str(tmp_path),), timeout_s=60)
    assert rank1["asked"] is None and rank1["not_asked"] is None  # rank 1 only arrived late
    message = rank0["asked"]
    # The class's own text first, unchanged; the late rank and its stack after it.
    assert message.startswith(f"mini_ddp: rank 0 waited more than {TIMEOUT_S} s for the "
                              "all-reduce of bucket 0 of 1")
    assert "Another rank is probably dead, stuck, or skipped this bucket" in message
    head, _, late = message.partition("(docs/debugging.md).\n")  # the class's text ends there
    assert "rank 1: has not reached bucket 0 of step 2" in late, message
    assert "where rank 1 is (Python stacks, most recent call last):" in late
    assert f"in slow_grad_hook (tests/test_timeout_stacks.py:{STUCK_LINE})" in late, late
    # Taken while rank 1 was stuck (before it arrived): rank 0 did not wait for it.
    assert f"tests/test_timeout_stacks.py:{STUCK_LINE} in slow_grad_hook: time.sleep" in late
    # Both ranks left a dump: rank 0 with the answer, rank 1 as it answered.
    dumps = read_dumps(tmp_path)
    assert dumps[0]["reason"].startswith("GradSyncTimeout: mini_ddp: rank 0 waited")
    assert dumps[0]["peers"]["1"]["answered"]
    assert dumps[1]["reason"].startswith("asked for its stack by rank 0 (rank 0 timed out "
                                         "waiting for bucket 0 of step 2)")
    json.dumps(dumps)  # what the doctor reads stays plain JSON
    # Warnings off: no responder anywhere, and the message says so.
    assert rank0["not_asked"].endswith("The late ranks were not asked where they are: no "
                                       "stall monitor runs (stall_warning_s=None), so no rank "
                                       "has a stack responder."), rank0["not_asked"]

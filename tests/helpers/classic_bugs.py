"""The classic DDP mistakes, each as a small training script a rank runs (docs/debugging.md).

``run_bug(ctx, bug, engine, debug)`` runs one of :data:`BUGS` on this rank with ``engine``
``"mini"`` (DataParallelModel) or ``"torch"`` (torch DDP) and returns what the rank was told:
the exception it raised (type and message), the WARNING+ records of the ``"mini_ddp"``
logger, and its INFO records. Run through :func:`mini_ddp.run_ranks` at world size 2 (Gloo, short timeouts); a rank
that Gloo aborts shows as a dead rank in ``RanksFailed``. ``python tests/helpers/classic_bugs.py
BUG ENGINE [debug|nodebug]`` prints every rank's outcome (how docs/debugging.md's torch column was
measured).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp import DataParallelModel

BUGS = ("none", "uneven", "uneven_joined", "eval_forward", "eval_forward_no_grad", "one_rank_collective", "same_data",
        "load_on_one_rank", "param_added", "eval_mode", "nan", "nan_everywhere", "bypass")
STEPS = 4
WARN_S = 1.5  # the stall warning (and the debug check's warning)
TIMEOUT_S = 4.0  # sync_timeout_s: the debug check's error
# The runs that must be told nothing: no step may last long enough to warn, however busy the
# machine (a warning at WARN_S would be a finding about the machine, not the script).
QUIET = ("none", "uneven_joined")
QUIET_WARN_S = 3600.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def batches(rank: int, bug: str) -> list[torch.Tensor]:
    """This rank's batches: its own shard (one rank has one more under "uneven"), or the same
    batches on every rank under "same_data"."""
    gen = torch.Generator().manual_seed(0 if bug == "same_data" else 100 + rank)
    count = STEPS + (1 if bug.startswith("uneven") and rank == 0 else 0)
    data = [torch.randn(6, 8, generator=gen) for _ in range(count)]
    if (bug == "nan" and rank == 1) or bug == "nan_everywhere":
        data[2][0, 0] = float("nan")  # one bad sample on rank 1 (or on every rank), in step 3
    return data


def detail_group() -> dist.ProcessGroup | None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, a group torch wraps in its ProcessGroupWrapper
    (the default group was made before this rank read the variable); else None: the default."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG") != "DETAIL":
        return None
    dist.set_debug_level_from_env()
    return dist.new_group(list(range(dist.get_world_size())))


def wrap(module: nn.Module, engine: str, debug: bool | None,
         group: dist.ProcessGroup | None, warn_s: float = WARN_S) -> nn.Module:
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(module, process_group=group)
    # The debug check's deadline is sync_timeout_s: short under the switch; else the group's.
    return DataParallelModel(module, stall_warning_s=warn_s,
                             sync_timeout_s=TIMEOUT_S if debug else None,
                             debug=debug, replica_check_every=2, process_group=group)


def train(rank: int, bug: str, engine: str, debug: bool | None) -> None:
    group = detail_group()
    torch.manual_seed(0)
    model = wrap(Net(), engine, debug, group, QUIET_WARN_S if bug in QUIET else WARN_S)
    if bug == "load_on_one_rank" and rank == 0:
        torch.manual_seed(7)
        model.module.load_state_dict(Net().state_dict())  # rank 0 only, after wrapping
    if bug == "param_added":
        model.module.extra = nn.Parameter(torch.zeros(2))  # after wrapping: never synced
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # The fix of "uneven": the loop inside join() (torch's Join context for uneven inputs).
    with model.join() if bug == "uneven_joined" else contextlib.nullcontext():
        loss = steps(model, rank, bug, group, opt)
    if bug == "uneven_joined":  # the next epoch, even: the ranks' step counts now differ by one
        loss = steps(model, rank, "none", group, opt)
    metric = loss.detach().reshape(1)
    dist.all_reduce(metric, group=group)  # both ranks, after the loop: the epoch's loss


def steps(model: nn.Module, rank: int, bug: str, group: dist.ProcessGroup | None,
          opt: torch.optim.Optimizer) -> torch.Tensor:
    """The training loop (with the mistake of ``bug``); returns the last loss."""
    for step, x in enumerate(batches(rank, bug), start=1):
        net = model.module if bug == "bypass" and rank == 1 else model
        out = net(x)
        loss = out.square().mean()
        if bug == "param_added":
            loss = loss + model.module.extra.square().sum() * x.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bug == "eval_forward" and rank == 0 and step == 2:
            model(torch.randn(6, 8))  # evaluation through the wrapper, on rank 0 only
        if bug == "eval_forward_no_grad" and rank == 0 and step == 2:
            with torch.no_grad():
                model(torch.randn(6, 8))
        if bug == "eval_mode" and rank == 0 and step == 1:
            model.eval()  # evaluation mode on rank 0 ... and no model.train() after it
        if bug == "one_rank_collective" and rank == 0 and step % 2 == 0:
            metric = loss.detach().clone()
            dist.all_reduce(metric, group=group)  # a logging metric, all-reduced on rank 0 only
    return loss


def run_bug(ctx, bug: str, engine: str, debug: bool | None = None) -> dict:
    """One rank of ``bug``: what it was told (see the module docstring)."""
    told: list[str] = []
    info: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: (told if record.levelno >= logging.WARNING
                                   else info).append(record.getMessage())
    logging.getLogger("mini_ddp").addHandler(handler)
    logging.getLogger("mini_ddp").setLevel(logging.INFO)
    error = None
    try:
        train(ctx.rank, bug, engine, debug)
    except Exception as exc:  # noqa: BLE001 - what the rank was told is the result
        error = f"{type(exc).__name__}: {exc}"
    finally:
        logging.getLogger("mini_ddp").removeHandler(handler)
    return {"rank": ctx.rank, "error": error, "warnings": told, "info": info}


if __name__ == "__main__":
    from helpers.ranks import RanksFailed, run_ranks

    name, engine_name = sys.argv[1], sys.argv[2]
    flag = {"debug": True, "nodebug": False}.get(sys.argv[3] if len(sys.argv) > 3 else "")
    try:
        outcome = run_ranks(run_bug, 2, (name, engine_name, flag), timeout_s=40,
                            collective_timeout_s=15)
        print(json.dumps(outcome, indent=1))
    except RanksFailed as failed:
        print(str(failed)[-3000:])

"""A model wrapped on a subgroup talks to that group's ranks only, bit for bit like torch DDP.

``process_group=dist.new_group(ranks)`` is how model-parallel and pipeline jobs hand DDP its
data-parallel group. Every collective and store key of the wrapper — the parameter check,
the start-up broadcast, the shared-memory transport's start-up and votes, the replica check,
the debug checks, the stall marks and stack requests — must stay inside that group: a rank
outside it does other work and never joins them, and two wrappers on disjoint groups of one
job must not meet in the store.

Each case trains torch DDP and DataParallelModel on the same group, in the same processes, on
the same data, and compares every gradient after every backward and every parameter and buffer
after every step with ``torch.equal``; with the shared-memory transport on (the default on one
host, and checked to have really run) and off. A rank outside every group computes something of
its own, then meets the others only at the final barrier on the default group.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel

STEPS = 4


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3))


def _outside_work(rank: int) -> float:
    """What a rank outside every group does meanwhile: training of its own, no collective."""
    torch.manual_seed(rank)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        net(torch.randn(5, 6)).sum().backward()
        opt.step()
    with torch.no_grad():
        return float(sum(p.sum() for p in net.parameters()))


def _train_on_group(rank: int, group: dist.ProcessGroup, shm: bool) -> list[str]:
    torch.manual_seed(rank)  # different models per rank: group rank 0's broadcast must win
    net = _net()
    ours = DataParallelModel(copy.deepcopy(net), process_group=group, bucket_cap_mb=0.0005,
                             shared_memory_allreduce=shm, replica_check_every=1, debug=True)
    ref = DDP(copy.deepcopy(net), process_group=group, bucket_cap_mb=0.0005)
    problems = []
    if shm != (ours.transport is not None):
        problems.append(f"transport is {ours.transport} with shared_memory_allreduce={shm}")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=gen)
        for model, opt in zip((ours, ref), opts, strict=True):
            opt.zero_grad()
            F.mse_loss(model(x), torch.zeros(5, 3)).backward()
        for (name, a), b in zip(ours.module.named_parameters(), ref.module.parameters(),
                                strict=True):
            if not torch.equal(a.grad, b.grad):
                problems.append(f"step {step}: grad of {name}")
        for opt in opts:
            opt.step()
        for (name, a), b in zip(ours.module.state_dict().items(),
                                ref.module.state_dict().values(), strict=True):
            if not torch.equal(a, b):
                problems.append(f"step {step}: {name}")
    if shm and ours.transport is not None and not all(
            ours.transport.owns(b.buffer) for b in ours.reducer.layout.buckets):
        problems.append("a bucket is not in shared memory")
    return problems


def _subgroups(ctx, groups: list[list[int]], shm: bool) -> dict[str, object]:
    made = [dist.new_group(ranks) for ranks in groups]  # every rank makes every group
    mine = [(ranks, group) for ranks, group in zip(groups, made, strict=True)
            if ctx.rank in ranks]
    if not mine:
        out = {"outside": _outside_work(ctx.rank)}
    else:
        ranks, group = mine[0]
        out = {"group": ranks, "problems": _train_on_group(ctx.rank, group, shm)}
    dist.barrier()  # the only collective every rank of the job joins
    return out


CASES = {
    "ws3, ranks 0 and 1, rank 2 outside": (3, [[0, 1]]),
    "ws4, two disjoint pairs": (4, [[0, 1], [2, 3]]),
}


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_subgroup_model_matches_torch_ddp_and_leaves_other_ranks_alone(case: str,
                                                                         shm: bool) -> None:
    world_size, groups = CASES[case]
    results = run_ranks(_subgroups, world_size, (groups, shm), timeout_s=180,
                        collective_timeout_s=30)
    for rank, out in enumerate(results):
        if any(rank in g for g in groups):
            assert out["problems"] == [], f"rank {rank}: {out['problems']}"
        else:
            assert "outside" in out


def test_each_group_has_a_store_key_space_of_its_own() -> None:
    from types import SimpleNamespace

    from mini_ddp.watch.bounded_store import group_key_space

    a, b = SimpleNamespace(group_name="tg_a"), SimpleNamespace(group_name="tg_b")
    first_a = group_key_space("board", a)
    # Models on another group in between do not shift a group's numbering.
    assert group_key_space("board", b) != first_a
    assert group_key_space("board", b).startswith("mini_ddp/board/tg_b/")
    second_a = group_key_space("board", a)
    assert first_a.startswith("mini_ddp/board/tg_a/") and second_a != first_a
    assert int(second_a.rsplit("/", 1)[1]) == int(first_a.rsplit("/", 1)[1]) + 1

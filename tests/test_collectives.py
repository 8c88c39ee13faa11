"""Our point-to-point collectives agree with Gloo's, and work as torch DDP comm hooks.

Every case for one world size runs inside a single ``run_ranks`` call (process start-up is the
expensive part); the ranks return (ours, Gloo's) pairs and the parent compares them: exactly for
int64, with torch's default float32 tolerances otherwise (the summation order differs).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.ranks import run_ranks
from torch.distributed import ReduceOp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp.transport.collectives import (
    ALLREDUCES,
    collective_hook,
    ring_allreduce,
    tree_broadcast,
    tree_reduce,
)


def _portable(t: torch.Tensor):
    """Tensors cross the result pipe as numpy arrays: torch pickles a tensor as a handle to
    shared memory, which dies with the rank that sent it."""
    return t.detach().numpy().copy()


LARGE = (1 << 16) + 1  # prime: not divisible by any world size, and big enough to matter
OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "MAX": ReduceOp.MAX,
       "MIN": ReduceOp.MIN, "PRODUCT": ReduceOp.PRODUCT}


def _input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.int64:  # small values keep PRODUCT exact and in range
        return torch.randint(-4, 5, shape, generator=g)
    return torch.randn(shape, generator=g)


def _gloo_reference(x: torch.Tensor, kind: str, op: str, root: int, group, n: int):
    """What dist.* computes for this case. AVG is Gloo's SUM divided by n: older Gloo builds
    have no AVG at all, and this reference works on every torch version."""
    want, gloo_op = x.clone(), OPS["SUM" if op == "AVG" else op]
    if kind == "allreduce":
        dist.all_reduce(want, gloo_op, group=group)
    elif kind == "broadcast":
        dist.broadcast(want, root, group=group)
    else:
        dist.reduce(want, root, gloo_op, group=group)
    if op == "AVG" and (kind == "allreduce" or dist.get_rank() == root):
        want.div_(n)
    return want


def _cases(n: int, full: bool = True):
    """(kind, algorithm, shape, dtype, op, root) for ``n`` ranks; ``full=False`` is a quick subset.

    Sizes: empty, one element, n-1 (fewer than ranks), 2n+1 as a 2-D tensor (not divisible by
    n, and the flat view must alias it) and a large prime size. MIN and PRODUCT, which share
    all their code with MAX and SUM but the reducer, are only tried on the 2-D size.
    """
    shapes = [(0,), (1,), (max(n - 1, 0),), (1, 2 * n + 1), (LARGE,)] if full else [(1, 2 * n + 1)]
    roots = sorted({0, n // 2, n - 1})
    for shape in shapes:
        large = shape == (LARGE,)
        for dtype in (torch.int64, torch.float32) if full else (torch.float32,):
            ops = ["SUM", "MAX"] + (["MIN", "PRODUCT"] if len(shape) == 2 else [])
            ops += ["AVG"] if dtype.is_floating_point else []
            for op in ops:
                for alg in ALLREDUCES:
                    yield "allreduce", alg, shape, dtype, op, 0
            for root in [n - 1] if large else roots:
                yield "broadcast", "tree", shape, dtype, "SUM", root
                for reduce_op in [o for o in ops if o in ("SUM", "MAX", "AVG")]:
                    yield "reduce", "tree", shape, dtype, reduce_op, root


def _run_case(kind, alg, x, op, root, group):
    got = x.clone()
    if kind == "allreduce":
        ret = ALLREDUCES[alg](got, op=OPS[op], group=group)
    elif kind == "broadcast":
        ret = tree_broadcast(got, root, group=group)
    else:
        ret = tree_reduce(got, root, OPS[op], group=group)
    assert ret is got, "collectives return the tensor they were given"
    return got


def _check_against_gloo(ctx):
    """Rank body: every case on WORLD, then on a subgroup of non-consecutive ranks."""
    n, out = ctx.world_size, []
    groups = [(None, list(range(n)))]
    if n >= 4:  # skips ranks, so group ranks != global ranks
        members = [0, 2, 3] if n == 4 else [1, 3, 4]
        groups.append((dist.new_group(members), members))
    for seed, (group, members) in enumerate(groups):
        cases = _cases(len(members), full=group is None)
        for i, (kind, alg, shape, dtype, op, root) in enumerate(cases):
            root = members[root]  # roots are global ranks, like dist.broadcast's src
            label = f"{kind}/{alg}/{list(shape)}/{dtype}/{op}/root={root}/group={members}"
            x = _input(ctx.rank, shape, dtype, seed * 10_000 + i)
            if ctx.rank not in members:  # non-members must not communicate or change anything
                got = _run_case(kind, alg, x, op, root, group)
                out.append((label, _portable(got), _portable(x)))
                continue
            got = _run_case(kind, alg, x, op, root, group)
            want = _gloo_reference(x, kind, op, root, group, len(members))
            if kind != "reduce" or ctx.rank == root:  # reduce defines the result on dst only
                out.append((label, _portable(got), _portable(want)))
    return out


def _compare(per_rank_results) -> None:
    failures = []
    for rank, results in enumerate(per_rank_results):
        for label, got, want in results:
            got, want = torch.from_numpy(got), torch.from_numpy(want)
            try:
                if got.dtype.is_floating_point:
                    torch.testing.assert_close(got, want)
                else:
                    assert torch.equal(got, want), f"{got} != {want}"
            except AssertionError as err:
                failures.append(f"rank {rank} {label}: {str(err)[:300]}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:20])


def _train(ctx, steps: int):
    """Rank body: the same tiny model trained with torch DDP under several comm hooks."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    hooks = {"torch": default_hooks.allreduce_hook}
    hooks.update({name: collective_hook(fn) for name, fn in ALLREDUCES.items()})
    params = {}
    for name, hook in hooks.items():
        model = DDP(copy.deepcopy(base))
        model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + ctx.rank)  # different data on every rank
        for _ in range(steps):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        params[name] = [_portable(t) for p in model.parameters() for t in (p, p.grad)]
    return params


def _rank_body(ctx):
    """Everything one world size checks, so each world size costs one process launch."""
    ddp = _train(ctx, steps=3) if ctx.world_size in (2, 3) else None
    return {"collectives": _check_against_gloo(ctx), "ddp": ddp}


@functools.cache
def _results(world_size: int) -> list[dict]:
    return run_ranks(_rank_body, world_size, timeout_s=120)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_collectives_match_gloo(world_size):
    results = [r["collectives"] for r in _results(world_size)]
    _compare(results)
    assert sum(len(r) for r in results) > 100 * world_size  # the cases really ran


def test_hook_with_torch_ddp_matches_allreduce_hook():
    results = [r["ddp"] for r in _results(3)]
    for rank_params in results:
        for name in ALLREDUCES:
            got = [torch.from_numpy(a) for a in rank_params[name]]
            torch.testing.assert_close(got, [torch.from_numpy(a) for a in rank_params["torch"]])
    for name in ["torch", *ALLREDUCES]:
        for got, want in zip(results[0][name], results[2][name], strict=True):
            assert (got == want).all(), f"{name}: ranks disagree"  # replicas stay in sync


def test_hook_is_bitwise_equal_at_world_size_two():
    # With two ranks every algorithm computes each element as one addition, buf0/2 + buf1/2,
    # and IEEE addition is commutative: so the summation order is the same as Gloo's, and the
    # trained parameters must match to the bit, not just within tolerance.
    results = [r["ddp"] for r in _results(2)]
    for rank_params in results:
        for name in ALLREDUCES:
            for got, want in zip(rank_params[name], rank_params["torch"], strict=True):
                assert (got == want).all(), name


def test_bad_arguments_fail_before_communicating():
    # No process group exists in the test process: these must raise before touching dist.
    with pytest.raises(ValueError, match="contiguous"):
        ring_allreduce(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="AVG"):
        ring_allreduce(torch.zeros(4, dtype=torch.int64), op=ReduceOp.AVG)
    with pytest.raises(ValueError, match="unsupported"):
        ring_allreduce(torch.zeros(4, dtype=torch.int64), op=ReduceOp.BAND)
    with pytest.raises(ValueError, match="contiguous"):
        tree_broadcast(torch.zeros(4, 4).t(), 0)


def test_hook_name_mentions_the_algorithm():
    assert "ring_allreduce" in collective_hook(ring_allreduce).__name__

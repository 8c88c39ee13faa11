"""Uneven inputs: ``Join([ours])`` trains exactly like ``Join([torch DDP])``.

World size 3 with 5, 4 and 3 batches per rank (and the reverse, so that rank 0 — the usual
source of buffers — is the first to run out). Both engines train the same model copy on the
same batches inside their own Join context; afterwards every parameter and buffer must be
bitwise equal to torch's (the arithmetic is the same: a joined rank adds zeros to the sum, and
the divisor is multiplied in as 1/n while copying into the bucket). ``throw_on_early_termination``
must raise on every rank, for both engines.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.ranks import run_ranks
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from mini_ddp import DataParallelModel

WORLD = 3


class _Net(nn.Module):
    """Linear-BatchNorm-Linear, plus a head only ranks >= 1 use (locally unused on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.out = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.body(x)
        return self.out(h) + (self.extra(h) if use_extra else 0)


def _batches(rank: int, counts: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
            for _ in range(counts[rank])]


def _train(model: nn.Module, rank: int, counts: tuple[int, ...], join_kwargs: dict,
           unused: bool) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Join([model], **join_kwargs):
        for x, y in _batches(rank, counts):
            opt.zero_grad()
            out = model(x, use_extra=unused and rank >= 1) if unused else model(x)
            F.cross_entropy(out, y).backward()
            opt.step()
    return model


def _join_cases(ctx) -> list[tuple[str, bool, str]]:
    results = []
    cases = [
        ("5-4-3 divide_by_initial", (5, 4, 3), {}, {}),
        ("3-4-5 (rank 0 joins first)", (3, 4, 5), {}, {}),
        ("5-4-3 divide_by_active", (5, 4, 3), {"divide_by_initial_world_size": False}, {}),
        ("2-5-1 find_unused", (2, 5, 1), {}, {"find_unused_parameters": True}),
        ("4-0-2 a rank without data", (4, 0, 2), {}, {}),
    ]
    for name, counts, join_kwargs, ddp_kwargs in cases:
        torch.manual_seed(0)
        base = _Net()
        if not ddp_kwargs:
            base.extra.requires_grad_(False)  # keep the no-find-unused cases error-free
        mine = copy.deepcopy(base)
        unused = bool(ddp_kwargs)
        theirs = _train(DistributedDataParallel(base, **ddp_kwargs), ctx.rank, counts,
                        join_kwargs, unused).module
        ours = _train(DataParallelModel(mine, **ddp_kwargs), ctx.rank, counts, join_kwargs,
                      unused).module
        bad = [f"{n}: max|diff| {(a.double() - b.double()).abs().max().item():.3g}"
               for (n, a), (_, b) in zip(
                   list(ours.named_parameters()) + list(ours.named_buffers()),
                   list(theirs.named_parameters()) + list(theirs.named_buffers()),
                   strict=True) if not torch.equal(a, b)]
        results.append((name, not bad, "; ".join(bad[:3])))
    return results


def _throw_case(ctx, engine: str) -> str:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = DataParallelModel(net) if engine == "ours" else DistributedDataParallel(net)
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(2 + ctx.rank):
                model(torch.randn(3, 4)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _throw_cases(ctx) -> dict[str, str]:
    return {engine: _throw_case(ctx, engine) for engine in ("torch", "ours")}


@pytest.mark.timeout(240)
def test_uneven_inputs_train_bitwise_like_torch_ddp():
    per_rank = run_ranks(_join_cases, WORLD, timeout_s=200)
    failures = [f"rank {rank}: {name}: {details}" for rank, results in enumerate(per_rank)
                for name, ok, details in results if not ok]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(240)
def test_throw_on_early_termination_raises_on_every_rank_for_both():
    per_rank = run_ranks(_throw_cases, WORLD, timeout_s=200)
    for rank, errors in enumerate(per_rank):
        for engine, message in errors.items():
            # Rank 0 runs out first and says so; the others learn it at their next forward.
            expected = "exhausted all inputs" if rank == 0 else "exhausted inputs"
            assert expected in message, (rank, engine, message)
        assert errors["ours"] == errors["torch"], (rank, errors)

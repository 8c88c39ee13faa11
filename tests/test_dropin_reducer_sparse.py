"""Sparse gradients (``nn.Embedding(sparse=True)``) against torch DDP, bitwise, world size 3."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.ranks import run_ranks
from reducer_parity import train_side_by_side
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel


class Bag(nn.Module):
    """A sparse embedding between two dense layers (its bucket sits between dense ones)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.embed = nn.Embedding(30, 4, sparse=True)
        self.bag = nn.EmbeddingBag(30, 4, mode="sum", sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        h = self.embed(idx).mean(1) + self.bag(idx)
        return self.head(torch.tanh(self.pre(h)))


def _batch(g):
    return torch.randint(0, 30, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)


def _hook(engine):
    engine.register_comm_hook(None, default_hooks.allreduce_hook)


def _run(ctx, kw, hooked, ours_kw=None):
    return train_side_by_side(ctx.rank, Bag, _batch, F.cross_entropy, kw, ours_kw,
                              momentum=0.0, setup=_hook if hooked else None, steps=3)


@pytest.mark.parametrize("kw,hooked", [
    ({}, False),
    ({"bucket_cap_mb": 0.0001}, False),
    ({"gradient_as_bucket_view": True}, False),
    ({}, True),
    ({"find_unused_parameters": True, "bucket_cap_mb": 0.0001}, False),
    ({"static_graph": True, "bucket_cap_mb": 0.0001}, False),
    ({"batched_grad_copy": True, "bucket_cap_mb": 0.0001}, False),
], ids=["default", "tiny-cap", "grad-as-bucket-view", "allreduce-hook", "find-unused",
        "static-graph", "batched"])
def test_sparse_embedding_matches_torch(kw, hooked):
    results = run_ranks(_run, 3, args=(kw, hooked), timeout_s=180)
    assert results == [[], [], []], results


def test_sparse_embedding_two_ranks_shared_memory_path():
    # Two ranks on one host: dense buckets may go through shared memory; the sparse one
    # always goes through Gloo.
    results = run_ranks(_run, 2, args=({}, False, {"shared_memory_min_bytes": 0}), timeout_s=180)
    assert results == [[], []], results


class Skips(nn.Module):
    """The sparse embedding is left out of the graph on every rank."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x)


def _unused_sparse(ctx):
    out = []
    for cls in (DDP, DataParallelModel):
        torch.manual_seed(0)
        model = cls(Skips(), find_unused_parameters=True)
        try:
            model(torch.randn(2, 4)).sum().backward()
            out.append(None)
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    return out


def test_unused_sparse_parameter_raises_torchs_error():
    for ref, ours in run_ranks(_unused_sparse, 2, timeout_s=120):
        assert ref is not None and ours is not None, (ref, ours)
        assert ref[0] == ours[0] == "RuntimeError", (ref, ours)
        assert "Expected sparse gradient to be defined." in ref[1]
        assert "Expected sparse gradient to be defined." in ours[1], ours


def _uneven(ctx):
    torch.manual_seed(1000 + ctx.rank)
    base = Bag()
    out = []
    for cls in (DDP, DataParallelModel):
        model = cls(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            with model.join():
                for step in range(2 + ctx.rank):  # rank 0 runs out first
                    x, y = _batch(torch.Generator().manual_seed(ctx.rank * 100 + step))
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            out.append([p.detach().clone() for p in model.module.parameters()])
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}"[:300])
    ref, ours = out
    if isinstance(ref, str) or isinstance(ours, str):
        return ref if isinstance(ref, str) else None, ours if isinstance(ours, str) else None
    return [torch.equal(a, b) for a, b in zip(ref, ours, strict=True)]


def test_sparse_embedding_with_join():
    # Uneven inputs: joined ranks shadow the sparse bucket's all-reduce with sparse zeros.
    for result in run_ranks(_uneven, 3, timeout_s=120):
        assert result == [True] * 6, result

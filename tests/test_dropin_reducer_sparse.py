"""Sparse gradients (``nn.Embedding(sparse=True)``) against torch DDP, bitwise, world size 3."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reducer_parity import train_side_by_side
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mini_ddp import run_ranks


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


def _run(ctx, kw, hooked):
    return train_side_by_side(ctx.rank, Bag, _batch, F.cross_entropy, kw, momentum=0.0,
                              setup=_hook if hooked else None, steps=3)


@pytest.mark.parametrize("kw,hooked", [
    ({}, False),
    ({"bucket_cap_mb": 0.0001}, False),
    ({"gradient_as_bucket_view": True}, False),
    ({}, True),
    ({"find_unused_parameters": True, "bucket_cap_mb": 0.0001}, False),
], ids=["default", "tiny-cap", "grad-as-bucket-view", "allreduce-hook", "find-unused"])
def test_sparse_embedding_matches_torch(kw, hooked):
    results = run_ranks(_run, 3, args=(kw, hooked), timeout_s=180)
    assert results == [[], [], []], results

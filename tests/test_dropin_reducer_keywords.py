"""skip_all_reduce_unused_params, bucket_cap_mb_list and batched_grad_copy against torch DDP.

Bitwise (``torch.equal``) at world size 3, every gradient after every backward and every
parameter after every step (see reducer_parity.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.ranks import run_ranks
from reducer_parity import train_side_by_side
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class Unused(nn.Module):
    """``never`` gets no gradient on any rank; ``odd`` only on odd steps."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.odd = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.step = 0

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if self.step % 2 == 1:
            h = h + self.odd(h)
        self.step += 1
        return self.head(h)


class NeverUsed(nn.Module):
    """``never`` gets no gradient on any rank, every step (a static graph)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.trunk(x)))


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _batch(g):
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _hook(engine):
    engine.register_comm_hook(None, default_hooks.allreduce_hook)


FACTORIES = {"mlp": _mlp, "unused": Unused, "never": NeverUsed}


def _run(ctx, name, kw, hooked, set_to_none):
    return train_side_by_side(ctx.rank, FACTORIES[name], _batch, F.cross_entropy, kw,
                              setup=_hook if hooked else None, set_to_none=set_to_none,
                              steps=4)


CASES = {
    "cap-list": ("mlp", {"bucket_cap_mb_list": [0.0003, 0.001]}, False, True),
    "cap-list-find-unused": ("unused", {"bucket_cap_mb_list": [0.0002, 0.0005],
                                        "find_unused_parameters": True}, False, True),
    "skip-unused": ("unused", {"skip_all_reduce_unused_params": True,
                               "find_unused_parameters": True, "bucket_cap_mb": 0.0001},
                    False, True),
    "skip-unused-static": ("never", {"skip_all_reduce_unused_params": True,
                                     "static_graph": True, "bucket_cap_mb": 0.0001},
                           False, True),
    "batched": ("mlp", {"batched_grad_copy": True, "bucket_cap_mb": 0.001}, False, True),
    "batched-one-bucket": ("mlp", {"batched_grad_copy": True}, False, True),
    "batched-view": ("mlp", {"batched_grad_copy": True, "gradient_as_bucket_view": True,
                             "bucket_cap_mb": 0.001}, False, False),
    "batched-hook": ("mlp", {"batched_grad_copy": True, "bucket_cap_mb": 0.001}, True, True),
    "batched-static": ("mlp", {"batched_grad_copy": True, "static_graph": True,
                               "bucket_cap_mb": 0.001}, False, True),
    "batched-find-unused": ("unused", {"batched_grad_copy": True,
                                       "find_unused_parameters": True}, False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keyword_matches_torch(case):
    name, kw, hooked, set_to_none = CASES[case]
    results = run_ranks(_run, 3, args=(name, kw, hooked, set_to_none), timeout_s=180)
    assert results == [[], [], []], results


class _Count:
    """Comm-hook state that counts the buckets each engine actually reduces."""

    def __init__(self):
        self.calls = 0


def _counting_hook(state, bucket):
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def _count_launches(ctx, skip):
    counts = []

    def setup(engine):
        state = _Count()
        counts.append(state)
        engine.register_comm_hook(state, _counting_hook)

    kw = {"skip_all_reduce_unused_params": skip, "find_unused_parameters": True,
          "bucket_cap_mb": 0.0001}
    bad = train_side_by_side(ctx.rank, Unused, _batch, F.cross_entropy, kw, setup=setup,
                             steps=4)
    return bad, [c.calls for c in counts]


def test_skip_all_reduce_unused_params_launches_what_torch_launches():
    # The skipped buckets leave no trace in the values (globally unused gradients are left
    # alone either way): the number of reduced buckets is what tells.
    skipped = run_ranks(_count_launches, 3, args=(True,), timeout_s=180)
    full = run_ranks(_count_launches, 3, args=(False,), timeout_s=180)
    for bad, (ref_calls, our_calls) in skipped + full:
        assert bad == [] and ref_calls == our_calls, (bad, ref_calls, our_calls)
    assert skipped[0][1][0] < full[0][1][0]

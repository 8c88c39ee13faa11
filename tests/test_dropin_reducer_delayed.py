"""``delay_all_reduce_named_params`` + ``param_to_hook_all_reduce`` against torch DDP, bitwise.

torch DDP never waits for the delayed all-reduce it launches; each step therefore waits until
Gloo has finished it (a barrier after backward cannot be relied on with Gloo's worker threads,
so the test polls the work queue empty by issuing and waiting a blocking all-reduce on the
same group — Gloo runs one group's collectives in issue order on every rank).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.ranks import run_ranks
from reducer_parity import train_side_by_side
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.c(torch.tanh(self.b(torch.relu(self.a(x))))))


def _batch(g):
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _settle():
    # Gloo keeps one group's collectives in issue order: once a later one is done, the
    # delayed all-reduce torch DDP launched and never waited for is done too.
    dist.barrier()
    time.sleep(0.05)


def _delay_some(ctx):
    kw = {"delay_all_reduce_named_params": lambda m: list(m.b.named_parameters(prefix="b")),
          "param_to_hook_all_reduce": lambda m: m.a.weight}
    return train_side_by_side(ctx.rank, Net, _batch, F.cross_entropy, kw, settle=_settle)


def _trainable(m):
    return [(n, p) for n, p in m.named_parameters() if p.requires_grad]


def _delay_all(ctx, set_to_none):
    """torch 2.14's DDP cannot run this (its first forward raises AttributeError: the
    constructor returned before setting ``_lazy_init_ran``); ours trains, and the delayed
    all-reduce keeps the ranks' parameters identical — except the hook parameter's layer (the
    tensor hook fires while ``a``'s gradients are still being accumulated into the buffer the
    all-reduce reads, in torch DDP as here) and the frozen layer (DDP broadcasts nothing but
    the delayed parameters then)."""
    torch.manual_seed(1000 + ctx.rank)
    m = Net()
    c = copy.deepcopy(m)
    ref = DDP(c, delay_all_reduce_named_params=_trainable(c), param_to_hook_all_reduce=c.a.weight)
    try:
        ref(torch.randn(2, 6))
        torch_runs = True
    except AttributeError:
        torch_runs = False
    ours = DataParallelModel(m, delay_all_reduce_named_params=_trainable(m),
                             param_to_hook_all_reduce=m.a.weight)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(torch.Generator().manual_seed(ctx.rank * 100 + step))
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(ours(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for n, p in m.named_parameters()
                      if not n.startswith(("a.", "frozen."))])
    everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, flat)
    return torch_runs, all(torch.equal(everyone[0], t) for t in everyone)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_delay_every_trainable_parameter(set_to_none):
    results = run_ranks(_delay_all, 3, args=(set_to_none,), timeout_s=120)
    assert results == [(False, True)] * 3, results


def test_delay_some_parameters_matches_torch():
    results = run_ranks(_delay_some, 3, timeout_s=120)
    assert results == [[], [], []], results


def _only_one_given(ctx):
    out = []
    for cls in (DDP, DataParallelModel):
        m = Net()
        try:
            cls(m, delay_all_reduce_named_params=list(m.b.named_parameters(prefix="b")))
        except Exception as e:  # noqa: BLE001
            out.append((type(e), str(e)))
    return out


def _every_parameter(ctx):
    out = []
    for cls in (DDP, DataParallelModel):
        m = nn.Linear(3, 3)
        try:
            cls(m, delay_all_reduce_named_params=list(m.named_parameters()),
                param_to_hook_all_reduce=m.weight)
        except Exception as e:  # noqa: BLE001
            out.append((type(e), str(e)))
    return out


def test_every_parameter_delayed_raises_torchs_value_error():
    (ref, ours), *_ = run_ranks(_every_parameter, 1, timeout_s=60)
    assert ref[0] is ours[0] is ValueError
    assert ref[1] in ours[1]


def test_only_one_keyword_raises_torchs_value_error():
    (ref, ours), *_ = run_ranks(_only_one_given, 1, timeout_s=60)
    assert ref[0] is ours[0] is ValueError
    assert ref[1] in ours[1]


def _deepcopy_keeps_reducing(ctx):
    torch.manual_seed(1000 + ctx.rank)
    m = Net()
    copied = copy.deepcopy(DataParallelModel(
        m, delay_all_reduce_named_params=list(m.b.named_parameters(prefix="b")),
        param_to_hook_all_reduce=m.a.weight))
    x, y = _batch(torch.Generator().manual_seed(ctx.rank))
    F.cross_entropy(copied(x), y).backward()
    grad = copied.module.b.weight.grad.clone()
    everyone = [torch.empty_like(grad) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, grad)
    return all(torch.equal(everyone[0], g) for g in everyone)


def test_deepcopy_of_a_delayed_model_keeps_reducing():
    # torch DDP's copy loses the tensor hook (its delayed parameters then stay local); ours
    # hooks the copied parameter again.
    assert run_ranks(_deepcopy_keeps_reducing, 3, timeout_s=120) == [True] * 3

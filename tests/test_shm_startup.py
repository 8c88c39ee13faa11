"""What wrapping a model costs, counted rather than timed (counts hold on any machine).

Per ``DataParallelModel(...)`` on two and three CPU ranks: the Gloo collectives (the first
model on a group opens its shared-memory channel with two votes; later ones reuse it with
none), the shared-memory transport's socket exchanges (one per bucket allocated: none by
default, where iteration 1's layout is rebuilt at the second forward and Gloo sums it),
segments made while allocating (none where iteration 1's layout lasts: they are reserved on
the transport's worker during the start-up broadcast), threads the constructor itself starts
(none, after the process's first model), walks over the module's tree (one), and memory made
resident in shared memory (none: pages are mapped at their first touch). The gradients still
equal torch DDP's, bit for bit, after a re-wrap, and the rebuilt layout is summed in shared
memory.
"""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
import torch.distributed as dist
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.transport import shm_sync
from mini_ddp.transport.shm import FILE_PREFIX


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(20)], nn.BatchNorm1d(16))


def _resident_kib() -> int:
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                inside = FILE_PREFIX in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def _counted_wraps(ctx) -> dict:
    counts: dict[str, int] = {}
    root: list[nn.Module] = []
    me = threading.current_thread()

    def bump(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    def counting(name, real):
        def call(*args, **kwargs):
            bump(name)
            return real(*args, **kwargs)
        return call

    patches = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "broadcast",
                                                      "all_gather_object")}
    real_exchange, real_start = shm_sync.PeerSync.exchange, threading.Thread.start
    real_walk, real_create = nn.Module.named_modules, shm_sync.create_segment

    def exchange(self, *args, **kwargs):
        bump("socket exchanges")
        return real_exchange(self, *args, **kwargs)

    def start(self):
        if threading.current_thread() is me:
            bump("threads started and waited for")
        return real_start(self)

    def made_while_allocating(*args):  # not reserved ahead, during the broadcast
        bump("segments made while allocating")
        return real_create(*args)

    def walk(self, *args, **kwargs):
        if root and self is root[0]:
            bump("module walks")
        return real_walk(self, *args, **kwargs)

    base, out = _net(), {}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(ctx.rank))
    for name, real in patches.items():
        setattr(dist, name, counting(name, real))
    shm_sync.PeerSync.exchange, threading.Thread.start = exchange, start
    nn.Module.named_modules, shm_sync.create_segment = walk, made_while_allocating
    try:
        for label in ("first", "second", "after a drop", "lasting layout"):
            module = copy.deepcopy(base)
            root[:] = [module]
            gc.collect()
            counts.clear()
            # Searching for unused parameters, DDP keeps iteration 1's layout: shared memory.
            model = DataParallelModel(module,
                                      find_unused_parameters=label == "lasting layout")
            out[label] = {**counts, "resident KiB": _resident_kib()}
            root.clear()
            if label == "second":
                del model
                gc.collect()
            elif label == "first":
                kept = model  # alive while the second is built
            elif label == "after a drop":
                rewrapped = model
    finally:
        for name, real in patches.items():
            setattr(dist, name, real)
        shm_sync.PeerSync.exchange, threading.Thread.start = real_exchange, real_start
        nn.Module.named_modules, shm_sync.create_segment = real_walk, real_create
    # The re-wrapped model still trains as torch DDP does; its rebuilt layout is summed in
    # shared memory.
    model, ref = rewrapped, DDP(copy.deepcopy(base))
    out["equal"], out["buckets in shared memory"] = [], []
    for _ in range(3):
        for m in (model, ref):
            m(x).square().sum().backward()
        out["buckets in shared memory"].append(
            [model.transport.owns(b.buffer) for b in model.reducer.layout.buckets])
        out["equal"].append(all(torch.equal(a.grad, b.grad) for a, b in
                                zip(model.parameters(), ref.parameters(), strict=True)))
    del kept
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_wrapping_counts(world_size: int) -> None:
    for rank, out in enumerate(run_ranks(_counted_wraps, world_size, timeout_s=120)):
        # The parameter check's all-gather (carrying the offers), one broadcast of the state
        # (parameters and float buffers; the int64 batch counter is a second), the votes.
        base = {"all_gather": 1, "broadcast": 2, "module walks": 1, "resident KiB": 0}
        # The first model of the process also starts, once, the thread that starts the stack
        # responders (mini_ddp.watch.stacks); the group's shared-memory worker starts at the
        # first sum there.
        assert out["first"] == {**base, "all_reduce": 2, "threads started and waited for": 1}, \
            (rank, out["first"])
        assert out["second"] == base, (rank, out["second"])
        assert out["after a drop"] == base, (rank, out["after a drop"])
        # Where iteration 1's layout lasts, its bucket is allocated (one exchange) from a
        # segment the worker reserved during the broadcast (the worker starts then).
        assert out["lasting layout"] == {**base, "socket exchanges": 1,
                                         "threads started and waited for": 1}, \
            (rank, out["lasting layout"])
        assert out["equal"] == [True] * 3, (rank, out["equal"])
        # Gloo sums iteration 1's single bucket; the second forward rebuilds it in shared memory.
        shared = out["buckets in shared memory"]
        assert shared[0] == [False] and shared[1] == shared[2] and all(shared[1]), (rank, shared)

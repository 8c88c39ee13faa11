"""Wrappers that come and go: re-wrapping a module trains exactly as torch DDP does.

Fine-tuning, evaluation copies and notebooks wrap the same module more than once. torch DDP
frees a dropped wrapper's reducer at once (no garbage collection needed), and a wrapper still
referenced keeps its hooks but ignores a backward it did not arm for (its reducer expects
hooks only after its own forward). Each scenario runs torch DDP and DataParallelModel through
the same sequence on identical modules, with the garbage collector *disabled*, and compares
every gradient and every parameter with ``torch.equal`` (world size 3: averaging bits differ
between engines that get it wrong; world size 2: the shared-memory transport). A last test
wraps and drops a model 100 times and counts what could leak: live hooks, threads, file
descriptors, shared-memory mappings and ``/dev/shm`` files.
"""

from __future__ import annotations

import copy
import functools
import gc
import glob
import os
import threading
import time
import warnings

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.engine.reducer import Reducer
from mini_ddp.transport.shm import FILE_PREFIX, SHM_DIR


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))


def _step(model: nn.Module, module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One SGD step through ``model`` on ``module``'s parameters; the gradients it saw."""
    for p in module.parameters():
        p.grad = None
    model(x).square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    with torch.no_grad():
        for p in module.parameters():
            p.sub_(0.1 * p.grad)
    return grads


def _sequence(wrap, how: str, rank: int, kwargs: dict) -> list[torch.Tensor]:
    """Run scenario ``how`` with wrapper class ``wrap``; every gradient and final parameter."""
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [torch.randn(4, 6, generator=gen) for _ in range(7)]
    module = _net()
    seen: list[torch.Tensor] = []
    model = wrap(module, **kwargs)
    for x in batches[:2]:
        seen += _step(model, module, x)
    if how == "delete, then wrap again":
        del model
        model = wrap(module, **kwargs)
    elif how == "wrap again, old one kept":
        old = model
        model = wrap(module, **kwargs)
    elif how == "deepcopy the module, wrap the copy":
        module = copy.deepcopy(module)
        model = wrap(module, **kwargs)
    elif how == "deepcopy the wrapper, wrap its module":
        module = copy.deepcopy(model).module
        model = wrap(module, **kwargs)
    for x in batches[2:5]:
        seen += _step(model, module, x)
    if how == "wrap again, old one kept":
        seen += _step(old, module, batches[5])  # back to the old one: it arms, it syncs
        # Both forwards before one backward: both reducers armed, torch DDP reduces in each.
        seen += _step(lambda x: old(x) + model(x), module, batches[6])
    return seen + [p.detach().clone() for p in module.parameters()]


HOWS = ["delete, then wrap again", "wrap again, old one kept",
        "deepcopy the module, wrap the copy", "deepcopy the wrapper, wrap its module"]


def _parity(ctx, kwargs: dict) -> dict[str, list[int]]:
    gc.disable()  # no cycle may be needed to free the old wrapper
    try:
        result = {}
        for how in HOWS:
            ref = _sequence(DDP, how, ctx.rank, {})
            ours = _sequence(DataParallelModel, how, ctx.rank, kwargs)
            assert len(ref) == len(ours)
            result[how] = [i for i, (a, b) in enumerate(zip(ref, ours, strict=True))
                           if not torch.equal(a, b)]
        return result
    finally:
        gc.enable()


@pytest.mark.parametrize("world_size,kwargs", [
    (3, {}),
    (3, {"zero_copy_write_back": True}),
    (2, {"shared_memory_min_bytes": 0}),  # every bucket through shared memory
], ids=["ws3", "ws3-zero-copy", "ws2-shm"])
def test_rewrapping_trains_as_torch_ddp(world_size: int, kwargs: dict) -> None:
    results = run_ranks(_parity, world_size, args=(kwargs,), timeout_s=240)
    for rank, result in enumerate(results):
        assert result == {how: [] for how in HOWS}, f"rank {rank}: mismatching tensors {result}"


def _live_hooks() -> int:
    """Reducer hooks still registered on some live AccumulateGrad node (they hold a partial
    of the reducer's trampoline; the node frees them when it dies)."""
    trampoline = Reducer.__module__
    return sum(1 for o in gc.get_objects() if isinstance(o, functools.partial)
               and getattr(o.func, "__module__", None) == trampoline)


def _counts(tokens: list[str]) -> dict[str, int]:
    with open("/proc/self/maps") as f:
        maps = sum(FILE_PREFIX in line for line in f)
    with warnings.catch_warnings():  # isinstance on torch's deprecated lazy module objects
        warnings.simplefilter("ignore")
        hooks = _live_hooks()
        reducers = sum(1 for o in gc.get_objects() if isinstance(o, Reducer))
    return {"hooks": hooks, "reducers": reducers,
            "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "shm_maps": maps,
            "dev_shm_files": sum(len(glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{t}*")))
                                 for t in tokens)}


def _settled(tokens: list[str], down_to: dict[str, int] | None = None) -> dict[str, int]:
    """Counts once a dropped transport's worker has ended and its group is destroyed: once
    two readings agree, or (``down_to``) once no count is above it. Threads a dropped model
    stops end on their own time (a stack responder leaves its store wait when woken), so
    under load the last models' may still be on their way out: waited for, within a bound."""
    counts, deadline = _counts(tokens), time.monotonic() + hang_bound(10)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        again = _counts(tokens)
        if down_to is not None:
            if all(again[k] <= down_to[k] for k in down_to):
                return again
        elif again == counts:
            break
        counts = again
    return counts


def _cycles(ctx, n: int) -> dict:
    gc.collect()
    gc.disable()
    try:
        module = _net()
        tokens: list[str] = []
        live: list[dict[str, int]] = []
        x = torch.randn(4, 6)

        def cycle() -> None:
            model = DataParallelModel(module, shared_memory_min_bytes=0)
            assert model.transport is not None
            tokens.append(model.transport.token)
            for _ in range(2):  # the second forward rebuilds the buckets
                model(x).sum().backward()
            if not live:
                live.append(_counts(tokens))  # what one live model holds: the counters see it

        for _ in range(3):  # warm-up: first-use allocations (logging, thread pools) are done
            cycle()
        before = _settled(tokens)
        for _ in range(n):
            cycle()
        after = _settled(tokens, down_to=before)
        return {"live": live[0], "before": before, "after": after,
                "transports": len(set(tokens)), "cycles": len(tokens)}
    finally:
        gc.enable()


def test_wrap_and_drop_100_times_leaks_nothing() -> None:
    for rank, result in enumerate(run_ranks(_cycles, 2, args=(100,), timeout_s=300)):
        assert result["transports"] == result["cycles"] == 103, result  # shm, every time
        live, before, after = result["live"], result["before"], result["after"]
        assert live["reducers"] == 1 and live["hooks"] == 4 and live["shm_maps"] > 0, live
        assert live["threads"] > before["threads"], live  # the live model's stack responder
        assert before["reducers"] == 0 and before["hooks"] == 0, before
        assert before["dev_shm_files"] == 0 and before["shm_maps"] == 0, before
        # A descriptor or thread released a little late may make "before" one higher; a leak
        # would add one or more per cycle.
        grown = {k: after[k] - before[k] for k in before if after[k] > before[k]}
        assert grown == {}, f"rank {rank}: before {before}, after 100 cycles {after}"

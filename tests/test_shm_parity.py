"""Ranks on one machine: buckets summed through shared memory train bit for bit like torch DDP.

DataParallelModel sums float buckets of CPU ranks on one machine through
:mod:`mini_ddp.transport.shm` instead of Gloo (``shared_memory_min_bytes=0``, the default, puts
*every* float bucket there). Each case trains torch DDP (Gloo) and DataParallelModel side by
side in the same ranks, at world size 2 and at 3 (where the order of the additions decides
the bits), comparing every gradient
after every backward and every parameter and buffer after every step with ``torch.equal``.
Each case also checks that the shared-memory path really ran (the transport's reduction
count), so a silent fall-back to Gloo cannot pass for it.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.engine.observer import Observer
from mini_ddp.training.models import Seed002CNN, resnet18_cifar

CASES = {
    # name: (model factory, input shape, DDP keywords, steps, no_sync steps)
    "cnn, default caps": (Seed002CNN, (4, 3, 32, 32), {}, 4, ()),
    "resnet18 (BatchNorm), tiny caps": (resnet18_cifar, (2, 3, 32, 32),
                                        {"bucket_cap_mb": 1.0}, 3, ()),
    "cnn, gradient_as_bucket_view": (Seed002CNN, (4, 3, 32, 32),
                                     {"gradient_as_bucket_view": True}, 3, ()),
    "cnn, no_sync every other step": (Seed002CNN, (4, 3, 32, 32), {"bucket_cap_mb": 0.05}, 5,
                                      (1, 3)),
    "cnn, find_unused_parameters": (Seed002CNN, (4, 3, 32, 32),
                                    {"find_unused_parameters": True, "bucket_cap_mb": 0.05}, 3,
                                    ()),
    "cnn, static_graph": (Seed002CNN, (4, 3, 32, 32), {"static_graph": True}, 3, ()),
    "mlp, float64": (lambda: nn.Sequential(nn.Linear(12, 64), nn.Tanh(),
                                           nn.Linear(64, 5)).double(), (6, 12), {}, 3, ()),
}


def _reductions(model: DataParallelModel) -> int:
    transport = model.transport
    return -1 if transport is None else transport._next_slot


def _train_case(ctx, name: str) -> list[str]:
    factory, shape, kwargs, steps, local_steps = CASES[name]
    torch.manual_seed(ctx.rank)  # different models per rank: the start-up broadcast must win
    net = factory()
    ours = DataParallelModel(copy.deepcopy(net), shared_memory_min_bytes=0, **kwargs)
    ref = DDP(copy.deepcopy(net), **kwargs)
    assert ours.transport is not None, "two ranks on one machine must get the transport"
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, ref)]
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    dtype = next(net.parameters()).dtype
    problems = []
    for step in range(steps):
        x = torch.randn(*shape, generator=gen, dtype=dtype)
        for model, opt in zip((ours, ref), opts, strict=True):
            opt.zero_grad(set_to_none=step % 2 == 0)
            if step in local_steps:
                with model.no_sync():
                    F.mse_loss(model(x).float(), torch.ones(1)).backward()
            out = model(x).float()
            F.mse_loss(out, torch.zeros_like(out)).backward()
        for (n, a), b in zip(ours.module.named_parameters(), ref.module.parameters(),
                             strict=True):
            if (a.grad is None) != (b.grad is None) or (
                    a.grad is not None and not torch.equal(a.grad, b.grad)):
                problems.append(f"step {step}: grad of {n}")
        for opt in opts:
            opt.step()
        for (n, a), b in zip(ours.module.state_dict().items(), ref.module.state_dict().values(),
                             strict=True):
            if not torch.equal(a, b):
                problems.append(f"step {step}: {n}")
    if not all(ours.transport.owns(b.buffer) for b in ours.reducer.layout.buckets):
        problems.append("a bucket is not in shared memory")
    if _reductions(ours) == 0:
        problems.append("the shared-memory transport never allocated")
    return problems


def _all_cases(ctx) -> dict[str, list[str]]:
    return {name: _train_case(ctx, name) for name in CASES}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request) -> list[dict[str, list[str]]]:
    return run_ranks(_all_cases, request.param, timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_shared_memory_matches_torch_ddp(results, name: str) -> None:
    for rank, per_case in enumerate(results):
        assert per_case[name] == [], f"rank {rank}: {per_case[name]}"


def _hooked_and_joined(ctx) -> dict[str, object]:
    """A comm hook replaces the transport; Join (uneven inputs) runs on Gloo; both still exact."""
    torch.manual_seed(0)
    net = Seed002CNN()
    out: dict[str, object] = {}
    ours = DataParallelModel(copy.deepcopy(net), shared_memory_min_bytes=0)
    ref = DDP(copy.deepcopy(net))
    for m in (ours, ref):
        m.register_comm_hook(None, default_hooks.allreduce_hook)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        x = torch.randn(4, 3, 32, 32, generator=gen)
        for m in (ours, ref):
            m.zero_grad()
            m(x).sum().backward()
    out["hook equal"] = all(torch.equal(a.grad, b.grad) for a, b in
                            zip(ours.parameters(), ref.parameters(), strict=True))
    ours = DataParallelModel(copy.deepcopy(net), shared_memory_min_bytes=0)
    ref = DDP(copy.deepcopy(net))
    batches = [torch.randn(4, 3, 32, 32, generator=gen) for _ in range(3 + ctx.rank)]
    for m in (ours, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with m.join():
            for x in batches:
                opt.zero_grad()
                m(x).sum().backward()
                opt.step()
    out["join equal"] = all(torch.equal(a, b) for a, b in
                            zip(ours.parameters(), ref.parameters(), strict=True))
    return out


def test_comm_hook_and_join_bypass_the_transport_and_stay_exact() -> None:
    for rank, out in enumerate(run_ranks(_hooked_and_joined, 2, timeout_s=240)):
        assert out == {"hook equal": True, "join equal": True}, (rank, out)



def _die_in_backward(ctx, how: str, outdir: str) -> None:
    """Rank 1 is killed (or stopped) as bucket 1 launches; rank 0 writes what it caught."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 4))
    model = DataParallelModel(net, bucket_cap_mb=0.01, sync_timeout_s=3.0,
                              shared_memory_min_bytes=0)
    trap = _Trap(how, outdir)
    if ctx.rank == 1:
        Path(outdir, "victim.pid").write_text(str(os.getpid()))
        model.reducer.observers.add(trap)
    for step in range(4):
        trap.armed = step == 2
        try:
            model(torch.randn(8, 32)).square().mean().backward()
        except Exception as err:  # noqa: BLE001 - reported to the test
            seconds = time.time() - float(Path(outdir, "failed_at").read_text())
            if how == "stop":  # so that this rank's exit does not wait for the stopped peer
                os.kill(int(Path(outdir, "victim.pid").read_text()), signal.SIGKILL)
            Path(outdir, "rank0.json").write_text(json.dumps(
                {"type": type(err).__name__, "message": str(err), "seconds": seconds}))
            return
    Path(outdir, "rank0.json").write_text(json.dumps({"type": None}))


class _Trap(Observer):
    """An observer that kills or stops this rank when bucket 1 is about to launch (full)."""

    def __init__(self, how: str, outdir: str):
        self.how, self.outdir, self.armed = how, outdir, False

    def bucket_ready(self, reducer, bucket) -> None:
        if self.armed and bucket.index == 1:
            Path(self.outdir, "failed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)


@pytest.mark.parametrize("how, error, bound_s", [("kill", "CollectiveError", 30.0),
                                                 ("stop", "GradSyncTimeout", 3.0 + 30.0)])
def test_dead_or_hung_peer_is_named_through_shared_memory(tmp_path: Path, how: str,
                                                          error: str, bound_s: float) -> None:
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_die_in_backward, 2, args=(how, str(tmp_path)), timeout_s=90,
                  collective_timeout_s=hang_bound(60))
    assert set(failed.value.failures) == {1}, failed.value.failures  # rank 0 exited cleanly
    report = json.loads(Path(tmp_path, "rank0.json").read_text())
    assert report["type"] == error, report
    assert "all-reduce of bucket" in report["message"] and "rank 0" in report["message"]
    if how == "kill":
        assert "through shared memory" in report["message"], report["message"]
    assert report["seconds"] < hang_bound(bound_s), report

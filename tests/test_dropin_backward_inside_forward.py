"""A backward that runs while ``DataParallelModel``'s forward is still running.

Frameworks do this: PyTorch Lightning's manual optimization calls ``manual_backward`` inside
``training_step``, which runs inside DDP's forward. torch DDP synchronises such a backward only
if someone armed the reducer first (Lightning calls ``reducer._rebuild_buckets()`` and
``reducer.prepare_for_backward(loss)``, then clears ``require_backward_grad_sync`` until the
forward returns). Armed, mini_ddp synchronises it bit for bit as torch DDP; unarmed, torch DDP
leaves the first step's gradients local without a word (the ranks drift apart; its bucket
rebuild fails a step later), and mini_ddp raises at once, naming the parameter and the fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.engine.reducer import UnarmedBackwardError


class _StepInsideForward(nn.Module):
    """forward() computes a loss and runs backward on it, as a manual training_step does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        self.wrapper: DDP | None = None  # set to the wrapping engine; not a submodule
        self.arm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.net(x).square().mean()
        wrapper = self.wrapper
        if self.arm and wrapper.require_backward_grad_sync:  # Lightning's prepare_for_backward
            wrapper.require_forward_param_sync = True
            wrapper.reducer._rebuild_buckets()
            wrapper.reducer.prepare_for_backward([])
        loss.backward()
        if self.arm:  # Lightning's on_after_inner_forward
            wrapper.require_backward_grad_sync = False
        return loss.detach()


def _run(engine: type, rank: int, arm: bool, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(5)
    inner = _StepInsideForward()
    inner.arm = arm
    model = engine(inner)
    object.__setattr__(inner, "wrapper", model)  # not registered: no module cycle
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank)))
        model.require_backward_grad_sync = True  # Lightning's on_after_outer_forward
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return [p.detach().clone() for p in model.parameters()]


def _scenarios(ctx: Any) -> dict[str, Any]:
    rank, out = ctx.rank, {}
    theirs, ours = _run(DDP, rank, arm=True), _run(DataParallelModel, rank, arm=True)
    out["armed"] = all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))
    # One step: later, torch's bucket rebuild fails ("initialize_buckets must NOT be called
    # during autograd execution"); the first step itself passes without a word.
    out["torch unarmed"] = [t.sum().item() for t in _run(DDP, rank, arm=False, steps=1)]
    try:
        _run(DataParallelModel, rank, arm=False)
        out["ours unarmed"] = "no error"
    except UnarmedBackwardError as err:
        out["ours unarmed"] = str(err)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 2, timeout_s=90, collective_timeout_s=hang_bound(30))


@pytest.mark.timeout(120)
def test_armed_backward_inside_forward_syncs_bitwise_as_torch_ddp(results):
    assert all(r["armed"] for r in results)


@pytest.mark.timeout(120)
def test_unarmed_backward_inside_forward_is_refused_where_torch_drifts(results):
    # torch DDP: the first step stays local, so the ranks hold different parameters after it.
    assert results[0]["torch unarmed"] != results[1]["torch unarmed"]
    for r in results:
        message = r["ours unarmed"]
        assert "while DataParallelModel's forward was still running" in message, message
        assert "net.2.bias" in message or "net.2.weight" in message, message
        assert "prepare_for_backward" in message

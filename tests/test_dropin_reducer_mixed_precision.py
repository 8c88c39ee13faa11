"""``mixed_precision=_MixedPrecision(...)`` against torch DDP, bitwise, world size 3.

torch DDP's mixed precision creates accelerator streams and events even on CPU (and fails
without an accelerator); in the ranks of this test they are replaced by no-op stand-ins. That
changes nothing on CPU, where every operation already runs in program order — what remains is
exactly torch's sequence of casts, copies, reductions and divisions.
"""

from __future__ import annotations

import functools
import inspect

import cpu_streams
import pytest
import torch
import torch.nn.functional as F
from helpers.ranks import run_ranks
from reducer_parity import train_side_by_side
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from mini_ddp import DataParallelModel


class Net(nn.Module):
    """With a BatchNorm (its buffers need buffer_dtype == param_dtype on CPU) or without."""

    def __init__(self, norm=True):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.b = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.c = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.norm(self.a(x)))
        return self.c(self.frozen(torch.tanh(self.b(h))))


def _batch(g):
    return torch.randn(6, 6, generator=g), torch.randint(0, 3, (6,), generator=g)


def _loss(out, y):
    return F.cross_entropy(out.float(), y)


def _run(ctx, dtypes, kw):
    cpu_streams.install()
    mp = _MixedPrecision(*dtypes)
    # warmup: torch's first iteration reduces an uninitialised buffer (it moves its buckets to
    # param_dtype after making the gradient views, which keep pointing at the old buffer until
    # the rebuild before the second forward), so its first gradients are not reproducible.
    factory = Net if dtypes[2] == dtypes[0] else functools.partial(Net, norm=False)
    kw = dict(kw)
    set_to_none = kw.pop("set_to_none", True)
    return train_side_by_side(ctx.rank, factory, _batch, _loss, {"mixed_precision": mp, **kw},
                              steps=3, warmup=True, set_to_none=set_to_none)


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("dtypes,kw", [
    ((BF16, F32, BF16), {}),
    ((BF16, BF16, None), {"bucket_cap_mb": 0.001}),
    ((F16, F16, F16), {}),
    ((BF16, F32, F32), {"forward_sync_buffers": False}),
    ((BF16, F32, BF16), {"gradient_as_bucket_view": True}),
    ((BF16, BF16, None), {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}),
    ((F16, F16, F16), {"gradient_as_bucket_view": True}),
    ((BF16, F32, BF16), {"gradient_as_bucket_view": True, "set_to_none": False}),
], ids=["bf16-reduce-fp32", "bf16-small-buckets", "fp16", "bf16-no-buffer-sync",
        "bf16-bucket-view", "bf16-bucket-view-small-buckets", "fp16-bucket-view",
        "bf16-bucket-view-zeroed-grads"])
def test_mixed_precision_matches_torch(dtypes, kw):
    missing = set(kw) - set(inspect.signature(DDP).parameters) - {"set_to_none"}
    if missing:  # e.g. forward_sync_buffers, new in torch 2.14's DDP
        pytest.skip(f"torch DDP of this version has no {sorted(missing)}")
    results = run_ranks(_run, 3, args=(dtypes, kw), timeout_s=180)
    assert results == [[], [], []], results


def _no_sync_then_sync(ctx):
    """torch 2.14 cannot accumulate under no_sync() with mixed precision: no comm hook runs in
    the local backward, so the per-forward gradient hooks are never removed and the next
    forward adds a second set — the synced backward then marks each parameter twice."""
    cpu_streams.install()
    out = []
    for cls in (DDP, DataParallelModel):
        torch.manual_seed(0)
        model = cls(Net(), mixed_precision=_MixedPrecision(BF16, F32, BF16))
        x, y = _batch(torch.Generator().manual_seed(ctx.rank))
        try:
            with model.no_sync():
                _loss(model(x), y).backward()
            _loss(model(x), y).backward()
            out.append(None)
        except RuntimeError as e:
            out.append(str(e))
    return out


def test_mixed_precision_no_sync_fails_as_in_torch():
    sentence = "Expected to mark a variable ready only once."
    for ref, ours in run_ranks(_no_sync_then_sync, 2, timeout_s=120):
        assert ref is not None and sentence in ref, ref
        assert ours is not None and sentence in ours, ours


def _bucket_view_grads_per_step(ctx):
    """The gradient each engine hands out at steps 1 and 2 (after the warm-up)."""
    cpu_streams.install()
    out = []
    for cls in (DDP, DataParallelModel):
        torch.manual_seed(ctx.rank)
        model = cls(Net(), mixed_precision=_MixedPrecision(BF16, F32, BF16),
                    gradient_as_bucket_view=True)
        grads = []
        for step in range(3):
            model.zero_grad(set_to_none=True)
            x, y = _batch(torch.Generator().manual_seed(ctx.rank * 10 + step))
            _loss(model(x), y).backward()
            grads.append(model.module.c.weight.grad.clone())
        out.append(torch.equal(grads[1], grads[2]))
    return out


def test_mixed_precision_bucket_view_gradients_stay_those_of_the_first_synced_step():
    """torch 2.14's comm hook rebinds ``.grad``'s data, which with gradient_as_bucket_view is
    the reducer's bucket view itself: later gradients are written into that detached tensor,
    the bucket keeps its old contents, and every later step reduces those again. We match."""
    for ref, ours in run_ranks(_bucket_view_grads_per_step, 3, timeout_s=120):
        assert ref and ours


def test_mixed_precision_with_bucket_view_warns_that_gradients_go_stale(one_rank_group,
                                                                       monkeypatch):
    """The combination is accepted (as torch DDP does) but never silently."""
    import torch.distributed._functional_collectives  # noqa: F401 - torch's setup needs it

    monkeypatch.setattr(torch, "Stream", cpu_streams.NullStream)
    monkeypatch.setattr(torch, "Event", cpu_streams.NullEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream",
                        lambda *a, **k: cpu_streams.NullCurrentStream())
    with pytest.warns(UserWarning, match="stale gradients.*gradient_as_bucket_view=False"):
        DataParallelModel(Net(), gradient_as_bucket_view=True,
                          mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))

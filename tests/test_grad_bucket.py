"""What a comm hook sees through ``bucket.gradients()`` matches torch DDP's ``dist.GradBucket``.

A channels-last convolution is the case that tells view makers apart: the bucket's own views
keep the parameter's strides (so ``.grad`` is channels-last, as AccumulateGrad makes it), but
torch's ``GradBucket.gradients()`` slices the flat buffer and views each slice with the shape
only — contiguous strides over the same memory. A hook that inspects the gradients must see
the same shapes, strides and values under both. World size 3, a tiny cap for several buckets,
two steps (before and after the rebuild in gradient order).
"""

from __future__ import annotations

from typing import Any

import torch
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).to(
        memory_format=torch.channels_last)


def _recording_hook(seen: list) -> Any:
    # Unannotated: with postponed annotations, DDP's registration check refuses the strings.
    def hook(state, bucket):  # noqa: ANN001, ANN202
        seen.append([(tuple(g.shape), g.stride(), g.clone()) for g in bucket.gradients()])
        fut = torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(torch.distributed.get_world_size()))
    return hook


def _compare(ctx: Any) -> dict[str, Any]:
    ours, theirs = DataParallelModel(_model(), bucket_cap_mb=0.0002), \
        DDP(_model(), bucket_cap_mb=0.0002)
    seen_ours: list = []
    seen_theirs: list = []
    ours.register_comm_hook(None, _recording_hook(seen_ours))
    theirs.register_comm_hook(None, _recording_hook(seen_theirs))
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    problems = []
    for step in range(2):
        x = torch.randn(2, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
        for model in (ours, theirs):
            model.zero_grad()
            model(x).square().sum().backward()
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters(),
                                strict=True):
            if not torch.equal(a.grad, b.grad) or a.grad.stride() != b.grad.stride():
                problems.append(f"step {step}: .grad of {name} differs")
    if len(seen_ours) != len(seen_theirs):
        problems.append(f"{len(seen_ours)} hook calls, torch made {len(seen_theirs)}")
    for call, (mine, torchs) in enumerate(zip(seen_ours, seen_theirs, strict=False)):
        for (shape, stride, value), (t_shape, t_stride, t_value) in zip(mine, torchs,
                                                                          strict=True):
            if shape != t_shape or stride != t_stride or not torch.equal(value, t_value):
                problems.append(f"hook call {call}: {shape}/{stride} vs torch's "
                                f"{t_shape}/{t_stride}, values equal: "
                                f"{torch.equal(value, t_value)}")
    weight_strides = [s for call in seen_ours for (shape, s, _) in call if len(shape) == 4]
    return {"problems": problems, "strides": weight_strides}


def test_gradients_match_torch_grad_bucket_for_channels_last() -> None:
    results = run_ranks(_compare, 3, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"
    # The case is meaningful only if a 4-D weight went through a hook: contiguous strides.
    assert (4, 1, 1, 1) in results[0]["strides"] or (27, 9, 3, 1) in results[0]["strides"]

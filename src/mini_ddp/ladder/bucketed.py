"""Rung 2 — buckets: pack the gradients into a few flat buffers, one all-reduce per buffer.

Over rung 1 (:mod:`mini_ddp.ladder.naive`) this adds the first thing DDP does to cut the
number of collectives: *gradient buckets*. Parameters are grouped, in reverse definition order
(the last layers' gradients are computed first in backward), into buckets of about
``bucket_cap_mb`` MiB; the first bucket is kept small (1 MiB) so that, once buckets are sent
during backward (rung 3), the first message can leave early. Each bucket is one flat tensor;
each gradient is copied into its slice, the whole buffer is all-reduced at once, and the
slices are copied back into ``.grad``. Tens of parameters become one or two collectives.

The grouping is DDP's own, from :func:`mini_ddp.engine.buckets.assign_buckets`. The copy into
the bucket is also where DDP averages: it *multiplies* each gradient by ``1/world_size`` while
copying (``torch.mul(grad, 1/world_size, out=slice)``), then all-reduces with SUM. We do the
same.

Still missing: nothing is sent until ``backward()`` has finished. And DDP's layout is not
fixed: it starts with one bucket per dtype, and after the first backward re-packs the buckets
in the order the gradients actually arrived. Rung 3 (:mod:`mini_ddp.ladder.overlapped`) does
both, and with them reproduces DDP bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp.engine.buckets import DEFAULT_BUCKET_CAP_MB, MIB, assign_buckets
from mini_ddp.ladder.naive import broadcast_from_rank0

FIRST_BUCKET_MB = 1  # DDP's first_bucket_bytes_cap: a small first bucket, sent early


def size_limits(bucket_cap_mb: float | None) -> list[int]:
    """DDP's bucket caps in bytes: ``[1 MiB, cap]``, or just ``[cap]`` when the user chose one."""
    if bucket_cap_mb is None:
        return [FIRST_BUCKET_MB * MIB, DEFAULT_BUCKET_CAP_MB * MIB]
    return [int(bucket_cap_mb * MIB)]


def flat_buckets(params: Sequence[torch.Tensor], layout: list[list[int]]
                 ) -> list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]]:
    """One zero-filled flat buffer per bucket and, for each parameter in it, its view there."""
    buckets = []
    for indices in layout:
        buffer = torch.zeros(sum(params[i].numel() for i in indices),
                             dtype=params[indices[0]].dtype, device=params[indices[0]].device)
        views, offset = [], 0
        for i in indices:
            views.append((i, buffer[offset:offset + params[i].numel()].view_as(params[i])))
            offset += params[i].numel()
        buckets.append((buffer, views))
    return buckets


class BucketedDataParallel(nn.Module):
    """Wrap ``module``; call :meth:`sync_grads` between ``backward()`` and the optimizer step."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        broadcast_from_rank0(module, group)  # start from rank 0's model, as in rung 1
        self.params = [p for p in module.parameters() if p.requires_grad]
        # assign_buckets walks the parameters in definition order; reversing the list of
        # buckets puts the last layers (whose gradients backward produces first) in bucket 0.
        layout = list(reversed(assign_buckets(self.params, size_limits(bucket_cap_mb))))
        self.buckets = flat_buckets(self.params, layout)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Just the wrapped module's forward: all the work happens in :meth:`sync_grads`."""
        return self.module(*inputs, **kwargs)

    def sync_grads(self) -> None:
        """Average every ``.grad`` over the ranks, one SUM all-reduce per bucket."""
        scale = 1.0 / self.world_size
        for buffer, views in self.buckets:
            for i, view in views:
                # DDP's averaging: multiply while copying in (x * (1/3) is not x / 3 in fp32).
                torch.mul(self.params[i].grad, scale, out=view)
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
            for i, view in views:
                self.params[i].grad.copy_(view)

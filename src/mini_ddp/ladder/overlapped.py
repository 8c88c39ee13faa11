"""Rung 3 — overlap: send each bucket while backward is still computing the rest.

Over rung 2 (:mod:`mini_ddp.ladder.bucketed`) this moves the work *into* ``backward()``:

1. A hook on every parameter (``register_post_accumulate_grad_hook``) fires as soon as autograd
   has written that parameter's ``.grad``. It copies the gradient into its bucket slice,
   multiplied by ``1/world_size`` (DDP's averaging), and counts the bucket down.
2. A bucket whose last gradient arrived is launched at once as an *asynchronous* all-reduce —
   but only after every earlier bucket has been launched, so all ranks issue the same
   collectives in the same order (otherwise two ranks could sum different buckets together).
3. A callback queued on the autograd engine runs when backward ends: it waits for every
   bucket and copies the averaged slices back into ``.grad``.

So the optimizer needs no extra call: after ``loss.backward()`` the gradients are averaged.

DDP's bucket layout changes once, and the bits depend on it (Gloo's summation order depends on
an element's position in the flat buffer). The first backward uses ONE bucket per dtype, in
definition order, and records the order in which gradients arrive. Before the next forward
the buckets are rebuilt over that order with DDP's caps (1 MiB first, then ``bucket_cap_mb``)
and rank 0's layout is adopted by all. With that, this rung gives torch DDP's gradients bit
for bit (``tests/test_ladder.py``, at three ranks).

What the full engine (:class:`mini_ddp.DataParallelModel`) adds: unused parameters,
``no_sync``, buffer broadcasts, comm hooks, static graphs, join, and readable errors.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp.engine.buckets import agree_on_layout, assign_buckets
from mini_ddp.ladder.bucketed import flat_buckets, size_limits
from mini_ddp.ladder.naive import broadcast_from_rank0


class OverlappedDataParallel(nn.Module):
    """Wrap ``module``; ``loss.backward()`` leaves every ``.grad`` averaged over the ranks."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        broadcast_from_rank0(module, group)  # start from rank 0's model, as in rung 1
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.limits = size_limits(bucket_cap_mb)
        # Iteration 1: one bucket per dtype/device (no cap), as DDP does before it knows the
        # order in which gradients arrive.
        self.install(list(reversed(assign_buckets(self.params, [sys.maxsize]))))
        self.arrival_order: list[int] | None = []  # recorded in the first backward only
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(
                lambda p, index=index: self.on_grad_ready(index))
        self.begin_backward()

    def install(self, layout: list[list[int]]) -> None:
        """Make the flat buckets for ``layout`` and a map: parameter -> (bucket, view)."""
        self.layout = layout
        self.buckets = flat_buckets(self.params, layout)
        self.where = {i: (b, view) for b, (_, views) in enumerate(self.buckets)
                      for i, view in views}

    def begin_backward(self) -> None:
        """Reset the per-backward state: every bucket waits for all its gradients again."""
        self.missing = [len(views) for _, views in self.buckets]
        self.works: list[Any] = []  # one async all-reduce per launched bucket, in order
        self.finish_queued = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Rebuild the buckets once (before the second forward), then run the module."""
        if self.arrival_order:  # the first backward has run: re-pack in its order
            layout = assign_buckets(self.params, self.limits, order=self.arrival_order)
            self.install(agree_on_layout(layout, self.group, self.params[0].device))
            self.arrival_order = None
            self.begin_backward()
        return self.module(*inputs, **kwargs)

    def on_grad_ready(self, index: int) -> None:
        """Hook: ``.grad`` of parameter ``index`` is final for this backward."""
        if not self.finish_queued:  # first hook of this backward
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.finish_queued = True
        if self.arrival_order is not None:
            self.arrival_order.append(index)
        bucket, view = self.where[index]
        # DDP's averaging: multiply while copying in (x * (1/3) is not x / 3 in fp32).
        torch.mul(self.params[index].grad, 1.0 / self.world_size, out=view)
        self.missing[bucket] -= 1
        # Launch every full bucket whose predecessors have all been launched, in order.
        while len(self.works) < len(self.buckets) and self.missing[len(self.works)] == 0:
            buffer = self.buckets[len(self.works)][0]
            self.works.append(dist.all_reduce(buffer, group=self.group, async_op=True))

    def finish(self) -> None:
        """End of backward: wait for every bucket, copy the averages back into ``.grad``."""
        if len(self.works) < len(self.buckets):
            raise RuntimeError("OverlappedDataParallel: some parameters got no gradient in this "
                               "backward, so their buckets were never sent; every parameter "
                               "must take part in the loss")
        for work, (_, views) in zip(self.works, self.buckets, strict=True):
            work.wait()
            for i, view in views:
                self.params[i].grad.copy_(view)
        self.begin_backward()

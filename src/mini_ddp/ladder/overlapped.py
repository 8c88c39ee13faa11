"""Rung 3 — overlap: send each bucket while backward is still computing the rest.

Over rung 2 (:mod:`mini_ddp.ladder.bucketed`) this moves the work *into* ``backward()``.
Each step, with the ``reducer.cpp`` function of torch DDP it corresponds to:

1. :meth:`~OverlappedDataParallel.on_grad_ready` — ``Reducer::autograd_hook``. A post-hook on
   every parameter's ``AccumulateGrad`` node (the autograd node that writes ``.grad``) fires
   once that gradient is final for this backward. DDP hooks the node, not the tensor; such a
   post-hook fires even when the incoming gradient is undefined (a parameter reached by the
   graph that got no gradient: its slice is then zeros). In the torch this is tested with,
   ``register_post_accumulate_grad_hook`` fires in that case too; the lesson the node teaches
   is that autograd holds it only weakly — DDP keeps every node alive (a node that died would
   take its hook with it), so this rung keeps them in ``self.accumulators``.
2. The hook copies the gradient into its bucket slice multiplied by ``1/world_size``
   (``Reducer::mark_variable_ready`` -> ``mark_variable_ready_dense``) and counts the bucket
   down.
3. :meth:`~OverlappedDataParallel.launch_ready` — ``Reducer::mark_bucket_ready``: a full bucket
   is launched as an *asynchronous* all-reduce, but only once every earlier bucket has been
   launched, so all ranks issue the same collectives in the same order.
4. After the LAST launch, :meth:`~OverlappedDataParallel.finish` is queued on the autograd
   engine, as DDP queues ``Reducer::finalize_backward``: it runs when backward ends, waits for
   every bucket and copies the averages back into ``.grad`` (``finalize_bucket_dense``). Queued
   there, a backward in which some parameter got no gradient never queues it; the next forward
   then fails in :meth:`~OverlappedDataParallel.check_prior_reduction_finished`
   (``Reducer::ensure_prior_reduction_finished``) naming the parameters, with DDP's sentence.

The bucket layout changes once, and the bits depend on it (Gloo's summation order depends on
an element's position in the flat buffer). The first backward uses ONE bucket per dtype, in
definition order, and records the order in which gradients arrive (``push_rebuilt_params``).
Before the next forward *with grad enabled* the buckets are rebuilt over that order with DDP's
caps (``Reducer::rebuild_buckets``) and rank 0's layout is adopted by all
(``sync_bucket_indices``). DDP's ``_pre_forward`` rebuilds only under ``torch.is_grad_enabled()``,
so a forward under ``torch.no_grad()`` never rebuilds. This rung, which averages gradients
only, then issues no collective at all; torch DDP (and ``DataParallelModel``) still broadcasts
rank 0's buffers there, for a model with buffers and ``broadcast_buffers=True``, in the first
forward after wrapping or after a training forward — so evaluate on one rank through
``model.module`` (``tests/test_docs_claims.py`` counts the collectives).
With that, this rung gives torch DDP's gradients bit for bit (``tests/test_ladder.py``, three
ranks). Rung 4 (:mod:`mini_ddp.ladder.unused_and_no_sync`) adds ``no_sync`` and
``find_unused_parameters``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp.ladder.bucketed import assign_buckets, flat_buckets, size_limits
from mini_ddp.ladder.naive import broadcast_from_rank0, trainable

NOT_FINISHED = ("Expected to have finished reduction in the prior iteration before starting a "
                "new one.")  # torch DDP's sentence


def rank0_layout(layout: list[list[int]], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank takes rank 0's layout (``sync_bucket_indices``): arrival order can differ."""
    box = [layout]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


class OverlappedDataParallel(nn.Module):
    """Wrap ``module``; ``loss.backward()`` leaves every ``.grad`` averaged over the ranks."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        broadcast_from_rank0(module, group)  # start from rank 0's model, as in rung 1
        self.names = [name for name, _ in trainable(module)]
        self.params = [p for _, p in trainable(module)]
        self.limits = size_limits(bucket_cap_mb)
        # Iteration 1: one bucket per dtype/device (no cap), as DDP does before it knows the
        # order in which gradients arrive.
        self.install(list(reversed(assign_buckets(self.params, [sys.maxsize]))))
        self.arrival_order: list[int] | None = []  # recorded in the first backward only
        self.accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.params]
        for index, acc in enumerate(self.accumulators):
            acc.register_hook(lambda grad_in, grad_out, index=index: self.on_grad_ready(index))
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
        self.ready: set[int] = set()  # parameters whose hook fired in this backward
        self.require_finalize = False  # a hook fired: finish() must run before a new forward

    def check_prior_reduction_finished(self) -> None:
        """A forward must not start while the last backward's buckets were never all sent."""
        if self.require_finalize:
            missing = [self.names[i] for i in range(len(self.params)) if i not in self.ready]
            raise RuntimeError(f"{NOT_FINISHED} OverlappedDataParallel: on rank {self.rank} "
                               f"these parameters got no gradient in the last backward, so "
                               f"their buckets were never sent: {', '.join(missing)}; every "
                               "parameter must take part in the loss (or use rung 4)")

    def rebuild_if_needed(self) -> None:
        """Once, after the first backward: re-pack the buckets in gradient-arrival order."""
        if self.arrival_order:
            order, self.arrival_order = self.arrival_order, None
            self.install(rank0_layout(assign_buckets(self.params, self.limits, order),
                                      self.group))
            self.begin_backward()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Rebuild the buckets once (only when grad is enabled), then run the module."""
        if torch.is_grad_enabled():  # DDP's _pre_forward: no rebuild under no_grad
            self.check_prior_reduction_finished()
            self.rebuild_if_needed()
        return self.module(*inputs, **kwargs)

    def on_grad_ready(self, index: int) -> None:
        """Hook: ``.grad`` of parameter ``index`` is final for this backward."""
        self.require_finalize = True
        self.ready.add(index)
        if self.arrival_order is not None:
            self.arrival_order.append(index)
        bucket, view = self.where[index]
        grad = self.params[index].grad
        if grad is None:  # reached, but no gradient came: zeros, as DDP
            view.zero_()
        else:  # DDP's averaging: multiply while copying in (x * (1/3) is not x / 3 in fp32)
            torch.mul(grad, 1.0 / self.world_size, out=view)
        self.missing[bucket] -= 1
        self.launch_ready()

    def launch_ready(self) -> None:
        """Launch every full bucket whose predecessors have all been launched, in order."""
        while len(self.works) < len(self.buckets) and self.missing[len(self.works)] == 0:
            buffer = self.buckets[len(self.works)][0]
            self.works.append(dist.all_reduce(buffer, group=self.group, async_op=True))
            if len(self.works) == len(self.buckets):  # the last launch: finish after backward
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """End of backward: wait for every bucket, copy the averages back into ``.grad``."""
        try:
            for work, (_, views) in zip(self.works, self.buckets, strict=True):
                work.wait()
                for i, view in views:
                    self.copy_out(i, view)
        finally:  # a failed finish must not leave this backward's counts behind
            self.begin_backward()

    def copy_out(self, index: int, view: torch.Tensor) -> None:
        """Put the averaged gradient of parameter ``index`` into its ``.grad``."""
        param = self.params[index]
        if param.grad is None:
            param.grad = view.clone()
        else:
            param.grad.copy_(view)

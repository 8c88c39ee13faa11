"""Rung 4 — ``no_sync`` and ``find_unused_parameters``: steps that skip the all-reduce, and
parameters that get no gradient.

Over rung 3 (:mod:`mini_ddp.ladder.overlapped`) this adds the two things that make a backward
*not* a plain "every hook fires once":

* ``no_sync()`` (gradient accumulation). The decision is taken in **forward**, not in
  backward: DDP's forward calls ``Reducer::prepare_for_backward`` only when grad is enabled
  and ``require_backward_grad_sync`` is set, and that call is what makes the hooks act
  (``expect_autograd_hooks_``). A backward of a forward run inside ``no_sync()`` leaves every
  gradient local, accumulating in ``.grad``; the next synced backward averages the sum. So
  ``with model.no_sync(): loss = f(model(x))`` then ``loss.backward()`` *outside* the block
  still does not sync, and the other way round.
* ``find_unused_parameters=True``. After the forward,
  :meth:`~UnusedAndNoSyncDataParallel.search_unused` (``Reducer::search_unused_parameters``)
  walks the autograd graph from the outputs and lists the parameters it cannot reach; their
  hooks will never fire, so at the first hook of the backward they are marked ready with their
  ``.grad`` (zeros when there is none) and their buckets can go. Each hook that brings a
  gradient sets the parameter's entry in a *used map* — in every backward, synced or not;
  after the last bucket's launch the map is summed over ranks
  (``Reducer::all_reduce_local_used_map``), and a parameter no rank used keeps its ``.grad``
  untouched (still ``None``) in ``finalize_bucket_dense``. With it DDP never rebuilds the
  buckets (``should_rebuild_buckets`` is false: the graph may change from step to step, so no
  one backward's order is *the* order) and starts from the capped layout of rung 2 instead of
  one bucket.

Bit for bit torch DDP's at three ranks (``tests/test_ladder.py``). What the full engine
(:class:`mini_ddp.DataParallelModel`) adds: buffer broadcasts, comm hooks, static graphs,
join, mixed precision, the transports and readable errors for every misuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp.ladder.bucketed import assign_buckets
from mini_ddp.ladder.overlapped import OverlappedDataParallel


def tensors_in(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or nested tuples/lists/dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors_in(item)]
    return []


class UnusedAndNoSyncDataParallel(OverlappedDataParallel):
    """Rung 3 plus :meth:`no_sync` and ``find_unused_parameters``."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, group: dist.ProcessGroup | None = None):
        super().__init__(module, bucket_cap_mb, group)
        self.find_unused = find_unused_parameters
        self.require_sync = True  # DDP's require_backward_grad_sync; no_sync() clears it
        self.expect_hooks = False  # decided in forward: does the coming backward sync?
        self.unused: list[int] = []
        self.local_used = torch.zeros(len(self.params), dtype=torch.int32)
        if find_unused_parameters:  # the capped layout from the start, and never a rebuild
            self.install(list(reversed(assign_buckets(self.params, self.limits))))
            self.arrival_order = None
            self.begin_backward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards run inside skip the all-reduce in their backward."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Rung 3's forward, then decide (``prepare_for_backward``) what the backward does."""
        output = super().forward(*inputs, **kwargs)
        self.expect_hooks = torch.is_grad_enabled() and self.require_sync
        if self.expect_hooks and self.find_unused:
            self.unused = self.search_unused(tensors_in(output))
        return output

    def search_unused(self, outputs: list[torch.Tensor]) -> list[int]:
        """Indices of the parameters whose ``AccumulateGrad`` node no output can reach."""
        seen, stack = set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            for node, _ in stack.pop().next_functions:
                if node is not None and node not in seen:
                    seen.add(node)
                    stack.append(node)
        return [i for i, acc in enumerate(self.accumulators) if acc not in seen]

    def on_grad_ready(self, index: int) -> None:
        """``autograd_hook``: note the use, then (synced backwards only) rung 3's hook."""
        if self.find_unused and self.params[index].grad is not None:
            self.local_used[index] = 1  # in every backward, synced or not, as DDP
        if not self.expect_hooks:
            return  # no_sync: the gradient stays local, in .grad
        if not self.ready:  # the first hook: the unreachable ones are ready too
            for unused in self.unused:
                super().on_grad_ready(unused)
        super().on_grad_ready(index)

    def launch_ready(self) -> None:
        """Rung 3's launches; after the last one, the used map's all-reduce."""
        before = len(self.works)
        super().launch_ready()
        if self.find_unused and before < len(self.buckets) == len(self.works):
            self.global_used = self.local_used.clone()
            self.used_work = dist.all_reduce(self.global_used, group=self.group, async_op=True)

    def copy_out(self, index: int, view: torch.Tensor) -> None:
        """Rung 3's copy, except that a parameter no rank used keeps its ``.grad``."""
        if self.find_unused and self.local_used[index] == 0:
            self.used_work.wait()
            if self.global_used[index] == 0:
                return
        super().copy_out(index, view)

    def finish(self) -> None:
        """Rung 3's finish; the used map and the sync decision start afresh."""
        try:
            super().finish()
        finally:
            if self.find_unused:
                self.used_work.wait()
                self.local_used.zero_()
            self.expect_hooks = False

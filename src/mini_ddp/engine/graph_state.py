"""The bucket layout: which buckets exist now, and the one-time rebuild in gradient order.

Bookkeeping of torch's C++ reducer (``reducer.cpp``) that changes a value or an error but is
not on the path of one gradient (that path is :mod:`mini_ddp.engine.reducer`):

* :meth:`BucketLayout.install` puts a layout's buffers in place (the first one included),
  allocating them in shared memory when the transport will sum them;
* the hooks of the first backward record the order in which gradients arrive
  (:meth:`BucketLayout.record_ready`), and before the second forward
  :meth:`BucketLayout.rebuild_if_needed` rebuilds the buckets once in that order, with rank 0's
  layout (DDP's ``rebuild_buckets``);
* which of several live wrappers of the same parameters armed last
  (:meth:`BucketLayout.armed_elsewhere`): each keeps its hooks, as torch DDP's reducers do,
  and a backward belongs to the wrapper whose forward ran.

It knows parameters, the config and the transport, never the reducer, which owns one.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine import writeback
from mini_ddp.engine.buckets import shares_storage
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.errors import naming_collective
from mini_ddp.transport.shm import SharedMemoryAllreduce, ShmAllocationError, shm_supported

logger = logging.getLogger("mini_ddp")


class _ArmedBy:
    """Per parameter (by identity), the layout whose reducer armed last for a backward.

    Entries go with their parameter; only weak references are held, so a dropped wrapper is
    freed at once. (A ``WeakKeyDictionary`` would compare tensors with ``==``.)
    """

    def __init__(self) -> None:
        self._entries: dict[int, list[Any]] = {}  # id(param) -> [weakref(param), weakref(layout)]

    def claim(self, params: Sequence[torch.Tensor], layout: weakref.ref) -> None:
        for p in params:
            entry = self._entries.get(id(p))
            if entry is None or entry[0]() is not p:
                entry = self._entries[id(p)] = [
                    weakref.ref(p, functools.partial(self._forget, id(p))), None]
            entry[1] = layout

    def holder(self, param: torch.Tensor) -> Any:
        entry = self._entries.get(id(param))
        return None if entry is None or entry[0]() is not param else entry[1]()

    def _forget(self, key: int, dead: weakref.ref) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[0] is dead:
            del self._entries[key]


_ARMED_BY = _ArmedBy()


class BucketLayout:
    """The reducer's buckets, where each parameter sits in them, and their rebuild."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 config: DataParallelConfig, group: dist.ProcessGroup | None, rank: int,
                 transport: SharedMemoryAllreduce | None):
        self.params, self.names, self.config = params, names, config
        self.group, self.rank, self.transport = group, rank, transport
        self.buckets: list[bucketing.Bucket] = []
        self.locator: list[tuple[int, int]] = []  # param index -> (bucket, position)
        self.history: list[list[list[int]]] = []  # every layout installed, oldest first
        self.has_rebuilt = False
        self.rebuild_order: list[int] = []  # gradient-ready order seen by the recording backward
        self.grad_dtype: torch.dtype | None = None  # set by use_grad_dtype
        self._me = weakref.ref(self)
        # Iteration 1: one bucket per dtype/device unless unused parameters are searched for
        # (then DDP applies the size caps over the definition order). The list is reversed so
        # the last-defined parameters, whose gradients come first, are in bucket 0.
        self.install(list(reversed(bucketing.assign_buckets(
            params, config.initial_size_limits(), expect_sparse=config.expect_sparse_gradients))))

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A bucket's zero-filled buffer: shared memory when the transport will sum it."""
        dtype = self.grad_dtype or dtype
        nbytes = numel * dtype.itemsize
        if self.transport is not None and device.type == "cpu" and shm_supported(dtype) \
                and nbytes >= self.config.shared_memory_min_bytes:
            try:
                return self.transport.allocate(numel, dtype)  # collective: same on both ranks
            except ShmAllocationError as err:  # raised on both ranks: both fall back
                logger.warning("mini_ddp rank %d: %s; this bucket uses Gloo", self.rank, err)
        return bucketing.zeros_allocator(numel, dtype, device)

    def use_grad_dtype(self, dtype: torch.dtype) -> None:
        """Buckets hold ``dtype`` from now on, whatever the parameters' dtype.

        DDP's mixed precision moves its buckets to ``param_dtype``; with
        ``gradient_as_bucket_view=True`` that dtype is visible in ``.grad``.
        """
        self.grad_dtype = dtype
        for bucket in self.buckets:
            if bucket.sparse or bucket.buffer.dtype == dtype:
                continue
            if self.transport is not None and self.transport.owns(bucket.buffer):
                self.transport.free(bucket.buffer)
            bucket.replace_buffer(self.allocate(bucket.buffer.numel(), dtype,
                                                bucket.buffer.device))

    def install(self, layout: list[list[int]], rebuilt: bool = False) -> None:
        """Replace the buckets by fresh ones for ``layout`` (lists of parameter indices)."""
        # Gradients the zero-copy write-back left in the old buffers move along (unless someone
        # else holds them), so later steps keep writing in place instead of copying.
        movable = writeback.handed_out_grads(self.buckets)
        for bucket in self.buckets:
            if self.transport is not None and self.transport.owns(bucket.buffer):
                self.transport.free(bucket.buffer)  # memory goes once the old views do
        self.buckets, self.locator = bucketing.build_buckets(
            layout, self.params, self.allocate, self.config.expect_sparse_gradients)
        self.history.append([list(indices) for indices in layout])
        for index, old_view in movable:
            bucket_index, position = self.locator[index]
            bucket = self.buckets[bucket_index]
            self.params[index].grad = bucket.views[position].copy_(old_view)
            bucket.handed_out = True
        del movable
        if self.config.gradient_as_bucket_view:
            # Gradients that already exist move into the new buffers (DDP does the same when
            # it rebuilds), so ``.grad`` is a bucket view from now on.
            for bucket in self.buckets:
                if bucket.sparse:
                    continue  # its buffer is the sparse .grad itself
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is not None and not shares_storage(p.grad, bucket.buffer):
                        view.copy_(p.grad)
                        writeback.assign_grad(p, view)  # mixed precision: a param_dtype view
        logger.info("mini_ddp rank %d bucket layout, %s:\n%s", self.rank,
                    self.config.layout_reason(rebuilt),
                    bucketing.describe_layout(self.buckets, self.names))

    def should_rebuild(self) -> bool:
        """DDP rebuilds once, in gradient-ready order, unless it searches for unused params."""
        return ((self.config.static_graph or not self.config.find_unused_parameters)
                and not self.has_rebuilt)

    def arm(self) -> None:
        """Before a synced backward: every bucket waits for all its gradients again."""
        _ARMED_BY.claim(self.params, self._me)
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.future = None
            bucket.deferred.clear()  # batched_grad_copy: nothing deferred yet

    def armed_elsewhere(self, index: int) -> bool:
        """Has another live wrapper of parameter ``index`` armed for a backward since this one?

        Then a gradient after this layout's synchronised step is that wrapper's (torch DDP's
        reducer ignores a hook it does not expect), not a second backward of ours.
        """
        holder = _ARMED_BY.holder(self.params[index])
        return holder is not None and holder is not self

    def record_ready(self, *indices: int) -> None:
        """Note that these parameters' gradients are the next ones to become ready."""
        self.rebuild_order.extend(indices)

    def record_all(self) -> None:
        """Rebuild with every parameter if nothing was recorded (a joined rank's backward:
        DDP pushes every parameter so that it rebuilds with the others)."""
        if self.should_rebuild() and not self.rebuild_order:
            self.rebuild_order = list(range(len(self.params)))

    def rebuild_if_needed(self) -> bool:
        """Before a forward: rebuild the buckets once, in the recorded order, with rank 0's."""
        if not self.should_rebuild() or not self.rebuild_order:
            return False
        layout = bucketing.assign_buckets(self.params, self.config.rebuild_size_limits(),
                                          order=self.rebuild_order,
                                          expect_sparse=self.config.expect_sparse_gradients)
        with naming_collective(self.rank, "the broadcast of rank 0's rebuilt bucket layout "
                               "(before the second forward)"):
            layout = bucketing.agree_on_layout(layout, self.group, self.params[0].device)
        self.has_rebuilt = True
        self.rebuild_order = []
        self.install(layout, rebuilt=True)
        return True


def should_rebuild(reducer: Any) -> bool:
    """Will ``reducer`` (anything with a ``layout``) still rebuild its buckets once?"""
    return reducer.layout.should_rebuild()

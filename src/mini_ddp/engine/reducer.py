"""The reducer: from one parameter's gradient hook to the all-reduce and back into ``.grad``.

Follow one gradient through a step:

1. :meth:`Reducer._on_grad_accumulated` — a post-hook on the parameter's ``AccumulateGrad``
   node fires once autograd has written ``param.grad``. It calls :meth:`_mark_ready`.
2. :meth:`_mark_ready` copies the gradient into its bucket view, *multiplied* by
   ``1/world_size`` (DDP's exact arithmetic, see :meth:`_copy_grad_into_bucket`), and counts the
   bucket down. A full bucket is launched as soon as every earlier bucket has been
   (:meth:`start_grad_sync`): always in bucket order, so every rank issues the same collectives
   in the same order.
3. The launch goes through the comm-hook door (:mod:`mini_ddp.engine.hooks`) — or, for two ranks on
   one machine, through shared memory (:mod:`mini_ddp.transport.shm`, same bits); the future is kept.
4. When the last bucket has launched, :meth:`finish_grad_sync` is queued on the autograd engine.
   It runs when backward ends, waits for every bucket in :meth:`_wait` (the only place that
   blocks, with a deadline), and writes the results back into ``param.grad`` through
   :mod:`mini_ddp.engine.writeback`: by default ``.grad`` becomes the bucket's view
   (:func:`~mini_ddp.engine.writeback.hand_out`), which is reclaimed before the next backward writes
   into the bucket (:func:`~mini_ddp.engine.writeback.reclaim_buffers`, at step 1).

The bookkeeping mirrors torch's C++ reducer (``reducer.cpp``) wherever it changes a value or an
error. What is off this path lives in :mod:`mini_ddp.engine.graph_state`: the unused-parameter search,
installing bucket layouts and the one-time rebuild in gradient order, and a static graph's
first iteration (``delay_all_reduce``); join's stand-in backward is in :mod:`mini_ddp.engine.join`.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine import graph_state, writeback
from mini_ddp.engine.buckets import shares_storage
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.hooks import CommHook, GradBucket, allreduce_sum_hook, hook_name, result_tensor
from mini_ddp.errors import (
    CollectiveError,
    GradSyncTimeout,
    MarkedTwiceError,
    MiniDDPError,
    UnfinishedReductionError,
    describe_bucket,
    naming_collective,
)
from mini_ddp.transport.shm import (
    SharedMemoryAllreduce,
    ShmAllocationError,
    ShmError,
    shm_supported,
)

logger = logging.getLogger("mini_ddp")


def _grad_accumulator(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node autograd uses for ``param`` (kept alive by the reducer)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


class Reducer:
    """Buckets, hooks and the per-step state machine of gradient synchronisation."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 group: dist.ProcessGroup | None, config: DataParallelConfig,
                 transport: SharedMemoryAllreduce | None = None):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.config = config
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.div_factor = self.world_size  # what gradients are averaged over (join may change it)
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.trace: Any = None  # a recorder with .record(kind, **info), or None (tracing off)
        # The stall watchdog (mini_ddp.observe.watchdog): on_stall(reducer, bucket, error) is called
        # once a wait passes stall_after_s (error None) and when a collective fails.
        self.on_stall: Callable[[Reducer, bucketing.Bucket | None, BaseException | None],
                                None] | None = None
        self.stall_after_s: float | None = None
        self.layout_history: list[list[list[int]]] = []  # every layout installed, oldest first
        # Two ranks on one host: big float buckets live in shared memory and are summed there.
        self.transport = transport
        self.use_transport = transport is not None  # off while Join runs (model.forward)
        self.allocate: bucketing.Allocator = self._allocate_bucket
        # Zero-copy write-back: after the all-reduce, .grad becomes the bucket's view instead of
        # a copy of it (writeback.hand_out). Only on the plain path; the unused-parameter paths
        # and gradient_as_bucket_view keep their own rules, which are DDP's.
        self.zero_copy = (config.zero_copy_write_back and not config.gradient_as_bucket_view
                          and not config.find_unused_parameters and not config.static_graph)
        device = self.params[0].device

        # Iteration 1: one bucket per dtype/device unless unused parameters are searched for
        # (then DDP applies the size caps over the definition order). The list is reversed so
        # the last-defined parameters, whose gradients come first, are in bucket 0.
        n = len(self.params)
        limits = config.initial_size_limits()
        graph_state.install_buckets(
            self, list(reversed(bucketing.assign_buckets(self.params, limits))))

        self.num_iterations = 0          # synced forwards so far
        self.num_backward_calls = 0      # backward passes that reached a hook (DDP's num_bwd_calls_)
        self._backward_counted = False   # this backward is counted (reset when it finishes)
        self._hook_static_first = self._hook_tracks_used = self._hook_records_order = False
        self.expect_hooks = False        # a synced backward is expected
        self.synced_this_step = False    # a synced backward finished; no forward since
        self.require_finalize = False    # some gradient was marked ready and not yet finished
        self.ready: set[int] = set()     # parameters marked ready this iteration
        self.unused: list[int] = []      # parameters found unused (marked ready at first hook)
        self.marked_unused = False
        self.local_used = torch.zeros(n, dtype=torch.int32, device=device)
        self.global_used: torch.Tensor | None = None
        self._global_used_future: torch.futures.Future | None = None
        self.has_rebuilt = False
        self.rebuild_order: list[int] = []
        self.static_hook_counts = [0] * n   # hooks per parameter in iteration 1 (static graph)
        self.static_hooks_left = [0] * n
        self._lock = threading.Lock()

        # Hooks go on the AccumulateGrad nodes, not on the tensors: such a post-hook fires even
        # when the incoming gradient is undefined (an output unused in the loss), which is how
        # DDP tells "used but got no gradient" apart from "never reached".
        self._accumulators = [_grad_accumulator(p) for p in self.params]
        me = weakref.ref(self)  # the nodes outlive nothing, but avoid a cycle through C++
        for index, acc in enumerate(self._accumulators):
            acc.register_hook(functools.partial(_hook_trampoline, me, index))

    @property
    def div_factor(self) -> int:
        """What gradients are averaged over: the world size, unless ``join`` changes it."""
        return self._div_factor

    @div_factor.setter
    def div_factor(self, value: int) -> None:
        self._div_factor = value
        # 1/value as the 0-dim float64 CPU tensor DDP hands mul_out (a wrapped double scalar).
        # Made once instead of per gradient: a Python float makes torch.mul build that tensor
        # on every call, which doubled the call's cost. The kernel and the bits are the same.
        self._scale = torch.tensor(1.0 / value, dtype=torch.float64)

    # ---- bucket memory -------------------------------------------------------------------
    def _allocate_bucket(self, numel: int, dtype: torch.dtype, device: torch.device
                         ) -> torch.Tensor:
        """A bucket's zero-filled buffer: shared memory when the transport will sum it."""
        nbytes = numel * dtype.itemsize
        if self.transport is not None and device.type == "cpu" and shm_supported(dtype) \
                and nbytes >= self.config.shared_memory_min_bytes:
            try:
                return self.transport.allocate(numel, dtype)  # collective: same on both ranks
            except ShmAllocationError as err:  # raised on both ranks: both fall back
                logger.warning("mini_ddp rank %d: %s; this bucket uses Gloo", self.rank, err)
        return bucketing.zeros_allocator(numel, dtype, device)

    def _through_transport(self, bucket: bucketing.Bucket) -> bool:
        """Is this step's all-reduce of ``bucket`` the shared-memory one (not Gloo's)?"""
        return self.use_transport and self.transport.owns(bucket.buffer)

    # ---- per-step state ------------------------------------------------------------------
    def static_first_iteration(self) -> bool:
        # Counted in backward passes, as DDP does since 2.1: two forwards may precede one
        # backward, and that backward is still "iteration 1".
        return self.config.static_graph and self.num_backward_calls == 1

    def _dynamic_find_unused(self) -> bool:
        return self.config.find_unused_parameters and not self.config.static_graph

    def prepare_for_forward(self) -> None:
        """Count a synced forward (static graphs behave differently in iteration 1)."""
        self.num_iterations += 1

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arm the hooks for the backward of this forward's ``outputs``."""
        self.expect_hooks = True
        self.synced_this_step = False
        # The rebuild happens before forward, so this holds for the whole backward.
        self._hook_records_order = graph_state.should_rebuild(self)
        self.next_bucket = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.future = None
        if self.config.static_graph:
            self.static_hooks_left = list(self.static_hook_counts)
        self.marked_unused = False
        self.ready.clear()
        if self._dynamic_find_unused():
            self.unused = graph_state.unreachable_params(self._accumulators, outputs)

    def ensure_prior_reduction_finished(self) -> None:
        """Raise, naming the parameters, if the last backward left gradients unreduced."""
        if not self.require_finalize:
            return
        missing = [i for i in range(len(self.params)) if i not in self.ready]
        raise UnfinishedReductionError(self.rank, [self.names[i] for i in missing], missing)

    # ---- 1. hook -------------------------------------------------------------------------
    def _count_backward(self) -> None:
        """First hook of a backward: count it, and settle what its other hooks will ask.

        These flags change only with ``num_backward_calls`` (here) and the config, so each
        hook reads two attributes instead of re-deriving them (a hook runs per parameter).
        """
        self._backward_counted = True
        self.num_backward_calls += 1
        self._hook_static_first = self.static_first_iteration()
        self._hook_tracks_used = self._dynamic_find_unused() or self._hook_static_first

    def _on_grad_accumulated(self, index: int) -> None:
        with self._lock:
            # DDP's autograd_hook does this in *every* backward, synced or not: a parameter used
            # only inside no_sync() still counts as used at the synced step (its accumulated
            # grad is then averaged, not left local), and a static graph's first backward is
            # counted even when its forward ran under no_sync().
            if not self._backward_counted:
                self._count_backward()
            if self._hook_tracks_used and self.params[index].grad is not None:
                self.local_used[index] = 1
            if self._hook_static_first:
                self.static_hook_counts[index] += 1  # reducing waits: graph_state.delay_all_reduce
                return
            if not self.expect_hooks:
                if self.synced_this_step:
                    # A second backward on a synced forward: torch DDP ignores the hook and lets
                    # the gradient stay local (the ranks drift apart). We refuse it.
                    raise MarkedTwiceError(self.rank, self.names[index], index, after_sync=True)
                return  # no_sync(), or a backward DDP was not asked to synchronise
            if self.trace is not None:
                self.trace.record("hook", param=index)
            if not self.marked_unused:
                self.marked_unused = True
                if self.zero_copy:
                    # Before anything is written into a bucket a .grad may still be.
                    writeback.reclaim_buffers(self.buckets, self.transport)
                for unused_index in self.unused:
                    self._mark_ready(unused_index)
            if self.config.static_graph:
                if self.static_hooks_left[index] == 0:
                    raise MiniDDPError(
                        f"mini_ddp: parameter '{self.names[index]}' received a gradient on rank "
                        f"{self.rank} it did not receive in iteration 1, or more often: the "
                        f"training graph changed, which static_graph=True does not allow.")
                self.static_hooks_left[index] -= 1
                if self.static_hooks_left[index] > 0:
                    return  # hooks fire several times (e.g. checkpointing): wait for the last
            if self._hook_records_order:
                self.rebuild_order.append(index)
            self._mark_ready(index)

    # ---- 2. into the bucket --------------------------------------------------------------
    def _mark_ready(self, index: int) -> None:
        if index in self.ready:
            raise MarkedTwiceError(self.rank, self.names[index], index)
        self.ready.add(index)
        self.require_finalize = True
        bucket_index, position = self.locator[index]
        bucket = self.buckets[bucket_index]
        self._copy_grad_into_bucket(bucket, position)
        bucket.pending -= 1
        if bucket.pending == 0:
            if self.trace is not None:
                self.trace.record("bucket_ready", bucket=bucket_index)
            self.start_grad_sync(bucket_index)
            # Only a launch moves next_bucket, so only a full bucket can make it the last.
            if self.next_bucket == len(self.buckets):
                if self._dynamic_find_unused():
                    self._launch_used_map_reduce()
                Variable._execution_engine.queue_callback(self.finish_grad_sync)

    def _copy_grad_into_bucket(self, bucket: bucketing.Bucket, position: int) -> None:
        param, view = bucket.params[position], bucket.views[position]
        grad = param.grad
        if grad is None:
            view.zero_()  # marked ready without a gradient: contribute zeros
            return
        if grad is view or (self.config.gradient_as_bucket_view
                            and shares_storage(grad, bucket.buffer)):
            # The gradient already *is* the bucket view, and autograd accumulated into it.
            if self.comm_hook is None:
                if self.config.gradient_as_bucket_view:
                    view.div_(self.div_factor)  # DDP divides in place here: a true division
                else:
                    # Zero-copy write-back left it here: the default path's multiply, in
                    # place — the same kernel and scalar as below, so the same bits.
                    torch.mul(view, self._scale, out=view)
            return
        if self.comm_hook is not None:
            view.copy_(grad)  # a user hook does its own averaging
        elif grad.requires_grad:  # create_graph=True: the copy must not join the graph
            view.copy_(torch.mul(grad.detach(), 1.0 / self.div_factor))
        else:
            # DDP multiplies by 1/world_size while copying (mul_out with a double scalar).
            # x * (1/3) differs from x / 3 in about a third of fp32 values: this line is
            # where bitwise parity is won.
            torch.mul(grad, self._scale, out=view)
        if self.config.gradient_as_bucket_view:
            param.grad = view

    # ---- 3. launch -----------------------------------------------------------------------
    def start_grad_sync(self, bucket_index: int) -> None:
        """Launch every ready bucket from ``next_bucket`` on, strictly in bucket order."""
        if bucket_index > self.next_bucket:
            return
        while self.next_bucket < len(self.buckets) \
                and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: bucketing.Bucket) -> None:
        grad_bucket = GradBucket(bucket.index, bucket.index == len(self.buckets) - 1,
                                 bucket.buffer, bucket.params, bucket.offsets)
        bucket.grad_bucket = grad_bucket
        if self.trace is not None:
            self.trace.record("launch", bucket=bucket.index, bytes=bucket.nbytes)
        if self.comm_hook is None:
            with naming_collective(self.rank, lambda: self._describe(bucket)):
                if self._through_transport(bucket):
                    bucket.future = self.transport.all_reduce(bucket.buffer)
                else:
                    bucket.future = allreduce_sum_hook(self.group, grad_bucket)
        else:
            bucket.future = self.comm_hook(self.comm_hook_state, grad_bucket)
            # torch._C.Future, not torch.futures.Future: ``fut.then(...)`` (torch's own
            # allreduce_hook) returns the C++ base class, which DDP accepts.
            if not isinstance(bucket.future, torch._C.Future):
                raise TypeError(f"mini_ddp: communication hook {hook_name(self.comm_hook)} "
                                f"must return a torch.futures.Future; for bucket "
                                f"{bucket.index} it returned a {type(bucket.future).__name__}")
        if self.trace is not None:  # lets a recorder log when the collective really ends
            self.trace.record("launched", bucket=bucket.index, future=bucket.future)

    def _launch_used_map_reduce(self) -> None:
        self._global_used = self.local_used.clone()
        with naming_collective(self.rank, lambda: self._describe(None)):
            work = dist.all_reduce(self._global_used, group=self.group, async_op=True)
        self._global_used_future = work.get_future()
        self.global_used = None

    # ---- 4. wait and write back ----------------------------------------------------------
    def _wait(self, future: torch.futures.Future, bucket: bucketing.Bucket | None) -> Any:
        """The one place that blocks: wait for ``future`` with the configured deadline."""
        if not future.done():
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            if self.on_stall is not None and self.stall_after_s is not None \
                    and not done.wait(self.stall_after_s):
                self.on_stall(self, bucket, None)  # reports the stall; raises, or we wait on
            if not done.wait(self.config.sync_timeout_s):
                raise GradSyncTimeout(self.rank, self.config.sync_timeout_s, bucket,
                                      self.names, len(self.buckets))
        if self.on_stall is not None:
            try:
                future.wait()
            except Exception as error:  # noqa: BLE001 - raised again by the wait below
                self.on_stall(self, bucket, error)  # a dead peer: name it from its marks
        # A dead peer fails the collective (Gloo notices a closed socket at once): name it.
        with naming_collective(self.rank, lambda: self._describe(bucket)):
            try:
                return future.wait()
            except MiniDDPError as err:
                if bucket is None or not isinstance(err, (CollectiveError, ShmError)):
                    raise
                # The shared-memory transport's own error names a slot: name the bucket, with
                # the backend's words (a CollectiveError of the transport keeps them as cause).
                cause = err.__cause__ if isinstance(err, CollectiveError) else None
                raise CollectiveError(self.rank, self._describe(bucket), cause or err) from err

    def _describe(self, bucket: bucketing.Bucket | None) -> str:
        what = describe_bucket(bucket, self.names, len(self.buckets))
        if bucket is not None and self.comm_hook is None and self._through_transport(bucket):
            what += " through shared memory"
        if bucket is not None and self.comm_hook is not None:
            hook = getattr(self.comm_hook, "__qualname__", repr(self.comm_hook))
            what += f" through communication hook {hook}"
        return what

    def _globally_unused(self, index: int) -> bool:
        if self.local_used[index] != 0:
            return False
        if self.global_used is None and self._global_used_future is not None:
            self._wait(self._global_used_future, None)
            self.global_used = self._global_used
        return self.global_used is not None and bool(self.global_used[index] == 0)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket, then put the averaged gradients into ``param.grad``."""
        with self._lock:
            if self.trace is not None:
                self.trace.record("finalize_start")  # backward's compute has ended
            self.expect_hooks = False
            self.synced_this_step = True
            self.require_finalize = False
            self._backward_counted = False
            if self.config.static_graph and self.num_backward_calls > 1 \
                    and graph_state.should_rebuild(self):
                self.rebuild_order.extend(self.unused)
            track_unused = self.config.static_graph or self.config.find_unused_parameters
            plain = not track_unused and not self.config.gradient_as_bucket_view
            for bucket in self.buckets:
                value = self._wait(bucket.future, bucket)
                result = result_tensor(value, self.comm_hook, bucket.grad_bucket)
                if self.trace is not None:
                    self.trace.record("complete", bucket=bucket.index)
                if plain and result is bucket.buffer:
                    if self.zero_copy:
                        writeback.hand_out(bucket)
                    else:
                        writeback.copy_out(bucket)
                    continue
                for param, index, view_in, view_out in zip(
                        bucket.params, bucket.param_indices, bucket.views,
                        bucket.views_of(result), strict=True):
                    if track_unused and self._globally_unused(index):
                        continue  # nobody used it: leave .grad untouched (None stays None)
                    writeback.write_back(param, view_in, view_out,
                                         self.config.gradient_as_bucket_view)
            if self._global_used_future is not None and self.global_used is None:
                self._wait(self._global_used_future, None)
                self.global_used = self._global_used
            if self._dynamic_find_unused():
                self.local_used.zero_()
                self.global_used, self._global_used_future = None, None
            if self.trace is not None:
                self.trace.record("finalized")


def _hook_trampoline(reducer_ref: weakref.ref, index: int, *_grads: Any) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._on_grad_accumulated(index)

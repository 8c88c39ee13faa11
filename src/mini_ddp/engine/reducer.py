"""The reducer: from one parameter's gradient hook to the all-reduce and back into ``.grad``.

Follow one gradient through a step:

1. :meth:`Reducer.on_grad_accumulated` — a post-hook on the parameter's ``AccumulateGrad``
   node fires once autograd has written ``param.grad``. It calls :meth:`~Reducer.mark_ready`.
2. :meth:`~Reducer.mark_ready` copies the gradient into its bucket view, *multiplied* by
   ``1/world_size`` (DDP's exact arithmetic, :mod:`mini_ddp.engine.copy_in`), and counts the
   bucket down. A full bucket is launched as soon as every earlier bucket has been
   (:meth:`~Reducer.start_grad_sync`): always in bucket order, so every rank issues the same
   collectives in the same order.
3. The launch goes through the comm-hook door (:func:`mini_ddp.engine.hooks.launch_hook`) — or,
   for two ranks on one machine, through shared memory (:mod:`mini_ddp.transport.shm`, same
   bits); the future is kept.
4. When the last bucket has launched, :meth:`~Reducer.finish_grad_sync` is queued on the
   autograd engine. It runs when backward ends, waits for every bucket in
   :meth:`~Reducer.wait` (the only place that blocks, with a deadline:
   :mod:`mini_ddp.engine.bucket_wait`), and writes the results back into ``param.grad``
   (:mod:`mini_ddp.engine.writeback`): by default ``.grad`` becomes the bucket's view, reclaimed
   before the next backward writes into the bucket (at step 1).

The bookkeeping mirrors torch's C++ reducer (``reducer.cpp``) wherever it changes a value or an
error. It lives in :class:`~mini_ddp.engine.reducer_state.ReducerState`, this class's base (the
views observers read, the per-step calls that touch no gradient), and in small named objects:
the per-step counters in :class:`~mini_ddp.engine.step_state.StepState`, the buckets and their
one-time rebuild in :class:`~mini_ddp.engine.graph_state.BucketLayout`, the unused-parameter
search in :class:`~mini_ddp.engine.unused.UnusedSearch`. A static graph's first iteration
reduces everything after backward (:meth:`~Reducer.delay_all_reduce`); join's stand-in backward
is in :mod:`mini_ddp.engine.join`. DDP's variants of steps 2 and 3 — ``batched_grad_copy``, a
sparse gradient that *is* its own bucket, ``skip_all_reduce_unused_params`` leaving out buckets
of unused parameters only — are routed in :mod:`mini_ddp.engine.grad_routing`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine import writeback
from mini_ddp.engine.bucket_wait import wait_for_collective
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.grad_routing import flush_if_batched, grad_into_bucket, skipped
from mini_ddp.engine.hooks import GradBucket, allreduce_sum_hook, launch_hook, result_tensor
from mini_ddp.engine.reducer_state import ReducerState
from mini_ddp.engine.sparse import sparse_write_back
from mini_ddp.engine.torch_api import (
    BACKWARD_COMM_END,
    BACKWARD_COMM_START,
    BACKWARD_COMPUTE_END,
    BACKWARD_COMPUTE_START,
    TorchReducerAPI,
    outputs_list,
)
from mini_ddp.errors import GradSyncTimeout, MarkedTwiceError, describe_bucket, naming_collective
from mini_ddp.transport.shm import SharedMemoryAllreduce


def _grad_accumulator(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node autograd uses for ``param`` (kept alive by the reducer)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


class Reducer(TorchReducerAPI, ReducerState):
    """Hooks and the hook -> bucket -> launch -> wait -> write-back path of one model.

    Answers torch's reducer methods by name too (:mod:`mini_ddp.engine.torch_api`).
    """

    flight: Any = None  # the flight recorder's ring (mini_ddp.engine.flight_log), or None

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 group: dist.ProcessGroup | None, config: DataParallelConfig,
                 transport: SharedMemoryAllreduce | None = None):
        super().__init__(params, names, group, config, transport)
        # Hooks go on the AccumulateGrad nodes, not on the tensors: such a post-hook fires even
        # when the incoming gradient is undefined (an output unused in the loss), which is how
        # DDP tells "used but got no gradient" apart from "never reached".
        self._accumulators = [_grad_accumulator(p) for p in self.params]
        me = weakref.ref(self)  # the nodes outlive nothing, but avoid a cycle through C++
        self._hook_handles = [acc.register_hook(functools.partial(_hook_trampoline, me, index))
                              for index, acc in enumerate(self._accumulators)]

    def _through_transport(self, bucket: bucketing.Bucket) -> bool:
        """Is this step's all-reduce of ``bucket`` the shared-memory one (not Gloo's)?"""
        return self.use_transport and not bucket.sparse and self.transport.owns(bucket.buffer)

    # ---- per-step state ------------------------------------------------------------------
    def rebuild_buckets_if_needed(self) -> bool:
        """Before a forward: check the last backward finished; rebuild buckets once."""
        self.ensure_prior_reduction_finished()
        return self.layout.rebuild_if_needed()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Arm the hooks for the backward of this forward's ``outputs`` (a tensor or a list
        of them, as torch's reducer takes; the model calls it after forward, frameworks call
        it for a backward that runs inside the forward)."""
        outputs = outputs_list(outputs)
        if self.runtime_log is not None:
            self.runtime_log.mark(BACKWARD_COMPUTE_START)
        self.step.arm(self.config.static_graph)
        # The rebuild happens before forward, so this holds for the whole backward.
        self.step.records_order = self.layout.should_rebuild()
        self.layout.arm()
        if self.unused_search.dynamic:
            self.unused_search.search(self._accumulators, outputs)

    def remove_autograd_hooks(self) -> None:
        """Remove every gradient hook (DDP's ``_remove_autograd_hooks``): later backwards
        leave ``.grad`` local."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def forward_running(self, synced: bool) -> None:
        """The model's forward starts (``synced``: it will synchronise) or has returned."""
        self.step.forward_running = synced

    # ---- 1. hook -------------------------------------------------------------------------
    def on_grad_accumulated(self, index: int) -> None:
        """The hook of parameter ``index``: autograd has written its ``.grad``."""
        step = self.step
        with self._lock:
            # DDP's autograd_hook does this in *every* backward, synced or not: a parameter used
            # only inside no_sync() still counts as used at the synced step (its accumulated
            # grad is then averaged, not left local). A static graph's no_sync() backwards
            # before its first synced one are not counted (StepState.begin_backward).
            if not step.backward_counted:
                step.begin_backward(self.config.static_graph, self.unused_search.dynamic)
            if step.tracks_used and self.params[index].grad is not None:
                self.unused_search.mark_used(index)
            if step.static_first:
                step.static_hook_counts[index] += 1  # reducing waits: delay_all_reduce
                return
            if not step.expect_hooks:
                if step.synced_this_step and not self.layout.armed_elsewhere(index):
                    # A second backward on a synced forward: torch DDP ignores the hook and lets
                    # the gradient stay local (the ranks drift apart). We refuse it. (Another
                    # wrapper of the same parameters armed since: its backward, not ours.)
                    raise MarkedTwiceError(self.rank, self.names[index], index, after_sync=True)
                unarmed = step.unarmed(self.rank, self.names[index], index)
                if unarmed is not None:  # backward inside a forward nobody armed: refused
                    raise unarmed
                return  # no_sync(), or a backward DDP was not asked to synchronise
            if self.trace is not None:
                self.trace.record("hook", param=index)
            step.ready_order.append(index)  # the logging data's ready order, as torch's
            if not step.marked_unused:
                step.marked_unused = True
                if self.zero_copy:
                    # Before anything is written into a bucket a .grad may still be.
                    writeback.reclaim_buffers(self.buckets, self.transport)
                for unused_index in self.unused_search.unused:
                    self.mark_ready(unused_index)
            if self.config.static_graph and not step.last_static_hook(index, self.names[index],
                                                                      self.rank):
                return  # hooks fire several times (e.g. checkpointing): wait for the last
            if step.records_order:
                self.layout.record_ready(index)
            self.mark_ready(index)

    # ---- 2. into the bucket --------------------------------------------------------------
    def mark_ready(self, index: int) -> None:
        """Copy parameter ``index``'s gradient into its bucket; launch what became full."""
        step = self.step
        if index in step.ready:
            raise MarkedTwiceError(self.rank, self.names[index], index)
        step.ready.add(index)
        step.require_finalize = True
        bucket_index, position = self.locator[index]
        bucket = self.buckets[bucket_index]
        self._copy_in(bucket, position)
        bucket.pending -= 1
        if bucket.pending == 0:
            flush_if_batched(bucket, self.config, hooked=self.comm_hook is not None,
                             div_factor=self.div_factor)
            if self.trace is not None:
                self.trace.record("bucket_ready", bucket=bucket_index)
            self.start_grad_sync(bucket_index)
            # Only a launch moves next_bucket, so only a full bucket can make it the last.
            if step.next_bucket == len(self.buckets):
                if self.unused_search.dynamic:
                    self.unused_search.launch_map_reduce(lambda: self._describe(None))
                Variable._execution_engine.queue_callback(self.finish_grad_sync)

    def _copy_in(self, bucket: bucketing.Bucket, position: int) -> None:
        grad_into_bucket(bucket, position, self.config, hooked=self.comm_hook is not None,
                         div_factor=self.div_factor, scale=self._scale, names=self.names,
                         rank=self.rank)

    # ---- 3. launch -----------------------------------------------------------------------
    def start_grad_sync(self, bucket_index: int) -> None:
        """Launch every ready bucket from ``next_bucket`` on, strictly in bucket order."""
        step, buckets = self.step, self.buckets
        if bucket_index > step.next_bucket:
            return
        while step.next_bucket < len(buckets) and buckets[step.next_bucket].pending == 0:
            if not skipped(buckets[step.next_bucket], self.config, self.unused_search.unused):
                self._launch(buckets[step.next_bucket])
            step.next_bucket += 1

    def _launch(self, bucket: bucketing.Bucket) -> None:
        grad_bucket = bucket.grad_bucket = GradBucket.of(bucket, len(self.buckets))
        if self.trace is not None:
            self.trace.record("launch", bucket=bucket.index, bytes=bucket.nbytes)
        if self.runtime_log is not None:
            self.runtime_log.mark(BACKWARD_COMM_START)  # the first launch of the step
        if self.comm_hook is not None:  # a user hook's errors are its own: no naming
            try:
                bucket.future = launch_hook(self.comm_hook, self.comm_hook_state, self.group,
                                            grad_bucket)
            except RuntimeError as err:  # e.g. no future returned: logged, as torch logs it
                if self.runtime_log is not None:
                    self.runtime_log.record_error(err)
                raise
        else:
            with naming_collective(self.rank, lambda: self._describe(bucket)):
                bucket.future = self.transport.all_reduce(bucket.buffer) \
                    if self._through_transport(bucket) else allreduce_sum_hook(self.group,
                                                                                grad_bucket)
        if self.trace is not None:  # lets a recorder log when the collective really ends
            self.trace.record("launched", bucket=bucket.index, future=bucket.future)
        if self.flight is not None:
            self.flight.launched(self.num_iterations, bucket)

    def delay_all_reduce(self) -> None:
        """Static graph, first iteration: reduce everything once backward has finished.

        In iteration 1 the hooks only count how often each parameter's gradient arrives; this
        (queued by the model's output sink) then copies every gradient in and reduces all
        buckets, through steps 2-4 above (DDP's ``delay_all_reduce``).
        """
        with self._lock:
            self.unused_search.launch_map_reduce(lambda: self._describe(None))
            self.unused_search.unused = [i for i, c in enumerate(self.step.static_hook_counts)
                                         if c == 0]
            self.step.require_finalize = True
            for bucket in self.buckets:
                for position in range(len(bucket.params)):
                    self._copy_in(bucket, position)
            for bucket in self.buckets:
                flush_if_batched(bucket, self.config, hooked=self.comm_hook is not None,
                                 div_factor=self.div_factor)
                self._launch(bucket)
            self.step.next_bucket = len(self.buckets)
        self.finish_grad_sync()

    # ---- 4. wait and write back ----------------------------------------------------------
    def wait(self, future: torch.futures.Future, bucket: bucketing.Bucket | None) -> Any:
        """The one place that blocks: wait for ``future`` with the configured deadline.

        ``bucket`` (None: the used-map all-reduce) names what is waited for in a timeout, a
        stall report (``on_stall``) and a collective's failure.
        """
        on_stall = self.on_stall

        def timed_out() -> GradSyncTimeout:
            error = GradSyncTimeout(self.rank, self.config.sync_timeout_s, bucket, self.names,
                                    len(self.buckets))
            if self.flight is not None:  # what led here, for `python -m mini_ddp doctor`
                self.flight.dump(f"GradSyncTimeout: {error}")
            return error

        return wait_for_collective(
            future, rank=self.rank, timeout_s=self.config.sync_timeout_s,
            describe=lambda: self._describe(bucket), names_a_bucket=bucket is not None,
            timed_out=timed_out,
            on_stall=None if on_stall is None else lambda err: on_stall(self, bucket, err),
            stall_after_s=self.stall_after_s)

    def _describe(self, bucket: bucketing.Bucket | None) -> str:
        what = describe_bucket(bucket, self.names, len(self.buckets))
        if bucket is not None and self.comm_hook is None and self._through_transport(bucket):
            what += " through shared memory"
        if bucket is not None and self.comm_hook is not None:
            hook = getattr(self.comm_hook, "__qualname__", repr(self.comm_hook))
            what += f" through communication hook {hook}"
        return what

    def finish_grad_sync(self) -> None:
        """Wait for every bucket, then put the averaged gradients into ``param.grad``."""
        with self._lock:
            if self.trace is not None:
                self.trace.record("finalize_start")  # backward's compute has ended
            if self.runtime_log is not None:
                self.runtime_log.mark(BACKWARD_COMPUTE_END)
            self.step.finish()
            if self.config.static_graph and self.step.num_backward_calls > 1 \
                    and self.layout.should_rebuild():
                self.layout.record_ready(*self.unused_search.unused)
            track_unused = self.config.static_graph or self.config.find_unused_parameters
            plain = not track_unused and not self.config.gradient_as_bucket_view
            skip = (lambda index: self.unused_search.globally_unused(index, self.wait)) \
                if track_unused else None
            for bucket in self.buckets:
                if bucket.future is None:
                    continue  # skipped: all its parameters unused (skip_all_reduce_unused_params)
                value = self.wait(bucket.future, bucket)
                if self.flight is not None:
                    self.flight.completed(bucket.index)
                if bucket.sparse:  # the result goes into the bucket, which is the .grad
                    sparse_write_back(bucket, value)
                    continue
                result = result_tensor(value, self.comm_hook, bucket.grad_bucket)
                if self.trace is not None:
                    self.trace.record("complete", bucket=bucket.index)
                writeback.write_back_bucket(bucket, result, plain=plain, zero_copy=self.zero_copy,
                                            as_bucket_view=self.config.gradient_as_bucket_view,
                                            skip=skip)
            self.unused_search.finish(self.wait)
            if self.runtime_log is not None:
                self.runtime_log.mark(BACKWARD_COMM_END)
            if self.trace is not None:
                self.trace.record("finalized")


def _hook_trampoline(reducer_ref: weakref.ref, index: int, *_grads: Any) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_grad_accumulated(index)

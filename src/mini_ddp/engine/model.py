"""``DataParallelModel``: the drop-in replacement for ``torch.nn.parallel.DistributedDataParallel``.

This module owns what happens *around* the module's forward: argument checks, the start-up
sync, the per-forward bookkeeping (bucket rebuild, buffer broadcast, arming the reducer for
backward) and ``no_sync()``. The model's other faces are mixins, one concept each:
comm-hook registration (:mod:`.comm_hook_registration`), torch DDP's semi-private API
(:mod:`.ddp_private_api`) and the ``Join`` protocol (:mod:`.joinable`); the output sink
forward routes its outputs through is :mod:`.output_sink`. How gradients are bucketed and
reduced is the reducer's business (:mod:`mini_ddp.engine.reducer`).

The class derives from ``torch.nn.parallel.DistributedDataParallel`` without running its
constructor; :data:`INHERITED_FROM_TORCH_DDP` lists the few members of torch's class it keeps,
and why each is safe without torch's reducer.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Joinable
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from mini_ddp.engine import construction, pickling, python_reducer
from mini_ddp.engine import join as joining
from mini_ddp.engine.buckets import expect_sparse_gradients
from mini_ddp.engine.comm import (
    BROADCAST_BUCKET_BYTES,
    dist_broadcast_coalesced,
    verify_params_across_ranks,
)
from mini_ddp.engine.comm_hook_registration import CommHookRegistration
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.ddp_private_api import (
    STATIC_AND_FIND_UNUSED,
    TorchDDPInternals,
    TorchDDPPrivateAPI,
)
from mini_ddp.engine.delayed import DelayedAllReduce, check_something_left, ignored_names
from mini_ddp.engine.joinable import JoinableModel
from mini_ddp.engine.logging_data import RuntimeLog
from mini_ddp.engine.mixed_precision import (
    MIXED_PRECISION_BUCKET_VIEW,
    allreduce_and_upcast_hook,
    cast_inputs,
)
from mini_ddp.engine.mixed_precision import setup as mixed_precision_setup
from mini_ddp.engine.output_sink import find_tensors, through_sink
from mini_ddp.engine.reducer import Reducer
from mini_ddp.engine.stall import StallMonitor
from mini_ddp.errors import naming_collective
from mini_ddp.transport.shm import SharedMemoryAllreduce

logger = logging.getLogger("mini_ddp")

# The members of torch DDP's class that DataParallelModel inherits rather than owns, and why
# each is safe although torch's constructor never ran (no C++ reducer, no logger, no buckets).
# Every other member torch's class defines is overridden (tests/test_dropin_ddp_subclass.py).
INHERITED_FROM_TORCH_DDP = {
    "_active_ddp_module": "class attribute (None outside a forward) that torch.compile reads; "
                          "it belongs to torch's class, not to an instance",
    "_get_active_ddp_module": "classmethod: only reads the class attribute _active_ddp_module",
    "_inside_ddp_forward": "context manager: only sets and restores _active_ddp_module",
    "_get_parameters": "generator over a module's parameters; reads nothing of the instance",
    "_get_data_parallel_params": "staticmethod over a module's parameters (skips _ddp_ignored)",
    "scatter": "torch's scatter_kwargs over self.dim, which the constructor keeps",
    "gather": "torch's gather over self.dim, which the constructor keeps",
    "train": "nn.Module.train, then returns self",
}
# Class metadata every class has, or the ABC bookkeeping Joinable brings (not behaviour).
CLASS_METADATA = {"__module__", "__doc__", "__annotations__", "__abstractmethods__",
                  "_abc_impl", "__dict__", "__weakref__", "__qualname__", "__firstlineno__",
                  "__static_attributes__"}


class DataParallelModel(CommHookRegistration, TorchDDPPrivateAPI, TorchDDPInternals,
                        JoinableModel, DistributedDataParallel):
    """Synchronise gradients of ``module`` across processes, exactly like torch DDP.

    Same constructor arguments, same semantics and — on the default path — the same bits as
    ``torch.nn.parallel.DistributedDataParallel``; ``state_dict()`` keys carry the same
    ``module.`` prefix, so checkpoints interchange in both directions.

    It *is* a ``DistributedDataParallel`` for ``isinstance``: PyTorch Lightning, Accelerate,
    the Transformers ``Trainer``, ``torch.distributed.checkpoint`` and ``torch.compile`` choose
    their DDP code paths (manual-backward arming, unwrapping, ``module.`` prefix handling) by
    that check. It never runs torch's constructor — no C++ reducer, logger or bucket exists —
    so it owns every method of torch's class that would reach them: each is implemented over
    mini_ddp's engine or refuses with what mini_ddp does instead; the few inherited members are
    listed with the reason in :data:`INHERITED_FROM_TORCH_DDP`.

    mini_ddp additions (keyword-only): ``sync_timeout_s`` — the bound on waiting for one
    bucket's collective at the end of backward, and for the buffer broadcast before forward
    (default: the process group's timeout; see :class:`DataParallelConfig` and
    docs/reliability.md); ``stall_warning_s`` — after this long (60 s) waiting for a bucket,
    log a warning naming the ranks that have not reached it (None: off); ``zero_copy_write_back`` —
    opt-in (default False): ``.grad`` becomes a view of its bucket after the all-reduce instead
    of a copy of it (one gradient-sized copy less per step; its limits: docs/limitations.md);
    ``shared_memory_allreduce`` / ``shared_memory_min_bytes`` — two CPU ranks on one machine sum
    buckets of at least that size through shared memory instead of Gloo (same bits).
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[int] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *,
                 sync_timeout_s: float | None = None, stall_warning_s: float | None = 60.0,
                 zero_copy_write_back: bool = False,
                 shared_memory_allreduce: bool = True, shared_memory_min_bytes: int = 1 << 20):
        # Not DistributedDataParallel.__init__: it would build torch's C++ reducer.
        nn.Module.__init__(self)
        Joinable.__init__(self)  # uneven inputs: see join() and mini_ddp.engine.join
        self.divide_by_initial_world_size = True  # join(divide_by_initial_world_size=...)
        # Attributes torch DDP's constructor sets and callers read.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._lazy_init_ran = False
        # torch DDP's compiled-autograd mode (optimize_ddp="python_reducer"), decided at
        # construction as torch decides it: see mini_ddp.engine.python_reducer.
        self._use_python_reducer = python_reducer.requested()
        self._accum_grad_hooks: list = []
        self._ddp_sink_clone = True
        self.broadcast_bucket_size = BROADCAST_BUCKET_BYTES
        if not (dist.is_available() and dist.is_initialized()):
            # torch DDP's ValueError and sentence (from looking up the default group).
            raise ValueError(
                "Default process group has not been initialized, please make sure to call "
                "init_process_group. (mini_ddp: DataParallelModel needs torch.distributed to be "
                "initialised first. Call torch.distributed.init_process_group(backend='gloo' "
                "(CPU) or 'nccl' (GPU), ...) in every process before wrapping the model — "
                "torchrun sets the environment for init_method='env://'; see "
                "docs/launching.md.)")
        self._runtime_log = RuntimeLog()
        construction.check_delay_pair(delay_all_reduce_named_params, param_to_hook_all_reduce)
        self.process_group = construction.resolve_process_group(process_group, device_mesh,
                                                                module)
        if static_graph and find_unused_parameters:  # DDP warns the same at construction
            warnings.warn(STATIC_AND_FIND_UNUSED, stacklevel=2)
        if check_reduction:
            warnings.warn("The `check_reduction` argument is deprecated (as in torch DDP) and "
                          "has no effect.", FutureWarning, stacklevel=2)
        self.module = module
        self.dim = dim  # accepted and kept, as torch DDP: only its legacy scatter/gather use it
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.delayed: DelayedAllReduce | None = None
        if delay_all_reduce_named_params is not None:  # see mini_ddp.engine.delayed
            self.parameters_to_ignore |= ignored_names(delay_all_reduce_named_params)
            check_something_left(module, self.parameters_to_ignore)
            self.delayed = DelayedAllReduce(
                delay_all_reduce_named_params, param_to_hook_all_reduce, module,
                self.process_group, device_ids, self.parameters_to_ignore, bucket_cap_mb,
                bucket_cap_mb_list)
            if self.delayed.all_params:  # DDP then builds no reducer at all
                self.reducer = None
                return
        construction.check_params(module, self.parameters_to_ignore)
        self.device_ids, self.output_device = construction.check_device_ids(
            module, self.parameters_to_ignore, device_ids, output_device)
        named = construction.params_for_reducer(module, self.parameters_to_ignore)
        self.device = named[0][1].device
        self.device_type = self.device.type
        construction.check_sync_batchnorm(module, self.device_type)

        if forward_sync_buffers is not None:
            sync_fwd, init_bufs = forward_sync_buffers, True
        else:
            sync_fwd = init_bufs = True if broadcast_buffers is None else broadcast_buffers
        self.config = DataParallelConfig(
            bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list,
            find_unused_parameters=find_unused_parameters,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
            expect_sparse_gradients=expect_sparse_gradients(module, [p for _, p in named]),
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            init_sync=init_sync, init_sync_buffers=init_bufs, forward_sync_buffers=sync_fwd,
            sync_timeout_s=sync_timeout_s, stall_warning_s=stall_warning_s,
            zero_copy_write_back=zero_copy_write_back,
            shared_memory_allreduce=shared_memory_allreduce,
            shared_memory_min_bytes=shared_memory_min_bytes)
        self.config.resolve_sync_timeout(self.process_group)  # None: the group's timeout
        # torch DDP's attribute: torch.compile's DDPOptimizer splits graphs at this many bytes.
        self.bucket_bytes_cap = self.config.bucket_bytes_cap
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph

        if init_sync:
            verify_params_across_ranks(named, self.process_group)
            self.broadcast_module_states(include_buffers=init_bufs)
        self.transport = None
        if self.config.shared_memory_allreduce and self.device_type == "cpu":
            # Collective on the default group when it has two Gloo ranks; None otherwise.
            self.transport = SharedMemoryAllreduce.create(self.process_group)
            if self.transport is not None:  # its worker thread must not outlive the model
                weakref.finalize(self, self.transport.close, wait=False)
        self._attach_reducer(named)
        if self._use_python_reducer:  # our reducer's hooks go: torch's C++ ones do nothing
            self.reducer.remove_autograd_hooks()
            python_reducer.configure_inductor(bucket_cap_mb)
            self._accum_grad_hooks = python_reducer.register_hooks(self, [p for _, p in named])
        self.mixed_precision = mixed_precision
        if mixed_precision is not None:  # torch's sequence: see mini_ddp.engine.mixed_precision
            logger.warning("Received mixed precision config %s", mixed_precision)
            if gradient_as_bucket_view:  # .grad is the bucket view: its dtype shows
                # Accepted and bit-for-bit as torch DDP, but never silently: DDP's upcast hook
                # detaches .grad from the bucket, so later steps re-reduce the first step's.
                warnings.warn(MIXED_PRECISION_BUCKET_VIEW, stacklevel=2)
                self.reducer.layout.use_grad_dtype(mixed_precision.param_dtype)
            self.reducer.zero_copy = False  # .grad must stay the full-precision tensor
            self.register_comm_hook(mixed_precision_setup(
                module, [p for _, p in named], mixed_precision, self.process_group,
                self.reducer.autograd_hook), allreduce_and_upcast_hook)

    def _attach_reducer(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """A fresh reducer (and what watches it) over ``named``: at construction, after
        unpickling, and when ``_set_static_graph`` changes how it must work."""
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named],
                               self.process_group, self.config, self.transport)
        self.reducer.runtime_log = self._runtime_log
        self.stall_monitor = None if self.config.stall_warning_s is None else StallMonitor(
            self.reducer, self.process_group, self.config.stall_warning_s).install()
        self._delay_all_reduce_enqueued = False
        self._comm_hook_registered = False
        self._comm_hook_name: str | None = None

    # ---- pickling (deepcopy, torch.save of the whole model): see mini_ddp.engine.pickling --
    def __getstate__(self) -> dict[str, Any]:
        pickling.check_default_group(self.process_group)
        return pickling.state_to_pickle(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = pickling.default_group_for_unpickle()
        nn.Module.__setstate__(self, state)  # not DDP's: it would build torch's reducer
        self.transport = None  # a copy sums through Gloo (same bits): no second shm channel
        self._attach_reducer(construction.params_for_reducer(self.module,
                                                             self.parameters_to_ignore))

    # ---- construction helpers ------------------------------------------------------------
    def broadcast_module_states(self, include_buffers: bool, src: int = 0) -> None:
        """Broadcast parameters (and buffers) from group rank ``src`` (start-up, join's end)."""
        states = [p for n, p in self.module.named_parameters() if n not in
                  self.parameters_to_ignore]
        if include_buffers:
            states += [b for n, b in self.module.named_buffers() if n not in
                       self.parameters_to_ignore]
        with naming_collective(dist.get_rank(self.process_group),
                               "the start-up broadcast of rank 0's parameters and buffers"):
            dist_broadcast_coalesced(states, src=dist.get_global_rank(self.process_group, src),
                                     group=self.process_group)

    # ---- forward: torch DDP's three steps, under torch DDP's names ---------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; around it, do DDP's per-forward bookkeeping.

        Split as torch DDP splits it (``_pre_forward``, ``_run_ddp_forward``, ``_post_forward``):
        code written against DDP (``torch.distributed._composable.replicate``, compilers) calls
        the three steps by name. Under ``torch.compile`` only the module runs compiled.
        """
        if self._use_python_reducer:  # torch DDP's three steps do nothing (dynamo traces it)
            return self.module(*inputs, **kwargs)
        return self._forward_with_bookkeeping(*inputs, **kwargs)

    # torch.compile: dynamo runs this frame and the bookkeeping around the module eagerly
    # (torch DDP's forward graph-breaks at its own) and compiles only the module's frame, as
    # DDP's active module. torch's lazy decorator: dynamo is imported at the first call.
    @torch._disable_dynamo(recursive=False)
    def _forward_with_bookkeeping(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        return self._post_forward(self._run_ddp_forward(*inputs, **kwargs))

    @torch._disable_dynamo
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Before the module runs: count the iteration, rebuild buckets once, broadcast
        buffers, tell ``Join`` this rank trains, move and cast the inputs."""
        if not self._lazy_init_ran:
            self._lazy_init()
        python_reducer.refuse_compiled_autograd_without_it(self)
        if self.reducer is None:  # every parameter delayed: none of DDP's bookkeeping
            return inputs, kwargs
        trace = self.reducer.trace
        if trace is not None:
            trace.record("forward_start")
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.require_backward_grad_sync:
            self._runtime_log.forward_started(self.reducer.step.num_iterations,
                                              self.reducer.step.ready_order)
            self.reducer.prepare_for_forward()
        joining.notify_forward(self)  # inside Join: "still training"; sets the grad divisor
        if grad_enabled:
            with self._runtime_log.recording_errors():  # e.g. an unfinished prior reduction
                if self.reducer.rebuild_buckets_if_needed():
                    logger.info("mini_ddp: buckets rebuilt in gradient-ready order.")
        if self.will_sync_module_buffers():
            self.sync_buffers()
        # Join's shadow all-reduces go through Gloo: so does every rank's backward meanwhile.
        self.reducer.use_transport = self.transport is not None and not self._join_config.enable
        if self._join_config.enable:
            joining.announce_backward_sync(self, joined=False)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(device), (inputs, kwargs))
        inputs, kwargs = cast_inputs(self.mixed_precision, inputs, kwargs)
        # A backward that runs before _post_forward (a framework's manual backward inside
        # the forward) must be armed explicitly, or it is refused (see Reducer).
        self.reducer.forward_running(grad_enabled and self.require_backward_grad_sync)
        return inputs, kwargs

    @torch._disable_dynamo(recursive=False)  # only the module's own frame is compiled
    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, as torch DDP's: while this model is DDP's active
        module, so ``torch.compile`` splits the module's graph at ``bucket_bytes_cap``
        boundaries (its DDPOptimizer) and gradients become ready in torch DDP's order."""
        if self.reducer is None:  # torch DDP runs this case outside _inside_ddp_forward too
            return self.module(*inputs, **kwargs)
        # What torch DDP's _inside_ddp_forward() does (saved and restored: DDPs may nest),
        # without its context manager, whose contextlib frames dynamo would trace and break in.
        previous = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = self
        try:
            return self.module(*inputs, **kwargs)
        finally:
            DistributedDataParallel._active_ddp_module = previous

    @torch._disable_dynamo
    def _post_forward(self, output: Any) -> Any:
        """After the module ran: arm the reducer for this forward's backward (with the
        unused-parameter search's outputs), route outputs through the sink when needed."""
        if self.reducer is None:
            self.delayed.point_grads_at_buffer()
            return output
        self.reducer.forward_running(False)
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        if synced:
            self.require_forward_param_sync = True
            search = self.find_unused_parameters and not self.static_graph
            self.reducer.prepare_for_backward(find_tensors(output) if search else [])
        else:
            self.require_forward_param_sync = False
            if torch.is_grad_enabled():  # no_sync(): this forward's backward is local by design
                self.reducer.local_backward_follows()
        # A static graph's first synced backward reduces once all its hooks have run; a
        # no_sync() forward before it stays local (see StepState.begin_backward).
        if (self.find_unused_parameters and not self.static_graph) or (
                self.static_graph and not self._delay_all_reduce_enqueued and synced):
            output = through_sink(output, self._on_outputs_backward, clone=self._ddp_sink_clone)
        if self.delayed is not None:
            self.delayed.point_grads_at_buffer()
        if self.reducer.trace is not None:
            self.reducer.trace.record("forward_end")
        return output

    def _on_outputs_backward(self) -> None:
        """The output sink's backward: with a static graph, queue the iteration-1 reduction
        once, to run after all hooks (see :mod:`mini_ddp.engine.output_sink`)."""
        if self.static_graph and not self._delay_all_reduce_enqueued:
            Variable._execution_engine.queue_callback(self.reducer.delay_all_reduce)
            self._delay_all_reduce_enqueued = True

    def will_sync_module_buffers(self) -> bool:
        """True when this forward will broadcast rank 0's buffers first."""
        return (self.require_forward_param_sync and self.config.forward_sync_buffers
                and any(True for _ in self._buffers_to_sync()))

    def _buffers_to_sync(self) -> Iterator[torch.Tensor]:
        # Re-read every time: a module may reassign a buffer attribute.
        return (b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore)

    def sync_buffers(self, src: int | None = None) -> None:
        """Broadcast buffers from group rank ``src``: 0, or under Join the highest active rank
        (rank 0 may have joined with stale buffers; DDP agrees on a rank the same way)."""
        if src is None:
            src = joining.find_common_rank(self, True) if self._join_config.enable else 0
        buffers = tuple(self._buffers_to_sync())
        # Keep version counters unchanged, as DDP does: the broadcast writes in place, and a
        # bumped counter would break a graph that saved a buffer (e.g. for double backward).
        what = f"the broadcast of rank {src}'s {len(buffers)} buffers before forward"
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers), \
                naming_collective(self.reducer.rank, what):
            # Bounded only by a user's sync_timeout_s: torch DDP never blocks the host here.
            dist_broadcast_coalesced(buffers, src=dist.get_global_rank(self.process_group, src),
                                     group=self.process_group,
                                     timeout_s=self.config.buffer_sync_timeout_s)

    # ---- torch DDP's names for the buffer broadcast ------------------------------------
    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before each synced forward."""
        return self.config.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.config.forward_sync_buffers = value

    def _check_sync_bufs_pre_fwd(self) -> bool:
        """Will buffers be broadcast before this forward (DDP's name)?"""
        return self.will_sync_module_buffers()

    def _check_sync_bufs_post_fwd(self) -> bool:
        """After forward: never (that needs a buffer comm hook, which mini_ddp has not)."""
        return False

    def _sync_buffers(self) -> None:
        """DDP's name for :meth:`sync_buffers` from the authoritative rank."""
        self.sync_buffers()

    def _sync_module_buffers(self, authoritative_rank: int) -> None:
        """Broadcast buffers from group rank ``authoritative_rank``."""
        self.sync_buffers(src=authoritative_rank)

    def _default_broadcast_coalesced(self, bufs: Any = None, bucket_size: int | None = None,
                                     authoritative_rank: int = 0) -> None:
        """Broadcast ``bufs`` (default: the synced buffers) from ``authoritative_rank``."""
        self._distributed_broadcast_coalesced(
            tuple(self._buffers_to_sync()) if bufs is None else bufs,
            self.broadcast_bucket_size if bucket_size is None else bucket_size,
            authoritative_rank)

    def _distributed_broadcast_coalesced(self, tensors: Any, buffer_size: int,
                                         authoritative_rank: int = 0) -> None:
        """Overwrite ``tensors`` with group rank ``authoritative_rank``'s, coalesced in
        chunks of ``buffer_size`` bytes (torch's ``_broadcast_coalesced`` contract)."""
        dist_broadcast_coalesced(tensors, src=dist.get_global_rank(self.process_group,
                                                                   authoritative_rank),
                                 group=self.process_group, bucket_bytes=buffer_size,
                                 timeout_s=self.config.sync_timeout_s)

    # ---- user controls -------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backwards inside this context do not synchronise.

        The first forward-backward *after* the context synchronises the accumulated sum.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

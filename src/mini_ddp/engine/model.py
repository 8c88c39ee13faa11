"""``DataParallelModel``: the drop-in replacement for ``torch.nn.parallel.DistributedDataParallel``.

One class, read top to bottom in the order a model lives: **construction** (the constructor's
checks, the config, the reducer), the **start-up sync** (rank 0's parameters and buffers),
**forward** (torch DDP's three steps: bucket rebuild, buffer broadcast, arming the reducer for
backward, the output sink), **no_sync**, **comm hooks** (registration, at most once),
**join** (the model's side of torch's ``Join`` protocol; what a joined rank does is
:mod:`mini_ddp.engine.join`), **pickling** (``copy.deepcopy``, ``torch.save`` of the whole
model) and **torch DDP's underscore API** (what frameworks and torch's tests call by name).
The helpers below the class follow the same order: the constructor's checks, the output sink,
torch DDP's python reducer (compiled autograd), the pickling rule. How gradients are bucketed
and reduced is the reducer's business (:mod:`mini_ddp.engine.reducer`); DDP's logger and the
refusals of torch's internals are :mod:`mini_ddp.engine.torch_api`.

The class derives from ``torch.nn.parallel.DistributedDataParallel`` without running its
constructor; :data:`INHERITED_FROM_TORCH_DDP` lists the few members of torch's class it keeps,
and why each is safe without torch's reducer.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from mini_ddp.engine import join as joining
from mini_ddp.engine import observer
from mini_ddp.engine.buckets import BucketLayout, expect_sparse_gradients
from mini_ddp.engine.comm import (
    BROADCAST_BUCKET_BYTES,
    dist_broadcast_coalesced,
    verify_params_across_ranks,
)
from mini_ddp.engine.config import MIB, DataParallelConfig, debug_requested
from mini_ddp.engine.delayed import DelayedAllReduce, check_something_left, ignored_names
from mini_ddp.engine.hooks import (
    CommHook,
    builtin_comm_hook,
    check_comm_hook,
    hook_name,
    prepare_comm_hook,
)
from mini_ddp.engine.mixed_precision import (
    MIXED_PRECISION_BUCKET_VIEW,
    allreduce_and_upcast_hook,
    cast_inputs,
)
from mini_ddp.engine.mixed_precision import setup as mixed_precision_setup
from mini_ddp.engine.reducer import Reducer
from mini_ddp.engine.torch_api import (
    MODEL_REFUSAL,
    TORCH_INTERNALS,
    RuntimeLog,
    install_refusals,
    logging_data,
    rebuilt_layout,
)
from mini_ddp.errors import MiniDDPError, naming_collective
from mini_ddp.transport.shm import NO_OFFER, SharedMemoryAllreduce

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


class DataParallelModel(DistributedDataParallel):
    """Synchronise gradients of ``module`` across processes, exactly like torch DDP.

    Same constructor arguments, same semantics and — on the default path — the same bits as
    ``torch.nn.parallel.DistributedDataParallel``; ``state_dict()`` keys carry the same
    ``module.`` prefix, so checkpoints interchange in both directions.

    It *is* a ``DistributedDataParallel`` for ``isinstance``: PyTorch Lightning, Accelerate,
    the Transformers ``Trainer``, ``torch.distributed.checkpoint`` and ``torch.compile`` choose
    their DDP code paths (manual-backward arming, unwrapping, ``module.`` prefix handling) by
    that check. It never runs torch's constructor — no C++ reducer, logger or bucket exists —
    so it owns every method of torch's class that would reach them: each is implemented over
    mini_ddp's engine or refuses with what mini_ddp does instead
    (:data:`mini_ddp.engine.torch_api.TORCH_INTERNALS`); the few inherited members are listed
    with the reason in :data:`INHERITED_FROM_TORCH_DDP`.

    mini_ddp additions (keyword-only): ``sync_timeout_s`` — the bound on waiting for one
    bucket's collective at the end of backward, and for the buffer broadcast before forward
    (default: the process group's timeout; see :class:`DataParallelConfig` and
    docs/reliability.md); ``stall_warning_s`` — after this long (60 s) waiting for a bucket,
    log a warning naming the ranks that have not reached it (None: off); ``zero_copy_write_back`` —
    opt-in (default False): ``.grad`` becomes a view of its bucket after the all-reduce instead
    of a copy of it (one gradient-sized copy less per step; its limits: docs/limitations.md);
    ``shared_memory_allreduce`` / ``shared_memory_min_bytes`` — CPU ranks on one machine sum
    buckets of at least that size through shared memory instead of Gloo (same bits);
    ``debug`` — mini_ddp's debug switch (None: ``MINI_DDP_DEBUG=1`` or
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turn it on): the classic mistakes named with their fix;
    ``replica_check_every`` — compare the ranks' parameters, buffers and modes every this many
    steps (100; None: off). See docs/debugging.md and :mod:`mini_ddp.checks.debug`;
    ``grouped_hooks`` — once the gradient order is known, one autograd hook per group of
    gradients instead of one per gradient (default True; same bits, see
    :mod:`mini_ddp.engine.hook_groups`).
    """

    # ==== construction ========================================================================
    # Set by the layers above the engine when they attach (mini_ddp.engine.observer.watch):
    # the stall warning (mini_ddp.watch.stall) and the checks (mini_ddp.checks.debug).
    stall_monitor: Any = None
    sync_checks: Any = None

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
                 shared_memory_allreduce: bool = True, shared_memory_min_bytes: int = 0,
                 debug: bool | None = None, replica_check_every: int | None = 100,
                 grouped_hooks: bool = True):
        # Not DistributedDataParallel.__init__: it would build torch's C++ reducer.
        nn.Module.__init__(self)
        Joinable.__init__(self)  # uneven inputs: see join() and mini_ddp.engine.join
        self.divide_by_initial_world_size = True  # join(divide_by_initial_world_size=...)
        # Attributes torch DDP's constructor sets and callers read.
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._lazy_init_ran = False
        # torch DDP's compiled-autograd mode (optimize_ddp="python_reducer"), decided at
        # construction as torch decides it: see python_reducer_requested below.
        self._use_python_reducer = python_reducer_requested()
        self._accum_grad_hooks: list = []
        self._ddp_sink_clone = True
        self._comm_hook_name: str | None = None  # the registered comm hook's (None: none yet)
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
        check_delay_pair(delay_all_reduce_named_params, param_to_hook_all_reduce)
        self.process_group = resolve_process_group(process_group, device_mesh, module)
        if static_graph and find_unused_parameters:  # DDP warns the same at construction
            warnings.warn(STATIC_AND_FIND_UNUSED, stacklevel=2)
        if check_reduction:
            warnings.warn("The `check_reduction` argument is deprecated (as in torch DDP) and "
                          "has no effect.", FutureWarning, stacklevel=2)
        self.module = module
        self.dim = dim  # accepted and kept, as torch DDP: only its legacy scatter/gather use it
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # The module's tree, walked once for every check, the reducer and the broadcast below.
        walk = walk_module(module)
        # Whether there are buffers to broadcast before a forward: read here and at each
        # broadcast, as torch DDP reads its modules_buffers (a walk over every submodule per
        # forward costs a model of 200 small layers about 0.3 ms).
        self._has_buffers_to_sync = walk.has_buffers(self.parameters_to_ignore)
        self.delayed: DelayedAllReduce | None = None
        if delay_all_reduce_named_params is not None:  # see mini_ddp.engine.delayed
            self.parameters_to_ignore |= ignored_names(delay_all_reduce_named_params)
            self._has_buffers_to_sync = walk.has_buffers(self.parameters_to_ignore)
            check_something_left(module, self.parameters_to_ignore)
            self.delayed = DelayedAllReduce(
                delay_all_reduce_named_params, param_to_hook_all_reduce, module,
                self.process_group, device_ids, self.parameters_to_ignore, bucket_cap_mb,
                bucket_cap_mb_list)
        # torch DDP's list of the managed parameters (ignored and delayed ones left out), kept
        # as it does: its forward's in-backward-optimizer check reads it, not the module tree.
        self._module_parameters = [p for n, p in walk.params if n not in self.parameters_to_ignore]
        if self.delayed is not None and self.delayed.all_params:  # DDP builds no reducer then
            self.reducer = None
            return
        check_params(walk, type(module).__name__, self.parameters_to_ignore)
        self.device_ids, self.output_device = check_device_ids(
            walk, self.parameters_to_ignore, device_ids, output_device)
        named = params_for_reducer(walk, self.parameters_to_ignore)
        self.device = named[0][1].device
        self.device_type = self.device.type
        check_sync_batchnorm(walk.modules, self.device_type)

        if forward_sync_buffers is not None:
            sync_fwd, init_bufs = forward_sync_buffers, True
        else:
            sync_fwd = init_bufs = True if broadcast_buffers is None else broadcast_buffers
        self.config = DataParallelConfig(
            bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list,
            find_unused_parameters=find_unused_parameters,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
            expect_sparse_gradients=expect_sparse_gradients(walk.owned(), [p for _, p in named]),
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            init_sync=init_sync, init_sync_buffers=init_bufs, forward_sync_buffers=sync_fwd,
            sync_timeout_s=sync_timeout_s, stall_warning_s=stall_warning_s,
            zero_copy_write_back=zero_copy_write_back,
            shared_memory_allreduce=shared_memory_allreduce,
            shared_memory_min_bytes=shared_memory_min_bytes, debug=debug_requested(debug),
            replica_check_every=replica_check_every, grouped_hooks=grouped_hooks)
        self.config.resolve_sync_timeout(self.process_group)  # None: the group's timeout
        # torch DDP's attribute: torch.compile's DDPOptimizer splits graphs at this many bytes.
        self.bucket_bytes_cap = self.config.bucket_bytes_cap
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph

        # The flight recorder (kept with the stall warning, mini_ddp.watch) starts before the
        # start-up broadcast, so that broadcast is its first entry on every rank.
        flight = observer.startup_recorder(self)
        # The shared-memory transport's start-up offers ride on the parameter check's
        # all-gather; then its two votes run on the model's group (None unless Gloo ranks
        # sharing a host, and every rank asked for it), before the start-up broadcast, so that
        # its worker reserves the buckets' memory while the broadcast runs (when iteration 1's
        # layout is summed there: not when DDP rebuilds it, BucketLayout.shared_sizes).
        offer = SharedMemoryAllreduce.offer(self.process_group) \
            if self.config.shared_memory_allreduce and self.device_type == "cpu" else None
        offers, self.transport = None, None
        managed = [p for _, p in named]
        layout = BucketLayout.initial_layout(managed, self.config)
        try:
            if init_sync:
                offers = verify_params_across_ranks(
                    named, self.process_group, NO_OFFER if offer is None else offer.fields)
            self.transport = SharedMemoryAllreduce.from_offer(offer, offers)
            if self.transport is not None:  # its worker thread must not outlive the model
                weakref.finalize(self, self.transport.close, wait=False)
                if init_sync:  # the buckets' memory is reserved while the broadcast runs
                    self.transport.reserve(BucketLayout.shared_sizes(layout, managed,
                                                                     self.config))
            if init_sync:
                self.broadcast_module_states(include_buffers=init_bufs, flight=flight,
                                             walk=walk)
        except BaseException:
            if self.transport is not None:
                self.transport.close(wait=False)
            elif offer is not None:
                offer.close()
            raise
        self._attach_reducer(named, flight=flight, modules=walk.modules, layout=layout)
        if self._use_python_reducer:  # our reducer's hooks go: torch's C++ ones do nothing
            self.reducer.remove_autograd_hooks()
            configure_inductor(self.config.bucket_bytes_cap)
            self._accum_grad_hooks = register_python_reducer_hooks(self,
                                                                   [p for _, p in named])
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

    def _attach_reducer(self, named: list[tuple[str, nn.Parameter]],
                        comm_hook: tuple[CommHook, object] | None = None,
                        flight: Any = None,
                        modules: list[tuple[str, nn.Module]] | None = None,
                        layout: list[list[int]] | None = None) -> None:
        """A fresh reducer (and what watches it) over ``named``: at construction, after
        unpickling, and when ``_set_static_graph`` changes how it must work.

        ``comm_hook`` is the registered hook (as prepared) and its state, carried over to the
        new reducer by ``_set_static_graph``; None leaves the new reducer without one, as
        after construction and unpickling (torch DDP's copy drops its hook with the reducer).
        ``flight``: the flight recorder to keep (None: the stall monitor starts a fresh one).
        ``modules``: the module's ``named_modules()`` when the caller has them (None: read).
        ``layout``: iteration 1's buckets when the caller made them (None: the reducer does).
        """
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named],
                               self.process_group, self.config, self.transport,
                               modules=list(self.module.named_modules()) if modules is None
                               else modules, layout=layout)
        self.reducer.runtime_log = self._runtime_log
        self._runtime_log.use_device([p.device for _, p in named])
        self.reducer.observers.add(self._runtime_log)
        if flight is not None:
            self.reducer.flight = flight
        # What the layers above the engine attach (mini_ddp.engine.observer): the stall
        # warning and its flight log (mini_ddp.watch), the replica check and, under the debug
        # switch, the other checks (mini_ddp.checks): they set stall_monitor and sync_checks.
        observer.watch(self)
        self._delay_all_reduce_enqueued = False
        if comm_hook is None:
            self._comm_hook_name = None
        else:
            self.reducer.comm_hook, self.reducer.comm_hook_state = comm_hook

    # ==== start-up sync =======================================================================
    def broadcast_module_states(self, include_buffers: bool, src: int = 0,
                                flight: Any = None, op: str = "startup_broadcast",
                                walk: ModuleWalk | None = None) -> None:
        """Broadcast parameters (and buffers) from group rank ``src`` (start-up, join's end).

        Recorded as ``op`` in ``flight``, else in the reducer's flight recorder (if any).
        ``walk``: the module's tree as the constructor walked it (None: walk it now).
        """
        walk = walk_module(self.module) if walk is None else walk
        ignore = self.parameters_to_ignore
        states = [p for n, p in walk.params if n not in ignore]
        if include_buffers:
            states += [b for n, b in walk.buffers if n not in ignore]
        reducer = getattr(self, "reducer", None)  # None at start-up: built after this
        if flight is None and reducer is not None:
            flight = reducer.flight
        step = 0 if reducer is None else reducer.step.num_iterations
        with naming_collective(dist.get_rank(self.process_group),
                               "the start-up broadcast of rank 0's parameters and buffers"):
            dist_broadcast_coalesced(states, src=dist.get_global_rank(self.process_group, src),
                                     group=self.process_group, flight=flight, op=op, step=step)

    # ==== forward: torch DDP's three steps, under torch DDP's names ===========================
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; around it, do DDP's per-forward bookkeeping.

        Split as torch DDP splits it (``_pre_forward``, ``_run_ddp_forward``, ``_post_forward``):
        code written against DDP (``torch.distributed._composable.replicate``, compilers) calls
        the three steps by name. Under ``torch.compile`` only the module runs compiled.
        """
        if self._use_python_reducer:  # torch DDP's three steps do nothing (dynamo traces it)
            return self.module(*inputs, **kwargs)
        # Under tracing is_compiling() is a constant True, so dynamo never reads sys.modules.
        if torch.compiler.is_compiling() or "torch._dynamo" in sys.modules:
            return self._forward_with_bookkeeping(*inputs, **kwargs)
        return self._forward_without_dynamo(*inputs, **kwargs)

    # torch.compile: dynamo runs this frame and the bookkeeping around the module eagerly
    # (torch DDP's forward graph-breaks at its own) and compiles only the module's frame, as
    # DDP's active module. torch's lazy decorator: dynamo is imported at the first call.
    @torch._disable_dynamo(recursive=False)
    def _forward_with_bookkeeping(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        return self._post_forward(self._run_ddp_forward(*inputs, **kwargs))

    def _forward_without_dynamo(self, *inputs: Any, **kwargs: Any) -> Any:
        """:meth:`_forward_with_bookkeeping` while ``torch._dynamo`` is not imported: then no
        frame can be traced, nor intercepted by dynamo's frame hook, so the three steps run
        without torch's lazy disabling wrappers, whose first call would import dynamo (2-3 s
        of CPU, which a process that never compiles need not pay; ``torch.compile`` imports
        it before anything is compiled)."""
        inputs, kwargs = without_dynamo_wrapper(self._pre_forward)(*inputs, **kwargs)
        output = without_dynamo_wrapper(self._run_ddp_forward)(*inputs, **kwargs)
        return without_dynamo_wrapper(self._post_forward)(output)

    @torch._disable_dynamo
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Before the module runs: count the iteration, rebuild buckets once, broadcast
        buffers, tell ``Join`` this rank trains, move and cast the inputs."""
        if not self._lazy_init_ran:
            self._lazy_init()
        refuse_compiled_autograd_without_python_reducer(self)
        if self.reducer is None:  # every parameter delayed: none of DDP's bookkeeping
            return inputs, kwargs
        grad_enabled = torch.is_grad_enabled()
        self.reducer.observers.forward_begun(self)  # before this forward's first collective
        if grad_enabled and self.require_backward_grad_sync:
            reducer = self.reducer
            self._runtime_log.forward_started(reducer.step.num_iterations,
                                              reducer.step.ready_order,
                                              lambda: rebuilt_layout(reducer))
            self.reducer.prepare_for_forward()
        joining.notify_forward(self)  # inside Join: "still training"; sets the grad divisor
        if grad_enabled:
            with self._runtime_log.recording_errors():  # e.g. an unfinished prior reduction
                self.reducer.rebuild_buckets_if_needed()  # logs its one line at INFO
        broadcast = self.will_sync_module_buffers()
        if broadcast:
            self.sync_buffers()
        if grad_enabled and self.require_backward_grad_sync:
            self.reducer.observers.forward_ready(self, broadcast)
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
        except BaseException:
            # The module raised: no backward of this forward can come, so the reducer stops
            # treating one as running (torch DDP: prepare_for_backward never runs, and hooks
            # until the next forward are ignored). A bare raise: the exception goes on as the
            # module raised it (same object, traceback, nothing chained).
            self.reducer.forward_running(False)
            raise
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
            # The outputs: where the unused-parameter search starts, and where the reducer
            # hears that backward has begun (Reducer.backward_begins).
            self.reducer.prepare_for_backward(find_tensors(output))
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
        self.reducer.observers.forward_ended(self)
        return output

    def _on_outputs_backward(self) -> None:
        """The output sink's backward: with a static graph, queue the iteration-1 reduction
        once, to run after all hooks (see :class:`OutputSink`)."""
        if self.static_graph and not self._delay_all_reduce_enqueued:
            Variable._execution_engine.queue_callback(self.reducer.delay_all_reduce)
            self._delay_all_reduce_enqueued = True

    @property
    def joining(self) -> bool:
        """Whether this model has been inside ``join()`` (torch's ``Join`` leaves the model's
        join config enabled after the context)."""
        return self._join_config.enable

    @property
    def uses_python_reducer(self) -> bool:
        """torch's compiled-autograd mode (``optimize_ddp="python_reducer"``): the engine's
        hooks are off and torch's compiled autograd reduces."""
        return self._use_python_reducer

    def will_sync_module_buffers(self) -> bool:
        """True when this forward will broadcast rank 0's buffers first."""
        return (self.require_forward_param_sync and self.config.forward_sync_buffers
                and self._has_buffers_to_sync)

    def _buffers_to_sync(self) -> Iterator[torch.Tensor]:
        # Re-read at every broadcast: a module may reassign a buffer attribute.
        return (b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore)

    def sync_buffers(self, src: int | None = None) -> None:
        """Broadcast buffers from group rank ``src``: 0, or under Join the highest active rank
        (rank 0 may have joined with stale buffers; DDP agrees on a rank the same way)."""
        if src is None:
            src = joining.find_common_rank(self, True) if self._join_config.enable else 0
        buffers = tuple(self._buffers_to_sync())
        self._has_buffers_to_sync = bool(buffers)  # torch DDP re-reads its list here too
        # Keep version counters unchanged, as DDP does: the broadcast writes in place, and a
        # bumped counter would break a graph that saved a buffer (e.g. for double backward).
        what = f"the broadcast of rank {src}'s {len(buffers)} buffers before forward"
        reducer = self.reducer
        slow = reducer.on_slow_broadcast  # the stall warning (mini_ddp.watch.stall)
        on_slow = None if slow is None else \
            functools.partial(slow, reducer, reducer.step.num_iterations)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers), \
                naming_collective(self.reducer.rank, what):
            # Bounded only by a user's sync_timeout_s: torch DDP never blocks the host here.
            dist_broadcast_coalesced(buffers, src=dist.get_global_rank(self.process_group, src),
                                     group=self.process_group,
                                     timeout_s=self.config.buffer_sync_timeout_s,
                                     flight=reducer.flight, op="buffers_broadcast",
                                     step=reducer.step.num_iterations,
                                     stall_after_s=reducer.stall_after_s, on_slow=on_slow)

    # ---- torch DDP's names for the buffer broadcast ----------------------------------------
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

    # ==== no_sync =============================================================================
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

    # ==== comm hooks: register_comm_hook and torch DDP's built-in ones, at most one, once =====
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``.

        Same contract as torch DDP, so torch's own hooks (``default_hooks.allreduce_hook``,
        ``fp16_compress_hook``, PowerSGD, …) run unchanged. The hook must average the
        gradients itself: with a hook, gradients are copied into buckets unscaled.

        On Gloo, torch's PowerSGD and quantization hooks are wrapped in
        :func:`mini_ddp.engine.hooks.gloo_safe` (each bucket finishes before the next starts): as
        they are, they deadlock there, in torch DDP too. See docs/comm_hooks.md.
        """
        self._check_comm_hook(hook)
        self._install_comm_hook(state, hook, hook_name(hook), TWO_HOOKS)

    def _check_comm_hook(self, hook: CommHook) -> None:
        """torch DDP's checks on a hook (callable, signature), recorded as DDP records them."""
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as err:
            self._runtime_log.record_error(err)
            raise

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch DDP's C++ built-in hooks (``dist.BuiltinCommHookType.ALLREDUCE``,
        ``FP16_COMPRESS``), run as the equivalent Python hooks of torch's ``default_hooks``
        (same operations, same bits; see :func:`mini_ddp.engine.hooks.builtin_comm_hook`)."""
        self._install_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type),
                                str(comm_hook_type), TWO_HOOKS_BUILTIN)

    def _install_comm_hook(self, state: object, hook: CommHook, name: str, twice: str
                           ) -> None:
        if self._comm_hook_name is not None:
            err = RuntimeError(f"{twice} (mini_ddp: {name} cannot replace "
                               f"{self._comm_hook_name}, registered before)")
            self._runtime_log.record_error(err)
            raise err
        self._comm_hook_name = name
        self.reducer.comm_hook = prepare_comm_hook(hook, state, self.process_group, self.device,
                                                   self.config.sync_timeout_s)
        self.reducer.comm_hook_state = state

    # ==== join: the model's side of torch's Join protocol (uneven inputs) =====================
    # What a joined rank does (shadowing the others' collectives, the final broadcast) is
    # mini_ddp.engine.join, over the model's public face; these methods wire the model into
    # Join and answer the underscore steps of torch DDP's own join hook by name.
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across ranks, as torch DDP's ``join``.

        Ranks that run out of batches shadow the others' collectives until all are done; the
        last rank to finish then broadcasts its model. Gradients are divided by the initial
        world size, or by the number of ranks still training when
        ``divide_by_initial_world_size=False``. With ``throw_on_early_termination=True`` every
        rank raises as soon as one runs out. Equivalent to ``Join([model], ...)``; see
        :mod:`mini_ddp.engine.join`.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The :class:`~torch.distributed.algorithms.join.Joinable` hook (``Join`` calls it)."""
        return joining.DataParallelJoinHook(
            self, kwargs.get("divide_by_initial_world_size", True))

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> bool | None:
        """The all-reduce telling joined ranks whether this backward syncs (DDP's step)."""
        return joining.announce_backward_sync(self, joined=is_joined_rank)

    def _check_and_sync_module_buffers(self) -> None:
        """A joined rank's side of the buffer broadcast before forward (DDP's step)."""
        if self.will_sync_module_buffers():
            self.sync_buffers(src=joining.find_common_rank(self, candidate=False))

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (DDP's step)."""
        joining.sync_final_model(self, is_last_joiner)

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """The highest rank for which ``rank_cond`` holds (``input_rank`` is this rank's)."""
        return joining.find_common_rank(self, candidate=rank_cond)

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's own all-reduces."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """Process group of the join protocol's own all-reduces."""
        return self.process_group

    # ==== pickling: copy.deepcopy, torch.save / torch.load of the whole model =================
    # As torch DDP: what cannot be pickled — the process group, the reducer (autograd hooks,
    # buckets, futures) and, here, the shared-memory transport (files and a thread) — is
    # dropped, and unpickling rebuilds the reducer over the copy's own parameters on the
    # *default* process group. So pickling is only allowed when the model uses the default
    # group, and loading needs an initialised default group (torch's ValueError otherwise).
    # Rebuilding runs no collective: one rank may deepcopy its model (an EMA copy) without the
    # others; the copy joins gradient synchronisation the next time it runs forward and
    # backward, on every rank. The copy starts like a freshly built model (first-iteration
    # bucket layout, no comm hook — torch DDP's copy drops its hook with the reducer too),
    # except that no start-up broadcast runs: the copy's parameters are what was pickled.
    def __getstate__(self) -> dict[str, Any]:
        check_default_group(self.process_group)
        state = copy.copy(self.__dict__)
        for name in _NOT_PICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = _get_default_group()
        nn.Module.__setstate__(self, state)  # not DDP's: it would build torch's reducer
        self.transport = None  # a copy sums through Gloo (same bits): no second shm channel
        self._attach_reducer(params_for_reducer(walk_module(self.module),
                                                self.parameters_to_ignore))

    # ==== torch DDP's underscore API ==========================================================
    # Real training code, frameworks (PyTorch Lightning, Accelerate) and torch's own tests call
    # these, so a drop-in replacement has them, with torch's warnings and error sentences.
    def _set_static_graph(self) -> None:
        """Switch to ``static_graph=True`` after construction, before the first forward."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.step.num_iterations != 0:
            err = RuntimeError(f"{STATIC_GRAPH_LATE} (mini_ddp: {self.reducer.step.num_iterations} "
                               "iterations have run)")
            self._runtime_log.record_error(err)
            raise err
        self.static_graph = self.config.static_graph = True
        # Nothing has run yet: a fresh reducer takes the static-graph rules from the start
        # (first-iteration layout, no zero-copy write-back), keeping a registered hook.
        hook = None if self._comm_hook_name is None else (self.reducer.comm_hook,
                                                          self.reducer.comm_hook_state)
        self._attach_reducer(list(zip(self.reducer.names, self.reducer.params, strict=True)),
                             comm_hook=hook, flight=self.reducer.flight)
        if self.find_unused_parameters:
            warnings.warn(STATIC_AND_FIND_UNUSED, stacklevel=2)

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch DDP's debugging dict (same keys, meanings and types where we know them; see
        :func:`mini_ddp.engine.torch_api.logging_data`)."""
        return logging_data(self, self._runtime_log, self._comm_hook_name)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample runtime statistics every ``sample_rate`` iterations after the first ten."""
        try:
            self._runtime_log.set_sample_rate(sample_rate)
        except ValueError as err:
            self._runtime_log.record_error(err)
            raise

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]
                                                    ) -> None:
        """Exclude parameters/buffers by name from syncing (DDP's static method of this name).

        Marks each named tensor ``_ddp_ignored`` too, as torch does (its
        ``_get_data_parallel_params`` and composable APIs read that mark).
        """
        module._ddp_params_and_buffers_to_ignore = names
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if name in names:
                tensor._ddp_ignored = True

    def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> NoReturn:
        """Record ``err_msg`` in the logging data (key ``error``) and raise it, as DDP does."""
        err = err_type(err_msg)
        self._runtime_log.record_error(err)
        raise err

    def _check_default_group(self) -> None:
        """Raise torch's RuntimeError unless the model reduces over the default group."""
        with self._runtime_log.recording_errors():
            check_default_group(self.process_group)

    @property
    def _distributed_rank(self) -> int:
        """This process's rank in the model's process group."""
        return dist.get_rank(self.process_group)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward left gradients unreduced (DDP's check of that name)."""
        self.reducer.ensure_prior_reduction_finished()

    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's gradient hooks: later backwards do not synchronise."""
        self.reducer.remove_autograd_hooks()

    def _fire_reducer_autograd_hook(self, idx: int, *unused: Any) -> None:
        """Run parameter ``idx``'s gradient hook by hand (DDP's mixed-precision path does)."""
        self.reducer.autograd_hook(idx)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the output sink clones the outputs (default True, as DDP's DDPSink)."""
        self._ddp_sink_clone = val

    def _lazy_init(self) -> None:
        """What DDP initialises before the first forward: the in-backward optimizer check."""
        self._setup_in_backward_optimizers()
        self._lazy_init_ran = True

    def _setup_in_backward_optimizers(self) -> None:
        """Refuse ``_apply_optimizer_in_backward``: its optimizers would step on unreduced
        gradients (DDP re-routes them through a comm hook; mini_ddp does not)."""
        if not any(hasattr(p, "_in_backward_optimizers") for p in self._module_parameters):
            return
        culprits = [n for n, p in self.module.named_parameters()
                    if hasattr(p, "_in_backward_optimizers")]
        if culprits:
            raise NotImplementedError(
                "mini_ddp: optimizers applied in backward (torch.distributed.optim."
                "_apply_optimizer_in_backward) are not supported; they would step on "
                f"gradients that are not yet averaged. Parameters: {culprits[:5]}. Step the "
                "optimizer after backward instead.")

    def _clear_grad_buffer(self) -> None:
        """Point ``.grad`` of the delayed parameters at their buffer (DDP's after-forward step
        for ``delay_all_reduce_named_params``); nothing to do without delayed parameters."""
        if self.delayed is not None:
            self.delayed.point_grads_at_buffer()

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """Raise DDP's ValueError if ``module`` has SyncBatchNorm layers on CPU."""
        with self._runtime_log.recording_errors():
            check_sync_batchnorm(list(module.named_modules()), self.device_type)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int) -> tuple[tuple, tuple]:
        """Move inputs to ``device_id`` (DDP keeps this for backward compatibility)."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id), False)


# The members of torch's class only its own constructor, reducer or join hook call: refusals
# naming what mini_ddp does instead (mini_ddp.engine.torch_api.TORCH_INTERNALS).
install_refusals(DataParallelModel, TORCH_INTERNALS, MODEL_REFUSAL)


# ==== construction: what the constructor checks before it builds anything =====================
# Where torch DDP refuses a mistake, we refuse it with the same exception type and a message
# that starts with torch's own sentence, verbatim, so code that matches on DDP's errors keeps
# working; our detail (which parameter, which devices) follows it.

NO_GRAD_PARAMS = ("DistributedDataParallel is not needed when a module doesn't have any "
                  "parameter that requires a gradient.")
SINGLE_DEVICE_ID = "device_ids can only be None or contain a single element."
UNINITIALIZED = ("Modules with uninitialized parameters can't be used with "
                 "`DistributedDataParallel`. Run a dummy forward pass to correctly initialize "
                 "the modules")
DELAY_PAIR = ("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at "
              "the same time.")
MESH_AND_GROUP = "Cannot specify both process_group and device_mesh arguments."
SYNC_BN_CPU = "SyncBatchNorm layers only work with GPU modules"
STATIC_AND_FIND_UNUSED = (
    "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
    "will detect unused parameters automatically, so you do not need to set "
    "find_unused_parameters=true, just be sure these unused parameters will not change during "
    "training loop while calling `_set_static_graph`.")
STATIC_GRAPH_LATE = ("set_static_graph() should be called before training loop starts and "
                     "after DistributedDataParallel is constructed.")
# torch's C++ reducer words it in the order of the call that comes second.
TWO_HOOKS = "register_comm_hook or register_builtin_comm_hook can only be called once."
TWO_HOOKS_BUILTIN = "register_builtin_comm_hook or register_comm_hook can only be called once."


def resolve_process_group(process_group: dist.ProcessGroup | None, device_mesh: Any,
                          module: nn.Module) -> dist.ProcessGroup:
    """The group to reduce over: ``process_group``, a 1-D ``device_mesh``'s group, or WORLD.

    As torch DDP: the two are mutually exclusive, and only a one-dimensional mesh is accepted
    (its dimension 0 is the data-parallel group). A mesh sliced out of a larger one means DDP
    combined with tensor parallelism: like torch DDP, ``module``'s DTensor parameters are then
    turned into local tensors (re-wrapped around each forward) by torch's own
    ``_pre_dp_module_transform``, before any parameter is inspected.
    """
    if process_group and device_mesh is not None:
        raise RuntimeError(MESH_AND_GROUP)
    if device_mesh is None:
        return process_group or dist.group.WORLD
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(module)
    return device_mesh.get_group(mesh_dim=0)


def check_delay_pair(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any) -> None:
    """DDP needs both keywords or neither."""
    if (delay_all_reduce_named_params is not None) != (param_to_hook_all_reduce is not None):
        raise ValueError(f"{DELAY_PAIR} (mini_ddp: got delay_all_reduce_named_params="
                         f"{delay_all_reduce_named_params!r}, param_to_hook_all_reduce="
                         f"{type(param_to_hook_all_reduce).__name__})")


@dataclass
class ModuleWalk:
    """A module's tree, walked once: what the constructor's checks, the reducer and the
    start-up broadcast read (each walking it again costs a model of 200 small layers ~0.3 ms).

    ``modules``: ``named_modules()``; ``own``: each of those modules' own parameters, as its
    ``named_parameters(recurse=False)`` gives them, with full names; ``params`` and
    ``buffers``: the module's ``named_parameters()`` and ``named_buffers()``.
    """

    modules: list[tuple[str, nn.Module]]
    own: list[list[tuple[str, nn.Parameter]]]
    params: list[tuple[str, nn.Parameter]]
    buffers: list[tuple[str, torch.Tensor]]

    def has_buffers(self, ignore: set[str]) -> bool:
        """Whether any buffer is not ignored (there is something to broadcast before forward)."""
        return any(n not in ignore for n, _ in self.buffers)

    def owned(self) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """Each module with its own parameters, in ``modules`` order."""
        return [(m, [p for _, p in own]) for (_, m), own in zip(self.modules, self.own,
                                                                 strict=True)]


def _reads_its_own_members(module: nn.Module) -> bool:
    """Whether ``module``'s parameter and buffer accessors are nn.Module's own (so its
    ``_parameters`` and ``_buffers`` are what they yield)."""
    cls = type(module)
    return (cls.named_parameters is nn.Module.named_parameters
            and cls.named_buffers is nn.Module.named_buffers
            and cls._named_members is nn.Module._named_members)


def walk_module(module: nn.Module) -> ModuleWalk:
    """:class:`ModuleWalk` of ``module``: one ``named_modules()`` pass reading each module's
    own members, in the order and with the de-duplication torch's accessors use (a tensor
    registered twice is kept at its first name). A module that overrides the accessors is
    asked through them instead."""
    modules = list(module.named_modules())
    if not all(_reads_its_own_members(m) for _, m in modules):
        own = [[(f"{prefix}.{k}" if prefix else k, p) for k, p in m.named_parameters(
            recurse=False)] for prefix, m in modules]
        return ModuleWalk(modules, own, list(module.named_parameters()),
                          list(module.named_buffers()))
    own, params, buffers = [], [], []
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    for prefix, m in modules:
        mine, local = [], set()
        for k, p in m._parameters.items():
            if p is None or id(p) in local:
                continue
            local.add(id(p))
            name = f"{prefix}.{k}" if prefix else k
            mine.append((name, p))
            if id(p) not in seen_params:
                seen_params.add(id(p))
                params.append((name, p))
        own.append(mine)
        for k, b in m._buffers.items():
            if b is not None and id(b) not in seen_buffers:
                seen_buffers.add(id(b))
                buffers.append((f"{prefix}.{k}" if prefix else k, b))
    return ModuleWalk(modules, own, params, buffers)


def params_for_reducer(walk: ModuleWalk, ignore: set[str]) -> list[tuple[str, nn.Parameter]]:
    """DDP's parameter order: modules in ``named_modules()`` order, each module's own
    parameters that require grad, shared parameters kept at their first occurrence (after
    the filter, as torch DDP's ``_build_params_for_reducer``)."""
    seen: set[int] = set()
    named = []
    for own in walk.own:
        for name, param in own:
            if not param.requires_grad or name in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            named.append((name, param))
    return named


def check_params(walk: ModuleWalk, what: str, ignore: set[str]) -> None:
    """DDP's checks on the module's (not ignored) parameters, in DDP's order; ``what``: the
    module's class name."""
    managed = [(n, p) for n, p in walk.params if n not in ignore]
    if not any(p.requires_grad for _, p in managed):
        raise RuntimeError(f"{NO_GRAD_PARAMS} (mini_ddp: {what} has "
                           f"{len(managed)} such parameters, none requires grad)")
    device_types = {p.device.type for _, p in managed}
    if len(device_types) != 1:
        where = {t: next(n for n, p in managed if p.device.type == t) for t in device_types}
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {device_types}. (mini_ddp: e.g. {where}"
            f"{'; materialise meta device parameters first' if 'meta' in device_types else ''})")
    for name, param in managed:
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(f"{UNINITIALIZED} (mini_ddp: parameter '{name}' is uninitialized)")
    for name, param in managed:
        if param.device.type == "meta":
            # torch DDP fails later, inside its start-up collectives.
            raise RuntimeError(f"mini_ddp: parameter '{name}' is on the meta device: "
                               "materialise the model (e.g. to_empty + init) first.")


def check_device_ids(walk: ModuleWalk, ignore: set[str], device_ids: Any, output_device: Any
                     ) -> tuple[list[int] | None, int | None]:
    """``(device_ids, output_device)`` as DDP normalises them (None for CPU/multi-device)."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"{SINGLE_DEVICE_ID} (mini_ddp: got {list(device_ids)}; one device "
                         "per process)")
    devices = {p.device for n, p in walk.params if n not in ignore}
    device_type = next(iter(devices)).type
    if not device_ids or device_type == "cpu" or len(devices) > 1:
        # As DDP: a falsy output_device (0) passes unnoticed on CPU.
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work "
                "with single-device/multiple-device GPU modules or CPU modules, but got "
                f"device_ids {device_ids}, output_device {output_device}, and module "
                f"parameters {devices}.")
        return None, None
    ids = [torch._utils._get_device_index(d, True) for d in device_ids]
    out = ids[0] if output_device is None else torch._utils._get_device_index(output_device,
                                                                               True)
    return ids, out


def check_sync_batchnorm(modules: list[tuple[str, nn.Module]], device_type: str) -> None:
    """DDP refuses SyncBatchNorm on CPU at construction (its forward would fail anyway);
    ``modules``: the module's ``named_modules()``."""
    if device_type != "cpu":
        return
    for name, layer in modules:
        if isinstance(layer, nn.SyncBatchNorm):
            where = f"layer '{name}'" if name else "module"
            raise ValueError(f"{SYNC_BN_CPU} (mini_ddp: the SyncBatchNorm {where} is on CPU; "
                             "use nn.BatchNorm* there, or convert with "
                             "nn.SyncBatchNorm.convert_sync_batchnorm only on GPU)")


# ==== the output sink: an identity on the forward's outputs whose backward runs first =========
# forward routes its outputs through it when it must act before any parameter gradient
# arrives (find_unused_parameters, a static graph's first iteration), and find_tensors
# collects the outputs the unused-parameter search starts from.

class OutputSink(torch.autograd.Function):
    """Identity on the forward outputs whose backward runs before any parameter gradient.

    With ``find_unused_parameters`` it keeps undefined gradients undefined
    (``set_materialize_grads(False)``): an output left out of the loss then sends *no*
    gradient into its subgraph, whose parameters' hooks still fire — marked ready with zeros
    and kept as globally unused, as in DDP. With ``static_graph`` its backward queues the
    iteration-1 reduction, which must run after all hooks
    (:meth:`DataParallelModel._on_outputs_backward`).
    """

    @staticmethod
    def forward(ctx: Any, on_backward: weakref.WeakMethod, clone: bool, *outputs: Any) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        # DDPSink clones unless ``_set_ddp_sink_clone(False)``: a loss modified in place must
        # not be the sink's own output.
        return tuple(o.clone() if clone and isinstance(o, torch.Tensor) else o for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        on_backward = ctx.on_backward()  # None once the model is gone
        if on_backward is not None:
            on_backward()
        return (None, None, *grads)


def through_sink(output: Any, on_backward: Callable[[], None], clone: bool = True) -> Any:
    """Route every output tensor through :class:`OutputSink`; ``on_backward`` (a bound method,
    held weakly: the graph must not keep the model alive) runs when its backward does;
    ``clone=False`` passes the tensors through uncloned (``_set_ddp_sink_clone(False)``)."""
    leaves, spec = pytree.tree_flatten(output)
    passed = OutputSink.apply(weakref.WeakMethod(on_backward), clone, *leaves)
    # Tensors that are not part of a graph stay as they were (DDP does the same).
    merged = [leaf if isinstance(leaf, torch.Tensor) and leaf.grad_fn is None else new
              for leaf, new in zip(leaves, passed, strict=True)]
    return pytree.tree_unflatten(merged, spec)


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in an output: tensors, lists/tuples (namedtuples), dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in find_tensors(item)]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in fields(obj) for t in find_tensors(getattr(obj, f.name))]
    return []


# ==== torch DDP's "python reducer": the mode compiled autograd synchronises gradients in ======
# With torch._dynamo.config.optimize_ddp = "python_reducer" set before construction, torch DDP
# skips its reducer altogether: its forward does no bookkeeping, and a post-accumulate-grad
# hook on every parameter divides .grad by the world size, all-reduces it with a functional
# collective (torch.distributed._functional_collectives.all_reduce) and copies the result
# back. Under compiled autograd (torch._dynamo.config.compiled_autograd = True) those hooks are
# traced into the compiled backward and inductor buckets the all-reduces
# (_fuse_ddp_communication). DataParallelModel in that mode does exactly the same, so it gives
# torch DDP's bits; its own reducer (buckets, hooks on AccumulateGrad nodes) is left unarmed,
# as torch DDP leaves its C++ one.

def python_reducer_requested() -> bool:
    """Is torch.compile configured for the python reducer (``optimize_ddp="python_reducer"``)?

    Only dynamo's config can ask for it, so without ``torch._dynamo`` imported the answer is
    no — and constructing a model does not import dynamo (seconds of CPU) to find out.
    """
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and dynamo.utils.get_optimize_ddp_mode() == "python_reducer"


def without_dynamo_wrapper(method: Callable[..., Any]) -> Callable[..., Any]:
    """A bound method decorated with ``torch._disable_dynamo``, as the function the decorator
    wraps (torch's wrapper keeps it as ``__wrapped__``) bound to the same object; a method
    without the wrapper (a subclass's own) as it is."""
    function = getattr(getattr(method, "__func__", None), "__wrapped__", None)
    return method if function is None else function.__get__(method.__self__)


def refuse_compiled_autograd_without_python_reducer(model: DataParallelModel) -> None:
    """Before a forward on mini_ddp's own reducer: refuse compiled autograd (its hooks cannot
    run inside a compiled backward; the step's gradients would stay local)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and dynamo.config.compiled_autograd:
        rank = torch.distributed.get_rank(model.process_group)
        raise MiniDDPError(
            f"mini_ddp: torch._dynamo.config.compiled_autograd is on (rank {rank}), but "
            "DataParallelModel was built without torch DDP's python reducer: its own reducer's "
            "gradient hooks cannot run inside a compiled backward, and the gradients would not "
            "be averaged. Set torch._dynamo.config.optimize_ddp = \"python_reducer\" before "
            "building the model (as torch DDP requires for compiled autograd; see "
            "docs/compile.md), or turn compiled_autograd off.")


def configure_inductor(bucket_bytes_cap: int) -> None:
    """What torch DDP's constructor sets in this mode: inductor fuses the traced all-reduces
    into buckets of the cap (the fused layout decides Gloo's summation order). torch hands it
    the cap in whole MiB (``bucket_bytes_cap // 2**20``: 25 by default, 0 below 1 MiB)."""
    import torch._inductor.config as inductor_config

    inductor_config._fuse_ddp_communication = True
    inductor_config._fuse_ddp_bucket_size = bucket_bytes_cap // MIB


def _python_reducer_hook(model: DataParallelModel, param: torch.Tensor) -> None:
    """torch DDP's ``compiled_accum_grad_hook``: average ``param.grad`` across the group."""
    import torch.distributed._functional_collectives as fcol

    if not model.require_backward_grad_sync or param.grad is None:  # no_sync(): stays local
        return
    hook, state = model.reducer.comm_hook, model.reducer.comm_hook_state
    if hook is not None:  # torch calls a registered hook per parameter, with (grad, param)
        hook(state, (param.grad, param))
        return
    gradient = param.grad / model.process_group.size()
    gradient = fcol.all_reduce(gradient, "sum", model.process_group)
    param.grad.copy_(gradient)


def register_python_reducer_hooks(model: DataParallelModel, params: list[nn.Parameter]
                                  ) -> list[RemovableHandle]:
    """One post-accumulate-grad hook per parameter that requires a gradient, as torch DDP."""
    return [p.register_post_accumulate_grad_hook(functools.partial(_python_reducer_hook, model))
            for p in params if p.requires_grad]


# ==== pickling: torch DDP's rule ==============================================================
NOT_DEFAULT_GROUP = ("DDP Pickling/Unpickling are only supported when using DDP with the "
                     "default process group. That is, when you have called init_process_group "
                     "and have not passed process_group argument to DDP constructor")

# Live objects a copy cannot share or carry (groups, hooks, files, threads, a store); rebuilt
# (or left off) by unpickling.
_NOT_PICKLED = ("process_group", "reducer", "transport", "stall_monitor", "sync_checks")


def check_default_group(process_group: dist.ProcessGroup | None) -> None:
    """Refuse to pickle a model on a group other than the default one (torch DDP's rule).

    Without any default group, torch's own ``ValueError`` ("Default process group has not
    been initialized ...") propagates, as it does from DDP.
    """
    if process_group is not _get_default_group():
        raise RuntimeError(f"{NOT_DEFAULT_GROUP} (mini_ddp: this model reduces over a group "
                           f"of {dist.get_world_size(process_group)} ranks made with new_group "
                           "or a device_mesh)")

"""``DataParallelModel``: the drop-in replacement for ``torch.nn.parallel.DistributedDataParallel``.

This module owns what happens *around* the module's forward: argument checks, the start-up
sync, the per-forward bookkeeping (bucket rebuild, buffer broadcast, arming the reducer for
backward), ``no_sync()`` and the comm-hook registration. How gradients are bucketed and
reduced is the reducer's business (:mod:`mini_ddp.engine.reducer`).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils import _pytree as pytree

from mini_ddp.engine import construction, pickling
from mini_ddp.engine import join as joining
from mini_ddp.engine.comm import dist_broadcast_coalesced, verify_params_across_ranks
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.delayed import DelayedAllReduce, check_something_left, ignored_names
from mini_ddp.engine.hooks import (
    CommHook,
    builtin_comm_hook,
    check_comm_hook,
    hook_name,
    prepare_comm_hook,
)
from mini_ddp.engine.logging_data import RuntimeLog, logging_data
from mini_ddp.engine.mixed_precision import allreduce_and_upcast_hook, cast_inputs
from mini_ddp.engine.mixed_precision import setup as mixed_precision_setup
from mini_ddp.engine.reducer import Reducer
from mini_ddp.engine.sparse import expect_sparse_gradients
from mini_ddp.engine.stall import StallMonitor
from mini_ddp.errors import naming_collective
from mini_ddp.transport.shm import SharedMemoryAllreduce

logger = logging.getLogger("mini_ddp")

# torch's C++ reducer words it in the order of the call that comes second.
TWO_HOOKS = "register_comm_hook or register_builtin_comm_hook can only be called once."
TWO_HOOKS_BUILTIN = "register_builtin_comm_hook or register_comm_hook can only be called once."
STATIC_AND_FIND_UNUSED = (
    "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
    "will detect unused parameters automatically, so you do not need to set "
    "find_unused_parameters=true, just be sure these unused parameters will not change during "
    "training loop while calling `_set_static_graph`.")
STATIC_GRAPH_LATE = ("set_static_graph() should be called before training loop starts and "
                     "after DistributedDataParallel is constructed.")


class DataParallelModel(nn.Module, Joinable):
    """Synchronise gradients of ``module`` across processes, exactly like torch DDP.

    Same constructor arguments, same semantics and — on the default path — the same bits as
    ``torch.nn.parallel.DistributedDataParallel``; ``state_dict()`` keys carry the same
    ``module.`` prefix, so checkpoints interchange in both directions. Arguments DDP has and
    we do not implement raise ``NotImplementedError`` naming the argument.

    mini_ddp additions (keyword-only): ``sync_timeout_s`` — the bound on waiting for one
    bucket's collective at the end of backward, and for the buffer broadcast before forward
    (default: the process group's timeout; see :class:`DataParallelConfig` and
    docs/reliability.md); ``stall_warning_s`` — after this long (60 s) waiting for a bucket,
    log a warning naming the ranks that have not reached it (None: off); ``zero_copy_write_back`` —
    ``.grad`` becomes a view of its bucket after the all-reduce instead of a copy of it (same
    bits, one gradient-sized copy less per step; docs/performance.md);
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
                 zero_copy_write_back: bool = True,
                 shared_memory_allreduce: bool = True, shared_memory_min_bytes: int = 1 << 20):
        super().__init__()
        Joinable.__init__(self)  # uneven inputs: see join() and mini_ddp.engine.join
        self.divide_by_initial_world_size = True  # join(divide_by_initial_world_size=...)
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
        self.process_group = construction.resolve_process_group(process_group, device_mesh)
        if static_graph and find_unused_parameters:  # DDP warns the same at construction
            warnings.warn(STATIC_AND_FIND_UNUSED, stacklevel=2)
        if check_reduction:
            warnings.warn("The `check_reduction` argument is deprecated (as in torch DDP) and "
                          "has no effect.", FutureWarning, stacklevel=2)
        if dim != 0:
            raise NotImplementedError("mini_ddp: only dim=0 is supported (one device per "
                                      "process; inputs are not scattered)")

        self.module = module
        self.dim = dim
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
        self.mixed_precision = mixed_precision
        if mixed_precision is not None:  # torch's sequence: see mini_ddp.engine.mixed_precision
            logger.warning("Received mixed precision config %s", mixed_precision)
            if gradient_as_bucket_view:  # DDP's hook swaps .grad's data out of the bucket
                raise NotImplementedError("mini_ddp: mixed_precision with "
                                          "gradient_as_bucket_view=True is not supported")
            self.reducer.zero_copy = False  # .grad must stay the full-precision tensor
            self.register_comm_hook(mixed_precision_setup(
                module, [p for _, p in named], mixed_precision, self.process_group,
                self.reducer.on_grad_accumulated), allreduce_and_upcast_hook)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True

    def _attach_reducer(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """A fresh reducer (and what watches it) over ``named``: at construction, after
        unpickling, and when ``_set_static_graph`` changes how it must work."""
        self.reducer = Reducer([p for _, p in named], [n for n, _ in named],
                               self.process_group, self.config, self.transport)
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
        super().__setstate__(state)
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

    # ---- forward -------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; around it, do DDP's per-forward bookkeeping."""
        if self.reducer is None:  # every parameter delayed: none of DDP's bookkeeping
            return self.delayed.forward(self.module, inputs, kwargs)
        trace = self.reducer.trace
        if trace is not None:
            trace.record("forward_start")
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.require_backward_grad_sync:
            self._runtime_log.forward_started(self.reducer.num_iterations)
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
                torch.Tensor, lambda t: t.to(device, non_blocking=True), (inputs, kwargs))
        inputs, kwargs = cast_inputs(self.mixed_precision, inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            search = self.find_unused_parameters and not self.static_graph
            self.reducer.prepare_for_backward(_find_tensors(output) if search else [])
        else:
            self.require_forward_param_sync = False
            if torch.is_grad_enabled():  # no_sync(): this forward's backward is local by design
                self.reducer.local_backward_follows()
        if (self.find_unused_parameters and not self.static_graph) or (
                self.static_graph and not self._delay_all_reduce_enqueued):
            output = self._through_sink(output)
        if self.delayed is not None:
            self.delayed.point_grads_at_buffer()
        self._runtime_log.forward_finished()
        if trace is not None:
            trace.record("forward_end")
        return output

    def _through_sink(self, output: Any) -> Any:
        """Route every output tensor through :class:`_OutputSink` (see there for why)."""
        leaves, spec = pytree.tree_flatten(output)
        passed = _OutputSink.apply(weakref.ref(self), *leaves)
        # Tensors that are not part of a graph stay as they were (DDP does the same).
        merged = [leaf if isinstance(leaf, torch.Tensor) and leaf.grad_fn is None else new
                  for leaf, new in zip(leaves, passed, strict=True)]
        return pytree.tree_unflatten(merged, spec)

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
            # Bounded like the gradient waits: a hung peer must not stall forward forever.
            dist_broadcast_coalesced(buffers, src=dist.get_global_rank(self.process_group, src),
                                     group=self.process_group,
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

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's own all-reduces."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """Process group of the join protocol's own all-reduces."""
        return self.process_group

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``.

        Same contract as torch DDP, so torch's own hooks (``default_hooks.allreduce_hook``,
        ``fp16_compress_hook``, PowerSGD, …) run unchanged. The hook must average the
        gradients itself: with a hook, gradients are copied into buckets unscaled.

        On Gloo, torch's PowerSGD and quantization hooks are wrapped in
        :func:`mini_ddp.engine.hooks.gloo_safe` (each bucket finishes before the next starts): as
        they are, they deadlock there, in torch DDP too. See docs/comm_hooks.md.
        """
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as err:
            self._runtime_log.record_error(err)
            raise
        self._install_comm_hook(state, hook, hook_name(hook), TWO_HOOKS)

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch DDP's C++ built-in hooks (``dist.BuiltinCommHookType.ALLREDUCE``,
        ``FP16_COMPRESS``), run as the equivalent Python hooks of torch's ``default_hooks``
        (same operations, same bits; see :func:`mini_ddp.engine.hooks.builtin_comm_hook`)."""
        self._install_comm_hook(self.process_group, builtin_comm_hook(comm_hook_type),
                                str(comm_hook_type), TWO_HOOKS_BUILTIN)

    def _install_comm_hook(self, state: object, hook: CommHook, name: str, twice: str
                           ) -> None:
        if self._comm_hook_registered:
            err = RuntimeError(f"{twice} (mini_ddp: {name} cannot replace "
                               f"{self._comm_hook_name}, registered before)")
            self._runtime_log.record_error(err)
            raise err
        self._comm_hook_registered = True
        self._comm_hook_name = name
        self.reducer.comm_hook = prepare_comm_hook(hook, state, self.process_group, self.device,
                                                   self.config.sync_timeout_s)
        self.reducer.comm_hook_state = state

    # ---- torch DDP's semi-private API (used by real code and torch's own tests) -----------
    def _set_static_graph(self) -> None:
        """Switch to ``static_graph=True`` after construction, before the first forward."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.num_iterations != 0:
            err = RuntimeError(f"{STATIC_GRAPH_LATE} (mini_ddp: {self.reducer.num_iterations} "
                               "iterations have run)")
            self._runtime_log.record_error(err)
            raise err
        self.static_graph = self.config.static_graph = True
        # Nothing has run yet: a fresh reducer takes the static-graph rules from the start
        # (first-iteration layout, no zero-copy write-back), keeping a registered hook.
        hook, state, name = self.reducer.comm_hook, self.reducer.comm_hook_state, \
            self._comm_hook_name
        self._attach_reducer(list(zip(self.reducer.names, self.reducer.params, strict=True)))
        if hook is not None:
            self.reducer.comm_hook, self.reducer.comm_hook_state = hook, state
            self._comm_hook_registered, self._comm_hook_name = True, name
        if self.find_unused_parameters:
            warnings.warn(STATIC_AND_FIND_UNUSED, stacklevel=2)

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch DDP's debugging dict (same keys, meanings and types where we know them; see
        :mod:`mini_ddp.engine.logging_data`)."""
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
        """Exclude parameters/buffers by name from syncing (DDP's static method of this name)."""
        module._ddp_params_and_buffers_to_ignore = names


class _OutputSink(torch.autograd.Function):
    """Identity on the forward outputs whose backward runs before any parameter gradient.

    With ``find_unused_parameters`` it keeps undefined gradients undefined
    (``set_materialize_grads(False)``): an output left out of the loss then sends *no*
    gradient into its subgraph, whose parameters' hooks still fire — marked ready with zeros
    and kept as globally unused, as in DDP. With ``static_graph`` its backward queues the
    iteration-1 reduction, which must run after all hooks.
    """

    @staticmethod
    def forward(ctx: Any, model_ref: weakref.ref, *outputs: Any) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.model_ref = model_ref
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        model = ctx.model_ref()
        if model is not None and model.static_graph and not model._delay_all_reduce_enqueued:
            Variable._execution_engine.queue_callback(model.reducer.delay_all_reduce)
            model._delay_all_reduce_enqueued = True
        return (None, *grads)


def _find_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in an output: tensors, lists/tuples (namedtuples), dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _find_tensors(item)]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []

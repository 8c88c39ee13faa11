"""The reducer: from one parameter's gradient hook to the all-reduce and back into ``.grad``.

Follow one gradient through a step. After the per-step calls the model makes, the methods
below come in this order, named as torch's C++ reducer (``reducer.cpp``) names them, so a
reader may hold that file beside this one (docs/architecture.md has the glossary):

1. :meth:`Reducer.autograd_hook` — a post-hook on the parameter's ``AccumulateGrad`` node
   fires once autograd has written ``param.grad``. It calls
   :meth:`~Reducer.mark_variable_ready`.
2. :meth:`~Reducer.mark_variable_ready` copies the gradient into its bucket view
   (:meth:`~Reducer.copy_grad_in`) and counts the bucket down. A full bucket is *multiplied*
   by ``1/world_size`` at once (:meth:`~Reducer.scale_bucket`: DDP multiplies each gradient
   while copying it in — the same kernel and scalar per element, so the same bits) and is
   launched as soon as every earlier bucket has been (:meth:`~Reducer.mark_bucket_ready`):
   always in bucket order, so every rank issues the same collectives in the same order.
3. :meth:`~Reducer.all_reduce_bucket` launches it through the comm-hook door
   (:func:`mini_ddp.engine.hooks.launch_hook`, which runs a registered hook or the default
   all-reduce) — or, for CPU ranks on one machine, through shared memory
   (:mod:`mini_ddp.transport.shm`, same bits); the future is kept.
4. When the last bucket has launched, :meth:`~Reducer.finalize_backward` is queued on the
   autograd engine. It runs when backward ends and waits for every bucket in
   :meth:`~Reducer.wait` (the only place that blocks, with a deadline),
5. and writes the results back into ``param.grad`` (:mod:`mini_ddp.engine.writeback`): by
   default a copy of the bucket's view, as DDP; with ``zero_copy_write_back=True`` ``.grad``
   becomes the view, reclaimed before the next backward writes into the bucket (at step 1).

The bookkeeping mirrors reducer.cpp wherever it changes a value or an error. The reducer owns
it in three named objects: the per-step counters in :class:`StepState` (named after
reducer.cpp's members), the buckets and their one-time rebuild in
:class:`~mini_ddp.engine.buckets.BucketLayout` (``reducer.layout``), the unused-parameter search
in :class:`~mini_ddp.engine.unused.UnusedSearch`. A static graph's first iteration reduces
everything after backward (:meth:`~Reducer.delay_all_reduce`); join's stand-in backward is in
:mod:`mini_ddp.engine.join`. DDP's variants of steps 2 and 3 sit in the step they vary:
``batched_grad_copy`` (:meth:`~Reducer.copy_grad_in` only notes a gradient and
:meth:`~Reducer.flush_batched` copies a full bucket at once), a sparse gradient that *is* its
own bucket, and ``skip_all_reduce_unused_params`` leaving out buckets of unused parameters only
(:meth:`~Reducer.mark_bucket_ready`).
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine import writeback
from mini_ddp.engine.buckets import BucketLayout, assign_grad, check_sparse_grad, shares_storage
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.hook_groups import (
    AGAIN,
    ONCE,
    Group,
    HookGroups,
    hooks_after,
    node_hook_after,
    passive_hook,
    user_grad_hook,
)
from mini_ddp.engine.hooks import CommHook, GradBucket, launch_hook, result_tensor
from mini_ddp.engine.observer import Observers
from mini_ddp.engine.torch_api import (
    BACKWARD_COMPUTE_START,
    TorchReducerAPI,
    outputs_list,
)
from mini_ddp.engine.unused import UnusedSearch
from mini_ddp.errors import (
    CollectiveError,
    GradChangedLateError,
    GradSyncTimeout,
    MarkedTwiceError,
    MiniDDPError,
    UnfinishedReductionError,
    collective_error,
    describe_bucket,
)
from mini_ddp.transport.shm import SharedMemoryAllreduce, ShmError
from mini_ddp.transport.wait import wait_done

logger = logging.getLogger("mini_ddp")

OnStall = Callable[[Any, "bucketing.Bucket | None", "BaseException | None"], "str | None"]
OnTimeout = Callable[[Any, "bucketing.Bucket | None"], "tuple[str, dict[str, Any]]"]
NOT_ASKED = ("  The late ranks were not asked where they are: no stall monitor runs "
             "(stall_warning_s=None), so no rank has a stack responder.")


class UnarmedBackwardError(MiniDDPError):
    """A backward ran inside a synchronised forward that nobody armed for it."""

    def __init__(self, rank: int, name: str, index: int):
        self.rank, self.name, self.index = rank, name, index
        super().__init__(
            f"mini_ddp: parameter '{name}' (index {index}) received a gradient on rank {rank} "
            "while DataParallelModel's forward was still running, and nothing armed the "
            "reducer for that backward: its gradients would stay local and the ranks would "
            "drift apart. Call model.reducer.prepare_for_backward(outputs) before such a "
            "backward (as torch DDP requires and PyTorch Lightning does through "
            "isinstance(model, DistributedDataParallel)), run backward after the forward "
            "returns, or run the forward inside model.no_sync() to accumulate locally.")


UNDEFINED_BUT_USED = ("Encountered gradient which is undefined, but still allreduced by DDP "
                      "reducer. This indicates a bug in DDP implementation, please report a bug "
                      "with a repro to PyTorch.")


class UndefinedButUsedError(MiniDDPError):
    """A parameter without a gradient is marked ready while the used map counts it as used."""

    def __init__(self, rank: int, name: str, index: int):
        self.rank, self.name, self.index = rank, name, index
        # torch's reducer checks the same in mark_variable_ready_dense (a RuntimeError with
        # this sentence): summing zeros for it would overwrite its .grad on every rank.
        super().__init__(
            f"{UNDEFINED_BUT_USED} (mini_ddp: parameter '{name}' (index {index}) has no "
            f"gradient in this synchronised backward on rank {rank}, but the used map still "
            "counts it as used: a backward that synchronised nothing since the last "
            "synchronised one (inside no_sync(), or after a forward that raised) used it, and "
            "its .grad was set to None before this step. Run a synchronised backward before "
            "zeroing gradients with set_to_none=True, or zero them with set_to_none=False.)")


_SUM = dist.AllreduceOptions()  # reduceOp SUM, the backend's default timeout


@dataclass
class StepState:
    """The per-step state of a reducer over ``num_params`` parameters."""

    num_params: int
    num_iterations: int = 0          # synced forwards so far
    num_backward_calls: int = 0      # backward passes that reached a hook (DDP's num_bwd_calls_)
    backward_counted: bool = False   # this backward is counted (reset when it finishes)
    # Settled by the first hook of a backward (:meth:`begin_backward`): what every hook
    # of that backward asks, read instead of re-derived per parameter.
    static_first: bool = False       # a static graph's first backward: hooks only count
    tracks_used: bool = False        # hooks fill the used map
    records_order: bool = False      # hooks record the gradient-ready order for the rebuild
    expect_hooks: bool = False       # a synced backward is expected
    # Settled once the first hook of a synced backward has done the once-per-backward work:
    # no used map, no static graph, no order to record — every other hook of this backward
    # only marks its gradient ready (Reducer.autograd_hook's first branch).
    plain: bool = False
    forward_running: bool = False    # a synced forward has not returned yet
    synced_this_step: bool = False   # a synced backward finished; no forward since
    require_finalize: bool = False   # some gradient was marked ready and not yet finished
    marked_unused: bool = False      # this backward's unused parameters were marked ready
    next_bucket: int = 0             # the next bucket to launch (launches are in order)
    ready: set[int] = field(default_factory=set)  # parameters marked ready this iteration
    ready_order: list[int] = field(default_factory=list)  # hooks' order, for the logging data
    static_hook_counts: list[int] = field(default_factory=list)  # hooks per param, iteration 1
    static_hooks_left: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.static_hook_counts = [0] * self.num_params
        self.static_hooks_left = [0] * self.num_params

    def begin_backward(self, static_graph: bool, dynamic_unused: bool) -> None:
        """First hook of a backward: count it, and settle what its other hooks will ask."""
        self.backward_counted = True
        if static_graph and not self.expect_hooks and self.num_backward_calls == 0:
            # A local backward (no_sync()) before a static graph's first synchronised one is
            # not its "iteration 1": its gradients stay local, and the first synchronised
            # backward then counts the hooks and reduces everything accumulated (torch DDP
            # fails an internal assert here).
            self.static_first = self.tracks_used = False
            return
        self.num_backward_calls += 1
        # Counted in backward passes, as DDP does since 2.1: two forwards may precede one
        # backward, and that backward is still "iteration 1".
        self.static_first = static_graph and self.num_backward_calls == 1
        self.tracks_used = dynamic_unused or self.static_first

    def last_static_hook(self, index: int, name: str, rank: int) -> bool:
        """Static graph: count a hook of parameter ``index``; True when it is its last one.

        Hooks may fire several times per parameter (e.g. activation checkpointing): the
        gradient is final at the count iteration 1 saw. More hooks than that, or a parameter
        iteration 1 never saw, mean the graph changed.
        """
        if self.static_hooks_left[index] == 0:
            raise MiniDDPError(
                f"mini_ddp: parameter '{name}' received a gradient on rank {rank} it did not "
                "receive in iteration 1, or more often: the training graph changed, which "
                "static_graph=True does not allow.")
        self.static_hooks_left[index] -= 1
        return self.static_hooks_left[index] == 0

    def expect_autograd_hooks(self, static_graph: bool) -> None:
        """Before a synced backward (``prepare_for_backward``): expect hooks, nothing ready,
        nothing launched."""
        self.expect_hooks = True
        self.backward_counted = False  # the armed backward is a new one, even after no_sync
        self.plain = False  # settled again by the first hook
        self.synced_this_step = False
        self.next_bucket = 0
        if static_graph:
            self.static_hooks_left = list(self.static_hook_counts)
        self.marked_unused = False
        self.ready.clear()
        self.ready_order.clear()  # torch clears its grad_ready_order_indices_ here too

    def unarmed(self, rank: int, name: str, index: int) -> UnarmedBackwardError | None:
        """A hook fired while no synced backward is expected: the error to raise, if any.

        torch DDP ignores such a gradient, which is right for ``no_sync()`` and for a backward
        through the bare module, but not for a backward that runs *inside* a synced forward
        (a framework's manual backward in ``training_step``) that nobody armed with
        ``reducer.prepare_for_backward``: its gradients would stay local, the ranks drift apart.
        """
        if self.forward_running:
            return UnarmedBackwardError(rank, name, index)
        return None

    def missing(self) -> list[int]:
        """Parameters not marked ready in this iteration."""
        return [i for i in range(self.num_params) if i not in self.ready]


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")


def _grad_accumulator(param: torch.Tensor) -> Any:
    """The ``AccumulateGrad`` node autograd uses for ``param`` now (held by the reducer)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def scale_tensor(div_factor: int) -> torch.Tensor:
    """``1/div_factor`` as the 0-dim float64 CPU tensor DDP hands ``mul_out``.

    A wrapped double scalar: made once per divisor instead of per gradient (a Python float
    makes ``torch.mul`` build that tensor on every call). Same kernel, same bits.
    """
    return torch.tensor(1.0 / div_factor, dtype=torch.float64)


class Reducer(TorchReducerAPI):
    """Hooks and the hook -> bucket -> launch -> wait -> write-back path of one model.

    Answers torch's reducer methods by name too (:mod:`mini_ddp.engine.torch_api`).
    Observers read its state where it lives: ``layout`` (buckets, locator, rebuild history),
    ``step`` (:class:`StepState`) and ``unused_search``. ``layout`` as an argument: iteration
    1's buckets when the caller made them already (:meth:`BucketLayout.initial_layout`).
    """


    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 group: dist.ProcessGroup | None, config: DataParallelConfig,
                 transport: SharedMemoryAllreduce | None = None,
                 modules: Sequence[tuple[str, torch.nn.Module]] = (),
                 layout: list[list[int]] | None = None):
        self.params = list(params)
        self.names = list(names)
        self.modules = list(modules)  # (name, module): where user backward hooks are looked for
        self.group = group
        self._group = group if group is not None else dist.group.WORLD  # for allreduce
        # Where a wait has a second layer (wait_done's device probe): results on a GPU.
        self._results_on_gpu = any(p.device.type != "cpu" for p in self.params)
        self.config = config
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.div_factor = self.world_size  # what gradients are averaged over (join may change it)
        self.scales_whole_buckets = False  # set with comm_hook, just below
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        # What watches this reducer (mini_ddp.engine.observer): one call per event.
        self.observers = Observers()
        self._flight: Any = None
        # The stall seam: on_stall(reducer, bucket, error) is called once a wait passes
        # stall_after_s (error None) and when a collective fails. The model installs the default
        # warning there (mini_ddp.watch.stall); mini_ddp.watch.stall replaces it.
        self.on_stall: OnStall | None = None
        self.stall_after_s: float | None = None
        # The timeout seam: on_timeout(reducer, bucket) -> (lines for the GradSyncTimeout
        # message, extra fields of the flight recorder dump), called once a wait passes
        # sync_timeout_s. The stall monitor installs it: it asks the late ranks where they are.
        self.on_timeout: OnTimeout | None = None
        # The broadcast seam: on_slow_broadcast(reducer, step) is called once the buffer
        # broadcast before a forward (on the CPU) has waited stall_after_s; it may raise.
        self.on_slow_broadcast: Callable[[Reducer, int], None] | None = None
        # CPU ranks on one host: float buckets live in shared memory and are summed there.
        self.transport = transport
        self.use_transport = transport is not None  # off while Join runs (model.forward)
        # Zero-copy write-back: after the all-reduce, .grad becomes the bucket's view instead of
        # a copy of it (writeback.hand_out). Only on the plain path; the unused-parameter paths
        # and gradient_as_bucket_view keep their own rules, which are DDP's.
        self.zero_copy = (config.zero_copy_write_back and not config.gradient_as_bucket_view
                          and not config.find_unused_parameters and not config.static_graph)
        self.layout = BucketLayout(self.params, self.names, config, group, self.rank, transport,
                                   layout)
        self.step = StepState(len(self.params))
        self.unused_search = UnusedSearch(len(self.params), self.params[0].device, config,
                                          group, self.rank)
        self._lock = threading.Lock()
        # Hooks go on the AccumulateGrad nodes, not on the tensors: such a post-hook fires even
        # when the incoming gradient is undefined (an output unused in the loss), which is how
        # DDP tells "used but got no gradient" apart from "never reached".
        # The reducer holds the nodes, as torch's reducer holds its grad_accumulators_: a
        # parameter refers to its AccumulateGrad node only weakly, so a node nobody else holds
        # is freed between iterations, and a fresh one, without our hook, is made next time.
        self._accumulators = [_grad_accumulator(p) for p in self.params]
        # One hook per gradient, until the order is known and the path is plain: then one per
        # group of gradients (mini_ddp.engine.hook_groups; config.grouped_hooks).
        self.hook_groups = HookGroups(len(self.params)) if config.grouped_hooks else None
        # This backward reads its gradients after their hooks (once per bucket or group)
        # rather than in them, as torch's reducer does: decided before every synchronised
        # backward by hook_groups (HookGroups.reads_late), False without it.
        self.reads_late = False
        self._hooks_removed = False
        self._hook_handles: list[Any] = []
        self._node_tables: list[tuple[dict[int, Any], int]] = []  # filled just below
        self._register_param_hooks()
        # Each node's table of Python post-hooks (torch keeps one per node; our handle points
        # at it) and our first hook's id there: a user hook registered on a node after
        # wrapping runs after ours, and is found there (hook_groups.node_hook_after).
        self._node_tables = [(handle.hooks_dict_ref(), handle.id)
                             for handle in self._hook_handles]
        self._hooks_before_wrap = sum(len(table) for table, _ in self._node_tables) \
            - len(self._hook_handles)

    def _register_param_hooks(self) -> None:
        """One hook per parameter's ``AccumulateGrad`` node."""
        self._set_hooks(_hook_trampoline, [(index, index) for index in range(len(self.params))])

    def _register_group_hooks(self, groups: list[Group]) -> None:
        """One hook per group, on the node of its last gradient in ready order."""
        self._set_hooks(_group_hook_trampoline,
                        [(group.last, number) for number, group in enumerate(groups)])

    def _set_hooks(self, trampoline: Callable[..., None], targets: list[tuple[int, int]]) -> None:
        """Replace our hooks: for each ``(param index, argument)``, one on that parameter's
        node calling ``trampoline(reducer_ref, argument, ...)``."""
        for handle in self._hook_handles:
            handle.remove()
        me = weakref.ref(self)  # the hooks hold the reducer weakly: no cycle through C++
        self._hook_handles = [
            self._accumulators[index].register_hook(functools.partial(trampoline, me, argument))
            for index, argument in targets]
        if not self._node_tables:
            return  # the constructor's hooks: nobody else's can come after them yet
        # A hook the user put on a node after wrapping runs after torch DDP's, registered at
        # wrapping: it must run after ours too, so it is re-added behind the one just made
        # (autograd calls a node's post-hooks in its table's insertion order).
        mine = {handle.id for handle in self._hook_handles}
        for index, _ in targets:
            table, first = self._node_tables[index]
            for key in hooks_after(table, first, mine):
                table[key] = table.pop(key)

    @property
    def div_factor(self) -> int:
        """What gradients are averaged over: the world size, unless ``join`` changes it."""
        return self._div_factor

    @div_factor.setter
    def div_factor(self, value: int) -> None:
        # Set before every forward (join may change it): the scalar tensor is made only anew.
        if getattr(self, "_div_factor", None) != value:
            self._div_factor = value
            self._scale = scale_tensor(value)

    @property
    def comm_hook(self) -> CommHook | None:
        """The registered comm hook (as prepared), or None: the default all-reduce.

        (The per-step path reads ``_comm_hook``, saving a call per read.)
        """
        return self._comm_hook

    @comm_hook.setter
    def comm_hook(self, hook: CommHook | None) -> None:
        self._comm_hook = hook
        # Settled here, not per gradient: whether gradients are copied in unscaled and each
        # full bucket is multiplied once (copy_grad_in, scale_bucket) — the default path.
        self.scales_whole_buckets = (hook is None and not self.config.batched_grad_copy
                                     and not self.config.gradient_as_bucket_view)

    def _through_transport(self, bucket: bucketing.Bucket) -> bool:
        """Is this step's all-reduce of ``bucket`` the shared-memory one (not Gloo's)?"""
        # A bucket below shared_memory_min_bytes is never allocated there: no need to ask.
        return (self.use_transport and not bucket.sparse
                and bucket.nbytes >= self.config.shared_memory_min_bytes
                and self.transport.owns(bucket.buffer))

    @property
    def flight(self) -> Any:
        """The flight log recording this reducer's collectives (None: none); set, it
        observes the bucket launches and completions too (:mod:`mini_ddp.engine.observer`)."""
        return self._flight

    @flight.setter
    def flight(self, log: Any) -> None:
        if self._flight is not None:
            self.observers.remove(self._flight)
        self._flight = log
        if log is not None:
            self.observers.add(log)

    # ---- per-step calls from the model --------------------------------------------------
    def prepare_for_forward(self) -> None:
        """Count a synced forward (static graphs behave differently in iteration 1)."""
        self.step.num_iterations += 1

    def local_backward_follows(self) -> None:
        """This forward's backward is local by design (``no_sync()``): no sync expected."""
        self.step.synced_this_step = False

    def ensure_prior_reduction_finished(self) -> None:
        """Raise, naming the parameters, if the last backward left gradients unreduced."""
        step, groups = self.step, self.hook_groups
        if groups is not None and groups.groups is not None and step.expect_hooks:
            # Grouped hooks: a gradient whose group's hook never fired was still computed.
            # Count it as its own hook would have (torch DDP's reducer sees every one).
            fresh = [i for i in groups.fresh_indices(self.params) if i not in step.ready]
            if fresh:
                step.ready.update(fresh)
                step.require_finalize = True
        if not step.require_finalize:
            return
        missing = step.missing()
        raise UnfinishedReductionError(
            self.rank, [self.names[i] for i in missing], missing,
            static_graph=self.config.static_graph,
            find_unused_parameters=self.config.find_unused_parameters,
            frozen=[self.names[i] for i in missing if not self.params[i].requires_grad],
            unfinished=self.unfinished_buckets())

    def unfinished_buckets(self) -> list[str]:
        """The buckets of the current backward whose reduction has not finished, in words
        (for an error after an interrupted backward: never launched, or launched unwaited)."""
        words = []
        for bucket in self.layout.buckets:
            if bucket.index >= self.step.next_bucket:
                words.append(f"{self.describe(bucket)} was never launched")
            elif bucket.future is not None:
                words.append(f"{self.describe(bucket)} was launched but never waited for")
        return words

    def rebuild_buckets_if_needed(self) -> bool:
        """Before a forward: check the last backward finished; rebuild buckets once."""
        self.ensure_prior_reduction_finished()
        # Gradients the zero-copy write-back left in the old buffers move along (unless someone
        # else holds them), so later steps keep writing in place instead of copying.
        rebuilt = self.layout.rebuild_if_needed(writeback.handed_out_grads, self.flight,
                                                self.step.num_iterations)
        if rebuilt:
            self.observers.order_decided(self, "rebuild")
        return rebuilt

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Arm the hooks for the backward of this forward's ``outputs`` (a tensor or a list
        of them, as torch's reducer takes; the model calls it after forward, frameworks call
        it for a backward that runs inside the forward)."""
        outputs = outputs_list(outputs)
        if self.runtime_log is not None:
            self.runtime_log.mark(BACKWARD_COMPUTE_START)
        self.step.expect_autograd_hooks(self.config.static_graph)
        # The rebuild happens before forward, so this holds for the whole backward.
        self.step.records_order = self.layout.should_rebuild()
        self.layout.reset_bucket_counting()
        if self.unused_search.dynamic:
            self.unused_search.search(self._accumulators, outputs)
        groups = self.hook_groups
        self.reads_late = False
        if groups is not None and not self._hooks_removed:
            if self.scales_whole_buckets:  # the default path: the only one that reads late
                self.reads_late = groups.reads_late(
                    user_grad_hook(self.params, self.names, self.modules)
                    or node_hook_after(self._node_tables, self.names, self._hook_handles,
                                       self._hooks_before_wrap))
            self._choose_hooks(outputs)

    def remove_autograd_hooks(self) -> None:
        """Remove every gradient hook (DDP's ``_remove_autograd_hooks``): later backwards
        leave ``.grad`` local."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._hooks_removed = True
        if self.hook_groups is not None:
            self.hook_groups.disarm(fell_back=False)

    def forward_running(self, synced: bool) -> None:
        """The model's forward starts (``synced``: it will synchronise) or has returned."""
        self.step.forward_running = synced

    # ---- 1. hook -------------------------------------------------------------------------
    def autograd_hook(self, index: int) -> None:
        """The hook of parameter ``index``: autograd has written its ``.grad``."""
        step = self.step
        with self._lock:
            if step.plain:  # the steady state: the first hook of this backward decided it all
                if self.observers.per_gradient:
                    self.observers.gradient_ready(self, index)
                step.ready_order.append(index)  # the logging data's ready order, as torch's
                self.mark_variable_ready(index)
                return
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
            if self.observers.per_gradient:
                self.observers.gradient_ready(self, index)
            step.ready_order.append(index)  # the logging data's ready order, as torch's
            if not step.marked_unused:
                step.marked_unused = True
                self.observers.backward_begun(self)
                if self.zero_copy:
                    # Before anything is written into a bucket a .grad may still be.
                    writeback.reclaim_buffers(self.layout.buckets, self.transport)
                for unused_index in self.unused_search.unused:
                    self.mark_variable_ready(unused_index)
                step.plain = not (step.tracks_used or step.records_order
                                  or self.config.static_graph)
            if self.config.static_graph and not step.last_static_hook(index, self.names[index],
                                                                      self.rank):
                return  # hooks fire several times (e.g. checkpointing): wait for the last
            if step.records_order:
                self.layout.record_ready(index)
            self.mark_variable_ready(index)


    # ---- 1b. grouped hooks (mini_ddp.engine.hook_groups) ----------------------------------
    def _plain_path(self) -> bool:
        """Is this backward's path the plain one that grouped hooks may serve (once its
        gradients may be read late)?"""
        config = self.config
        return (self.scales_whole_buckets and not config.find_unused_parameters
                and not config.static_graph and not config.debug
                and not self.observers.per_gradient
                and not self.step.records_order
                # Another wrapper of the same parameters writes their .grad back too.
                and not self.layout.shared_with_another
                and not any(bucket.sparse for bucket in self.layout.buckets))

    def _choose_hooks(self, outputs: list[torch.Tensor]) -> None:
        """Before a synced backward: group the hooks once the order is known and gradients
        may be read late, back to one per gradient when that stops (tracing switched on, a
        comm hook, a user hook on a gradient). On the plain path, a hook on the outputs marks
        when backward begins (:meth:`backward_begins`)."""
        groups = self.hook_groups
        groups.expect_backward()
        plain = self._plain_path()
        began = plain and self._hook_backward_start(outputs)
        groupable = began and self.reads_late and groups.groupable(self.params)
        if groups.groups is not None:
            if not groupable:
                groups.disarm(fell_back=False)
                self._register_param_hooks()
                self.observers.order_decided(self, "fallback")
        elif groupable and groups.should_arm():
            self._register_group_hooks(groups.arm(self.layout.buckets))
            self.observers.order_decided(self, "grouped")
            logger.debug("mini_ddp rank %d: gradient order stable, %d hooks for %d gradients",
                         self.rank, len(groups.groups), len(self.params))

    def _hook_backward_start(self, outputs: list[torch.Tensor]) -> bool:
        """Hook each output that backward will start from; False if there is none (no
        outputs were given: a framework's own ``prepare_for_backward([])``)."""
        me = weakref.ref(self)
        hooked = False
        for output in outputs:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(passive_hook(functools.partial(_begin_trampoline, me)))
                hooked = True
        return hooked

    def backward_begins(self) -> None:
        """The first output's gradient is computed, before any parameter's that flows through
        an output: record every ``.grad`` (HookGroups.begin). (One that arrived earlier, used
        outside the outputs, looks not yet arrived to its group: a fallback, the safe way.)"""
        if self.step.expect_hooks and self.hook_groups is not None:
            self.hook_groups.begin(self.params)

    def group_ready(self, number: int) -> None:
        """The hook of group ``number``: the last gradient of the group (in the order seen) has
        arrived. Copy the group into its bucket, count the bucket down by the group."""
        plan = self.hook_groups.groups
        if plan is None:
            return  # disarmed while this backward ran (the hooks go with it)
        group = plan[number]
        step = self.step
        if not step.plain:
            # The backward's first hook: settle it exactly as a per-gradient hook would
            # (counting, refusing an unarmed backward, the zero-copy reclaim), with the
            # group's own last gradient; then the rest of the group below.
            self.autograd_hook(group.last)
            if not step.plain or self.hook_groups.groups is None:
                return  # no_sync(), or a backward nobody armed: nothing to reduce
            first = True
        else:
            first = False
        with self._lock:  # the rest of the group (all of it after the first hook)
            bucket = group.bucket
            params, indices, positions = group.params, group.indices, group.positions
            if first:  # marked by autograd_hook
                params, indices, positions = params[:-1], indices[:-1], positions[:-1]
            if self.observers.per_gradient:  # attached while the hooks were grouped
                for index in indices:
                    self.observers.gradient_ready(self, index)
            if not indices:
                return
            grads = list(map(_GRAD, params))
            found, index = self.hook_groups.arrivals(indices, grads)
            if found == AGAIN:  # a second arrival: what torch's per-gradient hooks refuse
                raise MarkedTwiceError(self.rank, self.names[index], index, read_by_group=True)
            if found != ONCE:
                self.fall_back_to_param_hooks(index)
                return
            if not step.ready.isdisjoint(indices):  # cannot happen unless a group repeats
                index = next(i for i in indices if i in step.ready)
                raise MarkedTwiceError(self.rank, self.names[index], index)
            step.ready.update(indices)
            if first:  # the logging data's order: the group's, its last (noted already) last
                step.ready_order[-1:-1] = indices
            else:
                step.ready_order.extend(indices)
            step.require_finalize = True
            # No .grad here is a bucket view: a view's version counter is its siblings' too, so
            # hooks are never grouped while one exists (HookGroups.groupable), and autograd makes
            # new tensors. Every gradient is copied.
            sources = grads if not any(map(_REQUIRES_GRAD, grads)) \
                else [grad.detach() for grad in grads]  # create_graph=True: not into the graph
            torch._foreach_copy_(list(map(bucket.views.__getitem__, positions)), sources)
            self.hook_groups.copied(params, grads, indices)
            bucket.pending -= len(indices)
            if bucket.pending == 0:
                self.bucket_full(bucket)

    def fall_back_to_param_hooks(self, missing: int) -> None:
        """A group's hook found a gradient of its group (parameter ``missing``) not yet (or
        never) computed in this backward: the order changed. One hook per gradient again, from
        this moment: every gradient already accumulated is marked ready now, each other one
        when its hook fires (or, if its node ran with no gradient before the hook was back, at
        the end of the backward: :meth:`_settle_unhooked`). Called with the lock held."""
        logger.info("mini_ddp rank %d: parameter '%s' had no gradient yet when its group's hook "
                    "fired (the gradient order changed): one hook per gradient again",
                    self.rank, self.names[missing])
        again = self.hook_groups.extra_arrival(self.params)
        if again is not None:  # arrived twice before any hook saw it: torch's error
            raise MarkedTwiceError(self.rank, self.names[again], again, read_by_group=True)
        fresh = self.hook_groups.fresh_indices(self.params)
        self.hook_groups.disarm(fell_back=True)
        self._register_param_hooks()
        self.observers.order_decided(self, "fallback")
        for index in fresh:
            if index not in self.step.ready:
                self.mark_variable_ready(index)
        Variable._execution_engine.queue_callback(self._settle_unhooked)

    def _settle_unhooked(self) -> None:
        """End of a backward that fell back: a parameter whose ``AccumulateGrad`` node ran
        before its hook was back (with no gradient: an output left out of the loss) is
        marked ready now, as its hook would have marked it (zeros, or the ``.grad`` it keeps).
        A parameter whose node was not in this backward's graph stays unready: the next
        forward names it, as after a per-gradient backward."""
        with self._lock:
            if not self.step.expect_hooks:
                return  # finished already
            for index in self.step.missing():
                if torch._C._will_engine_execute_node(self._accumulators[index]):
                    self.mark_variable_ready(index)

    # ---- 2. into the bucket --------------------------------------------------------------
    def mark_variable_ready(self, index: int) -> None:
        """Copy parameter ``index``'s gradient into its bucket; launch what became full."""
        step, buckets = self.step, self.layout.buckets
        if index in step.ready:
            raise MarkedTwiceError(self.rank, self.names[index], index)
        step.ready.add(index)
        step.require_finalize = True
        bucket_index, position = self.layout.locator[index]
        bucket = buckets[bucket_index]
        # The default path's common case inline (copy_grad_in's first branch, one call less
        # per gradient): note the gradient and the version its hook saw; copy it now, or, when
        # this backward reads late, in scale_bucket's one copy of the bucket.
        if self.scales_whole_buckets and not bucket.sparse \
                and (grad := bucket.params[position].grad) is not None:
            if grad is not bucket.views[position]:
                bucket.noted.append((position, grad, grad._version))
                if not self.reads_late:
                    bucket.views[position].copy_(grad.detach() if grad.requires_grad else grad)
        else:
            self.copy_grad_in(bucket, position)
        bucket.pending -= 1
        if bucket.pending == 0:
            self.bucket_full(bucket)

    def bucket_full(self, bucket: bucketing.Bucket) -> None:
        """Every gradient of ``bucket`` is in: scale it, launch what can be launched, and
        queue the end of backward once the last bucket has gone."""
        step, buckets = self.step, self.layout.buckets
        if self.scales_whole_buckets:  # scale_bucket, inline: one call less per bucket
            if not bucket.sparse:  # a sparse bucket is divided on its way in
                if bucket.noted:
                    self._read_noted(bucket)
                bucket.buffer.mul_(self._scale)
        elif self.config.batched_grad_copy:
            self.flush_batched(bucket)
        self.observers.bucket_ready(self, bucket)
        # Launch every ready bucket from next_bucket on, strictly in bucket order. With
        # skip_all_reduce_unused_params a bucket of unused parameters only stays local (no
        # future: its .grad are left alone), as DDP's should_skip_all_reduce_bucket.
        if bucket.index == step.next_bucket:
            while step.next_bucket < len(buckets) and buckets[step.next_bucket].pending == 0:
                ready = buckets[step.next_bucket]
                if not (self.config.skip_all_reduce_unused_params and all(
                        i in self.unused_search.unused for i in ready.param_indices)):
                    self.all_reduce_bucket(ready)
                step.next_bucket += 1
        # Only a launch moves next_bucket, so only a full bucket can make it the last.
        if step.next_bucket == len(buckets):
            if self.unused_search.dynamic:
                self.unused_search.launch_map_reduce(lambda: self.describe(None),
                                                     self.flight, step.num_iterations)
            Variable._execution_engine.queue_callback(self.finalize_backward)

    def copy_grad_in(self, bucket: bucketing.Bucket, position: int) -> None:
        """Put ``bucket.params[position]``'s gradient into its view of the bucket.

        Without a comm hook, DDP multiplies by ``1/world_size`` *while copying* (``mul_out``
        with a double scalar); with a hook it copies unscaled, since the hook averages.
        ``x * (1/3)`` differs from ``x / 3`` in about a third of fp32 values, so how a
        gradient is scaled is where bitwise parity is won. The default path
        (:attr:`scales_whole_buckets`) only copies here, and :meth:`scale_bucket` multiplies
        the full bucket once: the same kernel and the same scalar on every element, so the
        same bits as DDP's per-gradient ``mul_out``, for one call per bucket instead of one
        per gradient. DDP's variants:

        * a sparse gradient becomes its bucket, divided in place (a true division, DDP's
          ``mark_variable_ready_sparse``);
        * ``gradient_as_bucket_view=True``: a gradient that already is its view is divided
          in place (DDP's ``div_``, a true division), any other one is multiplied into it,
          one gradient at a time, as DDP does;
        * ``batched_grad_copy=True`` only *notes* a gradient that is not already the view;
          :meth:`flush_batched` copies the noted ones when the bucket is full and divides the
          whole flat bucket once (a true division — the bits differ from the default path's
          multiply exactly as they do in torch DDP). An undefined gradient zeroes its view at
          once; one that requires grad (``create_graph=True``) bypasses batching and is then
          divided a second time by the flat ``div_``, as in DDP.
        """
        if bucket.sparse:  # the sparse .grad becomes the bucket (mini_ddp.engine.buckets)
            grad = check_sparse_grad(bucket.params[0].grad, self.names[bucket.param_indices[0]],
                                     self.rank)
            bucket.buffer = grad
            if self._comm_hook is None:
                grad.div_(self.div_factor)  # DDP: a true division, on the .grad itself
            return
        param, view = bucket.params[position], bucket.views[position]
        grad = param.grad
        if grad is None:
            index = bucket.param_indices[position]
            if self.step.tracks_used and self.unused_search.locally_used(index):
                raise UndefinedButUsedError(self.rank, self.names[index], index)
            view.zero_()  # marked ready without a gradient: contribute zeros
            return
        if self.scales_whole_buckets:
            # A gradient the zero-copy write-back left as the view is already in place; any
            # other is noted with the version seen now, and copied now or, when this backward
            # reads late, by scale_bucket, with the bucket's others, in one call.
            if grad is not view:
                bucket.noted.append((position, grad, grad._version))
                if not self.reads_late:
                    view.copy_(grad.detach() if grad.requires_grad else grad)
            return
        hooked = self._comm_hook is not None
        batched, as_bucket_view = self.config.batched_grad_copy, self.config.gradient_as_bucket_view
        if grad is view or (as_bucket_view and shares_storage(grad, bucket.buffer)):
            # The gradient already *is* the bucket view, and autograd accumulated into it.
            if not (hooked or batched):  # a hook averages; batched: the flat div_ scales it
                view.div_(self.div_factor)  # DDP divides in place here: a true division
            return
        if batched and not grad.requires_grad:
            bucket.deferred.append(position)  # DDP's defer: flush_batched copies it
            return
        if hooked:
            view.copy_(grad)  # a user hook does its own averaging
        elif grad.requires_grad:  # create_graph=True: the copy must not join the graph
            view.copy_(torch.mul(grad.detach(), 1.0 / self.div_factor))
        else:
            torch.mul(grad, self._scale, out=view)  # DDP's mul_out
        if as_bucket_view:
            assign_grad(param, view)

    def scale_bucket(self, bucket: bucketing.Bucket) -> None:
        """The default path: the bucket is full, copy its gradients in and multiply it by
        ``1/world_size``, each at once.

        DDP multiplies each gradient on its way in (``mul_out`` with the wrapped double
        ``1/world_size``); one in-place multiply of the flat buffer by the same 0-dim double
        tensor runs the same elementwise kernel on every element, so the bits are the same
        (tests/test_core_parity.py compares them with torch DDP at world size 3). The copies
        are exact, so doing them here, in one ``torch._foreach_copy_``, changes no bit either:
        it saves a Python call per gradient, which is most of the hook's cost on many small
        parameters.
        """
        if bucket.sparse:  # divided on its way in
            return
        if bucket.noted:
            self._read_noted(bucket)
        bucket.buffer.mul_(self._scale)

    def _read_noted(self, bucket: bucketing.Bucket) -> None:
        """The bucket is full: check that no noted gradient changed since its hook (its
        version counter), and copy them in at once if this backward reads late.

        Reading at the hooks, a change means a late read would have differed from torch's:
        gradients are read at the hooks from now on (HookGroups.late_change). Reading late,
        it means the value torch DDP would reduce is gone: an error naming the parameter.
        """
        positions, grads, versions = zip(*bucket.noted, strict=True)
        bucket.noted.clear()
        if list(map(_VERSION, grads)) != list(versions):
            for position, grad, version in zip(positions, grads, versions, strict=True):
                # A view's counter is its siblings' too (the zero-copy write-back's bucket
                # views): it moves with them, so it tells nothing.
                if grad._version != version and grad._base is None:
                    index = bucket.param_indices[position]
                    if self.reads_late:
                        raise GradChangedLateError(self.rank, self.names[index], index)
                    if self.hook_groups is not None:
                        self.hook_groups.late_change(self.names[index])
                    break
        if self.reads_late:
            if any(map(_REQUIRES_GRAD, grads)):  # create_graph=True: not into the graph
                grads = [grad.detach() for grad in grads]
            torch._foreach_copy_(list(map(bucket.views.__getitem__, positions)), list(grads))

    @staticmethod
    def _copy_deferred(bucket: bucketing.Bucket) -> None:
        """``batched_grad_copy``: copy the gradients :meth:`copy_grad_in` deferred (DDP reads
        them when the bucket is full too) into their bucket views."""
        # map(), not comprehensions: no Python frame per gradient.
        grads = list(map(_GRAD, map(bucket.params.__getitem__, bucket.deferred)))
        if any(map(_REQUIRES_GRAD, grads)):  # create_graph=True: the copy must not join it
            grads = [grad.detach() for grad in grads]
        torch._foreach_copy_(list(map(bucket.views.__getitem__, bucket.deferred)), grads)

    def flush_batched(self, bucket: bucketing.Bucket) -> None:
        """``batched_grad_copy``: the bucket is full, copy its noted gradients in at once
        (one ``torch._foreach_copy_``), then divide the bucket once (no comm hook)."""
        if bucket.sparse:
            return  # divided on its way in
        if bucket.deferred:
            self._copy_deferred(bucket)
            if self.config.gradient_as_bucket_view:
                for i in bucket.deferred:
                    bucket.params[i].grad = bucket.views[i]
            bucket.deferred.clear()
        if self._comm_hook is None:
            bucket.buffer.div_(self.div_factor)

    # ---- 3. launch -----------------------------------------------------------------------
    def all_reduce_bucket(self, bucket: bucketing.Bucket) -> None:
        """Start ``bucket``'s collective: shared memory where it lives there, else the
        comm-hook door (a registered hook, or the default all-reduce)."""
        if self._comm_hook is not None:  # a user hook's errors are its own: no naming
            grad_bucket = bucket.grad_bucket = GradBucket.of(bucket, len(self.layout.buckets))
            try:
                bucket.future = launch_hook(self._comm_hook, self.comm_hook_state, self.group,
                                            grad_bucket)
            except RuntimeError as err:  # e.g. no future returned: logged, as torch logs it
                if self.runtime_log is not None:
                    self.runtime_log.record_error(err)
                raise
        else:
            # The default path, without the comm-hook door's GradBucket (made only if a
            # result needs checking): shared memory where the bucket lives there, else
            # allreduce_sum_hook's call, inline; a backend failure named as naming_collective
            # names it, without the context manager on the path.
            bucket.grad_bucket = None
            buffer = bucket.buffer
            try:
                if self.use_transport and not bucket.sparse \
                        and buffer.nbytes >= self.config.shared_memory_min_bytes \
                        and self.transport.owns(buffer):
                    bucket.future = self.transport.all_reduce(buffer)
                elif buffer.is_complex():  # dist.all_reduce sums it as its real view
                    bucket.future = dist.all_reduce(buffer, group=self.group,
                                                    async_op=True).get_future()
                else:  # the group's own allreduce, as torch's C++ reducer calls it
                    bucket.future = self._group.allreduce([buffer], _SUM).get_future()
            except MiniDDPError:
                raise
            except RuntimeError as err:
                raise collective_error(self.rank, self.describe(bucket), err) from err
        self.observers.bucket_launched(self, bucket)

    def delay_all_reduce(self) -> None:
        """Static graph, first iteration: reduce everything once backward has finished.

        In iteration 1 the hooks only count how often each parameter's gradient arrives; this
        (queued by the model's output sink) then copies every gradient in and reduces all
        buckets, through steps 2-5 above (DDP's ``delay_all_reduce``).
        """
        buckets = self.layout.buckets
        with self._lock:
            self.unused_search.launch_map_reduce(lambda: self.describe(None), self.flight,
                                                 self.step.num_iterations)
            self.unused_search.unused = [i for i, c in enumerate(self.step.static_hook_counts)
                                         if c == 0]
            self.step.require_finalize = True
            for bucket in buckets:
                for position in range(len(bucket.params)):
                    self.copy_grad_in(bucket, position)
            for bucket in buckets:
                if self.scales_whole_buckets:
                    self.scale_bucket(bucket)
                elif self.config.batched_grad_copy:
                    self.flush_batched(bucket)
                self.observers.bucket_ready(self, bucket)
                self.all_reduce_bucket(bucket)
            self.step.next_bucket = len(buckets)
        self.finalize_backward()

    # ---- 4. wait -------------------------------------------------------------------------
    def wait(self, future: torch.futures.Future, bucket: bucketing.Bucket | None) -> Any:
        """The one place that blocks: wait for ``future`` with the configured deadline.

        ``bucket`` (None: the used-map all-reduce) names what is waited for in a timeout, a
        stall report and a collective's failure. The wait itself is
        :func:`mini_ddp.transport.wait.wait_done` — which, for a result on a GPU, waits until
        the GPU has run the collective (NCCL's futures are done at launch), so the deadline and
        the stall report mean the same on NCCL as on Gloo. The stall observer (``on_stall``)
        is told once the wait is slow and again when the collective fails; either may raise,
        else the wait goes on.
        """
        on_stall = self.on_stall
        slow = None if on_stall is None else lambda: on_stall(self, bucket, None)
        blocks = not future.done()
        if blocks:
            self.observers.wait_begun(self, bucket)
        # A finished future with a host result has nothing left to wait for (wait_done's
        # second layer is for results on a GPU): the common case, without the call.
        if (blocks or self._results_on_gpu or self._comm_hook is not None) and not wait_done(
                future, self.config.sync_timeout_s, stall_after_s=self.stall_after_s,
                on_slow=slow):
            late, dumped = (NOT_ASKED, {}) if self.on_timeout is None \
                else self.on_timeout(self, bucket)
            error = GradSyncTimeout(self.rank, self.config.sync_timeout_s, bucket, self.names,
                                    len(self.layout.buckets), late=late)
            if self.flight is not None:  # what led here, for `python -m mini_ddp doctor`
                self.flight.dump(f"GradSyncTimeout: {error}", **dumped)
            raise error
        if blocks:
            self.observers.wait_ended(self, bucket)
        late = None
        if on_stall is not None:
            try:
                future.wait()
            except Exception as error:  # noqa: BLE001 - raised again by the wait below
                # A dead peer, or the backend's own timeout: the observer may name late ranks.
                late = on_stall(self, bucket, error)
        # A dead peer fails the collective (Gloo notices a closed socket at once): name it.
        try:
            return future.wait()
        except MiniDDPError as err:
            if bucket is None or not isinstance(err, (CollectiveError, ShmError)):
                raise
            # The shared-memory transport's own error names a slot: name the bucket, with
            # the backend's words (a CollectiveError of the transport keeps them as cause).
            cause = err.__cause__ if isinstance(err, CollectiveError) else None
            raise CollectiveError(self.rank, self.describe(bucket), cause or err,
                                  late=late or "") from err
        except RuntimeError as err:  # the backend's failure (naming_collective's rule)
            raise collective_error(self.rank, self.describe(bucket), err,
                                   late=late or "") from err

    def describe(self, bucket: bucketing.Bucket | None) -> str:
        """What a wait for ``bucket`` (None: the used map) waits for, in errors' words."""
        what = describe_bucket(bucket, self.names, len(self.layout.buckets))
        if bucket is not None and self.comm_hook is None and self._through_transport(bucket):
            what += " through shared memory"
        if bucket is not None and self.comm_hook is not None:
            hook = getattr(self.comm_hook, "__qualname__", repr(self.comm_hook))
            what += f" through communication hook {hook}"
        return what

    # ---- 5. write back -------------------------------------------------------------------
    def finalize_backward(self) -> None:
        """Wait for every bucket, then put the averaged gradients into ``param.grad``."""
        config = self.config
        with self._lock:
            self.observers.backward_ended(self)
            groups = self.hook_groups
            if groups is not None and groups.groups is not None:
                changed = groups.changed_since_copy(reset=True)  # one that arrived twice
                if changed is not None:
                    raise MarkedTwiceError(self.rank, self.names[changed], changed)
            elif groups is not None and self.step.plain and not self._hooks_removed:
                groups.observe(self.step.ready_order, self.params)
            if groups is not None and self.scales_whole_buckets and not self.reads_late \
                    and groups.changed_late is None:
                groups.quiet_backward()  # read at the hooks, and nothing changed after them
            # The synced backward has finished (its gradients are being written back): the
            # step state's end, inline (one call less on every backward's path).
            step = self.step
            step.expect_hooks = step.backward_counted = step.plain = False
            step.require_finalize = False
            step.synced_this_step = True
            if config.static_graph and self.step.num_backward_calls > 1 \
                    and self.layout.should_rebuild():
                self.layout.record_ready(*self.unused_search.unused)
            track_unused = config.static_graph or config.find_unused_parameters
            plain = not track_unused and not config.gradient_as_bucket_view
            skip = (lambda index: self.unused_search.globally_unused(index, self.wait)) \
                if track_unused else None
            for bucket in self.layout.buckets:
                if bucket.future is None:
                    continue  # skipped: all its parameters unused (skip_all_reduce_unused_params)
                value = self.wait(bucket.future, bucket)
                self.observers.bucket_done(self, bucket)
                if bucket.sparse:  # the result goes into the bucket, which is the .grad
                    bucketing.sparse_write_back(bucket, value)
                    continue
                # The default path's result is [the bucket's own buffer], reduced in place.
                result = value[0] if self._comm_hook is None and type(value) is list \
                    and len(value) == 1 and value[0] is bucket.buffer \
                    else result_tensor(value, self._comm_hook, bucket.grad_bucket
                                       or GradBucket.of(bucket, len(self.layout.buckets)))
                writeback.write_back_bucket(bucket, result, plain=plain, zero_copy=self.zero_copy,
                                            as_bucket_view=config.gradient_as_bucket_view,
                                            skip=skip)
            if track_unused:  # the used map: nothing to wait for or reset otherwise
                self.unused_search.finish(self.wait)
            self.observers.backward_finished(self)


def _hook_trampoline(reducer_ref: weakref.ref, index: int, *_grads: Any) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.autograd_hook(index)


def _group_hook_trampoline(reducer_ref: weakref.ref, number: int, *_grads: Any) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.group_ready(number)


def _begin_trampoline(reducer_ref: weakref.ref, *_grad: Any) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.backward_begins()

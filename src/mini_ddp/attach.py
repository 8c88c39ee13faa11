"""``mini_ddp.attach(ddp_model)``: mini_ddp's watch and checks on torch's own DistributedDataParallel.

A user who keeps ``torch.nn.parallel.DistributedDataParallel`` adds one line::

    model = mini_ddp.attach(DistributedDataParallel(net))   # the same object, returned

and gets what :class:`~mini_ddp.engine.model.DataParallelModel` tells about the classic
mistakes (docs/debugging.md has the table, with a column for ``attach``), in the same words,
honouring ``MINI_DDP_DEBUG=1``. ``attach`` works only through torch's public surfaces:

* a forward pre-hook and a forward hook on the DDP model, and a forward pre-hook on its
  ``module`` (it runs after torch's buffer broadcast): they count the synchronised steps and
  call the checks where a DataParallelModel calls them;
* post-accumulate-grad hooks on the synchronised parameters: which backward a forward armed;
* a communication hook that times each bucket's future and tells the checks the bucket's
  local gradients before it reduces them (the replica check's identical-data hash): torch's
  ``allreduce_hook`` unless the user registers one (``register_comm_hook`` is wrapped on this
  instance, so the user's hook is timed instead — it composes, and torch's once-only rule still
  holds). A built-in C++ hook (``_register_builtin_comm_hook``) keeps its buckets to itself:
  they go untimed, and the identical-data hash is not taken;
* the process group's store, for the finish marks, the checks' records and the stack requests.

What it runs: the replica check (identical data, weights loaded on one rank, a rank left in
``eval()``, a parameter added after wrapping) and the bypassed-wrapper warning always; the finish
marks (a rank that finished is not called dead: a failed bucket future logs what the store
says); the stall warning, naming the ranks that have not reached a bucket (or torch's buffer
broadcast before a forward: uneven inputs, a collective on one rank) and their Python stacks;
under the debug switch the collective fingerprints (an extra forward on one rank, uneven
inputs, a collective on one rank only) and the NaN watch. The checks themselves are the ones a
DataParallelModel runs (:class:`mini_ddp.checks.debug.SyncChecks`), given a small view of the DDP
model that exposes what they read.

What torch's C++ reducer hides is not guessed: its bucket order and which parameters a bucket
holds (so the stall report names a bucket by torch's index only), and when its hooks run
relative to ours (so the backward's fingerprint may come after torch launched a one-parameter
first bucket). Attaching never changes a bit of training: the hooks only read, and the default
hook is torch's own ``allreduce_hook``, bitwise the built-in reduction (tested).
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mini_ddp.checks.debug import SyncChecks, debug_requested
from mini_ddp.checks.grad_watch import GradWatch
from mini_ddp.engine.observer import Observers
from mini_ddp.errors import DEBUG_HINT
from mini_ddp.watch.bounded_store import StoreUnanswered, default_store
from mini_ddp.watch.peers import explain_peers, note_mistake, peer_states, watch
from mini_ddp.watch.stacks import (
    ANSWER_S,
    ask_stacks,
    describe_answer,
    extra_forward,
    start_responder,
)
from mini_ddp.watch.stall import ARRIVAL_GRACE_S, MAX_ASKED, broadcast_stall, late_ranks

__all__ = ["Attachment", "attach", "attachment"]

logger = logging.getLogger("mini_ddp")

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, Attachment] = weakref.WeakKeyDictionary()
_SESSIONS = itertools.count()  # the same on every rank: attach is called in lockstep
_BACKEND_ERROR = re.compile(r"gloo|nccl|connection|timed out|timeout", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


class _Step:
    """The step counter the checks read (``num_iterations``, ``expect_hooks``), driven by the
    forward hooks: torch's own counter sits in its C++ reducer."""

    def __init__(self) -> None:
        self.num_iterations = 0
        self.expect_hooks = False


class _BucketView:
    """What the checks read of one of torch's buckets (a ``GradBucket``) at ``bucket_ready``."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.sparse = buffer.is_sparse


class _ReducerView:
    """What the checks read of a reducer: rank, world size, the synchronised parameters and
    their names (in ``named_parameters`` order: torch's bucket order is its own), the step."""

    def __init__(self, ddp: nn.Module, group: Any) -> None:
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.group = group
        ignore = set(getattr(ddp, "parameters_to_ignore", ()))
        named = [(n, p) for n, p in ddp.module.named_parameters()
                 if p.requires_grad and n not in ignore]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.step = _Step()
        # The engine's events the checks hear under attach: bucket_ready, from the timed comm
        # hook (none under a built-in C++ hook, whose buckets torch keeps to itself).
        self.observers = Observers(every_event=False)


class _ModelView:
    """The DataParallelModel-shaped view of a torch DDP model that the checks are given."""

    def __init__(self, ddp: nn.Module, config: SimpleNamespace, monitor: Any) -> None:
        self.module = ddp.module
        self.process_group = ddp.process_group
        self.parameters_to_ignore = set(getattr(ddp, "parameters_to_ignore", ()))
        self.reducer = _ReducerView(ddp, ddp.process_group)
        self.config = config
        self.stall_monitor = monitor


class Attachment:
    """mini_ddp's hooks on one torch DDP model (see the module docstring); ``detach()`` takes
    them off (a registered comm hook stays: torch cannot unregister one)."""

    def __init__(self, ddp: nn.Module, debug: bool | None = None,
                 replica_check_every: int | None = 100, stall_warning_s: float | None = 60.0):
        self.debug = debug_requested(debug)
        group = ddp.process_group
        name = getattr(group, "group_name", "default")
        self._prefix = f"mini_ddp/attach/{name}/{next(_SESSIONS)}"
        self.answer_s = ANSWER_S
        self.stall_warning_s = stall_warning_s
        self._store: Any = None
        config = SimpleNamespace(stall_warning_s=stall_warning_s,
                                 sync_timeout_s=_group_timeout_s(group), debug=self.debug,
                                 replica_check_every=replica_check_every)
        self.view = _ModelView(ddp, config, self)
        reducer = self.view.reducer
        self._inside = False  # between the DDP model's forward pre-hook and its forward hook
        self._synced = False  # that forward is a synchronised one
        self._broadcast = False  # and broadcast the buffers
        self._armed_task: int | None = None
        self._pending: dict[int, tuple[float, int]] = {}  # bucket index -> (launched, step)
        self._broadcasting: tuple[float, int] | None = None  # torch's buffer broadcast: (since, step)
        # The last wait reported: a bucket's step, or ("broadcast", step): one report each.
        self._reported_step: int | tuple[str, int] | None = None
        self._told_failure = False  # one failure told: the process group is unusable after it
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        me = weakref.ref(self)
        # Before the checks' own hooks: the first of each backward decides whether the last
        # forward armed it (GradWatch reads that in its hook, which runs after this one).
        for param in reducer.params:
            self._handles.append(param.register_post_accumulate_grad_hook(
                functools.partial(_accumulated, me)))
        self._handles.append(ddp.register_forward_pre_hook(functools.partial(_pre_forward, me)))
        # always_call: the hook runs when torch's forward raised too (its buffer broadcast).
        self._handles.append(ddp.register_forward_hook(functools.partial(_post_forward, me),
                                                       always_call=True))
        self._handles.append(ddp.module.register_forward_pre_hook(
            functools.partial(_inner_pre_forward, me)))
        self.checks = SyncChecks(self.view, self.debug, replica_check_every)
        # The bypassed-wrapper check, by default as a WARNING (the switch's GradWatch raises):
        # nearly free, and torch's reducer says nothing of a backward no forward armed.
        self.bypass = None if self.debug or reducer.world_size == 1 else GradWatch(
            self.view, self.checks.board, nonfinite=False, strict=False,
            on_mistake=note_mistake)
        self._ddp = weakref.ref(ddp)
        self._hook_registered = False
        self._wrap_register_comm_hook(ddp)
        self._responder = None
        if reducer.world_size > 1:
            watch(reducer)  # this rank's finish mark, with its step
            if stall_warning_s is not None:
                try:
                    self._responder = start_responder(default_store(self._prefix),
                                                      reducer.rank, reducer,
                                                      prefix=self._prefix)
                except (RuntimeError, ValueError):  # no default store: stacks go unasked
                    self._responder = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # ---- what the checks' _ask reads of a stall monitor --------------------------------------
    @property
    def store(self) -> Any:
        """The prefixed store for stack requests and stall marks (opened on first use)."""
        if self._store is None:
            self._store = default_store(self._prefix)
        return self._store

    def dump(self, reason: str, **extra: Any) -> None:
        """No flight log under attach (torch's C++ reducer launches the collectives)."""

    # ---- hooks -----------------------------------------------------------------------------
    def pre_forward(self, ddp: nn.Module) -> None:
        """Before torch DDP's forward (and its buffer broadcast)."""
        step = self.view.reducer.step
        grad = torch.is_grad_enabled()
        synced = grad and bool(ddp.require_backward_grad_sync)
        broadcast = bool(ddp.will_sync_module_buffers())
        if not self._hook_registered:
            self._register_timing(ddp, None, None)  # torch's allreduce_hook, timed
        self.checks.before_collectives(grad, synced, broadcast, step.num_iterations + synced)
        if self.bypass is not None and grad:
            self.bypass.forward_seen()
        self._inside, self._synced, self._broadcast = True, synced, broadcast
        if synced:
            step.num_iterations += 1
            step.expect_hooks = True
            self._armed_task = None
        if broadcast and self.stall_warning_s is not None and self.view.reducer.world_size > 1:
            self._broadcasting = (time.monotonic(), step.num_iterations)
            self._start_watcher()

    def inner_pre_forward(self) -> None:
        """Before the wrapped module's forward: after torch's buffer broadcast when inside the
        DDP model's forward (a bypass, ``model.module(x)``, is not)."""
        self._broadcasting = None
        if self._inside and self._synced:
            self.checks.after_buffer_sync(self.view.reducer.step.num_iterations, self._broadcast)

    def post_forward(self) -> None:
        """After torch DDP's forward: when it raised a backend error (its buffer broadcast
        failed), say what the store proves of the other ranks."""
        self._inside = False
        self._broadcasting = None
        error = sys.exc_info()[1]
        if error is not None and _BACKEND_ERROR.search(str(error)) \
                and self.view.reducer.world_size > 1:
            step = self.view.reducer.step.num_iterations
            self.failed(f"the broadcast of the buffers before forward of step {step}", error)

    def accumulated(self) -> None:
        """A parameter's gradient was accumulated: the first backward after a synchronised
        forward is the one it armed; a later one is not."""
        step = self.view.reducer.step
        if not step.expect_hooks:
            return
        task = torch._C._current_graph_task_id()
        if self._armed_task is None:
            self._armed_task = task
        elif task != self._armed_task:
            step.expect_hooks = False

    # ---- the comm hook: each bucket's future, timed ------------------------------------------
    def _wrap_register_comm_hook(self, ddp: nn.Module) -> None:
        original = ddp.register_comm_hook
        me = weakref.ref(self)

        @functools.wraps(original)
        def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
            attached = me()
            if attached is None or attached._hook_registered:
                return original(state, hook)  # torch's own refusal of a second hook
            attached._register_timing(None, state, hook, original)
            return None

        ddp.register_comm_hook = register_comm_hook
        builtin = ddp._register_builtin_comm_hook

        @functools.wraps(builtin)
        def register_builtin(comm_hook_type: Any) -> None:
            attached = me()
            if attached is not None:
                attached._hook_registered = True  # a C++ hook: its buckets go untimed
            return builtin(comm_hook_type)

        ddp._register_builtin_comm_hook = register_builtin

    def _register_timing(self, ddp: nn.Module | None, state: object,
                         hook: Callable[..., Any] | None, register: Any = None) -> None:
        self._hook_registered = True
        if hook is None:
            state, hook = self.view.process_group, default_hooks.allreduce_hook
        if register is None:
            register = type(ddp).register_comm_hook.__get__(ddp)
        me = weakref.ref(self)

        def timed(hook_state, bucket):  # noqa: ANN001, ANN202 - torch reads the annotations
            attached = me()
            if attached is not None:  # the bucket's local gradients, before the hook reduces them
                reducer = attached.view.reducer
                reducer.observers.bucket_ready(reducer, _BucketView(bucket.buffer()))
            fut = hook(hook_state, bucket)
            if attached is None or not isinstance(fut, torch._C.Future):
                return fut  # torch names a hook that returned no future
            return attached.launched(bucket.index(), fut)

        timed.__name__ = getattr(hook, "__name__", "hook")
        register(state, timed)

    def launched(self, index: int, fut: torch.futures.Future) -> torch.futures.Future:
        """Bucket ``index``'s future: timed for the stall warning; a failure is told with
        what the store says of the other ranks (finished, failed, or no mark)."""
        step = self.view.reducer.step.num_iterations
        with self._lock:
            self._pending[index] = (time.monotonic(), step)
        self._start_watcher()
        me = weakref.ref(self)

        def done(f: torch.futures.Future) -> Any:
            attached = me()
            if attached is not None:
                with attached._lock:
                    attached._pending.pop(index, None)
            try:
                return f.value()
            except Exception as error:
                if attached is not None:
                    attached.failed(f"the all-reduce of bucket {index} of step {step}", error)
                raise

        return fut.then(done)

    def failed(self, what: str, error: BaseException) -> None:
        """A collective of torch's (``what``) failed: say what the store proves, as a WARNING
        before torch's own error, in the words of :class:`~mini_ddp.errors.CollectiveError`."""
        if self._told_failure:
            return
        self._told_failure = True
        rank = self.view.reducer.rank
        marks = explain_peers(rank)
        first = re.sub(r"^\[[^\]]*:\d+\]\s*", "", (str(error).strip().splitlines()
                                                 or [type(error).__name__])[0])
        first = first.split(" This is typically caused by")[0].rstrip(" .")[:300]
        if marks and not marks.startswith("Whether another rank"):
            logger.warning("mini_ddp: rank %d: %s failed because another rank ended before it. "
                           "What the other ranks left in the store: %s (The backend said: %s.)",
                           rank, what, marks, first)
        elif _TIMED_OUT.search(first):
            logger.warning("mini_ddp: rank %d: %s failed: %s. No rank closed its connection (a "
                           "rank that exits or is killed closes it at once): the others are "
                           "stuck or slow, or alive and running a different collective. %s",
                           rank, what, first, DEBUG_HINT)
        else:
            logger.warning("mini_ddp: rank %d: %s failed: %s. Another rank has most likely "
                           "died (killed, out of memory, crashed), hung, or lost its "
                           "connection: its own log says why.%s", rank, what, first,
                           f" {marks}" if marks else "")

    # ---- the stall warning -------------------------------------------------------------------
    def _start_watcher(self) -> None:
        if self._watcher is not None or self.stall_warning_s is None \
                or self.view.reducer.world_size == 1:
            return
        me = weakref.ref(self)
        self._watcher = threading.Thread(target=_watch_stalls, args=(me, self._stop),
                                         name="mini_ddp-attach-stall", daemon=True)
        self._watcher.start()

    def oldest_pending(self) -> tuple[int, float, int] | None:
        """``(bucket, waited_s, step)`` of the longest-waiting bucket future (None: none)."""
        with self._lock:
            if not self._pending:
                return None
            index, (start, step) = min(self._pending.items(), key=lambda kv: kv[1][0])
        return index, time.monotonic() - start, step

    def broadcast_held_up(self) -> tuple[float, int] | None:
        """``(waited_s, step)`` of torch's buffer broadcast under way (None: none)."""
        since = self._broadcasting
        return None if since is None else (time.monotonic() - since[0], since[1])

    def report_broadcast_stall(self, waited: float, step: int) -> str | None:
        """The stall report of torch's buffer broadcast before forward ``step``, in
        DataParallelModel's words (None: every peer has reached it). torch's C++ broadcast
        cannot be interrupted from here: the process group's timeout ends it."""
        reducer = self.view.reducer
        found = broadcast_stall(self.store, reducer.rank, reducer.world_size, step,
                                round(waited, 1), grace_s=ARRIVAL_GRACE_S,
                                answer_s=self.answer_s, can_ask=self._responder is not None)
        if found is None:
            return None
        text, never_pairs, _answers = found
        if never_pairs:
            text += ("\n  The two collectives never pair: torch DDP's broadcast waits for the "
                     "process group's timeout, then fails.")
        return text

    def _late_ranks(self, step: int, kind: str = "stall") -> list[int]:
        """Mark this rank waiting in ``kind`` at ``step``; the peers whose mark stays older."""
        reducer = self.view.reducer
        return late_ranks(self.store, kind, reducer.rank, reducer.world_size, step,
                          ARRIVAL_GRACE_S)

    def report_stall(self, index: int, waited: float, step: int) -> str:
        """Mark this rank waiting, give the peers a moment to mark theirs, name the ones that
        did not, with their stacks (and what their finish marks say); the report's text."""
        rank = self.view.reducer.rank
        late = self._late_ranks(step)
        lines = [f"mini_ddp stall report from rank {rank} (step {step}): the all-reduce of "
                 f"bucket {index} (torch's bucket index) has not finished after {waited:.1f} s."]
        states = peer_states()
        answers = ask_stacks(self.store, late[:MAX_ASKED], self.answer_s, asked_by=rank,
                             why=f"rank {rank} waits for bucket {index} of step {step}") \
            if late and self._responder is not None else {}
        named = False
        for r in late:
            if r in states and states[r].ended:
                lines.append(f"  {states[r].describe()}")
                continue
            lines.append(f"  rank {r}: has not reached bucket {index} of step {step}: it is "
                         f"slow or stuck before it (no mark from it within "
                         f"{ARRIVAL_GRACE_S:g} s of this one)")
            if r in answers:
                lines.append(describe_answer(r, answers[r]))
                verdict = extra_forward(r, answers[r], rank, step)
                if verdict:
                    lines.append(verdict)
                    named = True
        if late and not named:
            lines.append("  A rank that has not reached the bucket is still computing or is "
                         "stuck before it (data loading, a rank-dependent branch, a deadlock "
                         "in user code); this rank keeps waiting for it.")
        return "\n".join(lines)

    def detach(self) -> None:
        """Take the hooks and the checks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.checks.remove()
        if self.bypass is not None:
            self.bypass.remove()
        self._stop.set()
        if self._responder is not None:
            self._responder.stop()
            self._responder = None


def _watch_stalls(me: weakref.ref, stop: threading.Event) -> None:
    """The stall warning's thread: every half second, the longest wait under way (a bucket's
    future, or torch's buffer broadcast) against the limit; one report per step."""
    while not stop.wait(0.5):
        attached = me()
        if attached is None:
            return
        limit = attached.stall_warning_s
        broadcast, oldest = attached.broadcast_held_up(), attached.oldest_pending()
        if limit is not None and broadcast is not None and broadcast[0] >= limit \
                and attached._reported_step != ("broadcast", broadcast[1]):
            attached._reported_step = ("broadcast", broadcast[1])
            _tell(attached, lambda a=attached, b=broadcast: a.report_broadcast_stall(*b),
                  f"the buffer broadcast of step {broadcast[1]}")
        elif limit is not None and oldest is not None and oldest[1] >= limit \
                and attached._reported_step != oldest[2]:
            attached._reported_step = oldest[2]
            _tell(attached, lambda a=attached, o=oldest: a.report_stall(*o),
                  f"bucket {oldest[0]}")
        del attached


def _tell(attached: Attachment, report: Callable[[], str | None], what: str) -> None:
    """Log a stall report (a failure to make one is logged too: nothing escapes the thread)."""
    try:
        text = report()
        if text:
            logger.warning("%s", text)
    except StoreUnanswered as problem:
        logger.warning("mini_ddp: rank %d has waited %g s for %s; %s: no stall report this time "
                       "(the wait goes on)", attached.view.reducer.rank,
                       attached.stall_warning_s, what, problem)
    except Exception:  # noqa: BLE001 - a thread of its own: nothing may escape it
        logger.exception("mini_ddp: could not make the stall report")


def _pre_forward(me: weakref.ref, module: nn.Module, _args: Any) -> None:
    attached = me()
    if attached is not None:
        attached.pre_forward(module)


def _post_forward(me: weakref.ref, _module: nn.Module, _args: Any, _out: Any) -> None:
    attached = me()
    if attached is not None:
        attached.post_forward()


def _inner_pre_forward(me: weakref.ref, _module: nn.Module, _args: Any) -> None:
    attached = me()
    if attached is not None:
        attached.inner_pre_forward()


def _accumulated(me: weakref.ref, _param: torch.Tensor) -> None:
    attached = me()
    if attached is not None:
        attached.accumulated()


def _group_timeout_s(group: Any) -> float | None:
    try:
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group)).total_seconds()
    except Exception:  # noqa: BLE001 - the deadline is only the debug check's error's
        return None


def attach(ddp_model: nn.Module, *, debug: bool | None = None,
           replica_check_every: int | None = 100,
           stall_warning_s: float | None = 60.0) -> nn.Module:
    """Put mini_ddp's watch and checks on torch's ``DistributedDataParallel`` model; returns
    the same model (attaching twice is once).

    ``debug``: mini_ddp's debug switch (None: ``MINI_DDP_DEBUG=1`` or
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``); ``replica_check_every``: steps between replica checks
    (None: off unless debug); ``stall_warning_s``: the stall warning's limit (None: off). See
    the module docstring and docs/debugging.md for what is named under ``attach``.
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError("mini_ddp.attach expects a torch.nn.parallel.DistributedDataParallel "
                        f"model, not {type(ddp_model).__name__}: DataParallelModel runs these "
                        "checks itself")
    if ddp_model not in _ATTACHED:
        _ATTACHED[ddp_model] = Attachment(ddp_model, debug, replica_check_every,
                                          stall_warning_s)
    return ddp_model


def attachment(ddp_model: nn.Module) -> Attachment | None:
    """The :class:`Attachment` of ``ddp_model`` (None: not attached)."""
    return _ATTACHED.get(ddp_model)

"""Watching local gradients: where a NaN came from, a wrapper that was bypassed.

By default :class:`NonFiniteSentinel` reads one small gradient per backward for the first
mistake; under the debug switch :class:`GradWatch` reads every one, and watches for the second.

Two mistakes only the local gradients show, before the all-reduce mixes them:

* **A NaN or Inf from one rank.** One rank's bad batch (or overflow) makes its local gradient
  NaN; the all-reduce then makes every rank's gradient — and weights — NaN, and nothing says
  where it started. A tensor hook on each parameter checks the incoming local gradient
  (``torch.isfinite``); the first non-finite one is logged by its rank with the parameter's
  name and posted on the :class:`~mini_ddp.checks.rank_board.RankBoard`, and every other rank
  names that rank at its next forward. A warning, not an error: ``torch.amp.GradScaler`` skips
  steps with Inf gradients on purpose.
* **A training forward that bypasses the wrapper.** ``model.module(x)`` (or the inner module
  kept under another name) in training runs no collective: that rank's gradients stay local
  (torch DDP ignores them) and the other ranks wait for it. A post-accumulate-grad hook sees a
  backward (a new autograd graph task) into the wrapped parameters that no forward through the
  wrapper preceded, and raises :class:`WrapperBypassedError` on that rank, posting the verdict
  for the waiting ranks (:class:`~mini_ddp.checks.fingerprint.Fingerprints` quotes it).

The post-accumulate hook is also where a synchronised backward's fingerprint is taken: it runs
before the reducer's own hook of the same parameter, so before any bucket is launched.
Cost: the bypass check is one Python hook per parameter that returns at once after the first
parameter of each backward; the NaN check adds a ``torch.isfinite(grad).all()`` per gradient
and a second hook (docs/debugging.md has both figures). Under mini_ddp's debug switch both run
and a bypass raises; ``mini_ddp.attach`` on torch's DDP runs the bypass check by default, as a
WARNING (``strict=False``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch

from mini_ddp.engine.hook_groups import passive_hook
from mini_ddp.errors import MiniDDPError

logger = logging.getLogger("mini_ddp")

SENTINEL_MAX_NUMEL = 4096
"""The largest parameter the default NaN check reads per backward (see NonFiniteSentinel)."""
DEBUG_HINT = "MINI_DDP_DEBUG=1"


class WrapperBypassedError(MiniDDPError):
    """A backward into the wrapped parameters without a forward through the wrapper."""


class GradWatch:
    """The hooks on ``model``'s synchronised parameters (see the module docstring)."""

    def __init__(self, model: Any, board: Any, fingerprints: Any = None,
                 nonfinite: bool = True, strict: bool = True,
                 on_mistake: Any = None):
        # nonfinite: check each local gradient (a pass over it); strict: a bypassed wrapper
        # raises (the debug switch) rather than warns (by default: a backward through
        # model.module on purpose, for a local saliency map, is legal and stays so).
        self.strict = strict
        self.nonfinite = nonfinite
        self.on_mistake = on_mistake  # told a verdict on this rank's script (its finish mark)
        self._model = weakref.ref(model)
        self.board, self.fingerprints = board, fingerprints
        self._task = None  # the autograd graph task of the last backward seen
        self._forwards = 0  # forwards through the wrapper with grad enabled since that backward
        self._nonfinite_step: int | None = None  # the step this rank posted a NaN/Inf for
        self._peer_steps: dict[int, int] = {}  # peers' NaN/Inf records already told
        self._bypass_told = False
        me = weakref.ref(self)
        self._handles = []
        for index, param in enumerate(model.reducer.params):
            # Read-only hooks (passive_hook): the reducer may still read gradients late.
            if nonfinite:
                self._handles.append(param.register_hook(
                    passive_hook(functools.partial(_local_grad, me, index))))
            self._handles.append(param.register_post_accumulate_grad_hook(
                passive_hook(functools.partial(_accumulated, me, index))))

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forward_seen(self) -> None:
        """A forward through the wrapper with grad enabled (synchronised or in no_sync)."""
        self._forwards += 1

    # ---- NaN / Inf ------------------------------------------------------------------------
    def local_grad(self, index: int, grad: torch.Tensor) -> None:
        """A parameter's local gradient, before it is accumulated and all-reduced."""
        model = self._model()
        if model is None or self._nonfinite_step is not None or grad.is_sparse:
            return
        if bool(torch.isfinite(grad).all()):
            return
        reducer = model.reducer
        step, name = reducer.step.num_iterations, reducer.names[index]
        kind = "NaN" if bool(torch.isnan(grad).any()) else "Inf"
        self._nonfinite_step = step
        self.board.post("nonfinite", {"step": step, "param": name, "kind": kind})
        if self._peer_steps and min(self._peer_steps.values()) < step:
            return  # a peer's NaN reached this rank first: it named where it came from
        logger.warning(
            "mini_ddp: rank %d: the local gradient of '%s' holds %s in the backward of step "
            "%d, before the all-reduce: it comes from this rank's batch or forward (a bad "
            "sample, a log of zero, an overflow); the all-reduce spreads it to every rank. "
            "See docs/debugging.md.", self.board.rank, name, kind, step)

    def peers_nonfinite(self) -> None:
        """At a forward: name the peer whose NaN/Inf the last all-reduce brought here."""
        if not self.nonfinite:
            return  # no record to read: the happy path touches no store
        for rank in self.board.peers:
            if rank in self._peer_steps:
                continue
            record = self.board.read("nonfinite", rank)
            if record is None:
                continue
            self._peer_steps[rank] = record["step"]
            if self._nonfinite_step is not None and self._nonfinite_step < record["step"]:
                continue  # this rank's came first: it said so
            own = "" if self._nonfinite_step == record["step"] else \
                " This rank's own local gradients were finite then."
            _warn_came_from(self.board.rank, rank, record, own)

    # ---- the bypassed wrapper, and the backward's fingerprint ------------------------------
    def accumulated(self, index: int) -> None:
        """Autograd accumulated a parameter's ``.grad`` (once per parameter and backward)."""
        # One id per backward (autograd "graph task"): the first parameter of each backward
        # decides; torch.autograd.grad never accumulates into .grad, so it never gets here.
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        self._task = task
        model = self._model()
        if model is None:
            return
        forwards, self._forwards = self._forwards, 0
        step = model.reducer.step
        if step.expect_hooks:
            if self.fingerprints is not None:
                self.fingerprints.backward(step.num_iterations)
            return
        if forwards == 0 and not self._bypass_told:
            self._bypass_told = True
            name = model.reducer.names[index]
            text = (f"mini_ddp: rank {self.board.rank}: a backward put gradients into the "
                    f"wrapped model's parameters ('{name}', …) but no forward through "
                    "DataParallelModel preceded it: the training forward bypasses the wrapper "
                    "(model.module(x), or the inner module kept under another name). Those "
                    "gradients are never averaged — this rank trains alone, and the other "
                    "ranks wait for its collectives. Call model(x) to train; model.module(x) "
                    "only to evaluate, under torch.no_grad(). See docs/debugging.md.")
            if self.on_mistake is not None:
                self.on_mistake(text)
            if not self.strict:
                logger.warning("%s", text)
                return
            self.board.post("verdict", text)
            raise WrapperBypassedError(text)


class NonFiniteSentinel:
    """By default: where a NaN/Inf came from, from one small gradient per backward.

    A bad batch, a NaN loss or an overflow in the forward makes *every* local gradient
    non-finite, the output layer's first among them. So one parameter is watched: the last
    registered one of at most :data:`SENTINEL_MAX_NUMEL` elements (an output layer's bias, in
    most models), whose gradient autograd computes near the start of backward. Its passive
    tensor hook tests it with ``torch.isfinite(grad).all()``: on the host at once, before the
    gradient's bucket launches; on a GPU the result is read at a later forward, once the kernel
    has run (no device sync on the training path). A non-finite one is posted on the
    :class:`~mini_ddp.checks.rank_board.RankBoard` — the only store traffic, and only then — and
    the rank names where it came from: at once when a peer's record of an earlier step is up
    (it is: the peer posted it before a launch this rank's all-reduces waited for), else at the
    next forward, once every peer's record of the same step is up: this rank alone — "holds
    NaN in the backward of step 3, before the all-reduce" —, an earlier rank — "came from rank
    1" —, or every rank at once (the weights were already non-finite: not one rank's batch). A NaN that starts deeper in backward
    and never reaches the watched gradient is named only by the debug switch's per-gradient
    check (:class:`GradWatch`), which replaces this one there. A warning, never an error.
    """

    def __init__(self, model: Any, board: Any):
        self._model = weakref.ref(model)
        self.board = board
        reducer = model.reducer
        small = [i for i, p in enumerate(reducer.params) if p.numel() <= SENTINEL_MAX_NUMEL]
        self.index = small[-1] if small else len(reducer.params) - 1
        self.name = reducer.names[self.index]
        self._pending: tuple[int, torch.Tensor, torch.Tensor, Any] | None = None
        self._found: tuple[int, str] | None = None  # (step, kind) posted, not yet named
        self._told = False
        self._handle = reducer.params[self.index].register_hook(
            passive_hook(functools.partial(_sentinel_grad, weakref.ref(self))))

    def remove(self) -> None:
        """Take the hook off."""
        self._handle.remove()

    def local_grad(self, grad: torch.Tensor) -> None:
        """The watched parameter's local gradient in a backward (its tensor hook)."""
        model = self._model()
        if model is None or self._told or self._found is not None or grad is None \
                or grad.is_sparse \
                or not model.reducer.step.expect_hooks:
            return  # gone, said, or not a synchronised backward (no_sync, a bare backward)
        step = model.reducer.step.num_iterations
        if not grad.is_cuda:  # on the host the test is done at once, before any launch
            if not bool(torch.isfinite(grad).all()):
                self._found_at(step, "NaN" if bool(torch.isnan(grad).any()) else "Inf")
            return
        ready = torch.cuda.Event()  # read at a later forward, once the kernels ran: no sync
        ready.record()
        self._pending = (step, torch.isfinite(grad).all(), torch.isnan(grad).any(), ready)

    def forward(self) -> None:
        """At each forward: read a result left on the device; name the origin once every
        peer's record of its step is up."""
        if self._told:
            return
        if self._found is not None:
            self._name_origin(final=True)
        elif self._pending is not None and self._pending[3].query():
            self._read_pending()

    def _read_pending(self) -> None:
        step, finite, nan, _ = self._pending
        self._pending = None
        if not bool(finite):
            self._found_at(step, "NaN" if bool(nan) else "Inf")

    def _found_at(self, step: int, kind: str) -> None:
        self._found = (step, kind)
        self.board.post("nonfinite", {"step": step, "param": self.name, "kind": kind})
        self._name_origin(final=False)

    def _name_origin(self, final: bool) -> None:
        """Say where the NaN/Inf came from. Not ``final``: only if a peer's record of an
        earlier step is already up (it is, if there is one); else at the next forward."""
        step, kind = self._found
        records = {self.board.rank: {"step": step, "param": self.name, "kind": kind}}
        for rank in self.board.peers:
            record = self.board.read("nonfinite", rank)
            if record is not None:
                records[rank] = record
        first = min(r["step"] for r in records.values())
        if not final and first == step:
            return  # a peer's record of this same step may not be up yet
        self._told = True
        origin = sorted(rank for rank, r in records.items() if r["step"] == first)
        me = self.board.rank
        if origin == [me]:
            logger.warning(
                "mini_ddp: rank %d: the local gradient of '%s' holds %s in the backward of "
                "step %d, before the all-reduce, and no other rank's did: it comes from this "
                "rank's batch or forward (a bad sample, a log of zero, an overflow); the "
                "all-reduce spreads it to every rank. See docs/debugging.md.",
                me, self.name, kind, step)
        elif len(origin) == 1:
            _warn_came_from(me, origin[0], records[origin[0]],
                           f" This rank's own local gradient of '{self.name}' was finite then.")
        else:
            logger.warning(
                "mini_ddp: rank %d: ranks %s all computed a local gradient of '%s' holding "
                "%s in the backward of step %d, before the all-reduce: not one rank's batch — "
                "the weights were already non-finite, or every rank's data or loss is. "
                "%s checks each gradient to find where it started. See docs/debugging.md.",
                me, origin, self.name, kind, first, DEBUG_HINT)


def _warn_came_from(me: int, rank: int, record: dict[str, Any], own: str) -> None:
    """Say on rank ``me`` that the NaN/Inf of ``record`` (a peer's "nonfinite" post) came from
    ``rank``; ``own``: what this rank's own gradients were then ("" if not known)."""
    logger.warning(
        "mini_ddp: rank %d: the %s in every rank's gradients since step %d came from rank %d: "
        "its local gradient of '%s' held %s before the all-reduce.%s See docs/debugging.md.",
        me, record["kind"], record["step"], rank, record["param"], record["kind"], own)


def _sentinel_grad(sentinel_ref: weakref.ref, grad: torch.Tensor) -> None:
    sentinel = sentinel_ref()
    if sentinel is not None:
        sentinel.local_grad(grad)


def _local_grad(watch_ref: weakref.ref, index: int, grad: torch.Tensor) -> None:
    watch = watch_ref()
    if watch is not None:
        watch.local_grad(index, grad)


def _accumulated(watch_ref: weakref.ref, index: int, _param: torch.Tensor) -> None:
    watch = watch_ref()
    if watch is not None:
        watch.accumulated(index)

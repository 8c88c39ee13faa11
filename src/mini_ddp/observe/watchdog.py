"""The stall report: when gradient sync stops, every rank says where and who is missing.

The classic DDP hang: on one rank a parameter gets no gradient (its branch was skipped, its
output left out of the loss). That rank's bucket never fills, so it never launches that
bucket's all-reduce (nor any later one); its backward simply returns, and only its *next*
forward raises. Every other rank launched the bucket and now waits for a partner that will
never come — with torch DDP, for the process group's timeout (torch's default: 30 minutes), with no word on why.

``StallWatchdog(model, limit_s=60)`` makes each rank leave marks in the process group's store
(the key-value store every rank already shares): which step it is in and how many buckets it
launched, and — the moment its backward ends with buckets unlaunched — which of its parameters
got no gradient. A rank that waits longer than ``limit_s`` for a collective (or sees it fail
because the peer died) reads everyone's marks and raises :class:`StallError` with a report
naming the rank and the parameters; the rank at fault raises the same report at its next
forward. With ``action="warn"`` the report is logged and waiting goes on (for up to
``sync_timeout_s`` more, then :class:`~mini_ddp.errors.GradSyncTimeout`).

Built on :class:`mini_ddp.watch.stall.StallMonitor`, the warning every model has by default
(``stall_warning_s``): that one marks only once a wait is slow, so it can name a rank that has
not arrived but not the parameters it never produced. The watchdog replaces it while installed
and puts it back on ``remove()``.

Cost when installed: a store write per bucket launch and per step (each run off the
training thread with a deadline: :func:`mini_ddp.watch.bounded_store.bounded_store_call`);
nothing when not installed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.autograd import Variable

from mini_ddp.errors import MiniDDPError
from mini_ddp.observe.tracing import attach, detach
from mini_ddp.watch.bounded_store import StoreUnanswered
from mini_ddp.watch.stall import StallMonitor, StallReport, holds_up

__all__ = ["StallError", "StallReport", "StallWatchdog", "holds_up"]

logger = logging.getLogger("mini_ddp")


class StallError(MiniDDPError):
    """Gradient synchronisation stalled or failed; ``report`` says where and who."""

    def __init__(self, report: StallReport):
        self.report = report
        super().__init__(str(report))


class StallWatchdog(StallMonitor):
    """Watch ``model``'s gradient sync; report stalls longer than ``limit_s`` seconds.

    Does nothing until :meth:`install` (or ``with StallWatchdog(model):``).
    """

    eager_marks = True

    def __init__(self, model: Any, limit_s: float = 60.0, action: str = "raise",
                 store: Any = None):
        if action not in ("raise", "warn"):
            raise ValueError(f"mini_ddp: StallWatchdog action must be 'raise' or 'warn', "
                             f"got {action!r}")
        super().__init__(model.reducer, model.process_group, limit_s, store)
        self.model, self.action = model, action
        self._callback_step = -1
        self._store_warned = False

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> StallWatchdog:
        """Start watching (idempotent); returns self."""
        if self.reducer.on_stall != self.on_stall:
            attach(self.reducer, self)
            super().install()
        return self

    def remove(self) -> None:
        """Stop watching; the model's default stall warning (if any) is back."""
        detach(self.reducer, self)
        super().remove()

    # ---- marks (the reducer's trace events) -------------------------------------------------
    def record(self, kind: str, **info: Any) -> None:
        """Trace-event entry point: leave marks; catch an unfinished backward at once."""
        r = self.reducer
        if kind == "launched":
            self._mark("backward", launched=info["bucket"] + 1)
        elif kind == "hook" and self._callback_step != r.step.num_iterations:
            # First gradient of this backward: check, when backward ends, that every bucket
            # launched. That is the earliest moment a rank can know it will stall the others.
            self._callback_step = r.step.num_iterations
            Variable._execution_engine.queue_callback(self._backward_ended)
        elif kind == "finalized":
            self._mark("finalized", launched=len(r.layout.buckets))
        elif kind == "forward_start" and r.step.require_finalize and torch.is_grad_enabled():
            try:
                report = self.report(None, None)  # the engine would raise too: say why first
            except StoreUnanswered:
                return  # the engine's own error follows, without the marks
            self.act(report, None)

    def _mark(self, state: str, **info: Any) -> None:
        """Leave a mark; a store that does not take it costs one log line (the first time),
        never the step: while it stays stuck, later marks fail at once."""
        try:
            self.publish(state, **info)
        except StoreUnanswered as problem:
            if not self._store_warned:
                self._store_warned = True
                logger.warning("mini_ddp: rank %d's stall watchdog cannot leave its marks: %s "
                               "(training goes on; reports will lack this rank's progress)",
                               self.reducer.rank, problem)

    def _backward_ended(self) -> None:
        if self.reducer.step.next_bucket < len(self.reducer.layout.buckets):
            self._mark("ended_unfinished", launched=self.reducer.step.next_bucket)

    # ---- the report ---------------------------------------------------------------------------
    def on_stall(self, reducer: Any, bucket: Any, error: BaseException | None) -> None:
        """Called by the reducer after ``limit_s`` without an answer, or when the collective
        failed (a dead peer). Our own marks first, so other ranks' reports include them. Made
        in the waiting thread (so that ``action="raise"`` raises there), every store call
        bounded: a store that does not answer costs one log line and the wait goes on."""
        if error is not None:
            self.failed(bucket)
        try:
            self.publish("failed" if error else "waiting", launched=reducer.step.next_bucket,
                         waiting_for=None if bucket is None else bucket.index)
            report = self.report(bucket, error)
        except StoreUnanswered as problem:
            logger.warning("mini_ddp: rank %d's stall watchdog could not read the ranks' "
                           "marks: %s: no stall report this time", reducer.rank, problem)
            return
        self.diagnose(report)  # the late ranks' stacks (not a dead peer's), and the dumps
        self.act(report, error)

    def act(self, report: StallReport, error: BaseException | None) -> None:
        """Raise :class:`StallError`, or (``action="warn"``) log it and let the wait go on."""
        if self.action == "raise":
            raise StallError(report) from error
        super().act(report, error)

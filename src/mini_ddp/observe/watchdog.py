"""The stall report: when gradient sync stops, every rank says where and who is missing.

The classic DDP hang: on one rank a parameter gets no gradient (its branch was skipped, its
output left out of the loss). That rank's bucket never fills, so it never launches that
bucket's all-reduce (nor any later one); its backward simply returns, and only its *next*
forward raises. Every other rank launched the bucket and now waits for a partner that will
never come — with torch DDP, for the process group's 30-minute timeout, with no word on why.

``StallWatchdog(model, limit_s=60)`` makes each rank leave marks in the process group's store
(the key-value store every rank already shares): which step it is in and how many buckets it
launched, and — the moment its backward ends with buckets unlaunched — which of its parameters
got no gradient. A rank that waits longer than ``limit_s`` for a collective (or sees it fail
because the peer died) reads everyone's marks and raises :class:`StallError` with a report
naming the rank and the parameters; the rank at fault raises the same report at its next
forward. With ``action="warn"`` the report is logged and waiting goes on (for up to
``sync_timeout_s`` more, then :class:`~mini_ddp.errors.GradSyncTimeout`).

Cost when installed: a store write per bucket launch and per step; nothing when not installed.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from mini_ddp.errors import MiniDDPError
from mini_ddp.observe.tracing import attach, detach

logger = logging.getLogger("mini_ddp")
_SESSIONS = itertools.count()  # same sequence on every rank: watchdogs are made in lockstep


@dataclass
class StallReport:
    """What one rank knows when sync stalls: its own state and every rank's marks."""

    rank: int
    world_size: int
    step: int
    waiting_for: int | None  # bucket index (None: not waiting, or the unused-parameter map)
    waiting_params: list[str]
    waited_s: float
    error: str | None
    pending_buckets: list[int]  # buckets not yet launched here
    missing_params: list[str]  # parameters without a gradient here this step
    marks: dict[int, dict | None] = field(default_factory=dict)
    culprits: dict[int, str] = field(default_factory=dict)  # rank -> why it holds things up

    def __str__(self) -> str:
        head = f"mini_ddp stall report from rank {self.rank} (step {self.step}): "
        if self.waiting_for is not None:
            shown = ", ".join(self.waiting_params[:6]) + (", …" if len(self.waiting_params) > 6
                                                          else "")
            why = "failed" if self.error else f"has not finished after {self.waited_s:.1f} s"
            head += f"the all-reduce of bucket {self.waiting_for} ({shown}) {why}"
        else:
            head += "this rank's last backward ended with buckets it never launched"
        lines = [head + "."]
        if self.error:
            lines.append(f"  the collective failed with: {self.error.splitlines()[0][:300]}")
        if self.missing_params:
            lines.append(f"  rank {self.rank}: no gradient for {', '.join(self.missing_params)};"
                         f" buckets never launched: {self.pending_buckets}")
        for rank, why in sorted(self.culprits.items()):
            lines.append(f"  rank {rank}: {why}")
        reached = [r for r in range(self.world_size) if r not in self.culprits and r != self.rank]
        if reached and self.waiting_for is not None:
            lines.append(f"  ranks that reached bucket {self.waiting_for}: {reached}")
        lines.append("  A parameter with no gradient on some rank means its branch was skipped or "
                     "its output left out of the loss there: use it on every rank, or pass "
                     "find_unused_parameters=True.")
        return "\n".join(lines)


class StallError(MiniDDPError):
    """Gradient synchronisation stalled or failed; ``report`` says where and who."""

    def __init__(self, report: StallReport):
        self.report = report
        super().__init__(str(report))


class StallWatchdog:
    """Watch ``model``'s gradient sync; report stalls longer than ``limit_s`` seconds."""

    def __init__(self, model: Any, limit_s: float = 60.0, action: str = "raise",
                 store: Any = None):
        if action not in ("raise", "warn"):
            raise ValueError(f"mini_ddp: StallWatchdog action must be 'raise' or 'warn', "
                             f"got {action!r}")
        self.model, self.reducer = model, model.reducer
        self.limit_s, self.action = limit_s, action
        group = getattr(model.process_group, "group_name", "default")
        self.store = store or dist.PrefixStore(
            f"mini_ddp/observe/watchdog/{group}/{next(_SESSIONS)}",
            dist.distributed_c10d._get_default_store())
        self._callback_step = -1

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> StallWatchdog:
        """Start watching (idempotent); returns self."""
        if self.reducer.on_stall is not self._on_stall:
            attach(self.reducer, self)
            self.reducer.on_stall, self.reducer.stall_after_s = self._on_stall, self.limit_s
        return self

    def remove(self) -> None:
        """Stop watching; the reducer is back on its zero-cost path."""
        detach(self.reducer, self)
        if self.reducer.on_stall is self._on_stall:
            self.reducer.on_stall, self.reducer.stall_after_s = None, None

    def __enter__(self) -> StallWatchdog:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- marks (the reducer's trace events) -------------------------------------------------
    def record(self, kind: str, **info: Any) -> None:
        """Trace-event entry point: leave marks; catch an unfinished backward at once."""
        r = self.reducer
        if kind == "launched":
            self._publish("backward", launched=info["bucket"] + 1)
        elif kind == "hook" and self._callback_step != r.num_iterations:
            # First gradient of this backward: check, when backward ends, that every bucket
            # launched. That is the earliest moment a rank can know it will stall the others.
            self._callback_step = r.num_iterations
            Variable._execution_engine.queue_callback(self._backward_ended)
        elif kind == "finalized":
            self._publish("finalized", launched=len(r.buckets))
        elif kind == "forward_start" and r.require_finalize and torch.is_grad_enabled():
            report = self._report(None, None)  # the engine would raise too: say why first
            self._act(report, None)

    def _backward_ended(self) -> None:
        if self.reducer.next_bucket < len(self.reducer.buckets):
            self._publish("ended_unfinished", launched=self.reducer.next_bucket)

    def _publish(self, state: str, launched: int, **extra: Any) -> None:
        r = self.reducer
        mark = {"step": r.num_iterations, "state": state, "launched": launched,
                "buckets": len(r.buckets), "time": time.time(), **extra}
        if state in ("ended_unfinished", "waiting", "failed"):
            mark["missing"] = self._missing()
            mark["pending"] = [b.index for b in r.buckets[r.next_bucket:]]
        self.store.set(f"rank{r.rank}", json.dumps(mark))

    def _missing(self) -> list[str]:
        r = self.reducer
        return [r.names[i] for i in range(len(r.params)) if i not in r.ready]

    # ---- the report ---------------------------------------------------------------------------
    def _on_stall(self, reducer: Any, bucket: Any, error: BaseException | None) -> None:
        # Called by Reducer._wait: after limit_s without an answer, or when the collective
        # failed (a dead peer). Our own marks first, so other ranks' reports include them.
        self._publish("failed" if error else "waiting", launched=reducer.next_bucket,
                      waiting_for=None if bucket is None else bucket.index)
        self._act(self._report(bucket, error), error)

    def _act(self, report: StallReport, error: BaseException | None) -> None:
        if self.action == "raise":
            raise StallError(report) from error
        logger.warning("%s", report)

    def _report(self, bucket: Any, error: BaseException | None) -> StallReport:
        r = self.reducer
        marks = {}
        for rank in range(r.world_size):
            key = f"rank{rank}"
            marks[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        index = None if bucket is None else bucket.index
        report = StallReport(
            r.rank, r.world_size, r.num_iterations, index,
            [] if bucket is None else [r.names[i] for i in bucket.param_indices],
            self.limit_s if error is None and bucket is not None else 0.0,
            None if error is None else f"{type(error).__name__}: {error}",
            [b.index for b in r.buckets[r.next_bucket:]], self._missing(), marks)
        for rank, mark in marks.items():
            if rank != r.rank:
                why = _holds_up(mark, r.num_iterations, index)
                if why:
                    report.culprits[rank] = why
        return report


def _holds_up(mark: dict | None, step: int, bucket: int | None) -> str | None:
    """Why a rank with ``mark`` keeps bucket ``bucket`` of ``step`` from finishing (or None)."""
    if mark is None:
        return "left no mark: it has not launched any bucket since the watchdog started"
    ago = f"{time.time() - mark['time']:.1f} s ago"
    if mark["step"] < step:
        return f"is behind, still in step {mark['step']} ({mark['state']}, {ago})"
    if mark["step"] > step:
        return None
    if mark["state"] == "ended_unfinished" or (mark.get("missing") and mark["state"] != "waiting"):
        return (f"its backward of step {step} ended without a gradient for "
                f"{', '.join(mark['missing'])}, so it never launched buckets {mark['pending']} "
                f"(it launched {mark['launched']} of {mark['buckets']}; marked {ago})")
    if bucket is not None and mark["launched"] <= bucket:
        return (f"has launched {mark['launched']} of {mark['buckets']} buckets, not yet bucket "
                f"{bucket}: its backward is still running or stuck ({mark['state']}, {ago})")
    return None

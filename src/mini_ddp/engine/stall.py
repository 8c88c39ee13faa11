"""The stall warning: when a wait for a bucket drags on, name the ranks that have not arrived.

``DataParallelModel`` installs a :class:`StallMonitor` by default (``stall_warning_s=60``).
When the end of backward has waited ``stall_warning_s`` for one bucket's collective, the
waiting rank writes a mark into the process group's store (the key-value store every rank
already shares: which step, which bucket, how far it got), gives the other ranks a moment to
do the same, and logs a WARNING on the ``"mini_ddp"`` logger naming the bucket, its
parameters, and every rank that left no mark for this step — the rank that is slow or stuck.
Then it keeps waiting: a slow rank that arrives late costs a log line, not the job (torch DDP
waits for the process group's timeout, and so does ``sync_timeout_s`` by default).

This is Horovod's stall check, without its coordinator: each waiting rank asks the store.
It then asks each late rank *where* it is — its Python stacks, answered by the rank's stack
responder thread (:class:`mini_ddp.engine.stacks.StackResponder`) through the same store — and puts
them in the report, or says the rank did not answer (native code holding the GIL, or dead).
Every rank involved writes its flight recorder dump (:class:`mini_ddp.engine.flight_log.FlightLog`), for
``python -m mini_ddp doctor DIR``.

Cost on the happy path: nothing per step — no collective, no store access; the store is used
only once a wait has passed the limit (or ``sync_timeout_s`` has:
:meth:`StallMonitor.on_timeout` asks the late ranks too). Installing starts the responder (one
daemon thread blocked in one ``store.wait`` on its own connection) and the flight log (a
``deque.append`` per collective). :class:`mini_ddp.observe.watchdog.StallWatchdog` builds on
this class: it leaves marks at every bucket launch (so the report can say which parameters a
rank never produced) and can raise instead of warn.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mini_ddp.engine.flight_log import FlightLog, install_dump_signal
from mini_ddp.engine.stacks import (
    ANSWER_S,
    TIMEOUT_ANSWER_S,
    StackResponder,
    ask_stacks,
    describe_answer,
    start_responder,
)

logger = logging.getLogger("mini_ddp")


_SESSIONS = itertools.count()  # same sequence on every rank: monitors are made in lockstep
ARRIVAL_GRACE_S = 2.0
"""How long a waiting rank gives its peers to leave their marks before naming those that did
not: ranks that launched the bucket a little later reach the limit a little later too."""
MAX_ASKED = 4
"""Late ranks asked for their stacks per report (the lowest ranks): the store load of a report
stays bounded however many ranks are late, and four stacks are as many as a reader follows."""


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
    stacks: dict[int, dict] = field(default_factory=dict)  # rank -> its answer (StackResponder)

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
            if rank in self.stacks:
                lines.append(describe_answer(rank, self.stacks[rank]))
        reached = [r for r in range(self.world_size) if r not in self.culprits and r != self.rank]
        if reached and self.waiting_for is not None:
            lines.append(f"  ranks that reached bucket {self.waiting_for}: {reached}")
        if self.missing_params or any("without a gradient" in w for w in self.culprits.values()):
            lines.append("  A parameter with no gradient on some rank means its branch was "
                         "skipped or its output left out of the loss there: use it on every "
                         "rank, or pass find_unused_parameters=True.")
        elif self.culprits:
            lines.append("  A rank that has not reached the bucket is still computing or is "
                         "stuck before it (data loading, a rank-dependent branch, a deadlock "
                         "in user code); this rank keeps waiting for it.")
        return "\n".join(lines)


def holds_up(mark: dict | None, step: int, bucket: int | None) -> str | None:
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


class StallMonitor:
    """Log a :class:`StallReport` when a wait for a bucket passes ``limit_s`` seconds.

    Marks are written only once a wait is slow (see the module docstring); ``install()`` puts
    the monitor on the reducer's stall seam, ``remove()`` puts back what was there.
    """

    eager_marks = False
    """Whether every rank marks its progress at each bucket launch (the watchdog does): then
    no grace is needed, and a rank without a mark has launched nothing since it started."""

    def __init__(self, reducer: Any, process_group: Any, limit_s: float = 60.0,
                 store: Any = None):
        # Weak: the reducer's stall seam holds this monitor (its bound on_stall), so a strong
        # reference back would be a cycle that keeps a dropped model's reducer — and its
        # AccumulateGrad hooks — alive until a garbage collection (torch DDP frees at once).
        try:
            self._reducer = weakref.ref(reducer)
        except TypeError:  # a stand-in that cannot be weakly referenced (tests, tools)
            self._reducer = lambda: reducer
        self.limit_s = limit_s
        group = getattr(process_group, "group_name", "default")
        self._prefix = f"mini_ddp/stall/{group}/{next(_SESSIONS)}"
        self._store = store
        self._replaced: tuple[Any, float | None, Any] | None = None
        self._responder: StackResponder | None = None
        self.answer_s = ANSWER_S  # how long a report waits for a late rank's stack
        self.timeout_answer_s = TIMEOUT_ANSWER_S  # the same, when sync_timeout_s has passed

    @property
    def reducer(self) -> Any:
        """The reducer watched (None once it has been freed)."""
        return self._reducer()

    @property
    def store(self) -> Any:
        """The store where marks go (made on first use: the happy path never touches it)."""
        if self._store is None:
            self._store = dist.PrefixStore(self._prefix,
                                           dist.distributed_c10d._get_default_store())
        return self._store

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> StallMonitor:
        """Start watching (idempotent); returns self."""
        r = self.reducer
        if r.on_stall != self.on_stall:
            self._replaced = (r.on_stall, r.stall_after_s, getattr(r, "on_timeout", None))
            r.on_stall, r.stall_after_s = self.on_stall, self.limit_s
            r.on_timeout = self.on_timeout
            self._start_flight_log_and_responder()
        return self

    def _start_flight_log_and_responder(self) -> None:
        r = self.reducer
        if not hasattr(r, "layout"):
            return  # a stand-in reducer (tests of the install/remove bookkeeping)
        if getattr(r, "flight", None) is None:  # else made by the model, before its reducer
            r.flight = FlightLog.of_group(r.group, reducer=r)
        if os.environ.get("MINI_DDP_FLIGHT_SIGNAL", "") not in ("", "0"):
            # Opt-in: a process-wide signal is not a library's to take by default, and
            # faulthandler.register(SIGUSR1) — how hang stacks are usually taken — is
            # invisible to signal.getsignal, so installing would silently replace it.
            install_dump_signal()
        if self._responder is None and r.world_size > 1:
            store = self._store
            if store is None:  # a store of its own: the happy path leaves self.store unopened
                try:
                    store = dist.PrefixStore(self._prefix,
                                             dist.distributed_c10d._get_default_store())
                except (RuntimeError, ValueError):  # no default store: stacks go unasked
                    return
            # Stops when the reducer goes (the model deleted): the thread holds nothing of it.
            self._responder = start_responder(store, r.rank, r, r.flight.on_ask)

    def remove(self) -> None:
        """Stop watching; whatever watched before (the default warning, or nothing) is back."""
        r = self.reducer
        if r.on_stall == self.on_stall and self._replaced is not None:
            r.on_stall, r.stall_after_s, r.on_timeout = self._replaced
            self._replaced = None
        if self._responder is not None:
            self._responder.stop()
            self._responder = None

    def __enter__(self) -> StallMonitor:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- marks ------------------------------------------------------------------------------
    def publish(self, state: str, launched: int, **extra: Any) -> None:
        """Leave this rank's mark: its step, how many buckets it launched, and ``state``."""
        r = self.reducer
        mark = {"step": r.step.num_iterations, "state": state, "launched": launched,
                "buckets": len(r.layout.buckets), "time": time.time(), **extra}
        if state in ("ended_unfinished", "waiting", "failed"):
            mark["missing"] = self.missing()
            mark["pending"] = [b.index for b in r.layout.buckets[r.step.next_bucket:]]
        self.store.set(f"rank{r.rank}", json.dumps(mark))

    def missing(self) -> list[str]:
        """This rank's parameters that have no gradient yet in the current backward."""
        r = self.reducer
        return [r.names[i] for i in range(len(r.params)) if i not in r.step.ready]

    def marks(self) -> dict[int, dict | None]:
        """Every rank's latest mark (None: it left none)."""
        found: dict[int, dict | None] = {}
        for rank in range(self.reducer.world_size):
            key = f"rank{rank}"
            found[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return found

    # ---- the report -------------------------------------------------------------------------
    def on_stall(self, reducer: Any, bucket: Any, error: BaseException | None) -> None:
        """The reducer's stall seam: after ``limit_s`` without an answer (``error`` None), or
        when the collective failed. A failed collective is already named by the reducer: the
        flight recorder only dumps."""
        if error is not None:
            self.failed(bucket)
            self.dump(f"collective failed: {type(error).__name__}: {error}")
            return
        self.publish("waiting", launched=reducer.step.next_bucket,
                     waiting_for=None if bucket is None else bucket.index)
        report = self.report(bucket, None)
        if report is not None:
            self.diagnose(report)
            self.act(report, None)

    def on_timeout(self, reducer: Any, bucket: Any) -> tuple[str, dict[str, Any]]:
        """The reducer's timeout seam: its wait passed ``sync_timeout_s`` (whether or not a
        warning came first). Say who holds ``bucket`` up and ask them where they are now.

        Returns the lines for :class:`~mini_ddp.errors.GradSyncTimeout`'s message (after its
        own text; empty when every rank has arrived meanwhile) and the extra fields of this
        rank's flight recorder dump (``report``, ``peers``). Bounded in wall-clock time: the
        peers' grace to leave their marks (at most :data:`ARRIVAL_GRACE_S`), then
        :attr:`timeout_answer_s` for the stacks — a rank that does not answer is said to, as in
        a warning. The store is used from a thread of its own, joined with that deadline (and
        a second more): a store call cannot be given a deadline, and a store cut off from this
        rank (a network partition) would otherwise hold the error back for the store's own
        timeout.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        worker = threading.Thread(target=lambda: found.append(self._ask_late(reducer, bucket)),
                                  name=f"mini_ddp-timeout-ask-rank{reducer.rank}", daemon=True)
        worker.start()
        limit = min(self.limit_s, ARRIVAL_GRACE_S) + self.timeout_answer_s + 1.0
        worker.join(limit)
        if not found:
            return (f"  The late ranks could not be asked where they are: the process group's "
                    f"store did not answer within {limit:g} s.", {})
        return found[0]

    def _ask_late(self, reducer: Any, bucket: Any) -> tuple[str, dict[str, Any]]:
        try:
            self.publish("waiting", launched=reducer.step.next_bucket,
                         waiting_for=None if bucket is None else bucket.index)
            report = self.report(bucket, None)
            if report is None or not report.culprits:
                return "", {}
            self.ask(report, "timed out waiting", self.timeout_answer_s)
        except Exception:  # noqa: BLE001 - the timeout is raised in any case, with what we have
            logger.exception("mini_ddp: rank %d could not find the late ranks of its timeout",
                             reducer.rank)
            return "", {}
        lines = ["  Ranks that had not reached it when this rank gave up:"]
        for rank, why in sorted(report.culprits.items()):
            lines.append(f"  rank {rank}: {why}")
            if rank in report.stacks:
                lines.append(describe_answer(rank, report.stacks[rank]))
        text = "\n".join(lines)
        return text, {"report": text, "peers": {str(rank): answer
                                               for rank, answer in report.stacks.items()}}

    # ---- where the late ranks are -------------------------------------------------------------
    def ask(self, report: StallReport, waits: str = "waits",
            answer_s: float | None = None) -> None:
        """Ask the late ranks of ``report`` (at most :data:`MAX_ASKED`, the lowest) for their
        stacks, into ``report.stacks``, waiting ``answer_s`` (default :attr:`answer_s`) for
        them (each asked rank dumps its flight log as it answers)."""
        r = self.reducer
        late = sorted(report.culprits)[:MAX_ASKED]
        if late and report.error is None:
            what = "the unused-parameter map" if report.waiting_for is None \
                else f"bucket {report.waiting_for}"
            try:
                report.stacks = ask_stacks(self.store, late, answer_s or self.answer_s,
                                           asked_by=r.rank,
                                           why=f"rank {r.rank} {waits} for {what} of step "
                                               f"{report.step}")
            except Exception:  # noqa: BLE001 - a report without stacks beats a failed wait
                logger.exception("mini_ddp: rank %d could not ask ranks %s for their stacks",
                                 r.rank, late)

    def diagnose(self, report: StallReport) -> None:
        """Ask the late ranks for their stacks (:meth:`ask`), into ``report``; then dump this
        rank's flight log (the asked ranks dump theirs as they answer)."""
        self.ask(report)
        text = str(report)
        self.dump(f"stall warning: {text.splitlines()[0]}", report=text,
                  peers={str(rank): answer for rank, answer in report.stacks.items()})

    def failed(self, bucket: Any) -> None:
        """Mark ``bucket``'s collective failed in the flight log."""
        flight = getattr(self.reducer, "flight", None)
        if flight is not None and bucket is not None:
            flight.completed(bucket.index, state="failed")

    def dump(self, reason: str, **extra: Any) -> None:
        """Write this rank's flight recorder dump (nothing without a flight log)."""
        flight = getattr(self.reducer, "flight", None)
        if flight is not None:
            flight.dump(reason, **extra)

    def act(self, report: StallReport, error: BaseException | None) -> None:
        """Tell the user: a WARNING on the ``"mini_ddp"`` logger."""
        logger.warning("%s", report)

    def report(self, bucket: Any, error: BaseException | None) -> StallReport | None:
        """Read every rank's marks and say who holds ``bucket`` up (None: nobody any more)."""
        r = self.reducer
        index = None if bucket is None else bucket.index
        marks = self.marks()
        if not self.eager_marks and error is None:
            # Peers mark only when their own wait passes the limit: give them a moment, and
            # stop early once they all have (or the collective finished: no stall to report).
            deadline = time.monotonic() + min(self.limit_s, ARRIVAL_GRACE_S)
            while not all(m is not None and m["step"] >= r.step.num_iterations
                          for m in marks.values()) and time.monotonic() < deadline:
                if bucket is not None and bucket.future is not None and bucket.future.done():
                    return None
                time.sleep(0.05)
                marks = self.marks()
        report = StallReport(
            r.rank, r.world_size, r.step.num_iterations, index,
            [] if bucket is None else [r.names[i] for i in bucket.param_indices],
            self.limit_s if error is None and bucket is not None else 0.0,
            None if error is None else f"{type(error).__name__}: {error}",
            [b.index for b in r.layout.buckets[r.step.next_bucket:]], self.missing(), marks)
        for rank, mark in marks.items():
            if rank == r.rank:
                continue
            if not self.eager_marks and (mark is None or mark["step"] < r.step.num_iterations):
                what = "the unused-parameter map" if index is None else f"bucket {index}"
                report.culprits[rank] = (
                    f"has not reached {what} of step {r.step.num_iterations}: it is slow or stuck "
                    f"before it (no mark from it within {min(self.limit_s, ARRIVAL_GRACE_S):g}"
                    " s of this one)")
                continue
            why = holds_up(mark, r.step.num_iterations, index)
            if why:
                report.culprits[rank] = why
        return report

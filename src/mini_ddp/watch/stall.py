"""The stall warning: when a wait for a bucket drags on, name the ranks that have not arrived.

``DataParallelModel`` installs a :class:`StallMonitor` by default (``stall_warning_s=60``).
When the end of backward has waited ``stall_warning_s`` for one bucket's collective, the
waiting rank writes a mark into the process group's store (the key-value store every rank
already shares: which step, which bucket, how far it got), gives the other ranks a moment to
do the same, and logs a WARNING on the ``"mini_ddp"`` logger naming the bucket, its
parameters, and every rank that left no mark for this step — the rank that is slow or stuck.
Then it keeps waiting: a slow rank that arrives late costs a log line, not the job (torch DDP
waits for the process group's timeout, and so does ``sync_timeout_s`` by default).

The report runs in a thread of its own, from a snapshot of the rank's state taken as the wait
passes the limit, and every store call it makes has a deadline
(:func:`mini_ddp.watch.bounded_store.bounded_store_call`): the wait, its deadline and training
go on exactly as without the warning, and a store that is slow, frozen or gone costs one log
line ("the rendezvous store did not answer within 2 s: no stall report this time"). As each
rank's models are watched, the rank also leaves a mark as it finishes
(:mod:`mini_ddp.watch.peers`), so that a peer that finished is not reported as dead.

The buffer broadcast before a forward is watched too (:meth:`StallMonitor.on_slow_broadcast`):
a late rank inside a collective of the user's own can never pair with it (uneven inputs, a
collective on one rank), and the waiting rank raises
:class:`~mini_ddp.errors.SyncMismatchError` naming it, instead of waiting on.

This is Horovod's stall check, without its coordinator: each waiting rank asks the store.
It then asks each late rank *where* it is — its Python stacks, answered by the rank's stack
responder thread (:class:`mini_ddp.watch.stacks.StackResponder`) through the same store — and puts
them in the report, or says the rank did not answer (native code holding the GIL, or dead).
Every rank involved writes its flight recorder dump (:class:`mini_ddp.watch.flight_log.FlightLog`), for
``python -m mini_ddp doctor DIR``.

Cost on the happy path: nothing per step — no collective, no store access; the store is used
only once a wait has passed the limit (or ``sync_timeout_s`` has:
:meth:`StallMonitor.on_timeout` asks the late ranks too). Installing starts the responder (one
daemon thread blocked in one ``store.wait`` on its own connection) and the flight log (a
``deque.append`` per collective).

The stall report, opt-in: :class:`StallWatchdog` builds on the same monitor. The stall report: when gradient sync stops, every rank says where and who is missing.

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

Built on :class:`StallMonitor`, the warning every model has by default
(``stall_warning_s``): that one marks only once a wait is slow, so it can name a rank that has
not arrived but not the parameters it never produced. The watchdog replaces it while installed
and puts it back on ``remove()``.

Cost when installed: a store write per bucket launch and per step (each run off the
training thread with a deadline: :func:`mini_ddp.watch.bounded_store.bounded_store_call`);
nothing when not installed.

Every model wears the warning: :func:`attach_stall_warning` is registered with the engine's
observer registry (:mod:`mini_ddp.engine.observer`) when this module is imported.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.autograd import Variable

from mini_ddp.engine import observer
from mini_ddp.errors import MiniDDPError, SyncMismatchError
from mini_ddp.watch.bounded_store import (
    STORE_CALL_S,
    StoreUnanswered,
    bounded_store_call,
    default_store,
    group_key_space,
)
from mini_ddp.watch.flight_log import FlightLog, install_dump_signal
from mini_ddp.watch.peers import PeerState, peer_states, watch
from mini_ddp.watch.stacks import (
    ANSWER_S,
    NOT_ASKED,
    TIMEOUT_ANSWER_S,
    StackResponder,
    ask_stacks,
    describe_answer,
    elsewhere_verdict,
    extra_forward,
    start_responder,
)

logger = logging.getLogger("mini_ddp")


ARRIVAL_GRACE_S = 2.0
"""How long a waiting rank gives its peers to leave their marks before naming those that did
not: ranks that launched the bucket a little later reach the limit a little later too."""
FINISH_GRACE_S = 3.0
"""How long a rank whose collective failed waits for the peers without a finish mark to leave
one before it dumps: a rank that finished frees its model (closing its connections) a moment
before its exit writes the mark."""
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
        late, named = self.late_lines()
        lines += late
        reached = [r for r in range(self.world_size) if r not in self.culprits and r != self.rank]
        if reached and self.waiting_for is not None:
            lines.append(f"  ranks that reached bucket {self.waiting_for}: {reached}")
        if self.missing_params or any("without a gradient" in w for w in self.culprits.values()):
            lines.append("  A parameter with no gradient on some rank means its branch was "
                         "skipped or its output left out of the loss there: use it on every "
                         "rank, or pass find_unused_parameters=True.")
        elif self.culprits and not named:
            lines.append("  A rank that has not reached the bucket is still computing or is "
                         "stuck before it (data loading, a rank-dependent branch, a deadlock "
                         "in user code); this rank keeps waiting for it.")
        return "\n".join(lines)

    def late_lines(self) -> tuple[list[str], bool]:
        """Each late rank's line, its stack, and what the stack proves (a late rank inside a
        forward's buffer broadcast while this rank waits for a bucket ran an extra forward:
        :func:`~mini_ddp.watch.stacks.extra_forward`); and whether a cause was named."""
        lines, named = [], False
        for rank, why in sorted(self.culprits.items()):
            lines.append(f"  rank {rank}: {why}")
            if rank in self.stacks:
                lines.append(describe_answer(rank, self.stacks[rank]))
                verdict = None if self.waiting_for is None or self.error else \
                    extra_forward(rank, self.stacks[rank], self.rank, self.step)
                if verdict:
                    lines.append(verdict)
                    named = True
        return lines, named


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
        self._prefix = group_key_space("stall", process_group)
        self._store = store
        self._replaced: tuple[Any, float | None, Any] | None = None
        self._responder: StackResponder | None = None
        self.answer_s = ANSWER_S  # how long a report waits for a late rank's stack
        self.timeout_answer_s = TIMEOUT_ANSWER_S  # the same, when sync_timeout_s has passed
        self.call_s = STORE_CALL_S  # the deadline of each store call (bounded_store_call)
        self._reporting: threading.Thread | None = None  # the slow wait's report, under way

    @property
    def reducer(self) -> Any:
        """The reducer watched (None once it has been freed)."""
        return self._reducer()

    @property
    def store(self) -> Any:
        """The store where marks go (made on first use: the happy path never touches it)."""
        if self._store is None:
            self._store = default_store(self._prefix)
        return self._store

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> StallMonitor:
        """Start watching (idempotent); returns self."""
        r = self.reducer
        if r.on_stall != self.on_stall:
            self._replaced = (r.on_stall, r.stall_after_s, getattr(r, "on_timeout", None),
                              getattr(r, "on_slow_broadcast", None))
            r.on_stall, r.stall_after_s = self.on_stall, self.limit_s
            r.on_timeout, r.on_slow_broadcast = self.on_timeout, self.on_slow_broadcast
            self._start_flight_log_and_responder()
            if hasattr(r, "layout"):  # a real reducer: its rank leaves a mark as it finishes
                watch(r)
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
            store, prefix = self._store, None
            if store is None:  # a store of its own: the happy path leaves self.store unopened
                try:
                    store, prefix = default_store(self._prefix), self._prefix
                except (RuntimeError, ValueError):  # no default store: stacks go unasked
                    return
            # Stops when the reducer goes (the model deleted): the thread holds nothing of it.
            self._responder = start_responder(store, r.rank, r, r.flight.on_ask, prefix)

    def remove(self) -> None:
        """Stop watching; whatever watched before (the default warning, or nothing) is back."""
        r = self.reducer
        if r.on_stall == self.on_stall and self._replaced is not None:
            r.on_stall, r.stall_after_s, r.on_timeout, r.on_slow_broadcast = self._replaced
            self._replaced = None
        if self._responder is not None:
            self._responder.stop()
            self._responder = None

    def __enter__(self) -> StallMonitor:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- marks ------------------------------------------------------------------------------
    def snapshot(self, bucket: Any = None) -> dict[str, Any]:
        """This rank's state now, for marks and reports made off the waiting thread: its
        step, the next bucket to launch, the parameters still without a gradient, the buckets
        not launched, and what ``bucket`` (None: the unused-parameter map) holds."""
        r = self.reducer
        buckets = r.layout.buckets
        return {"rank": r.rank, "world_size": r.world_size, "step": r.step.num_iterations,
                "next_bucket": r.step.next_bucket, "buckets": len(buckets),
                "missing": self.missing(),
                "pending": [b.index for b in buckets[r.step.next_bucket:]],
                "bucket": None if bucket is None else bucket.index,
                "params": [] if bucket is None else [r.names[i] for i in bucket.param_indices]}

    def publish(self, state: str, launched: int, now: dict[str, Any] | None = None,
                **extra: Any) -> None:
        """Leave this rank's mark: its step, how many buckets it launched, and ``state``
        (``now``: a :meth:`snapshot` taken earlier, default now). The store call has a
        deadline of :attr:`call_s`: raises :class:`StoreUnanswered` when the store does not
        take it."""
        now = self.snapshot() if now is None else now
        mark = {"step": now["step"], "state": state, "launched": launched,
                "buckets": now["buckets"], "time": time.time(), **extra}
        if state in ("ended_unfinished", "waiting", "failed"):
            mark["missing"], mark["pending"] = now["missing"], now["pending"]
        key, payload = f"rank{now['rank']}", json.dumps(mark)
        bounded_store_call(self.store, lambda s: s.set(key, payload), self.call_s,
                           "this rank's stall mark")

    def missing(self) -> list[str]:
        """This rank's parameters that have no gradient yet in the current backward."""
        r = self.reducer
        ready = set(r.step.ready)  # a copy: a report may run while backward goes on
        return [r.names[i] for i in range(len(r.params)) if i not in ready]

    def marks(self) -> dict[int, dict | None]:
        """Every rank's latest mark (None: it left none); one store call with a deadline of
        :attr:`call_s` (raises :class:`StoreUnanswered`)."""
        size = self.reducer.world_size

        def read(store: Any) -> dict[int, dict | None]:
            return {rank: json.loads(store.get(f"rank{rank}"))
                    if store.check([f"rank{rank}"]) else None for rank in range(size)}

        return bounded_store_call(self.store, read, self.call_s, "the ranks' stall marks")

    def peer_states(self) -> dict[int, PeerState]:
        """Each rank's last known state: its finish mark when it left one
        (:func:`mini_ddp.watch.peers.peer_states`), else ``"at step S"`` from its latest
        stall mark when it left one, else ``"unknown"``. Bounded; never raises."""
        states = peer_states(group=getattr(self.reducer, "group", None))
        try:
            marks = self.marks()
        except StoreUnanswered:
            return states
        for rank, mark in marks.items():
            state = states.get(rank)
            if mark is not None and (state is None or state.state == "unknown"):
                states[rank] = PeerState(rank, "at step", mark["state"], mark["step"],
                                         time=mark["time"])
        return states

    @staticmethod
    def _settled_peer_states(reducer: Any) -> dict[int, PeerState]:
        """The peers' finish marks after a failed collective, waiting up to
        :data:`FINISH_GRACE_S` for a peer that has none yet (a finished rank's connections
        close before its mark is written; a dead rank's never comes: bounded)."""
        group = getattr(reducer, "group", None)
        deadline = time.monotonic() + FINISH_GRACE_S
        while True:
            states = peer_states(group=group)
            unknown = [r for r, state in states.items()
                       if r != reducer.rank and state.state == "unknown"]
            if not unknown or time.monotonic() >= deadline:
                return states
            time.sleep(0.1)

    # ---- the report -------------------------------------------------------------------------
    def on_stall(self, reducer: Any, bucket: Any, error: BaseException | None) -> str | None:
        """The reducer's stall seam: after ``limit_s`` without an answer (``error`` None), or
        when the collective failed. A failed collective is already named by the reducer: the
        flight recorder dumps (with what the store says of the other ranks), and when the
        backend's own timeout failed it (Gloo's "Timed out", the process group's timeout,
        which ``sync_timeout_s`` equals by default and may lose the race to), the late ranks
        are named and asked where they are as for a ``GradSyncTimeout`` (bounded the same
        way): the returned lines go into the error.

        A slow wait is reported from a thread of its own: this returns at once, so the wait,
        its deadline and training go on exactly as without the warning, whatever the store
        does (a frozen or gone store costs one log line, from that thread)."""
        if error is not None:
            self.failed(bucket)
            late, dumped = "", {}
            if "timed out" in str(error).lower():
                late, dumped = self.on_timeout(reducer, bucket)
            states = {str(rank): asdict(state) for rank, state in
                      self._settled_peer_states(reducer).items()}
            self.dump(f"collective failed: {type(error).__name__}: {error}", peer_states=states,
                      **dumped)
            return late
        if self._reporting is not None and self._reporting.is_alive():
            return None  # the report under way covers this wait too
        now = self.snapshot(bucket)
        future = None if bucket is None else bucket.future
        self._reporting = threading.Thread(
            target=self._report_slow_wait, args=(now, future),
            name=f"mini_ddp-stall-report-rank{now['rank']}", daemon=True)
        self._reporting.start()
        return None

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` for a stall report under way; True when none is left."""
        if self._reporting is not None:
            self._reporting.join(timeout_s)
        return self._reporting is None or not self._reporting.is_alive()

    def _report_slow_wait(self, now: dict[str, Any], future: Any) -> None:
        try:
            self.publish("waiting", launched=now["next_bucket"], now=now,
                         waiting_for=now["bucket"])
            report = self.report(None, None, now=now, future=future)
        except StoreUnanswered as problem:
            what = "the unused-parameter map" if now["bucket"] is None \
                else f"bucket {now['bucket']}"
            logger.warning("mini_ddp: rank %d has waited %g s for %s of step %d; %s: no stall "
                           "report this time (the wait goes on)", now["rank"], self.limit_s,
                           what, now["step"], problem)
            return
        except Exception:  # noqa: BLE001 - a thread of its own: nothing may escape it
            logger.exception("mini_ddp: rank %d could not make its stall report", now["rank"])
            return
        if report is not None and not _failed(future):
            self.diagnose(report, future)
            if not _failed(future):  # a failed one is named by the wait's own error and dump
                self.act(report, None)

    def on_slow_broadcast(self, reducer: Any, step: int) -> None:
        """The broadcast seam: the buffer broadcast before forward ``step`` has waited
        ``limit_s``. Leave this rank's mark, give the peers a moment to leave theirs, and ask
        those without one where they are — on the waiting thread: the forward is held up
        anyway, and what it finds may end it.

        A late rank inside a collective of the user's own can never pair with the broadcast
        (uneven inputs, or a collective on some ranks only): :class:`SyncMismatchError` names it
        with its line, rather than a wait for the process group's timeout. Otherwise a WARNING
        with the late ranks' stacks, and the wait goes on."""
        rank = reducer.rank
        what = f"the broadcast of the buffers before forward of step {step}"
        try:
            found = broadcast_stall(self.store, rank, reducer.world_size, step, self.limit_s,
                                    grace_s=min(self.limit_s, ARRIVAL_GRACE_S),
                                    answer_s=self.answer_s, call_s=self.call_s,
                                    group=getattr(reducer, "group", None))
        except StoreUnanswered as problem:
            logger.warning("mini_ddp: rank %d has waited %g s in %s; %s: no stall report this "
                           "time (the wait goes on)", rank, self.limit_s, what, problem)
            return
        if found is None:
            return
        text, never_pairs, answers = found
        head = text.splitlines()[0]
        self.dump(f"stall warning: {head}", report=text,
                  peers={str(r): answer for r, answer in answers.items()})
        if never_pairs:  # waiting on would only end in the process group's timeout
            raise SyncMismatchError(text)
        logger.warning("%s\n  This rank keeps waiting.", text)

    def on_timeout(self, reducer: Any, bucket: Any) -> tuple[str, dict[str, Any]]:
        """The reducer's timeout seam: its wait passed ``sync_timeout_s`` (whether or not a
        warning came first). Say who holds ``bucket`` up and ask them where they are now.

        Returns the lines for :class:`~mini_ddp.errors.GradSyncTimeout`'s message (after its
        own text; empty when every rank has arrived meanwhile) and the extra fields of this
        rank's flight recorder dump (``report``, ``peers``). Bounded in wall-clock time: the
        peers' grace to leave their marks (at most :data:`ARRIVAL_GRACE_S`), then
        :attr:`timeout_answer_s` for the stacks — a rank that does not answer is said to, as in
        a warning. Every store call has its own deadline (:attr:`call_s`), and a store that
        does not answer is named as the reason the late ranks could not be asked (at once,
        when an earlier call, e.g. a stall report's, is still waiting for it); the whole is
        joined with that deadline and a second more.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        now = self.snapshot(bucket)
        worker = threading.Thread(target=lambda: found.append(self._ask_late(now, bucket)),
                                  name=f"mini_ddp-timeout-ask-rank{reducer.rank}", daemon=True)
        worker.start()
        limit = min(self.limit_s, ARRIVAL_GRACE_S) + self.timeout_answer_s + 1.0
        worker.join(limit)
        if not found:
            return (f"  The late ranks could not be asked where they are: the rendezvous "
                    f"store did not answer within {limit:g} s.", {})
        return found[0]

    def _ask_late(self, now: dict[str, Any], bucket: Any) -> tuple[str, dict[str, Any]]:
        try:
            self.publish("waiting", launched=now["next_bucket"], now=now,
                         waiting_for=now["bucket"])
            report = self.report(None, None, now=now,
                                 future=None if bucket is None else bucket.future)
            if report is None or not report.culprits:
                return "", {}
            self.ask(report, "timed out waiting", self.timeout_answer_s)
        except StoreUnanswered as problem:
            return (f"  The late ranks could not be named: {problem}.", {})
        except Exception:  # noqa: BLE001 - the timeout is raised in any case, with what we have
            logger.exception("mini_ddp: rank %d could not find the late ranks of its timeout",
                             now["rank"])
            return "", {}
        text = "\n".join(["  Ranks that had not reached it when this rank gave up:",
                          *report.late_lines()[0]])
        return text, {"report": text, "peers": {str(rank): answer
                                               for rank, answer in report.stacks.items()}}

    # ---- where the late ranks are -------------------------------------------------------------
    def ask(self, report: StallReport, waits: str = "waits",
            answer_s: float | None = None) -> None:
        """Ask the late ranks of ``report`` (at most :data:`MAX_ASKED`, the lowest) for their
        stacks, into ``report.stacks``, waiting ``answer_s`` (default :attr:`answer_s`) for
        them (each asked rank dumps its flight log as it answers). A store that does not
        answer leaves the report without stacks, and says so in one log line."""
        late = sorted(report.culprits)[:MAX_ASKED]
        if late and report.error is None:
            what = "the unused-parameter map" if report.waiting_for is None \
                else f"bucket {report.waiting_for}"
            try:
                report.stacks = ask_stacks(self.store, late, answer_s or self.answer_s,
                                           asked_by=report.rank,
                                           why=f"rank {report.rank} {waits} for {what} of step "
                                               f"{report.step}", call_s=self.call_s)
            except StoreUnanswered as problem:
                logger.warning("mini_ddp: rank %d could not ask ranks %s for their stacks: %s: "
                               "no stacks this time", report.rank, late, problem)
            except Exception:  # noqa: BLE001 - a report without stacks beats a failed wait
                logger.exception("mini_ddp: rank %d could not ask ranks %s for their stacks",
                                 report.rank, late)

    def diagnose(self, report: StallReport, future: Any = None) -> None:
        """Ask the late ranks for their stacks (:meth:`ask`), into ``report``; then dump this
        rank's flight log (the asked ranks dump theirs as they answer) — unless ``future``, the
        collective waited for, failed meanwhile: its failure's dump is the one to keep."""
        self.ask(report)
        if _failed(future):
            return
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

    def report(self, bucket: Any, error: BaseException | None,
               now: dict[str, Any] | None = None, future: Any = None) -> StallReport | None:
        """Read every rank's marks and say who holds ``bucket`` up (None: nobody any more).

        ``now`` (a :meth:`snapshot`) and ``future`` stand for ``bucket`` when the report is
        made off the waiting thread. Raises :class:`StoreUnanswered` when the store does not
        hand the marks over in time."""
        now = self.snapshot(bucket) if now is None else now
        if future is None and bucket is not None:
            future = bucket.future
        step, index = now["step"], now["bucket"]
        marks = self.marks()
        if not self.eager_marks and error is None:
            # Peers mark only when their own wait passes the limit: give them a moment, and
            # stop early once they all have (or the collective finished: no stall to report).
            deadline = time.monotonic() + min(self.limit_s, ARRIVAL_GRACE_S)
            while not all(m is not None and m["step"] >= step
                          for m in marks.values()) and time.monotonic() < deadline:
                if _finished_well(future):
                    return None
                time.sleep(0.05)
                marks = self.marks()
        report = StallReport(
            now["rank"], now["world_size"], step, index, now["params"],
            self.limit_s if error is None and index is not None else 0.0,
            None if error is None else f"{type(error).__name__}: {error}",
            now["pending"], now["missing"], marks)
        for rank, mark in marks.items():
            if rank == now["rank"]:
                continue
            if not self.eager_marks and (mark is None or mark["step"] < step):
                what = "the unused-parameter map" if index is None else f"bucket {index}"
                report.culprits[rank] = (
                    f"has not reached {what} of step {step}: it is slow or stuck "
                    f"before it (no mark from it within {min(self.limit_s, ARRIVAL_GRACE_S):g}"
                    " s of this one)")
                continue
            why = holds_up(mark, step, index)
            if why:
                report.culprits[rank] = why
        return report


def late_ranks(store: Any, kind: str, rank: int, size: int, step: int, grace_s: float,
               call_s: float = STORE_CALL_S) -> list[int]:
    """Mark ``rank`` as waiting in ``kind`` (a wait's name: ``"broadcast"``) at ``step``, give the
    other ranks up to ``grace_s`` to leave the same mark, and return those whose mark is older
    (or missing). A mark of its own per kind: a rank in a forward's broadcast has not reached a
    bucket of the step before, whatever its step count says. Every store call has a deadline
    of ``call_s`` (raises :class:`StoreUnanswered`)."""
    key, mark = f"{kind}/rank{rank}", str(step)
    bounded_store_call(store, lambda s: s.set(key, mark), call_s, "this rank's stall mark")

    def read(s: Any) -> dict[int, int]:
        names = {r: f"{kind}/rank{r}" for r in range(size) if r != rank}
        return {r: int(s.get(k)) for r, k in names.items() if s.check([k])}

    deadline = time.monotonic() + grace_s
    marks = bounded_store_call(store, read, call_s, "the ranks' stall marks")
    while any(marks.get(r, -1) < step for r in range(size) if r != rank) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        marks = bounded_store_call(store, read, call_s, "the ranks' stall marks")
    return [r for r in range(size) if r != rank and marks.get(r, -1) < step]


def broadcast_stall(store: Any, rank: int, size: int, step: int, waited_s: float, *,
                    grace_s: float, answer_s: float, call_s: float = STORE_CALL_S,
                    can_ask: bool = True, group: Any = None
                    ) -> tuple[str, bool, dict[int, Any]] | None:
    """Rank ``rank`` has waited ``waited_s`` in the buffer broadcast before forward ``step``:
    mark it, give the peers ``grace_s`` to mark theirs (:func:`late_ranks`), ask the late ones
    (at most :data:`MAX_ASKED`) for their stacks unless ``can_ask`` is False (no stack
    responder: they are said to be unasked), and return :func:`broadcast_report`'s text and
    verdict with the answers. None: every peer has reached the broadcast. The one sequence
    DataParallelModel's stall monitor and ``mini_ddp.attach`` both run; a store that does
    not answer raises :class:`StoreUnanswered`."""
    late = late_ranks(store, "broadcast", rank, size, step, grace_s, call_s)
    if not late:
        return None
    answers = ask_stacks(store, late[:MAX_ASKED], answer_s, asked_by=rank,
                         why=f"rank {rank} waits in the buffer broadcast before forward of "
                             f"step {step}", call_s=call_s) if can_ask else {}
    text, never_pairs = broadcast_report(rank, step, waited_s, late, answers,
                                         peer_states(group=group))
    return text, never_pairs, answers


def broadcast_report(rank: int, step: int, waited_s: float, late: list[int],
                     answers: dict[int, Any], states: dict[int, PeerState]) -> tuple[str, bool]:
    """The report of rank ``rank``, held up ``waited_s`` in the buffer broadcast before forward
    ``step`` by ``late`` (their stacks ``answers``, their finish marks ``states``), and whether
    a late rank is inside a collective of the user's own: one that can never pair with the
    broadcast (:func:`~mini_ddp.watch.stacks.elsewhere_verdict`). DataParallelModel's and
    ``mini_ddp.attach``'s words."""
    lines = [f"mini_ddp: rank {rank} waited {waited_s:g} s in the broadcast of the buffers "
             f"before forward of step {step} for ranks {late}, which have not reached it."]
    never_pairs = False
    for r in late:
        if r in states and states[r].ended:
            lines.append(f"  {states[r].describe()}")
            continue
        answer = answers.get(r, NOT_ASKED)
        verdict = elsewhere_verdict(r, answer, rank, step, answer.get("step"))
        never_pairs = never_pairs or verdict is not None
        lines.append(verdict or f"  rank {r}: has not reached it: it is slow or stuck before "
                                f"it.\n{describe_answer(r, answer)}")
    return "\n".join(lines), never_pairs


def _failed(future: Any) -> bool:
    """Has ``future``'s collective failed?"""
    return future is not None and future.done() and not _finished_well(future)


def _finished_well(future: Any) -> bool:
    """Has ``future``'s collective completed with a value? (A failed one — Gloo's own timeout
    firing with the deadline — still has late ranks to name.)"""
    if future is None or not future.done():
        return False
    try:
        future.value()
    except Exception:  # noqa: BLE001 - failed: not finished well
        return False
    return True


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
        self._store_warned = False

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> StallWatchdog:
        """Start watching (idempotent); returns self."""
        if self.reducer.on_stall != self.on_stall:
            self.reducer.observers.add(self, first=True)  # its forward report comes first
            super().install()
        return self

    def remove(self) -> None:
        """Stop watching; the model's default stall warning (if any) is back."""
        self.reducer.observers.remove(self)
        super().remove()

    # ---- marks (the engine's events: mini_ddp.engine.observer) ---------------------------
    def bucket_launched(self, reducer: Any, bucket: Any) -> None:
        """A launch: this rank's mark says how far its backward got."""
        self._mark("backward", launched=bucket.index + 1)

    def backward_begun(self, reducer: Any) -> None:
        """First gradient of this backward: check, when backward ends, that every bucket
        launched. That is the earliest moment a rank can know it will stall the others."""
        Variable._execution_engine.queue_callback(self._backward_ended)

    def backward_finished(self, reducer: Any) -> None:
        """Every bucket is written back: this step is done here."""
        self._mark("finalized", launched=len(reducer.layout.buckets))

    def forward_begun(self, model: Any) -> None:
        """A forward with this rank's last backward unfinished: the engine would raise too;
        say why first."""
        if self.reducer.step.require_finalize and torch.is_grad_enabled():
            try:
                report = self.report(None, None)
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


# ---- what every model wears (mini_ddp.engine.observer's registry) ------------------------
def startup_flight_log(model: Any) -> FlightLog | None:
    """The flight log that records ``model``'s start-up broadcast: kept with the stall
    warning (None when ``stall_warning_s=None``)."""
    if model.config.stall_warning_s is None:
        return None
    return FlightLog.of_group(model.process_group)


def attach_stall_warning(model: Any) -> None:
    """The default stall warning (``stall_warning_s``) on ``model``'s reducer, with its
    flight log (the one that recorded the start-up broadcast, when there is one)."""
    reducer = model.reducer
    if model.config.stall_warning_s is None:
        model.stall_monitor = None
        return
    if reducer.flight is not None:  # made before its reducer: read its progress at dumps
        reducer.flight.watch(reducer)
    model.stall_monitor = StallMonitor(reducer, model.process_group,
                                       model.config.stall_warning_s).install()


observer.register(attach_stall_warning, recorder=startup_flight_log)

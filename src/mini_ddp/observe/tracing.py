"""Opt-in tracing of gradient synchronisation: what happened when, on every rank.

::

    with mini_ddp.observe.tracing.trace(model) as rec:          # collective: every rank enters
        for x, y in loader:
            loss_fn(model(x), y).backward()
            with rec.span("optimizer_step"):
                opt.step()
    traces = mini_ddp.observe.tracing.gather_traces(rec)         # on rank 0: one RankTrace per rank
    mini_ddp.observe.tracing.write_chrome_trace(traces, "trace.json")   # open in ui.perfetto.dev

A recorder is one more observer of the engine (:mod:`mini_ddp.engine.observer`): it hears
each point of a step (forward start/end, each parameter's gradient, a bucket becoming ready,
its launch, the end of backward, each bucket's result, the copy-back) as the engine's events
and stores them as ``(monotonic ns, kind, info)`` tuples (:meth:`TraceRecorder.record`); with
no recorder attached a step pays the no-op event calls every step pays, and one attribute test
per gradient. The real end of each collective is taken from a done-callback on its future,
because the reducer only *observes* completion later, when backward has ended. On a GPU the
callback runs as soon as the collective is queued (NCCL's futures are done at launch), so
there it records a CUDA event on the callback's stream — which torch makes wait for the
collective — and the event's device time, placed on the host clock through an anchor event
(:class:`~mini_ddp.watch.device_timer.DeviceTimer`), is the collective's end. Such an end
carries ``clock="device"``; the Chrome trace's all-reduce names its clock in ``args``.

What ran is part of the record, because mini_ddp's own fast paths are not torch DDP's: a
"setup" event (:func:`describe_setup`) names the backend, the comm hook, whether two ranks on
one host sum big buckets in shared memory, and the write-back (``copy``: torch DDP's default;
``zero-copy``: mini_ddp's opt-in, ``.grad`` becomes the bucket's view; ``bucket view``:
``gradient_as_bucket_view=True``); each "launch" event names the transport that bucket's
all-reduce went through (``shared memory``, ``Gloo``, ``NCCL`` or ``comm hook <name>``). The
Chrome trace carries both (``otherData.setup``, ``otherData.transports`` and each all-reduce's
``args.transport``), and the timeline PNG prints them under its title.

Clocks: each rank converts its monotonic clock to wall-clock time, with the pair of readings
taken right after a barrier on entry; the readings are all-gathered so the skew between ranks
is known (on one host it is only the barrier's exit jitter).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine.observer import Observer
from mini_ddp.observe.spans import Event, RankTrace, Span, spans
from mini_ddp.watch.device_timer import DeviceTimer, timer_for


class RecordingObserver(Observer):
    """The engine's events as :meth:`record` calls, under the kinds a trace keeps (see
    :mod:`mini_ddp.observe.spans`); a subclass says what ``record`` does with them."""

    def record(self, kind: str, **info: Any) -> None:
        """Keep ``kind`` (with ``info``) as of now."""
        raise NotImplementedError

    def forward_begun(self, model: Any) -> None:
        self.record("forward_start")

    def forward_ended(self, model: Any) -> None:
        self.record("forward_end")

    def gradient_ready(self, reducer: Any, index: int) -> None:
        self.record("hook", param=index)

    def bucket_ready(self, reducer: Any, bucket: Any) -> None:
        self.record("bucket_ready", bucket=bucket.index)

    def bucket_launched(self, reducer: Any, bucket: Any) -> None:
        # The future lets a recorder log when the collective really ends.
        self.record("launch", bucket=bucket.index, bytes=bucket.nbytes, future=bucket.future)

    def backward_ended(self, reducer: Any) -> None:
        self.record("finalize_start")

    def bucket_done(self, reducer: Any, bucket: Any) -> None:
        self.record("complete", bucket=bucket.index)

    def backward_finished(self, reducer: Any) -> None:
        self.record("finalized")


class TraceRecorder(RecordingObserver):
    """Collects one rank's events; attach it with :func:`trace` (or :func:`attach`)."""

    def __init__(self, rank: int = 0, param_names: list[str] | None = None,
                 reducer: Any = None, device_timer: DeviceTimer | None = None):
        self.rank = rank
        self.param_names = list(param_names or [])
        self.events: list[Event] = []
        self.offset_ns = time.time_ns() - time.monotonic_ns()
        self.skew_ns = 0
        self._reducer = reducer
        self._layout_seen: Any = None
        # Collectives whose "comm_done" is not logged yet. A future counts as done before its
        # callbacks have run (torch wakes waiters first), so without this a step's
        # "comm_done" could land after its "finalized".
        self._in_flight = 0
        self._landed = threading.Condition()
        # A CUDA model's collectives end when the device says so, not when a callback runs.
        if device_timer is None and reducer is not None and getattr(reducer, "params", None):
            device_timer = timer_for(reducer.params[0].device)
        self.device_timer = device_timer
        if device_timer is not None:
            device_timer.anchor()  # before any event, so every event lies after it

    def record(self, kind: str, **info: Any) -> None:
        """Log ``kind`` now. A ``future=`` entry is not stored: its completion is logged."""
        future = info.pop("future", None)
        if kind == "launch" and self._reducer is not None:
            info["transport"] = transport_of(self._reducer, info.get("bucket"))
        if kind == "finalized":
            with self._landed:  # every collective of the step is complete: callbacks imminent
                self._landed.wait_for(lambda: self._in_flight == 0, timeout=5.0)
        self._append(kind, info)
        if kind == "forward_end":
            self._note_layout()
        if future is not None:
            with self._landed:
                self._in_flight += 1
            future.add_done_callback(functools.partial(self._comm_done, info.get("bucket")))

    def _comm_done(self, bucket: Any, _future: Any) -> None:
        if self.device_timer is not None:  # resolved to a time by snapshot()
            self._append("comm_done", {"bucket": bucket,
                                       "device_event": self.device_timer.stamp()})
        else:
            self._append("comm_done", {"bucket": bucket})
        with self._landed:
            self._in_flight -= 1
            self._landed.notify_all()

    def mark(self, name: str, **info: Any) -> None:
        """Log an instant of your own, e.g. ``rec.mark("optimizer_step")``."""
        self._append("mark", {"name": name, **info})

    @contextmanager
    def span(self, name: str, **info: Any) -> Iterator[None]:
        """Log a duration of your own, e.g. ``with rec.span("optimizer_step"): opt.step()``."""
        self._append("span_start", {"name": name, **info})
        try:
            yield
        finally:
            self._append("span_end", {"name": name})

    def align_clock(self, group: dist.ProcessGroup | None = None) -> None:
        """Collective: read (monotonic, wall) right after a barrier; learn the ranks' skew."""
        device = self._reducer.params[0].device if self._reducer is not None else "cpu"
        dist.barrier(group=group)
        mono, wall = time.monotonic_ns(), time.time_ns()
        mine = torch.tensor([mono, wall], dtype=torch.int64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        walls = [int(t[1]) for t in everyone]
        self.offset_ns = wall - mono
        self.skew_ns = max(walls) - min(walls)

    def snapshot(self) -> RankTrace:
        """A copy of the events so far, sorted by time, ready to pickle or export.

        Device-timed ends are resolved here (waiting, if need be, until the device reached
        them): the copy holds only times, no CUDA events."""
        events = [self._resolved(e) for e in list(self.events)]  # list(): an atomic copy
        events.sort(key=lambda e: e[0])
        return RankTrace(self.rank, events, self.param_names, self.offset_ns, self.skew_ns)

    def _resolved(self, event: Event) -> Event:
        t, kind, info = event
        if "device_event" not in info:
            return event
        rest = {k: v for k, v in info.items() if k != "device_event"}
        return (self.device_timer.host_ns(info["device_event"]), kind, {**rest, "clock": "device"})

    def _append(self, kind: str, info: dict) -> None:
        # Done-callbacks call this from the backend's threads: list.append is atomic in
        # CPython, so no lock (a lock would cost more than the rest of a record).
        self.events.append((time.monotonic_ns(), kind, info))

    def mark_setup(self) -> None:
        """Log which paths the attached reducer takes (:func:`describe_setup`)."""
        if self._reducer is not None:
            self._append("setup", describe_setup(self._reducer))

    def _note_layout(self) -> None:
        # The layout changes once (the rebuild, inside a forward): log it when it does, so the
        # exporter can name each bucket's parameters. One identity test per forward.
        buckets = getattr(getattr(self._reducer, "layout", None), "buckets", None)
        if buckets is not None and buckets is not self._layout_seen:
            self._layout_seen = buckets
            self._append("layout", {"buckets": [list(b.param_indices) for b in buckets]})


_BACKENDS = {"gloo": "Gloo", "nccl": "NCCL", "mpi": "MPI", "ucc": "UCC"}


def _backend(reducer: Any) -> str:
    try:
        name = str(dist.get_backend(reducer.group))
    except (RuntimeError, ValueError, AttributeError):
        return "unknown backend"
    return _BACKENDS.get(name, name)


def transport_of(reducer: Any, bucket: int | None) -> str:
    """What bucket ``bucket``'s all-reduce goes through now: ``shared memory``, the process
    group's backend (``Gloo``, ``NCCL``) or ``comm hook <name>``."""
    hook = getattr(reducer, "comm_hook", None)
    if hook is not None:
        return f"comm hook {getattr(hook, '__qualname__', repr(hook))}"
    buckets = getattr(getattr(reducer, "layout", None), "buckets", [])
    shm = getattr(reducer, "transport", None)
    if bucket is not None and bucket < len(buckets) and shm is not None \
            and getattr(reducer, "use_transport", False) \
            and not getattr(buckets[bucket], "sparse", False) and shm.owns(buckets[bucket].buffer):
        return "shared memory"
    return _backend(reducer)


def describe_setup(reducer: Any) -> dict:
    """The paths a reducer's steps take: backend, comm hook, shared memory, write-back."""
    config = getattr(reducer, "config", None)
    as_view = bool(getattr(config, "gradient_as_bucket_view", False))
    write_back = "bucket view" if as_view else \
        "zero-copy" if getattr(reducer, "zero_copy", False) else "copy"
    hook = getattr(reducer, "comm_hook", None)
    shm = getattr(reducer, "transport", None) is not None
    return {"backend": _backend(reducer),
            "comm_hook": None if hook is None else getattr(hook, "__qualname__", repr(hook)),
            "shared_memory": shm, "write_back": write_back,
            "find_unused_parameters": bool(getattr(config, "find_unused_parameters", False)),
            # torch DDP's own path: its backend's all-reduce, results copied into .grad
            "torch_ddp_path": not shm and hook is None and write_back != "zero-copy"}


def setup_line(setup: dict | None, transports: dict[str, int] | None = None) -> str:
    """One line saying which transport(s) and which write-back a recorded run used."""
    if not setup:
        return "transport and write-back not recorded"
    used = ", ".join(f"{t} ({n} all-reduces)" for t, n in (transports or {}).items()) \
        or ("shared memory for big buckets, " if setup["shared_memory"] else "") + setup["backend"]
    back = {"copy": "copy into .grad", "zero-copy": "zero-copy (.grad becomes the bucket's view)",
            "bucket view": "gradient_as_bucket_view"}[setup["write_back"]]
    # What ran decides: shared memory set up but never used (every bucket below its minimum)
    # leaves the step on torch DDP's path.
    ran_plain = transports is not None and "shared memory" not in transports \
        and setup["comm_hook"] is None and setup["write_back"] != "zero-copy"
    whose = "torch DDP's plain path" if setup["torch_ddp_path"] or ran_plain else \
        "mini_ddp's fast paths, not torch DDP's"
    return f"transport: {used}; write-back: {back} — {whose}"


def attach(reducer: Any, recorder: Any) -> None:
    """Make ``reducer`` (and its model) report events to ``recorder`` too (an observer)."""
    reducer.observers.add(recorder)


def detach(reducer: Any, recorder: Any) -> None:
    """Undo :func:`attach`; with no recorder left, tracing costs nothing again."""
    reducer.observers.remove(recorder)


@contextmanager
def trace(model: Any, align_clocks: bool = True) -> Iterator[TraceRecorder]:
    """Record ``model``'s gradient synchronisation inside the block (collective on entry)."""
    reducer = model.reducer
    recorder = TraceRecorder(reducer.rank, reducer.names, reducer)
    if align_clocks:
        recorder.align_clock(model.process_group)
    recorder.mark_setup()
    recorder._note_layout()
    attach(reducer, recorder)
    try:
        yield recorder
    finally:
        detach(reducer, recorder)


def gather_traces(recorder: TraceRecorder, group: dist.ProcessGroup | None = None
                  ) -> list[RankTrace] | None:
    """Collective: every rank's :class:`RankTrace` on group rank 0, ``None`` elsewhere."""
    mine = recorder.snapshot()
    rank = dist.get_rank(group)
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group or dist.group.WORLD, 0),
                       group=group)
    return gathered


# ---- Chrome trace export -------------------------------------------------------------------
def _tid(track: str) -> int:
    fixed = {"compute": 0, "hooks": 1}
    return fixed[track] if track in fixed else 10 + int(track.split()[1])


def setup_of(rank_trace: RankTrace) -> dict | None:
    """The "setup" event's description of a recorded rank (None: not recorded)."""
    return next((info for _, kind, info in rank_trace.events if kind == "setup"), None)


def spans_with_transport(rank_trace: RankTrace) -> list[Span]:
    """:func:`spans`, each all-reduce's ``args`` naming its transport (n-th launch of a bucket
    pairs with its n-th all-reduce span)."""
    launched: dict[int, list[str]] = {}
    for _, kind, info in rank_trace.events:
        if kind == "launch" and "transport" in info:
            launched.setdefault(info["bucket"], []).append(info["transport"])
    out, seen = [], {}
    for s in spans(rank_trace):
        if s.track.startswith("bucket") and s.end > s.start:
            bucket = int(s.track.split()[1])
            n = seen[bucket] = seen.get(bucket, -1) + 1
            kinds = launched.get(bucket, [])
            if n < len(kinds):
                s = Span(s.track, s.name, s.start, s.end, s.step, {**s.args, "transport": kinds[n]})
        out.append(s)
    return out


def transports_used(per_rank_spans: list[list[Span]]) -> dict[str, int]:
    """How many all-reduces went through each transport (over all ranks)."""
    counts: dict[str, int] = {}
    for rank_spans in per_rank_spans:
        for s in rank_spans:
            if "transport" in s.args:
                counts[s.args["transport"]] = counts.get(s.args["transport"], 0) + 1
    return counts


def chrome_trace(traces: list[RankTrace]) -> dict:
    """The Chrome trace-event JSON object (one process per rank, one thread per track)."""
    per_rank = [(t.rank, spans_with_transport(t)) for t in traces]
    t0 = min((s.start for _, ss in per_rank for s in ss), default=0)
    events: list[dict] = []
    for rank, rank_spans in per_rank:
        events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": rank,
                       "tid": 0, "args": {"sort_index": rank}})
        for track in sorted({s.track for s in rank_spans}, key=_tid):
            label = {"compute": "compute (forward / backward / finalize)",
                     "hooks": "gradient hooks"}.get(track, f"{track} communication")
            events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": rank,
                           "tid": _tid(track), "args": {"name": label}})
        for s in rank_spans:
            event = {"name": s.name, "pid": rank, "tid": _tid(s.track),
                     "ts": (s.start - t0) / 1000, "args": {"step": s.step, **s.args}}
            if s.end > s.start:
                event.update(ph="X", dur=(s.end - s.start) / 1000)
            else:
                event.update(ph="i", s="t")
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "mini_ddp.observe.tracing", "world_size": len(traces),
                          "setup": next((setup_of(t) for t in traces if setup_of(t)), None),
                          "transports": transports_used([ss for _, ss in per_rank]),
                          "clock_skew_us": max((t.skew_ns for t in traces), default=0) / 1000,
                          "t0_unix_ns": t0}}


def write_chrome_trace(traces: list[RankTrace], path: str) -> dict:
    """Write :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    obj = chrome_trace(traces)
    with open(path, "w") as f:
        json.dump(obj, f)
    return obj


_PHASES = set("BEXiIbenCMsStfPONDRcrp") | {"(", ")"}


def validate_chrome_trace(obj: Any) -> list[str]:
    """Problems with a Chrome trace-event object (empty list: valid).

    Checks what viewers rely on: every event has ``ph``/``ts``/``pid``/``tid``/``name``, the
    phase is one the format defines, ``X`` durations are non-negative numbers, and ``B``/``E``
    pairs balance per thread in time order.
    """
    events = obj.get("traceEvents") if isinstance(obj, dict) else obj
    if not isinstance(events, list):
        return ["no traceEvents list"]
    problems, open_spans = [], {}
    for i, e in enumerate(events):
        missing = [k for k in ("ph", "ts", "pid", "tid", "name") if k not in e]
        if missing:
            problems.append(f"event {i} lacks {missing}")
            continue
        if e["ph"] not in _PHASES:
            problems.append(f"event {i} has unknown phase {e['ph']!r}")
        if not isinstance(e["ts"], (int, float)) or e["ts"] < 0:
            problems.append(f"event {i} has bad ts {e['ts']!r}")
        if e["ph"] == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            problems.append(f"event {i} ({e['name']}) has bad dur {e.get('dur')!r}")
        stack = open_spans.setdefault((e["pid"], e["tid"]), [])
        if e["ph"] == "B":
            stack.append(e)
        elif e["ph"] == "E":
            if not stack or stack[-1]["ts"] > e["ts"]:
                problems.append(f"event {i}: E without an earlier open B on {e['pid']}/{e['tid']}")
            else:
                stack.pop()
    problems += [f"{len(s)} unclosed B events on pid/tid {k}" for k, s in open_spans.items() if s]
    return problems

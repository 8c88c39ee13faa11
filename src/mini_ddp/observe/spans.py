"""Spans: one rank's raw trace events paired up into durations on tracks.

A recorder (:mod:`mini_ddp.observe.tracing`) stores raw events in a :class:`RankTrace`;
:func:`spans` turns them into a forward, the backward's compute, each bucket's all-reduce from
launch to real completion and the finalize. Both the Chrome trace writer
(:mod:`mini_ddp.observe.tracing`) and the overlap figure and timeline
(:mod:`mini_ddp.observe.timeline`) read spans, so they live here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Event = tuple[int, str, dict]  # (monotonic ns, kind, info)


@dataclass
class RankTrace:
    """One rank's events, picklable, on a clock shared by all ranks (ns since the epoch)."""

    rank: int
    events: list[Event]
    param_names: list[str]
    offset_ns: int = 0  # add to an event's time to get wall-clock ns
    skew_ns: int = 0  # largest disagreement between ranks' clocks seen at alignment


@dataclass
class Span:
    """A duration (``end > start``) or an instant (``end == start``) on one rank's track."""

    track: str  # "compute", "hooks" or "bucket K"
    name: str
    start: int  # ns on the shared clock
    end: int
    step: int  # the synchronised step it belongs to (1-based; counts finalized backwards)
    args: dict = field(default_factory=dict)


def spans(rank_trace: RankTrace) -> list[Span]:
    """Turn one rank's raw events into spans: forwards, backward compute, per-bucket comm, …"""
    out: list[Span] = []
    off, names = rank_trace.offset_ns, rank_trace.param_names
    step, layout = 1, []
    forward_start = forward_end = first_hook = finalize_start = None
    user_open: dict[str, int] = {}
    # bucket -> [[launch, done, observed, bytes, step, names, clock]]
    comm: dict[int, list[list]] = {}
    for t, kind, info in rank_trace.events:
        t += off
        bucket = info.get("bucket")
        if kind == "layout":
            layout = info["buckets"]
        elif kind == "forward_start":
            forward_start = t
        elif kind == "forward_end" and forward_start is not None:
            out.append(Span("compute", "forward", forward_start, t, step))
            forward_end, forward_start = t, None
        elif kind == "hook":
            first_hook = t if first_hook is None else first_hook
            index = info["param"]
            where = next((k for k, b in enumerate(layout) if index in b), None)
            out.append(Span("hooks", names[index], t, t, step, {"param": index, "bucket": where}))
        elif kind == "bucket_ready":
            out.append(Span(f"bucket {bucket}", "ready", t, t, step))
        elif kind == "launch":
            members = [names[i] for i in layout[bucket]] if bucket < len(layout) else []
            comm.setdefault(bucket, []).append([t, None, None, info.get("bytes"), step, members,
                                                "host"])
        elif kind in ("comm_done", "complete"):
            # n-th launch of a bucket pairs with its n-th completion (done-callbacks may be
            # logged a hair after the reducer observed the result: keep the earlier time —
            # unless the end is a device event: on a GPU the host "observes" a result as
            # soon as its stream waits for it, before the device has run the collective).
            slot = 1 if kind == "comm_done" else 2
            row = next((r for r in comm.get(bucket, []) if r[slot] is None), None)
            if row is not None:
                row[slot] = t
                if kind == "comm_done":
                    row[6] = info.get("clock", "host")
        elif kind == "finalize_start":
            begin = forward_end if forward_end is not None and (
                first_hook is None or forward_end <= first_hook) else first_hook
            if begin is not None:
                out.append(Span("compute", "backward", begin, t, step))
            finalize_start = t
        elif kind == "finalized":
            if finalize_start is not None:
                out.append(Span("compute", "finalize (wait, then fill .grad)", finalize_start,
                                t, step))
            step, first_hook, forward_end, finalize_start = step + 1, None, None, None
        elif kind == "mark":
            out.append(Span("compute", info["name"], t, t, step, dict(info)))
        elif kind == "span_start":
            user_open[info["name"]] = t
        elif kind == "span_end" and info["name"] in user_open:
            out.append(Span("compute", info["name"], user_open.pop(info["name"]), t, step))
    for bucket, rows in comm.items():
        for launch, done, observed, nbytes, at_step, members, clock in rows:
            ends = [done] if clock == "device" else [e for e in (done, observed) if e is not None]
            if ends:
                out.append(Span(f"bucket {bucket}", f"all-reduce bucket {bucket}", launch,
                                min(ends), at_step, {"bytes": nbytes, "params": members,
                                                     "observed_by_finalize": observed is not None,
                                                     "clock": clock}))
    return sorted(out, key=lambda s: (s.start, s.end))

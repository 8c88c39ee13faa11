"""What a trace means: spans on tracks, the overlap figure, and a PNG timeline.

A recorder (:mod:`mini_ddp.observe.tracing`) only stores raw events. This module pairs them up into
*spans* — a forward, the backward's compute, each bucket's all-reduce from launch to real
completion, the finalize (waiting for the collectives, then copying results into ``.grad``) —
and answers the question DDP's design is about: how much of the communication ran *while*
backward was still computing (hidden), and how much the step had to wait for (exposed).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_ddp.observe.tracing import RankTrace


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
    comm: dict[int, list[list]] = {}  # bucket -> [[launch, done, observed, bytes, step, names]]
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
            comm.setdefault(bucket, []).append([t, None, None, info.get("bytes"), step, members])
        elif kind in ("comm_done", "complete"):
            # n-th launch of a bucket pairs with its n-th completion (done-callbacks may be
            # logged a hair after the reducer observed the result: keep the earlier time).
            slot = 1 if kind == "comm_done" else 2
            row = next((r for r in comm.get(bucket, []) if r[slot] is None), None)
            if row is not None:
                row[slot] = t
        elif kind == "finalize_start":
            begin = forward_end if forward_end is not None and (
                first_hook is None or forward_end <= first_hook) else first_hook
            if begin is not None:
                out.append(Span("compute", "backward", begin, t, step))
            finalize_start = t
        elif kind == "finalized":
            if finalize_start is not None:
                out.append(Span("compute", "finalize (wait + copy back)", finalize_start, t, step))
            step, first_hook, forward_end, finalize_start = step + 1, None, None, None
        elif kind == "mark":
            out.append(Span("compute", info["name"], t, t, step, dict(info)))
        elif kind == "span_start":
            user_open[info["name"]] = t
        elif kind == "span_end" and info["name"] in user_open:
            out.append(Span("compute", info["name"], user_open.pop(info["name"]), t, step))
    for bucket, rows in comm.items():
        for launch, done, observed, nbytes, at_step, members in rows:
            ends = [e for e in (done, observed) if e is not None]
            if ends:
                out.append(Span(f"bucket {bucket}", f"all-reduce bucket {bucket}", launch,
                                min(ends), at_step, {"bytes": nbytes, "params": members,
                                                     "observed_by_finalize": observed is not None}))
    return sorted(out, key=lambda s: (s.start, s.end))




# ---- the overlap figure --------------------------------------------------------------------
@dataclass
class StepOverlap:
    """Communication versus backward compute in one synchronised step of one rank."""

    rank: int
    step: int
    backward_s: float  # from the end of forward to the end of backward's compute
    comm_s: float  # time during which at least one bucket's collective was in flight
    hidden_s: float  # ... of which backward was still computing

    @property
    def exposed_s(self) -> float:
        """Communication the step waited for after backward's compute had ended."""
        return self.comm_s - self.hidden_s

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication time hidden behind backward compute (0..1)."""
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 1.0


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap(traces: list[RankTrace]) -> list[StepOverlap]:
    """One :class:`StepOverlap` per rank and finished step."""
    rows = []
    for rank_trace in traces:
        by_step: dict[int, list[Span]] = defaultdict(list)
        for s in spans(rank_trace):
            by_step[s.step].append(s)
        for step, items in sorted(by_step.items()):
            backward = [s for s in items if s.track == "compute" and s.name == "backward"]
            comm = _union([(s.start, s.end) for s in items
                           if s.track.startswith("bucket") and s.end > s.start])
            if not backward or not comm:
                continue
            b0, b1 = backward[0].start, backward[0].end
            hidden = sum(max(0, min(e, b1) - max(s, b0)) for s, e in comm)
            rows.append(StepOverlap(rank_trace.rank, step, (b1 - b0) / 1e9,
                                    sum(e - s for s, e in comm) / 1e9, hidden / 1e9))
    return rows


def overlap_summary(rows: list[StepOverlap], skip_first: bool = True) -> str:
    """A short table per rank; step 1 is left out by default (one bucket before the rebuild,
    so it cannot overlap — it is the warm-up, not the steady state)."""
    lines = ["rank  steps  backward ms  comm ms  hidden  exposed ms/step"]
    for rank in sorted({r.rank for r in rows}):
        mine = [r for r in rows if r.rank == rank and not (skip_first and r.step == 1)]
        if not mine:
            continue
        comm = sum(r.comm_s for r in mine)
        hidden = sum(r.hidden_s for r in mine) / comm if comm else 1.0
        lines.append(f"{rank:>4}  {len(mine):>5}  {1e3 * _mean(r.backward_s for r in mine):>11.2f}"
                     f"  {1e3 * comm / len(mine):>7.2f}  {hidden:>6.0%}"
                     f"  {1e3 * _mean(r.exposed_s for r in mine):>15.2f}")
    return "\n".join(lines)


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


# ---- PNG timeline --------------------------------------------------------------------------
_COLOURS = {"forward": "tab:blue", "backward": "tab:orange",
            "finalize (wait + copy back)": "tab:gray"}


def plot_timeline(traces: list[RankTrace], path: str, last_steps: int = 2,
                  title: str = "") -> None:
    """Draw the last ``last_steps`` finished steps of every rank: compute, hooks, buckets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_rank = [(t.rank, spans(t)) for t in traces]
    finished = min(max((s.step for s in ss if s.name == "backward"), default=0)
                   for _, ss in per_rank)
    shown = set(range(max(1, finished - last_steps + 1), finished + 1)) or {1}
    chosen = [(r, [s for s in ss if s.step in shown]) for r, ss in per_rank]
    t0 = min((s.start for _, ss in chosen for s in ss), default=0)
    rows: list[str] = []
    fig_height = 2.0 + 0.35 * sum(2 + len({s.track for s in ss if s.track.startswith("bucket")})
                                  for _, ss in chosen)
    fig, ax = plt.subplots(figsize=(12, fig_height))
    for rank, rank_spans in chosen:
        buckets = sorted({s.track for s in rank_spans if s.track.startswith("bucket")},
                         key=lambda t: int(t.split()[1]))
        for track in ["compute", "hooks", *buckets]:
            y = -len(rows)
            rows.append(f"rank {rank} {'comm ' if track in buckets else ''}{track}")
            for s in (s for s in rank_spans if s.track == track):
                x0, width = (s.start - t0) / 1e6, (s.end - s.start) / 1e6
                if track == "hooks" or (track != "compute" and width == 0):
                    ax.plot([x0, x0], [y - 0.3, y + 0.3], color="black", linewidth=0.8)
                elif track == "compute" and width == 0:
                    ax.plot([x0, x0], [y - 0.4, y + 0.4], color="tab:green", linewidth=2)
                else:
                    colour = _COLOURS.get(s.name, "tab:green") if track == "compute" \
                        else f"C{(int(track.split()[1]) + 3) % 10}"
                    ax.broken_barh([(x0, width)], (y - 0.35, 0.7), color=colour, alpha=0.85)
    ax.set_yticks([-i for i in range(len(rows))], rows)
    ax.set_xlabel("time (ms), clocks aligned across ranks")
    ax.set_title(title or f"gradient synchronisation on {len(traces)} ranks, steps "
                 f"{min(shown)}-{max(shown)}", fontsize=10)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    legend = [Patch(color=c, label=n) for n, c in _COLOURS.items()] + [
        Patch(color="tab:green", label="your spans/marks (optimizer step)"),
        Patch(color="C3", label="all-reduce of a bucket, launch to completion"),
        Line2D([], [], color="black", linewidth=0.8, label="hook fired / bucket ready")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 * 6 / fig_height),
              ncol=3, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

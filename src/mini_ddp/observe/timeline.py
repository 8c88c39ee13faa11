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
from dataclasses import dataclass

from mini_ddp.engine.config import format_bytes
from mini_ddp.observe.spans import RankTrace, Span, spans  # noqa: F401  (spans: re-exported)
from mini_ddp.observe.tracing import setup_line, setup_of, spans_with_transport, transports_used


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
_ENGINE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "finalize": "tab:gray"}
_ENGINE_LABELS = {"forward": "forward", "backward": "backward (compute)",
                  # Neutral on purpose: with the zero-copy write-back nothing is copied, .grad
                  # just becomes a view of its bucket; otherwise the bucket is copied out.
                  "finalize": "finalize: wait for the all-reduces, then fill .grad"}
_USER_COLOUR, _COMM_COLOUR, _TICK_COLOUR = "tab:green", "tab:red", "black"


def _engine_part(span: Span) -> str | None:
    """"forward", "backward" or "finalize" for the engine's own compute spans; None for the
    user's spans and marks (``rec.span`` / ``rec.mark``)."""
    for part in _ENGINE_COLOURS:
        if span.name == part or span.name.startswith(part + " "):
            return part
    return None


def user_spans_to_their_step(rank_spans: list[Span]) -> list[Span]:
    """Give each user span the step it ends: :func:`spans` counts steps by finalized backwards,
    so an optimizer step run after step N's backward is tagged N + 1; here it belongs to N."""
    forward_at = {s.step: s.start for s in rank_spans if _engine_part(s) == "forward"}
    out = []
    for s in rank_spans:
        if s.track == "compute" and _engine_part(s) is None and s.step > 1 \
                and s.start < forward_at.get(s.step, float("inf")):
            s = Span(s.track, s.name, s.start, s.end, s.step - 1, s.args)
        out.append(s)
    return out


def plot_timeline(traces: list[RankTrace], path: str, last_steps: int = 2,
                  title: str = "") -> tuple[str, list[str]]:
    """Draw the last ``last_steps`` finished steps of every rank: compute, hooks, buckets.

    A step runs from its forward to the end of the user's spans after its backward (the
    optimizer step), so the title's step range is exactly what is drawn; the legend lists
    only what was drawn. Under the title: which transport(s) the drawn all-reduces went through
    and which write-back ran (mini_ddp's fast paths are not torch DDP's). Dotted lines mark
    where each step's forward begins; each bucket row is labelled with the bucket's bytes.
    Returns the title and the legend's labels.
    """
    setup = next((setup_of(t) for t in traces if setup_of(t)), None)
    return plot_spans([(t.rank, spans_with_transport(t)) for t in traces], path, last_steps,
                      title, setup)


def spans_from_chrome_trace(obj: dict) -> list[tuple[int, list[Span]]]:
    """Each rank's spans back from a trace written by
    :func:`mini_ddp.observe.tracing.write_chrome_trace`: a saved run can be drawn again."""
    tracks: dict[tuple[int, int], str] = {}
    for e in obj["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            label = e["args"]["name"]
            tracks[e["pid"], e["tid"]] = ("compute" if label.startswith("compute") else "hooks"
                                          if label == "gradient hooks" else
                                          label.removesuffix(" communication"))
    per_rank: dict[int, list[Span]] = defaultdict(list)
    for e in obj["traceEvents"]:
        if e["ph"] in ("X", "i"):
            start = round(e["ts"] * 1000)
            end = start + round(e.get("dur", 0) * 1000)
            args = {k: v for k, v in e["args"].items() if k != "step"}
            per_rank[e["pid"]].append(Span(tracks[e["pid"], e["tid"]], e["name"], start, end,
                                           e["args"]["step"], args))
    return sorted(per_rank.items())


def track_label(rank: int, track: str, rank_spans: list[Span]) -> str:
    """A timeline row's label; a bucket row names the bucket's size in bytes (its last launch
    among ``rank_spans``)."""
    if not track.startswith("bucket"):
        return f"rank {rank} {track}"
    sizes = [s.args["bytes"] for s in rank_spans if s.track == track and s.args.get("bytes")]
    return f"rank {rank} comm {track}" + (f" ({format_bytes(sizes[-1])})" if sizes else "")


def step_boundaries(per_rank: list[tuple[int, list[Span]]]) -> list[tuple[int, int]]:
    """``(step, ns)`` per step among the spans, in step order: where the step's first forward
    (over all ranks) begins. The timeline draws its dotted step lines here."""
    starts: dict[int, int] = {}
    for _, rank_spans in per_rank:
        for s in rank_spans:
            if _engine_part(s) == "forward":
                starts[s.step] = min(s.start, starts.get(s.step, s.start))
    return sorted(starts.items())


def plot_spans(per_rank: list[tuple[int, list[Span]]], path: str, last_steps: int = 2,
               title: str = "", setup: dict | None = None) -> tuple[str, list[str]]:
    """:func:`plot_timeline` from each rank's spans (e.g. :func:`spans_from_chrome_trace`;
    ``setup``: the trace's ``otherData["setup"]``). The title's second line (returned too) is
    :func:`mini_ddp.observe.tracing.setup_line` of the drawn all-reduces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    per_rank = [(r, user_spans_to_their_step(ss)) for r, ss in per_rank]
    finished = min(max((s.step for s in ss if _engine_part(s) == "finalize"), default=0)
                   for _, ss in per_rank)
    shown = set(range(max(1, finished - last_steps + 1), finished + 1)) or {1}
    chosen = [(r, [s for s in ss if s.step in shown]) for r, ss in per_rank]
    t0 = min((s.start for _, ss in chosen for s in ss), default=0)
    rows: list[str] = []
    used: dict[str, set[str]] = {"engine": set(), "user": set(), "comm": set(), "tick": set()}
    fig_height = 2.0 + 0.35 * sum(2 + len({s.track for s in ss if s.track.startswith("bucket")})
                                  for _, ss in chosen)
    fig, ax = plt.subplots(figsize=(12, fig_height))
    for rank, rank_spans in chosen:
        buckets = sorted({s.track for s in rank_spans if s.track.startswith("bucket")},
                         key=lambda t: int(t.split()[1]))
        for track in ["compute", "hooks", *buckets]:
            y = -len(rows)
            rows.append(track_label(rank, track, rank_spans))
            for s in (s for s in rank_spans if s.track == track):
                x0, width = (s.start - t0) / 1e6, (s.end - s.start) / 1e6
                part = _engine_part(s) if track == "compute" else None
                if track == "compute" and part is None:
                    used["user"].add(s.name)
                    if width == 0:  # a mark
                        ax.plot([x0, x0], [y - 0.4, y + 0.4], color=_USER_COLOUR, linewidth=2)
                    else:
                        ax.broken_barh([(x0, width)], (y - 0.35, 0.7), color=_USER_COLOUR,
                                       alpha=0.85)
                elif track == "compute":
                    used["engine"].add(part)
                    ax.broken_barh([(x0, width)], (y - 0.35, 0.7),
                                   color=_ENGINE_COLOURS[part], alpha=0.85)
                elif track == "hooks" or width == 0:
                    used["tick"].add(track)
                    ax.plot([x0, x0], [y - 0.3, y + 0.3], color=_TICK_COLOUR, linewidth=0.8)
                else:
                    used["comm"].add(track)
                    ax.broken_barh([(x0, width)], (y - 0.35, 0.7), color=_COMM_COLOUR,
                                   alpha=0.85)
    for step, start in step_boundaries(chosen):
        x = (start - t0) / 1e6
        ax.axvline(x, color="0.4", linestyle=":", linewidth=1)
        ax.text(x, 0.99, f" step {step}", fontsize=8, color="0.3", va="top",
                transform=ax.get_xaxis_transform())
    ax.set_yticks([-i for i in range(len(rows))], rows)
    ax.set_xlabel("time (ms), clocks aligned across ranks")
    steps = f"step {min(shown)}" if len(shown) == 1 else f"steps {min(shown)}-{max(shown)}"
    title = title or f"gradient synchronisation on {len(per_rank)} ranks, {steps}"
    title = f"{title}\n{setup_line(setup, transports_used([ss for _, ss in chosen]))}"
    ax.set_title(title, fontsize=9)
    legend = [Patch(color=_ENGINE_COLOURS[p], label=_ENGINE_LABELS[p])
              for p in _ENGINE_COLOURS if p in used["engine"]]
    if used["user"]:
        legend.append(Patch(color=_USER_COLOUR, label="your spans/marks: "
                            + ", ".join(sorted(used["user"]))))
    if used["comm"]:
        legend.append(Patch(color=_COMM_COLOUR, label="a bucket's all-reduce, launch to "
                            "completion"))
    if used["tick"]:
        legend.append(Line2D([], [], color=_TICK_COLOUR, linewidth=0.8,
                             label="hook fired (hooks row) / bucket ready (bucket rows)"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 * 6 / fig_height),
              ncol=3, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return title, [h.get_label() for h in legend]

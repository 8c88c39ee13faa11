"""Tracing: every bucket goes ready -> launch -> complete on every rank; the Chrome trace is valid."""

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp import DataParallelModel
from mini_ddp.engine.config import format_bytes
from mini_ddp.engine.observer import Observer, Observers
from mini_ddp.observe.timeline import (
    overlap,
    overlap_summary,
    plot_spans,
    plot_timeline,
    spans,
    spans_from_chrome_trace,
    step_boundaries,
    track_label,
    user_spans_to_their_step,
)
from mini_ddp.observe.tracing import (
    RankTrace,
    TraceRecorder,
    attach,
    chrome_trace,
    detach,
    setup_line,
    spans_with_transport,
    trace,
    validate_chrome_trace,
)

STEPS = 3


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _traced_training(ctx):
    torch.manual_seed(0)
    model = DataParallelModel(_net(), bucket_cap_mb=0.0005)  # ~512 bytes: 3 buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16) + ctx.rank
    layouts = []
    with trace(model) as rec:
        for _ in range(STEPS):
            model(x).square().mean().backward()
            layouts.append([list(b.param_indices) for b in model.reducer.layout.buckets])
            with rec.span("optimizer_step"):
                opt.step()
            opt.zero_grad()
        rec.mark("done")
    return rec.snapshot(), layouts, rec not in model.reducer.observers.members


@pytest.fixture(scope="module")
def traced():
    return run_ranks(_traced_training, 2, timeout_s=120)


def _steps(events):
    """Raw events cut into synchronised steps (each ends with 'finalized')."""
    steps, current = [], []
    for event in events:
        current.append(event)
        if event[1] == "finalized":
            steps.append(current)
            current = []
    return steps


def test_every_bucket_goes_ready_launch_complete_in_order_on_every_rank(traced):
    for rank_trace, layouts, _ in traced:
        steps = _steps(rank_trace.events)
        assert len(steps) == STEPS
        assert len(layouts[0]) == 1 and len(layouts[-1]) > 2  # one bucket, then the rebuild
        for step, layout in zip(steps, layouts, strict=True):
            for k in range(len(layout)):
                times = {kind: [t for t, kd, info in step if kd == kind and info.get("bucket") == k]
                         for kind in ("bucket_ready", "launch", "comm_done", "complete")}
                assert all(len(v) == 1 for v in times.values()), (rank_trace.rank, k, times)
                ready, launch = times["bucket_ready"][0], times["launch"][0]
                assert ready <= launch <= times["comm_done"][0]
                assert launch <= times["complete"][0]
            launches = [info["bucket"] for _, kind, info in step if kind == "launch"]
            assert launches == sorted(launches)  # strictly in bucket order
            hooks = sorted(info["param"] for _, kind, info in step if kind == "hook")
            assert hooks == list(range(6))  # each parameter's hook once per step
            kinds = [kind for _, kind, _ in step]
            assert kinds.index("forward_start") < kinds.index("forward_end") \
                < kinds.index("finalize_start") < kinds.index("finalized")


def test_tracing_is_detached_after_the_block(traced):
    assert all(detached for _, _, detached in traced)


def test_chrome_trace_is_valid_json_with_one_process_per_rank(traced, tmp_path):
    traces = [t for t, _, _ in traced]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace(traces)))
    obj = json.loads(path.read_text())
    assert validate_chrome_trace(obj) == []
    events = obj["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    comm = [e for e in events if e["name"].startswith("all-reduce")]
    expected = sum(len(layout) for _, layouts, _ in traced for layout in layouts)
    assert len(comm) == expected and all(e["ph"] == "X" and e["dur"] >= 0 for e in comm)
    names = {e["name"] for e in events}
    assert {"forward", "backward", "optimizer_step", "done", "2.weight"} <= names


def test_overlap_figure_and_png(traced, tmp_path):
    traces = [t for t, _, _ in traced]
    rows = overlap(traces)
    assert {(r.rank, r.step) for r in rows} == {(r, s) for r in (0, 1) for s in (1, 2, 3)}
    for row in rows:
        assert 0 <= row.hidden_s <= row.comm_s and 0 <= row.hidden_fraction <= 1
        assert row.exposed_s == pytest.approx(row.comm_s - row.hidden_s)
    assert "hidden" in overlap_summary(rows)
    png = tmp_path / "timeline.png"
    title, legend = plot_timeline(traces, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first_line, second_line = title.split("\n")
    assert first_line.endswith("steps 2-3")
    # two ranks on one host: shared memory, results copied into .grad — not torch DDP's path
    assert "shared memory (" in second_line and "copy into .grad" in second_line
    assert second_line.endswith("mini_ddp's fast paths, not torch DDP's")
    # one entry per colour drawn; the write-back is zero-copy here, so nothing says "copy"
    assert legend == ["forward", "backward (compute)",
                      "finalize: wait for the all-reduces, then fill .grad",
                      "your spans/marks: done, optimizer_step",
                      "a bucket's all-reduce, launch to completion",
                      "hook fired (hooks row) / bucket ready (bucket rows)"]


def test_the_trace_records_transport_and_write_back(traced):
    traces = [t for t, _, _ in traced]
    obj = chrome_trace(traces)
    setup = obj["otherData"]["setup"]
    assert setup["write_back"] == "copy" and setup["backend"] == "Gloo"
    # shared memory is set up for two ranks on one host; Gloo sums iteration 1's single
    # bucket, and every bucket of the rebuilt layout goes through shared memory
    assert setup["shared_memory"] and not setup["torch_ddp_path"]
    comm = [e for e in obj["traceEvents"] if e["name"].startswith("all-reduce")]
    first = [e for e in comm if e["args"]["step"] == 1]
    assert len(first) == 2 and all(e["args"]["transport"] == "Gloo" for e in first)
    assert all(e["args"]["transport"] == "shared memory" for e in comm if e not in first)
    assert obj["otherData"]["transports"] == {"Gloo": 2, "shared memory": len(comm) - 2}


def test_bucket_rows_name_their_bytes(traced):
    rank_spans = spans_with_transport(traced[0][0])
    label = track_label(0, "bucket 0", rank_spans)
    size = [s.args["bytes"] for s in rank_spans if s.track == "bucket 0" and "bytes" in s.args][-1]
    assert label == f"rank 0 comm bucket 0 ({format_bytes(size)})"
    assert track_label(0, "compute", rank_spans) == "rank 0 compute"


def test_setup_line_says_whose_path_ran():
    plain = {"backend": "Gloo", "comm_hook": None, "shared_memory": False, "write_back": "copy",
             "find_unused_parameters": False, "torch_ddp_path": True}
    assert setup_line(plain, {"Gloo": 3}) == ("transport: Gloo (3 all-reduces); write-back: "
                                              "copy into .grad — torch DDP's plain path")
    fast = {**plain, "shared_memory": True, "write_back": "zero-copy", "torch_ddp_path": False}
    assert "shared memory (2 all-reduces)" in setup_line(fast, {"shared memory": 2})
    assert setup_line(None) == "transport and write-back not recorded"


def _shm_trace(ctx, plain: bool):
    torch.manual_seed(0)
    model = DataParallelModel(nn.Linear(1100, 1100), shared_memory_allreduce=not plain,
                              zero_copy_write_back=not plain)  # 4.6 MiB: one bucket
    with trace(model) as rec:
        for _ in range(2):
            model(torch.randn(2, 1100)).sum().backward()
    return rec.snapshot()


@pytest.mark.parametrize("plain", [False, True], ids=["mini_ddp", "as_torch_ddp"])
def test_two_ranks_name_shared_memory_or_torch_ddps_path(plain):
    obj = chrome_trace(run_ranks(_shm_trace, 2, args=(plain,), timeout_s=120))
    if plain:
        assert obj["otherData"]["transports"] == {"Gloo": 4}
        assert obj["otherData"]["setup"]["torch_ddp_path"]
    else:
        # Gloo sums iteration 1's bucket on each rank; the rebuilt one is in shared memory
        assert obj["otherData"]["transports"] == {"Gloo": 2, "shared memory": 2}
        assert obj["otherData"]["setup"]["write_back"] == "zero-copy"


def test_a_saved_chrome_trace_draws_the_same_timeline(traced, tmp_path):
    traces = [t for t, _, _ in traced]
    saved = json.loads(json.dumps(chrome_trace(traces)))
    back = spans_from_chrome_trace(saved)
    assert [r for r, _ in back] == [0, 1]
    for rank_trace, (_, again) in zip(traces, back, strict=True):
        first = sorted((s.track, s.name, s.step, s.end - s.start) for s in spans(rank_trace))
        second = sorted((s.track, s.name, s.step, s.end - s.start) for s in again)
        assert [k[:3] for k in first] == [k[:3] for k in second]
        assert all(abs(a[3] - b[3]) <= 2 for a, b in zip(first, second, strict=True))  # ns
    assert plot_spans(back, str(tmp_path / "again.png"),
                      setup=saved["otherData"]["setup"]) == plot_timeline(
        traces, str(tmp_path / "first.png"))


def test_a_step_in_the_timeline_ends_with_its_optimizer_step(traced):
    for rank_trace, _, _ in traced:
        raw = [s for s in spans(rank_trace) if s.name == "optimizer_step"]
        assert [s.step for s in raw] == [2, 3, 4]  # spans() counts finalized backwards
        mine = [s for s in user_spans_to_their_step(spans(rank_trace))
                if s.name == "optimizer_step"]
        assert [s.step for s in mine] == [1, 2, 3]


def test_the_timeline_draws_one_step_line_where_each_step_begins(traced, tmp_path,
                                                                 monkeypatch):
    """A step line per drawn step, at the first forward_start (over the ranks) recorded after
    the previous step's 'finalized' — also when drawn again from a saved Chrome trace."""
    import matplotlib.axes

    traces = [t for t, _, _ in traced]
    # From the raw events: step N's forward_start on each rank, clock offsets applied.
    starts = {}
    for rank_trace in traces:
        steps = _steps(rank_trace.events)
        assert len(steps) == STEPS
        for n, events in enumerate(steps, start=1):
            (first,) = [t for t, kind, _ in events if kind == "forward_start"]
            starts.setdefault(n, []).append(first + rank_trace.offset_ns)
    expected = [(n, min(times)) for n, times in sorted(starts.items())]
    per_rank = [(t.rank, spans(t)) for t in traces]
    assert step_boundaries(per_rank) == expected
    # The Chrome trace starts its clock at the first event and keeps microseconds.
    again = step_boundaries(spans_from_chrome_trace(chrome_trace(traces)))
    assert [n for n, _ in again] == [n for n, _ in expected]
    assert [ns - again[0][1] for _, ns in again] == [
        pytest.approx(ns - expected[0][1], abs=2) for _, ns in expected]
    for rank_trace in traces:  # each boundary lies inside its own rank's step
        for n, events in enumerate(_steps(rank_trace.events), start=1):
            finalized = events[-1][0] + rank_trace.offset_ns
            assert expected[n - 1][1] < finalized
            if n > 1:
                before = _steps(rank_trace.events)[n - 2][-1][0] + rank_trace.offset_ns
                own = starts[n][traces.index(rank_trace)]
                assert before < own
    # What is drawn: exactly these lines for the last two steps, at these distances apart.
    drawn, labels = [], []
    real_axvline, real_text = matplotlib.axes.Axes.axvline, matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda ax, x, *a, **k: drawn.append(x) or real_axvline(ax, x, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "text",
                        lambda ax, x, y, s, *a, **k: labels.append(s) or real_text(ax, x, y, s,
                                                                                  *a, **k))
    plot_timeline(traces, str(tmp_path / "timeline.png"), last_steps=2)
    assert [s.strip() for s in labels] == ["step 2", "step 3"]
    assert len(drawn) == 2 and drawn[0] >= 0
    assert drawn[1] - drawn[0] == pytest.approx((expected[2][1] - expected[1][1]) / 1e6)


# ---- no processes ----------------------------------------------------------------------------
def test_validator_catches_malformed_traces():
    ok = {"name": "a", "ph": "B", "ts": 1, "pid": 0, "tid": 0}
    assert validate_chrome_trace([ok, {**ok, "ph": "E", "ts": 2}]) == []
    assert validate_chrome_trace([ok])  # unclosed B
    assert validate_chrome_trace([{**ok, "ph": "E"}])  # E without B
    assert validate_chrome_trace([{**ok, "ph": "Q"}])  # unknown phase
    assert validate_chrome_trace([{**ok, "ph": "X", "dur": -1}])  # negative duration
    assert validate_chrome_trace([{"ph": "X", "ts": 0, "pid": 0, "dur": 1}])  # missing keys
    assert validate_chrome_trace({"nothing": []})


def test_completion_seen_before_its_callback_keeps_the_earlier_time():
    # The done-callback can be logged a hair after finalize observed the result: pair the
    # n-th launch with the n-th completion of that bucket, and end the span at the earlier.
    events = [(0, "layout", {"buckets": [[0]]}), (10, "forward_start", {}),
              (20, "forward_end", {}), (30, "hook", {"param": 0}),
              (31, "bucket_ready", {"bucket": 0}), (32, "launch", {"bucket": 0, "bytes": 4}),
              (40, "finalize_start", {}), (50, "complete", {"bucket": 0}),
              (55, "comm_done", {"bucket": 0}), (60, "finalized", {})]
    out = spans(RankTrace(0, events, ["w"]))
    comm = next(s for s in out if s.track == "bucket 0" and s.end > s.start)
    assert (comm.start, comm.end) == (32, 50)
    backward = next(s for s in out if s.name == "backward")
    assert (backward.start, backward.end) == (20, 40)


def test_attach_and_detach_share_the_reducer_observers():
    observers = Observers()

    class Reducer:
        pass

    reducer, a, b = Reducer(), TraceRecorder(), TraceRecorder()
    reducer.observers = observers
    attach(reducer, a)
    attach(reducer, b)
    assert observers.per_gradient  # a recorder listens to each gradient: hooks stay per gradient
    observers.gradient_ready(reducer, 3)
    assert [e[1:] for e in a.events] == [e[1:] for e in b.events] == [("hook", {"param": 3})]
    detach(reducer, a)
    assert observers.members == [b]
    detach(reducer, b)
    assert observers.members == [] and not observers.per_gradient  # the zero-cost path again


# ---- the tutorial's shipped artefacts (docs/img/ddp-step/) still match the code --------------
SHIPPED = Path(__file__).resolve().parents[1] / "docs" / "img" / "ddp-step"


def _shape(obj: dict) -> set[tuple]:
    """What a trace's events look like, without the model: kinds, names with numbers and
    parameter names taken out, and the keys of their args."""
    hooks = {e["args"]["name"] for e in obj["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    out = set()
    for e in obj["traceEvents"]:
        if e["ph"] == "M":
            out.add(("M", e["name"], re.sub(r"\d+", "N", e["args"].get("name", ""))))
        elif "param" in e["args"]:
            out.add((e["ph"], "<a parameter>", tuple(sorted(e["args"]))))
        else:
            out.add((e["ph"], re.sub(r"\d+", "N", e["name"]), tuple(sorted(e["args"]))))
    assert hooks
    return out


def _plain_trace_run(tmp: Path) -> dict:
    from mini_ddp.tools import trace_demo

    assert trace_demo.main(["--model", "lenet", "--bucket-cap-mb", "0.01", "--batch-size", "4",
                            "--steps", "4", "--as-torch-ddp", "--out", str(tmp)]) == 0
    return json.loads((tmp / "trace.json").read_text())


@pytest.mark.timeout(300)
def test_the_shipped_trace_matches_what_the_code_emits(tmp_path, capsys):
    shipped = json.loads((SHIPPED / "trace.json").read_text())
    fresh = _plain_trace_run(tmp_path)
    capsys.readouterr()
    assert validate_chrome_trace(shipped) == []
    assert _shape(shipped) == _shape(fresh)  # same event kinds, names and args
    assert shipped["otherData"].keys() == fresh["otherData"].keys()
    setup = shipped["otherData"]["setup"]
    assert setup == {**fresh["otherData"]["setup"]} and setup["torch_ddp_path"]
    assert set(shipped["otherData"]["transports"]) == {"Gloo"}
    assert (SHIPPED / "overlap.txt").read_text().startswith("rank  steps  backward ms")


@pytest.mark.timeout(300)
def test_the_shipped_layout_is_what_explain_prints(capsys):
    from mini_ddp.tools import explain_cli

    assert explain_cli.main(["--model", "resnet18", "--max-names", "8"]) == 0
    fresh = capsys.readouterr().out.splitlines()
    shipped = (SHIPPED / "layout.txt").read_text().splitlines()
    # the layout does not depend on the world size; only the first line names it
    assert re.sub(r" of \d+:", ":", shipped[0]) == re.sub(r" of \d+:", ":", fresh[0])
    assert shipped[1:] == fresh[1:]


def test_the_tutorial_quotes_the_shipped_artefacts():
    page = (Path(__file__).resolve().parents[1] / "docs" / "tutorial.md").read_text()
    assert (SHIPPED / "overlap.txt").read_text().strip() in page
    setup = json.loads((SHIPPED / "trace.json").read_text())["otherData"]
    assert setup_line(setup["setup"], setup["transports"]) in page
    layout = (SHIPPED / "layout.txt").read_text().splitlines()
    rebuilt = layout[layout.index(next(line for line in layout if line.startswith("layout 2"))):]
    quoted = [line for line in rebuilt if line.startswith("       0  float32")]
    assert quoted and quoted[0] in page  # the tutorial's excerpt of the rebuilt layout


def test_the_static_graphs_first_iteration_tells_bucket_ready_for_every_bucket(one_rank_group):
    """Iteration 1 of a static graph reduces every bucket at the end of backward (DDP's
    delay_all_reduce); each bucket still goes ready before its launch, as in later steps."""
    class Seen(Observer):
        def __init__(self) -> None:
            self.ready: list[int] = []
            self.launched: list[int] = []

        def bucket_ready(self, reducer, bucket) -> None:
            self.ready.append(bucket.index)

        def bucket_launched(self, reducer, bucket) -> None:
            assert bucket.index in self.ready  # ready before launched
            self.launched.append(bucket.index)

    torch.manual_seed(0)
    model = DataParallelModel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)),
                              static_graph=True)
    seen = Seen()
    model.reducer.observers.add(seen)
    for _ in range(2):
        seen.ready, seen.launched = [], []
        model(torch.randn(8, 64)).sum().backward()
        buckets = len(model.reducer.layout.buckets)
        assert sorted(seen.ready) == list(range(buckets))
        assert sorted(seen.launched) == list(range(buckets))

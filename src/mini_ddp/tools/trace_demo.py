"""``python -m mini_ddp trace``: a short real training run, traced on every rank.

Writes ``trace.json`` (open it in https://ui.perfetto.dev or chrome://tracing), a PNG timeline,
the overlap figure and the bucket layout. Both the trace and the PNG say which transport each
all-reduce went through and which write-back ran: by default mini_ddp's fast paths (two ranks on
one host sum buckets of 1 MiB or more in shared memory, and ``.grad`` becomes the bucket's
view — neither is torch DDP's); ``--as-torch-ddp`` turns both off, so every bucket goes through
the process group's backend and is copied into ``.grad``, as torch DDP does. ``--overhead`` instead measures what the
observability tools cost per step: tracing off (the default path), tracing on, the stall
watchdog on, and the desync detector checking every step — interleaved rounds, medians, no
claims beyond this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from mini_ddp.observe.explain import explain
from mini_ddp.tools.helptext import plain
from mini_ddp.tools.model_args import add_model_arguments, build_spec, spec_from_args
from mini_ddp.training.models import compute_loss
from mini_ddp.training.spawn import RankContext, run_ranks


def _setup(ctx: RankContext, opts: dict) -> tuple[Any, Any, list]:
    from mini_ddp.engine.model import DataParallelModel

    spec = build_spec(opts["model"], opts["spec"])
    torch.manual_seed(0)
    plain = opts.get("as_torch_ddp", False)  # torch DDP's path: Gloo/NCCL, results copied
    model = DataParallelModel(spec.builder(), bucket_cap_mb=opts["bucket_cap_mb"],
                              find_unused_parameters=opts.get("find_unused_parameters", False),
                              shared_memory_allreduce=not plain, zero_copy_write_back=not plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own shard of data
    batches = [(*spec.make_batch(opts["batch_size"], gen), spec.loss) for _ in range(4)]
    return model, opt, batches


def _step(model: Any, opt: Any, batch: tuple, rec: Any = None) -> None:
    x, y, loss = batch
    compute_loss(loss, model(x), y).backward()
    if rec is None:
        opt.step()
    else:
        with rec.span("optimizer_step"):
            opt.step()
    opt.zero_grad(set_to_none=True)


def _traced_rank(ctx: RankContext, opts: dict) -> tuple[Any, str]:
    from mini_ddp.observe.tracing import trace

    model, opt, batches = _setup(ctx, opts)
    with trace(model) as rec:
        for step in range(opts["steps"]):
            _step(model, opt, batches[step % len(batches)], rec)
    return rec.snapshot(), explain(model, max_names=8)


def _overhead_rank(ctx: RankContext, opts: dict) -> dict[str, tuple[float, float]]:
    from mini_ddp.checks.replicas import DesyncDetector
    from mini_ddp.observe.tracing import TraceRecorder, attach, detach
    from mini_ddp.watch.stall import StallWatchdog

    model, opt, batches = _setup(ctx, opts)
    for batch in batches:  # warm-up, and the bucket rebuild
        _step(model, opt, batch)
    watchdog, detector = StallWatchdog(model, limit_s=600), DesyncDetector(model, every=1)
    # Wall time per step, and this process's CPU time per step (all its threads): the CPU
    # time is what the tools consume, and shrugs off most of a busy machine's scheduling noise.
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in
                                                   ("off", "trace", "watchdog", "desync")}
    for _ in range(opts["rounds"]):
        for mode in times:  # interleaved, so machine noise hits every mode alike
            rec = TraceRecorder(ctx.rank, model.reducer.names, model.reducer)
            if mode == "trace":
                attach(model.reducer, rec)
            elif mode == "watchdog":
                watchdog.install()
            elif mode == "desync":
                detector.install()
            for i in range(opts["steps"]):
                wall, cpu = time.perf_counter(), time.process_time()
                _step(model, opt, batches[i % len(batches)])
                times[mode].append((time.perf_counter() - wall, time.process_time() - cpu))
            detach(model.reducer, rec)
            watchdog.remove()
            detector.remove()
    return {mode: (statistics.median(w for w, _ in values),
                   statistics.median(c for _, c in values)) for mode, values in times.items()}


def _cap(text: str) -> float | None:
    return None if text == "ddp" else float(text)


def _record_cost_s(calls: int = 200_000) -> float:
    """Seconds per ``record()`` of a "hook" event, the most frequent kind (best of 5)."""
    from mini_ddp.observe.tracing import TraceRecorder

    best = float("inf")
    for _ in range(5):
        rec = TraceRecorder()
        start = time.perf_counter()
        for i in range(calls):
            rec.record("hook", param=i)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    """Run a traced training (or the overhead benchmark) and write/print the results."""
    parser = argparse.ArgumentParser(prog="python -m mini_ddp trace", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    add_model_arguments(parser, default="lenet")
    parser.add_argument("--bucket-cap-mb", type=_cap, default=0.01,
                        help="MiB; small by default, so that a tiny model has several "
                             "buckets; 'ddp' for DDP's defaults (25 MiB, first bucket 1 MiB; a cap "
                             "you set replaces both, as in torch DDP)")
    parser.add_argument("--as-torch-ddp", action="store_true",
                        help="torch DDP's plain path: no shared-memory all-reduce, results "
                             "copied into .grad (shared_memory_allreduce=False, "
                             "zero_copy_write_back=False)")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="DDP's find_unused_parameters=True (a model with parameters "
                             "that get no gradient)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="steps traced (per round)")
    parser.add_argument("--out", default="runs/trace", help="output directory")
    parser.add_argument("--overhead", action="store_true", help="benchmark the tools' cost")
    parser.add_argument("--rounds", type=int, default=5, help="--overhead: rounds per mode")
    args = parser.parse_args(argv)
    spec = spec_from_args(parser, args)  # a mistyped model: a usage error, before any rank
    # What the ranks rebuild the spec from: plain values (a zoo builder may be a lambda).
    opts = {**vars(args), "spec": {"input_shape": spec.input_shape,
                                   "input_dtype": spec.input_dtype, "loss": spec.loss,
                                   "num_classes": spec.num_classes, "vocab": spec.vocab}}
    if args.overhead:
        medians = run_ranks(_overhead_rank, args.world_size, args=(opts,), timeout_s=1200)
        print(f"median per step, {args.model}, batch {args.batch_size}, world size "
              f"{args.world_size}, {args.rounds} rounds x {args.steps} steps per mode "
              f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs):")
        for mode in medians[0]:
            cells = []
            for kind, what in ((0, "wall"), (1, "CPU")):
                per_rank = "/".join(f"{1e3 * m[mode][kind]:.2f}" for m in medians)
                rel = statistics.mean(m[mode][kind] / m["off"][kind] - 1 for m in medians)
                cells.append(f"{what} {per_rank} ms" + ("" if mode == "off" else f" ({rel:+.1%})"))
            print(f"  {mode:<9} " + "   ".join(cells))
        print(f"one TraceRecorder.record() call: {1e6 * _record_cost_s():.2f} us "
              "(a traced step records ~3 events per parameter and bucket)")
        return 0
    from mini_ddp.observe.timeline import overlap, overlap_summary, plot_timeline
    from mini_ddp.observe.tracing import setup_line, validate_chrome_trace, write_chrome_trace

    results = run_ranks(_traced_rank, args.world_size, args=(opts,), timeout_s=600)
    traces = [trace for trace, _ in results]
    os.makedirs(args.out, exist_ok=True)
    obj = write_chrome_trace(traces, os.path.join(args.out, "trace.json"))
    problems = validate_chrome_trace(obj)
    plot_timeline(traces, os.path.join(args.out, "timeline.png"))
    summary = overlap_summary(overlap(traces))
    with open(os.path.join(args.out, "overlap.txt"), "w") as f:
        f.write(summary + "\n")
    with open(os.path.join(args.out, "layout.txt"), "w") as f:
        f.write(results[0][1] + "\n")
    ran = setup_line(obj["otherData"]["setup"], obj["otherData"]["transports"])
    print(results[0][1], "", ran, "", "communication hidden behind backward compute (steps 2+):",
          summary, "", f"wrote {args.out}/trace.json ({len(obj['traceEvents'])} events"
          f"{', INVALID: ' + '; '.join(problems) if problems else ''}), timeline.png, "
          "overlap.txt, layout.txt", sep="\n")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

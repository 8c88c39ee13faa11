"""Step time and memory of torch DDP, mini_ddp, a naive baseline and compute alone, side by side.

One :func:`~mini_ddp.training.spawn.run_ranks` call per world size runs every model in the *same*
ranks; for each model the engines of :mod:`mini_ddp.tools.bench_models` train identical copies on
identical per-rank batches. Engines run in alternating blocks of ``--steps`` steps, the order
rotated every block, so load from other processes hits all engines alike; ratios are medians
of *paired* per-block ratios. A block's time is the median step of its slowest rank. Beside
wall time each step's process CPU time (all threads) is kept: it measures work done, and
suffers less from a busy machine. Memory is measured afterwards, each engine alone: peak RSS
growth while it is built and runs a few steps, and its tensor bytes (params, grads, buckets).
Nothing here asserts a time: the benchmark reports. ``--compile`` adds ``torch.compile``'d
torch DDP and mini_ddp (compiled in the warm-up steps, never timed), reported as the ratio of
compiled mini_ddp to compiled torch DDP.

Usage: ``python -m mini_ddp bench --json bench.json --plot docs/img/bench_sweep.png``
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import logging
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine.config import MIB
from mini_ddp.tools.bench_models import (
    ABLATIONS,
    BENCH_BATCH,
    COMPILED,
    ENGINES,
    MANY_SMALL,
    build_engine,
    memory_report,
    time_startup,
    wrap_engine,
)
from mini_ddp.tools.report import emit_report, time_blocks
from mini_ddp.training.models import ZOO
from mini_ddp.training.spawn import RankContext, run_ranks

logger = logging.getLogger("mini_ddp.tools.bench")


def steady_malloc() -> bool:
    """Stop glibc from handing freed heap back to the OS between steps (all engines alike).

    A training step frees and re-allocates the same gradient-sized blocks. glibc's *dynamic*
    thresholds decide, from the history of the process, whether such a block is trimmed off
    the heap or unmapped when freed; if so, every page of its next allocation faults again
    (~14 000 faults, +28 ms a step for the 20 M MLP, measured). Which engine trips it depends on
    what ran before in the same process, so it would add a systematic error to one engine's
    time. Fixed thresholds (mmap above 32 MiB, trim above 1 GiB) make every engine reuse its
    memory; for training outside the benchmark, glibc's ``MALLOC_TRIM_THRESHOLD_`` /
    ``MALLOC_MMAP_THRESHOLD_`` or jemalloc/tcmalloc do the same. Returns False if not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters, <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 32 * MIB) and libc.mallopt(m_trim_threshold,
                                                                              1 << 30))


_PEAKS = ("peak_rss_growth_MiB", "peak_pss_growth_MiB")  # lowest of rounds, highest of ranks
FIRST_WRAP = ("torch_ddp", "mini_ddp")
"""Engines whose first construction in a rank's process is timed on its own (one sample per
world size: what a script that wraps one model pays; mini_ddp's includes opening the group's
shared-memory channel, which later models on the group reuse)."""


def _bench_rank(ctx: RankContext, jobs: list[dict[str, Any]], malloc: str
                ) -> list[dict[str, Any]]:
    """Rank body: run every job (a model's comparison, or one bucket-cap sweep point)."""
    if malloc == "steady" and not steady_malloc():
        logger.warning("bench: not glibc; --malloc steady has no effect")
    results = []
    for job in jobs:
        spec, batch = ZOO[job["model"]], BENCH_BATCH[job["model"]]
        torch.manual_seed(0)  # the same base model on every rank: no start-up broadcast needed
        base = spec.builder()
        g = torch.Generator().manual_seed(1000 + ctx.rank)
        batches = [spec.make_batch(batch, g) for _ in range(2)]
        if job["compiled"] and isinstance(base, torch.nn.Sequential):
            logger.warning("bench: %s is an nn.Sequential, which torch.compile of a DDP leaves "
                           "eager: its compiled rows time eager engines", job["model"])
        first_wrap: dict[str, float] = {}
        engines = {}
        for n in job["engines"] + job["compiled"]:
            if not results and n in FIRST_WRAP:  # each DDP's first model in this process
                module = copy.deepcopy(base)
                dist.barrier()
                started = time.perf_counter()
                engines[n] = wrap_engine(n, module, job["cap"], job["gabv"], spec.loss)
                first_wrap[n] = time.perf_counter() - started
            else:
                engines[n] = build_engine(n, base, job["cap"], job["gabv"], spec.loss,
                                          job["compile_backend"])
        result: dict[str, Any] = {"blocks": time_blocks(engines, batches, job["steps"],
                                                        job["blocks"], job["warmup"]),
                                  "num_grads": sum(p.requires_grad for p in base.parameters())}
        if first_wrap:
            result["first_wrap"] = first_wrap
        del engines
        if job.get("startup_rounds"):
            result["startup"] = time_startup(base, batches, job["engines"], job["cap"],
                                             job["gabv"], spec.loss, job["startup_rounds"])
        if job["memory"]:  # several rounds, keep each engine's lowest peak (RSS is noisy)
            rounds = [memory_report(base, batches, job["cap"], job["mem_steps"], job["engines"])
                      for _ in range(job["mem_rounds"])]
            result["memory"] = {e: {"tensor_MiB": v["tensor_MiB"], **{key: min(
                (r[e][key] for r in rounds), key=lambda x: x or 0) for key in _PEAKS}}
                for e, v in rounds[0].items()}
        # Whole-process peak since the rank started (KiB on Linux): every engine's copies.
        result["maxrss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results.append(result)
    return results


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4)[::2] if len(values) > 1 else values * 2


def summarize(per_rank: list[dict[str, dict[str, list[float]]]], num_grads: int = 0
              ) -> dict[str, Any]:
    """Medians, paired ratios and exposed communication from every rank's block times.

    With ``num_grads`` (the model's gradient count) and a ``compute`` engine, also each
    engine's cost per gradient: its exposed time (median step minus compute-only's) over the
    number of gradients, in µs.
    """
    names = list(per_rank[0])
    nblocks = len(per_rank[0][names[0]]["wall"])
    wall = {n: [max(r[n]["wall"][b] for r in per_rank) for b in range(nblocks)] for n in names}
    cpu = {n: [statistics.mean(r[n]["cpu"][b] for r in per_rank) for b in range(nblocks)]
           for n in names}

    def paired(series: dict[str, list[float]], a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(series[a], series[b], strict=True))

    out: dict[str, Any] = {
        "median_ms": {n: statistics.median(wall[n]) * 1e3 for n in names},
        "cpu_ms": {n: statistics.median(cpu[n]) * 1e3 for n in names},
        "blocks_ms": {n: [v * 1e3 for v in wall[n]] for n in names}}
    ref = "torch_ddp" if "torch_ddp" in names else None
    if ref:
        out["over_ddp"] = {n: paired(wall, n, ref) for n in names}
        out["cpu_over_ddp"] = {n: paired(cpu, n, ref) for n in names}
        # How sure the median is: the middle half of the paired ratios, and in how many blocks
        # the engine beat torch DDP (a sign test: 15 of 20 happens by chance 2 % of the time).
        out["over_ddp_quartiles"] = {n: _quartiles([x / y for x, y in zip(
            wall[n], wall[ref], strict=True)]) for n in names}
        out["blocks_faster_than_ddp"] = {n: sum(x < y for x, y in zip(wall[n], wall[ref],
                                                                       strict=True))
                                         for n in names}
    if "torch_ddp_compiled" in names:  # compiled engines against compiled torch DDP
        ref = "torch_ddp_compiled"
        compiled = [n for n in names if n in COMPILED]
        out["over_compiled_ddp"] = {n: paired(wall, n, ref) for n in compiled}
        out["over_compiled_ddp_quartiles"] = {n: _quartiles([x / y for x, y in zip(
            wall[n], wall[ref], strict=True)]) for n in compiled}
        out["blocks_faster_than_compiled_ddp"] = {n: sum(x < y for x, y in zip(
            wall[n], wall[ref], strict=True)) for n in compiled}
    if "compute" in names:
        out["over_compute"] = {n: paired(wall, n, "compute") for n in names}
        out["exposed_comm_ms"] = {n: out["median_ms"][n] - out["median_ms"]["compute"]
                                  for n in names}
        if num_grads:  # what the engine adds to compute alone, spread over the gradients
            out["per_grad_us"] = {n: out["exposed_comm_ms"][n] * 1e3 / num_grads
                                  for n in names}
    return out


def summarize_startup(per_rank: list[dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """Start-up times (:func:`~mini_ddp.tools.bench_models.time_startup`): per engine the
    median over rounds of the slowest rank, in ms, and the paired ratio to torch DDP's
    (``over_ddp``: the median of the rounds' ratios; ``over_ddp_range``: their lowest and
    highest, so a reader can tell a difference from noise)."""
    names = list(per_rank[0])
    keys = list(per_rank[0][names[0]])
    rounds = len(per_rank[0][names[0]][keys[0]])
    slowest = {n: {k: [max(r[n][k][i] for r in per_rank) for i in range(rounds)] for k in keys}
               for n in names}
    out: dict[str, Any] = {f"{k}_ms": {n: statistics.median(slowest[n][k]) * 1e3 for n in names}
                           for k in keys}
    if "torch_ddp" in names:
        ratios = {k: {n: [x / y for x, y in zip(slowest[n][k], slowest["torch_ddp"][k],
                                                 strict=True)] for n in names} for k in keys}
        out["over_ddp"] = {k: {n: statistics.median(v) for n, v in per.items()}
                           for k, per in ratios.items()}
        out["over_ddp_range"] = {k: {n: (min(v), max(v)) for n, v in per.items()}
                                 for k, per in ratios.items()}
    return out


def _jobs(args: argparse.Namespace, world_size: int) -> list[dict[str, Any]]:
    common = {"steps": args.steps, "blocks": args.blocks, "warmup": args.warmup,
              "gabv": args.gradient_as_bucket_view, "mem_steps": args.mem_steps,
              "mem_rounds": args.mem_rounds, "compile_backend": args.compile_backend,
              "startup_rounds": args.startup_rounds}
    jobs = [{**common, "kind": "models", "model": m, "cap": args.bucket_cap_mb,
             "engines": args.engines, "memory": not args.no_memory,
             "compiled": list(COMPILED) if args.compile else []} for m in args.models]
    if world_size == args.sweep_world_size:
        jobs += [{**common, "kind": "sweep", "model": args.sweep_model, "cap": cap,
                  "blocks": args.sweep_blocks, "engines": ["torch_ddp", "mini_ddp"],
                  "memory": False, "compiled": [], "startup_rounds": 0}
                 for cap in args.sweep_caps]
    return jobs


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything ``args`` asks for; return the report (what ``--json`` writes)."""
    cpus = os.cpu_count() or 1
    report: dict[str, Any] = {
        "machine": {"cpus": cpus, "platform": platform.platform(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "python": platform.python_version(), "backend": "gloo, CPU, 1 thread/rank",
                    "loadavg_start": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json_path", "plot_path")},
        "results": [], "sweep": []}
    for ws in args.world_sizes:
        jobs = _jobs(args, ws)
        logger.info("world size %d: %d jobs", ws, len(jobs))
        per_rank = run_ranks(_bench_rank, ws, args=(jobs, args.malloc), timeout_s=args.timeout)
        for j, job in enumerate(jobs):
            row = {"world_size": ws, "model": job["model"], "bucket_cap_mb": job["cap"],
                   "oversubscribed": ws > cpus, "num_grads": per_rank[0][j]["num_grads"],
                   **summarize([r[j]["blocks"] for r in per_rank], per_rank[0][j]["num_grads"]),
                   "maxrss_MiB": [r[j]["maxrss_MiB"] for r in per_rank]}
            if "startup" in per_rank[0][j]:
                row["startup"] = summarize_startup([r[j]["startup"] for r in per_rank])
            if "first_wrap" in per_rank[0][j]:  # the slowest rank's, in ms
                row["first_wrap_ms"] = {e: max(r[j]["first_wrap"][e] for r in per_rank) * 1e3
                                        for e in per_rank[0][j]["first_wrap"]}
            if job["memory"]:  # tensors: rank 0's (ranks are alike); RSS: the highest rank
                mems = [r[j]["memory"] for r in per_rank]
                row["memory"] = {e: {**v, **{key: max(
                    (m[e][key] or 0 for m in mems), default=None) for key in _PEAKS}}
                    for e, v in mems[0].items()}
            report["sweep" if job["kind"] == "sweep" else "results"].append(row)
    report["machine"]["loadavg_end"] = os.getloadavg()
    return report


def _cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-".rjust(len(format(0.0, fmt)))


def _engine_row(r: dict[str, Any], e: str) -> str:
    """One table row: ``r`` is one model and world size, ``e`` one engine (or memory variant)."""
    def get(key: str) -> float | None:
        return r.get(key, {}).get(e)

    mem = r.get("memory", {}).get(e, {})
    timed = e in r["median_ms"]
    quart, won = get("over_ddp_quartiles"), get("blocks_faster_than_ddp")
    spread = (f"{quart[0]:.2f}-{quart[1]:.2f} {won:>2}/{len(r['blocks_ms'][e])}"
              if quart and won is not None else "-")
    return (f"  {r['model']:<12}{r['world_size']:>3}{'*' if r['oversubscribed'] else ' '}"
            f"{e:<21}{_cell(get('median_ms'), '8.1f')} {_cell(get('over_ddp'), '5.3f')} "
            f"{spread:>15} "
            f"{_cell(get('over_compute'), '8.2f')} {_cell(get('exposed_comm_ms'), '11.1f')} "
            f"{_cell(get('cpu_ms'), '8.1f')} {_cell(get('cpu_over_ddp'), '8.3f')} "
            f"{_cell(mem.get('tensor_MiB'), '11.1f')} "
            f"{_cell(mem.get('peak_rss_growth_MiB'), '9.0f')} "
            f"{_cell(mem.get('peak_pss_growth_MiB'), '9.0f')}") if timed or mem else ""


def format_report(report: dict[str, Any]) -> str:
    """The tables printed at the end: one row per model, world size and engine; the sweep."""
    m = report["machine"]
    lines = [f"# {m['cpus']} CPUs ({m.get('cpu_capability', '?')}), {m['platform']}, torch "
             f"{m['torch']}, {m['backend']}, load "
             f"avg {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f} (* oversubscribed), "
             f"malloc {report['settings'].get('malloc', 'default')}",
             "# model        ws engine                step ms  /ddp  IQR, blocks<ddp  /compute"
             "  exposed ms   cpu ms"
             "  cpu/ddp  tensor MiB  RSS+ MiB  PSS+ MiB"]
    for r in report["results"]:
        lines += [_engine_row(r, e) for e in r["median_ms"]]
        lines += [_engine_row(r, e) for e in r.get("memory", {}) if e.endswith("+gabv")]
    lines += _per_grad_lines(report["results"]) + _startup_lines(report["results"])
    compiled = [r for r in report["results"] if "over_compiled_ddp" in r]
    if compiled:
        lines.append(f"# torch.compile (backend {report['settings']['compile_backend']}, "
                     "compiled in the warm-up): model, ws, compiled torch DDP ms, compiled "
                     "mini_ddp ms, mini/ddp (paired), IQR, blocks<ddp")
        for r in compiled:
            e = "mini_ddp_compiled"
            quart, won = r["over_compiled_ddp_quartiles"][e], r["blocks_faster_than_compiled_ddp"][e]
            lines.append(f"  {r['model']:<12}{r['world_size']:>3} "
                         f"{r['median_ms']['torch_ddp_compiled']:>10.1f} "
                         f"{r['median_ms'][e]:>10.1f} {r['over_compiled_ddp'][e]:>8.3f} "
                         f"{quart[0]:.2f}-{quart[1]:.2f} {won:>2}/{len(r['blocks_ms'][e])}")
    if report["sweep"]:
        lines.append("# bucket-cap sweep: model, ws, cap MiB, torch DDP ms, mini_ddp ms, "
                     "mini/ddp (paired)")
        for r in report["sweep"]:
            lines.append(f"  {r['model']:<12}{r['world_size']:>3} {r['bucket_cap_mb']:>7g} "
                         f"{r['median_ms']['torch_ddp']:>10.1f} {r['median_ms']['mini_ddp']:>10.1f}"
                         f" {r['over_ddp']['mini_ddp']:>8.3f}")
    return "\n".join(lines)


def _per_grad_lines(results: list[dict[str, Any]]) -> list[str]:
    """The per-gradient table: exposed time over compute alone, per gradient, per engine."""
    rows = [r for r in results if "per_grad_us" in r]
    if not rows:
        return []
    lines = ["# per gradient (exposed ms over compute alone / gradients, in µs): model, ws, "
             "grads, compute ms, then per engine µs/grad (step /ddp, paired)"]
    for r in rows:
        cells = "  ".join(f"{e} {r['per_grad_us'][e]:6.1f} ({r['over_ddp'][e]:.3f})"
                          if "over_ddp" in r else f"{e} {r['per_grad_us'][e]:6.1f}"
                          for e in r["per_grad_us"] if e != "compute")
        lines.append(f"  {r['model']:<18}{r['world_size']:>3} {r['num_grads']:>5} "
                     f"{r['median_ms']['compute']:>8.1f}  {cells}")
    return lines


def _startup_lines(results: list[dict[str, Any]]) -> list[str]:
    """The start-up table: wrapping a fresh copy, its first and second step, per engine; and
    each DDP's first wrap in the process."""
    lines = []
    firsts = [r for r in results if "first_wrap_ms" in r]
    if firsts:
        lines.append("# first wrap in each rank's process (one sample, slowest rank; mini_ddp's "
                     "opens the group's shared-memory channel): model, ws, ms per engine")
        for r in firsts:
            cells = "  ".join(f"{e} {ms:8.1f}" for e, ms in r["first_wrap_ms"].items())
            lines.append(f"  {r['model']:<18}{r['world_size']:>3} {cells}")
    rows = [r for r in results if "startup" in r]
    if not rows:
        return lines
    lines += ["# start-up (median of rounds, slowest rank; later models, the channel reused): "
              "model, ws, engine, construct ms, first step ms, second step ms, each /ddp "
              "(paired; lowest-highest round)"]
    for r in rows:
        st = r["startup"]
        for e in st["construct_ms"]:
            ratio, span = st.get("over_ddp", {}), st.get("over_ddp_range", {})
            cells = "  ".join(f"{st[k + '_ms'][e]:8.1f} " + (
                f"{ratio[k][e]:5.2f} ({span[k][e][0]:.2f}-{span[k][e][1]:.2f})"
                if ratio and span else f"{ratio[k][e]:5.2f}" if ratio else "    -")
                for k in ("construct", "first_step", "second_step"))
            lines.append(f"  {r['model']:<18}{r['world_size']:>3} {e:<12} {cells}")
    return lines


def plot_sweep(report: dict[str, Any], path: str) -> None:
    """PNG: median step time against bucket cap, both engines (log-x)."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    rows = report["sweep"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = [r["bucket_cap_mb"] for r in rows]
    for engine, style in (("torch_ddp", "o-"), ("mini_ddp", "s-")):
        ax.plot(caps, [r["median_ms"][engine] for r in rows], style, label=engine)
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("median step time (ms)")
    m = report["machine"]
    ax.set_title(f"{rows[0]['model']}, world size {rows[0]['world_size']}, {m['cpus']} CPUs, "
                 f"{m['backend']}, load avg {m['loadavg_start'][0]:.1f}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _list(text: str, kind: type = str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``python -m mini_ddp bench``); returns the exit status."""
    p = argparse.ArgumentParser(prog="mini_ddp bench", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet18,mlp20m,transformer",
                   help=f"comma-separated, of {','.join(BENCH_BATCH)}")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated, of {','.join(ENGINES)}; ablations: "
                   f"{','.join(ABLATIONS)}")
    p.add_argument("--world-sizes", default="2,3,4")
    p.add_argument("--steps", type=int, default=1, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=20, help="blocks per engine")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per engine")
    p.add_argument("--mem-steps", type=int, default=3, help="measured steps per engine")
    p.add_argument("--mem-rounds", type=int, default=2, help="memory rounds (lowest kept)")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--sweep-model", default="resnet18")
    p.add_argument("--sweep-world-size", type=int, default=2, help="0: no sweep")
    p.add_argument("--sweep-caps", default="0.25,1,5,25,100")
    p.add_argument("--sweep-blocks", type=int, default=6)
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile(torch DDP) and torch.compile(mini_ddp), "
                   "side by side (their memory is not measured)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of --compile (inductor, aot_eager, ...)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--startup-rounds", type=int, default=3,
                   help="also time wrapping a fresh model and its first two steps, this many "
                   "rounds per engine (0: not)")
    p.add_argument("--many-small", action="store_true",
                   help=f"the per-gradient regime: models {','.join(MANY_SMALL)}, engines "
                   "torch_ddp,mini_ddp,compute, world sizes 2,3, 3 steps x 16 blocks, start-up "
                   "5 rounds, no memory, no sweep (other flags given after it still apply)")
    p.add_argument("--quick", action="store_true",
                   help="1 step x 3 blocks, world size 2, sweep caps 1,25: minutes, not hours")
    p.add_argument("--malloc", choices=("steady", "default"), default="steady",
                   help="steady: fixed glibc thresholds in the ranks, so no engine pays for "
                   "page faults the allocator's history decides (see steady_malloc)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path", help="bucket-sweep PNG")
    p.add_argument("--timeout", type=float, default=7200.0)
    args = p.parse_args(argv)
    if args.many_small:  # a preset: flags the user gave explicitly win
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        preset = {"--models": ("models", ",".join(MANY_SMALL)),
                  "--engines": ("engines", "torch_ddp,mini_ddp,compute"),
                  "--world-sizes": ("world_sizes", "2,3"), "--steps": ("steps", 3),
                  "--blocks": ("blocks", 16), "--startup-rounds": ("startup_rounds", 5),
                  "--sweep-world-size": ("sweep_world_size", 0)}
        for flag, (dest, value) in preset.items():
            if flag not in given:
                setattr(args, dest, value)
        args.no_memory = True
    if args.quick:
        args.steps, args.blocks, args.warmup, args.sweep_blocks = 1, 3, 2, 2
        args.world_sizes, args.sweep_caps = "2", "1,25"
    args.models, args.engines = _list(args.models), _list(args.engines)
    args.world_sizes, args.sweep_caps = _list(args.world_sizes, int), _list(args.sweep_caps, float)
    if bad := (set(args.models) - set(BENCH_BATCH)) | (set(args.engines) - set(ENGINES)
                                                            - set(ABLATIONS)):
        p.error(f"unknown models or engines: {sorted(bad)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = run_benchmark(args)
    emit_report(report, format_report(report), args.json_path, args.plot_path,
                plot_sweep if report["sweep"] else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark Gloo's allreduce against ours, nccl-tests style, with a fitted alpha-beta model.

For each message size (float32, default 1 KiB .. 256 MiB by powers of 4) and each algorithm,
every rank times ``--iters`` back-to-back allreduces after ``--warmup`` untimed ones; the time
reported is the mean over ranks of the per-iteration time (nccl-tests' default ``-a 1``).
Bandwidths follow nccl-tests' definitions (PERFORMANCE.md there)::

    algbw = bytes / time            busbw = algbw · 2(n-1)/n   (allreduce)

busbw is the per-link rate an allreduce implies; it is comparable across world sizes and is
the number to hold against the link's bandwidth. ``tree`` is a binomial reduce plus broadcast,
counted as one allreduce. Beside each measurement we print the alpha-beta prediction, with
alpha and beta *fitted* per algorithm over all sizes (see :mod:`mini_ddp.transport.collectives.cost`).

Usage: ``python -m mini_ddp collective-bench --world-size 2 --max-bytes 64M --json r.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.tools.report import emit_report
from mini_ddp.training.spawn import RankContext, run_ranks
from mini_ddp.transport.collectives import ALLREDUCES
from mini_ddp.transport.collectives.cost import FORMULA_TEXT, fit_alpha_beta, predict

ALGORITHMS = ["gloo", "ring", "halving_doubling", "tree", "naive"]
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"64M"``, ``"4KiB"``, ``"1024"`` -> bytes (binary units)."""
    text = text.strip().upper()
    digits = text.rstrip("BKMGI")
    return int(float(digits) * _UNITS[text[len(digits):]])


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def _gloo_allreduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> None:
    dist.all_reduce(tensor, op, group=group)


def _bench_rank(
    ctx: RankContext, sizes: list[int], algorithms: list[str], iters: int, warmup: int
) -> dict[str, list[float]]:
    """Rank body: seconds per allreduce for each algorithm and size, as seen by this rank."""
    fns = {"gloo": _gloo_allreduce, **ALLREDUCES}
    out: dict[str, list[float]] = {name: [] for name in algorithms}
    for nbytes in sizes:
        # Zeros stay finite under any number of SUMs; float adds cost the same for any value
        # (denormals aside), so the data does not change the timing.
        buf = torch.zeros(nbytes // 4, dtype=torch.float32)
        for name in algorithms:
            for _ in range(warmup):
                fns[name](buf)
            dist.barrier()  # everyone starts the timed loop together
            start = time.perf_counter()
            for _ in range(iters):
                fns[name](buf)
            out[name].append((time.perf_counter() - start) / iters)
    return out


def run_benchmark(
    world_size: int, sizes: list[int], algorithms: list[str], iters: int, warmup: int,
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Measure, fit and return the whole report (the JSON that ``--json`` writes)."""
    per_rank = run_ranks(_bench_rank, world_size, args=(sizes, algorithms, iters, warmup),
                         timeout_s=timeout_s)
    n, factor = world_size, 2 * (world_size - 1) / world_size
    report: dict[str, Any] = {
        "world_size": n, "iters": iters, "warmup": warmup, "sizes": sizes,
        "algorithms": algorithms, "bus_factor": factor,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "backend": "gloo over loopback",
                    "oversubscribed": n > (os.cpu_count() or 1)},
        "fits": {}, "results": [],
    }
    for name in algorithms:
        times = [sum(r[name][i] for r in per_rank) / n for i in range(len(sizes))]
        fit = fit_alpha_beta(name, n, sizes, times)
        report["fits"][name] = {
            "alpha_us": fit.alpha * 1e6, "beta_ns_per_byte": fit.beta * 1e9,
            "inv_beta_GBps": (1e-9 / fit.beta) if fit.beta > 0 else None,
            "rms_rel_error": fit.rms_rel_error, "formula": FORMULA_TEXT[name]}
        for nbytes, t in zip(sizes, times, strict=True):
            algbw = nbytes / t / 1e9
            report["results"].append({
                "algorithm": name, "bytes": nbytes, "time_us": t * 1e6, "algbw_GBps": algbw,
                "busbw_GBps": algbw * factor,
                "model_us": predict(name, n, nbytes, fit.alpha, fit.beta) * 1e6})
    return report


def format_report(report: dict[str, Any]) -> str:
    """The measurement table and the fitted parameters, as printed."""
    m = report["machine"]
    lines = [f"# allreduce, float32, world size {report['world_size']}, {m['cpus']} CPUs"
             f"{' (oversubscribed)' if m['oversubscribed'] else ''}, {m['backend']}, "
             f"iters {report['iters']}, warmup {report['warmup']}, torch {m['torch']}",
             f"# {'size':>9} {'algorithm':>17} {'time(us)':>11} {'algbw(GB/s)':>11} "
             f"{'busbw(GB/s)':>11} {'model(us)':>11} {'model/meas':>10}"]
    rows = sorted(report["results"],
                  key=lambda r: (r["bytes"], report["algorithms"].index(r["algorithm"])))
    for r in rows:
        lines.append(f"  {_human(r['bytes']):>9} {r['algorithm']:>17} {r['time_us']:>11.1f} "
                     f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f} {r['model_us']:>11.1f} "
                     f"{r['model_us'] / r['time_us']:>10.2f}")
    lines.append("# fitted alpha-beta model (beta is per byte sent, incl. reduction: beta+gamma/2)")
    lines.append(f"# {'algorithm':>17} {'alpha(us)':>10} {'beta(ns/B)':>11} {'1/beta(GB/s)':>12} "
                 f"{'rms rel err':>11}  formula")
    for name, f in report["fits"].items():
        inv = f"{f['inv_beta_GBps']:.3f}" if f["inv_beta_GBps"] else "inf"
        lines.append(f"  {name:>17} {f['alpha_us']:>10.1f} {f['beta_ns_per_byte']:>11.4f} "
                     f"{inv:>12} {f['rms_rel_error']:>11.2f}  {f['formula']}")
    return "\n".join(lines)


def plot_report(reports: dict[str, Any] | list[dict[str, Any]], path: str) -> None:
    """Write a PNG of busbw against message size, one panel per report: measured (solid) and
    the fitted alpha-beta model (dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on CI or the cluster
    import matplotlib.pyplot as plt

    reports = [reports] if isinstance(reports, dict) else reports
    fig, axes = plt.subplots(1, len(reports), figsize=(7 * len(reports), 5), squeeze=False)
    for ax, report in zip(axes[0], reports, strict=True):
        factor = report["bus_factor"]
        for i, name in enumerate(report["algorithms"]):
            rows = [r for r in report["results"] if r["algorithm"] == name]
            x = [r["bytes"] for r in rows]
            ax.plot(x, [r["busbw_GBps"] for r in rows], "o-", color=f"C{i}", label=name)
            model = [r["bytes"] / (r["model_us"] * 1e-6) / 1e9 * factor if r["model_us"] > 0
                     else 0.0 for r in rows]
            ax.plot(x, model, "--", color=f"C{i}", alpha=0.5)
        m = report["machine"]
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"allreduce, {report['world_size']} ranks on {m['cpus']} CPUs"
                     f"{' (oversubscribed)' if m['oversubscribed'] else ''}, {m['backend']}\n"
                     "solid: measured, dashed: fitted alpha-beta model", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    else:
        sizes, size = [], parse_bytes(args.min_bytes)
        while size <= parse_bytes(args.max_bytes):
            sizes.append(size)
            size *= args.factor
    return [max(4, s - s % 4) for s in sizes]  # whole float32 elements


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="mini_ddp collective-bench", description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", help="comma-separated sizes, e.g. 1K,64K,4M (overrides the range)")
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--factor", type=int, default=4, help="ratio between consecutive sizes")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHMS)}")
    p.add_argument("--json", dest="json_path", help="write the full report here")
    p.add_argument("--plot", dest="plot_path", help="write a busbw-vs-size PNG here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--replot", nargs="+", metavar="JSON",
                   help="don't measure: print and plot (side by side) earlier --json reports")
    args = p.parse_args(argv)
    if args.replot:
        reports = []
        for path in args.replot:
            with open(path) as f:
                reports.append(json.load(f))
            print(format_report(reports[-1]))
        if args.plot_path:
            plot_report(reports, args.plot_path)
        return 0
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown or args.factor < 2 or args.iters < 1 or args.world_size < 1:
        p.error(f"bad arguments (unknown algorithms: {unknown})" if unknown else
                "need --factor >= 2, --iters >= 1, --world-size >= 1")
    if args.world_size > (os.cpu_count() or 1):
        print(f"note: {args.world_size} ranks on {os.cpu_count()} CPUs: oversubscribed, "
              "ranks share cores, so times include scheduler contention")
    report = run_benchmark(args.world_size, _sizes(args), algorithms, args.iters, args.warmup,
                           timeout_s=args.timeout)
    emit_report(report, format_report(report), args.json_path, args.plot_path, plot_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

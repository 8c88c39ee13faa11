"""Predict step time and exposed communication for bigger worlds, from one measured profile.

The model (the one DDP's design rests on): backward produces gradients in a known order; a
bucket's all-reduce starts once the bucket is full *and* the previous bucket's all-reduce is
done (one channel, buckets in order); communication hides behind the rest of backward and
only what outlasts backward is exposed. Per bucket of ``m`` bytes on ``n`` ranks (ring)::

    allreduce(n, m) = 2(n-1)·alpha + 2(n-1)/n · m · beta

Inputs: a :class:`Profile` measured on ONE rank (world size 1: Gloo's all-reduce is then a
no-op, so every time in it is computation or the reducer's own copying) — forward, when each
parameter's gradient arrived and each bucket filled, the end of backward, the copy of results
back into ``.grad`` and the optimizer step — and a :class:`Network` (alpha, beta), fitted from
an all-reduce sweep or given. Buckets of another cap are re-formed from the per-parameter
arrival times with DDP's own assignment (:func:`mini_ddp.engine.buckets.assign_buckets`).

Like torch DDP, mini_ddp copies every bucket's result back into ``.grad`` after backward;
``overlap=True`` asks "what if each copy ran on the communication thread as its all-reduce
ended" (tried in mini_ddp: no measurable gain on CPU — docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mini_ddp.engine.buckets import assign_buckets
from mini_ddp.engine.config import MIB
from mini_ddp.tools.bench_models import BENCH_BATCH
from mini_ddp.tools.costmodel_inputs import NETWORKS, Network, Profile, profile_to_dict
from mini_ddp.tools.report import emit_report
from mini_ddp.training.spawn import run_ranks
from mini_ddp.transport.collectives.cost import predict as ab_predict


@dataclass
class Prediction:
    """A predicted step: total, the backward it hides behind, what is exposed, comm total."""

    step_s: float
    backward_s: float
    exposed_s: float
    comm_s: float


def allreduce_s(n: int, nbytes: float, net: Network) -> float:
    """Ring all-reduce time (0 for one rank), via :mod:`mini_ddp.transport.collectives.cost`."""
    return ab_predict("ring", n, nbytes, net.alpha, net.beta)


def buckets_for_cap(profile: Profile, cap_mb: float | None) -> tuple[list[float], list[int]]:
    """Ready times and sizes of the buckets DDP would form with ``cap_mb`` (None: measured).

    Re-forms buckets over the arrival order with DDP's rule (an explicit cap applies to the
    first bucket too); a bucket is ready when its last gradient has arrived and been copied in
    (copy-in time estimated from the measured copy-out rate). Gradients are taken as float32,
    as in every benchmark model (the cap counts bytes; only the dtype grouping would differ).
    """
    if cap_mb is None:
        return list(profile.bucket_ready_s), list(profile.bucket_bytes)
    metas = [torch.empty(b // 4, dtype=torch.float32, device="meta") for b in profile.param_bytes]
    layout = assign_buckets(metas, [int(cap_mb * MIB)], order=list(range(len(metas))))
    per_byte = profile.copy_out_s / max(1, sum(profile.param_bytes))
    ready = [max(profile.param_ready_s[i] + profile.param_bytes[i] * per_byte for i in b)
             for b in layout]
    return ready, [sum(profile.param_bytes[i] for i in b) for b in layout]


def predict(profile: Profile, n: int, net: Network, cap_mb: float | None = None,
            overlap: bool = False, compute_scale: float = 1.0) -> Prediction:
    """Simulate one step on ``n`` ranks. ``compute_scale`` stretches all computation (e.g.
    ranks sharing cores: ``n / cores``); communication is the network's alone."""
    ready, sizes = buckets_for_cap(profile, cap_mb)
    total = max(1, sum(sizes))
    backward = profile.backward_s * compute_scale
    channel_free, comm = 0.0, 0.0
    for r, m in zip(ready, sizes, strict=True):
        ar = allreduce_s(n, m, net)
        copy = profile.copy_out_s * compute_scale * m / total if overlap else 0.0
        channel_free = max(r * compute_scale, channel_free) + ar + copy
        comm += ar
    end = max(backward, channel_free)
    if not overlap:  # both engines copy every bucket back after the waits
        end += profile.copy_out_s * compute_scale
    exposed = end - backward - (0.0 if overlap else profile.copy_out_s * compute_scale)
    step = (profile.forward_s + profile.optimizer_s) * compute_scale + end
    return Prediction(step, backward, max(0.0, exposed), comm)


def _measure(args: argparse.Namespace) -> tuple[Profile, Network | None, dict, int]:
    """Profile, fit and step times: measured here, or reused from ``--profile-json``."""
    if args.profile_json:  # re-predict from an earlier report's measurements
        with open(args.profile_json) as f:
            old = json.load(f)
        steps = {}
        for v in old["validation"]:
            steps.setdefault(v["world_size"], {"compute": v["measured_compute_ms"] / 1e3})[
                v["engine"]] = v["measured_ms"] / 1e3
        return Profile(**old["profile"]), Network(**old["network"]), steps, old["cpus"]
    from mini_ddp.tools.costmodel_profile import profile_rank, steps_rank

    profile = Profile(**run_ranks(profile_rank, 1, args=(args.model, args.steps),
                                  timeout_s=args.timeout)[0])
    steps = {}
    for n in args.world_sizes:
        measured = run_ranks(steps_rank, n, args=(profile.model, args.steps),
                             timeout_s=args.timeout)
        steps[n] = {k: max(r[k] for r in measured) for k in measured[0]}
    return profile, None, steps, os.cpu_count() or 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Profile (or load), fit (or take) the network, validate, predict: the JSON report."""
    profile, net, steps, cpus = _measure(args)
    if args.alpha_us is not None and args.beta_gbps is not None:
        net = Network(args.alpha_us * 1e-6, 1e-9 / args.beta_gbps, "given")
    elif net is None:
        from mini_ddp.tools.costmodel_profile import fit_network

        net = fit_network(2)
    report: dict[str, Any] = {"model": profile.model, "cpus": cpus, "network": asdict(net),
                              "profile": profile_to_dict(profile), "validation": [],
                              "predictions": []}
    for n, got in sorted(steps.items()):
        scale = max(1.0, n / cpus)  # ranks sharing cores stretch computation
        p = predict(profile, n, net, compute_scale=scale)  # both engines: the same model
        for engine in ("mini_ddp", "torch_ddp"):
            report["validation"].append({
                "world_size": n, "engine": engine, "compute_scale": scale,
                "measured_ms": got[engine] * 1e3, "predicted_ms": p.step_s * 1e3,
                "error": p.step_s / got[engine] - 1, "measured_compute_ms": got["compute"] * 1e3,
                "predicted_exposed_ms": p.exposed_s * 1e3})
    for key, network in {"fitted": net, **NETWORKS}.items():
        for cap in args.caps:
            for n in args.predict_sizes:
                p = predict(profile, n, network, cap_mb=cap)
                report["predictions"].append({"network": key, "cap_mb": cap, "world_size": n,
                                              **{k[:-2] + "_ms": v * 1e3
                                                 for k, v in asdict(p).items()}})
    return report


def format_report(report: dict[str, Any]) -> str:
    """Validation and prediction tables, as printed."""
    net, pr = report["network"], report["profile"]
    lines = [f"# {report['model']}: forward {pr['forward_s'] * 1e3:.1f} ms, backward "
             f"{pr['backward_s'] * 1e3:.1f} ms, copy-out {pr['copy_out_s'] * 1e3:.1f} ms, "
             f"optimizer {pr['optimizer_s'] * 1e3:.1f} ms, {len(pr['bucket_bytes'])} buckets "
             f"({sum(pr['bucket_bytes']) / MIB:.1f} MiB)",
             f"# network: {net['name']}: alpha {net['alpha'] * 1e6:.1f} us, 1/beta "
             f"{1e-9 / net['beta'] if net['beta'] else float('inf'):.2f} GB/s"]
    if report["validation"]:
        lines.append("# validation: ws engine      measured ms  predicted ms  error  "
                     "(compute scale)")
        for v in report["validation"]:
            lines.append(f"  {v['world_size']:>14} {v['engine']:<10} {v['measured_ms']:>11.1f} "
                         f"{v['predicted_ms']:>13.1f} {v['error']:>+6.1%}  "
                         f"({v['compute_scale']:.2f})")
    lines.append("# predictions: network, cap MiB, world size: step ms / exposed ms")
    rows: dict[tuple, list[str]] = {}
    for p in report["predictions"]:
        rows.setdefault((p["network"], p["cap_mb"]), []).append(
            f"{p['world_size']}: {p['step_ms']:.0f}/{p['exposed_ms']:.0f}")
    for (network, cap), cells in rows.items():
        lines.append(f"  {network:<9} {cap if cap is not None else 'default':>7}  "
                     + "  ".join(cells))
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str) -> None:
    """PNG: predicted step time against world size per network (default caps), compute-only
    step as a floor, and the measured validation points."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, network in enumerate(dict.fromkeys(p["network"] for p in report["predictions"])):
        rows = [p for p in report["predictions"] if p["network"] == network
                and p["cap_mb"] == report["predictions"][0]["cap_mb"]]
        ax.plot([r["world_size"] for r in rows], [r["step_ms"] for r in rows], "o-",
                color=f"C{i}", label=f"{network} (predicted)")
    pr = report["profile"]
    ax.axhline((pr["forward_s"] + pr["backward_s"] + pr["optimizer_s"]) * 1e3, color="gray",
               ls="--", label="computation alone (profile)")
    val = [v for v in report["validation"] if v["engine"] == "mini_ddp"]
    if val:
        ax.plot([v["world_size"] for v in val], [v["measured_ms"] for v in val], "k*",
                ms=10, label=f"measured here ({report['cpus']} CPUs)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{report['model']}: ring all-reduce per bucket, one channel, overlapped "
                 "with backward", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``python -m mini_ddp cost-model``); returns the exit status."""
    p = argparse.ArgumentParser(prog="mini_ddp cost-model", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18", choices=sorted(BENCH_BATCH),
                   help="a benchmark model of the zoo (mini_ddp.training.models)")
    p.add_argument("--steps", type=int, default=5, help="profiled / validated steps")
    p.add_argument("--world-sizes", default="2,3,4", help="measure here and compare ('' none)")
    p.add_argument("--predict-sizes", default="2,4,8,16,32,64,128,256,512,1024")
    p.add_argument("--caps", default="default,1,5,25,100", help="bucket caps in MiB")
    p.add_argument("--alpha-us", type=float, help="with --beta-gbps: skip the fit")
    p.add_argument("--beta-gbps", type=float, help="1/beta in GB/s")
    p.add_argument("--profile-json", help="re-predict from an earlier --json report's "
                   "profile, network and measured steps (measures nothing)")
    p.add_argument("--json", dest="json_path")
    p.add_argument("--plot", dest="plot_path")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.world_sizes = [int(x) for x in args.world_sizes.split(",") if x.strip()]
    args.predict_sizes = [int(x) for x in args.predict_sizes.split(",") if x.strip()]
    args.caps = [None if c.strip() == "default" else float(c) for c in args.caps.split(",")]
    report = run(args)
    emit_report(report, format_report(report), args.json_path, args.plot_path, plot_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Measuring the cost model's inputs here: a one-rank profile, an all-reduce fit, real steps.

* :func:`measure_profile` — one rank (a world-size-1 group, so Gloo's all-reduce is a no-op)
  trains a benchmark model under mini_ddp with a trace recorder on the reducer and keeps, per
  step, forward, every parameter's gradient arrival ("hook"), every bucket's "bucket_ready",
  the end of backward ("finalize_start"), the copy back into ``.grad`` and the optimizer step.
* :func:`fit_network` — alpha/beta of Gloo's all-reduce here, from a size sweep.
* :func:`steps_rank` — real step times (mini_ddp, torch DDP, compute only) to validate against.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.observe.tracing import RecordingObserver
from mini_ddp.tools.bench_models import BENCH_BATCH, build_engine
from mini_ddp.tools.costmodel_inputs import Network, Profile, profile_to_dict
from mini_ddp.tools.report import time_blocks
from mini_ddp.training.models import ZOO, compute_loss
from mini_ddp.training.spawn import RankContext, run_ranks
from mini_ddp.transport.collectives.cost import fit_alpha_beta


class _Recorder(RecordingObserver):
    """A trace recorder on the reducer's observers: keeps ``(time, kind, info)``."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, dict]] = []

    def record(self, kind: str, **info: Any) -> None:
        info.pop("future", None)  # "launch" hands over its future; we need only the time
        self.events.append((time.perf_counter(), kind, info))


def _one_step(engine: Any, batch: Any, rec: _Recorder) -> dict[str, Any]:
    rec.events.clear()
    engine.opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = compute_loss(engine.loss, engine.model(batch[0]), batch[1])
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    engine.opt.step()
    t3 = time.perf_counter()
    first = {k: t for t, k, _ in reversed(rec.events)}  # earliest time of each kind
    return {"forward": t1 - t0, "backward": first["finalize_start"] - t1,
            "copy_out": t2 - first["finalize_start"], "optimizer": t3 - t2,
            "hooks": {i["param"]: t - t1 for t, k, i in rec.events if k == "hook"},
            "buckets": {i["bucket"]: t - t1 for t, k, i in rec.events if k == "bucket_ready"}}


def measure_profile(model: str, steps: int = 5, warmup: int = 3) -> Profile:
    """Profile ``model`` (a :data:`mini_ddp.tools.bench_models.BENCH_BATCH` key) on a world-size-1
    process group that must already exist: medians over ``steps`` steps."""
    spec = ZOO[model]
    torch.manual_seed(0)
    engine = build_engine("mini_ddp", spec.builder(), None, False, spec.loss)
    batch = spec.make_batch(BENCH_BATCH[model], torch.Generator().manual_seed(0))
    rec = _Recorder()
    for _ in range(warmup):  # the bucket rebuild happens before forward 2
        engine.step(batch)
    reducer = engine.model.reducer
    reducer.observers.add(rec)
    runs = [_one_step(engine, batch, rec) for _ in range(steps)]
    reducer.observers.remove(rec)
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    order = sorted(runs[0]["hooks"], key=lambda i: runs[0]["hooks"][i])
    position = {p: k for k, p in enumerate(order)}
    return Profile(
        forward_s=med("forward"), backward_s=med("backward"), copy_out_s=med("copy_out"),
        optimizer_s=med("optimizer"),
        param_ready_s=[statistics.median(r["hooks"][i] for r in runs) for i in order],
        param_bytes=[reducer.params[i].numel() * reducer.params[i].element_size()
                     for i in order],
        bucket_ready_s=[statistics.median(r["buckets"][b.index] for r in runs)
                        for b in reducer.layout.buckets],
        bucket_bytes=[b.nbytes for b in reducer.layout.buckets],
        bucket_params=[[position[i] for i in b.param_indices] for b in reducer.layout.buckets],
        model=model)


def profile_rank(ctx: RankContext, model: str, steps: int) -> dict[str, Any]:
    return profile_to_dict(measure_profile(model, steps))


def _sweep_rank(ctx: RankContext, sizes: list[int], iters: int) -> list[float]:
    times = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        dist.all_reduce(buf)  # warm-up (connections, allocation)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        times.append((time.perf_counter() - start) / iters)
    return times


def steps_rank(ctx: RankContext, model: str, steps: int) -> dict[str, float]:
    """Median step time of mini_ddp, torch DDP and compute only, alternating step by step."""
    spec = ZOO[model]
    torch.manual_seed(0)
    base = spec.builder()
    batches = [spec.make_batch(BENCH_BATCH[model], torch.Generator().manual_seed(ctx.rank))]
    engines = {n: build_engine(n, base, None, False, spec.loss)
               for n in ("mini_ddp", "torch_ddp", "compute")}
    blocks = time_blocks(engines, batches, steps=1, blocks=steps, warmup=3)
    return {n: statistics.median(v["wall"]) for n, v in blocks.items()}


def fit_network(world_size: int = 2, sizes: list[int] | None = None, iters: int = 5) -> Network:
    """alpha/beta of this machine's Gloo all-reduce, fitted on ``world_size`` ranks."""
    sizes = sizes or [4 ** k * 1024 for k in range(1, 9)]  # 4 KiB .. 64 MiB
    per_rank = run_ranks(_sweep_rank, world_size, args=(sizes, iters), timeout_s=600)
    times = [max(r[i] for r in per_rank) for i in range(len(sizes))]
    fit = fit_alpha_beta("ring", world_size, sizes, times)
    return Network(fit.alpha, fit.beta, f"Gloo loopback, fitted on {world_size} ranks "
                   f"(rms rel. error {fit.rms_rel_error:.2f})")

"""mini_ddp on a CUDA machine: what one GPU can prove, row by row, each row bounded.

Run it through ``scripts/gpu_check.sh`` (``PYTHONPATH=src``, unbuffered, ``${PYTHON:-python3}``).
The header (GPU, driver, CUDA, NCCL, torch, Python, commit) is written first; then every case
prints its row and appends it to ``$OUT/gpu_check.txt`` (``./gpu_check.txt`` without ``OUT``)
as soon as it has finished. Each case runs in fresh rank processes (:func:`mini_ddp.run_ranks`)
with a 60 s bound, so a hang or a crash costs one FAIL row, not the run; the whole run stops
starting cases after ``--budget-s`` (240 s). Rows are PASS, FAIL, INFO (a fact, e.g. what NCCL
refuses) or SKIP (the budget ran out). Sections:

nccl      NCCL. Whether NCCL allows two ranks on one GPU (it does not: an INFO row, and the
          multi-rank NCCL rows need two GPUs); world size 1 parity with torch DDP, bitwise —
          trivial arithmetic (the all-reduce is a copy), real CUDA paths.
semantics NCCL's futures complete at launch: the bounded wait, GradSyncTimeout and the stall
          warning must still see a collective the GPU has not run (widened with
          ``torch.cuda._sleep``); the forward's buffer broadcast must not block the host unless
          ``sync_timeout_s`` was set; CPU inputs are copied as torch DDP copies them; the
          used-parameter map lives in pinned host memory; the trace's all-reduce ends and the
          logging data's durations come from CUDA events (the GPU's time, not the launch's).
streams   both engines inside a side stream, GPU sleeps before forward and backward, gradients
          snapshotted before ``step()``: mini_ddp vs torch DDP bitwise (NCCL ws=1, Gloo ws=2).
gloo      Gloo on CUDA tensors, 2 and 3 ranks sharing cuda:0: bf16 mixed_precision,
          find_unused_parameters, static_graph, the fp16 compress hook, a BatchNorm model and
          plain buckets, bitwise vs torch DDP.
local     ``mini_ddp.transport.local_comm`` and ``MultiDeviceDataParallel`` on the visible GPUs
          (trivial with one GPU: said in the row).

``--cpu-dry-run`` runs the same cases with Gloo and CPU tensors (GPU sleeps and side streams
become no-ops, and each row checks what the CPU can show): the test suite runs it, so the
script cannot rot. Exit status: 0 no FAIL, 1 a FAIL, 2 no torch or no CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

try:
    import torch
except ImportError as err:
    print(f"gpu_check: cannot import torch ({err}); install torch for this python3 first.")
    sys.exit(2)
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import mini_ddp
from mini_ddp import DataParallelModel, GradSyncTimeout, RanksFailed, run_ranks
from mini_ddp.engine.multi_device import MultiDeviceDataParallel
from mini_ddp.observe.spans import spans
from mini_ddp.observe.tracing import trace
from mini_ddp.transport import local_comm
from mini_ddp.transport.wait import wait_done

# Deterministic cuBLAS, so that two identical computations give identical bits.
RANK_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
CASE_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 30.0  # NCCL answers "two ranks, one GPU" within seconds, or not at all
TINY_CAP = 0.0001  # MiB: about one parameter per bucket
Row = tuple[str, str, str]  # (status, name, detail); status PASS / FAIL / INFO / SKIP
TRIVIAL_WS1 = "trivial arithmetic at world size 1 (the all-reduce is a copy); CUDA paths real"


# ---- what differs between the GPU run and the CPU dry run ------------------------------------
def _deterministic() -> None:
    # warn_only: an op without a deterministic kernel should show up as a parity failure with
    # a warning in the log, not as a crash of the case.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9 spelling: no TF32 anywhere
        torch.backends.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def _place(gpu: bool, rank: int, share: bool) -> torch.device:
    """This rank's device: cuda:0 for every rank when ``share``, else one GPU per rank."""
    _deterministic()
    if not gpu:
        return torch.device("cpu")
    index = 0 if share else rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


_CYCLES_PER_S: list[float] = []


def _gpu_sleep(gpu: bool, seconds: float) -> None:
    """Keep the current stream busy for ``seconds`` (no-op in the dry run): widens races."""
    if not gpu:
        return
    if not _CYCLES_PER_S:  # calibrate once per process
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10**7)
        end.record()
        end.synchronize()
        _CYCLES_PER_S.append(10**7 / (start.elapsed_time(end) / 1000))
    torch.cuda._sleep(int(seconds * _CYCLES_PER_S[0]))


def _side_stream(gpu: bool) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(torch.cuda.Stream()) if gpu else contextlib.nullcontext()


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


class _NoOp:
    """Stands in for torch's accelerator streams and events alike (dry run only)."""

    def __enter__(self) -> _NoOp:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None  # wait_stream, record, wait, ...


def _cpu_streams_for_mixed_precision() -> None:
    """torch DDP's mixed precision makes accelerator streams even on CPU, where they would
    fail: no-op stand-ins in the dry run (CPU runs every operation in program order)."""
    torch.Stream = torch.Event = lambda *a, **k: _NoOp()
    torch.accelerator.current_stream = lambda *a, **k: _NoOp()


# ---- models and data -------------------------------------------------------------------------
class _SometimesUsed(nn.Module):
    """``never`` is unused everywhere, ``sometimes`` only on rank 0 (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.a, self.sometimes, self.b = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.never = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if dist.get_rank() == 0:
            h = h + torch.tanh(self.sometimes(h))
        return self.b(h)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    if kind == "wide":  # enough work per kernel that a missing stream wait would show
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    if kind == "unused":
        return _SometimesUsed()
    if kind == "bn":
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                             nn.Linear(8 * 14 * 14, 10))
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 12 * 12, 10))


def _data(kind: str, seed: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + seed)
    shape = {"wide": (size, 512), "cnn": (size, 3, 16, 16), "bn": (size, 3, 16, 16)}.get(
        kind, (size, 32))
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (size,), generator=g)


def _first_difference(tag: str, ours: nn.Module, theirs: nn.Module, grads: bool) -> str | None:
    """The first tensor that is not bitwise equal, or None."""
    if grads:
        pairs = [(n, p.grad, q.grad) for (n, p), q in
                 zip(ours.named_parameters(), theirs.parameters(), strict=True)]
    else:
        pairs = [(n, p, q) for (n, p), q in zip(
            [*ours.named_parameters(), *ours.named_buffers()],
            [*theirs.parameters(), *theirs.buffers()], strict=True)]
    for name, a, b in pairs:
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            return f"{tag}: {'grad of ' if grads else ''}{name} differs"
    return None


# ---- rank functions: each returns its rows ---------------------------------------------------
def parity(ctx, gpu: bool, share: bool, kind: str, options: dict, extra: str | None,
           steps: int = 3) -> list[Row]:
    """torch DDP and DataParallelModel side by side; grads, weights and buffers bitwise."""
    device = _place(gpu, ctx.rank, share)
    options = dict(options)
    if gpu:
        options["device_ids"] = [device.index]
    if extra == "bf16":
        if not gpu:
            _cpu_streams_for_mixed_precision()
        from torch.nn.parallel.distributed import _MixedPrecision  # private: as torch DDP
        options["mixed_precision"] = _MixedPrecision(torch.bfloat16, torch.float32,
                                                     torch.bfloat16)
    theirs, ours = (cls(_model(kind).to(device), **options) for cls in (DDP, DataParallelModel))
    if extra == "fp16_hook":
        for engine in (theirs, ours):
            engine.register_comm_hook(None, default_hooks.fp16_compress_hook)
    notes = []
    if extra == "used_map":  # the map torch DDP keeps in pinned host memory (local_used_map_)
        local = ours.reducer.unused_search.local_used
        pinned_ok = local.device.type == "cpu" and (local.is_pinned() or not gpu)
        notes.append(f"used map on {local.device.type}, pinned={local.is_pinned()}")
        if not pinned_ok:
            return [("FAIL", "", "; ".join(notes))]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]

    def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float(), y)

    bad = None
    if extra == "bf16":  # torch's first mixed-precision iteration is not reproducible
        x, y = _data(kind, 999 + ctx.rank)
        for engine in (ours, theirs):
            loss_of(engine(x.to(device)), y.to(device)).backward()
            engine.zero_grad(set_to_none=True)
    for step in range(steps):
        x, y = _data(kind, step * ctx.world_size + ctx.rank)
        for engine, opt in zip((ours, theirs), opts, strict=True):
            opt.zero_grad()
            loss_of(engine(x.to(device)), y.to(device)).backward()
        bad = bad or _first_difference(f"step {step}", ours.module, theirs.module, True)
        for opt in opts:
            opt.step()
        bad = bad or _first_difference(f"step {step}", ours.module, theirs.module, False)
    notes.append(bad or f"bitwise over {steps} steps")
    return [("FAIL" if bad else "PASS", "", "; ".join(notes))]


def streams(ctx, gpu: bool, share: bool, steps: int = 4) -> list[Row]:
    """Both engines inside one side stream, GPU sleeps before forward and backward, gradients
    cloned right after backward (no host sync): a missing stream wait reads stale data."""
    device = _place(gpu, ctx.rank, share)
    ids = [device.index] if gpu else None
    runs = []
    for cls in (DataParallelModel, DDP):
        model = cls(_model("wide").to(device), device_ids=ids)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        grads = []
        with _side_stream(gpu):
            for step in range(steps):
                x, y = _data("wide", step * ctx.world_size + ctx.rank, 128)
                opt.zero_grad()
                _gpu_sleep(gpu, 0.02)
                loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
                _gpu_sleep(gpu, 0.02)
                loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
            weights = [p.detach().clone() for p in model.parameters()]
        _sync(gpu)
        runs.append((grads, weights))
    (g_ours, w_ours), (g_ddp, w_ddp) = runs
    bad = [s for s in range(steps) if not all(
        torch.equal(a, b) for a, b in zip(g_ours[s], g_ddp[s], strict=True))]
    same_w = all(torch.equal(a, b) for a, b in zip(w_ours, w_ddp, strict=True))
    detail = (f"grads differ from torch DDP at steps {bad}" if bad else
              "weights differ from torch DDP" if not same_w else
              f"bitwise vs torch DDP over {steps} steps" + (
                  ", 20 ms GPU sleeps before forward and backward" if gpu else ""))
    return [("PASS" if not bad and same_w else "FAIL", "", detail)]


def nccl_wait(ctx, gpu: bool) -> list[Row]:
    """The one bounded wait on a collective the GPU has not run yet (1 s of GPU sleep first)."""
    device = _place(gpu, ctx.rank, share=False)
    sleep_s, rows = 1.0, []
    for path in ("CUDA event", "work.is_completed()"):
        t = torch.ones(1024, device=device)
        _gpu_sleep(gpu, sleep_s)
        work = dist.all_reduce(t, async_op=True)
        future = work.get_future()
        done_at_launch = future.done()
        by_work = work if path != "CUDA event" else None
        start = time.monotonic()
        early = wait_done(future, 0.2, work=by_work)
        slow: list[float] = []
        full = wait_done(future, 30.0, stall_after_s=0.3, work=by_work,
                         on_slow=lambda s=start, seen=slow: seen.append(time.monotonic() - s))
        waited = time.monotonic() - start
        work.wait()
        _sync(gpu)
        if gpu:
            ok = not early and full and waited >= 0.6 * sleep_s and len(slow) == 1
        else:
            ok = early and full and not slow  # CPU: done on the host means done
        rows.append(("PASS" if ok else "FAIL", f"through {path}",
                     f"future done at launch: {done_at_launch}; 0.2 s deadline "
                     f"{'held' if not early else 'not needed'}; full wait {waited:.2f} s, "
                     f"stall calls {len(slow)}" + (f" (GPU slept {sleep_s} s)" if gpu else "")))
    return rows


def grad_timeout(ctx, gpu: bool) -> list[Row]:
    """sync_timeout_s=0.5 while the GPU sleeps 2 s before backward: GradSyncTimeout on NCCL."""
    device = _place(gpu, ctx.rank, share=False)
    model = DataParallelModel(_model("mlp").to(device), sync_timeout_s=0.5,
                              stall_warning_s=None, device_ids=[device.index] if gpu else None)
    x, y = _data("mlp", 0)
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    _gpu_sleep(gpu, 2.0)
    start = time.monotonic()
    try:
        loss.backward()
        raised = None
    except GradSyncTimeout as err:
        raised = str(err).splitlines()[0][:120]
    waited = time.monotonic() - start
    _sync(gpu)
    ok = (raised is not None) if gpu else raised is None
    return [("PASS" if ok else "FAIL", "",
             f"raised after {waited:.2f} s: {raised}" if raised else
             f"backward finished in {waited:.2f} s, no timeout")]


def stall_warning(ctx, gpu: bool) -> list[Row]:
    """stall_warning_s=0.3 while the GPU sleeps 1.5 s before backward: the WARNING is logged."""
    device = _place(gpu, ctx.rank, share=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("mini_ddp").addHandler(handler)
    model = DataParallelModel(_model("mlp").to(device), stall_warning_s=0.3, sync_timeout_s=30,
                              device_ids=[device.index] if gpu else None)
    x, y = _data("mlp", 0)
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    _gpu_sleep(gpu, 1.5)
    loss.backward()
    _sync(gpu)
    stalls = [r.getMessage() for r in records if "stall" in r.getMessage()]
    ok = bool(stalls) if gpu else not stalls
    return [("PASS" if ok else "FAIL", "",
             f"{len(stalls)} stall warning(s): {stalls[0].splitlines()[0][:100]}" if stalls
             else "no stall warning (nothing was slow)")]


def buffer_broadcast(ctx, gpu: bool) -> list[Row]:
    """Host time of a forward with BatchNorm buffers while the GPU sleeps 1 s: torch DDP and
    mini_ddp by default must not block; with sync_timeout_s set, mini_ddp waits (bounded)."""
    device = _place(gpu, ctx.rank, share=False)
    ids, sleep_s, times = ([device.index] if gpu else None), 1.0, {}
    for name, cls, kw in (("torch DDP", DDP, {}), ("mini_ddp", DataParallelModel, {}),
                          ("mini_ddp sync_timeout_s=30", DataParallelModel,
                           {"sync_timeout_s": 30.0})):
        model = cls(_model("bn").to(device), device_ids=ids, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = (t.to(device) for t in _data("bn", ctx.rank))
        for _ in range(2):  # past the bucket rebuild
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        _sync(gpu)
        _gpu_sleep(gpu, sleep_s)
        start = time.monotonic()
        out = model(x)
        times[name] = time.monotonic() - start
        nn.functional.cross_entropy(out, y).backward()
        _sync(gpu)
    shown = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in times.items())
    if not gpu:
        return [("PASS", "", f"ran all three (dry run: nothing to block on): {shown}")]
    ok = (times["torch DDP"] < 0.3 * sleep_s and times["mini_ddp"] < 0.3 * sleep_s
          and times["mini_ddp sync_timeout_s=30"] >= 0.5 * sleep_s)
    return [("PASS" if ok else "FAIL", "", f"forward host time, GPU asleep {sleep_s} s: {shown}")]


def device_timings(ctx, gpu: bool) -> list[Row]:
    """The GPU asleep 0.5 s before backward: the trace's all-reduces must end after it, and
    backward_compute_time in the logging data (torch DDP's and ours) must include it."""
    device = _place(gpu, ctx.rank, share=False)
    ids, sleep_s, compute, rows = ([device.index] if gpu else None), 0.5, {}, []
    for name, cls in (("torch DDP", DDP), ("mini_ddp", DataParallelModel)):
        model = cls(_model("mlp").to(device), device_ids=ids, bucket_cap_mb=TINY_CAP)
        x, y = (t.to(device) for t in _data("mlp", ctx.rank))
        with contextlib.ExitStack() as stack:
            rec = stack.enter_context(trace(model)) if cls is DataParallelModel else None
            loss = nn.functional.cross_entropy(model(x), y)
            _gpu_sleep(gpu, sleep_s)
            loss.backward()
            model(x)  # the next forward publishes the sampled iteration's times
        _sync(gpu)
        compute[name] = model._get_ddp_logging_data().get("backward_compute_time", 0) / 1e9
        if rec is not None:
            comm = [s for s in spans(rec.snapshot()) if s.track.startswith("bucket")
                    and s.name.startswith("all-reduce")]
            clocks = sorted({s.args["clock"] for s in comm})
            longest = max((s.end - s.start) / 1e9 for s in comm) if comm else 0.0
            ok = bool(comm) and clocks == (["device"] if gpu else ["host"]) and (
                longest >= 0.6 * sleep_s if gpu else True)
            rows.append((_status(ok), "trace all-reduce ends",
                         f"{len(comm)} all-reduces, clock {', '.join(clocks)}, longest "
                         f"launch-to-end {longest * 1000:.0f} ms" +
                         (f" (GPU slept {sleep_s} s)" if gpu else " (dry run: host clock)")))
    shown = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in compute.items())
    ok = all(v >= 0.6 * sleep_s for v in compute.values()) if gpu else all(
        v >= 0 for v in compute.values())
    rows.append((_status(ok), "logging-data backward_compute_time", shown +
                 (f" (GPU slept {sleep_s} s)" if gpu else " (dry run: host clock)")))
    return rows


def input_copy(ctx, gpu: bool) -> list[Row]:
    """A pinned CPU input overwritten right after forward returns (the GPU asleep 0.5 s
    meanwhile): the output must be that of the original input, as under torch DDP."""
    device = _place(gpu, ctx.rank, share=False)
    rows = []
    for name, cls in (("mini_ddp", DataParallelModel), ("torch DDP", DDP)):
        model = cls(_model("mlp").to(device), device_ids=[device.index] if gpu else None)
        x, _ = _data("mlp", ctx.rank)
        with torch.no_grad():
            expected = model.module(x.to(device))
        host = x.pin_memory() if gpu else x.clone()
        _gpu_sleep(gpu, 0.5)
        start = time.monotonic()
        with torch.no_grad():
            out = model(host)
        host.fill_(math.nan)  # the caller reuses its buffer
        took = time.monotonic() - start
        _sync(gpu)
        rows.append((name, torch.equal(out, expected), took))
    ok = rows[0][1]
    return [("PASS" if ok else "FAIL", "", "; ".join(
        f"{n}: output {'of the original input' if same else 'CORRUPTED'} "
        f"(forward {t * 1000:.0f} ms)" for n, same, t in rows))]


def duplicate_gpu_probe(ctx, gpu: bool) -> list[Row]:
    """Two NCCL ranks; with one GPU both land on cuda:0 (run_ranks' barrier is the first op)."""
    device = _place(gpu, ctx.rank, share=False)
    t = torch.ones(4, device=device)
    dist.all_reduce(t)
    return [("PASS", "", f"{ctx.world_size} ranks all-reduced on {device} through "
                         f"{dist.get_backend()}")]


def local_comm_rows(ctx, gpu: bool) -> list[Row]:
    """Every local_comm function on the GPUs (or 3 CPU devices) vs the CPU implementation."""
    _deterministic()
    n = torch.cuda.device_count() if gpu else 3
    devices, cpu = (list(range(n)) if gpu else ["cpu"] * n), ["cpu"] * n
    note = " (trivial: one GPU)" if gpu and n == 1 else ""
    g = torch.Generator().manual_seed(3)
    host = [torch.randn(300, generator=g), torch.randn(4, 5, generator=g, dtype=torch.float64),
            torch.arange(7), torch.randn(1000, generator=g)]
    got = local_comm.broadcast_coalesced([t.to("cuda:0" if gpu else "cpu") for t in host],
                                         devices, buffer_size=1024)
    ref = local_comm.broadcast_coalesced(host, cpu, buffer_size=1024)
    ok = all(_all_same(a, b) for a, b in zip(got, ref, strict=True))
    rows = [(_status(ok), f"broadcast_coalesced to {n} device(s)", "bitwise vs CPU" + note)]
    per_device = [[(t * (i + 1)).to(d) for t in host] for i, d in enumerate(devices)]
    got = local_comm.reduce_add_coalesced(per_device, devices[0], buffer_size=1024)
    ref = local_comm.reduce_add_coalesced([[t.cpu() for t in p] for p in per_device], "cpu",
                                          buffer_size=1024)
    exact = n <= 2  # two addends: any order gives the same bits; NCCL may reorder more
    rows.append((_status(_all_same(got, ref, exact)), f"reduce_add_coalesced over {n} device(s)",
                 ("bitwise vs CPU" if exact else "allclose vs CPU (NCCL's order)") + note))
    batch = torch.randn(11, 3, generator=g)
    for source in ["cpu"] + (["cuda:0"] if gpu else []):
        got = local_comm.scatter(batch.to(source), devices)
        ok = _all_same(got, local_comm.scatter(batch, cpu))
        ok = ok and torch.equal(local_comm.gather(got, "cpu"), batch)
        if gpu:
            ok = ok and torch.equal(local_comm.gather(got, 0).cpu(), batch)
        rows.append((_status(ok), f"scatter from {source} + gather, {n} device(s)",
                     "bitwise vs CPU" + note))
    return rows


def injected_raise(ctx, gpu: bool) -> list[Row]:
    """``--inject raise``: a case that fails, to see the harness report it as one row."""
    raise RuntimeError("injected failure (--inject raise)")


def injected_hang(ctx, gpu: bool) -> list[Row]:
    """``--inject hang``: a case that never returns, to see the per-case bound end it."""
    time.sleep(3600)
    return []


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _all_same(got: list, ref: list, exact: bool = True) -> bool:
    """Same length, dtypes and values (bitwise, or allclose when ``exact`` is False)."""
    close = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return len(got) == len(ref) and all(
        a.dtype == b.dtype and close(a.cpu(), b) for a, b in zip(got, ref, strict=True))


def multi_device(ctx, gpu: bool, steps: int = 3) -> list[Row]:
    """MultiDeviceDataParallel over the GPUs vs one device training on the whole batch."""
    primary = _place(gpu, 0, share=True)
    n = torch.cuda.device_count() if gpu else 3
    ids = list(range(n)) if gpu else ["cpu"] * n
    model = MultiDeviceDataParallel(_model("cnn").to(primary), device_ids=ids)
    ref = _model("cnn").to(primary)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    worst = 0.0
    for step in range(steps):
        x, y = _data("cnn", step, 12)
        for net, opt in zip((model, ref), opts, strict=True):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x.to(primary)), y.to(primary)).backward()
            opt.step()
        worst = max(worst, max((p - q).abs().max().item() for p, q in
                               zip(model.parameters(), ref.parameters(), strict=True)))
    exact = n == 1  # one device: MDP runs the module itself, so the bits must match
    ok = worst == 0.0 if exact else worst < 1e-5
    note = " (trivial: one GPU, the module runs itself)" if gpu and n == 1 else ""
    return [(_status(ok), f"over {n} device(s)",
             f"max |weight diff| {worst:.2e} after {steps} steps{note}")]


# ---- the cases, their runner and the report --------------------------------------------------
@dataclass
class Case:
    section: str
    name: str
    fn: Callable
    world: int
    backend: str = "gloo"  # "nccl": NCCL on the GPU, Gloo in the dry run
    args: tuple = ()
    note: str = ""  # appended to the detail: why the row proves less than it seems


def _parity_cases(section: str, backend: str, world: int, share: bool, note: str = "",
                  full: bool = True) -> list[Case]:
    plain = [("mlp", {}, None, "mlp, default cap"),
             ("mlp", {"bucket_cap_mb": TINY_CAP, "gradient_as_bucket_view": True}, None,
              "mlp, tiny cap, gradient_as_bucket_view"),
             ("cnn", {"bucket_cap_mb": TINY_CAP}, None, "cnn, tiny cap")]
    features = [("bn", {}, None, "BatchNorm (buffer broadcast)"),
                ("unused", {"find_unused_parameters": True}, "used_map",
                 "find_unused_parameters"),
                ("mlp", {"static_graph": True}, None, "static_graph"),
                ("mlp", {}, "bf16", "mixed_precision bf16"),
                ("mlp", {"bucket_cap_mb": TINY_CAP}, "fp16_hook", "fp16_compress_hook")]
    chosen = plain + features if full else plain[:1] + features[:2]
    return [Case(section, f"{backend} ws={world} {name}", parity, world, backend,
                 (share, kind, options, extra), note)
            for kind, options, extra, name in chosen]


def build_cases(gpu: bool) -> list[Case]:
    """Every case but the NCCL multi-rank ones (added once the probe has said yes)."""
    cases = _parity_cases("nccl", "nccl", 1, False, TRIVIAL_WS1)
    cases += [
        Case("semantics", "bounded wait on a collective the GPU has not run", nccl_wait, 1,
             "nccl"),
        Case("semantics", "GradSyncTimeout with sync_timeout_s=0.5, GPU asleep 2 s",
             grad_timeout, 1, "nccl"),
        Case("semantics", "stall warning with stall_warning_s=0.3, GPU asleep 1.5 s",
             stall_warning, 1, "nccl"),
        Case("semantics", "forward's buffer broadcast does not block the host",
             buffer_broadcast, 1, "nccl"),
        Case("semantics", "CPU input reused right after forward (blocking copy)",
             input_copy, 1, "nccl"),
        Case("semantics", "times from CUDA events, GPU asleep 0.5 s", device_timings, 1,
             "nccl"),
        Case("streams", "nccl ws=1 side stream + GPU sleeps", streams, 1, "nccl", (False,),
             TRIVIAL_WS1),
        Case("streams", "gloo ws=2 on one GPU, side stream + GPU sleeps", streams, 2, "gloo",
             (True,)),
    ]
    for world in (2, 3):
        cases += _parity_cases("gloo", "gloo", world, True,
                               "2 processes share cuda:0" if world == 2 and gpu else "")
    cases += [Case("local", "local_comm", local_comm_rows, 1, "nccl"),
              Case("local", "MultiDeviceDataParallel", multi_device, 1, "nccl")]
    return cases


class Report:
    """The header and the rows, printed and appended to the report file as they come."""

    def __init__(self, path: str):
        self.path = path
        self.counts = {"PASS": 0, "FAIL": 0, "INFO": 0, "SKIP": 0}
        with open(path, "w"):
            pass

    def write(self, text: str) -> None:
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")

    def row(self, status: str, section: str, name: str, detail: str) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1
        self.write(f"{status:<4}  {section:<9} {name:<58} {detail}")


def run_case(case: Case, gpu: bool, report: Report, deadline: float) -> list[Row]:
    """Run one case in fresh ranks, bounded; report its rows (one FAIL row if it failed)."""
    left = deadline - time.monotonic()
    if left < 10:
        report.row("SKIP", case.section, case.name, "not run: the time budget is spent")
        return []
    backend = case.backend if gpu else "gloo"
    start = time.monotonic()
    try:
        per_rank = run_ranks(case.fn, case.world, args=(gpu, *case.args), backend=backend,
                             env=RANK_ENV, timeout_s=min(CASE_TIMEOUT_S, left),
                             collective_timeout_s=CASE_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - one failing case is one failing row
        text = str(err) if isinstance(err, RanksFailed) else traceback.format_exc()
        report.row("FAIL", case.section, case.name, _headline(text))
        report.write("\n".join("      | " + line for line in text.strip().splitlines()[-30:]))
        return [("FAIL", case.name, text)]
    took = time.monotonic() - start
    rows = []
    for position, (status, name, detail) in enumerate(per_rank[0]):
        failed = [(r, rows_r[position]) for r, rows_r in enumerate(per_rank)
                  if rows_r[position][0] == "FAIL"]
        if failed:
            rank, (status, name, detail) = failed[0]
            detail = f"rank {rank}: {detail}"
        full_name = f"{case.name} {name}".strip()
        if not gpu:  # the dry run's NCCL cases run on Gloo: say so in every row
            full_name = full_name.replace("nccl ws=", "nccl(gloo) ws=")
        note = f" [{case.note}]" if case.note and gpu else ""
        report.row(status, case.section, full_name, f"{detail}{note} ({took:.1f} s)")
        rows.append((status, full_name, detail))
    return rows


def _headline(text: str) -> str:
    """The line of a rank failure that says what went wrong."""
    if "still running after the deadline" in text:
        return f"hung: still running after {CASE_TIMEOUT_S:.0f} s (stack below)"
    errors = [line.strip() for line in text.splitlines()
              if re.match(r"\s*[\w.]+(Error|Exception|Timeout|Failed)\b", line)]
    return (errors[-1] if errors else text.strip().splitlines()[-1])[:200]


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "n/a (no git checkout)"
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "n/a (no git)"


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module\s+([\d.]+)", f.read())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "n/a"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "n/a"


def environment(gpu: bool) -> list[str]:
    """Header lines: what ran, where, with which versions."""
    lines = [f"mini_ddp GPU check, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
             f"commit {_git_commit()}; mini_ddp from {os.path.dirname(mini_ddp.__file__)}",
             f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}"]
    if not gpu:
        return lines + ["CPU DRY RUN: Gloo and CPU tensors in place of NCCL/CUDA; GPU sleeps "
                        "and side streams are no-ops. Not a GPU result."]
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    names = ", ".join(f"cuda:{i} {p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}"
                      f"{p.minor})" for i, p in enumerate(props))
    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else "n/a"
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)  # int before 2.2
    return lines + [f"GPUs: {names}",
                    f"driver {_driver_version()}, CUDA (torch build) {torch.version.cuda}, "
                    f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"]


def main(argv: list[str] | None = None) -> int:
    """Run every case; the report is written row by row. Exit 0 no FAIL, 1 a FAIL, 2 no CUDA."""
    global CASE_TIMEOUT_S  # --case-timeout-s
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the same cases with Gloo and CPU tensors")
    parser.add_argument("--only", default="",
                        help="run only the cases whose section or name contains this text")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no case after this many seconds (default 240)")
    parser.add_argument("--case-timeout-s", type=float, default=CASE_TIMEOUT_S,
                        help=f"bound on one case (default {CASE_TIMEOUT_S:.0f})")
    parser.add_argument("--inject", default="", help="comma-separated: 'raise', 'hang': "
                        "cases that fail first, to check that the harness reports and goes on")
    args = parser.parse_args(argv)
    CASE_TIMEOUT_S = args.case_timeout_s
    gpu = not args.cpu_dry_run
    if gpu and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --cpu-dry-run to test the script.")
        return 2
    path = os.path.join(os.environ.get("OUT") or ".", "gpu_check.txt")
    report = Report(path)
    start = time.monotonic()
    deadline = start + args.budget_s
    for line in environment(gpu):
        report.write(line)
    report.write("")

    def wanted(case: Case) -> bool:
        return (not args.only or case.section == "harness" or args.only in case.section
                or args.only in case.name)

    probe = Case("nccl", "nccl ws=2 ranks on one GPU", duplicate_gpu_probe, 2, "nccl")
    extra: list[Case] = []
    if wanted(probe) or args.only == "nccl":
        if gpu and torch.cuda.device_count() == 1:
            rows = run_case_quiet(probe, gpu, deadline)
            if rows is not None and nccl_refused_shared_gpu(rows):
                report.row("INFO", "nccl", probe.name,
                           "NCCL refuses two ranks on one device ('Duplicate GPU detected'): "
                           "multi-rank NCCL rows need 2 GPUs; not run")
            elif rows is not None and "still running after the deadline" in rows:
                report.row("INFO", "nccl", probe.name,
                           f"NCCL did not finish two ranks on one device within "
                           f"{PROBE_TIMEOUT_S:.0f} s (hung): multi-rank NCCL rows need 2 GPUs")
            elif rows is None:
                report.row("PASS", "nccl", probe.name, "NCCL accepted two ranks on cuda:0")
                extra = _parity_cases("nccl", "nccl", 2, False, full=False)
            else:
                report.row("FAIL", "nccl", probe.name, _headline(rows))
        else:  # several GPUs (one per rank), or the dry run's Gloo
            if all(r[0] != "FAIL" for r in run_case(probe, gpu, report, deadline)):
                extra = _parity_cases("nccl", "nccl", 2, False, full=False)
    injected = {"raise": injected_raise, "hang": injected_hang}
    extra = [Case("harness", f"injected: {kind}", injected[kind], 1)
             for kind in filter(None, args.inject.split(","))] + extra
    for case in extra + build_cases(gpu):
        if wanted(case):
            run_case(case, gpu, report, deadline)
    c = report.counts
    report.write("")
    report.write(f"{c['PASS']} passed, {c['FAIL']} failed, {c['INFO']} info, {c['SKIP']} "
                 f"skipped in {time.monotonic() - start:.0f} s"
                 + (" (CPU dry run)" if not gpu else "") + f"; written to {path}")
    return 1 if c["FAIL"] else 0


def nccl_refused_shared_gpu(failure: str) -> bool:
    """Does a rank failure say NCCL refused two ranks on one GPU? NCCL's words: "Duplicate
    GPU detected : rank 1 and rank 0 both on CUDA device ..." (an ncclInvalidUsage error)."""
    return any(words in failure for words in ("Duplicate GPU", "ncclInvalidUsage"))


def run_case_quiet(case: Case, gpu: bool, deadline: float) -> str | None:
    """Run ``case``; None when it passed, else the failure's text (for the NCCL probe)."""
    try:
        run_ranks(case.fn, case.world, args=(gpu, *case.args), backend=case.backend,
                  env=RANK_ENV, timeout_s=min(PROBE_TIMEOUT_S, deadline - time.monotonic()),
                  collective_timeout_s=CASE_TIMEOUT_S)
        return None
    except Exception as err:  # noqa: BLE001 - the refusal is the expected answer
        return str(err)


if __name__ == "__main__":
    sys.exit(main())

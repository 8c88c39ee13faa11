"""mini_ddp on a CUDA machine: parity, Gloo on CUDA, torch.cuda.comm and CUDA streams.

Run it through ``scripts/gpu_check.sh`` (which sets ``PYTHONPATH=src``). Sections:
(a) NCCL, world size 1: DataParallelModel vs torch DDP bitwise, MLP and CNN, default and tiny
    bucket cap, gradient_as_bucket_view off/on;
(b) Gloo with CUDA tensors, 2 and 3 ranks sharing one GPU: the same cases;
(c) local_comm's torch.cuda.comm paths on every visible GPU vs its CPU implementation, and
    MultiDeviceDataParallel over those GPUs vs one device on the whole batch;
(d) CUDA streams: gradients snapshotted just before ``optimizer.step()`` (no host sync in
    between) and the trained weights vs a CPU reference.
``--cpu-dry-run`` runs the same functions with Gloo and CPU tensors (three CPU "devices" in
(c)). Exit status: 0 all passed, 1 a check failed, 2 no torch or no CUDA.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback

try:
    import torch
except ImportError as err:
    print(f"gpu_check: cannot import torch ({err}); install torch for this python3 first.")
    sys.exit(2)
from torch import nn
from torch.cuda import nccl
from torch.nn.parallel import DistributedDataParallel as DDP

import mini_ddp
from mini_ddp import DataParallelModel, local_comm, run_ranks
from mini_ddp.engine.multi_device import MultiDeviceDataParallel

# Deterministic cuBLAS, so that two identical computations give identical bits.
RANK_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
TINY_CAP = 0.0001  # MiB: about one parameter per bucket
Row = tuple[str, bool, str]  # (check, passed, detail)


def _deterministic() -> None:
    # warn_only: an op without a deterministic kernel should show up as a parity failure with
    # a warning in the log, not as a crash of the whole section.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    # Full fp32 (no TF32) so that (c) and (d) can compare with a CPU reference.
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9 spelling
        torch.backends.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    if kind == "wide":  # enough work per kernel that a missing stream wait would show
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 12 * 12, 10))


def _data(kind: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    shape = {"mlp": (size, 32), "wide": (size, 512), "cnn": (size, 3, 16, 16)}[kind]
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (size,), generator=g)


def _device(name: str) -> torch.device:
    if name == "cuda":
        torch.cuda.set_device(0)  # every rank on GPU 0 (NCCL only runs here at world size 1)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def parity_ranks(ctx, device_name: str, cases: list, steps: int) -> list[Row]:
    """Each case: DataParallelModel and torch DDP side by side; grads and weights bitwise."""
    _deterministic()
    device, r, n = _device(device_name), ctx.rank, ctx.world_size
    ids = [0] if device.type == "cuda" else None
    rows = []
    for kind, cap, as_view in cases:
        ours = DataParallelModel(_model(kind).to(device), device_ids=ids, bucket_cap_mb=cap,
                                 gradient_as_bucket_view=as_view)
        theirs = DDP(_model(kind).to(device), device_ids=ids, bucket_cap_mb=cap,
                     gradient_as_bucket_view=as_view)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
        first_bad = None
        for step in range(steps):
            x, y = _data(kind, step * n + r, 8)
            for model, opt in zip((ours, theirs), opts, strict=True):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            same = all(torch.equal(p.grad, q.grad) for p, q in
                       zip(ours.parameters(), theirs.parameters(), strict=True))
            if not same and first_bad is None:
                first_bad = f"grads differ at step {step}"
            for opt in opts:
                opt.step()
        if first_bad is None and not all(torch.equal(p, q) for p, q in zip(
                ours.parameters(), theirs.parameters(), strict=True)):
            first_bad = "weights differ after training"
        cap_name = "tiny cap" if cap else "default cap"
        rows.append((f"{kind}, {cap_name}, grad_as_view={bool(as_view)}", first_bad is None,
                     first_bad or f"bitwise over {steps} steps"))
    return rows


def _parity(gpu: bool, backend: str, worlds: tuple[int, ...]) -> list[Row]:
    cases = [(k, cap, v) for k in ("mlp", "cnn") for cap in (None, TINY_CAP) for v in (0, 1)]
    out = []
    for world in worlds:
        per_rank = run_ranks(parity_ranks, world, args=("cuda" if gpu else "cpu", cases, 3),
                             backend=backend, env=RANK_ENV, timeout_s=150)
        for position, (name, _, _) in enumerate(per_rank[0]):
            bad = [rows[position] for rows in per_rank if not rows[position][1]]
            detail = (bad or per_rank[0])[0][2]  # the first failing rank's story, if any
            out.append((f"{backend} ws={world} {name}", not bad, detail))
    return out


def _all_same(got: list, ref: list, exact: bool = True) -> bool:
    """Same length, dtypes and values (bitwise, or allclose when ``exact`` is False)."""
    close = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return len(got) == len(ref) and all(
        a.dtype == b.dtype and close(a.cpu(), b) for a, b in zip(got, ref, strict=True))


def check_c_local_comm(gpu: bool) -> list[Row]:
    """Every local_comm function on the GPUs (or 3 CPU devices) vs the CPU implementation."""
    n = torch.cuda.device_count() if gpu else 3
    devices, cpu = (list(range(n)) if gpu else ["cpu"] * n), ["cpu"] * n
    g = torch.Generator().manual_seed(3)
    host = [torch.randn(300, generator=g), torch.randn(4, 5, generator=g, dtype=torch.float64),
            torch.arange(7), torch.randn(1000, generator=g)]
    got = local_comm.broadcast_coalesced([t.to("cuda:0" if gpu else "cpu") for t in host],
                                         devices, buffer_size=1024)
    ref = local_comm.broadcast_coalesced(host, cpu, buffer_size=1024)
    rows = [(f"broadcast_coalesced to {n} device(s)",
             all(_all_same(a, b) for a, b in zip(got, ref, strict=True)), "bitwise vs CPU")]
    per_device = [[(t * (i + 1)).to(d) for t in host] for i, d in enumerate(devices)]
    got = local_comm.reduce_add_coalesced(per_device, devices[0], buffer_size=1024)
    ref = local_comm.reduce_add_coalesced([[t.cpu() for t in p] for p in per_device], "cpu",
                                          buffer_size=1024)
    exact = n <= 2  # two addends: any order gives the same bits; NCCL may reorder more
    rows.append((f"reduce_add_coalesced over {n} device(s)", _all_same(got, ref, exact),
                 "bitwise vs CPU" if exact else "allclose vs CPU (NCCL's order)"))
    batch = torch.randn(11, 3, generator=g)
    for source in ["cpu"] + (["cuda:0"] if gpu else []):
        got = local_comm.scatter(batch.to(source), devices)
        ok = _all_same(got, local_comm.scatter(batch, cpu))
        ok = ok and torch.equal(local_comm.gather(got, "cpu"), batch)
        if gpu:
            ok = ok and torch.equal(local_comm.gather(got, 0).cpu(), batch)
        rows.append((f"scatter from {source} + gather, {n} device(s)", ok, "bitwise vs CPU"))
    return rows


def multi_device_ranks(ctx, device_name: str, steps: int) -> list[Row]:
    """MultiDeviceDataParallel over the GPUs vs one device training on the whole batch."""
    _deterministic()
    n = torch.cuda.device_count() if device_name == "cuda" else 3
    primary = _device(device_name)
    ids = list(range(n)) if device_name == "cuda" else ["cpu"] * n
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
    return [(f"MultiDeviceDataParallel over {n} device(s)", ok,
             f"max |weight diff| {worst:.2e} after {steps} steps")]


def check_c(gpu: bool) -> list[Row]:
    rows = check_c_local_comm(gpu)
    rows += run_ranks(multi_device_ranks, 1, args=("cuda" if gpu else "cpu", 3),
                      backend="nccl" if gpu else "gloo", env=RANK_ENV, timeout_s=150)[0]
    return rows


def _close(xs: list, ys: list) -> bool:
    """GPU vs CPU float32: equal up to rounding (a stale or missing gradient is far off)."""
    return all(torch.allclose(a.detach().cpu(), b, rtol=1e-3, atol=1e-5)
               for a, b in zip(xs, ys, strict=True))


def stream_ranks(ctx, device_name: str, steps: int) -> list[Row]:
    """No host sync between backward and step: snapshot grads, compare with a CPU reference."""
    _deterministic()
    device, r, n = _device(device_name), ctx.rank, ctx.world_size
    model = DataParallelModel(_model("wide").to(device),
                              device_ids=[0] if device.type == "cuda" else None)
    ref = _model("wide")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    snapshots, ref_grads = [], []
    for step in range(steps):
        x, y = _data("wide", step, 128 * n)
        mine = slice(r * 128, (r + 1) * 128)
        opt.zero_grad()
        xs = x[mine].pin_memory() if device.type == "cuda" else x[mine]
        loss = nn.functional.cross_entropy(model(xs.to(device, non_blocking=True)),
                                           y[mine].to(device, non_blocking=True))
        loss.backward()
        snapshots.append([p.grad.clone() for p in model.parameters()])  # queued, not synced
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_grads.append([p.grad.clone() for p in ref.parameters()])
        ref_opt.step()
    bad = [step for step, (a, b) in enumerate(zip(snapshots, ref_grads, strict=True))
           if not _close(a, b)]
    weights = _close(list(model.parameters()), list(ref.parameters()))
    detail = (f"grads differ at steps {bad}" if bad else "weights differ" if not weights
              else "match CPU reference (allclose)")
    return [(f"grads before step() and weights, {steps} steps", not bad and weights, detail)]


def check_d(gpu: bool) -> list[Row]:
    rows = []
    for backend, world in (("nccl" if gpu else "gloo", 1), ("gloo", 2)):
        per_rank = run_ranks(stream_ranks, world, args=("cuda" if gpu else "cpu", 4),
                             backend=backend, env=RANK_ENV, timeout_s=150)
        name, _, detail = per_rank[0][0]
        rows.append((f"{backend} ws={world} {name}", all(p[0][1] for p in per_rank), detail))
    return rows


def environment(gpu: bool) -> list[str]:
    """Header lines: versions, where mini_ddp was imported from, the GPUs."""
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, "
             f"mini_ddp from {os.path.dirname(mini_ddp.__file__)}"]
    if not gpu:
        return lines + ["CPU dry run: Gloo and CPU tensors in place of NCCL/CUDA"]
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    nccl_version = nccl.version() if torch.distributed.is_nccl_available() else "n/a"
    return lines + [f"CUDA {torch.version.cuda}, NCCL {nccl_version}, "
                    f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}"]


def main(argv: list[str] | None = None) -> int:
    """Run the sections, print the PASS/FAIL table, write it to $OUT/gpu_check.txt."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="exercise the same code paths with Gloo and CPU tensors")
    parser.add_argument("--only", default="abcd", help="sections to run, e.g. 'ac'")
    args = parser.parse_args(argv)
    gpu = not args.cpu_dry_run
    if gpu and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --cpu-dry-run to test the script.")
        return 2
    sections = {"a": ("(a) parity, NCCL", lambda g: _parity(g, "nccl" if g else "gloo", (1,))),
                "b": ("(b) parity, Gloo+CUDA", lambda g: _parity(g, "gloo", (2, 3))),
                "c": ("(c) torch.cuda.comm", check_c), "d": ("(d) CUDA streams", check_d)}
    if not gpu:
        sections = {k: (title.replace("NCCL", "Gloo/CPU").replace("+CUDA", "/CPU")
                        .replace("torch.cuda.comm", "local_comm (CPU)")
                        .replace("CUDA streams", "streams (CPU)"), fn)
                    for k, (title, fn) in sections.items()}
    table, timings, crashes = [], [], []
    for key in args.only:
        title, fn = sections[key]
        start = time.monotonic()
        try:
            rows = fn(gpu)
        except Exception:  # noqa: BLE001 - one broken section must not hide the others
            crashes.append(f"--- {title} ---\n{traceback.format_exc()}")
            rows = [("section crashed (details below)", False, "")]
            print(crashes[-1], file=sys.stderr)
        timings.append(f"{title}: {sum(r[1] for r in rows)}/{len(rows)} passed "
                       f"in {time.monotonic() - start:.1f} s")
        print(timings[-1], flush=True)
        table += [(title, name, ok, detail) for name, ok, detail in rows]
    width = max(len(r[1]) for r in table)
    failed = sum(not r[2] for r in table)
    lines = environment(gpu) + [""] + [
        f"{'PASS' if ok else 'FAIL'}  {section:<24} {name:<{width}}  {detail}"
        for section, name, ok, detail in table]
    lines += ["", *timings, f"{len(table) - failed} passed, {failed} failed", *crashes]
    report = "\n".join(lines)
    print(report)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.txt"), "w") as f:
            f.write(report + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the benchmark runs: zoo models at benchmark batch sizes, and the engines around them.

Models come from :data:`mini_ddp.training.models.ZOO` (builder, input, loss); the benchmark
adds only its per-rank batch size (:data:`BENCH_BATCH`):

* ``resnet18`` — torchvision's ResNet-18 (:func:`mini_ddp.training.models.resnet18_cifar`), 32×32 images:
  11.2 M parameters in 62 tensors, compute-heavy, many small gradients.
* ``mlp20m`` — a 20 M-parameter MLP (10 tensors): few, large gradients, little compute per byte, so
  communication dominates (the case bucketing exists for).
* ``transformer`` — a small ``nn.TransformerEncoder`` language model (4 layers, d=256):
  attention and layer norms, 3.7 M parameters in 51 tensors.
* ``tiny`` — a 3-layer MLP for tests: milliseconds per step.
* ``linear100`` and ``transformer_small`` (:data:`MANY_SMALL`) — 200 and 195 small tensors
  (100 × ``Linear(64, 64)``; a 16-layer ``TransformerEncoder`` with d=64): so little arithmetic
  per gradient that what an engine spends per gradient decides the step — the regime of a
  GPU, whose arithmetic is ~100× faster than these CPUs' while the per-gradient work of the
  engine is not.

Engines (:func:`build_engine`): ``torch_ddp`` (torch's C++ reducer), ``mini_ddp``
(:class:`mini_ddp.DataParallelModel`), ``naive`` (one blocking all-reduce per parameter after
backward, then ``div_``) and ``compute`` (no communication: the limit); with ``--compile`` also
``torch_ddp_compiled`` and ``mini_ddp_compiled`` (:data:`COMPILED`: ``torch.compile`` of the
wrapped model, the order torch documents for DDP). :func:`memory_report` measures each engine's
memory alone: tensor bytes (:func:`tensor_bytes`) and peak RSS growth.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mini_ddp.engine.model import DataParallelModel
from mini_ddp.training.models import compute_loss

Batch = tuple[torch.Tensor, torch.Tensor]


# The zoo models (mini_ddp.training.models.ZOO) the benchmark runs, and the per-rank batch
# each is measured at: a measurement setting, so it lives here and not in the zoo.
BENCH_BATCH: dict[str, int] = {"resnet18": 32, "mlp20m": 64, "transformer": 16, "tiny": 8,
                               "linear100": 16, "transformer_small": 16}
# The regime where what an engine spends per gradient decides the step (``--many-small``).
MANY_SMALL = ("linear100", "transformer_small")

ENGINES = ("torch_ddp", "mini_ddp", "naive", "compute")
# Ablations, on request (--engines): mini_ddp with one of its own speed-ups switched off.
ABLATIONS = {"mini_ddp_copy": {"zero_copy_write_back": False},
             "mini_ddp_zero_copy": {"zero_copy_write_back": True},
             "mini_ddp_gloo": {"shared_memory_allreduce": False},
             "mini_ddp_v1": {"zero_copy_write_back": False, "shared_memory_allreduce": False},
             "mini_ddp_nostall": {"stall_warning_s": None},
             # One hook per gradient always (no grouped hooks, mini_ddp.engine.hook_groups).
             "mini_ddp_pergrad": {"grouped_hooks": False},
             # Only buckets of at least 1 MiB (DDP's first bucket size) / 4 MiB through shared
             # memory, the rest through Gloo; the default sends every float bucket there.
             "mini_ddp_shm1m": {"shared_memory_min_bytes": 1 << 20},
             "mini_ddp_shm4m": {"shared_memory_min_bytes": 4 << 20},
             # The replica check (docs/debugging.md): off, at every step (its cost per check),
             # and the debug switch (fingerprints and the local-gradient watch on top).
             "mini_ddp_nochecks": {"replica_check_every": None},
             "mini_ddp_check_every_step": {"replica_check_every": 1},
             "mini_ddp_debug": {"debug": True}}
# torch.compile(engine) for the two DDPs, on request (--compile): the compiled engine's name
# and the eager engine it wraps. Only the wrapped module's frame is compiled (torch DDP's
# compiled path, which mini_ddp takes too) - so a model whose top level is an nn.Sequential,
# a torch.nn frame dynamo does not compile on its own, runs eagerly under both.
COMPILED = {"torch_ddp_compiled": "torch_ddp", "mini_ddp_compiled": "mini_ddp"}


@dataclass
class Engine:
    """One engine's model and optimizer; :meth:`step` is one training step."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    gabv: bool = False
    probe: Callable[[], None] | None = None  # called after backward and after the step
    loss: str = "cross_entropy"  # a mini_ddp.training.models.LOSSES key

    def step(self, batch: Batch) -> None:
        """Zero grads, forward, loss, backward, (naive: sync), SGD step.

        Grads are set to None, except with gradient_as_bucket_view: zeroed in place, they
        stay bucket views and backward accumulates straight into the buckets (the use torch
        documents for saving memory)."""
        self.opt.zero_grad(set_to_none=not self.gabv)
        compute_loss(self.loss, self.model(batch[0]), batch[1]).backward()
        if self.name == "naive":
            world = dist.get_world_size()
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)  # blocking, one collective per parameter
                    p.grad.div_(world)
        if self.probe is not None:
            self.probe()
        self.opt.step()
        if self.probe is not None:
            self.probe()


def build_engine(name: str, base: nn.Module, cap: float | None, gabv: bool,
                 loss: str = "cross_entropy", compile_backend: str = "inductor") -> Engine:
    """Wrap a deep copy of ``base`` as engine ``name`` (one of :data:`ENGINES`, an ablation or
    a :data:`COMPILED` engine, compiled with ``compile_backend``), with SGD."""
    if name in COMPILED:
        engine = build_engine(COMPILED[name], base, cap, gabv, loss)
        engine.name, engine.model = name, torch.compile(engine.model, backend=compile_backend)
        return engine
    return wrap_engine(name, copy.deepcopy(base), cap, gabv, loss)


def wrap_engine(name: str, module: nn.Module, cap: float | None, gabv: bool,
                loss: str = "cross_entropy") -> Engine:
    """Engine ``name`` around ``module`` itself (no copy): the part of :func:`build_engine`
    that :func:`time_startup` times."""
    if name == "torch_ddp":
        model: nn.Module = DistributedDataParallel(module, bucket_cap_mb=cap,
                                                   gradient_as_bucket_view=gabv)
    elif name == "mini_ddp" or name in ABLATIONS:
        model = DataParallelModel(module, bucket_cap_mb=cap, gradient_as_bucket_view=gabv,
                                  **ABLATIONS.get(name, {}))
    elif name in ("naive", "compute"):
        model = module
    else:
        raise ValueError(f"unknown engine {name!r}; choose from "
                         f"{ENGINES + tuple(ABLATIONS) + tuple(COMPILED)}")
    return Engine(name, model, torch.optim.SGD(model.parameters(), lr=1e-4), gabv, loss=loss)


def tensor_bytes(engine: Engine) -> int:
    """Bytes of parameters, gradients and bucket buffers, each storage counted once."""
    storages: dict[int, int] = {}
    for p in engine.model.parameters():
        for t in (p, p.grad):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    extra = 0
    if isinstance(engine.model, DataParallelModel):  # (zero-copy .grad shares their storage)
        for bucket in engine.model.reducer.layout.buckets:
            storages[bucket.buffer.untyped_storage().data_ptr()] = bucket.nbytes
    elif isinstance(engine.model, DistributedDataParallel) and not engine.gabv:
        # torch's buckets are not reachable from Python; DDP's logger reports their sizes.
        # (With gradient_as_bucket_view the grads above *are* the buckets' storages.)
        sizes = engine.model._get_ddp_logging_data().get("bucket_sizes", "")
        extra = sum(int(s) for s in str(sizes).split(",") if s.strip())
    return sum(storages.values()) + extra


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")),
                        None)
    except OSError:
        return None


def _reset_peak_rss() -> bool:
    """Give freed heap back to the OS (glibc ``malloc_trim``), then reset VmHWM (Linux
    ``clear_refs`` 5): the next peak then belongs to what runs next, not to reused memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: growth may then be hidden by memory malloc kept
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pss_kib() -> int | None:
    """Proportional set size: shared pages count once per process *sharing* them, split.

    RSS counts a page shared by several ranks (the shared-memory all-reduce's buckets, which
    every rank maps) in full in each; PSS is each rank's fair share of the machine's memory.
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Pss:")), None)
    except OSError:
        return None


def _sample_pss(samples: list[int]) -> None:
    samples.append(_pss_kib() or 0)


def memory_report(base: nn.Module, batches: list[Batch], cap: float | None, steps: int,
                  names: list[str]) -> dict[str, dict[str, float | None]]:
    """Each engine alone (the DDPs also with gradient_as_bucket_view), in MiB: its tensors
    after the last step (gradients alive), and its training peak — the highest RSS during
    ``steps`` steps, above the RSS before it was built. The peak is reset after two warm-up
    steps, so one-time transients (start-up broadcast, bucket rebuild) do not count. Also
    the highest PSS (:func:`_pss_kib`) sampled after each backward and each optimizer step,
    above the PSS before: the kernel keeps no PSS peak, so this one is sampled."""
    out = {}
    variants = [(n, False) for n in names] + [(n, True) for n in names if n.endswith("_ddp")]
    for name, gabv in variants:
        gc.collect()
        dist.barrier()
        _reset_peak_rss()
        before, pss_before = _status_kib("VmRSS"), _pss_kib()
        pss_samples: list[int] = []
        engine = build_engine(name, base, cap, gabv)
        for batch in batches[:2]:  # both DDPs rebuild their buckets once, at forward 2
            engine.step(batch)
        can_reset = _reset_peak_rss()
        engine.probe = functools.partial(_sample_pss, pss_samples)
        for i in range(steps):
            engine.step(batches[i % len(batches)])
        peak = _status_kib("VmHWM")
        out[name + ("+gabv" if gabv else "")] = {
            "tensor_MiB": tensor_bytes(engine) / 2**20,
            "peak_rss_growth_MiB": (peak - before) / 1024 if can_reset and peak and before
            else None,
            "peak_pss_growth_MiB": (max(pss_samples) - pss_before) / 1024 if pss_before
            and pss_samples and min(pss_samples) else None}
        del engine
    return out


def time_startup(base: nn.Module, batches: list[Batch], names: list[str], cap: float | None,
                 gabv: bool, loss: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per engine and round, seconds to wrap a fresh copy of ``base`` (the copy itself is not
    timed), and of its first and second steps (the second rebuilds the buckets in both DDPs).

    What a user who builds many models (sweeps, tests) pays per model. Engines take turns
    within a round, the order rotated every round, a barrier before each; collective (every
    rank calls it with the same names).
    """
    out: dict[str, dict[str, list[float]]] = {
        n: {"construct": [], "first_step": [], "second_step": []} for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            module = copy.deepcopy(base)
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            engine = wrap_engine(name, module, cap, gabv, loss)
            t1 = time.perf_counter()
            engine.step(batches[0])
            t2 = time.perf_counter()
            engine.step(batches[1 % len(batches)])
            t3 = time.perf_counter()
            for key, took in (("construct", t1 - t0), ("first_step", t2 - t1),
                              ("second_step", t3 - t2)):
                out[name][key].append(took)
            del engine, module
    return out

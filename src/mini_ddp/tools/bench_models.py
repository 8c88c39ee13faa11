"""What the benchmark runs: its models (each with a batch maker) and the engines around them.

* ``resnet18`` — torchvision's ResNet-18 (:func:`mini_ddp.training.models.resnet18_cifar`), 32×32 images:
  11.2 M parameters in 62 tensors, compute-heavy, many small gradients.
* ``mlp20m`` — a 20 M-parameter MLP (10 tensors): few, large gradients, little compute per byte, so
  communication dominates (the case bucketing exists for).
* ``transformer`` — a small ``nn.TransformerEncoder`` language model (4 layers, d=256):
  attention and layer norms, 3.7 M parameters in 51 tensors.
* ``tiny`` — a 3-layer MLP for tests: milliseconds per step.

Engines (:func:`build_engine`): ``torch_ddp`` (torch's C++ reducer), ``mini_ddp``
(:class:`mini_ddp.DataParallelModel`), ``naive`` (one blocking all-reduce per parameter after
backward, then ``div_``) and ``compute`` (no communication: the limit). :func:`memory_report` measures each engine's
memory alone: tensor bytes (:func:`tensor_bytes`) and peak RSS growth.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mini_ddp.engine.model import DataParallelModel
from mini_ddp.training.models import resnet18_cifar

Batch = tuple[torch.Tensor, torch.Tensor]


class TinyLM(nn.Module):
    """Embedding → ``nn.TransformerEncoder`` → per-token vocabulary logits."""

    def __init__(self, vocab: int = 1000, d_model: int = 256, layers: int = 4,
                 heads: int = 4, ff: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
        # enable_nested_tensor only matters for padded inference; off, it does not warn.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for integer ``tokens`` of shape (batch, seq)."""
        return self.head(self.encoder(self.embed(tokens)))


def mlp(widths: list[int]) -> nn.Sequential:
    """Linear layers of the given widths with ReLUs in between."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _images(batch: int, g: torch.Generator) -> Batch:
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


@dataclass(frozen=True)
class BenchModel:
    """A model factory, its per-rank batch size and a batch maker ``(batch, generator)``."""

    factory: Callable[[], nn.Module]
    batch: int
    make_batch: Callable[[int, torch.Generator], Batch]
    description: str


MLP20M_WIDTHS = [1024, 2688, 2688, 2688, 1024, 10]

BENCH_MODELS: dict[str, BenchModel] = {
    "resnet18": BenchModel(resnet18_cifar, 32, _images, "ResNet-18, 3x32x32, batch 32/rank"),
    "mlp20m": BenchModel(
        lambda: mlp(MLP20M_WIDTHS), 64,
        lambda b, g: (torch.randn(b, MLP20M_WIDTHS[0], generator=g),
                      torch.randint(0, 10, (b,), generator=g)),
        "MLP 1024-2688-2688-2688-1024-10 (20 M params), batch 64/rank"),
    "transformer": BenchModel(
        TinyLM, 16,
        lambda b, g: (torch.randint(0, 1000, (b, 64), generator=g),
                      torch.randint(0, 1000, (b, 64), generator=g)),
        "TransformerEncoder LM, 4 layers, d=256, seq 64, batch 16/rank"),
    "tiny": BenchModel(
        lambda: mlp([16, 32, 32, 4]), 8,
        lambda b, g: (torch.randn(b, 16, generator=g), torch.randint(0, 4, (b,), generator=g)),
        "MLP 16-32-32-4, batch 8/rank (tests)"),
}


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (works for per-token logits too)."""
    return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten())


ENGINES = ("torch_ddp", "mini_ddp", "naive", "compute")
# Ablations, on request (--engines): mini_ddp with one of its own speed-ups switched off.
ABLATIONS = {"mini_ddp_copy": {"zero_copy_write_back": False},
             "mini_ddp_gloo": {"shared_memory_allreduce": False},
             "mini_ddp_v1": {"zero_copy_write_back": False, "shared_memory_allreduce": False}}


@dataclass
class Engine:
    """One engine's model and optimizer; :meth:`step` is one training step."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    gabv: bool = False
    probe: Callable[[], None] | None = None  # called after backward and after the step

    def step(self, batch: Batch) -> None:
        """Zero grads, forward, loss, backward, (naive: sync), SGD step.

        Grads are set to None, except with gradient_as_bucket_view: zeroed in place, they
        stay bucket views and backward accumulates straight into the buckets (the use torch
        documents for saving memory)."""
        self.opt.zero_grad(set_to_none=not self.gabv)
        loss_fn(self.model(batch[0]), batch[1]).backward()
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


def build_engine(name: str, base: nn.Module, cap: float | None, gabv: bool) -> Engine:
    """Wrap a deep copy of ``base`` as engine ``name`` (one of :data:`ENGINES`), with SGD."""
    module = copy.deepcopy(base)
    if name == "torch_ddp":
        model: nn.Module = DistributedDataParallel(module, bucket_cap_mb=cap,
                                                   gradient_as_bucket_view=gabv)
    elif name == "mini_ddp" or name in ABLATIONS:
        model = DataParallelModel(module, bucket_cap_mb=cap, gradient_as_bucket_view=gabv,
                                  **ABLATIONS.get(name, {}))
    elif name in ("naive", "compute"):
        model = module
    else:
        raise ValueError(f"unknown engine {name!r}; choose from {ENGINES + tuple(ABLATIONS)}")
    return Engine(name, model, torch.optim.SGD(model.parameters(), lr=1e-4), gabv)


def tensor_bytes(engine: Engine) -> int:
    """Bytes of parameters, gradients and bucket buffers, each storage counted once."""
    storages: dict[int, int] = {}
    for p in engine.model.parameters():
        for t in (p, p.grad):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    extra = 0
    if isinstance(engine.model, DataParallelModel):  # (zero-copy .grad shares their storage)
        for bucket in engine.model.reducer.buckets:
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

    RSS counts a page shared by two ranks (the shared-memory all-reduce's buckets, which both
    ranks map) in full in both; PSS is each rank's fair share of the machine's memory.
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

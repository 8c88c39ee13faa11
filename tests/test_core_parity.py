"""DataParallelModel trains bit for bit like torch DDP.

Every case runs torch DDP and DataParallelModel in the same ranks, on deep copies of the same
model and on the same per-rank data, and compares with ``torch.equal`` every gradient after
every backward and every parameter and buffer after every optimizer step. Each rank starts
from a *different* random model, so the cases also prove the start-up broadcast from rank 0.
World size 3 is the one that matters: at 2, every averaging variant happens to give the same
bits (one addition, and x0.5 is exact), so a wrong engine could pass there.
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.training.models import Seed002CNN, Seed004MyModel, resnet18_cifar


class UnusedBranch(nn.Module):
    """A model with a branch used only on odd steps and a layer no rank ever uses."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(12, 16)
        self.sometimes = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)
        self.step = 0

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if self.step % 2 == 1:
            h = h + self.sometimes(h)
        self.step += 1
        return self.head(h)


class Tied(nn.Module):
    """Input embedding and output projection share one weight (tied weights)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.embed(x).mean(1))))


class MixedDtypes(nn.Module):
    """float32 and float64 parameters (one bucket per dtype), one frozen layer, one int param."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.b = nn.Linear(16, 16).double()
        self.c = nn.Linear(16, 4)
        self.counts = nn.Parameter(torch.tensor([1, 2]), requires_grad=False)

    def forward(self, x):
        h = self.frozen(torch.relu(self.a(x)))
        h = self.b(h.double()).float()
        return self.c(h)


def _mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 5))


MODELS = {
    # name: (factory, input maker(generator, batch) -> (x, y))
    "seed002": (Seed002CNN, lambda g, b: (torch.randn(b, 3, 32, 32, generator=g),
                                          torch.randint(0, 10, (b,), generator=g))),
    "seed004": (Seed004MyModel, lambda g, b: (torch.randn(b, 3, 14, 14, generator=g),
                                              torch.randint(0, 10, (b,), generator=g))),
    "resnet18": (resnet18_cifar, lambda g, b: (torch.randn(b, 3, 32, 32, generator=g),
                                               torch.randint(0, 10, (b,), generator=g))),
    "mlp": (_mlp, lambda g, b: (torch.randn(b, 12, generator=g),
                                torch.randint(0, 5, (b,), generator=g))),
    "unused": (UnusedBranch, lambda g, b: (torch.randn(b, 12, generator=g),
                                           torch.randint(0, 5, (b,), generator=g))),
    "tied": (Tied, lambda g, b: (torch.randint(0, 20, (b, 6), generator=g),
                                 torch.randint(0, 20, (b,), generator=g))),
    "mixed": (MixedDtypes, lambda g, b: (torch.randn(b, 10, generator=g),
                                         torch.randint(0, 4, (b,), generator=g))),
}


def _compare(tag, ref: nn.Module, ours: nn.Module, what: str) -> list[str]:
    """Names of tensors that differ (None vs tensor counts as a difference)."""
    bad = []
    pairs = (zip(ref.named_parameters(), ours.parameters(), strict=True) if what == "grad"
             else zip(list(ref.named_parameters()) + list(ref.named_buffers()),
                      list(ours.parameters()) + list(ours.buffers()), strict=True))
    for (name, a), b in pairs:
        if what == "grad":
            a, b = a.grad, b.grad
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            diff = "None vs tensor" if (a is None) != (b is None) else \
                f"max abs diff {(a.double() - b.double()).abs().max().item():.3g}"
            bad.append(f"{tag}: {what} of {name} differs ({diff})")
    return bad


def _train_side_by_side(ctx, model_name, options, steps=3, optimizer="sgd", accumulate=1,
                        set_to_none=True, batch=4):
    """Rank body: train torch DDP and DataParallelModel together; return every difference."""
    factory, make_batch = MODELS[model_name]
    torch.manual_seed(1000 + ctx.rank)  # deliberately different on each rank
    base = factory()
    try:
        ref = DDP(copy.deepcopy(base), **options)
    except AssertionError as err:  # an older torch DDP refuses it (2.11: bucket_cap_mb=0)
        return [f"{REFUSED}{err}"]
    ours = DataParallelModel(copy.deepcopy(base), **options)
    bad = _compare("after construction", ref.module, ours.module, "state")

    def make_opt(m):
        if optimizer == "adam":
            return torch.optim.Adam(m.parameters(), lr=1e-3)
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    opt_ref, opt_ours = make_opt(ref), make_opt(ours)
    for step in range(steps):
        g = torch.Generator().manual_seed(ctx.rank * 100 + step)
        micro = [make_batch(g, batch) for _ in range(accumulate)]
        for engine, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad(set_to_none=set_to_none)
            for i, (x, y) in enumerate(micro):
                sync = i == len(micro) - 1
                ctx_mgr = engine.no_sync() if not sync else contextlib.nullcontext()
                with ctx_mgr:
                    F.cross_entropy(engine(x), y).backward()
        bad += _compare(f"step {step}", ref.module, ours.module, "grad")
        opt_ref.step()
        opt_ours.step()
        bad += _compare(f"step {step}", ref.module, ours.module, "state")
    return bad


REFUSED = "torch DDP of this version refuses these options: "


def _assert_parity(world_size, model_name, options, **kw):
    results = run_ranks(_train_kw, world_size, args=(model_name, options, kw), timeout_s=240)
    if all(bad and bad[0].startswith(REFUSED) for bad in results):
        pytest.skip(f"{results[0][0]} (nothing to compare with)")
    problems = [f"rank {r}: {p}" for r, bad in enumerate(results) for p in bad]
    assert not problems, "\n".join(problems[:20])


def _train_kw(ctx, model_name, options, kw):
    return _train_side_by_side(ctx, model_name, options, **kw)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_seed002_cnn_default_cap(world_size):
    _assert_parity(world_size, "seed002", {})


def test_seed004_mymodel_tiny_cap_adam():
    # 0.01 MiB caps: many buckets in the rebuilt layout, launched while backward runs.
    _assert_parity(3, "seed004", {"bucket_cap_mb": 0.01}, optimizer="adam")


def test_resnet18_batchnorm_buffers():
    _assert_parity(3, "resnet18", {"bucket_cap_mb": 1}, steps=2, batch=2)


# 0 and -1 are accepted by torch DDP: a zero cap closes a bucket after every parameter, a
# negative one wraps around to "unlimited" in its C++ reducer.
@pytest.mark.parametrize("cap", [None, 0.001, 0, -1])
def test_mlp_default_and_tiny_cap(cap):
    _assert_parity(3, "mlp", {"bucket_cap_mb": cap}, steps=4)


def test_find_unused_parameters_globally_and_sometimes_unused():
    _assert_parity(3, "unused", {"find_unused_parameters": True, "bucket_cap_mb": 0.001},
                   steps=4)


def test_tied_weights():
    _assert_parity(3, "tied", {"bucket_cap_mb": 0.001}, steps=3)


def test_mixed_dtypes_frozen_and_integer_parameters():
    _assert_parity(3, "mixed", {"bucket_cap_mb": 0.001}, steps=3, optimizer="adam")


def test_no_sync_accumulation():
    _assert_parity(3, "mlp", {"bucket_cap_mb": 0.001}, steps=3, accumulate=3)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view(set_to_none):
    # set_to_none=False keeps .grad as the bucket view between steps: DDP then divides the
    # view in place (div_) instead of multiplying while copying — a different rounding path.
    _assert_parity(3, "mlp", {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
                   steps=4, set_to_none=set_to_none, accumulate=2)


def test_world_size_4_find_unused_with_accumulation():
    _assert_parity(4, "unused", {"find_unused_parameters": True}, steps=3, accumulate=2)


def _checkpoint_interchange(ctx):
    """Save each engine's state_dict, load it into the other, keep training: still equal."""
    torch.manual_seed(7)
    base = _mlp()
    ref, ours = DDP(copy.deepcopy(base)), DataParallelModel(copy.deepcopy(base))
    problems = []
    if list(ref.state_dict()) != list(ours.state_dict()):
        problems.append(f"keys differ: {list(ref.state_dict())} vs {list(ours.state_dict())}")
    for engine in (ref, ours):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(ctx.rank))
        engine(x).sum().backward()
        with torch.no_grad():
            for p in engine.parameters():
                p -= 0.1 * p.grad
    blob_ref, blob_ours = io.BytesIO(), io.BytesIO()
    torch.save(ref.state_dict(), blob_ref)
    torch.save(ours.state_dict(), blob_ours)
    blob_ref.seek(0)
    blob_ours.seek(0)
    fresh_ours, fresh_ref = DataParallelModel(_mlp()), DDP(_mlp())
    fresh_ours.load_state_dict(torch.load(blob_ref, weights_only=True))
    fresh_ref.load_state_dict(torch.load(blob_ours, weights_only=True))
    problems += _compare("torch->ours", ref.module, fresh_ours.module, "state")
    problems += _compare("ours->torch", ours.module, fresh_ref.module, "state")
    for engine_pair in ((fresh_ref, fresh_ours),):
        for engine in engine_pair:
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(50 + ctx.rank))
            engine(x).sum().backward()
        problems += _compare("after reload", engine_pair[0].module, engine_pair[1].module,
                             "grad")
    return problems


def test_checkpoint_interchange_with_torch_ddp():
    results = run_ranks(_checkpoint_interchange, 3, timeout_s=120)
    problems = [p for bad in results for p in bad]
    assert not problems, "\n".join(problems)


def _state(seed: int) -> list[torch.Tensor]:
    """Tensors that make several broadcast pieces: one over the piece size alone, many small
    ones that fill pieces, an int64 group and a float tail."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1 << 21, generator=gen), *[torch.randn(300, 300, generator=gen)
                                                   for _ in range(30)],
            torch.randint(0, 9, (1000,), generator=gen), torch.randn(5, generator=gen)]


def _broadcast_in_pieces(ctx) -> tuple[list[torch.Tensor], int]:
    import torch.distributed as dist

    from mini_ddp.engine.comm import dist_broadcast_coalesced

    tensors, calls, real = _state(ctx.rank), [], dist.broadcast
    dist.broadcast = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    try:
        dist_broadcast_coalesced(tensors, src=0)
    finally:
        dist.broadcast = real
    return tensors, len(calls)


def test_startup_broadcast_in_pieces_gives_every_rank_rank_0s_bits():
    # The state goes out in pieces, two in flight: whatever the piece boundaries, every rank
    # ends with exactly rank 0's tensors, and rank 0's are left as they were.
    results = run_ranks(_broadcast_in_pieces, 3, timeout_s=120)
    sent = _state(0)
    for rank, (tensors, pieces) in enumerate(results):
        assert pieces == results[0][1] >= 4, (rank, pieces)  # more than two in flight
        assert all(torch.equal(a, b) for a, b in zip(tensors, sent, strict=True)), rank

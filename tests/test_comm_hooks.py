"""torch's own comm hooks run unchanged on DataParallelModel and give torch DDP's bits.

Each parity case trains a DataParallelModel and a torch DDP model side by side in the same
ranks (same initial weights, same per-rank data, same hook, a fresh state each) and compares
every gradient and parameter after every step with ``torch.equal``. A tiny bucket cap gives
several buckets; world size 3 matters (at 2, averaging variants happen to agree). All cases of
one world size share one ``run_ranks`` call: process start-up is the expensive part.

PowerSGD: torch DDP cannot run the bare hook on Gloo with several buckets (it deadlocks, see
``test_bare_powerSGD_deadlocks_on_gloo_with_several_buckets``), so there torch gets
``gloo_safe(powerSGD_hook)``, while DataParallelModel gets the bare hook and wraps it itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.engine.hooks import GradBucket, gloo_safe, waits_in_callbacks
from mini_ddp.transport.collectives import collective_hook, ring_allreduce

CAP_MB = 0.00015  # 157 bytes: this model's gradients fall into 3 buckets after the rebuild
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 12), nn.Tanh(),
                         nn.Linear(12, 3))


class _BigFirstBucket(nn.Module):
    """Bucket 0 is an 8 MiB parameter whose all-reduce is still running while the small
    buckets behind it launch: that makes the Gloo deadlock below certain, not a race."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.big = nn.Parameter(torch.zeros(2 ** 21))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.big[:3]


def _powersgd(**kw: Any) -> Callable[[], psgd.PowerSGDState]:
    # Iterations 0-1 all-reduce; compression from the third step on, after DDP's rebuild.
    return lambda: psgd.PowerSGDState(None, start_powerSGD_iter=2, **kw)


class Case(NamedTuple):
    """One parity case. ``state`` is called once per model: PowerSGD states are per model."""

    state: Callable[[], Any]
    ours: Any  # what DataParallelModel gets: always torch's own hook, unchanged
    theirs: Any  # what torch DDP gets: the same, or gloo_safe(...) where the bare hook hangs
    cap_mb: float = CAP_MB
    model: Callable[[], nn.Module] = _model
    buckets: int = 3


def _no_state() -> None:
    return None


def _plain(hook: Any) -> Case:
    return Case(_no_state, hook, hook)


def _psgd(hook: Any, **kw: Any) -> Case:
    return Case(_powersgd(), hook, gloo_safe(hook), **kw)


CASES: dict[str, Case] = {
    "allreduce_hook": _plain(default.allreduce_hook),
    "fp16_compress_hook": _plain(default.fp16_compress_hook),
    "bf16_compress_hook": _plain(default.bf16_compress_hook),
    "fp16_compress_wrapper(allreduce_hook)": _plain(
        default.fp16_compress_wrapper(default.allreduce_hook)),
    "bf16_compress_wrapper(allreduce_hook)": _plain(
        default.bf16_compress_wrapper(default.allreduce_hook)),
    "powerSGD_hook": _psgd(psgd.powerSGD_hook),
    "powerSGD_hook, 8 MiB bucket 0": _psgd(psgd.powerSGD_hook, model=_BigFirstBucket,
                                           buckets=4),
    "powerSGD_hook, one bucket (torch runs it bare)": Case(
        _powersgd(), psgd.powerSGD_hook, psgd.powerSGD_hook, cap_mb=25.0, buckets=1),
    "powerSGD_hook, before start_powerSGD_iter (torch runs it bare)": Case(
        lambda: psgd.PowerSGDState(None, start_powerSGD_iter=100), psgd.powerSGD_hook,
        psgd.powerSGD_hook),
    "powerSGD_hook, rank 2, batched, no error feedback": Case(
        _powersgd(matrix_approximation_rank=2, batch_tensors_with_same_shape=True,
                  use_error_feedback=False), psgd.powerSGD_hook, gloo_safe(psgd.powerSGD_hook)),
    "fp16_compress_wrapper(powerSGD_hook)": _psgd(
        default.fp16_compress_wrapper(psgd.powerSGD_hook)),
    "collective_hook(ring_allreduce)": _plain(collective_hook(ring_allreduce)),
    # Not batched_powerSGD_hook: in torch 2.14 it fails at its first compressed step under
    # torch DDP too (it hands a 2-D matrix to _orthogonalize, which asserts 3-D).
}


def _register_on_torch(ddp: DDP, state: Any, hook: Any) -> None:
    try:
        ddp.register_comm_hook(state, hook)
    except TypeError as err:
        # Refused without CUDA + NCCL >= 2.10 (a CPU-only build; a CUDA build passes even with
        # no GPU). Its reducer runs bf16 fine on Gloo: register past the check, as it would.
        if "BF16" not in str(err):
            raise
        dist._register_comm_hook(ddp.reducer, state, hook)


def _differences(ours: nn.Module, theirs: nn.Module, what: str) -> list[str]:
    pairs = zip(ours.named_parameters(), theirs.parameters(), strict=True)
    return [f"{what}: {name}" for (name, p), q in pairs
            if not torch.equal(p.grad, q.grad) or not torch.equal(p, q)]


def _train_pair(ctx: Any, label: str, steps: int) -> dict[str, Any]:
    case = CASES[label]
    ours = DataParallelModel(case.model(), bucket_cap_mb=case.cap_mb)
    theirs = DDP(case.model(), bucket_cap_mb=case.cap_mb)
    our_state, torch_state = case.state(), case.state()
    ours.register_comm_hook(our_state, case.ours)
    _register_on_torch(theirs, torch_state, case.theirs)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    diffs: list[str] = []
    for step in range(steps):
        x = torch.randn(4, 6, generator=gen)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            model(x).square().sum().backward()
        diffs += _differences(ours.module, theirs.module, f"step {step}, before the update")
        opt_ours.step()
        opt_theirs.step()
        diffs += _differences(ours.module, theirs.module, f"step {step}, after the update")
    stats = our_state.compression_stats() if hasattr(our_state, "compression_stats") else None
    return {"diffs": diffs, "buckets": len(ours.reducer.layout.buckets), "stats": stats,
            "hook": ours.reducer.comm_hook.__qualname__}


def _default_vs_allreduce_hook(ctx: Any) -> tuple[int, int]:
    """First-step gradients: default path (x * 1/n, then sum) vs allreduce_hook (x / n)."""
    plain = DataParallelModel(_model(), bucket_cap_mb=CAP_MB)
    hooked = DataParallelModel(_model(), bucket_cap_mb=CAP_MB)
    hooked.register_comm_hook(None, default.allreduce_hook)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(7 + ctx.rank))
    differing = total = 0
    for model in (plain, hooked):
        model(x).square().sum().backward()
    for p, q in zip(plain.parameters(), hooked.parameters(), strict=True):
        differing += int((p.grad != q.grad).sum())
        total += p.numel()
    return differing, total


def _all_parity_cases(ctx: Any, labels: list[str]) -> dict[str, Any]:
    results = {label: _train_pair(ctx, label, STEPS) for label in labels}
    return {"cases": results, "default vs allreduce_hook": _default_vs_allreduce_hook(ctx)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_hooks_match_torch_ddp_bitwise(world_size: int) -> None:
    results = run_ranks(_all_parity_cases, world_size, args=(list(CASES),), timeout_s=240,
                        collective_timeout_s=hang_bound(60))
    for rank, per_rank in enumerate(results):
        for label, got in per_rank["cases"].items():
            assert got["diffs"] == [], f"rank {rank}, {label}: {got['diffs'][:5]}"
            assert got["buckets"] == CASES[label].buckets, (label, got["buckets"])
            if "powerSGD" in label and "before" not in label:
                _, before, after = got["stats"]
                assert after < before, f"{label}: PowerSGD never compressed ({got['stats']})"
                assert got["hook"].startswith("gloo_safe("), got["hook"]
    # DDP pre-multiplies by 1/n, allreduce_hook divides by n: same bits at 2 ranks, not at 3.
    differing, total = results[0]["default vs allreduce_hook"]
    assert total == 241
    assert (differing > 0) == (world_size == 3), differing


def _bare_powersgd(ctx: Any, engine: str) -> None:
    torch.manual_seed(0)
    model = _BigFirstBucket()
    state = psgd.PowerSGDState(None, start_powerSGD_iter=2)
    if engine == "torch":
        ddp = DDP(model, bucket_cap_mb=CAP_MB)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    else:  # DataParallelModel, bypassing register_comm_hook's gloo_safe
        ddp = DataParallelModel(model, bucket_cap_mb=CAP_MB)
        ddp.reducer.comm_hook, ddp.reducer.comm_hook_state = psgd.powerSGD_hook, state
    for _ in range(4):
        ddp(torch.randn(4, 6)).sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "mini_ddp"])
def test_bare_powerSGD_deadlocks_on_gloo_with_several_buckets(engine: str) -> None:
    """Why gloo_safe: neither torch DDP nor we can run the bare hook here. Bucket 0's
    all-reduce still runs on one Gloo worker when the other, done with bucket 1, blocks in its
    callback on an all-reduce queued behind it; then bucket 0's callback blocks the first."""
    with pytest.raises(RanksFailed) as err:
        # The harness's deadline ends the deadlock, never Gloo's timeout (far later): a rank
        # that Gloo aborted first would read as died, not as stuck.
        run_ranks(_bare_powersgd, 2, args=(engine,), timeout_s=12,
                  collective_timeout_s=hang_bound(120))
    failures = err.value.failures
    assert sorted(failures) == [0, 1]
    for rank, text in failures.items():
        assert "still running" in text, (rank, text[-2000:])
    # Where they hang (stack dumps are taken under load and may be cut short: look at both).
    assert "unpack_uncompressed_tensors_and_allreduce_ps" in "".join(failures.values())


def test_waits_in_callbacks_and_gloo_safe() -> None:
    for hook in (psgd.powerSGD_hook, psgd.batched_powerSGD_hook,
                 default.fp16_compress_wrapper(psgd.powerSGD_hook),
                 functools.partial(psgd.powerSGD_hook)):
        assert waits_in_callbacks(hook), hook
    safe = gloo_safe(psgd.powerSGD_hook)
    for hook in (default.allreduce_hook, safe,
                 default.fp16_compress_wrapper(default.allreduce_hook)):
        assert not waits_in_callbacks(hook), hook
    assert gloo_safe(safe) is safe and safe.__qualname__ == "gloo_safe(powerSGD_hook)"


def test_grad_bucket_mirrors_torch_interface() -> None:
    assert {m for m in dir(dist.GradBucket) if not m.startswith("_")} <= set(dir(GradBucket))
    a, b, buffer = torch.zeros(2, 3), torch.zeros(4), torch.arange(10.0)
    bucket = GradBucket(1, True, buffer, [a, b], [0, 6])
    assert (bucket.index(), bucket.is_last(), bucket.buffer() is buffer) == (1, True, True)
    assert [g.shape for g in bucket.gradients()] == [a.shape, b.shape]
    bucket.gradients()[0].fill_(-1)  # views into the buffer, as in torch
    assert buffer.tolist() == [-1.0] * 6 + [6.0, 7.0, 8.0, 9.0]
    assert all(p is q for p, q in zip(bucket.parameters(), [a, b], strict=True))
    bucket.set_buffer(buffer.half())  # gradients() follows the new buffer, as in torch
    assert bucket.buffer().dtype == bucket.gradients()[1].dtype == torch.float16


# ---- invalid hooks: a clear error on every rank, naming the hook (and bucket), no hang --------
def _one_arg(bucket):  # noqa: ANN001, ANN202 - unannotated on purpose
    return bucket


def _bad_annotation(state: Any, bucket: torch.Tensor) -> torch.futures.Future:
    raise AssertionError("never called")


# Unannotated: this file's annotations are strings, which registration refuses as torch does.
def _returns_tensor(state, bucket):  # noqa: ANN001, ANN202
    return bucket.buffer()


def _short_result(state, bucket):  # noqa: ANN001, ANN202
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer()[:-1])
    return fut


def _raw_allreduce_future(state, bucket):  # noqa: ANN001, ANN202
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # holds [tensor]


# label -> (hook, error type, words the message must contain)
INVALID: dict[str, tuple[Any, type, list[str]]] = {
    "not callable": (42, TypeError, ["must be callable", "42"]),
    "one argument": (_one_arg, TypeError, ["_one_arg", "two arguments", "(bucket)"]),
    "bucket annotation": (_bad_annotation, ValueError, ["_bad_annotation", "dist.GradBucket"]),
    "returns a tensor": (_returns_tensor, RuntimeError,
                         ["_returns_tensor", "torch.futures.Future", "bucket 0", "Tensor"]),
    "wrong shape": (_short_result, ValueError, ["_short_result", "bucket 0", "[240]", "[241]"]),
    "future holds a list": (_raw_allreduce_future, TypeError,
                            ["_raw_allreduce_future", "bucket 0", "list", "f.value()[0]"]),
    "registered twice": (default.fp16_compress_hook, RuntimeError,
                         ["only be called once", "fp16_compress_hook", "allreduce_hook"]),
}


def _invalid_hook_errors(ctx: Any) -> dict[str, tuple[str, str]]:
    out = {}
    for label, (hook, _, _) in INVALID.items():
        model = DataParallelModel(_model(), bucket_cap_mb=CAP_MB)
        try:
            if label == "registered twice":
                model.register_comm_hook(None, default.allreduce_hook)
            model.register_comm_hook(None, hook)
            model(torch.randn(2, 6)).sum().backward()
            out[label] = ("no error", "")
        except Exception as err:  # noqa: BLE001 - the test inspects it
            out[label] = (type(err).__name__, str(err))
    return out


def test_invalid_hooks_raise_clear_errors_on_every_rank() -> None:
    results = run_ranks(_invalid_hook_errors, 3, timeout_s=120, collective_timeout_s=hang_bound(30))
    for rank, per_rank in enumerate(results):
        for label, (_, error, words) in INVALID.items():
            kind, message = per_rank[label]
            assert kind == error.__name__, (rank, label, kind, message)
            missing = [w for w in words if w not in message]
            assert not missing, (rank, label, missing, message)

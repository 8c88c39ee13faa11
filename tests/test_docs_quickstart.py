"""The code in docs/quickstart.md runs as shown, on two ranks, and does what the page says.

Each snippet is read out of the markdown and executed; the names it leaves to the reader
(``MyModel``, ``loader``, ``micro_batches``, ``loss_fn``) are supplied here. Both snippets run
once with DataParallelModel and once with torch DDP in the same processes on the same data,
and every gradient and parameter is compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from docs_snippets import block_containing
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel

MAIN = block_containing("quickstart.md", "DataParallelModel(MyModel())")
ACCUMULATE = block_containing("quickstart.md", "model.no_sync()")


def _my_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    return [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen))
            for _ in range(n)]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _run_main(ctx, workdir: str) -> list[bool]:
    """The replace-DDP snippet, verbatim, with torch DDP as the reference."""
    os.chdir(workdir if ctx.rank == 0 else os.path.join(workdir, f"r{ctx.rank}"))
    real_init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: None  # run_ranks has already joined the group
    try:
        results = {}
        for name, wrap in (("mini", DataParallelModel), ("torch", DDP)):
            env = {"MyModel": _my_model, "loader": _batches(ctx.rank, 3),
                   "loss_fn": nn.functional.cross_entropy}
            code = MAIN if wrap is DataParallelModel else MAIN.replace(
                "from mini_ddp import DataParallelModel", "DataParallelModel = _DDP")
            env["_DDP"] = DDP
            exec(compile(code, "docs/quickstart.md", "exec"), env)  # noqa: S102
            # Only rank 0 writes: another rank finds no file, not a stale one (own directory).
            assert os.path.exists("ckpt.pt") == (ctx.rank == 0)
            results[name] = (env["model"], torch.load("ckpt.pt") if ctx.rank == 0 else {})
    finally:
        dist.init_process_group = real_init
    (mini, mini_sd), (ref, ref_sd) = results["mini"], results["torch"]
    same_params = all(torch.equal(a, b) for a, b in zip(mini.parameters(), ref.parameters(),
                                                          strict=True))
    same_grads = all(torch.equal(a, b) for a, b in zip(_grads(mini), _grads(ref), strict=True))
    same_ckpt = list(mini_sd) == list(ref_sd) and all(
        torch.equal(mini_sd[k], ref_sd[k]) for k in ref_sd)
    return [same_params, same_grads, same_ckpt]


def _run_accumulate(ctx) -> dict[str, bool]:
    """The no_sync snippet: local accumulation on the first micro-batches, one sync at the end."""
    micro = _batches(ctx.rank, 4)
    # What the gradients must be just before the last micro-batch: the plain local sum.
    local = copy.deepcopy(_my_model())
    for x, y in micro[:-1]:
        nn.functional.cross_entropy(local(x), y).backward()
    local_sum = _grads(local)
    out = {}
    for name, wrap in (("mini", DataParallelModel), ("torch", DDP)):
        model = wrap(_my_model())
        seen: list[list[torch.Tensor]] = []

        def loss_fn(output, target, model=model, seen=seen):
            # Called between forward and backward: .grad holds what the earlier backwards left.
            seen.append([None if p.grad is None else p.grad.detach().clone()
                         for p in model.parameters()])
            return nn.functional.cross_entropy(output, target)

        env = {"model": model, "micro_batches": micro, "loss_fn": loss_fn,
               "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
        exec(compile(ACCUMULATE, "docs/quickstart.md", "exec"), env)  # noqa: S102
        out[name] = (seen[-1], model)
    before_last, mini = out["mini"]
    ref_before_last, ref = out["torch"]
    # Not synchronised: equal to the local sum, hence different from the other rank's.
    gathered = [torch.zeros_like(before_last[0]) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, before_last[0])
    return {
        "local sum before the last micro-batch": all(
            torch.equal(a, b) for a, b in zip(before_last, local_sum, strict=True)),
        "ranks differ before the last micro-batch": not torch.equal(gathered[0], gathered[1]),
        "same as torch DDP before the last micro-batch": all(
            torch.equal(a, b) for a, b in zip(before_last, ref_before_last, strict=True)),
        "same gradients as torch DDP after": all(
            torch.equal(a, b) for a, b in zip(_grads(mini), _grads(ref), strict=True)),
        "same parameters as torch DDP after": all(
            torch.equal(a, b) for a, b in zip(mini.parameters(), ref.parameters(), strict=True)),
    }


def test_quickstart_replace_ddp_snippet_runs_and_matches_torch_ddp(tmp_path):
    (tmp_path / "r1").mkdir()
    for checks in run_ranks(_run_main, 2, args=(str(tmp_path),), timeout_s=90):
        assert checks == [True, True, True]


def test_quickstart_no_sync_snippet_accumulates_locally_then_matches_torch_ddp():
    assert "model(x)" in ACCUMULATE.split("with model.no_sync():")[1].split("\nx, y")[0], \
        "the forward must be inside no_sync()"
    for checks in run_ranks(_run_accumulate, 2, timeout_s=90):
        assert all(checks.values()), checks


def test_no_sync_around_backward_only_still_syncs():
    """The mistake the page warns about: forward outside no_sync() means the backward syncs."""
    for synced in run_ranks(_backward_only_inside, 2, timeout_s=90):
        assert synced


def _backward_only_inside(ctx) -> bool:
    model = DataParallelModel(_my_model())
    x, y = _batches(ctx.rank, 1)[0]
    loss = nn.functional.cross_entropy(model(x), y)
    with model.no_sync():
        loss.backward()
    grad = model.module[0].weight.grad
    gathered = [torch.zeros_like(grad) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, grad)
    return torch.equal(gathered[0], gathered[1])  # equal on both ranks: it was all-reduced

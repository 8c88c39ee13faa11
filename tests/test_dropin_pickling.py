"""A wrapped model pickles like torch DDP: ``copy.deepcopy`` and ``torch.save`` of the whole model.

torch DDP drops its process group and reducer when pickled and rebuilds the reducer on the
default group when unpickled; so do we. Each case treats a torch DDP model and a
DataParallelModel the same way in the same ranks (world size 3) and checks, with
``torch.equal``, that the copies keep training bit for bit alike.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel

WORLD = 3


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, rank: int) -> None:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def _save_load(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _copies_train_alike(ctx, how: str) -> dict[str, bool]:
    torch.manual_seed(100 + ctx.rank)  # different start per rank: the broadcast must win
    base = _model()
    # shared_memory_min_bytes=0: at two ranks every bucket (and so every zero-copy .grad)
    # lives in shared memory, which the copy must not share.
    wrapped = {"torch": DDP(copy.deepcopy(base)),
               "ours": DataParallelModel(copy.deepcopy(base), shared_memory_min_bytes=0)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in wrapped.items()}
    for seed in range(2):
        for k, m in wrapped.items():
            _step(m, opts[k], seed, ctx.rank)
    clone = copy.deepcopy if how == "deepcopy" else _save_load
    copies = {k: clone(m) for k, m in wrapped.items()}
    copy_opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in copies.items()}
    same_start = all(torch.equal(a, b) for a, b in zip(_state(copies["torch"]),
                                                       _state(copies["ours"]), strict=True))
    for seed in range(2, 5):  # the originals and the copies both keep training, interleaved
        for k in wrapped:
            _step(wrapped[k], opts[k], seed, ctx.rank)
            _step(copies[k], copy_opts[k], seed + 50, ctx.rank)
    equal = lambda a, b: all(torch.equal(x, y) for x, y in zip(_state(a), _state(b),  # noqa: E731
                                                              strict=True))
    everyone = [None] * ctx.world_size
    # Parameters only: BatchNorm's running statistics are per rank until the next broadcast.
    dist.all_gather_object(everyone, [p.detach() for p in copies["ours"].parameters()])
    return {"same_start": same_start,
            "copies_equal": equal(copies["torch"], copies["ours"]),
            "originals_equal": equal(wrapped["torch"], wrapped["ours"]),
            "copy_is_separate": not equal(copies["ours"], wrapped["ours"]),
            "copies_in_sync": all(torch.equal(a, b) for other in everyone
                                  for a, b in zip(other, everyone[0], strict=True)),
            "copy_has_reducer": copies["ours"].reducer is not wrapped["ours"].reducer,
            # Two ranks: the original sums big buckets in shared memory, the copy through Gloo.
            "copy_has_no_transport": copies["ours"].transport is None,
            "original_in_shared_memory": ctx.world_size != 2 or all(
                wrapped["ours"].transport.owns(b.buffer) for b in wrapped["ours"].reducer.layout.buckets)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how, world", [("deepcopy", WORLD), ("torch.save", WORLD),
                                        ("deepcopy", 2)])
def test_a_copy_of_the_wrapped_model_keeps_training_like_torch_ddp(how, world):
    for result in run_ranks(_copies_train_alike, world, (how,), timeout_s=150):
        assert all(result.values()), result


def _one_rank_copies(ctx) -> bool:
    model = DataParallelModel(_model())
    if ctx.rank == 0:  # an EMA copy on rank 0 only: copying may involve no collective
        ema = copy.deepcopy(model)
        with torch.no_grad():
            # The inner module: the copy's own forward broadcasts buffers (a collective on
            # every rank), exactly as a torch DDP copy's does.
            ema.module.eval()(torch.randn(4, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, ctx.rank)
    return True


@pytest.mark.timeout(120)
def test_one_rank_alone_may_deepcopy_without_the_others_hanging():
    assert run_ranks(_one_rank_copies, WORLD, timeout_s=90) == [True] * WORLD


def _pickle_refusals(ctx) -> list[tuple[str, str, str, str]]:
    group = dist.new_group(list(range(WORLD)))
    results = []
    for make in (lambda m: DDP(m, process_group=group),
                 lambda m: DataParallelModel(m, process_group=group)):
        model = make(_model())
        try:
            copy.deepcopy(model)
            results.append(("ok", ""))
        except Exception as err:  # noqa: BLE001 - compared below
            results.append((type(err).__name__, str(err)))
    return [(*results[0], *results[1])]


@pytest.mark.timeout(120)
def test_pickling_a_model_on_a_non_default_group_is_refused_like_torch():
    for [(torch_type, torch_msg, our_type, our_msg)] in run_ranks(_pickle_refusals, WORLD,
                                                                  timeout_s=90):
        assert torch_type == our_type == "RuntimeError"
        assert torch_msg in our_msg

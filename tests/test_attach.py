"""mini_ddp.attach on torch's own DistributedDataParallel: no bit of training changes, and the
classic mistakes are named in the words DataParallelModel uses (tests/mistakes/train.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.ranks import run_ranks
from test_mistakes import run_script, told
from torch import nn

import mini_ddp
from mini_ddp.attach import attachment


def said_by(output: str, rank: int) -> str:
    """Every line ``rank`` printed, a multi-line log record's continuation lines included."""
    lines, mine = [], False
    for line in output.splitlines():
        if line.startswith("[rank "):
            mine = line.startswith(f"[rank {rank}]")
        if mine:
            lines.append(line)
    return "\n".join(lines)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _fp16_hook(state, bucket):  # noqa: ANN001, ANN202 - torch checks the annotations
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.fp16_compress_hook(state, bucket)


def _train_pair(ctx, debug: bool, user_hook: bool) -> bool:
    plain = nn.parallel.DistributedDataParallel(_net())
    seen = nn.parallel.DistributedDataParallel(_net())
    assert mini_ddp.attach(seen, debug=debug, replica_check_every=1) is seen
    if user_hook:  # after attach: the timing wraps the user's hook
        plain.register_comm_hook(dist.group.WORLD, _fp16_hook)
        seen.register_comm_hook(dist.group.WORLD, _fp16_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, seen)]
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(4):
        x = torch.randn(6, 8, generator=gen)
        for model, opt in zip((plain, seen), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for a, b in zip(plain.state_dict().values(), seen.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    assert attachment(seen) is not None and attachment(plain) is None
    return True


@pytest.mark.parametrize(("debug", "user_hook"), [(False, False), (True, False), (False, True)],
                         ids=["defaults", "debug", "user_comm_hook"])
def test_attaching_changes_no_bit_of_torch_ddp_training(debug: bool, user_hook: bool) -> None:
    assert run_ranks(_train_pair, 2, (debug, user_hook), timeout_s=240) == [True, True]


# (mistake, debug switch, the text each rank-side must contain): the same for both engines.
NAMED = [
    ("load_on_one_rank", False, 0, "the replicas differ at step 1: in parameter fc1.weight"),
    ("same_data", False, 0, "computed bitwise identical local gradients in the first"),
    ("eval_mode", False, 0, "the ranks run different train/eval modes"),
    ("param_added", False, 0, "parameters extra require a gradient but DataParallelModel"),
    ("bypass", False, 0, "forward bypasses the wrapper"),
    ("finish_early", False, 0, "rank 1 finished (destroyed its process group) after step 3"),
    ("nan", True, 1, "holds NaN in the backward of step 3, before the all-reduce"),
    ("nan", True, 0, "came from rank 1"),
    ("no_grad_eval", True, 0, "an extra forward"),
    ("uneven", True, 0, "uneven inputs"),
    ("one_rank_collective", True, 1, "rank 0 is inside torch.distributed.all_reduce (called at "
                                     "train.py"),
    ("stuck", False, 0, "rank 1: has not reached bucket"),
    ("stuck", False, 0, "in main: time.sleep(40)"),
]


@pytest.mark.parametrize("engine", ["mini", "attach"])
@pytest.mark.parametrize(("mistake", "debug", "rank", "text"), NAMED,
                         ids=[f"{m}-{r}" for m, _, r, _ in NAMED])
def test_a_classic_mistake_is_named_alike_under_attach(engine: str, mistake: str, debug: bool,
                                                        rank: int, text: str) -> None:
    out = run_script(mistake, engine, debug, env={"STALL_S": "3"} if mistake == "stuck" else {})
    mine = said_by(out, rank)
    assert text in mine, out[-4000:]
    assert "died" not in told(out, 0) + told(out, 1), out[-4000:]

"""mini_ddp.attach on torch's own DistributedDataParallel: no bit of training changes, and the
classic mistakes are named in the words DataParallelModel uses (tests/mistakes/train.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from helpers.ranks import RanksFailed, run_ranks
from helpers.shared_runs import shared_folder
from test_mistakes import shared_script_run, short_waits, told
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


# (mistake, debug switch, rank, the text that rank's output must contain): the same for both
# engines.
NAMED = [
    ("load_on_one_rank", False, 0, "the replicas differ at step 1: in parameter fc1.weight"),
    ("same_data", False, 0, "computed bitwise identical local gradients in the first"),
    ("eval_mode", False, 0, "the ranks run different train/eval modes"),
    ("param_added", False, 0, "parameters extra require a gradient but DataParallelModel"),
    ("bypass", False, 0, "forward bypasses the wrapper"),
    ("finish_early", False, 0, "rank 1 finished (destroyed its process group) after step 3"),
    ("nan", True, 1, "holds NaN in the backward of step 3, before the all-reduce"),
    ("nan", True, 0, "came from rank 1"),
    ("nan", False, 1, "holds NaN in the backward of step 3, before the all-reduce"),
    ("nan", False, 0, "came from rank 1"),
    ("no_grad_eval", True, 0, "an extra forward"),
    ("no_grad_eval", False, 0, "an extra forward through the wrapper on rank 0: by step 100"),
    ("no_grad_eval", False, 1, "an extra forward through the wrapper on rank 0: by step 100"),
    ("extra_forward", True, 0, "an extra forward through"),
    ("extra_forward", True, 1, "an extra forward through"),
    ("extra_forward", False, 1, "an extra forward through the wrapper on rank 0 — a forward "
                                "rank 1 did not run"),
    ("uneven", True, 0, "uneven inputs"),
    ("uneven", False, 0, "(rank 0 is at step 6, rank 1 at step 5) and rank 1 went on past its "
                         "loop — uneven inputs"),
    ("one_rank_collective", True, 1, "rank 0 is inside torch.distributed.all_reduce (called at "
                                     "train.py"),
    ("one_rank_collective", False, 1, "rank 0 is inside torch.distributed.all_reduce (called "
                                      "at train.py"),
    ("stuck", False, 0, "rank 1: has not reached bucket"),
    ("stuck", False, 0, "in main: time.sleep(40)"),
]


CONCURRENT_RUNS = 6  # each run is two ranks that mostly wait: six at once keep two cores busy


@pytest.fixture(scope="module")
def output(request) -> Iterator[Callable[[str, str, bool], str]]:
    """``output(mistake, engine, debug)``: that script run's output (both ranks). One run per
    script, engine and switch, whichever tests read it (tests/test_mistakes.py's among them:
    ``shared_script_run``). The runs the selected tests need all start at once,
    ``CONCURRENT_RUNS`` at a time, those that wait first — out a process-group timeout, then
    for a stall warning (``short_waits``) — so that the others run meanwhile; a run that
    fails or hangs fails the tests that read it."""
    wanted = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is request.module and "mistake" in params:
            debug = params.get("debug", False)
            wanted.add((params["mistake"], params.get("engine", "mini"), debug))

    def longest_wait_first(run: tuple[str, str, bool]) -> tuple:
        env = short_waits(run[0], run[2])
        return "TIMEOUT_S" not in env, "STALL_S" not in env, run

    order = sorted(wanted, key=longest_wait_first)
    folder = shared_folder(request)
    with ThreadPoolExecutor(CONCURRENT_RUNS) as pool:
        runs = {run: pool.submit(shared_script_run, folder, *run) for run in order}
        yield lambda mistake, engine, debug: runs[mistake, engine, debug].result()
        for future in runs.values():
            future.cancel()  # the runs not yet started (a run already started ends by itself)


@pytest.mark.parametrize("engine", ["mini", "attach"])
@pytest.mark.parametrize(("mistake", "debug", "rank", "text"), NAMED,
                         ids=[f"{m}-{r}" for m, _, r, _ in NAMED])
def test_a_classic_mistake_is_named_alike_under_attach(output, engine: str, mistake: str,
                                                        debug: bool, rank: int, text: str
                                                        ) -> None:
    out = output(mistake, engine, debug)
    mine = said_by(out, rank)
    assert text in mine, out[-4000:]
    assert "died" not in told(out, 0) + told(out, 1), out[-4000:]
    if mistake in ("no_grad_eval", "extra_forward"):  # the message that names it, no other
        named = next(line for line in mine.splitlines() if text in line)
        assert "uneven inputs" not in named, named


def _evaluations(ctx, engine: str) -> dict[str, bool]:
    """Per case, whether this rank was told of an extra forward (a replica check every step)."""
    import logging

    from mini_ddp import DataParallelModel

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("mini_ddp").addHandler(handler)
    gen = torch.Generator().manual_seed(ctx.rank)
    found = {}
    for case in ("rank0", "every_rank", "no_buffers", "no_sync"):
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)) \
            if case == "no_buffers" else _net()
        if engine == "mini":
            model = DataParallelModel(net, replica_check_every=1)
        else:
            model = mini_ddp.attach(nn.parallel.DistributedDataParallel(net),
                                    replica_check_every=1)
        said.clear()
        # After step 2: the buckets are rebuilt at forward 2, and torch DDP's rebuild
        # broadcasts the bucket order, which a one-rank evaluation before it would meet (a
        # size mismatch that Gloo aborts on, in either engine).
        for step in range(1, 6):
            model(torch.randn(6, 8, generator=gen)).square().mean().backward()
            if step == 2 and case == "no_sync":  # gradient accumulation, on every rank
                with model.no_sync():
                    model(torch.randn(6, 8, generator=gen)).sum().backward()
            elif step == 2 and (ctx.rank == 0 or case == "every_rank"):
                with torch.no_grad():
                    model(torch.randn(6, 8, generator=gen))  # an evaluation forward
        found[case] = any("an extra forward through the wrapper on rank 0" in t for t in said)
    return found


@pytest.mark.parametrize("engine", ["mini", "attach"])
def test_an_evaluation_forward_on_one_rank_is_counted_only_when_it_broadcasts(engine: str
                                                                             ) -> None:
    # Named on every rank where rank 0 alone broadcast the buffers outside a training step;
    # an evaluation on every rank, or on a model without buffers (no collective), and a
    # no_sync() step on every rank are not mistakes.
    told = {"rank0": True, "every_rank": False, "no_buffers": False, "no_sync": False}
    assert run_ranks(_evaluations, 2, (engine,), timeout_s=120) == [told, told]


def _killed_rank(ctx, debug: bool) -> str:
    import logging
    import os
    import signal

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("mini_ddp").addHandler(handler)
    model = mini_ddp.attach(nn.parallel.DistributedDataParallel(_net()), debug=debug,
                            stall_warning_s=2)
    gen = torch.Generator().manual_seed(ctx.rank)
    try:
        for step in range(1, 6):
            if ctx.rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # killed: no finish mark, no word
            model(torch.randn(3, 8, generator=gen)).sum().backward()
    except RuntimeError as error:  # torch's own error: what mini_ddp said comes before it
        raise RuntimeError("\n".join([f"{type(error).__name__}: {error}", *said])) from None
    return "done"


@pytest.mark.parametrize("debug", [False, True], ids=["defaults", "debug"])
def test_a_killed_rank_is_said_to_have_most_likely_died_under_attach(debug: bool) -> None:
    # The process group's own timeout (300 s) is far past the bound: only the collective
    # failing at once (the switch stepping aside for a rank that neither left a finish mark
    # nor answers) ends this run in time.
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_killed_rank, 2, (debug,), timeout_s=150, collective_timeout_s=300)
    text = str(failed.value)
    rank0 = text.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]
    assert "Another rank has most likely died" in rank0, rank0
    assert "finished" not in rank0 and "uneven inputs" not in rank0, rank0


@pytest.mark.parametrize("mistake", ["uneven", "one_rank_collective"])
def test_a_broadcast_that_can_never_pair_ends_the_mini_run_at_defaults(output, mistake: str
                                                                      ) -> None:
    # DataParallelModel waits for its buffer broadcast itself: the stall report's verdict ends
    # the run (torch DDP's C++ broadcast, under attach, waits for the process group's timeout).
    out = output(mistake, "mini", False)
    waiting = 0 if mistake == "uneven" else 1
    assert told(out, waiting).startswith(f"[rank {waiting}] SyncMismatchError: mini_ddp: rank "
                                         f"{waiting} waited 3 s in the broadcast of the buffers"), out

"""Bad input is refused with an error naming the culprit, on every rank, and nothing hangs.

Refusals that leave the process group usable are batched: one set of ranks tries every
construction mistake, another every mistake made during a step. Cases that leave a collective
unmatched (a graph that changes under ``static_graph=True``) get their own ranks.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel, MarkedTwiceError, MiniDDPError
from mini_ddp.engine.comm import ParameterMismatchError

WORLD = 3


def _outcome(make) -> tuple[str, str]:
    """(error type, message) of calling ``make()``, or ("ok", "") when nothing was raised."""
    try:
        make()
    except Exception as err:  # noqa: BLE001 - the test asserts on the type
        return type(err).__name__, str(err)
    return "ok", ""


# ---- construction ------------------------------------------------------------------------
def _mlp(*widths: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)))


def _per_rank_models(rank: int) -> dict[str, nn.Module]:
    """One model per mistake; ranks 1 or 2 build theirs differently from rank 0."""
    named = OrderedDict([("encoder" if rank == 1 else "enc", nn.Linear(4, 4)),
                         ("head", nn.Linear(4, 2))])
    return {
        "count": _mlp(4, 4, 2, 2) if rank == 2 else _mlp(4, 4, 2),
        "name": nn.Sequential(named),
        "shape": _mlp(4, 3 if rank == 1 else 2),
        "dtype": _mlp(4, 2).double() if rank == 2 else _mlp(4, 2),
        "meta device": nn.Linear(4, 4, device="meta"),
        "cpu + meta": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta")),
        "lazy": nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(3)),
    }


# device_mesh, bucket_cap_mb_list and the delay_all_reduce pair: tests/test_dropin_*.py;
# mixed_precision, skip_all_reduce_unused_params, batched_grad_copy: test_dropin_reducer_*.py.


def _construction_refusals(ctx) -> dict[str, tuple[str, str]]:
    return {name: _outcome(lambda m=model: DataParallelModel(m))
            for name, model in _per_rank_models(ctx.rank).items()}


@pytest.fixture(scope="module")
def construction() -> list[dict[str, tuple[str, str]]]:
    return run_ranks(_construction_refusals, WORLD, timeout_s=120,
                     collective_timeout_s=hang_bound(60))


# case -> (error type, words the message must contain)
MISMATCH = {
    "count": ["rank 2 has 6 parameters", "rank 0 has 4", "'2.weight'", "[2, 2]"],
    "name": ["'encoder.weight' on rank 1", "'enc.weight' on rank 0", "[4, 4]"],
    "shape": ["'0.weight'", "shape [3, 4] on rank 1", "[2, 4] on rank 0"],
    "dtype": ["'0.weight'", "torch.float64 on rank 2", "torch.float32 on rank 0"],
}


# case -> rank -> the sentence torch DDP raises there (verbatim, from torch 2.14's C++ check);
# where torch raises nothing (names, dtypes, rank 0's view of a shape) there is no sentence.
TORCH_SAYS = {
    "count": {0: "DDP expects same model across all ranks, but Rank 0 has 4 params, while "
                 "rank 2 has inconsistent 6 params.",
              1: "DDP expects same model across all ranks, but Rank 1 has 4 params, while "
                 "rank 2 has inconsistent 6 params.",
              2: "DDP expects same model across all ranks, but Rank 2 has 6 params, while "
                 "rank 0 has inconsistent 4 params."},
    "shape": {1: "[1]: params[0] in this process with sizes [3, 4] appears not to match sizes "
                 "of the same param in process 0."},
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(MISMATCH))
def test_models_that_differ_across_ranks_are_refused_on_every_rank(construction, case):
    for rank, results in enumerate(construction):
        # torch's own sentence first, where torch raises on this rank; then ours.
        torch_says, _, ours = results[case][1].partition("mini_ddp: ")
        assert torch_says.strip() == TORCH_SAYS.get(case, {}).get(rank, ""), results[case]
    # Our verdict is the same everywhere, rank 0's view included.
    messages = {(kind, message.partition("mini_ddp: ")[2])
                for kind, message in (results[case] for results in construction)}
    assert len(messages) == 1, messages
    kind, message = messages.pop()
    assert kind == ParameterMismatchError.__name__ and issubclass(ParameterMismatchError,
                                                                  MiniDDPError)
    for words in MISMATCH[case]:
        assert words in message, message


def _ours_then_torchs(ctx) -> dict[str, tuple[tuple[str, str], tuple[str, str]]]:
    """Count and shape mismatches under DataParallelModel, then torch DDP (whose shape check
    leaves rank 0 waiting in a broadcast until the collective timeout: so it runs last)."""
    from torch.nn.parallel import DistributedDataParallel
    models = {"count": lambda: _mlp(4, 4, 2, 2) if ctx.rank == 1 else _mlp(4, 4, 2),
              "shape": lambda: _mlp(4, 3 if ctx.rank == 1 else 2)}
    return {case: (_outcome(lambda m=make: DataParallelModel(m())),
                   _outcome(lambda m=make: DistributedDataParallel(m())))
            for case, make in models.items()}


@pytest.mark.timeout(60)
def test_a_mismatch_message_contains_torchs_sentence_verbatim():
    # The collective timeout ends torch's shape check's wait (longer on a slow machine: it
    # bounds every other collective of the run too).
    for rank, found in enumerate(run_ranks(_ours_then_torchs, 2, timeout_s=40,
                                           collective_timeout_s=hang_bound(3))):
        for case, ((kind, message), (torch_kind, torch_message)) in found.items():
            assert kind == ParameterMismatchError.__name__, (case, kind, message)
            if case == "count" or rank == 1:  # where torch's own check raises
                assert torch_kind == "RuntimeError", (case, rank, torch_kind, torch_message)
                assert message.startswith(torch_message + " mini_ddp: "), (torch_message, message)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case, words", [
    ("meta device", ["'weight'", "meta device"]),
    ("cpu + meta", ["'1.weight'", "meta device"]),
    ("lazy", ["'1.weight'", "uninitialized", "dummy forward"]),
])
def test_parameters_that_cannot_be_synchronised_are_refused(construction, case, words):
    for results in construction:
        kind, message = results[case]
        assert kind in ("RuntimeError", "ValueError"), (kind, message)
        for word in words:
            assert word in message, message


def test_wrapping_before_init_process_group_says_what_to_call() -> None:
    with pytest.raises(ValueError, match=r"init_process_group"):  # torch DDP's type
        DataParallelModel(nn.Linear(2, 2))


# ---- during a step -----------------------------------------------------------------------
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.left, self.right = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.head = "both"

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.left(h) + self.right(h) if self.head == "both" else getattr(self, self.head)(h)


def _short_result_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer()[:-1].clone())  # one element short
    return future


def _not_a_future_hook(state, bucket):
    return bucket.buffer()


def _forward_twice_then_one_backward(ctx) -> bool:
    """Two forwards, one backward of the summed losses: allowed, and equal to torch DDP."""
    torch.manual_seed(0)
    base = _TwoHeads()
    ours, theirs = DataParallelModel(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    torch.manual_seed(10 + ctx.rank)
    x1, x2 = torch.randn(5, 6), torch.randn(5, 6)
    for model in (ours, theirs):
        (model(x1).square().sum() + model(x2).sum()).backward()
    return all(torch.equal(a.grad, b.grad) for a, b in
               zip(ours.module.parameters(), theirs.module.parameters(), strict=True))


def _step_refusals(ctx) -> dict[str, tuple[str, str]]:
    torch.manual_seed(ctx.rank)
    x = torch.randn(4, 6)
    results: dict[str, tuple[str, str]] = {}

    model = DataParallelModel(_TwoHeads(), bucket_cap_mb=0.0001)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    results["backward twice"] = _outcome(loss.backward)

    def two_forwards_two_backwards():
        first, second = model(x).sum(), model(x).sum()
        first.backward()
        second.backward()
    results["two forwards, two backwards"] = _outcome(two_forwards_two_backwards)

    def two_forwards_unused_search():
        net = _TwoHeads()
        net.head = "left"
        searching = DataParallelModel(net, find_unused_parameters=True)
        first = searching(x).sum()
        net.head = "right"
        (first + searching(x).sum()).backward()  # 'left' was found unused by forward 2
    results["two forwards, find_unused"] = _outcome(two_forwards_unused_search)

    def accumulate_with_no_sync():  # the legitimate way to run several backwards
        for _ in range(2):
            with model.no_sync():
                model(x).sum().backward()
            model(x).sum().backward()
    results["no_sync accumulation"] = _outcome(accumulate_with_no_sync)

    for name, hook in (("short hook result", _short_result_hook),
                       ("hook returns a tensor", _not_a_future_hook)):
        hooked = DataParallelModel(_TwoHeads())
        hooked.register_comm_hook(None, hook)
        results[name] = _outcome(lambda m=hooked: m(x).sum().backward())
    results["hook with one argument"] = _outcome(
        lambda: DataParallelModel(_TwoHeads()).register_comm_hook(None, lambda bucket: bucket))
    results["forward twice, one backward == torch DDP"] = (
        "ok" if _forward_twice_then_one_backward(ctx) else "differs", "")
    return results


@pytest.fixture(scope="module")
def step() -> list[dict[str, tuple[str, str]]]:
    return run_ranks(_step_refusals, WORLD, timeout_s=120, collective_timeout_s=hang_bound(60))


STEP = {
    # torch DDP ignores the second backward's hooks: its gradients stay local, ranks diverge.
    "backward twice": ("MarkedTwiceError", ["already synchronised", "retain_graph", "rank {r}"]),
    "two forwards, two backwards": ("MarkedTwiceError", ["already synchronised", "rank {r}"]),
    # torch DDP raises "Expected to mark a variable ready only once" here too.
    "two forwards, find_unused": ("MarkedTwiceError", ["only once", "'left.", "rank {r}"]),
    "no_sync accumulation": ("ok", []),
    "short hook result": ("ValueError", ["_short_result_hook", "shape [", "expected ["]),
    "hook returns a tensor": ("RuntimeError", ["_not_a_future_hook", "Future", "Tensor"]),
    "hook with one argument": ("TypeError", ["two arguments"]),
    "forward twice, one backward == torch DDP": ("ok", []),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(STEP))
def test_step_mistakes_are_refused_on_every_rank(step, case):
    kind, words = STEP[case]
    for rank, results in enumerate(step):
        got_kind, message = results[case]
        assert got_kind == kind, (rank, got_kind, message)
        for word in words:
            assert word.format(r=rank) in message, message
    if kind == "MarkedTwiceError":
        assert issubclass(MarkedTwiceError, MiniDDPError)


# ---- a graph that changes under static_graph=True ----------------------------------------
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.extra, self.b = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.use_extra = True

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(self.extra(h) if self.use_extra else h)


def _static_graph_changes_on_rank1(ctx, first: bool) -> tuple[str, str]:
    """Rank 1 changes its graph at step 2: it starts (or stops) using 'extra'."""
    torch.manual_seed(0)
    net = _Branchy()
    model = DataParallelModel(net, static_graph=True, sync_timeout_s=10)
    for step in range(4):
        net.use_extra = first != (ctx.rank == 1 and step == 2)
        outcome = _outcome(lambda: model(torch.randn(3, 4)).sum().backward())
        if outcome[0] != "ok":
            return outcome
    return "ok", ""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("starts_using", [True, False], ids=["starts using", "stops using"])
def test_a_changed_static_graph_is_an_error_on_every_rank(starts_using):
    results = run_ranks(_static_graph_changes_on_rank1, WORLD, args=(not starts_using,),
                        timeout_s=120, collective_timeout_s=hang_bound(60))
    kind, message = results[1]
    if starts_using:  # caught in the hook, naming the parameter
        assert kind == "MiniDDPError" and "'extra." in message and "rank 1" in message
        assert "static_graph=True" in message
    else:  # its bucket never fills; the next forward names what got no gradient
        assert kind == "UnfinishedReductionError" and "extra.weight" in message
    for rank in (0, 2):  # the others: the bucket rank 1 never contributed to, by name
        kind, message = results[rank]
        assert kind in ("CollectiveError", "GradSyncTimeout"), (kind, message)
        assert "all-reduce of bucket" in message and f"rank {rank}" in message

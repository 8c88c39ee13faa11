"""A forward that raises: the engine's per-forward state is reset, the exception is untouched.

Each step has two micro-batches, the first under ``no_sync()``. On one step (the first, or a
later one) the module raises half-way through the second micro-batch's forward, after its first
layers ran (as a bad batch or a failed check in user code would). The user catches the
exception and drops that micro-batch: on that step only a penalty computed from the parameters
themselves is back-propagated — through no forward of the wrapper, so neither engine
synchronises it — and the following steps train normally. Both engines run in the same
processes on the same data and are compared with ``torch.equal`` after every backward and
every optimizer step.

What torch DDP does after an exception in forward, as found by these tests (torch 2.14): the
forward's first half ran (``prepare_for_forward`` counted the iteration, buffers were
broadcast), but ``prepare_for_backward`` never ran, so the reducer expects no autograd hook: a
backward before the next forward (the penalty) is ignored and its gradients stay local, and
the next forward's "Expected to have finished reduction in the prior iteration" check passes
(nothing was marked ready). The exception itself reaches the caller as the module raised it:
the same object, the module's ``raise`` as the innermost frame, nothing chained to it.

With ``find_unused_parameters=True`` the ignored backward still marks the parameters it
reached in the local used map, and nothing clears that map until a synchronised backward
finishes. When the next step leaves a parameter unused and its ``.grad`` was set to None in
between (``zero_grad()``'s default), torch's reducer fails that backward with a RuntimeError:
"Encountered gradient which is undefined, but still allreduced by DDP reducer. This indicates
a bug in DDP implementation, please report a bug with a repro to PyTorch." (its check in
``mark_variable_ready_dense``; the same happens after a step spent wholly inside ``no_sync()``).
We raise the same sentence, naming the parameter. With ``zero_grad(set_to_none=False)`` both
engines train on, bitwise equal.

What the test guards on our side: the flag "a synchronised forward is running" is reset on
every exit of the forward, the exceptional one included; left set, it makes the engine refuse
the penalty's backward (``UnarmedBackwardError``: "while DataParallelModel's forward was still
running"), which torch DDP accepts.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from helpers.ranks import run_ranks
from reducer_parity import compare
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel
from mini_ddp.engine.reducer import UNDEFINED_BUT_USED

BAD_STEP = {"first": 0, "later": 2}


class BadBatch(ValueError):
    """What the module raises half-way through its forward."""


class RaisesMidway(nn.Module):
    """Linear -> BatchNorm -> (raise on a bad step) -> Linear; ``tail`` unused on odd steps,
    so ``find_unused_parameters=True`` has something to find."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.body = nn.Linear(8, 8)
        self.tail = nn.Linear(8, 2)
        self.bad = False
        self.raised: BaseException | None = None
        self.use_tail = True

    def forward(self, x):
        h = self.norm(self.head(x)).relu()
        if self.bad:
            self.raised = BadBatch("bad batch: NaN in the inputs")
            raise self.raised
        h = self.body(h)
        return self.tail(h) if self.use_tail else h[:, :2]


def _penalty(module: nn.Module) -> torch.Tensor:
    return 1e-2 * sum(p.square().sum() for p in module.parameters())


def _describe(err: BaseException, raised: BaseException | None) -> dict:
    last = traceback.extract_tb(err.__traceback__)[-1]
    return {"type": type(err).__name__, "message": str(err), "same_object": err is raised,
            "innermost": (last.name, last.line), "context": repr(err.__context__),
            "cause": repr(err.__cause__)}


def _job(ctx, find_unused: bool, bad_step: int, set_to_none: bool) -> dict:
    torch.manual_seed(100 + ctx.rank)  # different on each rank: the start-up broadcast counts
    base = RaisesMidway()
    modules = {"ddp": copy.deepcopy(base), "ours": copy.deepcopy(base)}
    # A tiny bucket cap: several buckets, so the one-time rebuild in gradient order matters.
    engines = {"ddp": DDP(modules["ddp"], find_unused_parameters=find_unused, bucket_cap_mb=1e-4),
               "ours": DataParallelModel(modules["ours"], find_unused_parameters=find_unused,
                                         bucket_cap_mb=1e-4)}
    opts = {k: torch.optim.SGD(e.parameters(), lr=0.1, momentum=0.9) for k, e in engines.items()}
    bad, errors, failures = [], {}, {}
    for step in range(5):
        g = torch.Generator().manual_seed(ctx.rank * 100 + step)
        first, second = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
        for name, engine in engines.items():
            module = modules[name]
            module.use_tail = step % 2 == 0 or not find_unused
            opts[name].zero_grad(set_to_none=set_to_none)
            with engine.no_sync():  # two micro-batches a step: the first accumulates locally
                engine(first).square().mean().backward()
            module.bad = step == bad_step
            try:
                loss = engine(second).square().mean()
            except BadBatch as err:
                errors[name] = _describe(err, module.raised)
                loss = _penalty(module)  # the bad micro-batch is dropped: the penalty only
            module.bad = False
            try:
                loss.backward()
            except RuntimeError as err:  # torch's check on the used map (see the docstring)
                failures[name] = (step, isinstance(err, RuntimeError), str(err))
        if failures:
            break
        bad += compare(f"step {step}", modules["ddp"], modules["ours"], "grad")
        for opt in opts.values():
            opt.step()
        bad += compare(f"step {step}", modules["ddp"], modules["ours"], "state")
    return {"bad": bad, "errors": errors, "failures": failures,
            "forward_running": engines["ours"].reducer.step.forward_running}


@pytest.mark.parametrize("when", list(BAD_STEP))
@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["to_none", "to_zero"])
def test_a_forward_that_raises_leaves_the_run_bitwise_equal_to_torch_ddp(when, find_unused,
                                                                         set_to_none):
    bad_step = BAD_STEP[when]
    for result in run_ranks(_job, 2, args=(find_unused, bad_step, set_to_none), timeout_s=120):
        assert result["bad"] == []
        assert not result["forward_running"]
        ours, theirs = result["errors"]["ours"], result["errors"]["ddp"]
        assert ours == theirs  # type, message, innermost frame, nothing chained
        assert ours["same_object"] and ours["type"] == "BadBatch"
        assert ours["innermost"] == ("forward", "raise self.raised")
        assert ours["context"] == "None" and ours["cause"] == "None"
        failures = result["failures"]
        if find_unused and set_to_none:
            # The next step leaves ``tail`` unused, its .grad None, while the used map still
            # counts the penalty's use: torch's reducer refuses, and so do we, in its words.
            (step, runtime_error, message), (our_step, our_runtime_error, ours) = (
                failures["ddp"], failures["ours"])
            assert step == our_step == bad_step + 1 and runtime_error and our_runtime_error
            assert message == UNDEFINED_BUT_USED and ours.startswith(message)
            assert "parameter 'tail.weight'" in ours
        else:
            assert failures == {}

"""docs/errors.md: every entry's error is triggered here, with the type and text the page gives.

The page lists entries as ``### title`` with ``**Raised:** `Type``` and
``**Message contains:** `text```. Each title has a trigger below (and each trigger a title), so
an entry cannot be added, removed or reworded without this test noticing. Construction and
single-process errors run in this process on a one-rank Gloo group (a FileStore in a temporary
file), or with no group at all for helpers that need none; those that need a peer run on two
ranks (a fault injected where the error answers a failure of the operating system or a peer).
"""

from __future__ import annotations

import argparse
import errno
import os
import pickle
import signal
import time
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from docs_snippets import error_entries
from helpers import classic_bugs
from helpers.ranks import RanksFailed, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

import mini_ddp
from mini_ddp import (
    DataParallelModel,
    DesyncDetector,
    SharedMemoryAllreduce,
    StallWatchdog,
    check_in_sync,
    gloo_safe,
)
from mini_ddp.engine.multi_device import MultiDeviceDataParallel
from mini_ddp.errors import TORCH_MISMATCH, naming_collective
from mini_ddp.ladder.naive import NaiveDataParallel
from mini_ddp.tools import bench_models, parity
from mini_ddp.tools.parity_options import ParityOptions
from mini_ddp.training import data, launch, models
from mini_ddp.transport import local_comm
from mini_ddp.transport import shm as shm_module
from mini_ddp.transport.collectives import naive
from mini_ddp.watch.flight_log import flight_recorder


def _entries() -> dict[str, tuple[str, str]]:
    return {title: (kind, text) for title, kind, text in error_entries()}


# ---- triggers: each returns the exception it provoked ---------------------------------------
def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is what we are after
        return err
    raise AssertionError("no error was raised")


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.forgotten = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.used(x)


class _TwiceCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.between = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        x = checkpoint(self.layer, x, use_reentrant=True)
        return checkpoint(self.layer, self.between(x), use_reentrant=True)


def _unused():
    model = DataParallelModel(_Unused())
    model(torch.randn(1, 2)).sum().backward()
    model(torch.randn(1, 2))


def _marked_twice():
    # The wrapper must stay referenced through backward: a dropped one is freed at once and
    # its hooks do nothing, as torch DDP's.
    model = DataParallelModel(_TwiceCheckpointed())
    model(torch.randn(1, 2, requires_grad=True)).sum().backward()


def _grad_changed_late():
    # A hook on an activation, set after the two backwards read at the hooks (the third reads
    # late, one hook per gradient), that changes a gradient its bucket has not read yet: no
    # hook table lists it.
    class Meddling(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)
            self.meddle = False

        def forward(self, x):
            hidden = self.first(x)
            if self.meddle:  # its gradient comes after second's, before first's
                hidden.register_hook(self.halve_second)
            return self.second(hidden)

        def halve_second(self, _grad):
            self.second.weight.grad.mul_(0.5)

    model = DataParallelModel(Meddling())
    x = torch.randn(3, 2)
    for _ in range(2):
        model(x).sum().backward()
    model.module.meddle = True
    model(x).sum().backward()


def _backward_twice():
    model = DataParallelModel(nn.Linear(2, 2))
    loss = model(torch.randn(1, 2)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x, both=True):
        return self.second(self.first(x)) if both else self.first(x)


def _undefined_but_used():
    model = DataParallelModel(_TwoLayers(), find_unused_parameters=True)
    with model.no_sync():  # uses `second`, synchronises nothing
        model(torch.randn(1, 2)).sum().backward()
    model.zero_grad(set_to_none=True)
    model(torch.randn(1, 2), both=False).sum().backward()


def _second_hook():
    model = DataParallelModel(nn.Linear(2, 2))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model.register_comm_hook(None, default_hooks.allreduce_hook)


def _list_future_hook():
    model = DataParallelModel(nn.Linear(2, 2))
    model.register_comm_hook(
        None, lambda state, bucket: dist.all_reduce(bucket.buffer(), async_op=True).get_future())
    model(torch.randn(1, 2)).sum().backward()


def _meta_and_cpu() -> nn.Module:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    return module


def _mesh_and_group():
    from torch.distributed.device_mesh import init_device_mesh
    DataParallelModel(nn.Linear(2, 2), process_group=dist.group.WORLD,
                      device_mesh=init_device_mesh("cpu", (1,)))


def _two_d_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    DataParallelModel(nn.Linear(2, 2), device_mesh=init_device_mesh("cpu", (1, 1)))


def _static_graph_late():
    model = DataParallelModel(nn.Linear(2, 2))
    model(torch.randn(1, 2)).sum().backward()
    model._set_static_graph()


def _optimizer_in_backward():
    from torch.distributed.optim import _apply_optimizer_in_backward
    inner = nn.Linear(2, 2)
    _apply_optimizer_in_backward(torch.optim.SGD, inner.parameters(), {"lr": 0.1})
    DataParallelModel(inner)(torch.randn(1, 2))


def _pickle_on_subgroup():
    model = DataParallelModel(nn.Linear(2, 2), process_group=dist.new_group([0]))
    pickle.dumps(model)


class _StepInForward(nn.Module):
    """forward() runs backward itself, and nothing arms the reducer for it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 2)

    def forward(self, x):
        self.net(x).sum().backward()
        return x


class _SometimesBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.branch = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x, branch):
        return self.branch(self.trunk(x)) if branch else self.trunk(x)


def _graph_changed():
    model = DataParallelModel(_SometimesBranch(), static_graph=True)
    model(torch.randn(1, 2), False).sum().backward()
    model(torch.randn(1, 2), True).sum().backward()


class _SparseSkipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(5, 2, sparse=True), nn.Linear(2, 2)

    def forward(self, x):
        return self.head(x)


class _SparseUsedDensely(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 2, sparse=True)

    def forward(self, x):
        return x @ self.embed.weight.T


def _sparse_unused():
    model = DataParallelModel(_SparseSkipped(), find_unused_parameters=True)
    model(torch.randn(1, 2)).sum().backward()


def _sparse_dense_grad():
    model = DataParallelModel(_SparseUsedDensely())
    model(torch.randn(1, 2)).sum().backward()


def _sparse_hook_dense():
    model = DataParallelModel(nn.Embedding(5, 2, sparse=True))
    model.register_comm_hook(None, lambda state, bucket: _done(bucket.buffer().to_dense()))
    model(torch.tensor([1, 2])).sum().backward()


def _done(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _compiled_autograd():
    import torch._dynamo

    model = DataParallelModel(nn.Linear(2, 2))
    with torch._dynamo.config.patch(compiled_autograd=True):
        model(torch.randn(1, 2))


def _failing_rank(ctx):
    raise ValueError("this rank fails on purpose")


def _hook(fn):
    model = DataParallelModel(nn.Linear(2, 2))
    model.register_comm_hook(None, fn)
    model(torch.randn(1, 2)).sum().backward()


def _bad_bucket_annotation(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return _done(bucket.buffer())


def _bad_return_annotation(state, bucket) -> int:
    return _done(bucket.buffer())


def _second_builtin_hook():
    model = DataParallelModel(nn.Linear(2, 2))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)


def _gloo_safe_timeout():
    _hook(gloo_safe(lambda state, bucket: torch.futures.Future(), timeout_s=0.2))


def _ladder_unused():
    model = NaiveDataParallel(_Unused())
    model(torch.randn(1, 2)).sum().backward()
    model.sync_grads()


def _no_flight_recorder():
    flight_recorder(DataParallelModel(nn.Linear(2, 2), stall_warning_s=None))


def _world_size_contradicts():
    with mock.patch.dict(os.environ, {"RANK": "0", "WORLD_SIZE": "1"}):
        launch.launch(lambda args, info: None, argparse.Namespace(world_size=3))


IN_PROCESS: dict[str, Callable[[], object]] = {
    "Nothing to train": lambda: DataParallelModel(nn.Linear(2, 2).requires_grad_(False)),
    "`attach` on a model that is not torch's DDP": lambda: mini_ddp.attach(nn.Linear(2, 2)),
    "Lazy module not materialised": lambda: DataParallelModel(nn.LazyLinear(2)),
    "`device_ids` on a CPU model": lambda: DataParallelModel(nn.Linear(2, 2), device_ids=[0]),
    "A parameter got no gradient": _unused,
    "A gradient arrived twice in one backward": _marked_twice,
    "A gradient changed after its hook, before its bucket read it": _grad_changed_late,
    "Backward twice on one forward": _backward_twice,
    "Second hook": _second_hook,
    "Hook's future holds a list": _list_future_hook,
    "Several `device_ids`": lambda: DataParallelModel(nn.Linear(2, 2), device_ids=[0, 1]),
    "Parameters on the meta device": lambda: DataParallelModel(nn.Linear(2, 2, device="meta")),
    "Parameters on different device types": lambda: DataParallelModel(_meta_and_cpu()),
    "`SyncBatchNorm` on CPU": lambda: DataParallelModel(nn.SyncBatchNorm(2)),
    "Only one of the delayed-all-reduce keywords":
        lambda: DataParallelModel(nn.Linear(2, 2), delay_all_reduce_named_params=[]),
    "Both `process_group` and `device_mesh`": _mesh_and_group,
    "A device mesh of more than one dimension": _two_d_mesh,
    "`_set_static_graph()` after training started": _static_graph_late,
    "Optimizers applied in backward": _optimizer_in_backward,
    "A torch-internal member of `DistributedDataParallel`":
        lambda: DataParallelModel(nn.Linear(2, 2))._register_fused_optim([], None),
    "A torch-internal member of the reducer":
        lambda: DataParallelModel(nn.Linear(2, 2)).reducer._set_optimizer_in_backward(),
    "Pickling a model on a subgroup": _pickle_on_subgroup,
    "Logging sample rate below 1":
        lambda: DataParallelModel(nn.Linear(2, 2))._set_ddp_runtime_logging_sample_rate(0),
    "`MultiDeviceDataParallel` without `device_ids`, or with an unusable batch":
        lambda: MultiDeviceDataParallel(nn.Linear(2, 2), device_ids=None),
    "`MultiDeviceDataParallel`: a CUDA device twice":  # device objects only: no GPU needed
        lambda: MultiDeviceDataParallel(nn.Linear(2, 2), device_ids=["cuda:0", "cuda:0"]),
    "`MultiDeviceDataParallel`: module not on `device_ids[0]`":
        lambda: MultiDeviceDataParallel(nn.Linear(2, 2, device="meta"), device_ids=["cpu"]),
    "A backward inside a forward that nothing armed":
        lambda: DataParallelModel(_StepInForward())(torch.randn(1, 2)),
    "The graph changed under `static_graph=True`": _graph_changed,
    "A parameter without a gradient that the used map counts as used": _undefined_but_used,
    "A rung of the teaching ladder: a parameter got no gradient": _ladder_unused,
    "A sparse parameter got no gradient": _sparse_unused,
    "A sparse parameter got a dense gradient": _sparse_dense_grad,
    "Compiled autograd without the python reducer": _compiled_autograd,
    "Second built-in hook": _second_builtin_hook,
    "Hook not callable": lambda: DataParallelModel(nn.Linear(2, 2)).register_comm_hook(None, 3),
    "Hook with the wrong number of arguments": lambda: _hook(lambda bucket: None),
    "Hook's bucket annotation": lambda: _hook(_bad_bucket_annotation),
    "Hook's return annotation": lambda: _hook(_bad_return_annotation),
    "Unknown built-in hook":
        lambda: DataParallelModel(nn.Linear(2, 2))._register_builtin_comm_hook("ALLREDUCE"),
    "Hook returned something other than a Future":
        lambda: _hook(lambda state, bucket: bucket.buffer()),
    "Hook's tensor has the wrong shape":
        lambda: _hook(lambda state, bucket: _done(torch.zeros(1))),
    "A sparse bucket's hook returned a dense tensor": _sparse_hook_dense,
    "`gloo_safe` hook timed out": _gloo_safe_timeout,
    "`StallWatchdog` action":
        lambda: StallWatchdog(DataParallelModel(nn.Linear(2, 2)), action="shout"),
    "`DesyncDetector` interval": lambda: DesyncDetector(DataParallelModel(nn.Linear(2, 2)), 0),
    "No flight recorder": _no_flight_recorder,
}

# Errors of helpers that need no process group.
def _detail_verdict() -> None:
    """torch's DETAIL verdict, as its ProcessGroupWrapper words it, inside one of mini_ddp's
    collectives (tests/test_debugging.py provokes the real one)."""
    with naming_collective(1, "the broadcast of rank 0's 3 buffers before forward"):
        raise RuntimeError(f"{TORCH_MISMATCH} Rank 1 is running collective: "
                           "CollectiveFingerPrint(SequenceNumber=13, OpType=BROADCAST, "
                           "TensorShape=[32], TensorDtypes=Float), but Rank 0 is running "
                           "collective: CollectiveFingerPrint(SequenceNumber=0OpType=GATHER).")


def _backend_timeout() -> None:
    """Gloo's own timeout inside one of mini_ddp's collectives (tests/test_debugging.py and
    docs/debugging.md's uneven-inputs row show it in a real run)."""
    with naming_collective(0, "the broadcast of rank 0's 3 buffers before forward"):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
                           "15000ms for send operation to complete")


NO_GROUP: dict[str, Callable[[], object]] = {
    "torch's DETAIL check found different collectives": _detail_verdict,
    "A collective timed out, with every connection open": _backend_timeout,
    "`run_ranks`: a rank failed": lambda: run_ranks(_failing_rank, 1, timeout_s=60),
    "`mini_ddp.transport.local_comm` arguments": lambda: local_comm.gather([], "cpu"),
    "Sparse tensors to `local_comm` on CPU": lambda: local_comm.broadcast_coalesced(
        [torch.eye(2).to_sparse()], ["cpu", "cpu"]),
    "Unknown model name": lambda: models.resolve_model("no-such-model"),
    "`--local-rank` without a launcher": lambda: launch.detect_launcher({}, 0),
    "`--world-size` against the launcher's": _world_size_contradicts,
    "Dataset files missing": lambda: data.load_cifar10(os.devnull + "-nowhere"),
    "`mini_ddp parity`: unknown reference":
        lambda: parity.run_parity(ParityOptions(reference="nearby")),
    "`mini_ddp bench`: unknown engine":
        lambda: bench_models.build_engine("warp-drive", nn.Linear(2, 2), None, False),
    "Hand-written collectives: unsupported reduce op":
        lambda: naive.flat_view(torch.zeros(2), dist.ReduceOp.BAND),
    "Hand-written collectives: non-contiguous tensor":
        lambda: naive.flat_view(torch.zeros(2, 3).t()),
    "Hand-written collectives: AVG of integers":
        lambda: naive.flat_view(torch.zeros(2, dtype=torch.int64), dist.ReduceOp.AVG),
}


def _mismatch(ctx) -> str:
    try:
        DataParallelModel(nn.Linear(2, 2 + ctx.rank))
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}|{err}"
    return "no error"


def _late_peer(ctx, watchdog: bool) -> str:
    """Rank 1 is late; rank 0 gives up first: at its sync_timeout_s (GradSyncTimeout), or at
    its StallWatchdog's limit (StallError). Rank 1 may then see a failed collective."""
    model = DataParallelModel(nn.Linear(2, 2), sync_timeout_s=6.0 if watchdog else 2.0)
    if ctx.rank == 1:
        time.sleep(3 if watchdog else 4)
        try:
            model(torch.randn(1, 2)).sum().backward()
        except RuntimeError:
            pass
        return "late"
    if watchdog:
        StallWatchdog(model, limit_s=1.0).install()
    err = _raised(lambda: model(torch.randn(1, 2)).sum().backward())
    return f"{type(err).__name__}|{err}"


def _timeout_rank(ctx) -> str:
    return _late_peer(ctx, watchdog=False)


def _stall(ctx) -> str:
    return _late_peer(ctx, watchdog=True)


def _finished_peer(ctx) -> str:
    model = DataParallelModel(nn.Linear(2, 2))
    if ctx.rank == 1:  # finishes: it leaves its mark, then its connections close
        dist.destroy_process_group()
        return "left"
    time.sleep(1)
    err = _raised(lambda: model(torch.randn(1, 2)).sum().backward())
    return f"{type(err).__name__}|{err}"


def _dead_peer(ctx) -> str:
    model = DataParallelModel(nn.Linear(2, 2))
    if ctx.rank == 1:  # dies: no mark, its connections close
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    err = _raised(lambda: model(torch.randn(1, 2)).sum().backward())
    raise RuntimeError(f"{KILLED_MARK}{type(err).__name__}|{err}")  # run_ranks keeps no result


def _desync(ctx) -> str:
    model = DataParallelModel(nn.Linear(2, 2))
    if ctx.rank == 1:
        with torch.no_grad():
            model.module.weight[0, 0] += 1  # a rank-local edit
    err = _raised(lambda: check_in_sync(model))
    return f"{type(err).__name__}|{err}"


def _classic(ctx, bug: str, kind: str) -> str:
    """A classic mistake of tests/helpers/classic_bugs.py under the debug switch: the error of
    type ``kind`` (a rank told something else, e.g. Gloo's words when its peer left: "late")."""
    error = classic_bugs.run_bug(ctx, bug, "mini", True)["error"] or ""
    name, _, message = error.partition(": ")
    return f"{name}|{message}" if name == kind else "late"


def _shm(ctx, what: str) -> str:
    shm = SharedMemoryAllreduce.create()
    if what == "desync":
        err = _raised(lambda: shm.allocate(10 + ctx.rank, torch.float32))
    elif what == "closed":
        shm.close()
        err = _raised(lambda: shm.allocate(10, torch.float32))
    elif what == "numel":
        err = _raised(lambda: shm.allocate(-1, torch.float32))
    elif what == "dtype":
        buffer = shm.allocate(4, torch.int32)
        err = _raised(lambda: shm.all_reduce(buffer))
    elif what == "foreign":
        err = _raised(lambda: shm.all_reduce(torch.zeros(4)))
    elif what == "worker thread":  # a callback of the transport's future runs on its thread
        buffer = shm.allocate(4, torch.float32)
        real_sum = shm_module.sum_chunk

        def slow_sum(*args: object) -> None:  # the callback is attached before the sum is done
            time.sleep(0.3)
            real_sum(*args)

        with mock.patch("mini_ddp.transport.shm.sum_chunk", side_effect=slow_sum):
            fut = shm.all_reduce(buffer).then(lambda _: shm.allocate(4, torch.float32))
            err = _raised(fut.wait)
    elif what == "peer failed":
        buffer = shm.allocate(4, torch.float32)
        if ctx.rank == 1:  # this rank's chunk of the sum fails; rank 0 reports its peer
            with mock.patch("mini_ddp.transport.shm.sum_chunk", side_effect=RuntimeError("boom")):
                _raised(shm.all_reduce(buffer).wait)
            shm.close()
            return "late"
        err = _raised(shm.all_reduce(buffer).wait)
    else:  # the memory file cannot be reserved (exhausted memory): both ranks raise
        no_memory = OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        with mock.patch("os.posix_fallocate", side_effect=no_memory):
            err = _raised(lambda: shm.allocate(10, torch.float64))
    shm.close()
    return f"{type(err).__name__}|{err}"


TWO_RANKS: dict[str, Callable] = {
    "Ranks built different models": _mismatch,
    "A peer stopped answering": _timeout_rank,
    "A peer died": _dead_peer,
    "A peer finished early": _finished_peer,
    "A stall, seen by the watchdog": _stall,
    "Replicas out of sync": _desync,
}
# Two-rank entries of the debug checks: the classic mistake that raises each.
CLASSIC: dict[str, str] = {
    "The ranks are about to run different collectives": "eval_forward",
    "A peer did not reach a collective (debug switch)": "bypass",  # rank 0: "rank 1 reported"
    "The replica check found different models": "param_added",
    "A training forward bypassed the wrapper": "bypass",
}
# Two-rank entries of the shared-memory transport: the scenario of _shm that raises each.
SHM: dict[str, str] = {
    "Ranks out of step on the shared-memory transport": "desync",
    "Shared-memory transport used after close": "closed",
    "A shared buffer could not be created or mapped": "huge",
    "A peer failed its chunk of a shared-memory sum": "peer failed",
    "Shared-memory transport arguments": "numel",
    "Shared-memory sum of an unsupported dtype": "dtype",
    "Not a buffer of the shared-memory transport": "foreign",
    "Shared-memory allocate from the transport's own thread": "worker thread",
}
NOT_INITIALISED = "Process group not initialised"
KILLED_MARK = "survivor saw: "  # where _dead_peer's survivor puts what it caught


def test_every_entry_has_a_trigger():
    triggers = [*IN_PROCESS, *NO_GROUP, *TWO_RANKS, *SHM, *CLASSIC, NOT_INITIALISED]
    assert len(triggers) == len(set(triggers))
    assert set(_entries()) == set(triggers)


def test_not_initialised_entry():
    assert not dist.is_initialized()
    kind, text = _entries()[NOT_INITIALISED]
    err = _raised(lambda: DataParallelModel(nn.Linear(2, 2)))
    assert type(err).__name__ == kind and text in str(err)


@pytest.mark.parametrize("title", sorted(IN_PROCESS))
def test_in_process_entry(title, one_rank_group):
    kind, text = _entries()[title]
    err = _raised(IN_PROCESS[title])
    assert type(err).__name__ == kind, f"{title}: {type(err).__name__}: {err}"
    assert text in str(err), f"{title}: {err}"


@pytest.mark.parametrize("title", sorted(NO_GROUP))
def test_no_group_entry(title):
    kind, text = _entries()[title]
    err = _raised(NO_GROUP[title])
    assert type(err).__name__ == kind, f"{title}: {type(err).__name__}: {err}"
    assert text in str(err), f"{title}: {err}"


@pytest.mark.parametrize("title", sorted([*TWO_RANKS, *SHM, *CLASSIC]))
def test_two_rank_entry(title, tmp_path):
    kind, text = _entries()[title]
    fn, args = (_shm, (SHM[title],)) if title in SHM else \
        (_classic, (CLASSIC[title], kind)) if title in CLASSIC else (TWO_RANKS[title], ())
    env = {"MINI_DDP_FLIGHT_DIR": str(tmp_path)}  # dumps of asked ranks
    if fn is _dead_peer:
        with pytest.raises(RanksFailed) as failed:
            run_ranks(fn, 2, args=args, timeout_s=60, env=env)
        results = [failed.value.failures[0].rsplit(KILLED_MARK, 1)[-1]]
    else:
        results = run_ranks(fn, 2, args=args, timeout_s=60, env=env)
    if title in CLASSIC:
        assert set(results) != {"late"}, f"{title}: no rank raised {kind}"
    for result in results:
        if result in ("late", "left"):
            continue
        got_kind, _, message = result.partition("|")
        assert got_kind == kind, result
        assert text in message, result

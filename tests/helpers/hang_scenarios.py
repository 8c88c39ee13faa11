"""One 3-rank job that hangs in every way the stall report must locate, then loses a rank.

Shared by tests/test_stall_stacks.py, tests/test_flight_recorder.py and tests/test_doctor.py
(:func:`run_hangs` runs the job once per test run, parallel workers included). After two
warm-up steps, each scenario is one training step in which one rank is stuck somewhere for
``STUCK_S`` seconds while the others wait at the end of backward (``stall_warning_s=WARN_S``):
in a data loader, in a gradient hook, in a communication hook, in a rank-0-only barrier, in
native code holding the GIL. Each scenario dumps its flight recorder files into its own
directory. Last, rank 1 SIGKILLs itself before a forward: the survivors' collective fails. In
between, a ``sync_timeout_s`` shorter than the warning ends a wait with ``GradSyncTimeout``,
whose message says where the late rank is.

Every rank writes what it saw (the warnings and when they came, the errors) to
``results_rank<R>.json``: the job ends with rank 1 dead, so ``run_ranks`` raises.
"""

from __future__ import annotations

import ctypes
import datetime
import fcntl
import functools
import gc
import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mini_ddp import DataParallelModel, MiniDDPError
from mini_ddp.watch.flight_log import flight_recorder
from mini_ddp.watch.stacks import TIMEOUT_ANSWER_S, ask_stacks
from mini_ddp.watch.stall import ARRIVAL_GRACE_S

# The clocks of the job, scaled by the session's slowdown (tests/helpers/deadlines.py) and
# written for a quiet machine: a busy one gets proportionally more room, never less. Each is
# either a limit whose passing the tests check for (WARN_S, ANSWER_S, TIMEOUT_S: rounded, so that
# the messages quote them as written) or how long a rank stays stuck past everything the
# others do meanwhile (STUCK_S, GIL_S, LATE_S), so that what they record happens while it is.
# A waiting rank gives its peers ARRIVAL_GRACE_S (fixed in mini_ddp) to leave their marks after
# its warning or timeout, before it asks the late ones where they are.
WARN_S = round(hang_bound(2.0), 1)  # stall_warning_s: the warning that the tests read
ANSWER_S = round(hang_bound(2.0), 1)  # the waiters' patience for a stack (default 5 s)
# Stuck until well after the warning, the grace and an answer: its stack is the stuck place.
STUCK_S = WARN_S + ARRIVAL_GRACE_S + hang_bound(3.0)
# Holding the GIL until well after the waiters gave up on its answer.
GIL_S = math.ceil(WARN_S + ARRIVAL_GRACE_S + ANSWER_S + hang_bound(3.0))
TIMEOUT_S = round(hang_bound(2.5), 1)  # sync_timeout_s: the GradSyncTimeout the tests read
TIMEOUT_ANSWER_S = hang_bound(TIMEOUT_ANSWER_S)  # the timeout's patience for a stack
# Rank 1's lateness in the timeout case: past the others' timeout, grace and ask.
LATE_S = TIMEOUT_S + ARRIVAL_GRACE_S + TIMEOUT_ANSWER_S + hang_bound(1.0)
# scenario -> (stuck rank, where)
SCENARIOS = {"loader": 1, "grad_hook": 2, "comm_hook": 1, "barrier": 0, "gil": 1}
FUNCTIONS = {"loader": "slow_loader", "grad_hook": "slow_grad_hook",
             "comm_hook": "slow_comm_hook", "barrier": "rank0_only_checkpoint",
             "gil": "hold_gil"}
LINES: dict[str, int] = {}  # function -> the line it is stuck on (filled below)
_STUCK = {"where": None}


def slow_loader(x: torch.Tensor) -> torch.Tensor:
    time.sleep(STUCK_S)  # a data loader that takes far too long
    return x


def slow_grad_hook(grad: torch.Tensor) -> torch.Tensor:
    if _STUCK["where"] == "grad_hook":
        time.sleep(STUCK_S)  # a gradient hook stuck inside backward
    return grad


def slow_comm_hook(state, bucket):  # unannotated: the hook check reads real annotations
    if _STUCK["where"] == "comm_hook":
        time.sleep(STUCK_S)  # a communication hook stuck before its all-reduce
    return default_hooks.allreduce_hook(state, bucket)


def rank0_only_checkpoint(side: dist.ProcessGroup) -> None:
    try:
        dist.barrier(group=side)  # only rank 0 enters: it waits for the others forever
    except RuntimeError:
        pass  # the side group's timeout (STUCK_S): the test goes on


def hold_gil() -> None:
    # ctypes.CDLL releases the GIL around a foreign call; PyDLL does not: libc sleep() now runs
    # holding it, so no other thread of this process (the stack responder) can run Python.
    ctypes.PyDLL(None).sleep(GIL_S)


def _line_of(function: str, marker: str) -> int:
    source = Path(__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith(f"def {function}("))
    return next(i for i in range(start, len(source)) if marker in source[i]) + 1


for _name, _marker in (("slow_loader", "time.sleep"), ("slow_grad_hook", "time.sleep"),
                       ("slow_comm_hook", "time.sleep"), ("rank0_only_checkpoint", "barrier("),
                       ("hold_gil", "sleep("), ("_job", "waits for the others' timeout")):
    LINES[_name] = _line_of(_name, _marker)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + hang_bound(10)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _responders() -> int:
    return sum(t.name.startswith("mini_ddp-stack-responder") for t in threading.enumerate())


def _job(ctx, outdir: str) -> None:
    out = Path(outdir)
    seen: dict = {"rank": ctx.rank}
    records: list[tuple[float, str]] = []
    t0 = [time.monotonic()]
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append((time.monotonic() - t0[0], r.getMessage()))
    logging.getLogger("mini_ddp").addHandler(handler)

    # The default path: a model with default settings runs a responder that answers.
    model = DataParallelModel(_net())
    seen["default_responder_alive"] = model.stall_monitor._responder.thread.is_alive()
    peer = (ctx.rank + 1) % ctx.world_size
    answer = ask_stacks(model.stall_monitor.store, [peer], 10.0, asked_by=ctx.rank)[peer]
    seen["default_answer"] = answer
    dist.barrier()
    # Teardown: wrapping and deleting a model leaves no responder behind.
    base = _responders()
    for _ in range(20):
        DataParallelModel(_net())
    gc.collect()
    # A dropped model's responder ends on its own time (later on a busy machine): a bound on
    # that wait, not a limit on how long it may take; a leaked thread still fails the test.
    deadline = time.monotonic() + hang_bound(60)
    while _responders() > base and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["responders_before_after"] = [base, _responders()]
    del model
    gc.collect()

    side = dist.new_group(timeout=datetime.timedelta(seconds=STUCK_S))
    model = DataParallelModel(_net(), stall_warning_s=WARN_S)
    model.stall_monitor.answer_s = ANSWER_S
    model.register_comm_hook(None, slow_comm_hook)
    model.module[0].weight.register_hook(slow_grad_hook)
    x = torch.randn(4, 4) * (ctx.rank + 1)
    for _ in range(2):  # step 1, and the bucket rebuild in step 2
        model(x).sum().backward()
    seen["scenarios"] = {}
    for name, stuck in SCENARIOS.items():
        flight_recorder(model, dump_dir=out / name)
        records.clear()
        dist.barrier()
        t0[0] = time.monotonic()
        batch = x
        if ctx.rank == stuck:
            if name == "loader":
                batch = slow_loader(x)
            elif name == "barrier":
                rank0_only_checkpoint(side)
            elif name == "gil":
                hold_gil()
            _STUCK["where"] = name
        loss = model(batch).sum()
        loss.backward()
        _STUCK["where"] = None
        model.stall_monitor.settle(hang_bound(30))  # the report runs beside the wait
        seen["scenarios"][name] = {"warnings": records[:], "step": model.reducer.step.num_iterations}
        if ctx.rank == stuck:  # its dump as it answered (late in the GIL case) lands here
            _wait_for(out / name / f"rank{stuck}.json")
        time.sleep(0.5)  # the second asker's answer too (the dump is rewritten)
    # GradSyncTimeout: a deadline shorter than the warning; rank 1 arrives after it, and after
    # the others have asked it where it is (their grace for its mark, then the ask).
    model = DataParallelModel(_net(), sync_timeout_s=TIMEOUT_S)
    model.stall_monitor.timeout_answer_s = TIMEOUT_ANSWER_S
    flight_recorder(model, dump_dir=out / "timeout")
    for _ in range(2):
        model(x).sum().backward()
    dist.barrier()
    try:
        loss = model(x).sum()
        if ctx.rank == 1:
            time.sleep(LATE_S)  # waits for the others' timeout: stuck here
        loss.backward()
        seen["timeout"] = None
    except MiniDDPError as error:
        seen["timeout"] = f"{type(error).__name__}: {error}"
    dist.barrier()  # rank 1's late all-reduce has met the others' abandoned ones
    # A dead rank: rank 1 is killed before its forward; the others' all-reduce fails.
    model = DataParallelModel(_net(), stall_warning_s=WARN_S)
    flight_recorder(model, dump_dir=out / "dead")
    for _ in range(2):  # past the bucket rebuild: the failure is a bucket's all-reduce
        model(x).sum().backward()
    dist.barrier()
    (out / f"results_rank{ctx.rank}.json").write_text(json.dumps(seen))
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        model(x).sum().backward()
        seen["dead"] = None
    except MiniDDPError as error:
        seen["dead"] = f"{type(error).__name__}: {error}"
    (out / f"results_rank{ctx.rank}.json").write_text(json.dumps(seen))


@functools.lru_cache(maxsize=1)
def _run(outdir: str) -> tuple[dict[int, dict], str]:
    # Parallel test workers share the folder (tests/conftest.py names it before they start):
    # the first to get here runs the job under the lock, the others wait and read what it left,
    # so the minute of deliberate stalls is spent once per test run, not once per worker.
    folder = Path(outdir)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "harness_failure.txt"
        if not done.exists():
            try:
                run_ranks(_job, 3, args=(outdir,), timeout_s=150,
                          collective_timeout_s=hang_bound(60))
                failure = "no rank failed"
            except RanksFailed as error:
                failure = str(error)
            done.write_text(failure)
        failure = done.read_text()
    results = {r: json.loads((folder / f"results_rank{r}.json").read_text()) for r in range(3)}
    return results, failure


def run_hangs(outdir: str | None = None) -> tuple[Path, dict[int, dict], str]:
    """Run the job once per test run (into ``$MINI_DDP_HANGS_DIR`` or a temporary folder);
    returns the folder, each rank's results and the harness's failure text."""
    folder = outdir or os.environ.get("MINI_DDP_HANGS_DIR")
    if folder is None:
        import tempfile
        folder = tempfile.mkdtemp(prefix="mini_ddp_hangs_")
        os.environ["MINI_DDP_HANGS_DIR"] = folder
    results, failure = _run(folder)
    return Path(folder), results, failure

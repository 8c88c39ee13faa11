"""Classic mistakes in a plain user script (tests/mistakes/train.py), not the project's harness.

Each case starts the script as a user would (``torch.multiprocessing.spawn``, every default of
DataParallelModel) and checks the run *ends* — within a bound many times what it needs, only so
that a hang fails instead of stalling the suite — with the right cause, and never with a death
that did not happen.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import preloaded
from helpers.deadlines import hang_bound
from helpers.shared_runs import shared_result

from mini_ddp.tools.doctor import diagnose

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "mistakes" / "train.py"
BOUND_S = 170  # the default stall warning is 60 s: a hang outlives this, an end does not
SHORT_STALL_S = "3"
"""The stall warning's limit where what is named does not depend on how long the wait is."""


def short_waits(mistake: str, debug: bool) -> dict[str, str]:
    """The environment that makes ``mistake``'s run name it in seconds, not minutes.

    The stall warning's limit (``STALL_S``; under the switch also the collective check's wait
    before it asks a late peer for its stack) where a peer is stuck or can never come: its
    stack says why, however long the wait was. An extra forward with grad deadlocks the ranks
    at defaults, and so do uneven inputs and a collective on one rank under ``attach`` (torch's
    broadcast cannot be interrupted): the stall report names it, and the process group's
    timeout (``TIMEOUT_S``, a hang bound: far past the report) then ends the run."""
    env = {}
    if mistake in ("stuck", "uneven", "one_rank_collective", "extra_forward"):
        env["STALL_S"] = SHORT_STALL_S
    if mistake in ("extra_forward", "uneven", "one_rank_collective") and not debug:
        env["TIMEOUT_S"] = f"{hang_bound(20):g}"
    return env


def run_script(mistake: str, engine: str = "mini", debug: bool = False,
               bound_s: float = BOUND_S, env: dict[str, str] | None = None,
               start_method: str = "fork") -> str:
    """The script's output (both ranks); fails when it does not end within ``bound_s`` (a
    hang bound, scaled by the machine's slowdown). The ranks are forked from the script's
    process (``start_method``: the script's ``START_METHOD``), itself started from a server
    that has imported torch (tests/helpers/preloaded.py), so that no rank imports it; the
    script's default, ``mp.spawn``, is run by
    ``test_a_training_forward_that_bypasses_the_wrapper_is_named_at_defaults``."""
    bound_s = hang_bound(bound_s)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "START_METHOD": start_method, "GRACE_S": f"{hang_bound(10):g}", **(env or {})}
    env.pop("MINI_DDP_DEBUG", None)
    if debug:
        env["MINI_DDP_DEBUG"] = "1"
    try:
        if start_method == "fork":  # the ranks fork from a process that has imported torch
            done = preloaded.run_script([SCRIPT, mistake, engine], env=env, cwd=ROOT,
                                        timeout=bound_s)
        else:
            done = subprocess.run([sys.executable, str(SCRIPT), mistake, engine], env=env,
                                  capture_output=True, text=True, timeout=bound_s, cwd=ROOT)
    except subprocess.TimeoutExpired as hung:
        out = (hung.stdout or b"").decode() if isinstance(hung.stdout, bytes) else hung.stdout
        pytest.fail(f"{mistake} ({engine}, debug={debug}) did not end in {bound_s:g} s:\n{out}")
    return done.stdout + done.stderr


def shared_script_run(where: Any, mistake: str, engine: str = "mini", debug: bool = False
                      ) -> str:
    """``run_script`` with :func:`short_waits`, run once per test run for the tests of every
    module and worker that read it (``where``: a pytest request, or its ``shared_folder``)."""
    return shared_result(where, f"mistake-{mistake}-{engine}-{'debug' if debug else 'defaults'}",
                         lambda: run_script(mistake, engine, debug,
                                            env=short_waits(mistake, debug)))


def told(output: str, rank: int) -> str:
    """What ``rank`` printed as its outcome (its exception, or "done")."""
    lines = [line for line in output.splitlines() if line.startswith(f"[rank {rank}] ")
             and " WARNING " not in line]
    return "\n".join(lines)


@pytest.mark.parametrize("debug", [False, True], ids=["defaults", "debug"])
def test_a_rank_that_finished_early_ends_the_run_with_its_finish_mark(request, debug: bool
                                                                      ) -> None:
    out = shared_script_run(request, "finish_early", debug=debug)
    assert "done" in told(out, 1), out
    said = told(out, 0)
    assert "rank 1 finished (destroyed its process group) after step 3" in said, out
    assert "uneven inputs" in said, said
    first = said.split(". ")[0]
    assert "killed" not in first and "closed by peer" not in first.lower(), first
    assert "died" not in said, said


def _dump(reason: str, **extra) -> dict:
    entry = {"seq": 15, "launched_ns": 0, "state": "completed", "bucket": 0, "step": 4,
             "numel": 10}
    return {"world_size": 2, "host": "h", "pid": 1, "time": 1.0, "reason": reason,
            "entries": [entry], **extra}


def test_the_doctor_reads_a_request_for_a_stack_as_proof_the_asker_was_alive() -> None:
    dumps = {1: _dump("asked for its stack by rank 0 (mini_ddp's debug check: a collective did "
                      "not come)", asked_at=1.0)}
    text = "\n".join(diagnose(dumps))
    assert "rank 0 left no dump, but it was alive" in text, text
    assert "died" not in text, text


def test_the_doctor_shows_where_the_peers_of_a_debug_check_were() -> None:
    stack = {"answered": True, "time": 1.0, "stacks": [{"thread": "MainThread", "main": True,
             "where": "train.py:9 in main", "frames": [["train.py", 9, "main",
                                                         "dist.all_reduce(x)"]]}]}
    dumps = {0: _dump("mini_ddp's debug check: ranks [1] have not reached a collective",
                      peers={"1": stack}),
             1: _dump("asked for its stack by rank 0 (mini_ddp's debug check)", asked_at=1.0,
                      stacks=stack["stacks"])}
    text = "\n".join(diagnose(dumps))
    assert "rank 0 waited for rank 1 before its next collective" in text, text
    assert "dist.all_reduce(x)" in text, text
    assert "died" not in text, text


def test_a_training_forward_that_bypasses_the_wrapper_is_named_at_defaults() -> None:
    out = run_script("bypass", start_method="spawn")  # the script as a user runs it
    said = told(out, 0)
    assert "Ranks [1] never completed a synchronised step: their training forward bypasses" in said, out
    assert "uneven inputs" not in said and "died" not in said, said


def _killed_rank(ctx) -> str:
    import signal

    import torch
    from torch import nn

    from mini_ddp import DataParallelModel

    torch.manual_seed(0)
    model = DataParallelModel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), debug=True,
                              stall_warning_s=2)
    for step in range(1, 6):
        if ctx.rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # killed: no finish mark, no word
        model(torch.randn(3, 4)).sum().backward()
    return "done"


def test_the_debug_switch_steps_aside_for_a_rank_that_was_killed() -> None:
    from helpers.ranks import RanksFailed, run_ranks

    # The process group's own timeout (300 s) is far past the bound: only the switch stepping
    # aside, and the collective then failing at once, ends this run in time.
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_killed_rank, 2, timeout_s=150, collective_timeout_s=300)
    text = str(failed.value)
    assert "neither left a finish mark nor answered" not in text  # a WARNING, not the error
    rank0 = text.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]
    assert "CollectiveError" in rank0 and "most likely died" in rank0, rank0
    assert "still running" not in rank0, rank0

"""A rank that dies (SIGKILL) or hangs (SIGSTOP) turns into a clear mini_ddp error on every survivor.

Each case runs 3 ranks; rank 1 kills or stops itself at a chosen point of a tiny training loop.
The survivors catch the error, write what they caught and when to a JSON file, and re-raise it,
so the harness reports them as failed (a non-zero exit) with the mini_ddp error in their
traceback. The test then checks the message names the collective that was being waited for,
and that it came within a bounded time (generous bounds: the machine is noisy).

``python tests/test_rank_death.py`` prints the measured failure matrix (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.deadlines import hang_bound
from helpers.ranks import RanksFailed, run_ranks
from torch import nn

from mini_ddp import DataParallelModel, GradSyncTimeout, MiniDDPError
from mini_ddp.engine.observer import Observer

SYNC_TIMEOUT_S = 3.0  # DataParallelModel(sync_timeout_s=...) in the hang cases
GLOO_TIMEOUT_S = 60.0  # the process group's own timeout: must not be what fires

# name -> (how rank 1 fails, where, at which step, BatchNorm?, expected error class, words)
CASES = {
    "kill mid-forward": ("SIGKILL", "forward", 3, False, "CollectiveError",
                         "all-reduce of bucket"),
    "kill mid-backward, buckets in flight": ("SIGKILL", "launch", 3, False, "CollectiveError",
                                             "all-reduce of bucket"),
    "kill between steps (next: backward)": ("SIGKILL", "after_step", 3, False,
                                            "CollectiveError", "all-reduce of bucket"),
    "kill between steps (next: buffer broadcast)": ("SIGKILL", "after_step", 3, True,
                                                    "CollectiveError", "buffers before forward"),
    "kill after step 1 (next: bucket rebuild)": ("SIGKILL", "after_step", 0, False,
                                                 "CollectiveError", "rebuilt bucket layout"),
    "kill before DataParallelModel()": ("SIGKILL", "construct", 0, False, "CollectiveError",
                                        "start-up all-gather"),
    "hang mid-backward (SIGSTOP)": ("SIGSTOP", "launch", 3, False, "GradSyncTimeout",
                                    "all-reduce of bucket"),
    "hang between steps (next: buffer broadcast)": ("SIGSTOP", "after_step", 3, True,
                                                    "CollectiveError", "no answer within"),
}


class _Net(nn.Module):
    def __init__(self, batchnorm: bool):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        self.bn = nn.BatchNorm1d(64) if batchnorm else nn.Identity()
        self.on_forward = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        self.on_forward()
        return self.c(torch.relu(self.b(self.bn(h))))


class _LaunchTrap(Observer):
    """An observer that runs ``action`` when bucket 1 is about to launch (it is full; bucket
    0 is out)."""

    def __init__(self, action):
        self.action, self.armed = action, False

    def bucket_ready(self, reducer, bucket) -> None:
        if self.armed and bucket.index == 1:
            self.action()


def _die(how: str, outdir: str) -> None:
    Path(outdir, "failed_at.json").write_text(json.dumps(time.time()))
    os.kill(os.getpid(), signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)


def _train(ctx, name: str, outdir: str) -> None:
    how, where, at_step, batchnorm, _, _ = CASES[name]
    victim = ctx.rank == 1
    die = lambda: _die(how, outdir)  # noqa: E731
    torch.manual_seed(0)
    net = _Net(batchnorm)
    try:
        if victim and where == "construct":
            die()
        # A small cap gives several buckets after the rebuild, so some can be in flight.
        model = DataParallelModel(net, bucket_cap_mb=0.01, sync_timeout_s=SYNC_TIMEOUT_S)
        trap = _LaunchTrap(die)
        if victim and where == "launch":
            model.reducer.observers.add(trap)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(6):
            if victim and where == "forward" and step == at_step:
                net.on_forward = die
            trap.armed = step == at_step
            loss = model(torch.randn(8, 32)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if victim and where == "after_step" and step == at_step:
                die()
    except Exception as err:
        caught = time.time()
        report = {"type": type(err).__name__, "message": str(err), "caught_at": caught,
                  "buckets": len(model.reducer.layout.buckets) if "model" in locals() else 0}
        Path(outdir, f"rank{ctx.rank}.json").write_text(json.dumps(report))
        if how == "SIGSTOP":
            # Clean up the stopped peer now, so that this rank's exit (which destroys the
            # process group and joins Gloo's threads) does not wait for Gloo's own timeout.
            try:
                os.kill(int(Path(outdir, "victim.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass  # the other survivor was first
        raise
    return None


def _train_recording_pid(ctx, name: str, outdir: str) -> None:
    if ctx.rank == 1:
        Path(outdir, "victim.pid").write_text(str(os.getpid()))
    return _train(ctx, name, outdir)


def run_case(name: str, outdir: str) -> dict:
    """Run one case; return each rank's harness report and each survivor's caught error."""
    os.makedirs(outdir, exist_ok=True)
    started = time.monotonic()
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_train_recording_pid, 3, args=(name, outdir), timeout_s=90,
                  collective_timeout_s=hang_bound(GLOO_TIMEOUT_S))
    wall = time.monotonic() - started
    failed_at = json.loads(Path(outdir, "failed_at.json").read_text())
    survivors = {}
    for rank in (0, 2):
        report = json.loads(Path(outdir, f"rank{rank}.json").read_text())
        report["seconds_to_error"] = report.pop("caught_at") - failed_at
        survivors[rank] = report
    return {"failures": failed.value.failures, "survivors": survivors, "wall_s": wall}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_survivors_raise_a_clear_error_in_bounded_time(name: str, tmp_path: Path) -> None:
    how, _, _, _, error_type, words = CASES[name]
    result = run_case(name, str(tmp_path))
    failures = result["failures"]
    assert set(failures) == {0, 1, 2}, failures  # everybody exits with a failure
    if how == "SIGKILL":
        assert "exit code -9" in failures[1]
    for rank, report in result["survivors"].items():
        assert report["type"] == error_type, report
        assert words in report["message"], report["message"]
        assert f"rank {rank}" in report["message"]
        # The traceback the harness got is the same mini_ddp error (non-zero exit, readable).
        assert error_type in failures[rank] and "mini_ddp:" in failures[rank]
        if how == "SIGKILL":
            # Gloo sees the closed socket at once; 30 s only guards against a hang.
            assert report["seconds_to_error"] < hang_bound(30), report
        else:
            # A hung peer is only noticed by our deadline (the error type says it was ours, not
            # Gloo's 60 s); the bound only guards against a hang.
            assert report["seconds_to_error"] < SYNC_TIMEOUT_S + hang_bound(30), report


def test_gradsynctimeout_is_a_mini_ddp_error() -> None:
    assert issubclass(GradSyncTimeout, MiniDDPError)


def _matrix() -> None:
    """Print the failure matrix as a markdown table (used for docs/reliability.md)."""
    import tempfile

    print("| case | error on survivors | time to error (s) | case wall (s) | message (rank 0) |")
    print("|---|---|---|---|---|")
    for name in CASES:
        result = run_case(name, tempfile.mkdtemp(prefix="rank_death_"))
        times = [r["seconds_to_error"] for r in result["survivors"].values()]
        report = result["survivors"][0]
        print(f"| {name} | {report['type']} | {min(times):.2f}–{max(times):.2f} | "
              f"{result['wall_s']:.1f} | "
              f"{report['message'].split('. Another rank')[0]} |", flush=True)


if __name__ == "__main__":
    sys.exit(_matrix())

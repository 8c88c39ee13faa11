"""No shared-memory file outlives its processes, whatever kills them and whenever.

A rank SIGKILLs itself at each point of a segment's life — just created (the peer has not
mapped it), just mapped the peer's (the peer has not mapped ours), renewed (the peer has not
mapped the new one), halfway through a sum — under each launcher: spawn, fork, forkserver and
torchrun. The survivor is SIGKILLed right after (an OOM killer, a launcher tearing the job
down): nobody gets to clean up. Then ``/dev/shm`` must hold nothing of the transport's.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.deadlines import hang_bound
from helpers.shm_kill_rank import POINTS, rank_main

from mini_ddp.transport.shm import FILE_PREFIX, SHM_DIR

HELPER = Path(__file__).with_name("helpers") / "shm_kill_rank.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leftovers(outdir: Path) -> list[str]:
    tokens = {p.read_text() for p in outdir.glob("token*")}
    assert tokens, "the ranks never made a transport"
    return [f for t in tokens for f in glob.glob(os.path.join(SHM_DIR, f"*{t}*"))] + [
        f for f in glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}*"))
        if any(t in f for t in tokens)]


def _run_mp(method: str, point: str, victim: int, outdir: Path) -> None:
    ctx = mp.get_context(method)
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=rank_main, args=(r, 2, init, point, victim, str(outdir)))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[victim].join(hang_bound(60))
        if procs[victim].is_alive():  # hung: where each rank is goes to stderr (shown)
            for p in procs:
                os.kill(p.pid, signal.SIGUSR1)
            procs[victim].join(2)
        reached = sorted(f.name for f in outdir.iterdir())
        assert procs[victim].exitcode == -signal.SIGKILL, (procs[victim].exitcode, reached)
    finally:
        for p in procs:  # nobody cleans up: the survivor dies the same way
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(30)


CASES = [("fork", point, victim) for point in POINTS for victim in (0, 1)] + [
    ("spawn", "mapping", 1), ("forkserver", "renewal", 0), ("spawn", "use", 0)]


@pytest.mark.parametrize("method,point,victim", CASES)
def test_sigkill_leaves_no_shm_file(tmp_path: Path, method: str, point: str,
                                    victim: int) -> None:
    _run_mp(method, point, victim, tmp_path)
    assert Path(tmp_path, f"reached{victim}").read_text() == point
    assert not list(tmp_path.glob("finished*"))
    assert _leftovers(tmp_path) == []


def test_sigkill_under_torchrun_leaves_no_shm_file(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(HELPER), "creation", "1", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=hang_bound(120))
    assert done.returncode != 0  # the job failed: a rank was killed
    assert Path(tmp_path, "reached1").read_text() == "creation", done.stderr[-2000:]
    assert _leftovers(tmp_path) == []

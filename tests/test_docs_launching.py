"""docs/launching.md's elastic form: torchrun with a c10d rendezvous starts an example that
trains. On one machine only (``--nnodes=1:1``); across machines it is not tested."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers.deadlines import hang_bound

from mini_ddp.training.launch import stop_torchrun

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_with_c10d_rendezvous_trains_an_example():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=docs-elastic",
           "--nnodes=1:1", "--nproc-per-node=2", str(ROOT / "examples" / "seed002_lenet.py"),
           "--max-steps", "2", "--batch-size", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=hang_bound(240))
    finally:
        stop_torchrun(proc)  # on a timeout: SIGTERM the agent so its workers stop too
    output = output.replace("\r", "\n") if output else ""
    assert proc.returncode == 0, output[-6000:]
    assert "launched by torchrun" in output, output[-3000:]
    assert "done: 2 steps" in output, output[-3000:]

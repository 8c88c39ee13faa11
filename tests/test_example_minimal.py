"""examples/train_minimal.py runs as a user would run it (plainly: it spawns 2 ranks) and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.deadlines import hang_bound

ROOT = Path(__file__).resolve().parents[1]
EPOCH = re.compile(r"epoch (\d+): train loss ([\d.]+), test accuracy ([\d.]+)%")


def test_train_minimal_spawns_two_ranks_and_learns():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)  # run plainly: the script must launch its own ranks
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_minimal.py"),
                           "--epochs", "2", "--world-size", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=hang_bound(240))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    epochs = [(int(e), float(loss), float(acc)) for e, loss, acc in EPOCH.findall(output)]
    assert [e for e, _, _ in epochs] == [0, 1], output[-4000:]  # rank 0 alone prints
    assert epochs[1][1] < epochs[0][1], epochs  # the loss falls
    assert epochs[1][2] > 50.0, epochs          # far above chance (10%)


def test_train_minimal_runs_under_the_legacy_launcher():
    """torch.distributed.launch passes --local-rank=N to the script, which must accept it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node=2",
                           str(ROOT / "examples" / "train_minimal.py"), "--epochs", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=hang_bound(120))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert [e for e, _, _ in EPOCH.findall(output)] == ["0"], output[-4000:]

"""The main job (``make demo``) runs end to end, shortened: train, prove parity, trace."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.deadlines import hang_bound


def test_demo_runs_end_to_end_and_reports_parity(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "mini_ddp", "demo", "--epochs", "1", "--max-steps", "6",
         "--parity-steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=hang_bound(600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parity     : bitwise equal to torch DDP" in proc.stdout
    assert "training   : finished" in proc.stdout
    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"], "the trace has no events"
    assert (out / "timeline.png").stat().st_size > 10_000

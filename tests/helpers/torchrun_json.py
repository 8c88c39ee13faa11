"""Run a helper script on two ranks under torchrun and read back the JSON each rank wrote.

The framework tests (Accelerate, the Transformers Trainer, the documented integration lines)
start their ranks the way those frameworks are launched in practice; each helper script writes
``rank<R>.json`` into the directory it is given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # tiny models from configs only


def run_two_ranks(helper: str, out_dir: Path, timeout_s: float = 180) -> list[dict[str, Any]]:
    """``torchrun --standalone --nproc-per-node 2 tests/helpers/<helper> out_dir``; each rank's
    JSON, or an assertion error carrying the run's output."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", **OFFLINE}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(Path(__file__).parent / helper),
                           str(out_dir)],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]

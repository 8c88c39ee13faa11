"""Run helper scripts on two ranks under torchrun and read back the JSON each rank wrote.

The framework tests (Accelerate, the Transformers Trainer, Lightning Fabric, the documented
integration lines) start their ranks the way those frameworks are launched in practice: under
torchrun, all four runs in one launch (frameworks_run.py, read through :func:`framework_run`).
Each helper script writes ``rank<R>.json`` into the directory it is given, and runs its
``main`` through :func:`run_rank` (the script's own directory is on its path; this module
imports nothing of the test tree at the top, so a rank can import it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # tiny models from configs only


def run_two_ranks(helper: str, out_dir: Path, timeout_s: float = 180) -> None:
    """``torchrun --standalone --nproc-per-node 2 tests/helpers/<helper> out_dir``, or an
    assertion error carrying the run's output."""
    from helpers.deadlines import hang_bound  # the test side only (see the module docstring)

    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", **OFFLINE}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(Path(__file__).parent / helper),
                           str(out_dir)],
                          env=env, capture_output=True, text=True, timeout=hang_bound(timeout_s))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def framework_run(request: Any, name: str) -> list[dict[str, Any]]:
    """Each rank's JSON from the run ``name`` of frameworks_run.py (``request``: the pytest
    request of a test or fixture). The launch, every run of frameworks_run.RUNS in one pair of
    ranks, is made once per test run, by the first test module that asks
    (tests/helpers/shared_runs.py)."""
    from helpers.shared_runs import shared_folder, shared_result

    out_dir = shared_folder(request) / "frameworks"

    def launch() -> dict[str, list[dict[str, Any]]]:
        from helpers.frameworks_run import RUNS

        out_dir.mkdir(exist_ok=True)
        run_two_ranks("frameworks_run.py", out_dir, timeout_s=480)
        return {run: [json.loads((out_dir / run / f"rank{r}.json").read_text())
                      for r in range(2)] for run in RUNS}

    return shared_result(request, "frameworks", launch)[name]


def run_rank(main: Callable[[], None]) -> None:
    """A helper script's rank: ``main()``, then the process group destroyed. The frameworks
    leave it alive, and a Gloo group still alive when the interpreter finalizes can abort the
    process ("terminate called without an active exception", SIGABRT) after the run has
    finished and written its JSON."""
    main()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

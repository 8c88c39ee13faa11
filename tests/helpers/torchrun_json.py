"""Run a helper script on two ranks under torchrun and read back the JSON each rank wrote.

The framework tests (Accelerate, the Transformers Trainer, the documented integration lines)
start their ranks the way those frameworks are launched in practice: under torchrun, or (for a
framework with a launcher of its own, such as Lightning Fabric's ``devices=2``) as one plain
``python`` process that starts the second rank itself. Each helper script writes
``rank<R>.json`` into the directory it is given, and runs its ``main`` through
:func:`run_rank` (the script's own directory is on its path; this module imports nothing of
the test tree at the top, so a rank can import it).
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


def run_two_ranks(helper: str, out_dir: Path, timeout_s: float = 180,
                  self_launching: bool = False) -> list[dict[str, Any]]:
    """``torchrun --standalone --nproc-per-node 2 tests/helpers/<helper> out_dir`` (with
    ``self_launching``: ``python tests/helpers/<helper> out_dir``, the framework starting rank
    1); each rank's JSON, or an assertion error carrying the run's output."""
    from helpers.deadlines import hang_bound  # the test side only (see the module docstring)

    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", **OFFLINE}
    launcher = [] if self_launching else ["-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node", "2"]
    if self_launching:
        env.pop("MASTER_PORT", None)  # the framework's launcher picks a free one
    proc = subprocess.run([sys.executable, *launcher, str(Path(__file__).parent / helper),
                           str(out_dir)],
                          env=env, capture_output=True, text=True, timeout=hang_bound(timeout_s))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def run_rank(main: Callable[[], None]) -> None:
    """A helper script's rank: ``main()``, then the process group destroyed. The frameworks
    leave it alive, and a Gloo group still alive when the interpreter finalizes can abort the
    process ("terminate called without an active exception", SIGABRT) after the run has
    finished and written its JSON."""
    main()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

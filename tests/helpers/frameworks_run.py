"""The framework runs that need two ranks and no launcher of the framework's own, in one
torchrun launch: ``torchrun --standalone --nproc-per-node 2 frameworks_run.py OUT_DIR``.

Accelerate (accelerate_run.py), the Transformers ``Trainer`` (transformers_run.py), Lightning
Fabric (fabric_run.py) and docs/integrations.md's four blocks (docs_integrations_run.py) run
one after the other in the same two ranks, each writing its ``rank{R}.json`` into
``OUT_DIR/<its name>``. Two processes importing these frameworks cost more CPU than all the
runs in them, so the runs share them; each run builds its own framework objects, and the
documented blocks already run the four frameworks one after another in one process. Each
helper still runs alone too: ``torchrun ... accelerate_run.py OUT_DIR``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

RUNS = ("accelerate_run", "transformers_run", "fabric_run", "docs_integrations_run")


def main(out_dir: Path) -> None:
    """Every run of :data:`RUNS`, in order, each into its own folder of ``out_dir``."""
    for name in RUNS:
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        importlib.import_module(name).main(folder)


if __name__ == "__main__":
    from torchrun_json import run_rank

    run_rank(lambda: main(Path(sys.argv[1])))

"""docs/integrations.md's code blocks, run as written: two ranks under torchrun, the names
each block leaves to the reader supplied (tests/helpers/docs_integrations_run.py).

Each block must train through ``DataParallelModel``, change the parameters, and leave both
ranks with the same ones. Bitwise parity with torch DDP under each framework is the business
of the other tests/test_integrations_*.py files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

for _framework in ("lightning", "accelerate", "transformers"):
    pytest.importorskip(_framework)

HELPER = Path(__file__).resolve().parent / "helpers" / "docs_integrations_run.py"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("docs_integrations")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(HELPER), str(out_dir)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["lightning", "accelerate", "transformers"])
def test_documented_lines_train_with_mini_ddp(results: list[dict[str, Any]],
                                              framework: str) -> None:
    for r in results:
        got = r[framework]
        assert got == {"wrapped_by": "DataParallelModel", "changed": True,
                       "ranks agree": True}, got

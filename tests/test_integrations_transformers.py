"""The Transformers ``Trainer`` with ``use_mini_ddp()``: bitwise torch DDP.

A 2-layer GPT-2 built from a ``GPT2Config`` (nothing downloaded) on synthetic tokens, trained
by ``Trainer`` (``use_cpu=True``, gradient accumulation 2, three optimizer steps) under torchrun
with two ranks: first as is (torch DDP), then with ``trainer.train()`` inside
``with use_mini_ddp():``, in the same processes. The run is tests/helpers/transformers_run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

HELPER = Path(__file__).resolve().parent / "helpers" / "transformers_run.py"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("transformers")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(HELPER), str(out_dir)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(240)
def test_trainer_trains_bitwise_as_torch_ddp(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["wrapped_by"] == "DataParallelModel", r
        assert r["torch wrapped_by"] == "DistributedDataParallel", r
        assert r["changed"] is True, r
        assert r["same"] is True, r  # torch.equal on every final parameter


@pytest.mark.timeout(240)
def test_trainer_keeps_the_plain_model_and_restores_torch_ddp(results: list[dict[str, Any]]
                                                               ) -> None:
    for r in results:
        assert r["unwrapped"] is True  # trainer.model is the model; model_wrapped wraps it
        assert r["rebinding restored"] is True

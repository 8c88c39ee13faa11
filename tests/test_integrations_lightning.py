"""PyTorch Lightning with ``MiniDDPStrategy``: bitwise torch DDP's ``DDPStrategy``.

``Trainer(accelerator="cpu", devices=2, strategy=MiniDDPStrategy())`` against the same
``Trainer`` with Lightning's ``DDPStrategy``, in the same two processes (Lightning's own popen
launcher), same data and seeds: gradient accumulation with clipping, manual optimization
(``manual_backward`` inside ``training_step``: Lightning arms the reducer from inside the
forward), a static graph under manual optimization (Lightning flushes its first iteration with
``reducer._delay_all_reduce()``), checkpoint + resume; then ``ddp_spawn``. Every case checks
the final parameters with ``torch.equal``, that ``DataParallelModel`` really wrapped the model
during ``fit``, and that teardown unwrapped it. The runs are in tests/helpers/lightning_run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.deadlines import hang_bound

pytest.importorskip("lightning")

HELPER = Path(__file__).resolve().parent / "helpers" / "lightning_run.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def _run(out_dir: Path, *extra: str, timeout_s: float) -> str:
    """Run the helper; return the tail of its output (both ranks share the pipes)."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("MASTER_PORT", None)  # Lightning picks a free one
    proc = subprocess.run([sys.executable, str(HELPER), str(out_dir), *extra], env=env,
                          capture_output=True, text=True, timeout=hang_bound(timeout_s))
    output = proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, output
    return output


def _written(path: Path, output: str, timeout_s: float = 30.0) -> Path:
    """``path`` once it exists: Lightning's launcher process (rank 0) can exit before the
    rank it started has written its results; a rank that failed after the last collective
    (rank 0 no longer there to notice) shows its traceback in ``output``."""
    deadline = time.monotonic() + hang_bound(timeout_s)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"{path.name} was never written:\n{output}"
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("lightning")
    output = _run(out_dir, timeout_s=240)
    ranks = [json.loads(_written(out_dir / f"rank{r}.json", output).read_text())
             for r in range(2)]
    _run(out_dir, "spawn", timeout_s=180)
    ranks[0].update(json.loads((out_dir / "rank0.json").read_text()))
    return ranks


CASES = ["accumulate_grad_batches=2, gradient_clip_val=0.05", "manual optimization",
         "static_graph, manual optimization", "checkpoint + resume", "ddp_spawn"]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", CASES)
def test_lightning_trains_bitwise_as_torch_ddp(results: list[dict[str, Any]], case: str) -> None:
    for rank, r in enumerate(results):
        if case not in r:
            assert case == "ddp_spawn" and rank == 1  # spawn reports from the parent only
            continue
        got = r[case]
        assert got["wrapped_by"] == "DataParallelModel", got
        assert got["changed"] is True, got  # it trained
        assert got["same"] is True, got     # torch.equal with torch DDP, every parameter
        assert got["unwrapped"] is True, got  # teardown gave back the LightningModule


@pytest.mark.timeout(480)
def test_lightning_checkpoint_keys_have_no_wrapper_prefix(results: list[dict[str, Any]]) -> None:
    assert results[0]["checkpoint + resume"]["keys"] == ["net.0.bias", "net.0.weight",
                                                          "net.2.bias", "net.2.weight"]

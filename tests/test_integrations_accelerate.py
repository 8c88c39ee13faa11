"""Hugging Face Accelerate with ``use_mini_ddp()``: bitwise torch DDP.

The same loop runs twice in the same two processes (torchrun, ``Accelerator(cpu=True)``):
``accelerator.prepare`` as is (torch DDP), then inside ``with use_mini_ddp():`` (mini_ddp).
It uses ``accumulate`` (``no_sync`` on the micro-batches between optimizer steps),
``clip_grad_norm_``, ``save_state``, a restart (new ``Accelerator``, model, optimizer) with
``load_state``, two forwards under ``no_sync`` whose second backward is synchronised by
``trigger_sync_in_backward`` (Accelerate arms ``model.reducer.prepare_for_backward([])``),
``unwrap_model`` and ``get_state_dict``. The loop is in
tests/helpers/accelerate_run.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.torchrun_json import framework_run

pytest.importorskip("accelerate")



@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return framework_run(request, "accelerate_run")


@pytest.mark.timeout(600)
def test_accelerate_trains_bitwise_as_torch_ddp(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["wrapped_by"] == "DataParallelModel" and r["is DDP"] is True, r
        assert r["torch wrapped_by"] == "DistributedDataParallel", r
        assert r["changed"] is True and r["resumed"] is True, r
        assert r["same"] is True, r  # torch.equal on every final parameter


@pytest.mark.timeout(600)
def test_accelerate_unwraps_and_saves_without_prefix(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["unwrapped"] is True
        assert r["state_dict keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert r["rebinding restored"] is True  # torch's class is back after the context

"""The Transformers ``Trainer`` with ``use_mini_ddp()``: bitwise torch DDP.

A 2-layer GPT-2 built from a ``GPT2Config`` (nothing downloaded) on synthetic tokens, trained
by ``Trainer`` (``use_cpu=True``, gradient accumulation 2, three optimizer steps) under torchrun
with two ranks: first as is (torch DDP), then with ``trainer.train()`` inside
``with use_mini_ddp():``, in the same processes. The run is tests/helpers/transformers_run.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.torchrun_json import framework_run

pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return framework_run(request, "transformers_run")


@pytest.mark.timeout(600)
def test_trainer_trains_bitwise_as_torch_ddp(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["wrapped_by"] == "DataParallelModel", r
        assert r["torch wrapped_by"] == "DistributedDataParallel", r
        assert r["changed"] is True, r
        assert r["same"] is True, r  # torch.equal on every final parameter


@pytest.mark.timeout(600)
def test_trainer_keeps_the_plain_model_and_restores_torch_ddp(results: list[dict[str, Any]]
                                                               ) -> None:
    for r in results:
        assert r["unwrapped"] is True  # trainer.model is the model; model_wrapped wraps it
        assert r["rebinding restored"] is True

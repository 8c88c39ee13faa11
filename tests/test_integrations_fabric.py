"""Lightning Fabric with ``MiniDDPStrategy``: bitwise Fabric's own ``DDPStrategy`` (torch DDP).

The same Fabric loop runs twice in the same two processes (``Fabric(accelerator="cpu",
devices=2, strategy=...)`` under torchrun, in the launch the torchrun framework tests share,
tests/helpers/frameworks_run.py; the strategies leave launching to Fabric's own code, and
Lightning's process launcher is exercised by tests/test_integrations_lightning.py): Fabric's
``DDPStrategy``, then
``mini_ddp.integrations.fabric.MiniDDPStrategy``. It takes plain steps with
``fabric.clip_gradients(max_norm=)``, accumulates over two micro-batches with
``fabric.no_backward_sync(model, enabled=...)`` and ``fabric.clip_gradients(clip_val=)``,
``fabric.save``-s model, optimizer and step, restarts (new Fabric, model, optimizer) with
``fabric.load`` and accumulates on. The documented snippet runs under torchrun in
tests/test_integrations_docs.py. The loop is in tests/helpers/fabric_run.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.torchrun_json import framework_run

pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return framework_run(request, "fabric_run")


@pytest.mark.timeout(600)
def test_fabric_trains_bitwise_as_torch_ddp(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["wrapped_by"] == "DataParallelModel" and r["is DDP"] is True, r
        assert r["torch"]["wrapped_by"] == "DistributedDataParallel", r
        assert r["changed"] is True, r  # it trained
        assert r["same"] is True, r     # torch.equal with torch DDP, every final parameter
        assert r["unwrapped"] is True, r  # fabric_model.module is the bare model


@pytest.mark.timeout(600)
def test_fabric_no_backward_sync_keeps_gradients_local(results: list[dict[str, Any]]) -> None:
    for r in results:
        # Four micro-batches under no_backward_sync(enabled=True): each rank's own gradients;
        # seven synchronised backwards (enabled=False or plain): the same on every rank.
        for engine in (r, r["torch"]):
            assert engine["seen"] == {"local": [False] * 4, "synced": [True] * 7}, engine


@pytest.mark.timeout(600)
def test_fabric_save_and_load(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["resumed"] is True and r["torch"]["resumed"] is True, r
        assert r["keys"] == r["torch"]["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.timeout(600)
def test_use_mini_ddp_does_not_reach_fabric_ddp_strategy(results: list[dict[str, Any]]) -> None:
    # What docs/integrations.md warns of: Fabric's strategy="ddp" holds torch's class, so the
    # strategy is the way in.
    for r in results:
        assert r["ddp under use_mini_ddp"] == "DistributedDataParallel", r

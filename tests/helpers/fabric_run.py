"""Lightning Fabric runs for tests/test_integrations_fabric.py: the same Fabric loop, first with
Fabric's ``DDPStrategy`` (torch DDP), then with ``MiniDDPStrategy``, in the same two processes.

The tests run it under torchrun with the other framework runs (frameworks_run.py), where
``Fabric(accelerator="cpu", devices=2, strategy=...)`` and ``fabric.launch()`` join torchrun's
two ranks; ``python fabric_run.py OUT_DIR`` alone has Fabric's own launcher start rank 1 by
re-running the command. The loop: plain steps with ``fabric.clip_gradients(max_norm=)``,
then gradient accumulation over two micro-batches with ``fabric.no_backward_sync(model,
enabled=...)`` and ``fabric.clip_gradients(clip_val=)``, ``fabric.save`` of model, optimizer
and step, a restart (new Fabric, model and optimizer) with ``fabric.load``, and more
accumulation. Last, ``Fabric(strategy="ddp")`` set up inside ``use_mini_ddp()``, which does not
reach it (Fabric holds torch's class from import time). Each rank writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from mini_ddp.integrations import use_mini_ddp
from mini_ddp.integrations.fabric import MiniDDPStrategy

PLAIN, ACCUMULATED = 3, 4  # batches per phase, before and after the restart


def _parts() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(88, 8, generator=g), torch.randn(88, 1, generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), \
        DataLoader(data, batch_size=4)


def _fabric(mini: bool) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=MiniDDPStrategy() if mini else DDPStrategy())
    fabric.launch()
    return fabric


def _ranks_agree(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(gathered[0], g) for g in gathered)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _step(fabric: Fabric, model: Any, opt: Any, batches: list[Any], accumulate: int,
          clip: dict[str, float], seen: dict[str, list[bool]]) -> None:
    loss_fn = nn.functional.mse_loss
    for i, (x, y) in enumerate(batches):
        syncing = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not syncing):
            fabric.backward(loss_fn(model(x), y))
        # Unsynchronised micro-batches leave each rank its own gradients; a synchronised
        # backward leaves every rank the same ones.
        seen["local" if not syncing else "synced"].append(_ranks_agree(_grads(model)))
        if syncing:
            fabric.clip_gradients(model, opt, **clip)
            opt.step()
            opt.zero_grad()


def _run(mini: bool, ckpt: str) -> dict[str, Any]:
    seen: dict[str, list[bool]] = {"local": [], "synced": []}
    fabric = _fabric(mini)
    net, opt, loader = _parts()
    model, opt = fabric.setup(net, opt)
    batches = list(fabric.setup_dataloaders(loader))
    wrapped_by = type(model._forward_module).__name__
    _step(fabric, model, opt, batches[:PLAIN], 1, {"max_norm": 0.05}, seen)
    _step(fabric, model, opt, batches[PLAIN:PLAIN + ACCUMULATED], 2, {"clip_val": 0.01}, seen)
    saved = [p.detach().clone() for p in model.parameters()]
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": PLAIN + ACCUMULATED})
    keys = sorted(torch.load(ckpt, weights_only=False)["model"])

    # A restart: a new Fabric, model and optimizer, set up the same way, continue from the file.
    fabric = _fabric(mini)
    net, opt, _ = _parts()
    model, opt = fabric.setup(net, opt)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(ckpt, state)
    resumed = state["step"] == PLAIN + ACCUMULATED and all(
        torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    _step(fabric, model, opt, batches[PLAIN + ACCUMULATED:], 2, {"max_norm": 0.05}, seen)
    return {"wrapped_by": wrapped_by, "is DDP": isinstance(model._forward_module, DDP),
            "resumed": resumed, "keys": keys, "seen": seen,
            "unwrapped": model.module is net and type(model.module) is nn.Sequential,
            "params": [p.detach().clone() for p in net.parameters()],
            "start": [p.detach().clone() for p in _parts()[0].parameters()]}


def _rebinding_reaches_ddp_strategy() -> str:
    """The class Fabric's own ``strategy="ddp"`` wraps with inside ``use_mini_ddp()``."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    with use_mini_ddp():
        model = fabric.setup(nn.Linear(2, 1))
    return type(model._forward_module).__name__


def main(out_dir: Path) -> None:
    """The run; each rank writes ``out_dir/rank{R}.json``."""
    warnings.simplefilter("ignore")
    _fabric(mini=False)  # joins the process group torchrun describes
    with tempfile.TemporaryDirectory() as tmp:
        holder = [tmp]  # rank 0's directory: fabric.save writes there, every rank loads it
        dist.broadcast_object_list(holder, src=0)
        theirs = _run(mini=False, ckpt=str(Path(holder[0]) / "torch.ckpt"))
        ours = _run(mini=True, ckpt=str(Path(holder[0]) / "mini.ckpt"))
        dist.barrier()
    out = {key: ours[key] for key in ("wrapped_by", "is DDP", "resumed", "keys", "seen",
                                      "unwrapped")}
    out["torch"] = {key: theirs[key] for key in ("wrapped_by", "resumed", "keys", "seen")}
    out["same"] = all(torch.equal(a, b) for a, b in zip(theirs["params"], ours["params"],
                                                         strict=True))
    out["ddp under use_mini_ddp"] = _rebinding_reaches_ddp_strategy()
    out["changed"] = not all(torch.equal(a, b) for a, b in zip(ours["params"], ours["start"],
                                                               strict=True))
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from torchrun_json import run_rank

    run_rank(lambda: main(Path(sys.argv[1])))

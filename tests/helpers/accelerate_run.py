"""Accelerate runs for tests/test_integrations_accelerate.py: the same training loop, first with
torch DDP (``accelerator.prepare`` as is), then with mini_ddp (``prepare`` inside
``use_mini_ddp()``), in the same two processes.

Started as Accelerate runs on CPUs: ``torchrun --nproc-per-node 2 accelerate_run.py OUT_DIR``
with ``Accelerator(cpu=True)`` (Accelerate's multi-CPU mode; ``accelerate launch`` has no
multi-process CPU launcher without MPI). The loop uses ``accumulate`` (gradient accumulation
with ``no_sync``), ``clip_grad_norm_``, ``save_state`` / ``load_state`` into a fresh model
and optimizer, ``no_sync`` + ``trigger_sync_in_backward``, and ``unwrap_model``. Each rank writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from mini_ddp.integrations import use_mini_ddp

STEPS_BEFORE_SAVE = 4  # micro-batches (two optimizer steps), then save, then four more


def _parts() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)


def _train(accelerator: Accelerator, model: nn.Module, opt: torch.optim.Optimizer,
           batches: list[Any]) -> None:
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()


def _run(mini: bool, state_dir: str) -> dict[str, Any]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rebind = use_mini_ddp() if mini else nullcontext()
    with rebind:
        model, opt, loader = accelerator.prepare(*_parts())
    batches = list(loader)
    _train(accelerator, model, opt, batches[:STEPS_BEFORE_SAVE])
    saved = [p.detach().clone() for p in model.parameters()]
    accelerator.save_state(state_dir)
    # A restart: a new Accelerator, model and optimizer, prepared the same way, continue from
    # the saved state.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    rebind = use_mini_ddp() if mini else nullcontext()
    with rebind:
        fresh, fresh_opt = accelerator.prepare(*_parts()[:2])
    accelerator.load_state(state_dir)
    resumed = all(torch.equal(a, b) for a, b in zip(saved, fresh.parameters(), strict=True))
    _train(accelerator, fresh, fresh_opt, batches[STEPS_BEFORE_SAVE:-2])
    # Accelerate's documented no_sync + trigger_sync_in_backward pattern: two forwards without
    # sync, the second backward armed by hand (reducer.prepare_for_backward([])).
    (xa, ya), (xb, yb) = batches[-2:]
    with accelerator.no_sync(fresh):
        loss_a = nn.functional.mse_loss(fresh(xa), ya)
        loss_b = nn.functional.mse_loss(fresh(xb), yb)
    accelerator.backward(loss_a)
    with accelerator.trigger_sync_in_backward(fresh):
        accelerator.backward(loss_b)
    fresh_opt.step()
    inner = accelerator.unwrap_model(fresh)
    return {"wrapped_by": type(fresh).__name__, "is DDP": isinstance(fresh, DDP),
            "resumed": resumed,
            "unwrapped": type(inner) is nn.Sequential and inner is fresh.module,
            "state_dict keys": sorted(accelerator.get_state_dict(fresh)),
            "params": [p.detach().clone() for p in inner.parameters()],
            "start": [p.detach().clone() for p in _parts()[0].parameters()]}


def main(out_dir: Path) -> None:
    """The run; each rank writes ``out_dir/rank{R}.json``."""
    warnings.simplefilter("ignore")
    Accelerator(cpu=True)  # joins the process group torchrun describes
    with tempfile.TemporaryDirectory() as tmp:
        holder = [tmp]  # rank 0's directory: save_state writes there, every rank loads it
        torch.distributed.broadcast_object_list(holder, src=0)
        theirs = _run(mini=False, state_dir=str(Path(holder[0]) / "torch"))
        ours = _run(mini=True, state_dir=str(Path(holder[0]) / "mini"))
        torch.distributed.barrier()
    out = {key: ours[key] for key in ("wrapped_by", "is DDP", "unwrapped", "state_dict keys",
                                      "resumed")}
    out["torch wrapped_by"] = theirs["wrapped_by"]
    out["same"] = all(torch.equal(a, b) for a, b in zip(theirs["params"], ours["params"],
                                                         strict=True))
    out["changed"] = not all(torch.equal(a, b) for a, b in zip(ours["params"], ours["start"],
                                                               strict=True))
    out["rebinding restored"] = torch.nn.parallel.DistributedDataParallel is DDP
    rank = torch.distributed.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from torchrun_json import run_rank

    run_rank(lambda: main(Path(sys.argv[1])))

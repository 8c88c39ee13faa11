"""Lightning runs for tests/test_integrations_lightning.py: each case trains under torch DDP's
``DDPStrategy`` and under ``MiniDDPStrategy`` in the same two processes, same data, same seeds.

``python tests/helpers/lightning_run.py OUT_DIR`` (Lightning's own launcher starts rank 1 by
re-running this command); then ``... OUT_DIR spawn`` runs the ``ddp_spawn`` case from the
parent process, against torch DDP's one-epoch parameters the first command saved. Each rank writes ``OUT_DIR/rank{R}.json``: per case, whether the final
parameters are ``torch.equal`` across engines, which class wrapped the model during ``fit``,
and what ``trainer.strategy.model`` is after it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mini_ddp.integrations.lightning import MiniDDPStrategy


class TinyRegressor(pl.LightningModule):
    """A two-layer MLP; ``manual=True`` uses manual optimization (manual_backward)."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.automatic_optimization = not manual
        self.wrapped_by = ""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.wrapped_by = type(self.trainer.strategy.model).__name__
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
        return DataLoader(data, batch_size=4)


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _fit(strategy: Any, manual: bool = False, ckpt: str | None = None,
         **kwargs: Any) -> tuple[TinyRegressor, pl.Trainer]:
    model = TinyRegressor(manual)
    trainer = _trainer(strategy, **kwargs)
    trainer.fit(model, ckpt_path=ckpt)
    return model, trainer


# Plain automatic optimization is the first fit of "checkpoint + resume".
CASES: dict[str, dict[str, Any]] = {
    "accumulate_grad_batches=2, gradient_clip_val=0.05": {
        "max_epochs": 1, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    "manual optimization": {"max_epochs": 1, "manual": True},
    "static_graph, manual optimization": {"max_epochs": 1, "static": True, "manual": True},
}


def _strategies(static: bool) -> tuple[Any, Any]:
    kw = {"static_graph": True} if static else {}
    return DDPStrategy(**kw), MiniDDPStrategy(**kw)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


TORCH_ONE_EPOCH = "torch_ddp_one_epoch.pt"


def _popen_cases(out: dict[str, Any], out_dir: Path) -> None:
    for name, case in CASES.items():
        case = dict(case)
        static, manual = case.pop("static", False), case.pop("manual", False)
        theirs_strategy, ours_strategy = _strategies(static)
        theirs, _ = _fit(theirs_strategy, manual, **case)
        ours, trainer = _fit(ours_strategy, manual, **case)
        out[name] = {"same": _same(theirs, ours), "changed": not _same(ours, TinyRegressor()),
                     "wrapped_by": ours.wrapped_by,
                     "torch wrapped_by": theirs.wrapped_by,
                     "unwrapped": trainer.strategy.model is ours and trainer.model is ours}
    # Checkpoint after one epoch, resume for a second, on both engines.
    with tempfile.TemporaryDirectory() as tmp:
        finals = []
        for i, strategy in enumerate((DDPStrategy(), MiniDDPStrategy())):
            _, trainer = _fit(strategy, max_epochs=1)
            path = trainer.strategy.broadcast(str(Path(tmp) / f"engine{i}.ckpt"))
            trainer.save_checkpoint(path)
            resumed, trainer = _fit(MiniDDPStrategy() if i else DDPStrategy(), max_epochs=2,
                                    ckpt=path)
            finals.append(resumed)
            if i:
                keys = sorted(torch.load(path, weights_only=False)["state_dict"])
            elif trainer.global_rank == 0:  # torch DDP's one epoch: the ddp_spawn reference
                state = torch.load(path, weights_only=False)["state_dict"]
                torch.save(state, out_dir / TORCH_ONE_EPOCH)
            # The checkpoint lives in rank 0's temporary directory: no rank leaves the block
            # (rank 0 deletes it there) before every rank has read it.
            trainer.strategy.barrier()
        out["checkpoint + resume"] = {"same": _same(*finals), "wrapped_by": finals[1].wrapped_by,
                                      "changed": not _same(finals[1], TinyRegressor()),
                                      "torch wrapped_by": finals[0].wrapped_by,
                                      "unwrapped": trainer.strategy.model is finals[1],
                                      "keys": keys}


def _spawn_case(out: dict[str, Any], out_dir: Path) -> None:
    """ddp_spawn with mini_ddp against torch DDP's one-epoch run of the popen cases (the start
    method changes no arithmetic; spawning both engines would double the slowest case)."""
    theirs = TinyRegressor()
    theirs.load_state_dict(torch.load(out_dir / TORCH_ONE_EPOCH))
    ours, trainer = _fit(MiniDDPStrategy(start_method="spawn"), max_epochs=1)
    out["ddp_spawn"] = {"same": _same(theirs, ours), "changed": not _same(ours, TinyRegressor()),
                        "wrapped_by": "DataParallelModel" if isinstance(
                            trainer.strategy, MiniDDPStrategy) else "",
                        "torch wrapped_by": "DistributedDataParallel",
                        "unwrapped": trainer.strategy.model is ours}


def main() -> None:
    warnings.simplefilter("ignore")
    out_dir = Path(sys.argv[1])
    out: dict[str, Any] = {}
    if sys.argv[2:] == ["spawn"]:
        _spawn_case(out, out_dir)
        rank = 0  # the parent process: the spawned ranks returned their weights to it
    else:
        _popen_cases(out, out_dir)
        rank = torch.distributed.get_rank()
    # Written whole, then renamed: the parent process (rank 0) may exit, and the test read the
    # files, while rank 1 is still writing its own.
    partial = out_dir / f"rank{rank}.json.partial"
    partial.write_text(json.dumps(out, indent=1))
    os.replace(partial, out_dir / f"rank{rank}.json")


if __name__ == "__main__":
    from torchrun_json import run_rank

    run_rank(main)

"""PyTorch Lightning: a ``DDPStrategy`` whose model is a ``DataParallelModel``.

``Trainer(strategy=MiniDDPStrategy())`` (``MiniDDPStrategy(start_method="spawn")`` for
``ddp_spawn``) takes every keyword of Lightning's ``DDPStrategy``, DDP's keywords and
mini_ddp's own (``sync_timeout_s``, ``zero_copy_write_back``, ...) included. Everything else is
Lightning's: because ``DataParallelModel`` is a ``DistributedDataParallel``, Lightning's
manual-optimization arming (``reducer.prepare_for_backward``), its static-graph flush
(``reducer._delay_all_reduce``), ``no_sync`` under gradient accumulation and the unwrapping at
teardown all run as they do for torch DDP. Needs ``lightning`` (``pip install
mini-ddp[integrations]``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from mini_ddp.engine.model import DataParallelModel


class MiniDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with ``DataParallelModel`` in torch DDP's place."""

    strategy_name = "mini_ddp"

    def _setup_model(self, model: nn.Module) -> DataParallelModel:
        """Wrap the LightningModule as ``DDPStrategy`` does, in a ``DataParallelModel``."""
        device_ids = self.determine_ddp_device_ids()
        # As DDPStrategy: on GPUs, build it on a side stream (torch's CUDA stream notes).
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DataParallelModel(module=model, device_ids=device_ids, **self._ddp_kwargs)

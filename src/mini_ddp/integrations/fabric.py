"""Lightning Fabric: a Fabric ``DDPStrategy`` whose model is a ``DataParallelModel``.

``Fabric(accelerator="cpu", devices=2, strategy=MiniDDPStrategy())`` takes every keyword of
Fabric's ``DDPStrategy`` (``start_method="spawn"`` for ``ddp_spawn``, ``timeout=``,
``process_group_backend=``), DDP's keywords and mini_ddp's own (``sync_timeout_s``,
``zero_copy_write_back``, ...), all passed on to ``DataParallelModel``. Only the wrapping
changes. Fabric's strategy checks for DDP with ``isinstance(module, DistributedDataParallel)``,
and ``DataParallelModel`` passes those checks, so the rest is Fabric's own code:
``fabric.no_backward_sync`` enters ``module.no_sync()``, ``fabric.save`` / ``fabric.load``
unwrap the model (no ``module.`` key prefix), and ``fabric.backward`` / ``fabric.clip_gradients``
act on the gradients the engine wrote back.

``use_mini_ddp()`` does not reach Fabric's own ``strategy="ddp"``: Fabric takes the class from
``torch.nn.parallel.distributed`` when it is imported, not from ``torch.nn.parallel`` when it
wraps. So the strategy is the one way in. Needs ``lightning`` (``pip install
mini-ddp[integrations]``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn

from mini_ddp.engine.model import DataParallelModel


class MiniDDPStrategy(DDPStrategy):
    """Fabric's DDP strategy with ``DataParallelModel`` in torch DDP's place."""

    def setup_module(self, module: nn.Module) -> DataParallelModel:
        """Wrap the module as Fabric's ``DDPStrategy`` does, in a ``DataParallelModel``."""
        device_ids = self._determine_ddp_device_ids()
        # As Fabric's DDPStrategy: on GPUs, build it on a side stream (torch's CUDA stream notes).
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DataParallelModel(module=module, device_ids=device_ids, **self._ddp_kwargs)

"""Integrations: mini_ddp under frameworks that wrap the model in torch DDP themselves.

``DataParallelModel`` *is* a ``torch.nn.parallel.DistributedDataParallel`` for ``isinstance``,
so frameworks take their DDP code paths with it (unwrapping, manual-backward arming, checkpoint
key handling). What is left is getting the framework to *build* it instead of torch's class:

* PyTorch Lightning: ``Trainer(strategy=mini_ddp.integrations.lightning.MiniDDPStrategy())``
  (:mod:`.lightning`; needs ``lightning``).
* Lightning Fabric: ``Fabric(strategy=mini_ddp.integrations.fabric.MiniDDPStrategy())``
  (:mod:`.fabric`; needs ``lightning``). ``use_mini_ddp()`` does not reach Fabric's own
  ``strategy="ddp"``, which holds torch's class from import time.
* Hugging Face Accelerate and the Transformers ``Trainer``: build the ``Accelerator`` /
  ``Trainer`` and call ``prepare`` / ``train`` inside ``with use_mini_ddp():``
  (:mod:`.rebind`), which points ``torch.nn.parallel.DistributedDataParallel`` at
  ``DataParallelModel`` and restores it on exit.

The top layer: it imports the engine, and each framework only inside its own module, so
``import mini_ddp`` never needs them. docs/integrations.md has the exact lines and what is
tested.
"""

from mini_ddp.integrations.rebind import use_mini_ddp

__all__ = ["use_mini_ddp"]

"""``use_mini_ddp()``: frameworks that call ``torch.nn.parallel.DistributedDataParallel(...)``
build a ``DataParallelModel`` instead, for as long as the context lasts.

Hugging Face Accelerate (``Accelerator.prepare``) and hence the Transformers ``Trainer`` look
the class up as an attribute of ``torch.nn.parallel`` at the moment they wrap the model, so
rebinding that one attribute is enough. It is reversible — the previous binding comes back on
exit, also after an exception — and nests. Only the public name is rebound:
``torch.nn.parallel.distributed.DistributedDataParallel`` (torch's own module, whose class
attribute ``_active_ddp_module`` torch.compile reads) stays torch's class. Models built inside
the context keep working after it: they are ``DistributedDataParallel`` instances either way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.parallel

from mini_ddp.engine.model import DataParallelModel

_lock = threading.Lock()


@contextmanager
def use_mini_ddp() -> Iterator[type[DataParallelModel]]:
    """Within the block, ``torch.nn.parallel.DistributedDataParallel`` is ``DataParallelModel``.

    Example (Accelerate)::

        with use_mini_ddp():
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    """
    with _lock:
        previous = torch.nn.parallel.DistributedDataParallel
        torch.nn.parallel.DistributedDataParallel = DataParallelModel
    try:
        yield DataParallelModel
    finally:
        with _lock:
            torch.nn.parallel.DistributedDataParallel = previous

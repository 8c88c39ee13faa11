"""mini_ddp: a small, readable, pure-Python DistributedDataParallel.

``from mini_ddp import DataParallelModel`` and use it where you used
``torch.nn.parallel.DistributedDataParallel``.
"""

from mini_ddp.config import DataParallelConfig
from mini_ddp.errors import (
    GradSyncTimeout,
    MarkedTwiceError,
    MiniDDPError,
    UnfinishedReductionError,
)
from mini_ddp.hooks import GradBucket
from mini_ddp.model import DataParallelModel
from mini_ddp.spawn import RankContext, RanksFailed, run_ranks

__all__ = [
    "DataParallelConfig",
    "DataParallelModel",
    "GradBucket",
    "GradSyncTimeout",
    "MarkedTwiceError",
    "MiniDDPError",
    "RankContext",
    "RanksFailed",
    "UnfinishedReductionError",
    "run_ranks",
]

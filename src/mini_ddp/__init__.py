"""mini_ddp: a small, readable, pure-Python DistributedDataParallel.

``from mini_ddp import DataParallelModel`` and use it where you used
``torch.nn.parallel.DistributedDataParallel``. The rest of this namespace is the toolbox around
it: tracing and layout explanations, stall and desync detection, teaching collectives, and the
rank harness the tests and tools are built on.
"""

from mini_ddp.collectives import collective_hook
from mini_ddp.comm import ParameterMismatchError
from mini_ddp.config import DataParallelConfig
from mini_ddp.desync import DesyncDetector, DesyncError, check_in_sync
from mini_ddp.errors import (
    CollectiveError,
    GradSyncTimeout,
    MarkedTwiceError,
    MiniDDPError,
    UnfinishedReductionError,
)
from mini_ddp.explain import explain
from mini_ddp.hooks import CommHookTimeout, GradBucket, gloo_safe
from mini_ddp.model import DataParallelModel
from mini_ddp.multi_device import MultiDeviceDataParallel
from mini_ddp.shm import SharedMemoryAllreduce
from mini_ddp.spawn import RankContext, RanksFailed, run_ranks
from mini_ddp.tracing import TraceRecorder, trace
from mini_ddp.watchdog import StallError, StallWatchdog

__all__ = [
    "CollectiveError",
    "CommHookTimeout",
    "DataParallelConfig",
    "DataParallelModel",
    "DesyncDetector",
    "DesyncError",
    "GradBucket",
    "GradSyncTimeout",
    "MarkedTwiceError",
    "MiniDDPError",
    "MultiDeviceDataParallel",
    "ParameterMismatchError",
    "RankContext",
    "RanksFailed",
    "SharedMemoryAllreduce",
    "StallError",
    "StallWatchdog",
    "TraceRecorder",
    "UnfinishedReductionError",
    "check_in_sync",
    "collective_hook",
    "explain",
    "gloo_safe",
    "run_ranks",
    "trace",
]

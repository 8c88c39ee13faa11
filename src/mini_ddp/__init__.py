"""mini_ddp: a small, readable, pure-Python DistributedDataParallel.

``from mini_ddp import DataParallelModel`` and use it where you used
``torch.nn.parallel.DistributedDataParallel``. The rest of this namespace is the toolbox around
it: tracing and layout explanations, stall and desync detection, teaching collectives, and the
rank harness the tests and tools are built on.
"""

from mini_ddp.attach import attach
from mini_ddp.engine.comm import ParameterMismatchError
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.fingerprint import SyncMismatchError
from mini_ddp.engine.grad_watch import WrapperBypassedError
from mini_ddp.engine.hooks import CommHookTimeout, GradBucket, gloo_safe
from mini_ddp.engine.model import DataParallelModel
from mini_ddp.engine.multi_device import MultiDeviceDataParallel
from mini_ddp.engine.replicas import ReplicasDifferError
from mini_ddp.errors import (
    CollectiveError,
    CollectiveMismatchError,
    GradChangedLateError,
    GradSyncTimeout,
    MarkedTwiceError,
    MiniDDPError,
    UnfinishedReductionError,
)
from mini_ddp.observe.desync import DesyncDetector, DesyncError, check_in_sync
from mini_ddp.observe.explain import explain
from mini_ddp.observe.tracing import TraceRecorder, trace
from mini_ddp.observe.watchdog import StallError, StallWatchdog
from mini_ddp.training.spawn import RankContext, RanksFailed, run_ranks
from mini_ddp.transport.collectives import collective_hook
from mini_ddp.transport.shm import SharedMemoryAllreduce

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CommHookTimeout",
    "DataParallelConfig",
    "DataParallelModel",
    "DesyncDetector",
    "DesyncError",
    "GradBucket",
    "GradChangedLateError",
    "GradSyncTimeout",
    "MarkedTwiceError",
    "MiniDDPError",
    "MultiDeviceDataParallel",
    "ParameterMismatchError",
    "RankContext",
    "RanksFailed",
    "ReplicasDifferError",
    "SharedMemoryAllreduce",
    "StallError",
    "StallWatchdog",
    "SyncMismatchError",
    "TraceRecorder",
    "UnfinishedReductionError",
    "WrapperBypassedError",
    "attach",
    "check_in_sync",
    "collective_hook",
    "explain",
    "gloo_safe",
    "run_ranks",
    "trace",
]

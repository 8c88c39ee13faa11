"""mini_ddp: a small, readable, pure-Python DistributedDataParallel.

``from mini_ddp import DataParallelModel`` and use it where you used
``torch.nn.parallel.DistributedDataParallel``. The rest of this namespace is the toolbox around
it: tracing and layout explanations, stall and desync detection, teaching collectives, and the
rank harness the tests and tools are built on.

The debugging sits in layers above the engine: :mod:`mini_ddp.watch` (the stall warning, the
flight log) and :mod:`mini_ddp.checks` (the replica check, the debug switch) register with the
engine's observer interface (:mod:`mini_ddp.engine.observer`) when imported here, and every
``DataParallelModel`` built after that wears them.
"""

import mini_ddp.checks  # noqa: F401  (registers the checks every model wears)
import mini_ddp.watch  # noqa: F401  (registers the stall warning and its flight log)
from mini_ddp.attach import attach
from mini_ddp.checks.grad_watch import WrapperBypassedError
from mini_ddp.checks.replicas import DesyncDetector, DesyncError, ReplicasDifferError, check_in_sync
from mini_ddp.engine.comm import ParameterMismatchError
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.hooks import CommHookTimeout, GradBucket, gloo_safe
from mini_ddp.engine.model import DataParallelModel
from mini_ddp.engine.multi_device import MultiDeviceDataParallel
from mini_ddp.errors import (
    CollectiveError,
    CollectiveMismatchError,
    GradChangedLateError,
    GradSyncTimeout,
    MarkedTwiceError,
    MiniDDPError,
    SyncMismatchError,
    UnfinishedReductionError,
)
from mini_ddp.observe.explain import explain
from mini_ddp.observe.tracing import TraceRecorder, trace
from mini_ddp.training.spawn import RankContext, RanksFailed, run_ranks
from mini_ddp.transport.collectives import collective_hook
from mini_ddp.transport.shm import SharedMemoryAllreduce
from mini_ddp.watch.stall import StallError, StallWatchdog

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

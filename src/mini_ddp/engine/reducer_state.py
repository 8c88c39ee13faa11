"""The reducer's state: what it keeps between steps, the views observers read, and the
per-step calls the model makes that do not touch a gradient.

:class:`ReducerState` is the base of :class:`mini_ddp.engine.reducer.Reducer`, which adds the
hooks and the path one gradient follows. The state itself lives in small named objects:
:class:`~mini_ddp.engine.step_state.StepState` (per-step counters),
:class:`~mini_ddp.engine.graph_state.BucketLayout` (buckets and their one-time rebuild) and
:class:`~mini_ddp.engine.unused.UnusedSearch` (unused parameters).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.copy_in import scale_tensor
from mini_ddp.engine.graph_state import BucketLayout
from mini_ddp.engine.hooks import CommHook
from mini_ddp.engine.step_state import StepState
from mini_ddp.engine.unused import UnusedSearch
from mini_ddp.errors import UnfinishedReductionError
from mini_ddp.transport.shm import SharedMemoryAllreduce

OnStall = Callable[[Any, "bucketing.Bucket | None", "BaseException | None"], None]


class ReducerState:
    """One model's reducer state: parameters, configuration, buckets, per-step counters."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 group: dist.ProcessGroup | None, config: DataParallelConfig,
                 transport: SharedMemoryAllreduce | None = None):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.config = config
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.div_factor = self.world_size  # what gradients are averaged over (join may change it)
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.trace: Any = None  # a recorder with .record(kind, **info), or None (tracing off)
        # The stall seam: on_stall(reducer, bucket, error) is called once a wait passes
        # stall_after_s (error None) and when a collective fails. The model installs the default
        # warning there (mini_ddp.engine.stall); mini_ddp.observe.watchdog replaces it.
        self.on_stall: OnStall | None = None
        self.stall_after_s: float | None = None
        # Two ranks on one host: big float buckets live in shared memory and are summed there.
        self.transport = transport
        self.use_transport = transport is not None  # off while Join runs (model.forward)
        # Zero-copy write-back: after the all-reduce, .grad becomes the bucket's view instead of
        # a copy of it (writeback.hand_out). Only on the plain path; the unused-parameter paths
        # and gradient_as_bucket_view keep their own rules, which are DDP's.
        self.zero_copy = (config.zero_copy_write_back and not config.gradient_as_bucket_view
                          and not config.find_unused_parameters and not config.static_graph)
        self.layout = BucketLayout(self.params, self.names, config, group, self.rank, transport)
        self.step = StepState(len(self.params))
        self.unused_search = UnusedSearch(len(self.params), self.params[0].device, config,
                                          group, self.rank)
        self._lock = threading.Lock()

    @property
    def div_factor(self) -> int:
        """What gradients are averaged over: the world size, unless ``join`` changes it."""
        return self._div_factor

    @div_factor.setter
    def div_factor(self, value: int) -> None:
        self._div_factor = value
        self._scale = scale_tensor(value)

    # Read-only views of the state objects, for the observers (explain, watchdog, desync).
    buckets = property(lambda self: self.layout.buckets, doc="The current buckets.")
    locator = property(lambda self: self.layout.locator, doc="Param -> (bucket, position).")
    layout_history = property(lambda self: self.layout.history, doc="Layouts, oldest first.")
    has_rebuilt = property(lambda self: self.layout.has_rebuilt, doc="Rebuilt once already.")
    rebuild_order = property(lambda self: self.layout.rebuild_order, doc="Recorded order.")
    num_iterations = property(lambda self: self.step.num_iterations, doc="Synced forwards.")
    next_bucket = property(lambda self: self.step.next_bucket, doc="Next bucket to launch.")
    ready = property(lambda self: self.step.ready, doc="Parameters ready this iteration.")
    require_finalize = property(lambda self: self.step.require_finalize,
                                doc="Some gradient was marked ready and not yet finished.")

    # ---- per-step calls from the model ----------------------------------------------------
    def prepare_for_forward(self) -> None:
        """Count a synced forward (static graphs behave differently in iteration 1)."""
        self.step.num_iterations += 1

    def local_backward_follows(self) -> None:
        """This forward's backward is local by design (``no_sync()``): no sync expected."""
        self.step.synced_this_step = False

    def ensure_prior_reduction_finished(self) -> None:
        """Raise, naming the parameters, if the last backward left gradients unreduced."""
        if not self.step.require_finalize:
            return
        missing = self.step.missing()
        raise UnfinishedReductionError(self.rank, [self.names[i] for i in missing], missing)

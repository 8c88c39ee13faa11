"""Which parameters a backward used: ``find_unused_parameters`` and the used-map all-reduce.

DDP's ``search_unused_parameters`` and its ``local_used_map`` / ``global_used_map``:

* before a backward, :meth:`UnusedSearch.search` walks the autograd graph from the outputs and
  lists the parameters it cannot reach; the reducer marks them ready, with zeros, at the first
  hook (only with ``find_unused_parameters=True`` and no static graph: :attr:`dynamic`);
* each hook that brings a gradient marks its parameter used (:meth:`mark_used`); once the last
  bucket has launched, the map is summed over ranks (:meth:`launch_map_reduce`), and a
  parameter no rank used keeps its ``.grad`` untouched (:meth:`globally_unused`).

Where the maps live is DDP's choice too: the local map is a host tensor (pinned when the
parameters are on a GPU), so a hook marks a parameter with a plain store — no kernel launch,
no device-to-host sync per parameter. For a GPU model it goes to the device once per backward
(through a fresh pinned copy, so re-zeroing the host map cannot race the asynchronous copy)
and the summed map comes back once, with one blocking copy, when it is first needed.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.errors import naming_collective

# torch's reducer warns once per process, in these words, when the search finds nothing unused.
NOTHING_UNUSED = (
    "find_unused_parameters=True was specified in DDP constructor, but did not find any unused "
    "parameters in the forward pass. This flag results in an extra traversal of the autograd "
    "graph every iteration,  which can adversely affect performance. If your model indeed "
    "never has any unused parameters in the forward pass, consider turning this flag off. Note "
    "that this warning may be a false positive if your model has flow control causing later "
    "iterations to have unused parameters.")
_warned_nothing_unused = False

# The warning is about the user's model, so it points at the user's line (the forward call),
# not at the engine or torch's nn.Module dispatch it runs under.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep
                      for m in (sys.modules["mini_ddp"], torch))


def _user_stacklevel() -> int:
    """``stacklevel`` for a warning issued in :meth:`UnusedSearch.search`: its first caller
    outside mini_ddp and torch."""
    frame, level = sys._getframe(2), 2  # level 1: search() itself
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


Wait = Callable[[torch.futures.Future, Any], Any]
"""The reducer's bounded wait: ``wait(future, bucket_or_None)``."""


def unreachable_params(accumulators: Sequence[Any], outputs: Sequence[torch.Tensor]
                       ) -> list[int]:
    """Indices of the ``accumulators`` (AccumulateGrad nodes) unreachable from ``outputs``."""
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return [i for i, acc in enumerate(accumulators) if acc not in seen]


class UnusedSearch:
    """The used maps of one reducer, and the parameters found unused before a backward."""

    def __init__(self, num_params: int, device: torch.device, config: DataParallelConfig,
                 group: dist.ProcessGroup | None, rank: int):
        self.group, self.rank = group, rank
        self.dynamic = config.find_unused_parameters and not config.static_graph
        """True when every backward searches the graph (DDP's ``dynamic_find_unused``)."""
        self.unused: list[int] = []  # parameters to mark ready at the first hook
        self.device = torch.device(device)
        """Where the map is summed: the parameters' device (the backend's tensors live there)."""
        self.local_used = torch.zeros(num_params, dtype=torch.int32,
                                      pin_memory=self.device.type == "cuda")
        """This rank's map, on the host (``local_used_map_`` in DDP)."""
        self.global_used: torch.Tensor | None = None  # the summed map, on the host
        self._summing: torch.Tensor | None = None  # the map being summed, on self.device
        self._future: torch.futures.Future | None = None
        self._entry: list | None = None  # the flight recorder's entry of the map's all-reduce
        self._flight: Any = None

    def search(self, accumulators: Sequence[Any], outputs: Sequence[torch.Tensor]) -> None:
        """Before a backward: find the parameters ``outputs`` cannot reach (warning once per
        process, as torch, when there are none)."""
        global _warned_nothing_unused
        self.unused = unreachable_params(accumulators, outputs)
        if not self.unused and not _warned_nothing_unused:
            _warned_nothing_unused = True
            warnings.warn(NOTHING_UNUSED, UserWarning, stacklevel=_user_stacklevel())

    def mark_used(self, index: int) -> None:
        """Parameter ``index`` received a gradient in this backward."""
        self.local_used[index] = 1

    def locally_used(self, index: int) -> bool:
        """Has this rank's map marked parameter ``index`` used since the last synced backward?"""
        return bool(self.local_used[index] != 0)

    def launch_map_reduce(self, describe: Callable[[], str], flight: Any = None,
                          step: int = 0) -> None:
        """Start summing the local used map over ranks (after the last bucket's launch);
        ``flight``: the flight recorder that records it (as the map of ``step``)."""
        if self.device.type == "cpu":
            self._summing = self.local_used.clone()
        else:
            # DDP's local_used_map_tmp: a pinned copy for the asynchronous host-to-device copy
            # (stream-ordered before the all-reduce), so finish() may re-zero the host map
            # before the GPU has read it.
            staged = torch.empty_like(self.local_used, pin_memory=self.device.type == "cuda")
            staged.copy_(self.local_used)
            self._summing = staged.to(self.device, non_blocking=True)
        self._entry, self._flight = None, flight
        if flight is not None:
            self._entry = flight.started("used_map_all_reduce", step, self._summing)
        with naming_collective(self.rank, describe):
            work = dist.all_reduce(self._summing, group=self.group, async_op=True)
        self._future = work.get_future()
        self.global_used = None

    def shadow_map_reduce(self, wait: Wait, flight: Any = None, step: int = 0) -> None:
        """The used-map all-reduce of a rank that has joined (zeros, same shape and device),
        waited for through ``wait`` and recorded in ``flight``."""
        zeros = torch.zeros(self.local_used.shape, dtype=self.local_used.dtype,
                            device=self.device)
        entry = None if flight is None else flight.started("used_map_all_reduce", step, zeros)
        wait(dist.all_reduce(zeros, group=self.group, async_op=True).get_future(), None)
        if entry is not None:
            flight.finished(entry)

    def _collect(self, wait: Wait) -> None:
        if self.global_used is None and self._future is not None:
            wait(self._future, None)
            if self._entry is not None:
                self._flight.finished(self._entry)
                self._entry = None
            # One blocking device-to-host copy, as DDP's local_used_map_.copy_(..._dev_).
            self.global_used = self._summing.cpu()

    def globally_unused(self, index: int, wait: Wait) -> bool:
        """True when no rank used parameter ``index`` (waits for the map the first time)."""
        if self.local_used[index] != 0:
            return False
        self._collect(wait)
        return self.global_used is not None and bool(self.global_used[index] == 0)

    def finish(self, wait: Wait) -> None:
        """End of a synced backward: wait for the map; a dynamic search starts afresh."""
        self._collect(wait)
        if self.dynamic:
            self.local_used.zero_()
            self.global_used, self._future = None, None

"""Device-side timestamps: CUDA events on the current stream, read against the host clock.

On a GPU the host returns from every kernel launch, and from every NCCL collective, before
the device has run it; a host clock read at a launch, or in a future's done-callback (NCCL's
futures are done once the collective is enqueued), says when the work was *queued*. torch
DDP's CUDA timer therefore records a CUDA event beside each host timestamp and measures its
durations between events (``elapsed_time``), synchronising them only when the statistics are
read, at the next sampled forward. :class:`DeviceTimer` does the same for the runtime logging
data (:mod:`mini_ddp.engine.torch_api`) and for traces (:mod:`mini_ddp.observe.tracing`),
which also need an event's time on the host's clock: an anchor event, recorded once with the
device idle, pairs a device instant with a host reading, and every later event is placed
``elapsed_time(anchor, event)`` after it.

The event and stream factories are parameters so that the logic is tested on machines
without a GPU, through fake events whose device time the test chooses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from mini_ddp.engine import observer

NS_PER_MS = 1_000_000  # CUDA events measure milliseconds (float); torch reports integer ns


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class DeviceTimer:
    """Events recorded on ``device``'s current stream, as torch DDP's ``CudaTimer`` records."""

    def __init__(self, device: torch.device, new_event: Callable[[], Any] = _cuda_event,
                 current_stream: Callable[[torch.device], Any] | None = None,
                 synchronize: Callable[[torch.device], None] | None = None):
        self.device = device
        self._new_event = new_event
        self._current_stream = current_stream or torch.cuda.current_stream
        self._synchronize = synchronize or torch.cuda.synchronize
        self._anchor: Any = None
        self._anchor_ns = 0

    def stamp(self) -> Any:
        """Record an event on the device's current stream now and return it.

        It completes when the device has run everything queued on that stream before it —
        inside a CUDA future's callback, the collective the future stands for (torch runs
        callbacks on streams that wait for the future's kernels)."""
        event = self._new_event()
        event.record(self._current_stream(self.device))
        return event

    @staticmethod
    def elapsed_ns(start: Any, end: Any) -> int | None:
        """Device time from ``start`` to ``end`` in ns; None when it cannot be measured.

        torch's ``measureDifference``: both events are synchronised (cheap when read at the
        next forward: the previous iteration's work is done) and a negative difference — an
        end not recorded in this iteration — counts as unmeasured."""
        if start is None or end is None:
            return None
        start.synchronize()
        end.synchronize()
        milliseconds = start.elapsed_time(end)
        if milliseconds < 0:
            return None
        return int(milliseconds * NS_PER_MS)

    def anchor(self) -> None:
        """Pair a device instant with a host reading (monotonic ns), once, with the device
        idle: later events are placed on the host clock relative to it."""
        if self._anchor is not None:
            return
        self._synchronize(self.device)
        anchor = self.stamp()
        anchor.synchronize()
        self._anchor, self._anchor_ns = anchor, time.monotonic_ns()

    def host_ns(self, event: Any) -> int:
        """When the device reached ``event``, on the host's monotonic clock (waits for it)."""
        self.anchor()
        event.synchronize()
        return self._anchor_ns + int(self._anchor.elapsed_time(event) * NS_PER_MS)


def timer_for(device: torch.device | None) -> DeviceTimer | None:
    """A :class:`DeviceTimer` for a CUDA ``device``; None for the CPU (host time is exact)."""
    if device is None or device.type != "cuda":
        return None
    return DeviceTimer(device)


observer.register_timer(timer_for)  # the runtime logging data's CUDA timestamps

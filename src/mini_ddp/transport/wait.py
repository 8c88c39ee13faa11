"""The one bounded wait: block until a collective has finished or a deadline passes.

Every place that waits for a collective with a limit (the reducer's end-of-backward wait, the
join's shadow backward, :func:`mini_ddp.engine.hooks.gloo_safe`, the forward's buffer
broadcast when ``sync_timeout_s`` was set) goes through :func:`wait_done`, so "how long, and
who hears about a slow one" is decided in one place. It only waits: what a timeout or a failure
*means* is for the caller to say (each raises its own error, naming its bucket or hook).

"Finished" has two layers. On the host, a future is done when its backend says so: for Gloo
that is when the data has arrived. NCCL's futures (and those of any CUDA-aware backend) are
marked done as soon as the collective is *enqueued* on the GPU, so their done flag says
nothing about a slow or stuck peer. :func:`device_probe` therefore adds a second layer for
results that live on a GPU: the work's own ``is_completed()`` (NCCL queries the collective's
end event) or, for a bare future, a CUDA event recorded on a side stream that waits for the
future — the same stream ordering torch's ``Future.wait()`` gives the caller's stream, read
without blocking. CPU results have no second layer: the wait is exactly the host one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["device_probe", "wait_done"]

POLL_START_S = 20e-6
"""First pause between two polls of a GPU collective's completion (doubled up to the next)."""
POLL_MAX_S = 1e-3
"""Longest pause between polls: a finished collective is noticed within about a millisecond."""

Probe = Callable[[], bool]
"""Answers "has the collective finished on its device?" without blocking."""


def wait_done(future: torch._C.Future, timeout_s: float | None, *,
              stall_after_s: float | None = None,
              on_slow: Callable[[], None] | None = None,
              work: Any = None) -> bool:
    """Wait until the collective behind ``future`` has finished; False if ``timeout_s`` ran out.

    Finished means: the future completed (with a value or an error) and, when its result
    lives on a GPU, the GPU has run the collective (:func:`device_probe`; ``work`` is the
    ``dist.Work`` the future came from, when the caller has it). ``timeout_s`` None waits
    forever. When ``on_slow`` is given with ``stall_after_s``, it is called once, after
    ``stall_after_s`` seconds without an answer; it may raise (the wait then ends with its
    exception) or return, and the wait goes on. ``timeout_s`` counts from the start of the
    wait, the report included: a stall warning (on by default) must not stretch a deadline the
    user set, and a deadline shorter than ``stall_after_s`` comes first.
    The future's value or error is not read here: call ``future.wait()`` afterwards for that.
    """
    start = time.monotonic()
    slow_at = None
    if on_slow is not None and stall_after_s is not None and (
            timeout_s is None or stall_after_s < timeout_s):
        slow_at = start + stall_after_s
    if not future.done():
        # add_done_callback fires on errors too, and at once if the future completed meanwhile.
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if slow_at is not None and not done.wait(stall_after_s):
            slow_at = None
            on_slow()
        if not done.wait(_left(start, timeout_s)):
            return False
    probe = device_probe(future, work)
    return probe is None or _poll(probe, start, timeout_s, slow_at, on_slow)


def _left(start: float, timeout_s: float | None) -> float | None:
    return None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))


def _poll(probe: Probe, start: float, timeout_s: float | None, slow_at: float | None,
          on_slow: Callable[[], None] | None) -> bool:
    """Poll ``probe`` with a growing pause until it says done, the deadline, or the stall."""
    pause = POLL_START_S
    while not probe():
        now = time.monotonic()
        if slow_at is not None and now >= slow_at:
            slow_at = None
            on_slow()
            continue
        if timeout_s is not None and now - start >= timeout_s:
            return probe()
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    return True


def device_probe(future: torch._C.Future, work: Any = None) -> Probe | None:
    """How to tell that a *host-done* ``future``'s collective has also finished on its GPU.

    None when there is nothing more to wait for: the future failed (its error is the
    caller's to read), or, without ``work``, its result is on the CPU (Gloo). ``work`` (a
    ``dist.Work``) is asked directly: NCCL's ``is_completed()`` queries the collective's end
    event (Gloo's says True once its future is done). Without it, a CUDA event is recorded on a side stream of each device the result
    lives on, after that stream was made to wait for the future (``Future.wait()`` orders the
    *current* streams, never blocking the host) — it fires when the collective has run.
    """
    try:
        value = future.value()
    except Exception:  # noqa: BLE001 - a failed future: the caller's future.wait() raises it
        return None
    if work is not None:
        return work.is_completed
    devices = _cuda_devices(value)
    if not devices:
        return None
    events = []
    with contextlib.ExitStack() as current:
        for device in devices:
            if device not in _STREAMS:
                _STREAMS[device] = torch.cuda.Stream(device=device)
            current.enter_context(torch.cuda.stream(_STREAMS[device]))
        future.wait()  # stream-ordered: the side streams now wait for the collective
        for device in devices:
            event = torch.cuda.Event()
            event.record(_STREAMS[device])
            events.append(event)
    return lambda: all(event.query() for event in events)


def _cuda_devices(value: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in a future's value (a tensor, or lists/tuples/dicts)."""
    found: dict[torch.device, None] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                found[item.device] = None
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return list(found)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device, reused


"""The one bounded wait: block on a future until it completes or a deadline passes.

Every place that waits for a collective with a limit (the reducer's end-of-backward wait, the
join's shadow backward, :func:`mini_ddp.engine.gloo_safe.gloo_safe`) goes through
:func:`wait_done`, so "how long, and who hears about a slow one" is decided in one place.
It only waits: what a timeout or a failure *means* is for the caller to say (each raises its
own error, naming its bucket or hook).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

__all__ = ["wait_done"]


def wait_done(future: torch._C.Future, timeout_s: float | None, *,
              stall_after_s: float | None = None,
              on_slow: Callable[[], None] | None = None) -> bool:
    """Wait until ``future`` completes (with a value or an error); False if ``timeout_s`` ran out.

    ``timeout_s`` None waits forever. When ``on_slow`` is given with ``stall_after_s``, it is
    called once, after ``stall_after_s`` seconds without an answer; it may raise (the wait then
    ends with its exception) or return, and the wait goes on. ``timeout_s`` counts from the
    start of the wait, the report included: a stall warning (on by default) must not stretch
    a deadline the user set, and a deadline shorter than ``stall_after_s`` comes first.
    The future's value or error is not read here: call ``future.wait()`` afterwards for that.
    """
    if future.done():
        return True
    # add_done_callback fires on errors too, and at once if the future completed meanwhile.
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    start = time.monotonic()
    if on_slow is not None and stall_after_s is not None and (
            timeout_s is None or stall_after_s < timeout_s) and not done.wait(stall_after_s):
        on_slow()
    return done.wait(None if timeout_s is None
                     else max(0.0, timeout_s - (time.monotonic() - start)))

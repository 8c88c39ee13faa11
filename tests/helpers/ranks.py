"""The tests' way to run a function on N local ranks: :func:`mini_ddp.training.spawn.run_ranks`
with its deadline scaled by the session's slowdown (tests/helpers/deadlines.py).

``timeout_s`` is the harness's hang bound (ranks still running then are reported with their
stacks), so it is scaled; so is the collective timeout it defaults to. An explicit
``collective_timeout_s`` is passed as given: where a test expects a collective to time out, that
number is what it tests; where it only bounds a hang, the call site scales it with
:func:`helpers.deadlines.hang_bound`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helpers.deadlines import hang_bound

from mini_ddp.training import spawn
from mini_ddp.training.spawn import RankContext, RanksFailed

__all__ = ["RankContext", "RanksFailed", "run_ranks"]


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), *,
              timeout_s: float = 120.0, collective_timeout_s: float | None = None,
              **kwargs: Any) -> list[Any]:
    """:func:`mini_ddp.training.spawn.run_ranks` with ``timeout_s`` (and the collective timeout
    when it defaults to it) scaled by :func:`helpers.deadlines.slowdown`."""
    deadline = hang_bound(timeout_s)
    return spawn.run_ranks(fn, world_size, args, timeout_s=deadline,
                           collective_timeout_s=collective_timeout_s if
                           collective_timeout_s is not None else deadline, **kwargs)

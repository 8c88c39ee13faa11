"""Waiting for a bucket's collective: the deadline, the stall report, and naming a failure.

Step 4 of :mod:`mini_ddp.engine.reducer` blocks here and only here. The wait itself is
:func:`mini_ddp.transport.wait.wait_done` — which, for a result on a GPU, waits until the GPU
has run the collective (NCCL's futures are done at launch), so the deadline and the stall
report mean the same on NCCL as on Gloo; this adds what a gradient wait means: a stall
observer is told once the wait is slow and again when the collective fails (it may raise), a
timeout raises the caller's error, and a failed collective is re-raised naming its bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mini_ddp.errors import CollectiveError, MiniDDPError, naming_collective
from mini_ddp.transport.shm import ShmError
from mini_ddp.transport.wait import wait_done


def wait_for_collective(future: torch.futures.Future, *, rank: int, timeout_s: float | None,
                        describe: Callable[[], str], names_a_bucket: bool,
                        timed_out: Callable[[], Exception],
                        on_stall: Callable[[BaseException | None], None] | None = None,
                        stall_after_s: float | None = None) -> Any:
    """``future.wait()``, bounded by ``timeout_s`` (then ``raise timed_out()``).

    ``describe()`` names what is awaited in errors. ``on_stall(None)`` runs once after
    ``stall_after_s`` without an answer, ``on_stall(error)`` when the collective failed; either
    may raise, else the wait goes on. ``names_a_bucket``: re-raise a transport's own error as a
    :class:`~mini_ddp.errors.CollectiveError` naming the bucket.
    """
    slow = None if on_stall is None else lambda: on_stall(None)
    if not wait_done(future, timeout_s, stall_after_s=stall_after_s, on_slow=slow):
        raise timed_out()
    if on_stall is not None:
        try:
            future.wait()
        except Exception as error:  # noqa: BLE001 - raised again by the wait below
            on_stall(error)  # a dead peer: the observer names it from its marks
    # A dead peer fails the collective (Gloo notices a closed socket at once): name it.
    with naming_collective(rank, describe):
        try:
            return future.wait()
        except MiniDDPError as err:
            if not names_a_bucket or not isinstance(err, (CollectiveError, ShmError)):
                raise
            # The shared-memory transport's own error names a slot: name the bucket, with
            # the backend's words (a CollectiveError of the transport keeps them as cause).
            cause = err.__cause__ if isinstance(err, CollectiveError) else None
            raise CollectiveError(rank, describe(), cause or err) from err

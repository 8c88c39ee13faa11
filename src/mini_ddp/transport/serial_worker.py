"""One daemon thread that runs jobs strictly in submission order, each with a future.

The shared-memory transport's engine room: its collectives must run in call order, off the
caller's thread (an autograd hook must not block), and once one fails every later job must
fail at once rather than talk to a peer that is out of step.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

_Job = tuple[Callable[[], Any], torch.futures.Future]


class SerialWorker:
    """Runs submitted jobs in order on one daemon thread named ``name``.

    A job that raises sets its future's error; unless ``keeps_working(error)`` says the error
    is harmless, the worker is then *failed*: every later job's future gets
    ``failed_error(first_error)`` without running.
    """

    def __init__(self, name: str, keeps_working: Callable[[BaseException], bool],
                 failed_error: Callable[[BaseException], Exception]):
        self._keeps_working, self._failed_error = keeps_working, failed_error
        self._failure: BaseException | None = None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Daemon: a process that exits without stop() does not wait for it.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``job``; its future gets its return value or its error."""
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((job, fut))
        return fut

    def on_worker_thread(self) -> bool:
        """True when called from the worker itself (a job, or a future callback it runs)."""
        return threading.current_thread() is self._thread

    def stop(self, wait: bool = True) -> None:
        """Run what is queued, then end the thread; ``wait`` joins it (never from itself)."""
        self._queue.put(None)
        if wait and not self.on_worker_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fut = item
            del item
            value: Any = None
            error: BaseException | None = None
            if self._failure is not None:
                error = self._failed_error(self._failure)
            else:
                try:
                    value = job()
                except BaseException as err:  # noqa: BLE001 - handed to the caller's future
                    error = err
                    if err.__traceback__ is not None:
                        # The frames' locals hold buffers: do not keep them alive via the error.
                        traceback.clear_frames(err.__traceback__)
                    if not self._keeps_working(err):
                        self._failure = err
            # Drop the job's references (buffers) before the caller can wake up.
            del job
            if error is None:
                fut.set_result(value)
            else:
                fut.set_exception(error if isinstance(error, Exception)
                                  else self._failed_error(error))
            del fut, value, error

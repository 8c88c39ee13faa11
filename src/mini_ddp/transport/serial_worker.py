"""One daemon thread that runs jobs strictly in submission order, each with a future.

The shared-memory transport's engine room: its collectives must run in call order, off the
caller's thread (an autograd hook must not block), and once one fails every later job must
fail at once rather than talk to a peer that is out of step. A caller that would only wait
for its job anyway (an allocation) runs it on its own thread when nothing is queued or
running: the same order, without a thread switch each way.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

_Job = tuple[Callable[[], Any], torch.futures.Future, bool]


class SerialWorker:
    """Runs submitted jobs in order on one daemon thread named ``name``.

    A job that raises sets its future's error; unless ``keeps_working(error)`` says the error
    is harmless, the worker is then *failed*: every later job's future gets
    ``failed_error(first_error)`` without running — except a job submitted with ``always``
    (bookkeeping that talks to no peer). The thread starts with the first job submitted (a
    worker whose jobs all ran on their callers' threads never starts one).
    """

    def __init__(self, name: str, keeps_working: Callable[[BaseException], bool],
                 failed_error: Callable[[BaseException], Exception]):
        self._keeps_working, self._failed_error = keeps_working, failed_error
        self._failure: BaseException | None = None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Jobs submitted and not finished, and the lock a job runs under (on either thread):
        # together they keep call() behind every job submitted before it, and ahead of every
        # one submitted after.
        self._lock = threading.Lock()
        self._pending = 0
        self._running = threading.Lock()
        # Daemon: a process that exits without stop() does not wait for it.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    @property
    def failed(self) -> bool:
        """Whether a job failed in a way that fails every later one."""
        return self._failure is not None

    def submit(self, job: Callable[[], Any], always: bool = False) -> torch.futures.Future:
        """Queue ``job``; its future gets its return value or its error. ``always``: run it
        even once the worker has failed."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._pending += 1
            if not self._started:
                self._started = True
                self._thread.start()
        self._queue.put((job, fut, always))
        return fut

    def soon(self, job: Callable[[], Any], always: bool = False) -> torch.futures.Future:
        """Run ``job`` after every job submitted before it, ahead of every job submitted
        after: on this thread, at once, when none is queued or running (the future it returns
        is then done), else queued for the worker like :meth:`submit`."""
        with self._lock:
            idle = self._pending == 0
            if idle:  # free: the worker holds it only while a job is pending
                self._running.acquire()
        if not idle:
            return self.submit(job, always)
        try:
            value, error = self._execute(job, always)
        finally:
            self._running.release()
        fut: torch.futures.Future = torch.futures.Future()
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)
        return fut

    def call(self, job: Callable[[], Any]) -> Any:
        """:meth:`soon`, waited for: ``job``'s value, or its error raised."""
        return self.soon(job).wait()

    def on_worker_thread(self) -> bool:
        """True when called from the worker itself (a job, or a future callback it runs)."""
        return threading.current_thread() is self._thread

    def stop(self, wait: bool = True) -> None:
        """Run what is queued, then end the thread; ``wait`` joins it (never from itself)."""
        with self._lock:
            started = self._started
        if not started:
            return
        self._queue.put(None)
        if wait and not self.on_worker_thread():
            self._thread.join()

    def _execute(self, job: Callable[[], Any], always: bool = False
                 ) -> tuple[Any, Exception | None]:
        """Run ``job`` (the caller holds ``_running``): its value, or the error to hand on."""
        if self._failure is not None and not always:
            return None, self._failed_error(self._failure)
        try:
            return job(), None
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            if err.__traceback__ is not None:
                # The frames' locals hold buffers: do not keep them alive via the error.
                traceback.clear_frames(err.__traceback__)
            if not self._keeps_working(err):
                self._failure = err
            return None, err if isinstance(err, Exception) else self._failed_error(err)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fut, always = item
            del item
            with self._running:
                value, error = self._execute(job, always)
            # Drop the job's references (buffers) before the caller can wake up.
            del job
            with self._lock:
                self._pending -= 1
            if error is None:
                fut.set_result(value)
            else:
                fut.set_exception(error)
            del fut, value, error

"""Where is a rank? Its Python stack, asked for through the process group's store.

When a stall warning names a late rank, the waiting rank asks that rank *where* it is, the way
``py-spy dump`` would, but without logging into its host: every rank of a model runs one small
daemon thread, a :class:`StackResponder`, that blocks in ``store.wait`` on its own request key
(``ask/<rank>``). :func:`ask_stacks` sets that key; the responder wakes, formats the Python stacks
of the threads that matter — the main thread, and any other thread inside mini_ddp's gradient
path (the thread running backward, when it is not the main one) — with :mod:`traceback`, and
writes them under ``stack/<rank>``. It works across hosts and on every backend, because the
only channel is the store every rank already shares.

Cost on the happy path: none per step. The responder's one ``store.wait`` sits on a connection
of its own (a TCPStore client serialises its requests, so a wait on the shared connection would
block every other store call of the process); the thread holds no lock and never runs until
asked. Asking costs, per late rank: one ``add`` and one ``set`` from each asker, the responder's
``get``/``delete``/``add``/``set`` (requests that arrive together are answered once), and the
asker's polls of the answer key every 50 ms until it comes (usually within one poll) or
``answer_s`` passes. See docs/reliability.md for how that scales.

A rank whose threads cannot run Python — stuck in native code that holds the GIL, or dead —
cannot answer; :func:`ask_stacks` then says so ("did not answer within N s").
"""

from __future__ import annotations

import atexit
import datetime
import json
import linecache
import logging
import os
import queue
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed import PrefixStore

from mini_ddp.errors import UNEVEN_FIX
from mini_ddp.watch.bounded_store import (
    STORE_CALL_S,
    StoreUnanswered,
    bounded_store_call,
    default_store,
)

logger = logging.getLogger("mini_ddp")

ANSWER_S = 5.0
"""How long an asker waits for a rank's stack before naming it as one that did not answer."""
TIMEOUT_ANSWER_S = 1.0
"""The same, for the ask of a ``GradSyncTimeout``: the deadline has already passed, and a rank
whose responder runs answers within a poll or two."""
STOP_S = 0.5
"""How long stopping a responder waits for the store to take the wake-up (at exit, or when the
model goes): a frozen store must not hold up either."""
MAX_FRAMES = 14
"""Innermost frames kept per thread (the outer ones are the launcher's and the harness's)."""
EVAL_FIX = ("to evaluate on one rank, call model.module(x) under torch.no_grad() (the wrapper's "
            "forward is a collective step: every rank must run it); or evaluate on every rank")
"""The fix for an extra forward through the wrapper on one rank, in every message that names one."""
# The buffer broadcast of a forward through the wrapper: DataParallelModel's, torch DDP's.
_BROADCASTS = {("sync_buffers", str(Path("mini_ddp", "engine", "model.py"))),
               ("_sync_buffers", str(Path("torch", "nn", "parallel", "distributed.py")))}
_POLL_S = 0.05
_SNAPSHOT_FILES = tuple(str(Path(m.__file__)) for m in (traceback, linecache))
_WAIT = datetime.timedelta(hours=12)  # the responder's store.wait: re-armed when it expires
_ENGINE_DIR = str(Path(__file__).resolve().parent)
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
                      | {str(Path(__file__).resolve().parents[1])})


def _in_library(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) or filename.startswith("<")


def thread_stacks(skip: int | None = None) -> list[dict[str, Any]]:
    """This process's stacks worth showing: the main thread, and every other thread with a
    frame in mini_ddp's engine (where gradient hooks and the end-of-backward wait run).

    Each entry: ``{"thread", "main", "frames": [[file, line, function, source], ...],
    "where": "function (file:line)"}`` — frames oldest first (as a Python traceback), at most
    :data:`MAX_FRAMES`; ``where`` is the innermost frame outside torch, mini_ddp and the
    standard library (the user's line), else the innermost frame. ``skip``: a thread ident
    to leave out (the responder's own).
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    found = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        # Without the frames of a stack being taken (a dump in progress on that thread):
        # they would push the frames that say where the rank is out of the MAX_FRAMES kept.
        summary = [f for f in traceback.extract_stack(frame)
                   if not f.filename.endswith(_SNAPSHOT_FILES)]
        if ident != main and not any(f.filename.startswith(_ENGINE_DIR) for f in summary):
            continue
        # From the first frame of the user's own (the launcher's bootstrap before it is noise).
        first = next((i for i, f in enumerate(summary) if not _in_library(f.filename)), 0)
        frames = [[f.filename, f.lineno, f.name, (f.line or "").strip()]
                  for f in summary[first:][-MAX_FRAMES:]]
        user = next((f for f in reversed(summary) if not _in_library(f.filename)),
                    summary[-1] if summary else None)
        found.append({"thread": names.get(ident, str(ident)), "main": ident == main,
                      "frames": frames,
                      "where": "" if user is None
                      else f"{user.name} ({user.filename}:{user.lineno})"})
    found.sort(key=lambda t: not t["main"])
    return found


def _short(path: str) -> str:
    """``path`` relative to the current directory when it lies below it (as pytest shows)."""
    here = os.getcwd() + os.sep
    return path[len(here):] if path.startswith(here) else path


def format_stacks(threads: list[dict[str, Any]], indent: str = "    ") -> str:
    """The text of :func:`thread_stacks`' result, most recent call last, one line a frame."""
    lines = []
    for t in threads:
        where = t["where"]
        if where.endswith(")") and " (" in where:
            name, _, place = where[:-1].partition(" (")
            where = f"{name} ({_short(place)})"
        lines.append(f"{indent}thread {t['thread']!r}{' (main)' if t['main'] else ''}, "
                     f"in {where}:")
        for filename, line, function, source in t["frames"]:
            lines.append(f"{indent}  {_short(filename)}:{line} in {function}"
                         + (f": {source}" if source else ""))
    return "\n".join(lines)


class StackResponder:
    """One rank's answering thread; ``stop()`` ends it (also called when the model goes).

    ``store`` is the prefixed store the askers use; the responder waits on a clone of it (its
    own connection). ``on_ask(stacks, request)`` runs in the thread after each answer — the
    flight recorder dumps there — and is held weakly, so the thread keeps nothing alive.
    ``step_of()`` gives the rank's step count, sent with the stacks (a late rank's step, which
    an asker compares with its own: uneven inputs).

    The thread opens its connections itself: each clone is a connect and handshake with the
    store's server (milliseconds, more on a loaded host, now and then seconds), which the
    model's constructor then does not wait for; with ``prefix`` (``store`` is the default
    store under it) it takes them from the process's pool instead (:class:`_Connections`).
    Nor does the constructor wait for the thread to start: ``Thread.start`` returns only
    once the new thread has run, a scheduler's delay on a loaded host, so one starter thread per
    process starts it (:data:`_STARTER`). A store that cannot open a second connection (a
    ``HashStore``) leaves the thread ended at once: nobody can ask this rank.
    """

    def __init__(self, store: Any, rank: int,
                 on_ask: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
                 step_of: Callable[[], int | None] | None = None, prefix: str | None = None):
        self.rank = rank
        self.pid = os.getpid()  # the process whose thread this is (see stop)
        self._stop = threading.Event()
        # stop() wakes the thread through a connection of its own (the thread opens it, into
        # this box): by then the process group, and the connection it shares, may be destroyed
        # (see _join_responders_at_exit).
        self._waker: list[Any] = []
        self._connected = threading.Event()  # the thread has its connections, or has none
        callback = None if on_ask is None else weakref.WeakMethod(on_ask) \
            if hasattr(on_ask, "__self__") else (lambda: on_ask)
        self._thread = threading.Thread(
            target=_connect_and_serve,
            args=(_Connector(store, prefix), rank, self._stop, callback, step_of, self._waker,
                  self._connected),
            name=f"mini_ddp-stack-responder-rank{rank}", daemon=True)
        self._launched = threading.Event()  # the starter has started it (or could not)
        _STARTER.start(self._thread, self._launched, self._connected)

    @property
    def thread(self) -> threading.Thread:
        """The answering thread, once started (waits up to :data:`STOP_S` for the starter)."""
        self._launched.wait(STOP_S)
        return self._thread

    def stop(self) -> None:
        """End the thread: set the stop flag, then wake its wait (idempotent, never raises).

        Only in the process that started it: a child forked from the rank has no such thread,
        and its exit (or its copy of the model going) must not wake and end the parent's
        through the store (nor write on the store connection it shares with the parent)."""
        if self._stop.is_set() or os.getpid() != self.pid:
            return
        self._stop.set()
        # Not connected yet: the thread sees the flag before it first waits, and ends.
        if not self._connected.wait(STOP_S) or not self._waker:
            return
        try:  # bounded: a frozen store must not hold up the model's deletion, or the exit
            bounded_store_call(self._waker[0], lambda s: s.set(f"ask/{self.rank}",
                                                               json.dumps({"stop": True})),
                               STOP_S, "waking the stack responder")
        except StoreUnanswered:  # the store is gone or frozen: the thread is a daemon
            pass


_RESPONDERS: weakref.WeakSet[StackResponder] = weakref.WeakSet()
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_LAST_SERVE_END = [float("-inf")]  # monotonic time a responder thread last left _serve
_THREAD_SETTLE_S = 0.25


class _Starter:
    """Starts responder threads in turn on a daemon thread of its own (itself started with the
    first responder of the process), so that no model's constructor waits for a new thread to
    be scheduled."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[threading.Thread, threading.Event,
                                             threading.Event]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, thread: threading.Thread, launched: threading.Event,
              connected: threading.Event) -> None:
        """Start ``thread`` soon; ``launched`` is set once it has started (or failed to, when
        ``connected`` is set too: no thread will connect)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mini_ddp-thread-starter")
                self._thread.start()
        self._queue.put((thread, launched, connected))

    def forget(self) -> None:
        """In a forked child: the parent's starter thread is not there."""
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread = None

    def _run(self) -> None:
        while True:
            thread, launched, connected = self._queue.get()
            try:
                thread.start()
                _THREADS.add(thread)
            except RuntimeError as error:  # no new thread (e.g. the interpreter is ending)
                logger.debug("mini_ddp: no stack responder thread: %s", error)
                connected.set()
            finally:
                launched.set()
            del thread, launched, connected


_STARTER = _Starter()


def _after_fork_in_child() -> None:
    # A forked child has none of the parent's threads: nothing of them to stop or join.
    _RESPONDERS.clear()
    _THREADS.clear()
    _STARTER.forget()
    _CONNECTIONS.forget()
    _LAST_SERVE_END[0] = float("-inf")


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _join_responders_at_exit() -> None:
    """Stop every live responder and join every responder thread before the interpreter
    finalises.

    A daemon thread still inside the store's C++ wait when Python shuts down is ended by
    forced unwinding through C++ frames on its way back to the GIL, and the process aborts
    ("terminate called without an active exception") after the script has finished. A
    responder stopped earlier (its model collected) may still be on its way out: it is
    joined too.
    """
    responders = list(_RESPONDERS)
    for responder in responders:
        responder.stop()
    for responder in responders:  # one still queued at the starter is joined below too
        responder._launched.wait(STOP_S)
    for thread in list(_THREADS):
        thread.join(timeout=2.0)
    # A joined thread has left Python, not yet its OS thread: C++ thread-local state (the
    # store client's) is torn down after that. Exiting meanwhile runs static destructors under
    # it and aborts the same way; a responder that ended moments ago gets that moment.
    settle = _THREAD_SETTLE_S - (time.monotonic() - _LAST_SERVE_END[0])
    if settle > 0:
        time.sleep(settle)


def start_responder(store: Any, rank: int, owner: Any,
                    on_ask: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None,
                    prefix: str | None = None) -> StackResponder | None:
    """A :class:`StackResponder` that stops when ``owner`` is garbage-collected (None when no
    thread could be started; one whose store cannot give it a connection of its own ends at
    once: then nobody can ask this rank). Its answers carry ``owner.step.num_iterations``
    (a reducer's step count) when the owner has one. ``prefix``: ``store`` is the default
    group's store under that prefix (:func:`~mini_ddp.watch.bounded_store.default_store`); the
    responder's connections then come from the process's pool (:class:`_Connections`) instead
    of two new clones of ``store``."""
    ref = weakref.ref(owner)

    def step_of() -> int | None:
        step = getattr(ref(), "step", None)
        return getattr(step, "num_iterations", None)

    try:
        responder = StackResponder(store, rank, on_ask, step_of, prefix)
    except Exception as error:  # noqa: BLE001 - no thread: stacks just go unasked
        logger.debug("mini_ddp: no stack responder on rank %d: %s", rank, error)
        return None
    weakref.finalize(owner, responder.stop).atexit = False  # exit: _join_responders_at_exit
    _RESPONDERS.add(responder)
    return responder


class _Connections:
    """This process's idle connections to the default group's store, for the responders.

    Each new connection is a connect and handshake with the store's server, and torch's
    TCPStore, now and then, takes about 5 s over one while other clients' requests can wait
    as long (``scripts/store_connect_times.py``; torch 2.11 and 2.14, both backends). Two new
    connections per model would freeze the store every few models a process builds — long
    enough for the cross-rank checks' bounded calls to give up. So a responder that was
    stopped hands its connection back for the next model's, and one wake-up connection serves
    every responder of the process (it only sets keys)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: Any = None  # the default store the connections below are clones of
        self._idle: list[Any] = []
        self._waker: Any = None

    def _current(self, store: Any) -> None:
        if self._store is not store:  # a new default group: the old connections are its
            self._store, self._idle, self._waker = store, [], None

    def take(self, store: Any) -> Any:
        """An idle clone of ``store`` (the default group's), or a new one."""
        with self._lock:
            self._current(store)
            if self._idle:
                return self._idle.pop()
        return store.clone()

    def give(self, store: Any, connection: Any) -> None:
        """``connection`` (taken for ``store``) is idle again: kept for the next responder
        when none is (a model dropped and the next one built is the pattern this serves),
        else closed (dropped), so the process holds at most one idle connection."""
        with self._lock:
            if self._store is store and not self._idle:
                self._idle.append(connection)

    def waker(self, store: Any) -> Any:
        """The process's one wake-up connection to ``store``'s server."""
        with self._lock:
            self._current(store)
            if self._waker is None:
                self._waker = store.clone()
            return self._waker

    def forget(self) -> None:
        """In a forked child: the parent's connections are not this process's to use."""
        self._lock = threading.Lock()
        self._store, self._idle, self._waker = None, [], None


_CONNECTIONS = _Connections()


class _Connector:
    """How a responder gets its connections: under ``prefix`` from the process's pool of
    default-store connections, or (a store of the caller's own) as clones of ``store``."""

    def __init__(self, store: Any, prefix: str | None) -> None:
        self.store, self.prefix = store, prefix
        self._default: Any = None  # the default store the pooled connection was taken for
        self._own: Any = None

    def open(self) -> tuple[Any, Any]:
        """The responder's own connection and the wake-up one (each under the prefix)."""
        if self.prefix is None:
            return self.store.clone(), self.store.clone()
        self._default = default_store()
        self._own = _CONNECTIONS.take(self._default)
        return (PrefixStore(self.prefix, self._own),
                PrefixStore(self.prefix, _CONNECTIONS.waker(self._default)))

    def close(self, reusable: bool) -> None:
        """The responder ended; ``reusable``: its connection is idle (it was stopped)."""
        if self.prefix is not None and reusable and self._default is not None:
            _CONNECTIONS.give(self._default, self._own)


def _connect_and_serve(connector: _Connector, rank: int, stop: threading.Event, callback: Any,
                       step_of: Any, waker: list[Any], connected: threading.Event) -> None:
    try:
        own, wake = connector.open()
        waker.append(wake)
    except Exception as error:  # noqa: BLE001 - e.g. a HashStore: stacks just go unasked
        logger.debug("mini_ddp: no stack responder on rank %d: %s", rank, error)
        return
    finally:
        connected.set()
    stopped = False
    try:
        stopped = _serve(own, rank, stop, callback, step_of)
    finally:
        connector.close(reusable=stopped)


def _serve(store: Any, rank: int, stop: threading.Event, callback: Any, step_of: Any) -> bool:
    """Answer requests until stopped (True) or the store fails (False)."""
    try:
        return _serve_requests(store, rank, stop, callback, step_of)
    finally:
        _LAST_SERVE_END[0] = time.monotonic()


def _serve_requests(store: Any, rank: int, stop: threading.Event, callback: Any,
                    step_of: Any) -> bool:
    ask, count, answer = f"ask/{rank}", f"asked/{rank}", f"stack/{rank}"
    reusable = True  # the connection is the one the responder was given, and idle when it ends
    while not stop.is_set():
        started = time.monotonic()
        try:
            store.wait([ask], _WAIT)
        except Exception:  # noqa: BLE001 - expired (re-arm) or the store is gone (end)
            if stop.is_set() or time.monotonic() - started < 60:
                return False  # not the long wait expiring: the store failed
            try:
                store = store.clone()  # a fresh connection: a timed-out one may be confused
                reusable = False
            except Exception:  # noqa: BLE001
                return False
            continue
        try:
            request = json.loads(store.get(ask))
            store.delete_key(ask)
            if stop.is_set() or request.get("stop"):
                return reusable
            generation = store.add(count, 0)  # every request counted so far gets this answer
            stacks = thread_stacks(skip=threading.get_ident())
            store.set(answer, json.dumps({"generation": generation, "time": time.time(),
                                          "asked_at": request.get("time"), "stacks": stacks,
                                          "step": None if step_of is None else step_of()}))
        except Exception:  # noqa: BLE001 - the store went away while answering
            return False
        on_ask = None if callback is None else callback()
        if on_ask is not None:
            try:
                on_ask(stacks, request)
            except Exception:  # noqa: BLE001 - a failed dump must not end the responder
                logger.exception("mini_ddp: rank %d could not write its flight recorder dump",
                                 rank)
    return reusable


def ask_stacks(store: Any, ranks: list[int], answer_s: float = ANSWER_S,
               asked_by: int | None = None, why: str = "",
               call_s: float = STORE_CALL_S) -> dict[int, dict[str, Any]]:
    """Ask each of ``ranks`` for its stacks; wait up to ``answer_s`` for all of them.

    Returns ``{rank: answer}``: an answer is ``{"answered": True, "stacks": [...], "time",
    "step"}`` (``step``: the rank's step count, None where its responder has none), or
    ``{"answered": False, "waited_s": answer_s}`` for a rank that did not answer in time. Every
    store call runs off this thread with a deadline of ``call_s``
    (:func:`~mini_ddp.watch.bounded_store.bounded_store_call`): a store that does not answer
    raises :class:`~mini_ddp.watch.bounded_store.StoreUnanswered`, never blocks.
    """
    now = time.time()
    request = json.dumps({"from": asked_by, "time": now, "why": why, "answer_s": answer_s})

    def send(s: Any) -> dict[int, int]:
        generations = {}
        for rank in ranks:
            generations[rank] = s.add(f"asked/{rank}", 1)
            s.set(f"ask/{rank}", request)
        return generations

    def replies(s: Any) -> dict[int, dict[str, Any]]:
        return {rank: json.loads(s.get(f"stack/{rank}")) for rank in ranks
                if rank not in found and s.check([f"stack/{rank}"])}

    generations = bounded_store_call(store, send, call_s, "asking for stacks")
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + answer_s
    while True:
        for rank, reply in bounded_store_call(store, replies, call_s, "reading stacks").items():
            if reply["generation"] >= generations[rank]:
                found[rank] = {"answered": True, "stacks": reply["stacks"],
                               "time": reply["time"], "step": reply.get("step")}
        if len(found) == len(ranks) or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    for rank in ranks:
        found.setdefault(rank, {"answered": False, "waited_s": answer_s})
    return found


def in_buffer_broadcast(answer: dict[str, Any]) -> str | None:
    """The user's line (``file:line in function``) when a rank's answer shows its main thread
    inside the buffer broadcast of a forward through the wrapper (None: it is not)."""
    if not answer.get("answered"):
        return None
    for thread in answer["stacks"]:
        if thread["main"] and any(function == name and filename.endswith(tail)
                                  for filename, _line, function, _src in thread["frames"]
                                  for name, tail in _BROADCASTS):
            name, _, place = thread["where"].removesuffix(")").partition(" (")
            return f"{Path(place).name} in {name}" if place else "?"
    return None


def extra_forward(rank: int, answer: dict[str, Any], waiting: int, step: int) -> str | None:
    """The verdict when late ``rank`` (its stack ``answer``) is inside a forward's buffer
    broadcast while rank ``waiting`` waits for a bucket of step ``step``'s backward (None: it
    is not).

    That broadcast can never pair: the waiting rank is past its forward, and a rank cannot
    start its next forward before the buckets both wait for are done. So ``rank`` ran a
    forward through the wrapper that the waiting rank did not run, with no backward for it —
    a forward whose output is dropped, an evaluation or logging forward on one rank."""
    where = in_buffer_broadcast(answer)
    if where is None:
        return None
    return (f"  rank {rank} is inside the buffer broadcast of a forward through the wrapper "
            f"(called at {where}), while rank {waiting} waits in the backward of step {step}: "
            f"an extra forward through the wrapper on rank {rank} — a forward rank {waiting} "
            f"did not run, with no backward for it (an output dropped, an evaluation or "
            f"logging forward on one rank); the two collectives never pair. Fix: {EVAL_FIX}. "
            "See docs/debugging.md.")


# The collectives a user's code calls (torch.distributed's functions), and where torch lives:
# frames carry the path torch was imported by, which may be a link to the resolved one.
_COLLECTIVES = {"all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor",
                "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter",
                "all_to_all", "all_to_all_single", "all_gather_object", "broadcast_object_list",
                "monitored_barrier", "send", "recv"}
_PACKAGE = str(Path(__file__).resolve().parents[1])
_TORCH = tuple({str(Path(torch.__file__).resolve().parent), str(Path(torch.__file__).parent)})


def in_mini_ddp_or_torch(filename: str) -> bool:
    """Whether a frame's file is mini_ddp's or torch's: not the user's line."""
    return filename.startswith((_PACKAGE, *_TORCH))


def stuck_in_collective(answer: dict[str, Any]) -> str | None:
    """``"torch.distributed.all_reduce (called at train.py:41 in main)"`` when a rank's stack
    (a stack responder's answer) shows its main thread inside a ``torch.distributed``
    collective called from user code, not from mini_ddp (None: it is not)."""
    if not answer.get("answered"):
        return None
    for thread in answer["stacks"]:
        if not thread["main"]:
            continue
        frames = thread["frames"]
        for i, (filename, _line, function, _src) in enumerate(frames):
            if "torch/distributed" in filename and function in _COLLECTIVES:
                user = next((f for f in reversed(frames[:i])
                             if not in_mini_ddp_or_torch(f[0])), None)
                where = f"{Path(user[0]).name}:{user[1]} in {user[2]}" if user else "?"
                inside = any(f[0].startswith(_PACKAGE) for f in frames[:i])
                return None if inside else f"torch.distributed.{function} (called at {where})"
    return None


def elsewhere_verdict(rank: int, answer: dict[str, Any], waiting: int, step: int,
                      their_step: int | None) -> str | None:
    """The verdict when late ``rank`` (its stack ``answer``) is inside a collective of the
    user's own while rank ``waiting`` is about to run, or runs, one of the wrapper's at step
    ``step`` (``their_step``: the late rank's own step, when known); None when it is not.

    The two can never pair: the ranks ran different numbers of steps (uneven inputs), or that
    collective runs on some ranks only. Every engine and check words it alike."""
    elsewhere = stuck_in_collective(answer)
    if elsewhere is None:
        return None
    steps = "" if their_step is None else (
        f" (rank {waiting} is at step {step}, rank {rank} at step {their_step})")
    return (f"  rank {rank} is inside {elsewhere}, a collective mini_ddp did not issue "
            f"and rank {waiting} does not run here. Either the ranks ran different numbers "
            f"of steps{steps} and rank {rank} went on past its loop — uneven inputs: "
            f"{UNEVEN_FIX} — or that collective runs on some ranks only (a metric "
            "all-reduced on rank 0, a rank-0-only barrier): every rank must issue the "
            "same collectives in the same order, so run it on every rank. See "
            "docs/debugging.md.")


NOT_ASKED: dict[str, Any] = {"answered": False, "asked": False}
"""The answer of a rank that was not asked (no stack responder to ask through, or past the
number of late ranks an asker asks)."""


def describe_answer(rank: int, answer: dict[str, Any]) -> str:
    """The report's lines for one rank's answer (or its silence, or that it was not asked)."""
    if answer.get("asked") is False:
        return (f"    rank {rank} was not asked where it is: no stack of it here (this rank "
                "could not ask, or asked only the first few late ranks)")
    if not answer["answered"]:
        return (f"    rank {rank} did not answer within {answer['waited_s']:g} s: no Python "
                "thread of it can run (stuck in native code that holds the GIL), or its process "
                "is gone")
    return f"    where rank {rank} is (Python stacks, most recent call last):\n" + \
        format_stacks(answer["stacks"], indent="      ")

"""The stall warning: when a wait for a bucket drags on, name the ranks that have not arrived.

``DataParallelModel`` installs a :class:`StallMonitor` by default (``stall_warning_s=60``).
When the end of backward has waited ``stall_warning_s`` for one bucket's collective, the
waiting rank writes a mark into the process group's store (the key-value store every rank
already shares: which step, which bucket, how far it got), gives the other ranks a moment to
do the same, and logs a WARNING on the ``"mini_ddp"`` logger naming the bucket, its
parameters, and every rank that left no mark for this step — the rank that is slow or stuck.
Then it keeps waiting: a slow rank that arrives late costs a log line, not the job (torch DDP
waits for the process group's timeout, and so does ``sync_timeout_s`` by default).

This is Horovod's stall check, without its coordinator: each waiting rank asks the store.
It then asks each late rank *where* it is — its Python stacks, answered by the rank's stack
responder thread (:class:`StackResponder`, below) through the same store — and puts
them in the report, or says the rank did not answer (native code holding the GIL, or dead).
Every rank involved writes its flight recorder dump (:class:`FlightLog`, below), for
``python -m mini_ddp doctor DIR``.

Cost on the happy path: nothing per step — no collective, no store access; the store is used
only once a wait has passed the limit (or ``sync_timeout_s`` has:
:meth:`StallMonitor.on_timeout` asks the late ranks too). Installing starts the responder (one
daemon thread blocked in one ``store.wait`` on its own connection) and the flight log (a
``deque.append`` per collective). :class:`mini_ddp.observe.watchdog.StallWatchdog` builds on
this class: it
leaves marks at every bucket launch (so the report can say which parameters a rank never
produced) and can raise instead of warn.

**Where is a rank?** Its Python stack, asked for through the process group's store.

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

**The flight recorder**: each rank's last N collectives, dumped when sync goes wrong.

Every model watched by the stall warning keeps a :class:`FlightLog` on its reducer: a ring
buffer (``collections.deque(maxlen=N)``) of the collectives the engine launched (:data:`OPS`:
the bucket all-reduces, the start-up and per-forward broadcasts, the unused-parameter map, the
rebuilt bucket layout, join's collectives) — sequence number, which one, step, bucket, bytes,
when it launched and when it completed. Recording is one list and one ``deque.append`` per
launch, and a stamp when the engine's wait for it returns (a collective nobody waits for is
asked at dump time).

A dump writes this rank's ring, its own Python stacks and why it dumped into a directory: the
keyword ``dump_dir`` (:func:`mini_ddp.observe.flight_recorder.flight_recorder`), else the
environment variable ``MINI_DDP_FLIGHT_DIR``, else ``./mini_ddp_flight`` — created only when a
dump happens. Two files per rank:

* ``rank<R>.json`` — mini_ddp's format, read by ``python -m mini_ddp doctor DIR``;
* ``mini_ddp_fr_<R>`` — torch's flight-recorder format (a pickle of ``{"version",
  "pg_config", "entries"}``, one entry per collective with ``collective_seq_id``, sizes, dtypes
  and state), so torch's own analyser reads the same dumps:
  ``python -m torch.distributed.flight_recorder.fr_trace DIR``.

A rank dumps on a stall warning (the waiting ranks, and every late rank when it is asked for
its stack), on ``GradSyncTimeout``, on a failed collective, and on demand: ``kill -USR1 <pid>``
when ``MINI_DDP_FLIGHT_SIGNAL=1`` is set or :func:`install_dump_signal` was called (the handler
is installed when the main thread creates the first log and SIGUSR1 has no other Python
handler; Python runs it in the main thread, so a main thread blocked inside a C call dumps when
that call returns — the store-based ask does not wait for that).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

logger = logging.getLogger("mini_ddp")


# ---- where is a rank: the stack responder ----------------------------------------------

ANSWER_S = 5.0
"""How long an asker waits for a rank's stack before naming it as one that did not answer."""
TIMEOUT_ANSWER_S = 1.0
"""The same, for the ask of a ``GradSyncTimeout``: the deadline has already passed, and a rank
whose responder runs answers within a poll or two."""
MAX_FRAMES = 14
"""Innermost frames kept per thread (the outer ones are the launcher's and the harness's)."""
_POLL_S = 0.05
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
        summary = traceback.extract_stack(frame)
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
    """

    def __init__(self, store: Any, rank: int,
                 on_ask: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None):
        self.rank = rank
        self._stop = threading.Event()
        own = store.clone()  # raises for stores that cannot open a second connection
        # stop() wakes the thread through a connection of its own: by then the process group,
        # and the connection it shares, may be destroyed (see _join_responders_at_exit).
        self._waker = store.clone()
        callback = None if on_ask is None else weakref.WeakMethod(on_ask) \
            if hasattr(on_ask, "__self__") else (lambda: on_ask)
        self.thread = threading.Thread(target=_serve, args=(own, rank, self._stop, callback),
                                       name=f"mini_ddp-stack-responder-rank{rank}", daemon=True)
        self.thread.start()
        _THREADS.add(self.thread)

    def stop(self) -> None:
        """End the thread: set the stop flag, then wake its wait (idempotent, never raises)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._waker.set(f"ask/{self.rank}", json.dumps({"stop": True}))
        except Exception:  # noqa: BLE001 - the store is gone: the thread's wait fails too
            pass


_RESPONDERS: weakref.WeakSet[StackResponder] = weakref.WeakSet()
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_LAST_SERVE_END = [float("-inf")]  # monotonic time a responder thread last left _serve
_THREAD_SETTLE_S = 0.25


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
    for responder in list(_RESPONDERS):
        responder.stop()
    for thread in list(_THREADS):
        thread.join(timeout=2.0)
    # A joined thread has left Python, not yet its OS thread: C++ thread-local state (the
    # store client's) is torn down after that. Exiting meanwhile runs static destructors under
    # it and aborts the same way; a responder that ended moments ago gets that moment.
    settle = _THREAD_SETTLE_S - (time.monotonic() - _LAST_SERVE_END[0])
    if settle > 0:
        time.sleep(settle)


def start_responder(store: Any, rank: int, owner: Any,
                    on_ask: Callable[[list[dict[str, Any]], dict[str, Any]], None] | None = None
                    ) -> StackResponder | None:
    """A :class:`StackResponder` that stops when ``owner`` is garbage-collected (None when the
    store cannot give the thread a connection of its own: then nobody can ask this rank)."""
    try:
        responder = StackResponder(store, rank, on_ask)
    except Exception as error:  # noqa: BLE001 - e.g. a HashStore: stacks just go unasked
        logger.debug("mini_ddp: no stack responder on rank %d: %s", rank, error)
        return None
    weakref.finalize(owner, responder.stop).atexit = False  # exit: _join_responders_at_exit
    _RESPONDERS.add(responder)
    return responder


def _serve(store: Any, rank: int, stop: threading.Event, callback: Any) -> None:
    try:
        _serve_requests(store, rank, stop, callback)
    finally:
        _LAST_SERVE_END[0] = time.monotonic()


def _serve_requests(store: Any, rank: int, stop: threading.Event, callback: Any) -> None:
    ask, count, answer = f"ask/{rank}", f"asked/{rank}", f"stack/{rank}"
    while not stop.is_set():
        started = time.monotonic()
        try:
            store.wait([ask], _WAIT)
        except Exception:  # noqa: BLE001 - expired (re-arm) or the store is gone (end)
            if stop.is_set() or time.monotonic() - started < 60:
                return  # not the long wait expiring: the store failed
            try:
                store = store.clone()  # a fresh connection: a timed-out one may be confused
            except Exception:  # noqa: BLE001
                return
            continue
        try:
            request = json.loads(store.get(ask))
            store.delete_key(ask)
            if stop.is_set() or request.get("stop"):
                return
            generation = store.add(count, 0)  # every request counted so far gets this answer
            stacks = thread_stacks(skip=threading.get_ident())
            store.set(answer, json.dumps({"generation": generation, "time": time.time(),
                                          "asked_at": request.get("time"), "stacks": stacks}))
        except Exception:  # noqa: BLE001 - the store went away while answering
            return
        on_ask = None if callback is None else callback()
        if on_ask is not None:
            try:
                on_ask(stacks, request)
            except Exception:  # noqa: BLE001 - a failed dump must not end the responder
                logger.exception("mini_ddp: rank %d could not write its flight recorder dump",
                                 rank)


def ask_stacks(store: Any, ranks: list[int], answer_s: float = ANSWER_S,
               asked_by: int | None = None, why: str = "") -> dict[int, dict[str, Any]]:
    """Ask each of ``ranks`` for its stacks; wait up to ``answer_s`` for all of them.

    Returns ``{rank: answer}``: an answer is ``{"answered": True, "stacks": [...], "time"}``, or
    ``{"answered": False, "waited_s": answer_s}`` for a rank that did not answer in time.
    """
    now = time.time()
    generations = {}
    for rank in ranks:
        generations[rank] = store.add(f"asked/{rank}", 1)
        store.set(f"ask/{rank}", json.dumps({"from": asked_by, "time": now, "why": why,
                                                  "answer_s": answer_s}))
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + answer_s
    while True:
        for rank in ranks:
            key = f"stack/{rank}"
            if rank in found or not store.check([key]):
                continue
            reply = json.loads(store.get(key))
            if reply["generation"] >= generations[rank]:
                found[rank] = {"answered": True, "stacks": reply["stacks"],
                               "time": reply["time"]}
        if len(found) == len(ranks) or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    for rank in ranks:
        found.setdefault(rank, {"answered": False, "waited_s": answer_s})
    return found


def describe_answer(rank: int, answer: dict[str, Any]) -> str:
    """The report's lines for one rank's answer (or its silence)."""
    if not answer["answered"]:
        return (f"    rank {rank} did not answer within {answer['waited_s']:g} s: no Python "
                "thread of it can run (stuck in native code that holds the GIL), or its process "
                "is gone")
    return f"    where rank {rank} is (Python stacks, most recent call last):\n" + \
        format_stacks(answer["stacks"], indent="      ")


# ---- the flight recorder ----------------------------------------------------------------

DEFAULT_ENTRIES = 2000
"""Collectives kept per rank (torch's ``TORCH_NCCL_TRACE_BUFFER_SIZE`` default is 2000 too);
``MINI_DDP_FLIGHT_ENTRIES`` overrides it."""
DEFAULT_DIR = "mini_ddp_flight"
TORCH_PREFIX = "mini_ddp_fr_"
"""File-name prefix of the torch-format dumps (torch's analyser infers it from the names)."""
TORCH_FORMAT_VERSION = "2.10"
"""The flight-recorder format version the torch-format dumps declare (torch 2.14 reads it)."""

# entry fields, kept as a list so the done-callback can stamp it in place; WORK: the work of a
# collective nobody waits for (join's announcements), asked whether it is done at dump time
SEQ, STEP, BUCKET, NBYTES, NUMEL, DTYPE, LAUNCHED, COMPLETED, STATE, OP, WORK = range(11)
BUCKET_OP = "bucket_all_reduce"
OPS = {
    BUCKET_OP: ("all_reduce", "a bucket's all-reduce"),
    "startup_broadcast": ("broadcast", "the start-up broadcast of rank 0's parameters and "
                                       "buffers"),
    "buffers_broadcast": ("broadcast", "the broadcast of the buffers before forward"),
    "used_map_all_reduce": ("all_reduce", "the unused-parameter map all-reduce"),
    "layout_broadcast": ("broadcast", "the broadcast of rank 0's rebuilt bucket layout"),
    "join_notify_all_reduce": ("all_reduce", "join's count of the ranks still training"),
    "join_sync_flag_all_reduce": ("all_reduce", "join's flag: does this backward synchronise"),
    "join_common_rank_all_reduce": ("all_reduce", "join's choice of the authoritative rank"),
    "join_final_broadcast": ("broadcast", "join's broadcast of the last joiner's model"),
}
"""Every collective the engine records: op name -> (torch's collective, the words for it).
The bucket all-reduces, the parameter and buffer broadcasts, the used map of
``find_unused_parameters`` / ``static_graph``, the broadcasts of the rebuilt bucket layout
(two: its sizes, then the layout) and join's collectives. Not recorded (the same on every
rank, so the numbering still agrees): the start-up check that every rank holds the same
parameters, and the shared-memory transport's own synchronisation."""
_LIVE: weakref.WeakSet[FlightLog] = weakref.WeakSet()
_signal_installed = False
_WRITES = itertools.count()


class FlightLog:
    """One reducer's ring of collectives, and how to dump it."""

    def __init__(self, rank: int, world_size: int, group_name: str = "0", backend: str = "",
                 entries: int | None = None, dump_dir: str | os.PathLike | None = None,
                 reducer: Any = None):
        size = entries or int(os.environ.get("MINI_DDP_FLIGHT_ENTRIES", DEFAULT_ENTRIES))
        self.rank, self.world_size, self.group_name, self.backend = (rank, world_size,
                                                                     group_name, backend)
        self.ring: collections.deque[list] = collections.deque(maxlen=size)
        self.dump_dir = dump_dir
        self.seq = 0
        self.step = 0  # kept up to date by the reducer's launches
        self._open: dict[int, list] = {}  # bucket index -> its entry, until seen complete
        # Read at dump time, weakly: the log must not keep its model alive.
        self._reducer = None if reducer is None else weakref.ref(reducer)
        # Reentrant: SIGUSR1's handler may run in the main thread in the middle of a dump.
        self._lock = threading.RLock()
        _LIVE.add(self)

    @classmethod
    def of_group(cls, group: Any, reducer: Any = None) -> FlightLog:
        """A log for this rank of ``group`` (None: the default group)."""
        group = group if group is not None else dist.group.WORLD
        return cls(dist.get_rank(group), dist.get_world_size(group),
                   str(getattr(group, "group_name", "0")), str(dist.get_backend(group)),
                   reducer=reducer)

    def watch(self, reducer: Any) -> None:
        """Read ``reducer``'s progress at dump time (a log made before its reducer)."""
        self._reducer = weakref.ref(reducer)

    # ---- recording (the reducer's launch) -------------------------------------------------
    def launched(self, step: int, bucket: Any) -> None:
        """Record the launch of ``bucket``'s collective (state ``started``)."""
        buffer = bucket.buffer
        entry = [self.seq, step, bucket.index, bucket.nbytes, buffer.numel(), buffer.dtype,
                 time.time_ns(), None, "started", BUCKET_OP, None]
        self.seq += 1
        self.step = step
        self.ring.append(entry)
        self._open[bucket.index] = entry

    def started(self, op: str, step: int, tensor: Any, work: Any = None) -> list:
        """Record the launch of one of the engine's other collectives, ``op`` (a key of
        :data:`OPS`), on ``tensor`` (state ``started``); returns the entry for
        :meth:`finished`. ``work``: the collective's work when nobody waits for it — asked at
        dump time whether it has completed."""
        numel = tensor.numel()
        entry = [self.seq, step, None, numel * tensor.element_size(), numel, tensor.dtype,
                 time.time_ns(), None, "started", op, work]
        self.seq += 1
        self.ring.append(entry)
        return entry

    @staticmethod
    def finished(entry: list, state: str = "completed") -> None:
        """The wait for ``entry``'s collective (from :meth:`started`) returned, or
        (``state="failed"``) it failed: stamp the entry."""
        entry[COMPLETED], entry[STATE], entry[WORK] = time.time_ns(), state, None

    def completed(self, bucket_index: int, state: str = "completed") -> None:
        """The reducer's wait for bucket ``bucket_index`` returned (or, ``state="failed"``, its
        collective failed): stamp the entry. As torch's ``time_discovered_completed_ns``, this
        is when the rank *saw* the completion — no callback runs on the backend's thread."""
        entry = self._open.pop(bucket_index, None)
        if entry is not None:
            entry[COMPLETED], entry[STATE] = time.time_ns(), state

    # ---- dumping ----------------------------------------------------------------------------
    def directory(self) -> Path:
        """Where dumps go: ``dump_dir``, else ``$MINI_DDP_FLIGHT_DIR``, else ./mini_ddp_flight."""
        return Path(self.dump_dir or os.environ.get("MINI_DDP_FLIGHT_DIR") or DEFAULT_DIR)

    def snapshot(self, reason: str, stacks: list[dict[str, Any]] | None = None,
                 **extra: Any) -> dict[str, Any]:
        """This rank's dump as a JSON-ready dict (``stacks`` default: taken now; ``extra``
        entries are added as they are: ``report``, the stall report's text, and ``peers``,
        ``{rank: answer}`` of the ranks it asked for their stacks)."""
        ring = list(self.ring)  # an atomic copy
        for e in ring:
            work = e[WORK]
            if work is not None and e[STATE] == "started" and work.is_completed():
                self.finished(e)  # discovered now, as torch's time_discovered_completed_ns
        entries = [{"seq": e[SEQ], "op": e[OP], "step": e[STEP], "bucket": e[BUCKET],
                    "bytes": e[NBYTES], "numel": e[NUMEL],
                    "dtype": str(e[DTYPE]).removeprefix("torch."), "launched_ns": e[LAUNCHED],
                    "completed_ns": e[COMPLETED], "state": e[STATE]} for e in ring]
        return {"format": "mini_ddp flight recorder", "version": 1, "rank": self.rank,
                "world_size": self.world_size, "group": self.group_name,
                "backend": self.backend, "host": socket.gethostname(), "pid": os.getpid(),
                "time": time.time(), "reason": reason, "step": self.step,
                "progress": self.progress(), "entries": entries,
                "stacks": thread_stacks() if stacks is None else stacks,
                "report": None, "peers": {}, **extra}

    def progress(self) -> dict[str, Any]:
        """Where the reducer is now: its step, the next bucket to launch, the buckets' names."""
        reducer = None if self._reducer is None else self._reducer()
        if reducer is None:
            return {}
        names = reducer.names
        return {"step": reducer.step.num_iterations, "next_bucket": reducer.step.next_bucket,
                "buckets": [[names[i] for i in b.param_indices] for b in reducer.layout.buckets]}

    def dump(self, reason: str, stacks: list[dict[str, Any]] | None = None,
             **extra: Any) -> Path | None:
        """Write ``rank<R>.json`` and the torch-format file; return the JSON path (None and a
        logged error when the directory cannot be written: a dump must not end the job)."""
        dump = self.snapshot(reason, stacks, **extra)
        folder = self.directory()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with self._lock:  # the responder thread and the main thread may both dump
                path = folder / f"rank{self.rank}.json"
                _write_atomically(path, json.dumps(dump, indent=1).encode())
                _write_atomically(folder / f"{TORCH_PREFIX}{self.rank}",
                                  pickle.dumps(torch_format(dump)))
        except OSError as error:
            logger.error("mini_ddp: rank %d could not write its flight recorder dump to %s: %s",
                         self.rank, folder, error)
            return None
        logger.info("mini_ddp: rank %d wrote its flight recorder dump (%s) to %s",
                    self.rank, reason, path)
        return path

    def on_ask(self, stacks: list[dict[str, Any]], request: dict[str, Any]) -> None:
        """The stack responder's callback: a peer asked where this rank is; dump, with the
        stacks it was sent (and how late the answer came, when the asker had given up)."""
        asked_at = request.get("time", time.time())
        after = time.time() - asked_at
        late = {"answered_late_s": round(after, 3)} if after > request.get("answer_s", after) \
            else {}
        self.dump(f"asked for its stack by rank {request.get('from')} "
                  f"({request.get('why') or 'a stall'})", stacks, asked_at=asked_at, **late)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.{next(_WRITES)}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a reader (the doctor) never sees half a file


def torch_format(dump: dict[str, Any]) -> dict[str, Any]:
    """``dump`` (from :meth:`FlightLog.snapshot`) in torch's flight-recorder format.

    Each recorded collective becomes an entry of the group under torch's name for it
    (``all_reduce`` for a bucket, the used map and join's counts; ``broadcast`` for the
    parameter and buffer broadcasts: :data:`OPS`), its sequence number the
    ``collective_seq_id`` (the analyser lines ranks up by it), its element count the input and
    output size; states map to torch's (``started`` / ``completed``). What torch's format has
    no field for (step, bucket, which of the engine's collectives, stacks, the stall report)
    stays in the JSON dump.
    """
    backend = "nccl" if dump["backend"] == "nccl" else "gloo"
    group = (dump["group"], "default_pg" if dump["group"] == "0" else dump["group"])
    entries = []
    for e in dump["entries"]:
        done = e["completed_ns"]
        entries.append({
            "record_id": e["seq"], "pg_id": 0, "process_group": group,
            "collective_seq_id": e["seq"], "p2p_seq_id": 0, "op_id": e["seq"],
            "profiling_name": f"{backend}:{OPS.get(e.get('op', BUCKET_OP), OPS[BUCKET_OP])[0]}",
            "time_created_ns": e["launched_ns"],
            "input_sizes": [[e["numel"]]], "output_sizes": [[e["numel"]]],
            "input_dtypes": [_TORCH_DTYPES.get(e["dtype"], e["dtype"])],
            "output_dtypes": [_TORCH_DTYPES.get(e["dtype"], e["dtype"])],
            "state": "completed" if e["state"] == "completed" else "started",
            "time_discovered_started_ns": e["launched_ns"],
            "time_discovered_completed_ns": done, "retired": done is not None,
            "timeout_ms": 0, "is_p2p": False, "frames": [],
            "duration_ms": None if done is None else (done - e["launched_ns"]) / 1e6})
    ranks = str(list(range(dump["world_size"])))
    return {"version": TORCH_FORMAT_VERSION, "entries": entries,
            "pg_config": {group[0]: {"name": group[0], "desc": group[1], "ranks": ranks}},
            "pg_status": {}}


_TORCH_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half",
                 "bfloat16": "BFloat16", "int64": "Long", "int32": "Int"}


def dump_all(reason: str) -> list[Path]:
    """Dump every live flight log of this process (what SIGUSR1 does)."""
    return [p for log in list(_LIVE) if (p := log.dump(reason)) is not None]


def install_dump_signal() -> bool:
    """Make SIGUSR1 dump every flight log of this process, once, if allowed: only from the
    main thread, and only while SIGUSR1 has its default action (a user's handler stays)."""
    global _signal_installed
    sig = getattr(signal, "SIGUSR1", None)
    if _signal_installed or sig is None or threading.current_thread() is not \
            threading.main_thread() or signal.getsignal(sig) is not signal.SIG_DFL:
        return _signal_installed
    signal.signal(sig, lambda *_: dump_all("on demand (SIGUSR1)"))
    _signal_installed = True
    return True


# ---- the stall warning ------------------------------------------------------------------
_SESSIONS = itertools.count()  # same sequence on every rank: monitors are made in lockstep
ARRIVAL_GRACE_S = 2.0
"""How long a waiting rank gives its peers to leave their marks before naming those that did
not: ranks that launched the bucket a little later reach the limit a little later too."""
MAX_ASKED = 4
"""Late ranks asked for their stacks per report (the lowest ranks): the store load of a report
stays bounded however many ranks are late, and four stacks are as many as a reader follows."""


@dataclass
class StallReport:
    """What one rank knows when sync stalls: its own state and every rank's marks."""

    rank: int
    world_size: int
    step: int
    waiting_for: int | None  # bucket index (None: not waiting, or the unused-parameter map)
    waiting_params: list[str]
    waited_s: float
    error: str | None
    pending_buckets: list[int]  # buckets not yet launched here
    missing_params: list[str]  # parameters without a gradient here this step
    marks: dict[int, dict | None] = field(default_factory=dict)
    culprits: dict[int, str] = field(default_factory=dict)  # rank -> why it holds things up
    stacks: dict[int, dict] = field(default_factory=dict)  # rank -> its answer (StackResponder)

    def __str__(self) -> str:
        head = f"mini_ddp stall report from rank {self.rank} (step {self.step}): "
        if self.waiting_for is not None:
            shown = ", ".join(self.waiting_params[:6]) + (", …" if len(self.waiting_params) > 6
                                                          else "")
            why = "failed" if self.error else f"has not finished after {self.waited_s:.1f} s"
            head += f"the all-reduce of bucket {self.waiting_for} ({shown}) {why}"
        else:
            head += "this rank's last backward ended with buckets it never launched"
        lines = [head + "."]
        if self.error:
            lines.append(f"  the collective failed with: {self.error.splitlines()[0][:300]}")
        if self.missing_params:
            lines.append(f"  rank {self.rank}: no gradient for {', '.join(self.missing_params)};"
                         f" buckets never launched: {self.pending_buckets}")
        for rank, why in sorted(self.culprits.items()):
            lines.append(f"  rank {rank}: {why}")
            if rank in self.stacks:
                lines.append(describe_answer(rank, self.stacks[rank]))
        reached = [r for r in range(self.world_size) if r not in self.culprits and r != self.rank]
        if reached and self.waiting_for is not None:
            lines.append(f"  ranks that reached bucket {self.waiting_for}: {reached}")
        if self.missing_params or any("without a gradient" in w for w in self.culprits.values()):
            lines.append("  A parameter with no gradient on some rank means its branch was "
                         "skipped or its output left out of the loss there: use it on every "
                         "rank, or pass find_unused_parameters=True.")
        elif self.culprits:
            lines.append("  A rank that has not reached the bucket is still computing or is "
                         "stuck before it (data loading, a rank-dependent branch, a deadlock "
                         "in user code); this rank keeps waiting for it.")
        return "\n".join(lines)


def holds_up(mark: dict | None, step: int, bucket: int | None) -> str | None:
    """Why a rank with ``mark`` keeps bucket ``bucket`` of ``step`` from finishing (or None)."""
    if mark is None:
        return "left no mark: it has not launched any bucket since the watchdog started"
    ago = f"{time.time() - mark['time']:.1f} s ago"
    if mark["step"] < step:
        return f"is behind, still in step {mark['step']} ({mark['state']}, {ago})"
    if mark["step"] > step:
        return None
    if mark["state"] == "ended_unfinished" or (mark.get("missing") and mark["state"] != "waiting"):
        return (f"its backward of step {step} ended without a gradient for "
                f"{', '.join(mark['missing'])}, so it never launched buckets {mark['pending']} "
                f"(it launched {mark['launched']} of {mark['buckets']}; marked {ago})")
    if bucket is not None and mark["launched"] <= bucket:
        return (f"has launched {mark['launched']} of {mark['buckets']} buckets, not yet bucket "
                f"{bucket}: its backward is still running or stuck ({mark['state']}, {ago})")
    return None


class StallMonitor:
    """Log a :class:`StallReport` when a wait for a bucket passes ``limit_s`` seconds.

    Marks are written only once a wait is slow (see the module docstring); ``install()`` puts
    the monitor on the reducer's stall seam, ``remove()`` puts back what was there.
    """

    eager_marks = False
    """Whether every rank marks its progress at each bucket launch (the watchdog does): then
    no grace is needed, and a rank without a mark has launched nothing since it started."""

    def __init__(self, reducer: Any, process_group: Any, limit_s: float = 60.0,
                 store: Any = None):
        # Weak: the reducer's stall seam holds this monitor (its bound on_stall), so a strong
        # reference back would be a cycle that keeps a dropped model's reducer — and its
        # AccumulateGrad hooks — alive until a garbage collection (torch DDP frees at once).
        try:
            self._reducer = weakref.ref(reducer)
        except TypeError:  # a stand-in that cannot be weakly referenced (tests, tools)
            self._reducer = lambda: reducer
        self.limit_s = limit_s
        group = getattr(process_group, "group_name", "default")
        self._prefix = f"mini_ddp/stall/{group}/{next(_SESSIONS)}"
        self._store = store
        self._replaced: tuple[Any, float | None, Any] | None = None
        self._responder: StackResponder | None = None
        self.answer_s = ANSWER_S  # how long a report waits for a late rank's stack
        self.timeout_answer_s = TIMEOUT_ANSWER_S  # the same, when sync_timeout_s has passed

    @property
    def reducer(self) -> Any:
        """The reducer watched (None once it has been freed)."""
        return self._reducer()

    @property
    def store(self) -> Any:
        """The store where marks go (made on first use: the happy path never touches it)."""
        if self._store is None:
            self._store = dist.PrefixStore(self._prefix,
                                           dist.distributed_c10d._get_default_store())
        return self._store

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> StallMonitor:
        """Start watching (idempotent); returns self."""
        r = self.reducer
        if r.on_stall != self.on_stall:
            self._replaced = (r.on_stall, r.stall_after_s, getattr(r, "on_timeout", None))
            r.on_stall, r.stall_after_s = self.on_stall, self.limit_s
            r.on_timeout = self.on_timeout
            self._start_flight_log_and_responder()
        return self

    def _start_flight_log_and_responder(self) -> None:
        r = self.reducer
        if not hasattr(r, "layout"):
            return  # a stand-in reducer (tests of the install/remove bookkeeping)
        if getattr(r, "flight", None) is None:  # else made by the model, before its reducer
            r.flight = FlightLog.of_group(r.group, reducer=r)
        if os.environ.get("MINI_DDP_FLIGHT_SIGNAL", "") not in ("", "0"):
            # Opt-in: a process-wide signal is not a library's to take by default, and
            # faulthandler.register(SIGUSR1) — how hang stacks are usually taken — is
            # invisible to signal.getsignal, so installing would silently replace it.
            install_dump_signal()
        if self._responder is None and r.world_size > 1:
            store = self._store
            if store is None:  # a store of its own: the happy path leaves self.store unopened
                try:
                    store = dist.PrefixStore(self._prefix,
                                             dist.distributed_c10d._get_default_store())
                except (RuntimeError, ValueError):  # no default store: stacks go unasked
                    return
            # Stops when the reducer goes (the model deleted): the thread holds nothing of it.
            self._responder = start_responder(store, r.rank, r, r.flight.on_ask)

    def remove(self) -> None:
        """Stop watching; whatever watched before (the default warning, or nothing) is back."""
        r = self.reducer
        if r.on_stall == self.on_stall and self._replaced is not None:
            r.on_stall, r.stall_after_s, r.on_timeout = self._replaced
            self._replaced = None
        if self._responder is not None:
            self._responder.stop()
            self._responder = None

    def __enter__(self) -> StallMonitor:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- marks ------------------------------------------------------------------------------
    def publish(self, state: str, launched: int, **extra: Any) -> None:
        """Leave this rank's mark: its step, how many buckets it launched, and ``state``."""
        r = self.reducer
        mark = {"step": r.step.num_iterations, "state": state, "launched": launched,
                "buckets": len(r.layout.buckets), "time": time.time(), **extra}
        if state in ("ended_unfinished", "waiting", "failed"):
            mark["missing"] = self.missing()
            mark["pending"] = [b.index for b in r.layout.buckets[r.step.next_bucket:]]
        self.store.set(f"rank{r.rank}", json.dumps(mark))

    def missing(self) -> list[str]:
        """This rank's parameters that have no gradient yet in the current backward."""
        r = self.reducer
        return [r.names[i] for i in range(len(r.params)) if i not in r.step.ready]

    def marks(self) -> dict[int, dict | None]:
        """Every rank's latest mark (None: it left none)."""
        found: dict[int, dict | None] = {}
        for rank in range(self.reducer.world_size):
            key = f"rank{rank}"
            found[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return found

    # ---- the report -------------------------------------------------------------------------
    def on_stall(self, reducer: Any, bucket: Any, error: BaseException | None) -> None:
        """The reducer's stall seam: after ``limit_s`` without an answer (``error`` None), or
        when the collective failed. A failed collective is already named by the reducer: the
        flight recorder only dumps."""
        if error is not None:
            self.failed(bucket)
            self.dump(f"collective failed: {type(error).__name__}: {error}")
            return
        self.publish("waiting", launched=reducer.step.next_bucket,
                     waiting_for=None if bucket is None else bucket.index)
        report = self.report(bucket, None)
        if report is not None:
            self.diagnose(report)
            self.act(report, None)

    def on_timeout(self, reducer: Any, bucket: Any) -> tuple[str, dict[str, Any]]:
        """The reducer's timeout seam: its wait passed ``sync_timeout_s`` (whether or not a
        warning came first). Say who holds ``bucket`` up and ask them where they are now.

        Returns the lines for :class:`~mini_ddp.errors.GradSyncTimeout`'s message (after its
        own text; empty when every rank has arrived meanwhile) and the extra fields of this
        rank's flight recorder dump (``report``, ``peers``). Bounded in wall-clock time: the
        peers' grace to leave their marks (at most :data:`ARRIVAL_GRACE_S`), then
        :attr:`timeout_answer_s` for the stacks — a rank that does not answer is said to, as in
        a warning. The store is used from a thread of its own, joined with that deadline (and
        a second more): a store call cannot be given a deadline, and a store cut off from this
        rank (a network partition) would otherwise hold the error back for the store's own
        timeout.
        """
        found: list[tuple[str, dict[str, Any]]] = []
        worker = threading.Thread(target=lambda: found.append(self._ask_late(reducer, bucket)),
                                  name=f"mini_ddp-timeout-ask-rank{reducer.rank}", daemon=True)
        worker.start()
        limit = min(self.limit_s, ARRIVAL_GRACE_S) + self.timeout_answer_s + 1.0
        worker.join(limit)
        if not found:
            return (f"  The late ranks could not be asked where they are: the process group's "
                    f"store did not answer within {limit:g} s.", {})
        return found[0]

    def _ask_late(self, reducer: Any, bucket: Any) -> tuple[str, dict[str, Any]]:
        try:
            self.publish("waiting", launched=reducer.step.next_bucket,
                         waiting_for=None if bucket is None else bucket.index)
            report = self.report(bucket, None)
            if report is None or not report.culprits:
                return "", {}
            self.ask(report, "timed out waiting", self.timeout_answer_s)
        except Exception:  # noqa: BLE001 - the timeout is raised in any case, with what we have
            logger.exception("mini_ddp: rank %d could not find the late ranks of its timeout",
                             reducer.rank)
            return "", {}
        lines = ["  Ranks that had not reached it when this rank gave up:"]
        for rank, why in sorted(report.culprits.items()):
            lines.append(f"  rank {rank}: {why}")
            if rank in report.stacks:
                lines.append(describe_answer(rank, report.stacks[rank]))
        text = "\n".join(lines)
        return text, {"report": text, "peers": {str(rank): answer
                                               for rank, answer in report.stacks.items()}}

    # ---- where the late ranks are -------------------------------------------------------------
    def ask(self, report: StallReport, waits: str = "waits",
            answer_s: float | None = None) -> None:
        """Ask the late ranks of ``report`` (at most :data:`MAX_ASKED`, the lowest) for their
        stacks, into ``report.stacks``, waiting ``answer_s`` (default :attr:`answer_s`) for
        them (each asked rank dumps its flight log as it answers)."""
        r = self.reducer
        late = sorted(report.culprits)[:MAX_ASKED]
        if late and report.error is None:
            what = "the unused-parameter map" if report.waiting_for is None \
                else f"bucket {report.waiting_for}"
            try:
                report.stacks = ask_stacks(self.store, late, answer_s or self.answer_s,
                                           asked_by=r.rank,
                                           why=f"rank {r.rank} {waits} for {what} of step "
                                               f"{report.step}")
            except Exception:  # noqa: BLE001 - a report without stacks beats a failed wait
                logger.exception("mini_ddp: rank %d could not ask ranks %s for their stacks",
                                 r.rank, late)

    def diagnose(self, report: StallReport) -> None:
        """Ask the late ranks for their stacks (:meth:`ask`), into ``report``; then dump this
        rank's flight log (the asked ranks dump theirs as they answer)."""
        self.ask(report)
        text = str(report)
        self.dump(f"stall warning: {text.splitlines()[0]}", report=text,
                  peers={str(rank): answer for rank, answer in report.stacks.items()})

    def failed(self, bucket: Any) -> None:
        """Mark ``bucket``'s collective failed in the flight log."""
        flight = getattr(self.reducer, "flight", None)
        if flight is not None and bucket is not None:
            flight.completed(bucket.index, state="failed")

    def dump(self, reason: str, **extra: Any) -> None:
        """Write this rank's flight recorder dump (nothing without a flight log)."""
        flight = getattr(self.reducer, "flight", None)
        if flight is not None:
            flight.dump(reason, **extra)

    def act(self, report: StallReport, error: BaseException | None) -> None:
        """Tell the user: a WARNING on the ``"mini_ddp"`` logger."""
        logger.warning("%s", report)

    def report(self, bucket: Any, error: BaseException | None) -> StallReport | None:
        """Read every rank's marks and say who holds ``bucket`` up (None: nobody any more)."""
        r = self.reducer
        index = None if bucket is None else bucket.index
        marks = self.marks()
        if not self.eager_marks and error is None:
            # Peers mark only when their own wait passes the limit: give them a moment, and
            # stop early once they all have (or the collective finished: no stall to report).
            deadline = time.monotonic() + min(self.limit_s, ARRIVAL_GRACE_S)
            while not all(m is not None and m["step"] >= r.step.num_iterations
                          for m in marks.values()) and time.monotonic() < deadline:
                if bucket is not None and bucket.future is not None and bucket.future.done():
                    return None
                time.sleep(0.05)
                marks = self.marks()
        report = StallReport(
            r.rank, r.world_size, r.step.num_iterations, index,
            [] if bucket is None else [r.names[i] for i in bucket.param_indices],
            self.limit_s if error is None and bucket is not None else 0.0,
            None if error is None else f"{type(error).__name__}: {error}",
            [b.index for b in r.layout.buckets[r.step.next_bucket:]], self.missing(), marks)
        for rank, mark in marks.items():
            if rank == r.rank:
                continue
            if not self.eager_marks and (mark is None or mark["step"] < r.step.num_iterations):
                what = "the unused-parameter map" if index is None else f"bucket {index}"
                report.culprits[rank] = (
                    f"has not reached {what} of step {r.step.num_iterations}: it is slow or stuck "
                    f"before it (no mark from it within {min(self.limit_s, ARRIVAL_GRACE_S):g}"
                    " s of this one)")
                continue
            why = holds_up(mark, r.step.num_iterations, index)
            if why:
                report.culprits[rank] = why
        return report

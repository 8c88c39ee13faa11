"""The flight recorder: each rank's last N collectives, dumped when sync goes wrong.

Every model watched by the stall warning keeps a :class:`FlightLog` on its reducer: a ring
buffer (``collections.deque(maxlen=N)``) of the collectives the engine launched (:data:`OPS`:
the bucket all-reduces, the start-up and per-forward broadcasts, the unused-parameter map, the
rebuilt bucket layout, join's collectives) — sequence number, which one, step, bucket, bytes,
when it launched and when it completed. Recording is one list and one ``deque.append`` per
launch, and a stamp when the engine's wait for it returns (a collective nobody waits for is
asked at dump time).

A dump writes this rank's ring, its own Python stacks and why it dumped into a directory: the
keyword ``dump_dir`` (:func:`flight_recorder`), else the
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

From the user's side: where a model's dumps go, dump now, read them. ::

    from mini_ddp.watch.flight_log import dump, flight_recorder
    flight_recorder(model, dump_dir="/shared/flight")   # or MINI_DDP_FLIGHT_DIR=/shared/flight
    ...
    dump(model, "before the checkpoint")                  # on demand, this rank only

Then ``python -m mini_ddp doctor /shared/flight`` lines the ranks up (ranks on several hosts
dump on their own host: copy the files into one directory first).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mini_ddp.watch.stacks import thread_stacks

logger = logging.getLogger("mini_ddp")

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
        self.pid = os.getpid()  # the rank's process: only it dumps (see dump)
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

    # The engine's events (mini_ddp.engine.observer): the reducer sets this log as its
    # ``flight``, which makes it an observer of the bucket launches and completions.
    def bucket_launched(self, reducer: Any, bucket: Any) -> None:
        """Event: ``bucket``'s collective started."""
        self.launched(reducer.step.num_iterations, bucket)

    def bucket_done(self, reducer: Any, bucket: Any) -> None:
        """Event: the wait for ``bucket`` returned."""
        self.completed(bucket.index)

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
        """Where dumps go: ``dump_dir``, else ``$MINI_DDP_FLIGHT_DIR``, else ./mini_ddp_flight;
        a model on a group other than the default one dumps into its subfolder
        ``group<name>``, so the group ranks of two groups never write the same file."""
        base = Path(self.dump_dir or os.environ.get("MINI_DDP_FLIGHT_DIR") or DEFAULT_DIR)
        return base if self.group_name == "0" else base / f"group{self.group_name}"

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
        logged error when the directory cannot be written: a dump must not end the job).

        None, writing nothing, in a child forked from the rank (it inherits the log and the
        SIGUSR1 handler): its ``rank<R>.json`` would replace the rank's own dump."""
        if os.getpid() != self.pid:
            logger.debug("mini_ddp: a process forked from rank %d does not dump its flight log",
                         self.rank)
            return None
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


# ---- the user's side: where a model's dumps go, dump now, read them ---------------------
def flight_recorder(model: Any, dump_dir: str | os.PathLike | None = None,
                    entries: int | None = None) -> FlightLog:
    """``model``'s flight log, with its dump directory and ring size set when given.

    Raises ``ValueError`` for a model without one (``stall_warning_s=None``).
    """
    log = getattr(getattr(model, "reducer", None), "flight", None)
    if log is None:
        raise ValueError("mini_ddp: this model has no flight recorder: it is kept by the stall "
                         "warning, which stall_warning_s=None turned off")
    if dump_dir is not None:
        log.dump_dir = dump_dir
    if entries is not None and entries != log.ring.maxlen:
        log.ring = type(log.ring)(log.ring, maxlen=entries)
    return log


def dump(model: Any, reason: str = "on demand") -> Path | None:
    """Write this rank's flight recorder dump now; returns the JSON file's path."""
    return flight_recorder(model).dump(reason)


def read_dumps(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """Every ``rank<R>.json`` dump in ``directory``, by rank."""
    found = {}
    for path in sorted(Path(directory).glob("rank*.json")):
        data = json.loads(path.read_text())
        if data.get("format") == "mini_ddp flight recorder":
            found[int(data["rank"])] = data
    return found

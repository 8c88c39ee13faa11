"""Store calls with a deadline, off the calling thread: how the observing side reaches the store.

The stall warning, the stack requests, the timeout's ask and the marks ranks leave when they
finish all talk to the process group's store (the rendezvous ``TCPStore``). That store can be
slow, frozen (its process stopped) or gone (its process ended). A ``TCPStore`` client call then
blocks — a stopped server keeps its socket open, so the client's own timeout does not always end
the call — or raises (``DistNetworkError: Broken pipe``). torch DDP never touches the store after
start-up, so none of that may reach the gradient wait either: :func:`bounded_store_call` runs one
call in a daemon thread and waits for it at most ``timeout_s``. A call that does not come back in
time, or fails, becomes a :class:`StoreUnanswered` whose text is the one log line the caller
writes ("the rendezvous store did not answer within 2 s").

A call that has not come back still holds its connection (a ``TCPStore`` client serialises its
requests), so the next call on that connection would queue behind it: while one is stuck, later
calls on the same connection fail at once with the same error instead of starting another
thread that would hang too. A clone (``store.clone()``, a connection of its own) is not held up.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["STORE_CALL_S", "StoreUnanswered", "bounded_store_call", "default_store",
           "group_key_space"]

T = TypeVar("T")

STORE_CALL_S = 2.0
"""Default deadline of one observing-side store call (a healthy store answers in milliseconds)."""

_LOCK = threading.Lock()
_STUCK: dict[int, tuple[float, float, threading.Thread]] = {}  # connection -> started, limit, thread


class StoreUnanswered(RuntimeError):
    """The rendezvous store did not answer a call in time, or the call failed (the store is gone).

    ``timed_out`` says which; the message is one sentence, meant for one log line.
    """

    timed_out: bool = True


def default_store(prefix: str | None = None) -> Any:
    """The default process group's store (the rendezvous store every rank shares), under
    ``prefix`` when given. Raises RuntimeError or ValueError when there is no default group."""
    store = dist.distributed_c10d._get_default_store()
    return store if prefix is None else dist.PrefixStore(prefix, store)


_KEY_SPACES: collections.defaultdict[tuple[str, str], itertools.count] = \
    collections.defaultdict(itertools.count)
_KEY_SPACES_LOCK = threading.Lock()


def group_key_space(kind: str, group: Any) -> str:
    """A fresh store key prefix of ``kind`` for one model on ``group``:
    ``mini_ddp/<kind>/<group name>/<n>``.

    ``n`` counts the models made on that group in this process, so every rank of the group
    names its model's prefix alike as long as the group's ranks make their models in the same
    order (as their collectives require anyway), whatever models they make on other groups;
    two groups never share a prefix (``new_group`` names each group alike on every rank).
    """
    name = str(getattr(group, "group_name", None) or "default")
    with _KEY_SPACES_LOCK:
        n = next(_KEY_SPACES[kind, name])
    return f"mini_ddp/{kind}/{name}/{n}"


def _connection(store: Any) -> Any:
    """The store object that owns the connection (a ``PrefixStore`` wraps another store)."""
    while getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store
    return store


def bounded_store_call(store: Any, call: Callable[[Any], T], timeout_s: float = STORE_CALL_S,
                       what: str = "") -> T:
    """``call(store)`` in a daemon thread; its result within ``timeout_s`` seconds, else raise.

    Raises :class:`StoreUnanswered` when the call did not return in time (the thread is left to
    finish on its own), when an earlier call on the same connection is still waiting, or when
    the call raised (the original error is the ``__cause__``). ``what`` names the call in the
    message ("the stall report's marks").
    """
    key = id(_connection(store))
    about = f" ({what})" if what else ""
    with _LOCK:
        stuck = _STUCK.get(key)
        if stuck is not None and stuck[2].is_alive():
            raise StoreUnanswered(
                f"the rendezvous store did not answer within {stuck[1]:g} s{about}: a call "
                f"made {time.monotonic() - stuck[0]:.1f} s ago is still waiting for it")
        _STUCK.pop(key, None)
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call(store)))
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            outcome.append((False, error))

    worker = threading.Thread(target=run, name="mini_ddp-store-call", daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        with _LOCK:
            _STUCK[key] = (started, timeout_s, worker)
        raise StoreUnanswered(f"the rendezvous store did not answer within {timeout_s:g} s"
                              f"{about}")
    ok, value = outcome[0]
    if not ok:
        first = (str(value).strip().splitlines() or [""])[0][:200]
        failed = StoreUnanswered(f"the rendezvous store failed{about}: "
                                 f"{type(value).__name__}: {first}")
        failed.timed_out = False
        raise failed from value
    return value

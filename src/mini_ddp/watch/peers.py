"""What the other ranks did: the marks a rank leaves when it finishes, and how to read them.

A collective fails on a survivor the moment a peer's sockets close, whether the peer died or
simply finished: it ran one batch fewer (uneven inputs), called ``destroy_process_group()`` or
reached the end of its script. Only the second is a bug in the training loop, with a fix of its
own (``model.join()``, ``DistributedSampler(drop_last=True)``), and blaming a death for it
sends the user looking for an out-of-memory kill that never happened.

So every rank of a watched model (one with the stall warning, the default) leaves a mark in
the process group's store as it finishes cleanly: in ``destroy_process_group()`` (torch's
function is wrapped once; the mark is written before the group goes) and at interpreter exit
(:mod:`atexit`), with the step it reached and, when the script ended with an uncaught
exception, that exception. Only the rank's own process marks: a child forked from it (a
``DataLoader`` worker, any forked helper) inherits the exit handlers and the group, and its
exit neither writes nor replaces the rank's mark (the pid that watched the model is checked). :func:`peer_states` reads every rank's mark, bounded in time; a
:class:`~mini_ddp.errors.CollectiveError` (through :func:`explain_peers`) and the flight
recorder's dump use it to say "rank 1 finished (destroyed its process group) after step 5",
and say a rank most likely died only when it left no mark.

Every store call here runs off the calling thread with a deadline
(:func:`~mini_ddp.watch.bounded_store.bounded_store_call`): a finishing rank whose store is
frozen or gone exits on time without its mark, and a reader says the store did not answer.
Cost: nothing per step; one store ``set`` per rank at its end, reads only when something failed.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import multiprocessing.util
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mini_ddp.errors import explain_peers_with
from mini_ddp.watch.bounded_store import StoreUnanswered, bounded_store_call, default_store

__all__ = ["FINISH_MARK_S", "READ_S", "PeerState", "describe_finished", "explain_peers",
           "mark_failed", "mark_finished", "note_mistake", "peer_states", "watch"]

logger = logging.getLogger("mini_ddp")

FINISH_MARK_S = 1.0
"""How long a finishing rank waits for the store to take its mark before it goes anyway."""
READ_S = 1.0
"""How long a reader waits for the store to hand over every rank's mark."""
KEY = "mini_ddp/peers/rank{}"

_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()  # reducers whose step a finish mark reports
_installed = threading.Lock()
_state: dict[str, Any] = {"installed": False, "marked": None, "exit_error": None,
                         "last_step": None, "owner": None,
                         "mistake": ""}
# "owner": the pid of the process whose rank the marks speak for — the one that watched a model
# (None: none has; then the process that ends marks, as a rank without a model of ours). A
# child forked while a process group exists (a DataLoader worker, any forked helper) inherits
# the group, the store's connection, the exit handlers and the wrapped destroy_process_group:
# its end is not its parent rank's, so it never marks — until it watches a model of its own.


def _after_fork_in_child() -> None:
    _WATCHED.clear()  # the parent's models: their steps are not this process's
    _state["last_step"] = None
    if dist.is_available() and dist.is_initialized():  # the parent's group: not ours to mark
        _state["owner"] = -1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _marks_for_this_process() -> bool:
    """Whether this process may leave (or read as its own) its rank's finish mark."""
    return _state["owner"] in (None, os.getpid())


@dataclass
class PeerState:
    """One rank's last known state, from the store.

    ``state``: ``"finished"`` (it ended cleanly: ``how`` says how, ``step`` after which step),
    ``"failed"`` (its script ended with an uncaught exception: ``error``), ``"unknown"`` (it
    left no mark: still running, or gone without a word — killed, out of memory, crashed) or
    ``"unreachable"`` (the store did not answer: ``error`` says how).
    """

    rank: int
    state: str
    how: str = ""
    step: int | None = None
    error: str = ""
    time: float | None = None
    mistake: str = ""  # what a check of this rank named about its own script, if anything

    @property
    def ended(self) -> bool:
        """The rank left a finish mark: it finished, or its script raised."""
        return self.state in ("finished", "failed")

    def describe(self) -> str:
        """This state in a message's words ("rank 1 finished (destroyed its process group)
        after step 5")."""
        after = "" if self.step is None else f" after step {self.step}"
        if self.state == "finished":
            told = f", after it reported: {self.mistake}" if self.mistake else ""
            return f"rank {self.rank} finished ({self.how}){after}{told}"
        if self.state == "failed":
            return f"rank {self.rank} failed{after}: its script raised {self.error}"
        if self.state == "unreachable":
            return f"rank {self.rank}: unknown ({self.error})"
        return f"rank {self.rank} left no mark of finishing"


def _steps() -> int | None:
    """The furthest step of this process's watched models, live or gone (None: none)."""
    steps = [r.step.num_iterations for r in list(_WATCHED)]
    if _state["last_step"] is not None:
        steps.append(_state["last_step"])
    return max(steps) if steps else None


def _remember(step: Any) -> None:
    # A model freed before the end (a function's local) still counts for the finish mark.
    last = _state["last_step"]
    _state["last_step"] = step.num_iterations if last is None else max(last,
                                                                       step.num_iterations)


def watch(reducer: Any) -> None:
    """Report ``reducer``'s step in this rank's finish mark, and make sure the mark is left
    (the first call wraps ``destroy_process_group`` and registers the exit mark)."""
    _state["owner"] = os.getpid()  # this process's rank: its end is what the mark tells
    if reducer not in _WATCHED:
        _WATCHED.add(reducer)
        weakref.finalize(reducer, _remember, reducer.step).atexit = False
    with _installed:
        if _state["installed"]:
            return
        _state["installed"] = True
        # Registered after torch's import, so it runs before torch's own exit handlers (LIFO),
        # while the group and its store are still there.
        atexit.register(_mark_at_exit)
        multiprocessing.util.Finalize(None, _note_exit_error, exitpriority=0)
        for owner in (dist, dist.distributed_c10d):
            original = owner.destroy_process_group
            if not getattr(original, "_mini_ddp_marks", False):
                owner.destroy_process_group = _marking(original)


def _marking(original: Any) -> Any:
    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        if group is None or group is dist.GroupMember.WORLD:
            # In a `finally:` after a failure the exception is still in flight: not a finish.
            _mark_end("destroyed its process group", sys.exc_info()[1])
        return original(group)

    destroy_process_group._mini_ddp_marks = True  # type: ignore[attr-defined]
    return destroy_process_group


def _note_exit_error() -> None:
    # multiprocessing runs its finalizers inside the `finally:` of the child's bootstrap, so an
    # exception that ends a spawned rank (torch.multiprocessing.spawn turns it into
    # sys.exit(1)) is still in flight here; atexit, later, no longer sees it.
    _state["exit_error"] = sys.exc_info()[1]


def _mark_at_exit() -> None:
    # sys.last_value: the uncaught exception that ended the script (printed by the interpreter).
    _mark_end("exited cleanly", _state.get("exit_error") or getattr(sys, "last_value", None))


def _failure(error: BaseException | None) -> str:
    """The words for an exception that ends a rank ("" when it is no failure: sys.exit(0))."""
    if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
        return ""
    if isinstance(error, SystemExit):
        return f"SystemExit: exit code {error.code}"
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def _mark_end(how: str, error: BaseException | None) -> None:
    failure = _failure(error)
    if failure:
        mark_finished("raised", error=failure)
    else:
        mark_finished(how)


def note_mistake(text: str) -> None:
    """Carry ``text`` (a check's verdict on this rank's own script, e.g. a bypassed wrapper) in
    this rank's finish mark: a peer then reads that mistake, not uneven inputs, as the cause."""
    if not _state["mistake"]:
        _state["mistake"] = text[:600]


def mark_failed(error: BaseException) -> bool:
    """Leave this rank's mark as failed with ``error`` (a harness that catches a rank's
    exception and then destroys the group calls this first, so the peers do not read the
    destroy as a clean finish)."""
    return mark_finished("raised", error=_failure(error) or type(error).__name__)


def mark_finished(how: str, error: str = "") -> bool:
    """Leave this rank's finish mark (once per process; the first one counts): ``how`` it
    finished ("destroyed its process group", "exited cleanly", or "raised" with ``error``).
    False when there is no group, the store did not take it within :data:`FINISH_MARK_S`, or
    this process is a child forked from the rank (its end is not the rank's: it never marks)."""
    if not dist.is_available() or not dist.is_initialized() or not _marks_for_this_process():
        return False
    try:
        store = default_store()
        if _state["marked"] == id(store):  # the first end counts (destroy, then exit)
            return False
        _state["marked"] = id(store)
        rank = dist.get_rank()
        mark = json.dumps({"how": how, "step": _steps(), "time": time.time(), "error": error,
                           "mistake": _state["mistake"]})
        bounded_store_call(store, lambda s: s.set(KEY.format(rank), mark), FINISH_MARK_S,
                           "this rank's finish mark")
    except (StoreUnanswered, RuntimeError, ValueError) as problem:
        logger.debug("mini_ddp: no finish mark left: %s", problem)
        return False
    return True


def peer_states(world_size: int | None = None, store: Any = None,
                timeout_s: float = READ_S, group: Any = None) -> dict[int, PeerState]:
    """Every rank's last known state from the store (its finish mark), within ``timeout_s``.

    ``group``: the ranks of that process group, by group rank (each process's mark is under
    its global rank); default every rank of the default group. ``store``: default the default
    process group's; ``world_size``: default the group's size. A rank without a mark is
    ``"unknown"``; when the store does not answer, every rank is ``"unreachable"`` with the
    store's sentence as ``error``. Never raises for the store.
    """
    if store is None or world_size is None:
        if not dist.is_available() or not dist.is_initialized():
            return {}
        try:
            if world_size is None:
                world_size = dist.get_world_size(group)
            store = default_store() if store is None else store
        except (RuntimeError, ValueError):
            return {}
    size = world_size
    # A process leaves one mark, under its global rank: a group's rank r reads its member's.
    members = list(range(size)) if group is None or group is dist.GroupMember.WORLD \
        else [dist.get_global_rank(group, r) for r in range(size)]

    def read(s: Any) -> dict[int, dict[str, Any]]:
        keys = [KEY.format(members[r]) for r in range(size)]
        return {r: json.loads(s.get(k)) for r, k in enumerate(keys) if s.check([k])}

    try:
        marks = bounded_store_call(store, read, timeout_s, "the ranks' finish marks")
    except StoreUnanswered as problem:
        return {r: PeerState(r, "unreachable", error=str(problem)) for r in range(size)}
    states = {}
    for rank in range(size):
        mark = marks.get(rank)
        if mark is None:
            states[rank] = PeerState(rank, "unknown")
        else:
            states[rank] = PeerState(rank, "failed" if mark["how"] == "raised" else "finished",
                                     mark["how"], mark.get("step"), mark.get("error", ""),
                                     mark.get("time"), mark.get("mistake", ""))
    return states


def describe_finished(states: dict[int, PeerState], rank: int) -> str:
    """The sentence about the other ranks for an error on ``rank`` ("" when none left a mark,
    so the caller keeps its own words): who finished or failed, and what to do about it."""
    others = [s for r, s in sorted(states.items()) if r != rank]
    if others and all(s.state == "unreachable" for s in others):
        return (f"Whether another rank finished or died is unknown: {others[0].error} (it runs "
                "in one rank's process, usually rank 0's, which may be the one gone).")
    ended = [s for s in others if s.state in ("finished", "failed")]
    if not ended:
        return ""
    text = "; ".join(s.describe() for s in ended) + "."
    steps = _steps()
    never = [s for s in ended if s.state == "finished" and not s.mistake and s.step == 0]
    if never:
        # Proven by the mark: it ended without one synchronised step, while others train.
        text += (f" Ranks {[s.rank for s in never]} never completed a synchronised step: "
                 "their training forward bypasses the wrapper (model.module(x) trains alone, "
                 "its gradients never averaged: call model(x)), or their loop got no batches.")
    if any(s.state == "finished" and not s.mistake and s.step != 0 for s in ended):
        here = "" if steps is None else f"; this rank was in step {steps}"
        text += (f" A rank that finished while others still train means the ranks ran "
                 f"different numbers of steps (uneven inputs{here}): give every rank the same "
                 "number of batches — DistributedSampler(drop_last=True) — or train inside "
                 "model.join() so the ranks that run out keep answering the others.")
    if any(s.state == "failed" for s in ended):
        text += " Its own log has the traceback."
    silent = [s.rank for s in others if s.state == "unknown"]
    if silent:
        text += (f" Ranks {silent} left no mark of finishing: still running, or gone "
                 "(killed, out of memory, crashed).")
    return text


def _watched_group() -> Any:
    """The one process group this process's watched models reduce over (None: the default
    group, or models on several groups, whose ranks are then read as the default group's)."""
    groups = {id(r.group): r.group for r in list(_WATCHED) if getattr(r, "group", None)}
    return next(iter(groups.values())) if len(groups) == 1 else None


def explain_peers(rank: int) -> str:
    """What the store knows of the other ranks, for :class:`~mini_ddp.errors.CollectiveError`
    on ``rank`` ("" when nothing: no group, or no rank left a mark). Bounded by
    :data:`READ_S`. ``rank`` and the ranks named are ranks of the group this process's models
    reduce over (a subgroup's when they all use one)."""
    try:
        states = peer_states(group=_watched_group())
    except Exception:  # noqa: BLE001 - an error message must be built in any case
        return ""
    return describe_finished(states, rank) if states else ""


explain_peers_with(explain_peers)

"""Collective fingerprints: before mini_ddp's collectives, the ranks check they run the same ones.

torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the process group in a ``ProcessGroupWrapper``
that, before every collective, all-gathers a fingerprint (sequence number, op type, tensor
shapes and dtypes) on a helper Gloo group and raises "Detected mismatch between collectives on
ranks" when they differ. It cannot tell *which* mistake made them differ, and it misses
collectives that happen to have the same shape (the buffer broadcast of an evaluation forward
on one rank pairs silently with the next training broadcast of the others).

Under mini_ddp's debug switch (:func:`mini_ddp.checks.debug.debug_requested`) the model does
the same for its own collectives, with what they mean: before the collectives of each forward
(the bucket rebuild, the buffer broadcast) and before the first bucket of each synchronised
backward, each rank posts a fingerprint — sequence number, forward or backward, the step, grad
mode, whether buffers are broadcast, and the user's line that called the forward — on a
:class:`~mini_ddp.checks.rank_board.RankBoard`, and waits for its peers' fingerprint of the same
sequence number (the store, not a collective: a collective could pair with the wrong one).

* A different fingerprint raises :class:`SyncMismatchError` on every rank, before the
  collective that would have paired wrongly, naming the mistake: an extra forward through the
  wrapper on one rank (evaluation: use ``model.module(x)``), ranks that ran different numbers
  of steps (uneven inputs: ``join()`` or ``DistributedSampler(drop_last=True)``).
* A peer that does not come within ``warn_s`` (the stall warning's limit) is asked where it is
  (its Python stack, through the stall monitor's responder): a peer inside a
  ``torch.distributed`` collective that mini_ddp did not issue is named with its line — a
  collective on some ranks only, or uneven inputs: :class:`SyncMismatchError` then, since
  the two can never pair. Otherwise a WARNING then, :class:`SyncMismatchError` at
  ``timeout_s`` (``sync_timeout_s``).

Cost: two store round trips per step and a wait for the slowest rank at each fingerprint —
debugging only (torch's DETAIL mode costs an all-gather per collective).
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mini_ddp.errors import UNEVEN_FIX, SyncMismatchError
from mini_ddp.watch.stacks import (
    EVAL_FIX,
    elsewhere_verdict,
    in_mini_ddp_or_torch,
    stuck_in_collective,
)

logger = logging.getLogger("mini_ddp")

ENDED_POLL_S = 0.5
"""How often a waiting rank reads its late peers' finish marks."""


def caller_line() -> str:
    """The user's line that called the model's forward: ``file:line in function``."""
    frame = sys._getframe(1)
    while frame is not None and (in_mini_ddp_or_torch(frame.f_code.co_filename)
                                 or frame.f_code.co_filename.startswith("<")):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


def describe(fp: dict[str, Any]) -> str:
    """A fingerprint in words."""
    if fp["kind"] == "backward":
        return f"the first bucket all-reduce of step {fp['step']}'s backward"
    mode = "" if fp["grad"] else " under no_grad"
    what = "a training forward" if fp["grad"] and fp["synced"] else \
        "a forward" + (" inside no_sync()" if fp["grad"] else "")
    bcast = ", broadcasting buffers" if fp["broadcast"] else ""
    return f"{what}{mode} (step {fp['step']}{bcast}, called at {fp['where']})"


def verdict(mine: tuple[int, dict], theirs: dict[int, dict], previous: dict[int, dict | None]
            ) -> str:
    """Name the mistake behind fingerprints that differ at one sequence number.

    ``mine``/``theirs``: ``(rank, fingerprint)`` of this rank and its peers; ``previous``: each
    rank's fingerprint before that one (None: it had none), to find a forward without backward.
    """
    everyone = {mine[0]: mine[1], **theirs}
    lines = [f"rank {r}: {describe(fp)}" for r, fp in sorted(everyone.items())]
    head = "mini_ddp: the ranks are about to run different collectives: " + "; ".join(lines)
    fwd = {r: fp for r, fp in everyone.items() if fp["kind"] == "forward"}
    bwd = {r: fp for r, fp in everyone.items() if fp["kind"] == "backward"}
    evals = {r: fp for r, fp in fwd.items() if not (fp["grad"] and fp["synced"])}
    if evals and len(evals) < len(everyone):
        ranks = sorted(evals)
        who = f"Ranks {ranks} run" if len(ranks) > 1 else f"Rank {ranks[0]} runs"
        return (f"{head}. {who} an extra forward "
                f"through DataParallelModel that the other ranks do not run (called at "
                f"{evals[ranks[0]]['where']}): its buffer broadcast would pair with another "
                f"collective of theirs — silently, when the sizes agree. Fix: {EVAL_FIX}. See "
                "docs/debugging.md.")
    if fwd and bwd:
        # A rank in forward while another starts backward: its previous forward had none.
        extra = {r: previous.get(r) for r in fwd
                 if previous.get(r) and previous[r]["kind"] == "forward"}
        if extra:
            r, fp = sorted(extra.items())[0]
            return (f"{head}. Rank {r}'s previous forward (step {fp['step']}, called at "
                    f"{fp['where']}) was not followed by a backward, while ranks {sorted(bwd)} "
                    "run that step's backward: an extra forward through DataParallelModel on "
                    f"rank {r} (evaluation or logging on one rank?). Fix: {EVAL_FIX}. See "
                    "docs/debugging.md.")
    steps = {r: fp["step"] for r, fp in everyone.items()}
    if len(set(steps.values())) > 1:
        shown = ", ".join(f"rank {r}: {s}" for r, s in sorted(steps.items()))
        return (f"{head}. The ranks ran different numbers of synchronised steps ({shown}): "
                f"uneven inputs, or a step run through the wrapper on some ranks only. Fix: "
                f"{UNEVEN_FIX}. See docs/debugging.md.")
    return (f"{head}. Every rank must run the same forwards and backwards through "
            "DataParallelModel, in the same order. See docs/debugging.md.")


class Fingerprints:
    """One model's fingerprints on ``board`` (see the module docstring).

    ``ask(ranks) -> {rank: answer}`` asks late peers for their stacks (None: nobody can be
    asked); ``last_state(rank) -> dict | None`` gives a peer's last known state, a dict with at
    least ``step`` (and ``kind``/``where`` for :func:`describe`): by default its last
    fingerprint on the board; any record of where each rank got to can stand in.
    """

    def __init__(self, model: Any, board: Any, warn_s: float | None, timeout_s: float | None,
                 ask: Callable[[list[int]], dict[int, Any]] | None = None,
                 last_state: Callable[[int], dict | None] | None = None,
                 ended: Callable[[list[int]], str] | None = None):
        self._model = weakref.ref(model)
        self.board = board
        self.warn_s = warn_s
        self.timeout_s = timeout_s
        self.ask = ask
        self._last_state = last_state
        # ended(ranks): what the store says of those of `ranks` that finished or failed ("":
        # none did); a late peer that ended will never come.
        self.ended = ended
        self._answers: dict[int, Any] = {}
        self.seq = 0
        self.paused = False  # once join() has run: see SyncChecks.before_collectives
        self._history: list[dict] = []
        self.verdicts: Callable[[], dict[int, str]] = lambda: {}

    def forward(self, grad_enabled: bool, synced: bool, broadcast: bool, step: int) -> None:
        """Before a forward's collectives (rebuild, buffer broadcast)."""
        if not (synced or broadcast):
            return  # a forward without a collective cannot pair with the wrong one
        self.check({"kind": "forward", "step": step, "grad": grad_enabled, "synced": synced,
                    "broadcast": broadcast, "where": caller_line()})

    def backward(self, step: int) -> None:
        """Before a synchronised backward's first bucket all-reduce."""
        if self.paused:
            return
        self.check({"kind": "backward", "step": step, "grad": True, "synced": True,
                    "broadcast": False, "where": ""})

    def peer_state(self, rank: int) -> dict | None:
        """``rank``'s last known state (default: its last fingerprint; None: none yet)."""
        if self._last_state is not None:
            return self._last_state(rank)
        return self.board.read("last", rank)

    def check(self, fp: dict[str, Any]) -> None:
        """Post ``fp`` as the next sequence number's; wait for the peers', compare."""
        self.seq += 1
        fp = {**fp, "seq": self.seq, "time": time.time()}
        key = f"fp/{self.seq}"
        board = self.board
        board.post(key, fp)
        board.post("last", fp)
        if self.seq > 2:
            board.remove(f"fp/{self.seq - 2}")  # every peer has read it: it is at seq - 1
        previous = self._history[-1] if self._history else None
        self._history = [*self._history[-1:], fp]
        theirs = self._wait(key, fp)
        if board.offline:
            return  # the store stopped answering: nothing to compare (RankBoard logged it)
        same = ("kind", "step", "grad", "synced", "broadcast")
        if any(tuple(t[k] for k in same) != tuple(fp[k] for k in same) for t in theirs.values()):
            before = {r: board.read(f"fp/{self.seq - 1}", r) for r in theirs}
            raise SyncMismatchError(verdict((board.rank, fp), theirs,
                                            {board.rank: previous, **before}))

    def _wait(self, key: str, fp: dict) -> dict[int, dict]:
        board = self.board
        warn_s = self.warn_s if self.warn_s is not None else self.timeout_s
        gone = {"text": "", "next": time.monotonic() + ENDED_POLL_S}

        def stop() -> bool:
            if self.verdicts():
                return True
            if self.ended is not None and time.monotonic() >= gone["next"]:
                gone["next"] = time.monotonic() + ENDED_POLL_S
                gone["text"] = self.ended([r for r in board.peers if board.read(key, r) is None])
            return bool(gone["text"])

        found = board.wait_all(key, warn_s or 60.0, stop=stop)
        if len(found) == len(board.peers) or board.offline:
            return found
        late = [r for r in board.peers if r not in found]
        if gone["text"]:
            raise SyncMismatchError(self._ended_report(fp, late, gone["text"]))
        text = self._late_report(fp, late, warn_s)
        if self.verdicts() or any(stuck_in_collective(self._answers.get(r, {})) for r in late):
            # A peer inside a collective this rank does not run here can never pair with it:
            # waiting longer only turns the error into the backend's timeout.
            raise SyncMismatchError(text)
        silent = [r for r in late if r in self._answers and not self._answers[r]["answered"]]
        if silent and len(silent) == len(late):
            # Gone (killed, crashed: no mark) or holding the GIL: the default path's verdict
            # comes from the collective itself, at once for a rank that is gone.
            logger.warning("%s\n  Ranks %s neither left a finish mark nor answered: the "
                           "collective check steps aside and the collective itself decides "
                           "(it fails at once when a rank is gone).", text, silent)
            return found
        logger.warning("%s", text)
        rest = None if self.timeout_s is None else max(self.timeout_s - (warn_s or 0), 0.0)
        found.update(board.wait_all(key, rest if rest is not None else 1e9, stop=stop))
        if len(found) == len(board.peers) or board.offline:
            return found
        late = [r for r in board.peers if r not in found]
        if gone["text"]:
            raise SyncMismatchError(self._ended_report(fp, late, gone["text"]))
        raise SyncMismatchError(self._late_report(fp, late, self.timeout_s))

    def _ended_report(self, fp: dict, late: list[int], marks: str) -> str:
        """The error for late peers that ended: what the store proves comes first."""
        return (f"mini_ddp: rank {self.board.rank} is about to run {describe(fp)} for ranks "
                f"{late}, which have not reached it and never will: they ended. What the other "
                f"ranks left in the store: {marks} (MINI_DDP_DEBUG's collective check.)")

    def _late_report(self, fp: dict, late: list[int], waited: float | None) -> str:
        me = self.board.rank
        told = self.verdicts()
        lines = [f"mini_ddp: rank {me} waited {waited:g} s before {describe(fp)} for ranks "
                 f"{late}, which have not reached it (MINI_DDP_DEBUG's collective check)."]
        answers = {} if self.ask is None or told else self.ask(late)
        self._answers = answers
        for rank in late:
            if rank in told:
                lines.append(f"  rank {rank} reported: {told[rank]}")
                continue
            last = self.peer_state(rank)
            state = "it posted no fingerprint yet (it never ran a forward through the wrapper)" \
                if last is None else f"its last was {describe(last)}" if "kind" in last \
                else f"its last known state: step {last.get('step')} ({last.get('state', '?')})"
            lines.append(f"  rank {rank}: {state}.")
            elsewhere = elsewhere_verdict(rank, answers.get(rank, {}), me, fp["step"],
                                          None if last is None else last["step"])
            if elsewhere:
                lines.append(elsewhere)
            elif rank in answers and answers[rank].get("answered"):
                where = answers[rank]["stacks"][0]["where"] if answers[rank]["stacks"] else "?"
                lines.append(f"  rank {rank} is at {where}: slow, or it runs a different "
                             "program path (a forward through model.module instead of the "
                             "wrapper?). See docs/debugging.md.")
        return "\n".join(lines)

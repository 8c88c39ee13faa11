"""The errors mini_ddp raises instead of hanging or diverging silently.

Each names the culprit: the rank, the parameter names and what was being waited for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class MiniDDPError(RuntimeError):
    """Base class of mini_ddp's own errors."""


class SyncMismatchError(MiniDDPError):
    """The ranks are about to run different collectives (or a rank never came)."""


class UnfinishedReductionError(MiniDDPError):
    """A forward started while the previous backward left parameters without a gradient.

    ``static_graph`` and ``find_unused_parameters`` are the model's settings: as in torch's
    ``Reducer::ensure_prior_reduction_finished``, they decide which explanation and advice
    the message gives (the advice for one setting is wrong for the others). ``frozen``: those
    of ``names`` that no longer require a gradient (frozen after wrapping).
    """

    def __init__(self, rank: int, names: list[str], indices: list[int],
                 static_graph: bool = False, find_unused_parameters: bool = False,
                 frozen: list[str] | None = None, unfinished: list[str] | None = None):
        self.rank, self.names, self.indices = rank, names, indices
        self.unfinished = unfinished or []
        listed = ", ".join(names[:20]) + (f", … ({len(names)} in all)" if len(names) > 20 else "")
        culprits = (f"The previous backward gave no gradient to these parameters on rank {rank}: "
                    f"{listed} (indices {indices[:20]}).")
        if not names:
            # Every gradient arrived, yet the reduction did not finish: the backward was cut
            # short after its last gradient (a communication hook or a gradient hook raised,
            # and the caller caught it and went on). Name what was left undone instead.
            undone = "; ".join(self.unfinished[:6]) or "its end-of-backward wait"
            culprits = (f"On rank {rank}, though, every parameter got its gradient in the "
                        f"previous backward, but its reduction never finished: {undone} — the "
                        "backward was interrupted (an exception raised in a communication hook "
                        "or a gradient hook, caught and followed by a new forward). The other "
                        "ranks may be waiting for this rank in that step: after such an error, "
                        "restart the job (or every rank's step) instead of retrying on one rank.")
        # torch's sentences, verbatim (including its lower-case "this" and double space).
        if static_graph:
            why = ("This error indicates that your training graph has changed in this "
                   "iteration, e.g., one parameter is used in first iteration, but then got "
                   "unused in the second iteration. this is not compatible with static_graph "
                   "set to True.")
            advice = ("With static_graph=True every iteration must use the same parameters: "
                      "if which parameters are used changes from step to step, drop "
                      "static_graph and pass find_unused_parameters=True instead.")
        elif find_unused_parameters:
            why = ("Since `find_unused_parameters=True` is enabled, this likely  means that "
                   "not all `forward` outputs participate in computing loss.")
            advice = ("Put every forward output that depends on them into the loss (or detach "
                      "the outputs you do not use).")
        else:
            why = ("This error indicates that your module has parameters that were not used "
                   "in producing loss.")
            advice = ("Either they were not used to compute the loss — pass "
                      "find_unused_parameters=True to DataParallelModel — or some forward "
                      "outputs that depend on them were left out of the loss.")
        if frozen:
            # Freezing after wrapping: the reducer still expects their gradients, as torch's.
            advice = (f"{', '.join(frozen[:20])} no longer require a gradient: "
                      "requires_grad_(False) after wrapping does not remove a parameter from "
                      "the all-reduce. Freeze before wrapping (and wrap again to change what is "
                      "frozen), or pass find_unused_parameters=True. " + advice)
        super().__init__(
            "mini_ddp: Expected to have finished reduction in the prior iteration before "
            f"starting a new one. {why} {culprits} {advice}")


class MarkedTwiceError(MiniDDPError):
    """A parameter's gradient arrived twice in one synchronised backward."""

    def __init__(self, rank: int, name: str, index: int, after_sync: bool = False,
                 read_by_group: bool = False):
        self.rank, self.name, self.index = rank, name, index
        if after_sync:
            # torch DDP ignores such a gradient: it stays local and the ranks silently diverge.
            super().__init__(
                f"mini_ddp: parameter '{name}' (index {index}) received a gradient on rank "
                f"{rank} after this step's gradients were already synchronised: backward() ran "
                "a second time on the same forward (retain_graph=True), or through the inner "
                "module without a DataParallelModel forward. That gradient would not be "
                "averaged across ranks. Sum the losses and call backward once per forward, "
                "or accumulate on purpose inside model.no_sync().")
            return
        super().__init__(
            # torch's C++ reducer opens with this sentence (a RuntimeError); ours adds the name.
            "Expected to mark a variable ready only once. "
            f"mini_ddp: parameter '{name}' "
            f"(index {index}) received a second gradient in the same backward on rank {rank}. "
            "Typical causes: the parameter is used in several reentrant backward passes "
            "(activation checkpointing with use_reentrant=True), it is shared by several "
            "modules wrapped separately, or backward ran twice on one forward. If the graph "
            "is the same every iteration, static_graph=True supports this."
            + (" (Found by its group's hook, which serves several gradients: the version "
               "counter of its .grad had moved further than one accumulation since backward "
               "began, so either a second gradient arrived or code inside backward changed it "
               "in place. grouped_hooks=False reads every gradient in its own hook, as torch "
               "DDP's reducer does.)" if read_by_group else ""))


class GradChangedLateError(MiniDDPError):
    """A gradient read after its hook had changed since the hook fired."""

    def __init__(self, rank: int, name: str, index: int):
        self.rank, self.name, self.index = rank, name, index
        super().__init__(
            f"mini_ddp: the .grad of parameter '{name}' (index {index}) changed on rank {rank} "
            "after its gradient hook fired and before its bucket read it. torch DDP reads each "
            "gradient inside its hook, so it all-reduces the value from before that change; "
            "mini_ddp reads a bucket's gradients together once the bucket is full, and has "
            "only the changed value. What changed it runs inside backward where no hook "
            "table shows it: a hook on an activation or a custom autograd.Function that "
            "writes into a parameter's .grad, from a later backward on than the first ones. "
            "Pass grouped_hooks=False to read every gradient in its own hook, as torch DDP "
            "does, or let it act from the first backward on (mini_ddp then sees the change "
            "and reads at the hooks on its own).")


class GradSyncTimeout(MiniDDPError):
    """A bucket's collective did not finish within the configured deadline."""

    def __init__(self, rank: int, timeout_s: float | None, bucket: Any, names: list[str],
                 num_buckets: int, late: str = ""):
        self.rank, self.timeout_s, self.bucket = rank, timeout_s, bucket
        self.late = late  # the late ranks and where they were, as the stall monitor found them
        what = describe_bucket(bucket, names, num_buckets)
        super().__init__(
            f"mini_ddp: rank {rank} waited more than {timeout_s} s for {what}. Another rank "
            "is probably dead, stuck, or skipped this bucket (a parameter that got no gradient "
            "there). Raise DataParallelModel(sync_timeout_s=...) if steps are legitimately "
            "this slow. If no rank is slow, MINI_DDP_DEBUG=1 names the usual mistakes behind "
            "this (docs/debugging.md)." + (f"\n{late}" if late else ""))


def describe_bucket(bucket: Any, names: list[str], num_buckets: int) -> str:
    """Name the collective of ``bucket`` (None: the unused-parameter map) for an error."""
    if bucket is None:
        return "the unused-parameter map all-reduce"
    shown = ", ".join(names[i] for i in bucket.param_indices[:6])
    return (f"the all-reduce of bucket {bucket.index} of {num_buckets} "
            f"({len(bucket.param_indices)} params: {shown}"
            f"{', …' if len(bucket.param_indices) > 6 else ''})")


_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
UNEVEN_FIX = ("give every rank the same number of batches — DistributedSampler(dataset, "
              "drop_last=True) (and a DataLoader without a partial last batch) — or wrap the "
              "training loop in `with model.join():`")
"""The fix for uneven inputs, as every message that suspects them words it."""
DEBUG_HINT = ("MINI_DDP_DEBUG=1 names which of these it is, with each rank's step "
              "(docs/debugging.md).")


class CollectiveError(MiniDDPError):
    """A collective failed or timed out: most often another rank died, hung or was killed.

    ``what`` names the collective (which bucket, which broadcast), ``cause`` is the backend's
    own message (kept whole as ``__cause__``).
    """

    def __init__(self, rank: int, what: str, cause: BaseException, late: str = ""):
        self.rank, self.what = rank, what
        self.late = late  # the late ranks, when the backend's own timeout ended the wait
        # Gloo prefixes its source path and appends boilerplate; the middle is what happened.
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        reason = re.sub(r"^\[[^\]]*:\d+\]\s*", "", first)
        reason = reason.split(" This is typically caused by")[0].rstrip(" .")
        # What the other ranks left in the store as they ended (a rank that finished is not
        # a rank that died); "" when none did, or nobody registered a reader.
        self.peers = _peer_notes(rank)
        after = f"\n{late}" if late else ""
        if self.peers and not self.peers.startswith("Whether another rank"):
            # What the marks prove leads; the backend's words ("closed by peer") follow, as
            # they cannot tell a rank that finished from one that was killed.
            super().__init__(
                f"mini_ddp: rank {rank}: {what} failed because another rank ended before it. "
                f"What the other ranks left in the store: {self.peers} (The backend said: "
                f"{reason}.) This process group cannot be used any more; restart the job "
                "(e.g. torchrun --max-restarts=N) and resume from the last checkpoint." + after)
            return
        unknown = f" {self.peers}" if self.peers else ""  # the store did not answer
        if _TIMED_OUT.search(reason):
            # The backend's own deadline: every connection is still open, so no rank exited
            # or was killed (its sockets close at once and read as "reset"/"closed by peer"):
            # "most likely died" would send the user after a crash that did not happen.
            super().__init__(
                f"mini_ddp: rank {rank}: {what} failed: {reason}. No rank closed its "
                "connection (a rank that exits or is killed closes it at once): the others "
                f"are stuck or slow{' (the lines below name the late ranks)' if late else ''}, "
                "unreachable (a lost host or network), or alive and running a different "
                "collective: uneven inputs (one rank ran more "
                f"steps: {UNEVEN_FIX}), a forward through the wrapper or a collective on some "
                f"ranks only.{unknown} {DEBUG_HINT} This process group cannot be used any more; "
                "restart the job (e.g. torchrun --max-restarts=N) and resume from the last "
                "checkpoint." + after)
            return
        super().__init__(
            f"mini_ddp: rank {rank}: {what} failed: {reason}. Another rank has most likely "
            "died (killed, out of memory, crashed), hung, or lost its connection: its own log "
            f"says why.{unknown} This process group cannot be used any more; restart the job "
            "(e.g. torchrun --max-restarts=N) and resume from the last checkpoint." + after)


_PEER_READERS: list[Callable[[int], str]] = []


def explain_peers_with(reader: Callable[[int], str]) -> None:
    """Make :class:`CollectiveError` ask ``reader(rank)`` what the other ranks did (the
    engine's :func:`mini_ddp.watch.peers.explain_peers`: who finished, who failed). This
    module is the lowest layer, so the reader is handed in rather than imported."""
    if reader not in _PEER_READERS:
        _PEER_READERS.append(reader)


def _peer_notes(rank: int) -> str:
    for reader in _PEER_READERS:
        try:
            text = reader(rank)
        except Exception:  # noqa: BLE001 - the error is raised in any case, with what we know
            continue
        if text:
            return text
    return ""


TORCH_MISMATCH = "Detected mismatch between collectives on ranks."
"""How torch's ``ProcessGroupWrapper`` (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) opens its verdict."""
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+),? ?OpType=(\w+)(?:, TensorShape=(\[[^\]]*\]))?")


class CollectiveMismatchError(MiniDDPError):
    """torch's DETAIL check found that the ranks run different collectives, inside one of
    mini_ddp's: the message opens with torch's verdict, verbatim, then says what it means."""

    def __init__(self, rank: int, what: str, cause: BaseException):
        self.rank, self.what = rank, what
        text = str(cause).strip()
        sides = "; ".join(f"rank {r}: {op.lower()}{f' of shape {shape}' if shape else ''} "
                          f"(collective #{seq})" for r, seq, op, shape in _FINGERPRINT.findall(text))
        super().__init__(
            f"{text}\nmini_ddp: rank {rank}: {what} met a different collective on another rank "
            f"(torch's TORCH_DISTRIBUTED_DEBUG=DETAIL check{': ' + sides if sides else ''}) — "
            "no rank died: the ranks issue different collectives. Usual causes: a forward "
            "through DataParallelModel on one rank only (evaluate with model.module(x) under "
            "torch.no_grad()), uneven inputs (DistributedSampler(drop_last=True), or "
            "model.join()), a collective run on some ranks only (run it on every rank). "
            "See docs/debugging.md.")


@contextmanager
def naming_collective(rank: int, what: str | Callable[[], str], late: str = "") -> Iterator[None]:
    """Re-raise a backend failure inside the block as :class:`CollectiveError` naming ``what``.

    ``what`` may be a callable, so the hot path builds no message until something fails;
    ``late``: lines naming the ranks that had not arrived (added after the message).

    torch DDP lets the raw backend error through (for Gloo: "Connection reset by peer" and a
    C++ source path), which says neither which collective nor which step failed.
    """
    try:
        yield
    except MiniDDPError:
        raise
    except RuntimeError as err:  # Gloo and NCCL raise RuntimeError (or DistError subclasses)
        raise collective_error(rank, what() if callable(what) else what, err, late) from err


def collective_error(rank: int, what: str, err: BaseException, late: str = ""
                     ) -> CollectiveError:
    """The error :func:`naming_collective` raises for a backend failure ``err`` of ``what``
    (for a caller that catches it itself: no context manager on its path)."""
    if TORCH_MISMATCH in str(err):  # torch's DETAIL verdict: a desync, not a death
        return CollectiveMismatchError(rank, what, err)
    return CollectiveError(rank, what, err, late)

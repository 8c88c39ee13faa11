"""mini_ddp's debug switch, and the checks a model runs with and without it.

**Always on** (nearly free, docs/debugging.md has the figures; ``replica_check_every=None``
turns both off): the replica check (:mod:`mini_ddp.checks.replicas` — identical data on every
rank at step 1; parameters, buffers, train/eval modes, parameter sets and the count of buffer
broadcasts outside a training step (an extra forward on one rank) compared at step 1 and every
``replica_check_every`` steps), and the rank a NaN/Inf came from, read from one small gradient
per backward (:class:`~mini_ddp.checks.grad_watch.NonFiniteSentinel`); a WARNING when
something differs.

**The debug switch** — ``DataParallelModel(..., debug=True)``, or the environment variable
``MINI_DDP_DEBUG=1``, or torch's own ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` — adds what costs a
store round trip or a pass over every gradient per step:

* collective fingerprints (:mod:`mini_ddp.checks.fingerprint`): an extra forward through the
  wrapper on one rank, uneven inputs, a collective on some ranks only — named before the
  collective that would pair wrongly;
* the local-gradient watch (:mod:`mini_ddp.checks.grad_watch`): the rank and parameter where a
  NaN/Inf first appeared, a training forward that bypasses the wrapper;
* the replica check raises :class:`~mini_ddp.checks.replicas.ReplicasDifferError` instead of
  warning.

With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch's ``ProcessGroupWrapper`` checks every
collective's shape as well; when it finds a mismatch inside one of mini_ddp's collectives, the
error opens with torch's verdict and says which of mini_ddp's collectives met it
(:class:`mini_ddp.errors.CollectiveMismatchError`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.checks.fingerprint import Fingerprints
from mini_ddp.checks.grad_watch import GradWatch, NonFiniteSentinel
from mini_ddp.checks.rank_board import RankBoard
from mini_ddp.checks.replicas import ReplicaCheck
from mini_ddp.engine import observer
from mini_ddp.engine.config import DEBUG_ENV, debug_requested  # noqa: F401  (the switch, here too)
from mini_ddp.watch.peers import describe_finished, note_mistake, peer_states
from mini_ddp.watch.stacks import ask_stacks

ENV = DEBUG_ENV
SWITCH = "MINI_DDP_DEBUG=1 (or DataParallelModel(debug=True), or TORCH_DISTRIBUTED_DEBUG=DETAIL)"


class SyncChecks:
    """The checks of one model; the model calls :meth:`before_collectives` at the start of
    each forward and :meth:`after_buffer_sync` after a synchronised forward's broadcast."""

    def __init__(self, model: Any, debug: bool, replica_check_every: int | None,
                 board: RankBoard | None = None):
        reducer = model.reducer
        self.debug = debug
        # Numbered per model in construction order, which every rank shares (construction is
        # collective); a reducer rebuilt by _set_static_graph passes its old board on.
        self.board = board or RankBoard(model.process_group, reducer.rank, reducer.world_size)
        self.single = reducer.world_size == 1
        self.replicas = None if self.single or (replica_check_every is None and not debug) \
            else ReplicaCheck(model, self.board, replica_check_every, strict=debug)
        # Where a NaN came from, by default from one small gradient per backward; the switch's
        # GradWatch reads every gradient instead.
        self.sentinel = None if self.single or debug or replica_check_every is None \
            else NonFiniteSentinel(model, self.board)
        self.fingerprints = self.watch = None
        if debug and not self.single:
            config = model.config
            monitor = weakref.ref(model)
            self.fingerprints = Fingerprints(model, self.board, config.stall_warning_s,
                                             config.sync_timeout_s,
                                             ask=lambda ranks: _ask(monitor(), ranks),
                                             ended=lambda ranks: _ended(reducer.rank, ranks))
            self.watch = GradWatch(model, self.board, self.fingerprints,
                                   on_mistake=note_mistake)
            self.fingerprints.verdicts = self._verdicts

    def _verdicts(self) -> dict[int, str]:
        found = {}
        for rank in self.board.peers:
            text = self.board.read("verdict", rank)
            if text is not None:
                found[rank] = text
        return found

    def before_collectives(self, grad_enabled: bool, synced: bool, broadcast: bool,
                           step: int, joining: bool = False) -> None:
        """Debug switch: a forward is about to run its collectives (if any). ``joining``:
        the model has been inside ``join()`` (torch's ``Join`` leaves the model's join config
        enabled after the context): the fingerprints pause for good — a joined rank shadows
        the others' collectives without their forwards, and counts no steps."""
        if self.sentinel is not None:  # mini_ddp.attach calls this at every forward
            self.sentinel.forward()
        if self.replicas is not None and broadcast and not synced:
            self.replicas.broadcast_off_step()
        if self.watch is not None and grad_enabled:
            self.watch.forward_seen()
        if self.fingerprints is not None:
            self.fingerprints.paused = joining
            if not joining:
                self.fingerprints.forward(grad_enabled, synced, broadcast, step)

    def after_buffer_sync(self, step: int, buffers_synced: bool, joining: bool = False
                          ) -> None:
        """A synchronised forward ``step`` has broadcast its buffers (or had none to).

        Once ``join()`` has run, the ranks' step counts may differ for good (a joined rank
        counts no steps while it shadows the others): the replica check, which pairs records
        by step, stops."""
        if joining and self.replicas is not None:
            self.replicas.remove()
            self.replicas = None
        if self.replicas is not None:
            self.replicas.before_forward(step, buffers_synced)
        if self.watch is not None:
            self.watch.peers_nonfinite()

    # ---- the engine's events (mini_ddp.engine.observer) ----------------------------------
    def forward_begun(self, model: Any) -> None:
        """The checks of a forward about to run its collectives: under the debug switch all
        of them (:meth:`before_collectives`); by default only the replica check's count of
        buffer broadcasts outside a training step, which a training forward skips at the
        cost of two reads."""
        grad_enabled = torch.is_grad_enabled()
        synced = grad_enabled and model.require_backward_grad_sync
        if self.debug:
            self.before_collectives(grad_enabled, synced, model.will_sync_module_buffers(),
                                    model.reducer.step.num_iterations + synced,
                                    joining=model.joining)
            return
        if self.sentinel is not None:
            self.sentinel.forward()
        if not synced and self.replicas is not None and model.will_sync_module_buffers():
            self.replicas.broadcast_off_step()

    def forward_ready(self, model: Any, buffers_synced: bool) -> None:
        """A synchronised forward has broadcast its buffers (or had none to)."""
        self.after_buffer_sync(model.reducer.step.num_iterations, buffers_synced,
                               joining=model.joining)

    def remove(self) -> None:
        """Take every hook off."""
        for check in (self.replicas, self.watch, self.sentinel):
            if check is not None:
                check.remove()


def _ended(rank: int, ranks: list[int]) -> str:
    """What the store says of the other ranks when one of ``ranks`` left a finish mark (it
    finished or its script raised), else "" (bounded; never raises for the store)."""
    states = peer_states()
    if not any(states.get(r) is not None and states[r].state in ("finished", "failed")
               for r in ranks):
        return ""
    return describe_finished(states, rank)


def _ask(model: Any, ranks: list[int]) -> dict[int, Any]:
    """The late ranks' stacks, through the stall monitor's responders (none: {})."""
    monitor = None if model is None else model.stall_monitor
    if monitor is None:
        return {}
    try:
        answers = ask_stacks(monitor.store, ranks, monitor.answer_s, asked_by=dist.get_rank(
            model.process_group), why="mini_ddp's debug check: a collective did not come")
    except Exception:  # noqa: BLE001 - a report without stacks beats none
        return {}
    # The asked ranks dump as they answer; this rank's dump beside theirs lets the doctor line
    # both up (without it, the asker reads as a rank that left no dump).
    monitor.dump(f"mini_ddp's debug check: ranks {ranks} have not reached a collective",
                 peers={str(rank): answer for rank, answer in answers.items()})
    return answers


def attach_checks(model: Any) -> None:
    """The checks every model wears (docs/debugging.md): the replica check always, the rest
    under the debug switch; none in torch's python-reducer mode (no hooks run). A new reducer
    keeps the store key space of the old one: the ranks name it alike."""
    old = model.sync_checks
    if old is not None:
        old.remove()
    model.sync_checks = None if model.uses_python_reducer else SyncChecks(
        model, model.config.debug, model.config.replica_check_every,
        board=None if old is None else old.board)
    if model.sync_checks is not None:
        model.reducer.observers.add(model.sync_checks)


observer.register(attach_checks)

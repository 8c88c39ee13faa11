"""Where one reducer is within a training step: counters, flags and the ready set.

Mirrors the per-iteration members of torch's C++ reducer (``num_iterations_``,
``num_bwd_calls_``, ``expect_autograd_hooks_``, ``require_finalize_``, ``next_bucket_``, the
static graph's per-parameter hook counts). Plain data with a few verbs; the reducer decides
when each changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mini_ddp.errors import MiniDDPError


class UnarmedBackwardError(MiniDDPError):
    """A backward ran inside a synchronised forward that nobody armed for it."""

    def __init__(self, rank: int, name: str, index: int):
        self.rank, self.name, self.index = rank, name, index
        super().__init__(
            f"mini_ddp: parameter '{name}' (index {index}) received a gradient on rank {rank} "
            "while DataParallelModel's forward was still running, and nothing armed the "
            "reducer for that backward: its gradients would stay local and the ranks would "
            "drift apart. Call model.reducer.prepare_for_backward(outputs) before such a "
            "backward (as torch DDP requires and PyTorch Lightning does through "
            "isinstance(model, DistributedDataParallel)), run backward after the forward "
            "returns, or run the forward inside model.no_sync() to accumulate locally.")


@dataclass
class StepState:
    """The per-step state of a reducer over ``num_params`` parameters."""

    num_params: int
    num_iterations: int = 0          # synced forwards so far
    num_backward_calls: int = 0      # backward passes that reached a hook (DDP's num_bwd_calls_)
    backward_counted: bool = False   # this backward is counted (reset when it finishes)
    # Settled by the first hook of a backward (:meth:`begin_backward`): what every hook
    # of that backward asks, read instead of re-derived per parameter.
    static_first: bool = False       # a static graph's first backward: hooks only count
    tracks_used: bool = False        # hooks fill the used map
    records_order: bool = False      # hooks record the gradient-ready order for the rebuild
    expect_hooks: bool = False       # a synced backward is expected
    forward_running: bool = False    # a synced forward has not returned yet
    synced_this_step: bool = False   # a synced backward finished; no forward since
    require_finalize: bool = False   # some gradient was marked ready and not yet finished
    marked_unused: bool = False      # this backward's unused parameters were marked ready
    next_bucket: int = 0             # the next bucket to launch (launches are in order)
    ready: set[int] = field(default_factory=set)  # parameters marked ready this iteration
    ready_order: list[int] = field(default_factory=list)  # hooks' order, for the logging data
    static_hook_counts: list[int] = field(default_factory=list)  # hooks per param, iteration 1
    static_hooks_left: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.static_hook_counts = [0] * self.num_params
        self.static_hooks_left = [0] * self.num_params

    def begin_backward(self, static_graph: bool, dynamic_unused: bool) -> None:
        """First hook of a backward: count it, and settle what its other hooks will ask."""
        self.backward_counted = True
        if static_graph and not self.expect_hooks and self.num_backward_calls == 0:
            # A local backward (no_sync()) before a static graph's first synchronised one is
            # not its "iteration 1": its gradients stay local, and the first synchronised
            # backward then counts the hooks and reduces everything accumulated (torch DDP
            # fails an internal assert here).
            self.static_first = self.tracks_used = False
            return
        self.num_backward_calls += 1
        # Counted in backward passes, as DDP does since 2.1: two forwards may precede one
        # backward, and that backward is still "iteration 1".
        self.static_first = static_graph and self.num_backward_calls == 1
        self.tracks_used = dynamic_unused or self.static_first

    def last_static_hook(self, index: int, name: str, rank: int) -> bool:
        """Static graph: count a hook of parameter ``index``; True when it is its last one.

        Hooks may fire several times per parameter (e.g. activation checkpointing): the
        gradient is final at the count iteration 1 saw. More hooks than that, or a parameter
        iteration 1 never saw, mean the graph changed.
        """
        if self.static_hooks_left[index] == 0:
            raise MiniDDPError(
                f"mini_ddp: parameter '{name}' received a gradient on rank {rank} it did not "
                "receive in iteration 1, or more often: the training graph changed, which "
                "static_graph=True does not allow.")
        self.static_hooks_left[index] -= 1
        return self.static_hooks_left[index] == 0

    def arm(self, static_graph: bool) -> None:
        """Before a synced backward: expect hooks, nothing ready, nothing launched."""
        self.expect_hooks = True
        self.backward_counted = False  # the armed backward is a new one, even after no_sync
        self.synced_this_step = False
        self.next_bucket = 0
        if static_graph:
            self.static_hooks_left = list(self.static_hook_counts)
        self.marked_unused = False
        self.ready.clear()
        self.ready_order.clear()  # torch clears its grad_ready_order_indices_ here too

    def finish(self) -> None:
        """A synced backward has finished (its gradients are being written back)."""
        self.expect_hooks = False
        self.synced_this_step = True
        self.require_finalize = False
        self.backward_counted = False

    def unarmed(self, rank: int, name: str, index: int) -> UnarmedBackwardError | None:
        """A hook fired while no synced backward is expected: the error to raise, if any.

        torch DDP ignores such a gradient, which is right for ``no_sync()`` and for a backward
        through the bare module, but not for a backward that runs *inside* a synced forward
        (a framework's manual backward in ``training_step``) that nobody armed with
        ``reducer.prepare_for_backward``: its gradients would stay local, the ranks drift apart.
        """
        if self.forward_running:
            return UnarmedBackwardError(rank, name, index)
        return None

    def missing(self) -> list[int]:
        """Parameters not marked ready in this iteration."""
        return [i for i in range(self.num_params) if i not in self.ready]

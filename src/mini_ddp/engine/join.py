"""Uneven inputs: ``DataParallelModel`` as a ``torch.distributed.algorithms.Join`` participant.

With uneven inputs, a rank that runs out of batches stops calling forward/backward while the
others still issue collectives every step; without help they wait for it forever. torch's
generic :class:`~torch.distributed.algorithms.Join` context manager handles the protocol, and
this module plugs our model into it exactly as torch DDP plugs in (its ``_DDPJoinHook``):

* Every forward of a rank that still has data first announces "not joined" with an async
  all-reduce of ones (``Join.notify_join_context``). Ranks that have joined loop in
  ``Join.__exit__``, all-reducing zeros in step with it, so the sum counts the active ranks.
  With ``divide_by_initial_world_size=False`` that count becomes the gradient divisor.
* For each such forward, a joined rank runs :meth:`DataParallelJoinHook.main_hook`: it shadows
  the bucket rebuild, the buffer broadcast (from an agreed authoritative rank: the highest
  rank still training, since rank 0 may have stale buffers), learns whether a synced backward
  follows, and if so shadows it (:func:`shadow_backward`) — one all-reduce of zeros per bucket,
  in bucket order, through the comm-hook door, then the unused-parameter map all-reduce.
* When every rank has joined, :meth:`DataParallelJoinHook.post_hook` broadcasts the model
  (parameters, and buffers when forward buffer sync is on) from the last rank to join.

The model side (``notify_forward``, ``announce_backward_sync``, ``find_common_rank``) is called
from :meth:`mini_ddp.DataParallelModel.forward` in the same places DDP's ``_pre_forward`` does.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from mini_ddp.engine.hooks import GradBucket, launch_hook


class JoiningModel(Protocol):
    """What join needs of the model (``DataParallelModel`` is one); duck-typed, no import."""

    reducer: Any  # a mini_ddp.engine.reducer.Reducer
    device: torch.device
    process_group: dist.ProcessGroup
    config: Any
    require_backward_grad_sync: bool
    require_forward_param_sync: bool
    divide_by_initial_world_size: bool

    def will_sync_module_buffers(self) -> bool: ...
    def sync_buffers(self, src: int | None = None) -> None: ...
    def broadcast_module_states(self, include_buffers: bool, src: int = 0, flight: Any = None,
                                op: str = "startup_broadcast") -> None: ...


_ONE = torch.ones(1)
"""What join's count all-reduces (one float per rank), for the flight recorder's sizes."""


def _record(reducer: Any, op: str, tensor: torch.Tensor, work: Any = None) -> list | None:
    """Record one of join's collectives in the reducer's flight recorder (if it has one)."""
    flight = reducer.flight
    return None if flight is None else flight.started(op, reducer.step.num_iterations, tensor,
                                                      work)


def find_common_rank(model: JoiningModel, candidate: bool) -> int:
    """The highest rank for which ``candidate`` is true on that rank (DDP's tie-break).

    One MAX all-reduce; ranks that are not candidates offer -1.
    """
    rank = torch.tensor([model.reducer.rank if candidate else -1], device=model.device)
    entry = _record(model.reducer, "join_common_rank_all_reduce", rank)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=model.process_group)
    if entry is not None:
        model.reducer.flight.finished(entry)
    if int(rank.item()) == -1:
        raise RuntimeError("mini_ddp: join found no rank to take the authoritative model "
                           "copy from (no rank offered itself); this is a bug in mini_ddp.")
    return int(rank.item())


def notify_forward(model: JoiningModel) -> None:
    """At the start of a forward: tell the join context this rank has not joined.

    Also fixes this step's gradient divisor: the initial world size, or — inside
    ``join(divide_by_initial_world_size=False)`` — the number of ranks still training, which
    the notification's all-reduce of ones just counted (DDP reads the same result).
    """
    work = Join.notify_join_context(model)
    reducer = model.reducer
    if work is not None:  # mostly not waited for: the dump asks the work whether it is done
        _record(reducer, "join_notify_all_reduce", _ONE, work)
    reducer.div_factor = reducer.world_size
    if work is not None and not model.divide_by_initial_world_size:
        work.wait()
        reducer.div_factor = int(work.get_future().value()[0].item())


def announce_backward_sync(model: JoiningModel, joined: bool) -> bool | None:
    """The all-reduce that tells joined ranks whether this iteration's backward is synced.

    Active ranks contribute 1 unless inside ``no_sync()`` and do not wait (as DDP); a joined
    rank contributes 0, waits, and learns whether it must shadow a backward.
    """
    flag = torch.ones(1, device=model.device) if not joined and \
        model.require_backward_grad_sync else torch.zeros(1, device=model.device)
    work = dist.all_reduce(flag, group=model.process_group, async_op=True)
    entry = _record(model.reducer, "join_sync_flag_all_reduce", flag,
                    None if joined else work)
    if not joined:
        return None
    work.wait()
    if entry is not None:
        model.reducer.flight.finished(entry)
    return bool(flag.item() != 0)


def sync_final_model(model: JoiningModel, is_last_joiner: bool) -> None:
    """Every rank takes the parameters (and buffers) of the last rank to join; ties go to
    the highest rank, as DDP breaks them."""
    src = find_common_rank(model, candidate=is_last_joiner)
    model.broadcast_module_states(include_buffers=model.config.forward_sync_buffers, src=src,
                                  op="join_final_broadcast")


def shadow_backward(reducer: Any) -> None:
    """Stand in for a synced backward this rank does not run (it has joined).

    Issues what a backward issues, in the same order — one all-reduce of zeros per bucket
    through the comm-hook door, then the unused-parameter map — and waits, as DDP's join
    hook does. Zeros add nothing to the other ranks' sums.
    """
    buckets, flight, step = reducer.layout.buckets, reducer.flight, reducer.step.num_iterations
    pending = []
    for bucket in buckets:
        zeros = GradBucket.of(bucket, len(buckets), torch.zeros_like(bucket.buffer))
        if flight is not None:  # numbered as the others' launches of the same buckets
            flight.launched(step, bucket)
        pending.append((bucket, launch_hook(reducer.comm_hook, reducer.comm_hook_state,
                                            reducer.group, zeros)))
    for bucket, future in pending:
        reducer.wait(future, bucket)  # the reducer's deadline and error naming
        if flight is not None:
            flight.completed(bucket.index)
    if reducer.unused_search.dynamic:
        reducer.unused_search.shadow_map_reduce(reducer.wait, flight, step)
    # Rebuild with the others before the next forward: DDP pushes every parameter.
    reducer.layout.record_all()


class DataParallelJoinHook(JoinHook):
    """What a rank that ran out of inputs does while others train, and once all have joined."""

    def __init__(self, model: JoiningModel, divide_by_initial_world_size: bool):
        self.model = model
        model.divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        """Shadow one training iteration's collectives (DDP's ``_DDPJoinHook.main_hook``)."""
        model = self.model
        # Join's loop has just all-reduced its count with the others' notification of their
        # forward (notify_forward): recorded here, where this rank sees it, in the same place.
        # (Assumes the model is the join's first Joinable, the one that notifies.)
        entry = _record(model.reducer, "join_notify_all_reduce", _ONE)
        if entry is not None:
            model.reducer.flight.finished(entry)
        model.reducer.rebuild_buckets_if_needed()  # the one-time rebuild broadcasts a layout
        if model.will_sync_module_buffers():
            model.sync_buffers(src=find_common_rank(model, candidate=False))
        should_sync = announce_backward_sync(model, joined=True)
        # A skipped (no_sync) backward skips the next forward's buffer broadcast, as on the
        # active ranks.
        model.require_forward_param_sync = should_sync
        if should_sync:
            shadow_backward(model.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Give every rank the model of the last rank to join (ties: the highest rank)."""
        sync_final_model(self.model, is_last_joiner)
        self.model.reducer.div_factor = self.model.reducer.world_size

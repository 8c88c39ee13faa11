"""Naive allreduce (everything to group rank 0, then back out), plus the helpers all algorithms share.

Cost model, for ``n`` ranks and an ``m``-byte tensor (alpha: latency per message, beta: time per
byte on the wire, gamma: time per byte reduced). Rank 0 is on the critical path: it receives
``n-1`` whole tensors one after another, reducing each, then sends ``n-1`` whole tensors::

    T_naive = 2(n-1)·alpha + 2(n-1)·m·beta + (n-1)·m·gamma

Both terms grow linearly with ``n`` and every byte squeezes through rank 0's link: this is the
baseline that the ring, halving-doubling and tree algorithms exist to beat.

The helpers below are shared by every algorithm in :mod:`mini_ddp.transport.collectives`; they live here
because the naive algorithm is the simplest reader of all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


def _maximum(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.maximum(acc, x, out=acc)


def _minimum(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.minimum(acc, x, out=acc)


# A list, not a dict: ``ReduceOp(ReduceOp.SUM) == ReduceOp.SUM`` but the two do not hash alike.
# AVG reduces like SUM; the division by the world size happens once, at the end (`finish`).
_REDUCERS: list[tuple[object, Callable[[torch.Tensor, torch.Tensor], object]]] = [
    (ReduceOp.SUM, torch.Tensor.add_),
    (ReduceOp.AVG, torch.Tensor.add_),
    (ReduceOp.PRODUCT, torch.Tensor.mul_),
    (ReduceOp.MAX, _maximum),
    (ReduceOp.MIN, _minimum),
]


def reducer(op: object) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """The in-place ``acc <- acc (op) x`` for a supported :class:`ReduceOp`; ValueError otherwise."""
    for known, fn in _REDUCERS:
        if op == known:
            return fn
    raise ValueError(f"unsupported reduce op {op!r}: use SUM, AVG, PRODUCT, MAX or MIN")


def flat_view(tensor: torch.Tensor, op: object = ReduceOp.SUM) -> torch.Tensor:
    """Check ``tensor`` and ``op`` (before any communication, so every rank fails alike) and
    return a 1-D view of ``tensor`` that aliases its memory."""
    if not tensor.is_contiguous():
        raise ValueError("collectives work in place on a flat view: pass a contiguous tensor")
    reducer(op)
    if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"AVG needs a floating-point tensor, got {tensor.dtype}")
    return tensor.view(-1)


def finish(flat: torch.Tensor, op: object, world_size: int) -> None:
    """Turn a reduced SUM into the AVG the caller asked for (no-op for every other op)."""
    if op == ReduceOp.AVG:
        flat.div_(world_size)


@dataclass(frozen=True)
class Comm:
    """This rank's view of a group: its group rank, the group size, and point-to-point ops that
    take *group* ranks (torch's ``dst``/``src`` are global ranks, so we translate)."""

    group: dist.ProcessGroup | None
    rank: int  # -1 when this process is not a member of ``group``
    size: int

    def peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (the identity for the default group)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def send(self, t: torch.Tensor, to: int) -> None:
        """Blocking send to group rank ``to``; empty tensors are skipped (the peer skips too)."""
        if t.numel():
            dist.send(t, self.peer(to), group=self.group)

    def recv(self, t: torch.Tensor, frm: int) -> None:
        """Blocking receive from group rank ``frm`` into ``t`` (skipped when ``t`` is empty)."""
        if t.numel():
            dist.recv(t, self.peer(frm), group=self.group)

    def exchange(self, out: torch.Tensor, to: int, into: torch.Tensor, frm: int) -> None:
        """Send ``out`` to ``to`` while receiving ``into`` from ``frm``, then wait for both.

        Posting both before waiting is what keeps a ring (everyone sends to the right at once)
        from deadlocking; waiting on both is what keeps a fast rank from leaving while its
        isend is still in flight, which would break the peer.
        """
        works = []
        if out.numel():
            works.append(dist.isend(out, self.peer(to), group=self.group))
        if into.numel():
            works.append(dist.irecv(into, self.peer(frm), group=self.group))
        for work in works:
            work.wait()


def comm_for(group: dist.ProcessGroup | None) -> Comm:
    """Describe this rank within ``group`` (``None``: the default, WORLD)."""
    return Comm(group, dist.get_rank(group), dist.get_world_size(group))


def naive_allreduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place by gathering it at group rank 0 and sending it back.

    Returns ``tensor`` (already holding the result) for convenience. Every send is sequential,
    which is the point: this is the O(n) baseline. See the module docstring for the cost.
    """
    flat = flat_view(tensor, op)
    comm = comm_for(group)
    if comm.rank < 0 or comm.size == 1 or flat.numel() == 0:
        return tensor
    combine = reducer(op)
    if comm.rank == 0:
        scratch = torch.empty_like(flat)
        for src in range(1, comm.size):  # fixed order 0,1,2..: deterministic summation
            comm.recv(scratch, src)
            combine(flat, scratch)
        finish(flat, op, comm.size)
        for dst in range(1, comm.size):
            comm.send(flat, dst)
    else:
        comm.send(flat, 0)
        comm.recv(flat, 0)
    return tensor

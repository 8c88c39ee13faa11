"""Binomial-tree broadcast and reduce, and an allreduce made of the two.

Number the ranks relative to the root (``v = (rank - root) mod n``). In a binomial tree rank
``v``'s parent is ``v`` with its lowest set bit cleared, and its children are ``v + 2^k`` for
every ``2^k`` below that bit. Broadcast flows down the tree: each rank receives once from its
parent, then sends to its children, biggest subtree first. Reduce is the mirror image: each rank
folds in its children (smallest subtree first) and sends the partial result to its parent. The
number of informed ranks doubles every round, so both take ``L = ceil(log2 n)`` rounds.

Cost, ``n`` ranks, ``m`` bytes (alpha per message, beta per byte sent, gamma per byte reduced)::

    T_bcast  = L·alpha + L·m·beta
    T_reduce = L·alpha + L·m·beta + L·m·gamma
    T_tree_allreduce = T_reduce + T_bcast = 2L·alpha + 2L·m·beta + L·m·gamma

Logarithmic latency, great for small messages; but the whole tensor crosses every level, so the
bandwidth term is ``log2 n`` times the ring's ``(n-1)/n`` (for large messages, pipelined or
two-tree variants as in NCCL fix this; they are not shown here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from mini_ddp.transport.collectives.naive import Comm, comm_for, finish, flat_view, reducer


def _root(comm: Comm, global_root: int) -> int:
    """Group rank of a root given, like ``dist.broadcast``'s ``src``, as a *global* rank."""
    if comm.group is None:
        return global_root
    return dist.get_group_rank(comm.group, global_root)


def tree_broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Broadcast ``tensor`` from global rank ``src`` (as in ``dist.broadcast``) in place.

    Returns ``tensor``. Ranks outside ``group`` return it untouched.
    """
    flat = flat_view(tensor)
    comm = comm_for(group)
    n = comm.size
    if comm.rank < 0 or n == 1 or flat.numel() == 0:
        return tensor
    root = _root(comm, src)
    v = (comm.rank - root) % n
    mask = 1
    while mask < n:  # receive from the parent (the root has none and falls through)
        if v & mask:
            comm.recv(flat, (v - mask + root) % n)
            break
        mask <<= 1
    mask >>= 1
    while mask:  # send to children, largest subtree first, so it can start forwarding early
        if v + mask < n:
            comm.send(flat, (v + mask + root) % n)
        mask >>= 1
    return tensor


def tree_reduce(
    tensor: torch.Tensor,
    dst: int,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` from every rank into global rank ``dst`` (as in ``dist.reduce``).

    Returns ``tensor``. Only ``dst`` is guaranteed the result; elsewhere ``tensor`` is used as an
    accumulator and ends up holding a partial reduction (as with Gloo: don't rely on it).
    """
    flat = flat_view(tensor, op)
    comm = comm_for(group)
    n = comm.size
    if comm.rank < 0 or n == 1 or flat.numel() == 0:
        return tensor
    combine = reducer(op)
    root = _root(comm, dst)
    v = (comm.rank - root) % n
    scratch: torch.Tensor | None = None
    mask = 1
    while mask < n:
        if v & mask:  # our subtree is complete: hand it to the parent and stop
            comm.send(flat, (v - mask + root) % n)
            return tensor
        if v + mask < n:  # fold in the child's subtree
            if scratch is None:
                scratch = torch.empty_like(flat)
            comm.recv(scratch, (v + mask + root) % n)
            combine(flat, scratch)
        mask <<= 1
    finish(flat, op, n)  # only the root gets here
    return tensor


def tree_allreduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place as a binomial-tree reduce then broadcast; returns it."""
    flat_view(tensor, op)  # validate before any rank starts sending
    comm = comm_for(group)
    if comm.rank < 0:
        return tensor
    root = comm.peer(0)
    tree_reduce(tensor, root, op, group)
    return tree_broadcast(tensor, root, group)

"""Ring allreduce: a reduce-scatter round the ring, then an all-gather round the ring.

The flat tensor is cut into ``n`` chunks. In each of ``n-1`` reduce-scatter steps every rank
sends one chunk to its right neighbour and folds the chunk arriving from its left into its own
copy; afterwards rank ``r`` holds the fully reduced chunk ``(r+1) % n``. The ``n-1`` all-gather
steps then pass the finished chunks round the ring once more, overwriting instead of reducing.

Cost, for ``n`` ranks and an ``m``-byte tensor (alpha per message, beta per byte sent, gamma per
byte reduced)::

    T_ring = 2(n-1)·alpha + 2·(n-1)/n·m·beta + (n-1)/n·m·gamma

Each rank sends ``2(n-1)/n`` of the data, which is the lower bound for any allreduce, whatever
``n``: the ring is *bandwidth-optimal*. The price is latency linear in ``n``, so for small
messages (or many ranks) the log-depth algorithms win.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from mini_ddp.transport.collectives.naive import comm_for, finish, flat_view, reducer


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """``parts+1`` boundaries splitting ``numel`` elements as evenly as possible.

    Chunk ``i`` is ``[b[i], b[i+1])``. Sizes differ by at most one, and when ``numel < parts``
    some chunks are empty (every rank computes the same bounds, so both ends of a send agree).
    """
    return [i * numel // parts for i in range(parts + 1)]


def ring_allreduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with the bandwidth-optimal ring; returns ``tensor``.

    Works for any size, including fewer elements than ranks (some chunks are empty and their
    sends are skipped). Ranks outside ``group`` return ``tensor`` untouched.
    """
    flat = flat_view(tensor, op)
    comm = comm_for(group)
    n, r = comm.size, comm.rank
    if r < 0 or n == 1 or flat.numel() == 0:
        return tensor
    combine = reducer(op)
    b = chunk_bounds(flat.numel(), n)

    def chunk(i: int) -> torch.Tensor:
        i %= n
        return flat[b[i]:b[i + 1]]

    right, left = (r + 1) % n, (r - 1) % n
    scratch = torch.empty_like(flat[: b[1] - b[0] + 1])  # room for the largest chunk
    # Reduce-scatter: at step s, send chunk r-s (which already holds s+1 contributions) and fold
    # the left neighbour's chunk r-s-1 into ours.
    for s in range(n - 1):
        incoming = chunk(r - s - 1)
        buf = scratch[: incoming.numel()]
        comm.exchange(chunk(r - s), right, buf, left)
        combine(incoming, buf)
    # Now chunk r+1 is complete here. AVG divides only this chunk, so each element is divided
    # once, by the rank that owns it, before it is gathered.
    finish(chunk(r + 1), op, n)
    # All-gather: pass completed chunks on; receive straight into place (no reduction).
    for s in range(n - 1):
        comm.exchange(chunk(r + 1 - s), right, chunk(r - s), left)
    return tensor

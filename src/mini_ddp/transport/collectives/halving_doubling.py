"""Rabenseifner's allreduce: recursive-halving reduce-scatter, then recursive-doubling all-gather.

With ``p`` a power of two, rank ``v`` pairs with ``v XOR p/2``: each partner keeps one half of
the range, sends the other half, and reduces the half it receives. Then with ``v XOR p/4`` on
the kept half, and so on: after ``log2 p`` exchanges each rank owns ``1/p`` of the vector, fully
reduced. The all-gather retraces the steps in reverse, doubling the owned range each time.

A world size that is not a power of two is folded into one: with ``p`` the largest power of two
below ``n`` and ``e = n - p`` extra ranks, the first ``2e`` ranks pair up (0,1), (2,3), ...; the
even one sends its whole tensor to the odd one and sits out, and gets the result back at the end.

Cost, ``n`` ranks, ``m`` bytes (alpha per message, beta per byte sent, gamma per byte reduced)::

    T_hd = 2·log2(p)·alpha + 2·(p-1)/p·m·beta + (p-1)/p·m·gamma          (n = p)
         + 2·alpha + 2·m·beta + m·gamma          (extra fold-in/out when n is not a power of 2)

Bandwidth-optimal like the ring, but with logarithmic latency; the fold-in costs a full extra
round trip of the whole tensor, which is why ``n = 3`` or ``5`` is a bad case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from mini_ddp.transport.collectives.naive import comm_for, finish, flat_view, reducer


def halving_doubling_allreduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with Rabenseifner's algorithm; returns ``tensor``.

    Any world size and tensor size work; ranks outside ``group`` return ``tensor`` untouched.
    """
    flat = flat_view(tensor, op)
    comm = comm_for(group)
    n, r = comm.size, comm.rank
    if r < 0 or n == 1 or flat.numel() == 0:
        return tensor
    combine = reducer(op)
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p

    # Fold-in: among the first 2*extra ranks, evens hand their data to the next odd rank.
    if r < 2 * extra:
        if r % 2 == 0:
            comm.send(flat, r + 1)
            comm.recv(flat, r + 1)  # fold-out: the finished result comes back
            return tensor
        scratch = torch.empty_like(flat)
        comm.recv(scratch, r - 1)
        combine(flat, scratch)
    v = r // 2 if r < 2 * extra else r - extra  # rank among the p survivors

    def real(vrank: int) -> int:  # survivor rank -> group rank (inverse of the line above)
        return 2 * vrank + 1 if vrank < extra else vrank + extra

    # Recursive halving: partners share the same range (they agree on all higher bits), so they
    # split it at the same midpoint; the lower rank keeps the lower half.
    lo, hi = 0, flat.numel()
    steps: list[tuple[int, int, int, int]] = []  # (mask, lo, hi, mid) to retrace the all-gather
    scratch = torch.empty_like(flat[: (hi + 1) // 2])
    mask = p // 2
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & mask == 0 else ((mid, hi), (lo, mid))
        buf = scratch[: keep[1] - keep[0]]
        comm.exchange(flat[give[0]:give[1]], real(v ^ mask), buf, real(v ^ mask))
        combine(flat[keep[0]:keep[1]], buf)
        steps.append((mask, lo, hi, mid))
        lo, hi = keep
        mask //= 2
    finish(flat[lo:hi], op, n)  # AVG: each element divided once, by its owner

    # Recursive doubling: in reverse, send what we own, receive the partner's half into place.
    for mask, plo, phi, mid in reversed(steps):
        theirs = (mid, phi) if v & mask == 0 else (plo, mid)
        comm.exchange(flat[lo:hi], real(v ^ mask), flat[theirs[0]:theirs[1]], real(v ^ mask))
        lo, hi = plo, phi

    if r < 2 * extra:  # fold-out to the even partner that sat out
        comm.send(flat, r - 1)
    return tensor

"""The arithmetic of the shared-memory all-reduce: each rank's chunk of the sum, in Gloo's order.

:mod:`mini_ddp.transport.shm` runs the protocol (sync, sum, sync); this is the sum. Gloo's
all-reduce (as ``ProcessGroupGloo`` calls it) is a ring: the flat buffer is cut into segments
of at most 1 MiB, their count rounded up to a multiple of the world size and at least twice
it, and rank ``c`` ends up owning chunk ``c`` (``count / world`` consecutive segments). That
chunk travels the ring from rank ``c-1`` down to rank ``c``, each rank adding its own values
to what it received, so every element of chunk ``c`` is

    x[c] + (x[c+1] + (x[c+2] + ... + (x[c-2] + x[c-1])))     (rank indices mod world)

with ``x[r]`` rank ``r``'s value. :func:`ring_chunk` gives a rank its chunk and
:func:`sum_chunk` computes it in exactly that order, so the bits are Gloo's at every world
size (float addition is not associative: at three ranks ``(a + b) + c`` is not
``a + (b + c)`` for many elements). At two ranks each element is one commutative addition.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_SUPPORTED = (torch.float32, torch.float64)

_SEGMENT_BYTES = 1 << 20
"""Gloo's largest ring segment (``AllreduceOptions::kMaxSegmentSize``): it sets the chunks."""

_PIECE_BYTES = 1 << 20  # sum and copy out in 1 MiB pieces: the copies then read from cache


def shm_supported(dtype: torch.dtype) -> bool:
    """Whether :meth:`~mini_ddp.transport.shm.SharedMemoryAllreduce.all_reduce` can sum
    buffers of ``dtype``."""
    return dtype in _SUPPORTED


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def ring_chunk(numel: int, element_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(lo, hi)``: the elements of a ``numel``-element buffer whose sum Gloo's ring
    all-reduce completes on ``rank`` (empty for the last ranks of a small buffer)."""
    total = numel * element_size
    if total == 0:
        return 0, 0
    max_segment = element_size * max(1, _SEGMENT_BYTES // element_size)
    segments = _round_up(max(-(-total // max_segment), 2 * world_size), world_size)
    segment_bytes = _round_up(-(-total // segments), element_size)
    chunk = segments // world_size * segment_bytes // element_size
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def sum_chunk(buffers: Sequence[torch.Tensor], rank: int, lo: int, hi: int) -> None:
    """Sum elements ``[lo, hi)`` of ``buffers`` (rank ``r``'s buffer at index ``r``) in the
    ring's order for chunk ``rank`` and write the sums into every buffer.

    Every view made here is gone when this returns, exceptions included: callers count the
    buffers' storage users to know nobody else looks into them.
    """
    world = len(buffers)
    own = buffers[rank]
    # The ring's operands for this chunk, innermost first: x[c-1], x[c-2], ..., x[c+1] —
    # every other rank's buffer, which is also where the sums are copied.
    inner = [buffers[(rank + k) % world] for k in range(world - 1, 0, -1)]
    step = max(1, _PIECE_BYTES // own.element_size())
    mine = acc = piece = None
    try:
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            mine = own[start:stop]
            if world == 2:
                acc = inner[0][start:stop]  # x[c+1] itself: one addition, no copy
            else:
                acc = torch.add(inner[1][start:stop], inner[0][start:stop])
                for operand in inner[2:]:
                    piece = operand[start:stop]
                    torch.add(piece, acc, out=acc)
            torch.add(mine, acc, out=mine)
            for other in inner:
                piece = other[start:stop]
                piece.copy_(mine)
    finally:
        del mine, acc, piece, inner, own

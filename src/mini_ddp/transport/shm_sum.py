"""The arithmetic of the shared-memory all-reduce: each rank's half of the sum.

:mod:`mini_ddp.transport.shm` runs the protocol (sync, sum, sync); this is the sum. At world
size 2 every element of a SUM is one IEEE addition, which is commutative, so whichever rank
computes an element gets Gloo's bits.
"""

from __future__ import annotations

import torch

_SUPPORTED = (torch.float32, torch.float64)

_CHUNK_BYTES = 1 << 20  # sum and copy back in 1 MiB pieces: the copy then reads from cache


def shm_supported(dtype: torch.dtype) -> bool:
    """Whether :meth:`~mini_ddp.transport.shm.SharedMemoryAllreduce.all_reduce` can sum
    buffers of ``dtype``."""
    return dtype in _SUPPORTED


def sum_range(own: torch.Tensor, peer: torch.Tensor, lo: int, hi: int) -> None:
    """``own[lo:hi] += peer[lo:hi]``, then the sums copied into ``peer[lo:hi]`` too.

    Every view made here is gone when this returns, exceptions included: callers count the
    buffers' storage users to know nobody else looks into them.
    """
    step = max(1, _CHUNK_BYTES // own.element_size())
    mine = theirs = None
    try:
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            mine, theirs = own[start:stop], peer[start:stop]
            torch.add(mine, theirs, out=mine)
            theirs.copy_(mine)
    finally:
        del mine, theirs

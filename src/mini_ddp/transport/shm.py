"""Sum all-reduce between the two ranks of a one-machine job through shared memory.

Gloo sums over TCP even when both ranks share a host (a 76 MiB float32 all-reduce costs
50-70 ms of CPU per rank on loopback, docs/performance.md). Here each rank's bucket buffer lives
in a ``/dev/shm`` file the peer maps too (:mod:`mini_ddp.transport.shm_files`), and an
all-reduce is:

1. *ready*: a tiny collective on a private Gloo group (:mod:`mini_ddp.transport.shm_sync`). It
   checks that both ranks reduce the same slot with the same size and dtype
   (:class:`ShmDesyncError` otherwise, on both ranks), and means both buffers hold their inputs;
2. rank 0 sums elements ``[0, n//2)`` and rank 1 ``[n//2, n)``: each computes
   ``mine[h] = mine[h] + peer[h]`` and writes the result into the peer's buffer as well;
3. *done*: a second tiny collective. Afterwards both buffers hold the whole sum, and neither
   rank touches the other's buffer until the next *ready*.

**Bitwise equal to Gloo.** At world size 2 every element of a SUM is a single IEEE addition,
``fl(a + b)``, and IEEE addition is commutative, so the result is the same bits whichever rank
computes it (``-0.0``, infinities, overflow and subnormals included). The one exception is a NaN
on *both* ranks at the same position: which payload survives depends on the operand order.
``tests/test_shm.py`` compares the raw bits with Gloo's result.

The work runs in call order on a :class:`~mini_ddp.transport.serial_worker.SerialWorker`, so
the caller (an autograd hook) never blocks: :meth:`SharedMemoryAllreduce.all_reduce` returns a
future like ``dist.all_reduce(..., async_op=True).get_future()``. Only that thread uses the
private group, so its syncs never interleave with the main thread's collectives. A dead peer
makes the group's next collective raise (Gloo notices a closed connection at once, a hung peer
at the default group's timeout): a :class:`~mini_ddp.errors.CollectiveError` on the future,
and every later call fails at once. Each file is unlinked before
:meth:`~SharedMemoryAllreduce.allocate` returns (the mappings outlive the names), so a process
that dies later leaves nothing behind. Fast for big buffers (about a third of Gloo's wall
time), slower than Gloo for tiny ones (two round trips and a thread hand-off).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.transport.serial_worker import SerialWorker
from mini_ddp.transport.shm_files import (
    FILE_PREFIX,
    SHM_DIR,
    ShmAllocationError,
    ShmError,
    map_segment,
    segment_path,
    unlink_quietly,
)
from mini_ddp.transport.shm_sync import (
    ALL_REDUCE,
    ALLOCATE,
    PairSync,
    ShmDesyncError,
    open_pair_group,
)

__all__ = [
    "FILE_PREFIX",
    "SHM_DIR",
    "SharedMemoryAllreduce",
    "ShmAllocationError",
    "ShmDesyncError",
    "ShmError",
    "shm_supported",
]

_SUPPORTED = (torch.float32, torch.float64)

_CHUNK_BYTES = 1 << 20  # sum and copy back in 1 MiB pieces: the copy then reads from cache


def shm_supported(dtype: torch.dtype) -> bool:
    """Whether :meth:`SharedMemoryAllreduce.all_reduce` can sum buffers of ``dtype``."""
    return dtype in _SUPPORTED


def _sum_range(own: torch.Tensor, peer: torch.Tensor, lo: int, hi: int) -> None:
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


class SharedMemoryAllreduce:
    """Sum all-reduce between the two ranks of a one-machine job through shared memory.

    Make one with :meth:`create` (a collective that returns None unless the job is two Gloo
    ranks sharing ``/dev/shm``), get buffers from :meth:`allocate` and sum them with
    :meth:`all_reduce`; results are bitwise equal to ``dist.all_reduce`` over Gloo. Both ranks
    must make the same calls in the same order. :meth:`close` it when done.

    ``token`` is the random part of this transport's file names (``FILE_PREFIX + token``).
    The constructor is internal: use :meth:`create`.
    """

    def __init__(self, side_group: dist.ProcessGroup, rank: int, token: str):
        self.rank = rank
        self.peer = 1 - rank
        self.token = token
        self._sync = PairSync(side_group, rank)
        self._next_slot = 0
        self._slots: dict[int, int] = {}  # id(own buffer) -> slot
        self._own: dict[int, torch.Tensor] = {}
        self._peer: dict[int, torch.Tensor] = {}
        # renew(): a slot's generation on each side, and our renewed files the peer has not
        # mapped yet (unlinked after the next done sync of that slot, when it has).
        self._own_gen: dict[int, int] = {}
        self._peer_gen: dict[int, int] = {}
        self._unmapped: dict[int, str] = {}
        self._closed = False
        self._lock = threading.Lock()  # guards _closed against concurrent submit/close
        # An allocation failure is agreed on both ranks and leaves the transport usable;
        # any other failure leaves the ranks out of step, so later calls fail at once.
        self._worker = SerialWorker(
            f"mini_ddp-shm-{token}",
            keeps_working=lambda err: isinstance(err, ShmAllocationError),
            failed_error=lambda err: ShmError(
                f"mini_ddp: rank {rank}: the shared-memory all-reduce transport failed "
                f"earlier and cannot be used: {err}"))

    # ----------------------------------------------------------------------------- creation
    @classmethod
    def create(cls, group: dist.ProcessGroup | None = None) -> SharedMemoryAllreduce | None:
        """A transport for the default group, or None on every rank when it cannot work.

        Collective: every rank of the default group must call it, and all get the same answer
        (:func:`~mini_ddp.transport.shm_sync.open_pair_group` says when a transport works).
        """
        opened = open_pair_group(group)
        return None if opened is None else cls(*opened)

    # ----------------------------------------------------------------------------- public API
    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D CPU tensor of ``numel`` elements that the peer rank maps too.

        Collective on the transport's group: both ranks call it in the same order with the
        same arguments (otherwise :class:`ShmDesyncError` on both, and the transport is
        unusable). It runs on the worker thread, after any queued all-reduces, and blocks
        until done. Each rank unlinks its own file before its call returns, so once both have
        returned nothing is left in ``/dev/shm`` (the mappings stay); the memory is released when the caller drops the tensor after :meth:`free` (or
        :meth:`close`). Any dtype is accepted, but :meth:`all_reduce` sums only float32 and
        float64 (:func:`shm_supported`). ``numel`` 0 gives an empty tensor without a file.

        Raises :class:`ShmAllocationError` on both ranks when either cannot create or map its
        file (e.g. ``/dev/shm`` is full); the transport stays usable.
        """
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"allocate: numel must be an int >= 0, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"allocate: dtype must be a torch.dtype, got {dtype!r}")
        if self._worker.on_worker_thread():
            raise RuntimeError("allocate: called from the transport's worker thread (a future "
                               "callback?); it would wait for itself")
        with self._lock:
            self._check_open("allocate")
            slot = self._next_slot
            self._next_slot += 1
        fut = self._submit(lambda: self._allocate(slot, numel, dtype))
        own = fut.wait()[0]
        return own

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum ``tensor`` with the peer's buffer of the same slot, asynchronously.

        ``tensor`` must be a buffer returned by this transport's :meth:`allocate` (the object
        itself, not a view or copy; ValueError otherwise) of a dtype that
        :func:`shm_supported`. Reductions run in call order; both ranks must reduce the same
        buffers in the same order. The future's value is ``[tensor]``, like
        ``dist.all_reduce(..., async_op=True).get_future()``; neither rank may write the buffer
        until it completes. Failures are set on the future: :class:`ShmDesyncError`, or
        :class:`~mini_ddp.errors.CollectiveError` when the peer died or hung; after either,
        every later call fails at once.
        """
        self._check_open("all_reduce")
        slot = self._slot_of(tensor, "all_reduce")
        if not shm_supported(tensor.dtype):
            raise ValueError(f"all_reduce: the shared-memory transport sums float32 and float64 "
                             f"only, not {tensor.dtype}")
        own = tensor
        with self._lock:
            self._check_open("all_reduce")
            return self._submit(lambda: self._reduce(slot, own))

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a live buffer of this transport (the object itself)."""
        return self._live_slot(tensor) is not None

    def renew(self, tensor: torch.Tensor) -> torch.Tensor:
        """Give the slot of ``tensor`` a fresh zero-filled buffer; return it. Local, no sync.

        For a caller that cannot overwrite the old buffer (someone still looks into it): the
        old tensor stays valid and becomes an ordinary tensor, no longer reduced. The peer
        learns of the new buffer at the next ready sync of the slot (each rank announces its
        buffer's generation there) and maps it then; the new file is unlinked after that
        reduction's done sync. Call it only while no reduction of the slot is in flight.
        """
        self._check_open("renew")
        slot = self._slot_of(tensor, "renew")
        gen = self._own_gen.get(slot, 0) + 1
        path = self._path(self.rank, slot, gen)
        try:
            fresh = map_segment(path, tensor.numel(), tensor.dtype, create=True)
        except OSError as err:
            raise ShmAllocationError(f"mini_ddp: rank {self.rank} could not create {path}: "
                                     f"{err}") from err
        with self._lock:
            self._drop_unmapped(slot)  # renewed twice before a reduction: never mapped
            del self._slots[id(tensor)]
            self._slots[id(fresh)] = slot
            self._own[slot], self._own_gen[slot], self._unmapped[slot] = fresh, gen, path
        return fresh

    def free(self, tensor: torch.Tensor) -> None:
        """Forget the buffer ``tensor`` (from :meth:`allocate`) and its mapping of the peer's.

        Local, no communication. The memory is released once the caller drops its own
        references and any all-reduce of it still queued has finished. ValueError if
        ``tensor`` is not a live buffer of this transport.
        """
        slot = self._slot_of(tensor, "free")
        del self._slots[id(tensor)], self._own[slot], self._peer[slot]
        with self._lock:
            self._drop_unmapped(slot)

    def close(self, wait: bool = True) -> None:
        """Finish the queued work, stop the worker thread and drop every buffer. Idempotent.

        Later calls of :meth:`allocate` and :meth:`all_reduce` raise :class:`ShmError`.
        ``wait=False`` does not wait for the worker (it may be stuck on a dead peer): for
        finalizers, which must not block.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._worker.stop(wait)
        self._slots.clear()
        self._own.clear()
        self._peer.clear()
        for path in self._unmapped.values():
            unlink_quietly(path)
        self._unmapped.clear()

    # ----------------------------------------------------------------------------- internals
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ShmError(f"mini_ddp: rank {self.rank}: {what} on a closed shared-memory "
                           "all-reduce transport")

    def _live_slot(self, tensor: Any) -> int | None:
        slot = self._slots.get(id(tensor))
        return slot if slot is not None and self._own.get(slot) is tensor else None

    def _drop_unmapped(self, slot: int) -> None:
        """Unlink ``slot``'s renewed file if it is still there (hold ``_lock``)."""
        path = self._unmapped.pop(slot, None)
        if path is not None:
            unlink_quietly(path)

    def _slot_of(self, tensor: Any, what: str) -> int:
        slot = self._live_slot(tensor)
        if slot is None:
            if isinstance(tensor, torch.Tensor):
                shown = (f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)} on "
                         f"{tensor.device}")
            else:
                shown = f"a {type(tensor).__name__}"
            raise ValueError(
                f"{what}: expected a buffer returned by this transport's allocate() (the tensor "
                f"object itself, not a view or copy, and not freed), got {shown}")
        return slot

    def _submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        return self._worker.submit(job)

    def _path(self, rank: int, slot: int, gen: int = 0) -> str:
        return segment_path(self.token, rank, slot, gen)

    def _allocate(self, slot: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        self._sync.ready(ALLOCATE, slot, numel, dtype, self._own_gen.get(slot, 0))
        if numel == 0:
            own, peer = torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=dtype)
        else:
            own, peer = self._sync.map_pair(self.token, slot, numel, dtype)
        self._slots[id(own)] = slot
        self._own[slot], self._peer[slot] = own, peer
        return [own]

    def _reduce(self, slot: int, own: torch.Tensor) -> list[torch.Tensor]:
        n = own.numel()
        peer_gen = self._sync.ready(ALL_REDUCE, slot, n, own.dtype, self._own_gen.get(slot, 0))
        lo, hi = (0, n // 2) if self.rank == 0 else (n // 2, n)
        ok = False
        try:
            if peer_gen != self._peer_gen.get(slot, 0):  # the peer renewed its buffer: map it
                self._peer[slot] = map_segment(self._path(self.peer, slot, peer_gen), n, own.dtype,
                                        create=False)
                self._peer_gen[slot] = peer_gen
            _sum_range(own, self._peer[slot], lo, hi)
            ok = True
        finally:
            # Join the done sync even if the sum failed, so the peer does not wait for us.
            both = self._sync.agree(f"all_reduce of slot {slot}, done sync", ok)
            with self._lock:  # the peer mapped it before its done sync (or gave up)
                self._drop_unmapped(slot)
        if not both:
            raise ShmError(f"mini_ddp: rank {self.rank}: rank {self.peer} failed to sum its half "
                           f"of slot {slot}")
        return [own]

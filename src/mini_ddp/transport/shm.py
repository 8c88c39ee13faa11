"""Sum all-reduce between the ranks of a one-machine job through shared memory.

Gloo sums over TCP even when all ranks share a host (a 76 MiB float32 all-reduce costs
50-70 ms of CPU per rank on loopback, docs/performance.md). Here each rank's bucket buffer lives
in a memory segment the other ranks map too (:mod:`mini_ddp.transport.shm_files`; which buffer
is which slot: :mod:`mini_ddp.transport.shm_slots`), and an all-reduce is:

1. *ready*: a few integers each way over a Unix-domain socket between every two of the
   processes (:mod:`mini_ddp.transport.shm_sync`; one round trip, tens of microseconds). It
   checks that all ranks reduce the same slot with the same size and dtype
   (:class:`ShmDesyncError` otherwise, on all of them), and means every buffer holds its
   inputs;
2. rank ``r`` sums the chunk of elements that Gloo's ring would finish on rank ``r``, reading
   every rank's buffer and adding in the ring's order, and writes the sums into every buffer
   (:mod:`mini_ddp.transport.shm_sum`);
3. *done*: a second round trip. Afterwards every buffer holds the whole sum, and no rank
   touches another's buffer until the next *ready*.

**Bitwise equal to Gloo.** Which rank sums which elements, and in which order, is Gloo's
ring's (:mod:`mini_ddp.transport.shm_sum`), so each element is the same chain of IEEE
additions, ``-0.0``, infinities, overflow and subnormals included. The one exception is a
NaN on several ranks at the same position: which payload survives depends on the operand
order within one addition. ``tests/test_shm.py`` compares the raw bits with Gloo's result at
two and three ranks.

**One channel per process and group.** The sockets, their checks and the worker thread are a
*channel*, made once per process and process group and kept while the group lives (like the
group's own Gloo connections); every transport on that group — one per model — is a view of it
with its own buffers and slot numbers. A transport asks to reuse the channel in its start-up
exchange (each rank names the channel it holds); it is reused only when every rank of the
group names the same one, so all ranks agree without a vote, and the votes that made the
channel stand for it. Otherwise (the first model on a group, or a channel that failed on some
rank) a fresh channel is made, with its votes, and replaces the old one. The transports of one
channel run in call order on it: the ranks must use them in the same order, as they must the
group's collectives; the ready check names the transport too, so a mix-up is a
:class:`ShmDesyncError`, never a wrong sum.

The work runs in call order on the channel's
:class:`~mini_ddp.transport.serial_worker.SerialWorker`, so the caller (an autograd hook) never
blocks: :meth:`SharedMemoryAllreduce.all_reduce` returns a future like
``dist.all_reduce(..., async_op=True).get_future()``. An allocation runs on the caller's thread
when the worker is idle (no thread switch each way), after the queued work otherwise. Only one
thread at a time uses the sockets, so the syncs never interleave with each other or with the
main thread's collectives. A dead peer closes
its end, so the next sync fails at once (a hung peer at the group's timeout): a
:class:`~mini_ddp.errors.CollectiveError` on the future, and every later call on the channel
fails at once. The segments are anonymous memory files (``memfd``), never
named in ``/dev/shm`` or anywhere else: a peer maps one through the creator's open descriptor
(``/proc/<pid>/fd``), announced at the slot's first all-reduce and closed as soon as every
peer has mapped it, and the memory goes with the last mapping. So no file outlives the processes, whatever kills them and whenever —
creation, mapping, renewal or use, under any launcher. A child forked from a rank (a
``DataLoader`` worker) disowns the transport at once: it closes its copies of the sockets and
never uses or closes the parent's connections, buffers or thread.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.transport.serial_worker import SerialWorker
from mini_ddp.transport.shm_files import (
    FILE_PREFIX,
    SHM_DIR,
    Segment,
    ShmAllocationError,
    ShmError,
    close_quietly,
    create_segment,
    segment_name,
)
from mini_ddp.transport.shm_slots import SlotTable
from mini_ddp.transport.shm_sum import ring_chunk, shm_supported, sum_chunk
from mini_ddp.transport.shm_sync import (
    ALL_REDUCE,
    NO_OFFER,
    ChannelOffer,
    PeerSync,
    ShmDesyncError,
    channel_offer,
    exchange_offers,
    holds_the_same_channel,
    offered_token,
    token_of,
)

__all__ = [
    "FILE_PREFIX",
    "NO_OFFER",
    "SHM_DIR",
    "ChannelOffer",
    "SharedMemoryAllreduce",
    "ShmAllocationError",
    "ShmDesyncError",
    "ShmError",
    "shm_supported",
]

_RELEASE_WAIT_S = 0.5
"""How long closing a channel without ``wait`` gives queued work to finish before it leaves
the sockets to the process's end."""


class _Channel:
    """One process's sockets to its peers on one group, their worker thread, and its health.

    Made by :meth:`SharedMemoryAllreduce.from_offer` after the votes; shared by every
    transport on the group (:data:`_CHANNELS`) until the group goes, the channel fails, or a
    fresh one replaces it.
    """

    def __init__(self, sync: PeerSync, rank: int, token: str, peer_pids: dict[int, int]):
        self.sync, self.rank, self.token, self.peer_pids = sync, rank, token, peer_pids
        self.number = int(token, 16)  # as offers carry it
        self.world_size = len(peer_pids) + 1
        self.closed = False
        self.lock = threading.Lock()  # guards closed against concurrent submit/close
        # An allocation failure is agreed on all ranks and leaves the channel usable; any
        # other failure leaves the ranks out of step, so later calls fail at once.
        self.worker = SerialWorker(
            f"mini_ddp-shm-{token}",
            keeps_working=lambda err: isinstance(err, ShmAllocationError),
            failed_error=lambda err: ShmError(
                f"mini_ddp: rank {rank}: the shared-memory all-reduce transport failed "
                f"earlier and cannot be used: {err}"))
        self.pid = os.getpid()  # the rank's process; a forked child disowns the channel

    def usable(self) -> bool:
        """Open, in the process that made it, and not failed: what a new transport may reuse."""
        return not self.closed and os.getpid() == self.pid and not self.worker.failed

    def close(self, wait: bool = True) -> None:
        """Finish the queued work, stop the worker, close the sockets (idempotent); the
        peers' next sync on the channel then fails at once. ``wait=False`` (finalizers) does
        not join the worker and gives queued work :data:`_RELEASE_WAIT_S` to finish before it
        closes the sockets (otherwise they go with the process)."""
        if os.getpid() != self.pid:
            self.disown()
            return
        with self.lock:
            if self.closed:
                return
            self.closed = True
            drained = self.worker.soon(lambda: None, always=True)  # once the queued work is
        self.worker.stop(wait)  # not under the lock: a queued job's end takes it
        # Closed here, on the caller's thread, once the worker is done with them — not while
        # the worker may still be blocked in one (then they go with the process).
        deadline = time.monotonic() + _RELEASE_WAIT_S
        while not drained.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        if drained.done():
            self.sync.release()

    def disown(self) -> None:
        """In a child forked from the rank: close this process's copies of the sockets (the
        parent's connections stay as they are). Local; the worker thread is the parent's."""
        if os.getpid() == self.pid:
            return
        self.closed = True  # no lock: a forked child runs only this thread
        self.sync.release()


# Each group's channel in this process, while the group lives (weak keys: a destroyed group
# takes its entry, and its finalizer closes the channel).
_CHANNELS: weakref.WeakKeyDictionary[Any, _Channel] = weakref.WeakKeyDictionary()
_CHANNELS_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[SharedMemoryAllreduce] = weakref.WeakSet()


def _live_channel(group: dist.ProcessGroup) -> _Channel | None:
    with _CHANNELS_LOCK:
        channel = _CHANNELS.get(group)
    return channel if channel is not None and channel.usable() else None


def _keep_channel(group: dist.ProcessGroup, channel: _Channel) -> None:
    """``channel`` is ``group``'s from now on; the one it replaces (if any) is closed."""
    try:
        with _CHANNELS_LOCK:
            old = _CHANNELS.get(group)
            _CHANNELS[group] = channel
    except TypeError:  # a group that cannot be weakly referenced: the channel is not shared
        old = None
    else:
        weakref.finalize(group, channel.close, wait=False)
    if old is not None and old is not channel:
        old.close(wait=False)


def _drop_channel(group: dist.ProcessGroup) -> None:
    """Close ``group``'s channel: not every rank of the group can use it any more."""
    with _CHANNELS_LOCK:
        old = _CHANNELS.pop(group, None)
    if old is not None:
        old.close(wait=False)


def _after_fork_in_child() -> None:
    # A child forked from a rank (a DataLoader worker, any forked helper) has no worker thread
    # and is no rank of the transport: it must never talk on the parent's sockets, and its
    # copies of them must not keep the parent's connections open after the parent is gone
    # (the peers would then wait for the group's timeout instead of failing at once). The
    # lock is made anew: only the forking thread lives on in the child, so a lock another
    # thread of the parent held at the fork would never be released there.
    global _CHANNELS_LOCK
    _CHANNELS_LOCK = threading.Lock()
    for channel in list(_CHANNELS.values()):
        channel.disown()
    _CHANNELS.clear()
    for transport in list(_LIVE):
        transport.disown()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SharedMemoryAllreduce:
    """Sum all-reduce between the ranks of a one-machine job through shared memory.

    Make one with :meth:`create` (a collective that returns None unless the job is Gloo ranks
    sharing ``/dev/shm``), get buffers from :meth:`allocate` and sum them with
    :meth:`all_reduce`; results are bitwise equal to ``dist.all_reduce`` over Gloo. All ranks
    must make the same calls in the same order. :meth:`close` it when done: that frees its
    buffers; the group's channel (sockets and worker thread) stays for the next transport on
    the group, and closes when the group is destroyed.

    ``token`` is the random part of this transport's segment labels (``FILE_PREFIX + token``,
    seen in ``/proc/<pid>/maps``), drawn afresh for every transport, also when it reuses the
    group's channel. The constructor is internal: use :meth:`create`.
    """

    def __init__(self, channel: _Channel, token: str):
        self.rank = channel.rank
        self.world_size = channel.world_size
        self.token = token
        self._number = int(token, 16)  # names this transport in its ready checks
        self._channel = channel
        self._sync = channel.sync
        self._worker = channel.worker
        self._next_slot = 0
        self._table = SlotTable()  # buffers, peer mappings, generations (shm_slots)
        # Segments made ahead of their allocate() by reserve(): slot -> (numel, dtype, the
        # segment or the OSError that stopped it). Read and written only by jobs of the worker
        # (reserve's, allocate's, close's), which run one at a time in call order.
        self._reserved: dict[int, tuple[int, torch.dtype, Segment | OSError]] = {}
        self._closed = False
        self.pid = os.getpid()  # the rank's process; a forked child disowns the transport
        _LIVE.add(self)

    # ----------------------------------------------------------------------------- creation
    @classmethod
    def create(cls, group: dist.ProcessGroup | None = None) -> SharedMemoryAllreduce | None:
        """A transport for ``group`` (None: the default group), or None on every rank of it
        when it cannot work.

        Collective on ``group``: every rank of it must call it, and all get the same answer
        (:meth:`~mini_ddp.transport.shm_sync.ChannelOffer.open` says when a transport works); ranks
        outside the group take no part. Its ranks are the group's ranks.
        """
        return cls.from_offer(cls.offer(group), None)

    @staticmethod
    def offer(group: dist.ProcessGroup | None = None) -> ChannelOffer | None:
        """This rank's half of a transport on ``group``, for a caller that carries
        :attr:`ChannelOffer.fields` (or :data:`NO_OFFER` where it has none) in an all-gather
        of its own, then calls :meth:`from_offer`. Local; None on every rank of the group when
        no transport can work there. The offer names the group's channel this process holds
        (if any), for the ranks to reuse."""
        offer = channel_offer(group)
        if offer is not None:
            offer.held = _live_channel(offer.group)
            offer.fields[-1] = 0 if offer.held is None else offer.held.number
        return offer

    @classmethod
    def from_offer(cls, offer: ChannelOffer | None, rows: list[list[int]] | None
                   ) -> SharedMemoryAllreduce | None:
        """The transport of ``offer`` (from :meth:`offer`), given every group rank's offer
        fields ``rows`` (None: exchange them now, an all-gather on the offer's group); None on
        every rank when any rank had no offer or cannot join. Collective on the group, as
        :meth:`create`: when every rank names the same live channel it is reused, without a
        vote; otherwise a fresh channel is opened with its two votes. The offer is closed in
        any case."""
        if offer is None:
            return None
        try:
            if rows is None:
                rows = exchange_offers(offer.group, offer.fields)
        except BaseException:
            offer.close()
            raise
        if any(int(row[0]) == 0 for row in rows):  # a rank without an offer: none anywhere
            offer.close()
            return None
        # Decided from the rows alone (the channel held when the offer was made), so that
        # every rank decides alike.
        live = offer.held
        if live is not None and holds_the_same_channel(rows, live.number, live.peer_pids,
                                                       live.rank):
            offer.close()
            return cls(live, token_of(offered_token(rows)))
        opened = offer.open(rows)  # the two votes; closes the offer
        if opened is None:
            _drop_channel(offer.group)  # some rank cannot use it: no rank keeps it
            return None
        channel = _Channel(*opened)
        _keep_channel(offer.group, channel)
        return cls(channel, channel.token)

    # ----------------------------------------------------------------------------- public API
    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled 1-D CPU tensor of ``numel`` elements that the other ranks map too.

        Collective on the transport's group: all ranks call it in the same order with the
        same arguments (otherwise :class:`ShmDesyncError` on all, and the transport is
        unusable). It runs after any queued all-reduces of the group's channel — on the
        caller's thread when none is queued — and blocks until done: one exchange with the
        peers, who map the buffer at its first all-reduce. The segment has no name anywhere
        (see the module docstring); the memory is released when the caller drops the tensor
        after :meth:`free` (or :meth:`close`). Any dtype is accepted, but :meth:`all_reduce`
        sums only float32 and float64 (:func:`shm_supported`). ``numel`` 0 gives an empty
        tensor without a segment.

        Raises :class:`ShmAllocationError` on all ranks when any cannot create a segment
        (e.g. memory is exhausted); the transport stays usable.
        """
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"allocate: numel must be an int >= 0, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"allocate: dtype must be a torch.dtype, got {dtype!r}")
        if self._worker.on_worker_thread():
            raise RuntimeError("allocate: called from the transport's worker thread (a future "
                               "callback?); it would wait for itself")
        with self._channel.lock:
            self._check_open("allocate")
            slot = self._next_slot
            self._next_slot += 1
        return self._worker.call(lambda: self._allocate(slot, numel, dtype))

    def reserve(self, sizes: Sequence[tuple[int, torch.dtype]]) -> None:
        """Start making the segments of the next ``len(sizes)`` :meth:`allocate` calls
        (``(numel, dtype)`` each, in call order) on the channel's worker thread, and return.

        Local, no communication. Reserving a segment's memory zero-fills every page of it
        (``posix_fallocate``: 15-22 ms for resnet18's 45 MB bucket on 2 cores), and the
        worker does it while the caller goes on — a model's constructor runs its start-up
        broadcast meanwhile. :meth:`allocate` takes the segment reserved for its slot when
        the size and dtype are those reserved, and makes one otherwise; a reservation that
        failed is :meth:`allocate`'s :class:`ShmAllocationError`, on every rank.
        """
        with self._channel.lock:
            self._check_open("reserve")
            first = self._next_slot
            requests = [(first + i, numel, dtype) for i, (numel, dtype) in enumerate(sizes)
                        if numel > 0]
            if requests:
                self._worker.submit(lambda: self._reserve(requests))

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum ``tensor`` with the other ranks' buffers of the same slot, asynchronously.

        ``tensor`` must be a buffer returned by this transport's :meth:`allocate` (the object
        itself, not a view or copy; ValueError otherwise) of a dtype that
        :func:`shm_supported`. Reductions run in call order; all ranks must reduce the same
        buffers in the same order. The future's value is ``[tensor]``, like
        ``dist.all_reduce(..., async_op=True).get_future()``; no rank may write the buffer
        until it completes. Failures are set on the future: :class:`ShmDesyncError`, or
        :class:`~mini_ddp.errors.CollectiveError` when a peer died or hung; after either,
        every later call on the group's channel fails at once.
        """
        self._check_open("all_reduce")
        slot = self._table.slot_of(tensor, "all_reduce")
        if not shm_supported(tensor.dtype):
            raise ValueError(f"all_reduce: the shared-memory transport sums float32 and float64 "
                             f"only, not {tensor.dtype}")
        own = tensor
        with self._channel.lock:
            self._check_open("all_reduce")
            return self._worker.submit(lambda: self._reduce(slot, own))

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a live buffer of this transport (the object itself)."""
        return self._table.live_slot(tensor) is not None

    def renew(self, tensor: torch.Tensor) -> torch.Tensor:
        """Give the slot of ``tensor`` a fresh zero-filled buffer; return it. Local, no sync.

        For a caller that cannot overwrite the old buffer (someone still looks into it): the
        old tensor stays valid and becomes an ordinary tensor, no longer reduced. The peers
        learn of the new buffer at the next ready sync of the slot (each rank announces its
        buffer's generation and descriptor there) and map it then; this rank's descriptor is
        closed after that reduction's done sync. Call it only while no reduction of the slot is
        in flight.
        """
        self._check_open("renew")
        slot = self._table.slot_of(tensor, "renew")
        gen = self._table.own_gen.get(slot, 0) + 1
        name = segment_name(self.token, self.rank, slot, gen)
        try:
            fresh = create_segment(name, tensor.numel(), tensor.dtype)
        except OSError as err:
            raise ShmAllocationError(f"mini_ddp: rank {self.rank} could not create {name}: "
                                     f"{err}") from err
        with self._channel.lock:
            self._table.renewed(tensor, fresh.tensor, slot, gen, fresh.fd)
        return fresh.tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Forget the buffer ``tensor`` (from :meth:`allocate`) and its mappings of the peers'.

        Local, no communication. The memory is released once the caller drops its own
        references and any all-reduce of it still queued has finished. ValueError if
        ``tensor`` is not a live buffer of this transport.
        """
        slot = self._table.slot_of(tensor, "free")
        self._table.forget(tensor, slot)
        with self._channel.lock:
            self._table.drop_unmapped(slot)

    def close(self, wait: bool = True) -> None:
        """Drop every buffer of this transport once its queued work has run. Idempotent.

        Later calls of :meth:`allocate` and :meth:`all_reduce` raise :class:`ShmError`. The
        group's channel stays open for the group's other transports (and the next one);
        ``wait`` waits for this transport's queued work (``wait=False``, for finalizers,
        leaves it queued: the buffers go after it). In a child forked from the rank it does
        nothing more than :meth:`disown` (the buffers are the parent's).
        """
        if os.getpid() != self.pid:
            self.disown()
            return
        with self._channel.lock:
            if self._closed:
                return
            self._closed = True
            if self._channel.closed:
                done = None
            else:  # after the queued reductions, which still read the table
                done = self._worker.soon(self._drop_all, always=True)
        if done is None:
            self._drop_all()
        elif wait and not self._worker.on_worker_thread():
            done.wait()

    def disown(self) -> None:
        """In a child forked from the rank: refuse every later call and close this process's
        copies of the descriptors the peers have not mapped yet. Local; the channel, the
        buffers and the peers are the parent's, and are left alone."""
        if os.getpid() == self.pid:
            return
        self._closed = True  # no lock: a forked child runs only this thread
        self._channel.disown()
        self._table.close_unmapped()
        self._drop_reserved()

    # ----------------------------------------------------------------------------- internals
    def _check_open(self, what: str) -> None:
        if self._closed or self._channel.closed:
            raise ShmError(f"mini_ddp: rank {self.rank}: {what} on a closed shared-memory "
                           "all-reduce transport")

    def _reserve(self, requests: list[tuple[int, int, torch.dtype]]) -> None:
        for slot, numel, dtype in requests:
            try:
                made: Segment | OSError = create_segment(
                    segment_name(self.token, self.rank, slot), numel, dtype)
            except OSError as err:  # allocate() reports it, on every rank
                made = err
            self._reserved[slot] = (numel, dtype, made)

    def _drop_reserved(self, below: int | None = None) -> None:
        """Close the reserved segments of the slots below ``below`` (None: all) that no
        allocation took: the caller asked for other sizes, or the transport closes."""
        for slot in [slot for slot in self._reserved if below is None or slot < below]:
            made = self._reserved.pop(slot)[2]
            if isinstance(made, Segment):
                close_quietly(made.fd)

    def _drop_all(self) -> None:
        self._table.clear()
        self._drop_reserved()

    def _allocate(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        reserved = self._reserved.get(slot)
        made = None
        if reserved is not None and reserved[:2] == (numel, dtype):
            made = self._reserved.pop(slot)[2]
        self._drop_reserved(slot + 1)  # not this allocation's size, or an earlier slot's
        segment = self._sync.allocate(self.token, self._number, slot, numel, dtype, made)
        if segment is None:  # numel 0: nothing to map
            own = torch.zeros(0, dtype=dtype)
            peers, fd = {peer: torch.zeros(0, dtype=dtype) for peer in self._sync.peers}, None
        else:  # its descriptor is kept for the peers until the slot's first all-reduce
            own, peers, fd = segment.tensor, {}, segment.fd
        with self._channel.lock:
            self._table.add(slot, own, peers, fd)
        return own

    def _reduce(self, slot: int, own: torch.Tensor) -> list[torch.Tensor]:
        n = own.numel()
        table = self._table
        announced = self._sync.ready(ALL_REDUCE, self._number, slot, n, own.dtype,
                                     (table.own_gen.get(slot, 0), table.unmapped_fd(slot)))
        lo, hi = ring_chunk(n, own.element_size(), self.world_size, self.rank)
        ok = False
        try:
            mapped, gens = table.peers[slot], table.peer_gen[slot]
            for peer, (gen, fd) in announced.items():
                if gen != gens.get(peer):  # first use, or the peer renewed: map its buffer
                    mapped[peer] = self._sync.open_peer(self.token, peer, slot, gen, fd, n,
                                                        own.dtype)
                    gens[peer] = gen
            buffers = [own if r == self.rank else mapped[r] for r in range(self.world_size)]
            sum_chunk(buffers, self.rank, lo, hi)
            del buffers
            ok = True
        finally:
            # Join the done sync even if the sum failed, so the peers do not wait for us.
            failed = self._sync.dissenters(f"all_reduce of slot {slot}, done sync", ok)
            with self._channel.lock:  # the peers mapped it before their done sync (or gave up)
                table.drop_unmapped(slot)
        if failed:
            raise ShmError(f"mini_ddp: rank {self.rank}: rank {failed[0]} failed to sum its "
                           f"chunk of slot {slot} (its own error says why)")
        return [own]

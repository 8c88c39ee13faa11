"""The shared-memory transport's slot table: which buffer is which slot, on every rank.

Every buffer :meth:`~mini_ddp.transport.shm.SharedMemoryAllreduce.allocate` hands out is a
*slot*: this rank's tensor, its mappings of the peers' tensors (made at the slot's first
all-reduce), each rank's generation (bumped by
:meth:`~mini_ddp.transport.shm.SharedMemoryAllreduce.renew`) and the descriptor of this rank's
segment while the peers have not mapped it yet. Buffers are known by
identity (the tensor object itself), never by value. The table does no locking and no
communication: the transport does.
"""

from __future__ import annotations

from typing import Any

import torch

from mini_ddp.transport.shm_files import close_quietly


class SlotTable:
    """Slots by buffer identity, with each rank's tensor and generation."""

    def __init__(self) -> None:
        self.by_id: dict[int, int] = {}  # id(own buffer) -> slot
        self.own: dict[int, torch.Tensor] = {}
        self.peers: dict[int, dict[int, torch.Tensor]] = {}  # slot -> {peer rank: mapping}
        # A slot's generation on each rank (renew() bumps it), and the descriptors of our
        # segments the peers have not mapped yet — a new slot's, a renewed one's — closed
        # after the next done sync of that slot, when they have.
        self.own_gen: dict[int, int] = {}
        self.peer_gen: dict[int, dict[int, int]] = {}  # slot -> {peer rank: generation}
        self.unmapped: dict[int, int] = {}

    def add(self, slot: int, own: torch.Tensor, peers: dict[int, torch.Tensor],
            fd: int | None) -> None:
        """A freshly allocated slot: ``own`` (ours), ``peers`` (our mappings of theirs, if
        any yet) and ``fd``, the descriptor of our segment the peers will map (None: none)."""
        self.by_id[id(own)] = slot
        self.own[slot], self.peers[slot] = own, dict(peers)
        self.peer_gen[slot] = dict.fromkeys(peers, 0)
        if fd is not None:
            self.unmapped[slot] = fd

    def live_slot(self, tensor: Any) -> int | None:
        """The slot whose own buffer is ``tensor`` itself, or None."""
        slot = self.by_id.get(id(tensor))
        return slot if slot is not None and self.own.get(slot) is tensor else None

    def slot_of(self, tensor: Any, what: str) -> int:
        """:meth:`live_slot`, or ValueError naming the call ``what`` and what it got."""
        slot = self.live_slot(tensor)
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

    def renewed(self, old: torch.Tensor, fresh: torch.Tensor, slot: int, gen: int, fd: int
                ) -> None:
        """``fresh`` (generation ``gen``, descriptor ``fd``) replaces ``old`` as ``slot``'s
        buffer."""
        self.drop_unmapped(slot)  # renewed twice before a reduction: never mapped
        del self.by_id[id(old)]
        self.by_id[id(fresh)] = slot
        self.own[slot], self.own_gen[slot], self.unmapped[slot] = fresh, gen, fd

    def forget(self, tensor: torch.Tensor, slot: int) -> None:
        """Drop ``slot`` (whose buffer is ``tensor``) and our mappings of the peers'."""
        del self.by_id[id(tensor)], self.own[slot], self.peers[slot], self.peer_gen[slot]

    def unmapped_fd(self, slot: int) -> int:
        """The descriptor of ``slot``'s renewed segment the peers have yet to map (-1: none)."""
        return self.unmapped.get(slot, -1)

    def drop_unmapped(self, slot: int) -> None:
        """Close the descriptor of ``slot``'s renewed segment if it is still open."""
        close_quietly(self.unmapped.pop(slot, None))

    def clear(self) -> None:
        """Forget every buffer and close every descriptor still kept for the peers."""
        self.by_id.clear()
        self.own.clear()
        self.peers.clear()
        self.peer_gen.clear()
        self.close_unmapped()

    def close_unmapped(self) -> None:
        """Close every descriptor still kept for the peers (a forked child closes its copies)."""
        for fd in self.unmapped.values():
            close_quietly(fd)
        self.unmapped.clear()

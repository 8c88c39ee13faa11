"""The shared-memory all-reduce's handshakes: tiny collectives on a private two-rank group.

:func:`open_pair_group` decides, collectively, whether the transport can work at all (two Gloo
ranks that see the same ``/dev/shm``) and makes its private group; :class:`PairSync` runs the
*ready* check (both ranks at the same call: :class:`ShmDesyncError` on both otherwise) and the
*agree* votes around each allocation and sum, and exchanges the descriptors through which each
rank maps the other's segments (:mod:`mini_ddp.transport.shm_files`). Gloo failures become
:class:`~mini_ddp.errors.CollectiveError`.
"""

from __future__ import annotations

import datetime
import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.errors import CollectiveError
from mini_ddp.transport.shm_files import (
    FILE_PREFIX,
    ShmAllocationError,
    ShmError,
    close_quietly,
    create_probe,
    create_segment,
    open_segment,
    read_probe,
    segment_name,
)

ALLOCATE, ALL_REDUCE = 1, 2
"""The operations a ready check names."""
_OPS = {ALLOCATE: "allocate", ALL_REDUCE: "all_reduce"}

# A stable code per dtype for the ready check; 0 for anything not listed.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)


class ShmDesyncError(ShmError):
    """The two ranks asked the transport for different things at the same point.

    ``ranks`` maps each rank to ``(operation, slot, numel, dtype)`` as that rank called it.
    """

    def __init__(self, rank: int, ranks: dict[int, tuple[str, int, int, str]]):
        self.rank, self.ranks = rank, ranks
        told = "; ".join(f"rank {r} called {op} on slot {slot} ({numel} elements of {dtype})"
                         for r, (op, slot, numel, dtype) in sorted(ranks.items()))
        super().__init__(
            f"mini_ddp: rank {rank}: the shared-memory all-reduce is out of step: {told}. "
            "Both ranks must allocate their buffers, and reduce them, in the same order with the "
            "same sizes and dtypes. Nothing was summed, and this transport cannot be used any "
            "more.")


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).removeprefix("torch.") if 0 < code <= len(_DTYPES) else "?"


def _default_timeout() -> datetime.timedelta | None:
    """The default group's collective timeout (None: let torch choose)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):  # private API: degrade to torch's default
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def open_pair_group(group: dist.ProcessGroup | None
                    ) -> tuple[dist.ProcessGroup, int, str, int] | None:
    """``(private group, rank, token, peer pid)`` for a transport, or None on every rank.

    Collective on the default group, the same answer on all ranks: a transport only if
    ``group`` is None or the default group, the default group is Gloo with exactly 2 ranks, and
    a probe shows that each rank can map the other's segments (rank 0 puts a random secret in
    a memory file, rank 1 reads it back through ``/proc/<pid>/fd``: same machine, same pid
    namespace, access allowed; agreed with an all-reduce MIN). It then makes the private Gloo
    group (``dist.new_group``, also collective on the default group) with the default group's
    timeout, and a per-transport random token for the segment labels.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    # Equal on every rank by construction, so no collective is needed to agree on these.
    if dist.get_world_size() != 2 or dist.get_backend() != "gloo":
        return None
    rank = dist.get_rank()
    wanted = group is None or group is dist.group.WORLD
    token = secrets.token_hex(8)
    secret = secrets.token_hex(16)
    probe = f"{FILE_PREFIX}{token}_probe"
    fd = -1
    try:
        if rank == 0:
            try:
                fd = create_probe(probe, secret.encode())
            except (OSError, AttributeError):  # AttributeError: no memfd_create (not Linux)
                fd = -1
        shared: list[Any] = [token, secret, fd]
        dist.broadcast_object_list(shared, src=0)
        token, secret, probe_fd = shared
        pids = torch.zeros(2, dtype=torch.int64)
        pids[rank] = os.getpid()
        dist.all_reduce(pids)
        ok = wanted and probe_fd >= 0
        if ok and rank == 1:
            try:
                probe = f"{FILE_PREFIX}{token}_probe"  # rank 0's token, as broadcast
                ok = read_probe(int(pids[0]), probe_fd, probe) == secret.encode()
            except OSError:
                ok = False
        agreed = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    finally:
        if fd >= 0:
            close_quietly(fd)
    if not agreed.item():
        return None
    timeout = _default_timeout()
    side = dist.new_group(ranks=[0, 1], backend="gloo",
                          **({"timeout": timeout} if timeout is not None else {}))
    return side, rank, token, int(pids[1 - rank])


class PairSync:
    """The ready check and the votes of one transport, on its private group."""

    def __init__(self, group: dist.ProcessGroup, rank: int, peer_pid: int):
        self.group, self.rank, self.peer = group, rank, 1 - rank
        self.peer_pid = peer_pid

    def release(self) -> None:
        """Destroy the private group (its connections and descriptors). Local; idempotent.

        Only once nothing uses the group any more. After ``destroy_process_group()`` of the
        default group it is gone already: then nothing is done here.
        """
        if self.group is None or not dist.is_initialized():
            return
        group, self.group = self.group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except (AssertionError, ValueError, RuntimeError):
                pass  # already gone with the default group (destroy_process_group() first)

    def collective(self, what: str, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        """A tiny all-reduce on the private group; Gloo failures become CollectiveError."""
        try:
            dist.all_reduce(tensor, op=op, group=self.group)
        except RuntimeError as err:
            raise CollectiveError(self.rank, f"the shared-memory all-reduce ({what})",
                                  err) from err

    def ready(self, op: int, slot: int, numel: int, dtype: torch.dtype, gen: int,
              fd: int = -1) -> tuple[int, int]:
        """Both ranks are at the same call: raise ShmDesyncError (on both) if they are not.

        Also exchanges the slot's buffer generation ``gen`` (bumped by the transport's
        ``renew``) and the descriptor ``fd`` of a renewed buffer the peer has not mapped yet;
        returns the peer's ``(gen, fd)``.
        """
        rows = torch.zeros(2, 6, dtype=torch.int64)
        rows[self.rank] = torch.tensor([op, slot, numel, _dtype_code(dtype), gen, fd])
        self.collective(f"{_OPS[op]} of slot {slot}, ready sync", rows, dist.ReduceOp.SUM)
        if not torch.equal(rows[0, :4], rows[1, :4]):
            told = {r: (_OPS.get(int(row[0]), "?"), int(row[1]), int(row[2]),
                        _dtype_name(int(row[3]))) for r, row in enumerate(rows)}
            raise ShmDesyncError(self.rank, told)
        return int(rows[self.peer, 4]), int(rows[self.peer, 5])

    def open_peer(self, token: str, slot: int, gen: int, fd: int, numel: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """Map the peer's buffer of ``slot`` (generation ``gen``, its descriptor ``fd``)."""
        return open_segment(self.peer_pid, fd, segment_name(token, self.peer, slot, gen),
                            numel, dtype)

    def agree(self, what: str, ok: bool) -> bool:
        """Whether ``ok`` holds on both ranks."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        self.collective(what, flag, dist.ReduceOp.MIN)
        return bool(flag.item())

    def map_pair(self, token: str, slot: int, numel: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Create this rank's segment for ``slot`` and map the peer's: ``(own, peer)`` tensors.

        Both ranks vote after each half, so a failure on either raises
        :class:`ShmAllocationError` on both. The segments have no names, so a rank killed at
        any point leaves nothing behind; this rank's descriptor is closed when this returns
        (after the peer has mapped it, or given up).
        """
        mine = segment_name(token, self.rank, slot)
        what = f"allocate of slot {slot}"
        segment = None
        try:
            problem = ""
            try:
                segment = create_segment(mine, numel, dtype)
            except OSError as err:
                problem = f"rank {self.rank} could not create {mine}: {err}"
            rows = torch.zeros(2, 2, dtype=torch.int64)
            rows[self.rank] = torch.tensor([int(not problem),
                                            -1 if segment is None else segment.fd])
            self.collective(f"{what}, segments created", rows, dist.ReduceOp.SUM)
            if not bool(rows[:, 0].all()):
                problem = problem or f"rank {self.peer} could not create its segment"
                raise ShmAllocationError(
                    f"mini_ddp: {problem} ({numel} elements of {dtype} for slot {slot}); "
                    "memory may be exhausted")
            try:
                peer = self.open_peer(token, slot, 0, int(rows[self.peer, 1]), numel, dtype)
            except OSError as err:
                problem = f"rank {self.rank} could not map the segment of rank {self.peer}: {err}"
            # After this sync the peer has mapped my segment (or given up): my descriptor can go.
            if not self.agree(f"{what}, segments mapped", not problem):
                problem = problem or (f"rank {self.peer} could not map the segment of rank "
                                      f"{self.rank}")
                raise ShmAllocationError(f"mini_ddp: {problem} (slot {slot})")
            return segment.tensor, peer
        finally:
            if segment is not None:
                close_quietly(segment.fd)

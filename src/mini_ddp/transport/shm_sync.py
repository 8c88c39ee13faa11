"""The shared-memory all-reduce's handshakes: a few integers each way over a private socket.

:func:`open_pair_channel` decides, collectively, whether the transport can work at all (two
Gloo ranks that see the same ``/dev/shm``) and connects the two processes by a Unix-domain
socket; :class:`PairSync` runs the *ready* check (both ranks at the same call:
:class:`ShmDesyncError` on both otherwise) and the *agree* votes around each allocation and
sum, and exchanges the descriptors through which each rank maps the other's segments
(:mod:`mini_ddp.transport.shm_files`). Socket failures (a closed connection, the timeout)
become :class:`~mini_ddp.errors.CollectiveError`.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence

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


def _default_timeout() -> datetime.timedelta:
    """The default group's collective timeout (torch's default when it cannot be read)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):  # private API: degrade to torch's default
        return dist.default_pg_timeout
    return timeout if isinstance(timeout, datetime.timedelta) else dist.default_pg_timeout


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of the Unix socket ``sock`` (the kernel's word)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _connect(address: str, server_pid: int, timeout_s: float) -> socket.socket | None:
    """Rank 1's end: connected to ``address`` if the process listening there is rank 0."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
        if _peer_pid(sock) == server_pid:
            return sock
    except (OSError, AttributeError):  # AttributeError: no SO_PEERCRED (not Linux)
        pass
    sock.close()
    return None


def _accept(listener: socket.socket, client_pid: int, timeout_s: float) -> socket.socket | None:
    """Rank 0's end: the connection from rank 1 (queued already), refusing any other process."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError:
            return None
        try:
            if _peer_pid(sock) == client_pid:
                return sock
        except OSError:
            pass
        sock.close()  # another process found the address first: not our peer
    return None


def open_pair_channel(group: dist.ProcessGroup | None) -> tuple[PairSync, int, str, int] | None:
    """``(channel, rank, token, peer pid)`` for a transport, or None on every rank.

    Collective on the default group, the same answer on all ranks: a transport only if
    ``group`` is None or the default group, the default group is Gloo with exactly 2 ranks, and
    a probe shows that each rank can map the other's segments (rank 0 puts a random secret in
    a memory file, rank 1 reads it back through ``/proc/<pid>/fd``: same machine, same pid
    namespace, access allowed). The channel is a Unix-domain socket between the two processes
    (an abstract address, so no file; each end checks the other's pid with ``SO_PEERCRED``),
    with the default group's timeout. Every check is agreed with an all-reduce MIN.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    # Equal on every rank by construction, so no collective is needed to agree on these.
    if dist.get_world_size() != 2 or dist.get_backend() != "gloo":
        return None
    rank = dist.get_rank()
    wanted = group is None or group is dist.group.WORLD
    # What rank 0 tells rank 1 and the two pids, in one all-reduce SUM (each rank fills its
    # own fields): [token, secret, secret, probe fd, pid of rank 0, pid of rank 1].
    shared = torch.zeros(6, dtype=torch.int64)
    timeout_s = _default_timeout().total_seconds()
    fd, listener, sock = -1, None, None
    try:
        if rank == 0:
            shared[:3] = torch.tensor([secrets.randbits(63) for _ in range(3)])
            token, secret = _token_and_secret(shared)
            try:
                fd = create_probe(f"{FILE_PREFIX}{token}_probe", secret)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(f"\0{FILE_PREFIX}{token}")  # abstract: no file to leave behind
                listener.listen(1)
            except (OSError, AttributeError):  # AttributeError: no memfd_create (not Linux)
                close_quietly(fd)
                fd = -1
            shared[3] = fd
        shared[4 + rank] = os.getpid()
        dist.all_reduce(shared)
        token, secret = _token_and_secret(shared)
        probe_fd, pids = int(shared[3]), [int(shared[4]), int(shared[5])]
        ok = wanted and probe_fd >= 0
        if ok and rank == 1:
            try:
                ok = read_probe(pids[0], probe_fd, f"{FILE_PREFIX}{token}_probe") == secret
            except OSError:
                ok = False
            # Before the vote, so that rank 0's accept below finds the connection queued.
            sock = _connect(f"\0{FILE_PREFIX}{token}", pids[0], timeout_s) if ok else None
            ok = sock is not None
        if _agreed(ok) and rank == 0:
            sock = _accept(listener, pids[1], timeout_s)
        if not _agreed(sock is not None):
            return None
        peer_pid = pids[1 - rank]
        channel, sock = PairSync(sock, rank, peer_pid, timeout_s), None
        return channel, rank, token, peer_pid
    finally:
        close_quietly(fd)
        if listener is not None:
            listener.close()
        if sock is not None:  # not handed to a channel
            sock.close()


_PEER_EXIT_S = 1.0
"""How long a rank whose peer closed the transport's socket waits for that process to end."""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _token_and_secret(shared: torch.Tensor) -> tuple[str, bytes]:
    """The transport's token (hex, for labels and the socket's address) and the probe's secret,
    from the first three random fields rank 0 shares."""
    return f"{int(shared[0]):016x}", struct.pack("<2q", int(shared[1]), int(shared[2]))


def _agreed(ok: bool) -> bool:
    """Whether ``ok`` holds on both ranks (an all-reduce MIN on the default group)."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class PairSync:
    """The ready check and the votes of one transport, over its socket to the peer.

    Every sync is one :meth:`exchange`: each rank sends a few integers and receives the
    peer's (one round trip of a Unix-domain socket, tens of microseconds, where a Gloo
    collective costs hundreds). A dead peer closes its end, so a waiting rank fails at once; a
    hung one fails at the default group's timeout.
    """

    def __init__(self, sock: socket.socket, rank: int, peer_pid: int, timeout_s: float):
        self.sock: socket.socket | None = sock
        self.rank, self.peer = rank, 1 - rank
        self.peer_pid = peer_pid
        self.timeout_s = timeout_s
        sock.settimeout(timeout_s)

    def release(self) -> None:
        """Close the socket (the peer's next exchange fails at once). Local; idempotent."""
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def exchange(self, what: str, values: Sequence[int]) -> tuple[int, ...]:
        """Send ``values`` to the peer and return the peer's (as many); a closed connection or
        the timeout becomes :class:`~mini_ddp.errors.CollectiveError` naming ``what``."""
        mine = struct.pack(f"<{len(values)}q", *values)
        theirs = bytearray(len(mine))
        failure = self._swap(mine, theirs)
        if failure is not None:
            raise CollectiveError(self.rank, f"the shared-memory all-reduce ({what})",
                                  failure) from failure
        return struct.unpack(f"<{len(values)}q", theirs)

    def _swap(self, mine: bytes, theirs: bytearray) -> OSError | None:
        """Send ``mine``, fill ``theirs`` from the peer; None, or what went wrong, in words
        :class:`~mini_ddp.errors.CollectiveError` reads right (a timeout as a hang, a closed
        connection in Gloo's words for it)."""
        sock = self.sock
        if sock is None:
            return ConnectionError("the transport's connection was closed on this rank")
        try:
            sock.sendall(mine)
            view, received = memoryview(theirs), 0
            while received < len(theirs):
                n = sock.recv_into(view[received:])
                if n == 0:
                    self._let_peer_exit()
                    return ConnectionResetError(f"Connection closed by peer: rank {self.peer} "
                                                "exited or was killed")
                received += n
        except TimeoutError:
            return TimeoutError(f"timed out after {self.timeout_s:.0f} s waiting for rank "
                                f"{self.peer}")
        except (ConnectionResetError, BrokenPipeError) as err:
            return ConnectionResetError(f"Connection closed by peer: rank {self.peer} exited "
                                        f"or was killed ({err})")
        except OSError as err:
            return err
        return None

    def _let_peer_exit(self) -> None:
        """The peer closed its end while its process still runs: most often its model was
        dropped as its script ends. Give that process up to :data:`_PEER_EXIT_S` to end, so that
        the finish mark it leaves at exit ("finished", not "died") is in the store when this
        rank's error reads it; a killed peer is gone already and costs nothing here."""
        deadline = time.monotonic() + _PEER_EXIT_S
        while _running(self.peer_pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def ready(self, op: int, slot: int, numel: int, dtype: torch.dtype, gen: int,
              fd: int = -1) -> tuple[int, int]:
        """Both ranks are at the same call: raise ShmDesyncError (on both) if they are not.

        Also exchanges the slot's buffer generation ``gen`` (bumped by the transport's
        ``renew``) and the descriptor ``fd`` of a renewed buffer the peer has not mapped yet;
        returns the peer's ``(gen, fd)``.
        """
        mine = (op, slot, numel, _dtype_code(dtype), gen, fd)
        theirs = self.exchange(f"{_OPS[op]} of slot {slot}, ready sync", mine)
        if mine[:4] != theirs[:4]:
            told = {r: (_OPS.get(row[0], "?"), row[1], row[2], _dtype_name(row[3]))
                    for r, row in ((self.rank, mine), (self.peer, theirs))}
            raise ShmDesyncError(self.rank, told)
        return theirs[4], theirs[5]

    def open_peer(self, token: str, slot: int, gen: int, fd: int, numel: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """Map the peer's buffer of ``slot`` (generation ``gen``, its descriptor ``fd``)."""
        return open_segment(self.peer_pid, fd, segment_name(token, self.peer, slot, gen),
                            numel, dtype)

    def agree(self, what: str, ok: bool) -> bool:
        """Whether ``ok`` holds on both ranks."""
        theirs = self.exchange(what, (int(ok),))[0]  # always: the peer waits for our vote
        return bool(ok) and bool(theirs)

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
            peer_ok, peer_fd = self.exchange(f"{what}, segments created",
                                             (int(not problem),
                                              -1 if segment is None else segment.fd))
            if problem or not peer_ok:
                problem = problem or f"rank {self.peer} could not create its segment"
                raise ShmAllocationError(
                    f"mini_ddp: {problem} ({numel} elements of {dtype} for slot {slot}); "
                    "memory may be exhausted")
            try:
                peer = self.open_peer(token, slot, 0, peer_fd, numel, dtype)
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

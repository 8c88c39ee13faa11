"""The shared-memory all-reduce's handshakes: a few integers each way over private sockets.

:func:`channel_offer` and :meth:`ChannelOffer.open` decide, collectively on the transport's
process group, whether the transport can work at all (Gloo ranks that see the same
``/dev/shm``) and connect every two of the group's processes by a Unix-domain socket (the
offers travel in an all-gather, :func:`exchange_offers` or the caller's own);
:class:`PeerSync` runs the *ready* check (all ranks at the same call: :class:`ShmDesyncError`
on all otherwise) of each allocation and sum, carrying what the call needs agreed (whether
every rank created its segment; the descriptors through which each rank maps the others'
segments, :mod:`mini_ddp.transport.shm_files`), and the *done* vote after each sum. Socket
failures (a closed connection, the timeout) become :class:`~mini_ddp.errors.CollectiveError`.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from mini_ddp.errors import CollectiveError
from mini_ddp.transport.shm_files import (
    FILE_PREFIX,
    Segment,
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
    """The ranks asked the transport for different things at the same point.

    ``ranks`` maps each rank to ``(operation, slot, numel, dtype)`` as that rank called it;
    ``transports`` (given when they differ) each rank's transport, by its token: the ranks
    called transports of one channel (one group) in different orders.
    """

    def __init__(self, rank: int, ranks: dict[int, tuple[str, int, int, str]],
                 transports: dict[int, str] | None = None):
        self.rank, self.ranks = rank, ranks
        told = "; ".join(f"rank {r} called {op} on slot {slot} ({numel} elements of {dtype})"
                         + (f" of the transport {transports[r]}" if transports else "")
                         for r, (op, slot, numel, dtype) in sorted(ranks.items()))
        super().__init__(
            f"mini_ddp: rank {rank}: the shared-memory all-reduce is out of step: {told}. "
            "All ranks must allocate their buffers, and reduce them, in the same order with the "
            "same sizes and dtypes. Nothing was summed, and this transport cannot be used any "
            "more.")


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).removeprefix("torch.") if 0 < code <= len(_DTYPES) else "?"


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """``group``'s collective timeout (torch's default when it cannot be read)."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # private API: degrade to torch's default
        return dist.default_pg_timeout
    return timeout if isinstance(timeout, datetime.timedelta) else dist.default_pg_timeout


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of the Unix socket ``sock`` (the kernel's word)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _connect(address: str, server_pid: int, timeout_s: float) -> socket.socket | None:
    """The connecting end: connected to ``address`` if the process listening there is
    ``server_pid``."""
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


def _accept(listener: socket.socket, client_pids: Sequence[int], timeout_s: float
            ) -> dict[int, socket.socket] | None:
    """The listening end: one connection from each of ``client_pids`` (queued already), by pid,
    refusing any other process; None if one is missing."""
    deadline = time.monotonic() + timeout_s
    wanted, socks = set(client_pids), {}
    while wanted and (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except OSError:
            break
        try:
            pid = _peer_pid(sock)
        except OSError:
            pid = -1
        if pid in wanted:
            wanted.discard(pid)
            socks[pid] = sock
        else:
            sock.close()  # another process found the address first: not one of ours
    if wanted:
        for sock in socks.values():
            sock.close()
        return None
    return socks


def _address(nonce: int) -> str:
    """The abstract Unix-socket address a rank listens on (no file to leave behind)."""
    return f"\0{FILE_PREFIX}{nonce:016x}"


OFFER_FIELDS = 7
"""How many integers each rank contributes to a channel's start-up exchange
(:attr:`ChannelOffer.fields`)."""
NO_OFFER = (0,) * OFFER_FIELDS
"""What a rank without an offer contributes instead (pid 0): then no rank opens a channel."""


def channel_offer(group: dist.ProcessGroup | None) -> ChannelOffer | None:
    """This rank's half of opening a channel on ``group`` (None: the default group), or None
    on every rank of the group when no transport can work there.

    Local: whether one can work at all is equal on every rank of ``group`` by construction
    (an initialised Gloo group of 2 ranks or more that this rank belongs to); whether it does
    is agreed by :meth:`ChannelOffer.open`.
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0 or dist.get_world_size(group) < 2 \
            or dist.get_backend(group) != "gloo":
        return None
    return ChannelOffer(group)


def holds_the_same_channel(rows: Sequence[Sequence[int]], live: int, pids: dict[int, int],
                           rank: int) -> bool:
    """Whether every group rank's offer ``rows`` names the live channel ``live`` (its token,
    not 0) and comes from the process that channel connects to (``pids``: the peers' pids by
    group rank, ``rank`` this one's). Every rank sees the same rows, so all answer alike: a
    channel is reused on every rank of the group or on none."""
    return bool(live) and len(rows) == len(pids) + 1 and all(
        int(row[OFFER_FIELDS - 1]) == live
        and int(row[0]) == (os.getpid() if r == rank else pids.get(r, -1))
        for r, row in enumerate(rows))


class ChannelOffer:
    """One rank's half of opening a transport's channel on a group, before the exchange.

    Made by :func:`channel_offer`: it listens on a fresh abstract Unix-socket address (no file),
    and on group rank 0 it draws the transport's token and a secret and puts the secret in a
    probe memory file. :attr:`fields` (:data:`OFFER_FIELDS` integers: this process's pid, the
    address's nonce, then on group rank 0 the token, the secret's two halves and the probe's
    descriptor, zeros elsewhere, and last the token of the channel this process already holds
    on the group, 0 for none) must reach every rank of the group in an all-gather, which
    the caller may share with another start-up check; :meth:`open` then connects the ranks.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = _group_timeout(group).total_seconds()
        self._fd, self._listener = -1, None
        nonce = secrets.randbits(63)
        try:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(_address(nonce))
            self._listener.listen(self.world)
        except OSError:
            nonce = 0  # no listener: the vote in open() says no
        shared = [0, 0, 0, -1]
        if self.rank == 0:
            shared[:3] = [secrets.randbits(63) for _ in range(3)]
            token, secret = _token_and_secret(shared)
            try:
                self._fd = create_probe(f"{FILE_PREFIX}{token}_probe", secret)
            except (OSError, AttributeError):  # AttributeError: no memfd_create (not Linux)
                self._fd = -1
            shared[3] = self._fd
        # The last field names a channel the caller already holds on the group, for the ranks
        # to reuse when all name the same one (holds_the_same_channel); ``held`` is it.
        self.fields: list[int] = [os.getpid(), nonce, *shared, 0]
        self.held: Any = None

    def open(self, rows: Sequence[Sequence[int]]
             ) -> tuple[PeerSync, int, str, dict[int, int]] | None:
        """``(channel, rank, token, {peer rank: pid})``, or None on every rank of the group.

        ``rows``: every group rank's :attr:`fields`, in group-rank order. Collective on the
        group: two all-reduce MIN votes — none when a row is :data:`NO_OFFER` (a rank that
        does not want a transport: every rank sees the same rows, so none opens one). The first agrees that every rank can map group rank
        0's memory (each reads the probe's secret back through ``/proc/<pid>/fd``: same
        machine, same pid namespace, access allowed) and has connected to the ranks below it;
        the second that every rank has a socket to every other (each end checks the other's
        pid with ``SO_PEERCRED``). The channel's sockets have the group's timeout. Whatever
        the outcome, the offer's listener and probe are closed.
        """
        rank, world, timeout_s = self.rank, self.world, self.timeout_s
        socks: dict[int, socket.socket] = {}
        try:
            if any(int(row[0]) == 0 for row in rows):
                return None
            pids = [int(row[0]) for row in rows]
            nonces = [int(row[1]) for row in rows]
            token, secret = _token_and_secret(rows[0][2:5])
            probe_fd = int(rows[0][5])
            ok = len(rows) == world and probe_fd >= 0 and all(nonces)
            if ok and rank > 0:
                try:
                    ok = read_probe(pids[0], probe_fd, f"{FILE_PREFIX}{token}_probe") == secret
                except OSError:
                    ok = False
            # Before the vote, so that each lower rank's accept below finds the connections
            # queued: every rank connects to the ranks below it.
            for lower in range(rank if ok else 0):
                sock = _connect(_address(nonces[lower]), pids[lower], timeout_s)
                if sock is None:
                    ok = False
                    break
                socks[lower] = sock
            if _agreed(ok, self.group) and rank < world - 1:
                accepted = _accept(self._listener, pids[rank + 1:], timeout_s)
                if accepted is not None:
                    socks.update({pids.index(pid): sock for pid, sock in accepted.items()})
            if not _agreed(len(socks) == world - 1, self.group):
                return None
            peer_pids = {r: pids[r] for r in range(world) if r != rank}
            channel, socks = PeerSync(socks, rank, peer_pids, timeout_s), {}
            return channel, rank, token, peer_pids
        finally:
            self.close()
            for sock in socks.values():  # not handed to a channel
                sock.close()

    def close(self) -> None:
        """Close the listener and the probe (idempotent)."""
        close_quietly(self._fd)
        self._fd = -1
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def exchange_offers(group: dist.ProcessGroup, fields: Sequence[int]) -> list[list[int]]:
    """Every group rank's ``fields`` (as many on each), in group-rank order: one all-gather
    on ``group``."""
    mine = torch.tensor(list(fields), dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [row.tolist() for row in rows]


_PEER_EXIT_S = 1.0
"""How long a rank whose peer closed the transport's socket waits for that process to end."""


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _token_and_secret(shared: Sequence[int]) -> tuple[str, bytes]:
    """The transport's token (hex, for labels and the socket's address) and the probe's secret,
    from the three random fields group rank 0 shares."""
    return token_of(shared[0]), struct.pack("<2q", int(shared[1]), int(shared[2]))


def token_of(number: int) -> str:
    """A token as labels show it (hex) from its number as offers carry it."""
    return f"{int(number):016x}"


def offered_token(rows: Sequence[Sequence[int]]) -> int:
    """The fresh token group rank 0 drew for this exchange (its offer's third field)."""
    return int(rows[0][2])


def _agreed(ok: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (an all-reduce MIN on it)."""
    flag = torch.tensor([int(ok)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class PeerSync:
    """The ready check and the votes of one transport, over its sockets to every peer.

    Every sync is one :meth:`exchange`: each rank sends a few integers to every peer and
    receives theirs (a round trip of a Unix-domain socket, tens of microseconds, where a Gloo
    collective costs hundreds). A dead peer closes its end, so a waiting rank fails at once; a
    hung one fails at the group's timeout.
    """

    def __init__(self, socks: dict[int, socket.socket], rank: int, peer_pids: dict[int, int],
                 timeout_s: float):
        self.socks: dict[int, socket.socket] | None = dict(sorted(socks.items()))
        self.rank = rank
        self.peers = tuple(sorted(socks))
        self.peer_pids = peer_pids
        self.timeout_s = timeout_s
        for sock in socks.values():
            sock.settimeout(timeout_s)

    def release(self) -> None:
        """Close the sockets (the peers' next exchange fails at once). Local; idempotent."""
        socks, self.socks = self.socks, None
        for sock in (socks or {}).values():
            sock.close()

    def exchange(self, what: str, values: Sequence[int]) -> dict[int, tuple[int, ...]]:
        """Send ``values`` to every peer and return each peer's (as many), by rank; a closed
        connection or the timeout becomes :class:`~mini_ddp.errors.CollectiveError` naming
        ``what``."""
        mine = struct.pack(f"<{len(values)}q", *values)
        theirs = {peer: bytearray(len(mine)) for peer in self.peers}
        failure = self._swap(mine, theirs)
        if failure is not None:
            raise CollectiveError(self.rank, f"the shared-memory all-reduce ({what})",
                                  failure) from failure
        return {peer: struct.unpack(f"<{len(values)}q", got) for peer, got in theirs.items()}

    def _swap(self, mine: bytes, theirs: dict[int, bytearray]) -> OSError | None:
        """Send ``mine`` to every peer, fill ``theirs`` from each; None, or what went wrong, in
        words :class:`~mini_ddp.errors.CollectiveError` reads right (a timeout as a hang, a
        closed connection in Gloo's words for it)."""
        socks = self.socks
        if socks is None:
            return ConnectionError("the transport's connections were closed on this rank")
        peer = self.peers[0]
        try:
            for peer in self.peers:  # a few bytes: never blocks
                socks[peer].sendall(mine)
            for peer, sock in socks.items():
                view, received = memoryview(theirs[peer]), 0
                while received < len(view):
                    n = sock.recv_into(view[received:])
                    if n == 0:
                        self._let_peer_exit(peer)
                        return ConnectionResetError(f"Connection closed by peer: rank {peer} "
                                                    "closed its connection")
                    received += n
        except TimeoutError:
            return TimeoutError(f"timed out after {self.timeout_s:.0f} s waiting for rank {peer}")
        except (ConnectionResetError, BrokenPipeError) as err:
            return ConnectionResetError(f"Connection closed by peer: rank {peer} closed its "
                                        f"connection ({err})")
        except OSError as err:
            return err
        return None

    def _let_peer_exit(self, peer: int) -> None:
        """``peer`` closed its end while its process still runs: most often its script is
        ending (its process group destroyed, the channel with it). Give that process up to :data:`_PEER_EXIT_S` to end, so that
        the finish mark it leaves at exit ("finished", not "died") is in the store when this
        rank's error reads it; a killed peer is gone already and costs nothing here."""
        deadline = time.monotonic() + _PEER_EXIT_S
        while _running(self.peer_pids[peer]) and time.monotonic() < deadline:
            time.sleep(0.01)

    def ready(self, op: int, view: int, slot: int, numel: int, dtype: torch.dtype,
              extra: Sequence[int] = ()) -> dict[int, tuple[int, ...]]:
        """Every rank is at the same call: raise ShmDesyncError (on all) if they are not.

        The call is ``op`` on ``slot`` of the transport ``view`` (its token's number: the
        transports of one channel share its sockets) with ``numel`` elements of ``dtype``.
        ``extra``: integers the call needs from every rank (as many on each); returns each
        peer's by rank.
        """
        mine = (op, view, slot, numel, _dtype_code(dtype), *extra)
        theirs = self.exchange(f"{_OPS[op]} of slot {slot}, ready sync", mine)
        if any(row[:5] != mine[:5] for row in theirs.values()):
            rows = {self.rank: mine, **theirs}
            told = {r: (_OPS.get(row[0], "?"), row[2], row[3], _dtype_name(row[4]))
                    for r, row in rows.items()}
            views = {r: token_of(row[1]) for r, row in rows.items()}
            raise ShmDesyncError(self.rank, told,
                                 views if len(set(views.values())) > 1 else None)
        return {peer: row[5:] for peer, row in theirs.items()}

    def allocate(self, token: str, view: int, slot: int, numel: int, dtype: torch.dtype,
                 made: Segment | OSError | None = None) -> Segment | None:
        """This rank's new segment for ``slot`` of the transport ``token`` (``view``: its
        number), or None for ``numel`` 0; one exchange with every peer. ``made``: the segment
        already made for it (or the error that stopped it); None makes one here.

        The exchange is the ready check and carries whether each rank created its segment:
        a failure on any raises :class:`ShmAllocationError` on all. Nothing of a peer is
        mapped here: each rank announces its descriptor at the slot's first all-reduce,
        where the peers map it (:meth:`open_peer`); until then the caller keeps it open.
        """
        name = segment_name(token, self.rank, slot)
        segment, problem = None, ""
        if numel:
            try:
                if isinstance(made, OSError):
                    raise made
                segment = made if made is not None else create_segment(name, numel, dtype)
            except OSError as err:
                problem = f"rank {self.rank} could not create {name}: {err}"
        try:
            theirs = self.ready(ALLOCATE, view, slot, numel, dtype, (int(not problem),))
            failed = [peer for peer, (peer_ok,) in theirs.items() if not peer_ok]
            if problem or failed:
                problem = problem or f"rank {failed[0]} could not create its segment"
                raise ShmAllocationError(
                    f"mini_ddp: {problem} ({numel} elements of {dtype}, "
                    f"{numel * dtype.itemsize / 2**20:.1f} MiB, for slot {slot}); memory "
                    "may be exhausted")
        except BaseException:
            if segment is not None:
                close_quietly(segment.fd)
            raise
        return segment

    def open_peer(self, token: str, peer: int, slot: int, gen: int, fd: int, numel: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """Map ``peer``'s buffer of ``slot`` (generation ``gen``, its descriptor ``fd``)."""
        return open_segment(self.peer_pids[peer], fd, segment_name(token, peer, slot, gen),
                            numel, dtype)

    def dissenters(self, what: str, ok: bool) -> list[int]:
        """Vote ``ok``; the peers whose vote was no, lowest rank first."""
        theirs = self.exchange(what, (int(ok),))  # always: the peers wait for our vote
        return [peer for peer, row in theirs.items() if not row[0]]

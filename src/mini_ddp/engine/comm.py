"""Moving whole tensors between processes: the start-up checks and broadcasts.

* :func:`verify_params_across_ranks` — every rank must hold the same parameters before
  anything is broadcast or reduced; a mismatch is reported *on every rank*, naming the rank,
  the parameter and both shapes (one all-gather, so a mismatch can never turn into a hang).
* :func:`dist_broadcast_coalesced` — rank 0's parameters and buffers to everyone, with few large
  collectives: tensors grouped by dtype and device into flat groups of bounded size
  (torch's own flatten/unflatten helpers), as ``dist._broadcast_coalesced`` does for DDP.

This is the inter-process level. Between the devices of *one* process (``torch.cuda.comm``:
broadcast, reduce-add, scatter, gather) see :mod:`mini_ddp.transport.local_comm`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mini_ddp.errors import MiniDDPError, naming_collective
from mini_ddp.transport.wait import wait_done

# DDP broadcasts module state in groups of at most 250 MiB.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
# ... and mini_ddp sends each group in pieces of about this size, two in flight (see
# dist_broadcast_coalesced): same bits, flattening and copying overlap the transfer.
PIPELINE_BYTES = 4 * 1024 * 1024


class ParameterMismatchError(MiniDDPError):
    """Ranks hold different parameters (count, name, shape, stride or dtype)."""


def _describe(name: str, t: torch.Tensor) -> tuple:
    return (name, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type)


def verify_params_across_ranks(named_params: Sequence[tuple[str, torch.Tensor]],
                               group: dist.ProcessGroup | None = None,
                               carry: Sequence[int] = ()) -> list[list[int]]:
    """Raise :class:`ParameterMismatchError` on every rank unless all ranks agree with rank 0.

    Compares, in order, each parameter's name, shape, stride, dtype and device type: first a
    digest of them from every rank (one all-gather of a few numbers each), and only if the
    digests differ the descriptions themselves, to name the difference.

    ``carry``: integers of another start-up exchange that ride on the same all-gather (as many
    on every rank: the shared-memory transport's offer); returns every rank's, in group-rank
    order, once the check has passed.
    """
    mine = [_describe(n, t) for n, t in named_params]
    digest = int.from_bytes(hashlib.blake2b(repr(mine).encode(), digest_size=8).digest(),
                            "little", signed=True)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    row = torch.tensor([digest, *carry], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(size)]
    what = "the start-up all-gather that checks every rank holds the same parameters"
    with naming_collective(rank, what):
        dist.all_gather(rows, row, group=group)
    gathered = [r.tolist() for r in rows]
    if all(r[0] == digest for r in gathered):  # every rank sees the same digests
        return [r[1:] for r in gathered]
    everyone: list = [None] * size
    with naming_collective(rank, what):
        dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        problem = _first_difference(reference, theirs, rank)
        if problem:
            torch_says = torch_mismatch_sentence(everyone, dist.get_rank(group))
            raise ParameterMismatchError(
                (f"{torch_says} " if torch_says else "")
                + f"mini_ddp: ranks hold different models: {problem}. Every rank must build the "
                f"same model (same parameters, in the same order, with the same shapes) "
                f"before wrapping it in DataParallelModel.")
    return [r[1:] for r in gathered]


def torch_mismatch_sentence(everyone: list, me: int) -> str | None:
    """The sentence torch DDP's start-up check raises on rank ``me``, or None where it does not.

    ``everyone``: each rank's list of ``(name, shape, stride, ...)``. torch's C++
    ``verify_params_across_processes`` first compares this rank's parameter count with every
    rank's, in rank order, then each size and stride with rank 0's; rank 0 itself never fails
    the second check, and names, dtypes and devices are not compared at all. mini_ddp raises on
    every rank and for those too; where torch would raise, its sentence comes first, verbatim.
    """
    mine = everyone[me]
    for rank, theirs in enumerate(everyone):
        if len(theirs) != len(mine):
            return (f"DDP expects same model across all ranks, but Rank {me} has {len(mine)} "
                    f"params, while rank {rank} has inconsistent {len(theirs)} params.")
    for index, (own, ref) in enumerate(zip(mine, everyone[0], strict=True)):
        for field, position in (("sizes", 1), ("strides", 2)):
            if own[position] != ref[position]:
                return (f"[{me}]: params[{index}] in this process with sizes {list(own[1])} "
                        f"appears not to match {field} of the same param in process 0.")
    return None


def _first_difference(reference: list, theirs: list, rank: int) -> str | None:
    fields = ("name", "shape", "stride", "dtype", "device type")
    for position, (ref, other) in enumerate(zip(reference, theirs, strict=False)):
        for field, a, b in zip(fields, ref, other, strict=True):
            if a != b:
                if field == "name":
                    return (f"parameter #{position} is '{b}' on rank {rank} but '{a}' on rank 0 "
                            f"(shapes {list(other[1])} vs {list(ref[1])})")
                return (f"parameter '{ref[0]}' has {field} {_fmt(b)} on rank {rank} "
                        f"but {_fmt(a)} on rank 0")
    if len(reference) != len(theirs):
        longer, who = (theirs, rank) if len(theirs) > len(reference) else (reference, 0)
        extra = longer[min(len(reference), len(theirs))]
        return (f"rank {rank} has {len(theirs)} parameters requiring grad, rank 0 has "
                f"{len(reference)}; the first extra one is '{extra[0]}' with shape "
                f"{list(extra[1])} on rank {who}")
    return None


def _fmt(value: object) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def dist_broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0,
                             group: dist.ProcessGroup | None = None,
                             bucket_bytes: int = BROADCAST_BUCKET_BYTES,
                             timeout_s: float | None = None, flight: Any = None,
                             op: str = "buffers_broadcast", step: int = 0,
                             stall_after_s: float | None = None,
                             on_slow: Callable[[], None] | None = None) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in few collectives.

    Tensors are grouped by (dtype, device) in order, each group capped at ``bucket_bytes``,
    and sent in pieces of about ``PIPELINE_BYTES`` (as a group closes: once it reaches the
    size), each flattened into one tensor, broadcast, and copied back, two pieces of a group in
    flight, the groups one after the other.
    Values are copied exactly, so the grouping never changes a bit. Only ``src`` flattens
    (the others receive into an empty buffer) and only the others copy back (``src``'s
    tensors already hold what it sent; their version counters are bumped as a copy would):
    one copy of the state less per rank than torch's ``_broadcast_coalesced``, same bits.
    ``timeout_s`` bounds the wait for each broadcast, blocking the host until it has
    finished (RuntimeError when it runs out);
    None waits as torch DDP does — on NCCL only the current stream waits, not the host, and
    the process group's own timeout applies. ``flight``: a flight recorder
    (:class:`mini_ddp.watch.flight_log.FlightLog`) that records each broadcast as ``op`` of
    ``step``. ``on_slow`` is called once a broadcast with a result on the CPU has waited
    ``stall_after_s`` (the stall warning: it may raise, else the wait goes on); on a GPU the
    host does not wait here, as in torch DDP, and a stall shows at the next bucket's wait.
    """
    sending = dist.get_rank() == src  # ``src`` is a global rank
    in_flight: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work, Any]] = []

    def finish_oldest() -> None:
        group_tensors, flat, work, entry = in_flight.pop(0)
        _wait_bounded(work, timeout_s, stall_after_s if flat.device.type == "cpu" else None,
                      on_slow)
        if entry is not None:
            flight.finished(entry)
        if sending and not any(t.is_inference() for t in group_tensors):
            torch.autograd.graph.increment_version(group_tensors)
        else:  # (an inference tensor refuses the copy on every rank, as in torch DDP)
            torch._foreach_copy_(group_tensors, _unflatten_dense_tensors(flat, group_tensors))

    with torch.no_grad():
        # A group goes in pieces of about PIPELINE_BYTES, two in flight (torch's
        # broadcast_coalesced keeps two too): while one piece is on the wire, the sender
        # flattens the next and the receivers copy the last one out, where a whole group would
        # do the three in turn. Groups go one after the other, as torch's: with a rank gone, a
        # later group never completes on a rank the earlier one did not (the int64 batch
        # counter does not overtake the float buffers, so the error names the broadcast).
        for group_tensors in _coalesce_groups(tensors, bucket_bytes):
            for piece in _coalesce_groups(group_tensors, PIPELINE_BYTES):
                if sending:
                    flat = _flatten_dense_tensors(piece)
                else:  # overwritten whole by the broadcast: what it held is never read
                    flat = piece[0].new_empty(sum(t.numel() for t in piece))
                entry = None if flight is None else flight.started(op, step, flat)
                in_flight.append((piece, flat, dist.broadcast(flat, src=src, group=group,
                                                              async_op=True), entry))
                if len(in_flight) == 2:
                    finish_oldest()
            while in_flight:
                finish_oldest()


def _wait_bounded(work: dist.Work, timeout_s: float | None, stall_after_s: float | None = None,
                  on_slow: Callable[[], None] | None = None) -> None:
    if timeout_s is None and (on_slow is None or stall_after_s is None):
        # torch DDP's own wait: on NCCL it only orders the current stream after the broadcast,
        # so the forward never blocks the host here.
        work.wait()
        return
    # A deadline the user set, or the stall warning's limit on the CPU: wait until the
    # broadcast has finished — on a GPU, until the GPU has run it (NCCL's future is done at
    # launch; wait_done asks the work itself).
    if not wait_done(work.get_future(), timeout_s, work=work, stall_after_s=stall_after_s,
                     on_slow=on_slow):
        raise RuntimeError(f"no answer within {timeout_s} s (DataParallelModel's "
                           "sync_timeout_s)")
    work.wait()  # raises the collective's own error (e.g. a peer closed its connection)


def _coalesce_groups(tensors: Sequence[torch.Tensor], bucket_bytes: int
                     ) -> list[list[torch.Tensor]]:
    groups: list[list[torch.Tensor]] = []
    current: dict[tuple, list[torch.Tensor]] = {}
    current_bytes: dict[tuple, int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        group = current.get(key)
        if group is None:
            current[key] = group = []
            current_bytes[key] = 0
        group.append(t)
        current_bytes[key] += t.nbytes
        if current_bytes[key] >= bucket_bytes:
            groups.append(current.pop(key))
            del current_bytes[key]
    groups.extend(current.values())
    return groups

"""Every knob of DataParallelModel in one dataclass, each with what it means and why."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# DDP's default bucket cap (25 MiB) and its smaller first bucket (1 MiB, used only when the
# user did not choose a cap). "MB" in DDP's arguments means MiB.
DEFAULT_BUCKET_CAP_MB = 25
MIB = 1024 * 1024


@dataclass
class DataParallelConfig:
    """How gradients are bucketed, synchronised and checked. Defaults are torch DDP's."""

    bucket_cap_mb: float | None = None
    """Bucket size cap in MiB (DDP calls it MB). ``None`` means DDP's default of 25 MiB *and*
    a small first bucket (``first_bucket_bytes``) after the rebuild; an explicit value uses
    that cap for every bucket, the first included."""

    bucket_cap_mb_list: list[float] | None = None
    """Per-bucket caps in MiB: bucket *i* of each dtype/device is capped by entry *i*, later
    ones by the last entry — for the first iteration's layout (over definition order, even
    without unused-parameter search) and for the rebuild alike, as torch DDP's
    ``bucket_cap_mb_list``. ``bucket_cap_mb`` is then ignored: the cap is the list's maximum
    and there is no separate small first bucket."""

    first_bucket_bytes: int | None = None
    """Cap of the first bucket after the rebuild. ``None`` reads DDP's module-level
    ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) when ``bucket_cap_mb`` is
    ``None``, else equals the cap — exactly how DDP chooses it."""

    find_unused_parameters: bool = False
    """Walk the autograd graph from the forward outputs each step and treat parameters it
    cannot reach as ready (with zero gradients). Costs a graph walk per step; parameters that no
    rank used keep their ``.grad`` untouched. Disables the bucket rebuild, as in DDP."""

    gradient_as_bucket_view: bool = False
    """Leave ``param.grad`` as a view into its bucket after the step instead of copying the
    result out: saves one gradient-sized copy and the memory of separate ``.grad`` tensors."""

    static_graph: bool = False
    """Promise that the same parameters get gradients, the same number of times, every
    iteration. Iteration 1 reduces everything after backward and records the pattern; later
    iterations may fire a parameter's hook several times (activation checkpointing)."""

    init_sync: bool = True
    """At construction, verify all ranks hold the same parameters and broadcast rank 0's
    parameters (and buffers, see ``init_sync_buffers``)."""

    init_sync_buffers: bool = True
    """Include buffers in the initial broadcast (DDP: follows ``broadcast_buffers``)."""

    forward_sync_buffers: bool = True
    """Broadcast rank 0's buffers (BatchNorm statistics, …) before the first forward and before
    each forward that follows a synchronised, grad-enabled one — also when this forward runs
    under ``no_grad`` (an evaluation right after a training step broadcasts too, so it is a
    collective: run it on every rank, or call ``model.module``) — and not right after a forward
    under ``no_grad`` or ``no_sync()``. This is DDP's rule: torch sets
    ``require_forward_param_sync`` after each forward from whether that forward synchronised."""

    sync_timeout_s: float | None = None
    """How long the end of backward waits for one bucket's collective (counted from the start
    of the wait, a stall warning included), and — only when set here — a forward for the
    buffer broadcast, before raising :class:`mini_ddp.errors.GradSyncTimeout` naming what it
    waited for. ``None`` (the default) means the process group's own timeout — what torch DDP waits (torch's
    default is 30 min for Gloo, the examples' launcher sets 10 min, and
    ``init_process_group(timeout=...)`` decides); ``DataParallelModel`` fills
    it in, see :func:`process_group_timeout_s`. Gloo fails the collective itself at that
    timeout, usually first: then the error is a ``CollectiveError`` naming the bucket."""

    sync_timeout_from_user: bool | None = None
    """Whether ``sync_timeout_s`` was given by the user (filled in by
    :meth:`resolve_sync_timeout`). Only a deadline the user set bounds the forward's buffer
    broadcast (:attr:`buffer_sync_timeout_s`); the gradient waits always have one."""

    stall_warning_s: float | None = 60.0
    """After this long waiting for one bucket, log a WARNING (logger ``"mini_ddp"``) naming the
    bucket, its parameters and the ranks that have not reached it, then keep waiting
    (:mod:`mini_ddp.watch.stall`). Free until a wait is that slow. ``None``: no warning."""

    zero_copy_write_back: bool = False
    """Opt-in. After the all-reduce, make ``param.grad`` the bucket's view instead of copying the
    bucket into a separate ``.grad`` (DDP's way, the default). One gradient-sized copy less at
    the end of every backward, and no separate ``.grad`` tensors. Before the next backward
    overwrites a bucket, the reducer checks from reference counts that nothing but ``.grad``
    looks into it (a gradient saved without ``clone()``, a view of one, a DLPack/NumPy export
    such as ``np.from_dlpack`` or ``.numpy()``, a kept ``untyped_storage()``, a weak
    reference); if something does, that bucket moves to a fresh buffer. A consumer that keeps
    only a raw pointer (``data_ptr()`` through ``ctypes`` or a C extension) or reaches memory
    through ``.data`` is invisible to that check and can see a later step's values where DDP's
    separate ``.grad`` would not (docs/limitations.md). Applies to the plain path
    only (not with ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view`` or
    mixed precision, which keep DDP's rules). ``False``: copy, exactly as DDP."""

    shared_memory_allreduce: bool = True
    """With CPU ranks that share one machine (the default group, Gloo), sum buckets of
    float32/float64 through shared memory (:mod:`mini_ddp.transport.shm`) instead of Gloo's
    loopback TCP: a quarter of the CPU time for large buckets. Bitwise the same: each rank adds
    the chunk Gloo's ring would finish on it, in the ring's order (:mod:`mini_ddp.transport.shm_sum`).
    Iteration 1's layout, when DDP rebuilds it (:attr:`rebuilds_layout`), stays on Gloo: fresh
    shared memory would cost about what Gloo's sum does, for a layout that lasts one step (two
    with a static graph).
    Off, or any other job: Gloo."""

    shared_memory_min_bytes: int = 0
    """Buckets smaller than this stay on Gloo. 0 (the default): every float32/float64 bucket
    goes through shared memory, since its two syncs are socket round trips of tens of
    microseconds, less than a Gloo collective of even a few bytes costs (docs/performance.md)."""

    grouped_hooks: bool = True
    """Once two consecutive synchronised backwards of the plain path delivered every gradient
    in the same order, keep one autograd hook per group of 32 gradients of a bucket instead of
    one per gradient (:mod:`mini_ddp.engine.hook_groups`): each hook copies its group into the
    bucket at once. Same bits; every group is checked before it is copied, and a change of
    order falls back to one hook per gradient within the same backward. Gradients are then
    read once per bucket or group rather than in their own hooks, which is only done while no
    user hook can change a ``.grad`` in between (see the module). ``False``: one hook per
    gradient always, each gradient read in its hook, as torch DDP's reducer."""

    debug: bool = False
    """mini_ddp's debug switch (``DataParallelModel(debug=...)``; None there reads
    ``MINI_DDP_DEBUG=1`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): collective fingerprints and
    the local-gradient watch name an extra forward on one rank, uneven inputs, a collective on
    some ranks only, where a NaN came from and a bypassed wrapper; the replica check raises
    instead of warning (:mod:`mini_ddp.checks.debug`). Costs a store round trip per step."""

    replica_check_every: int | None = 100
    """Compare the ranks' parameters, buffers and train/eval modes at step 1 and every this
    many synchronised steps, through the store (:mod:`mini_ddp.checks.replicas`); the first
    step's local gradients too (identical data on every rank). None: off."""

    skip_all_reduce_unused_params: bool = False
    """Do not launch a bucket whose parameters are all unused this iteration (found unused by
    ``find_unused_parameters``, or by a static graph's first iteration); their ``.grad`` stay
    as they are. Every rank must have the same unused parameters, or the collectives
    mismatch — as in torch DDP."""

    batched_grad_copy: bool = False
    """Defer each gradient's copy into its bucket until the bucket is full, then copy them all
    with one ``torch._foreach_copy_`` and divide the whole bucket once (``div_``, a true
    division — different bits from the default multiply by ``1/world_size``), as torch DDP."""

    expect_sparse_gradients: list[bool] | None = None
    """Per reducer parameter: does its module produce sparse gradients (``Embedding`` /
    ``EmbeddingBag`` with ``sparse=True``)? Set by ``DataParallelModel``; each such parameter
    gets a bucket of its own (:mod:`mini_ddp.engine.buckets`)."""

    def resolve_sync_timeout(self, group: dist.ProcessGroup) -> None:
        """Replace ``sync_timeout_s=None`` by ``group``'s own timeout, in seconds, and
        remember whether the user had set it (a second call changes neither)."""
        if self.sync_timeout_from_user is None:
            self.sync_timeout_from_user = self.sync_timeout_s is not None
        if self.sync_timeout_s is None:
            self.sync_timeout_s = process_group_timeout_s(group)

    @property
    def buffer_sync_timeout_s(self) -> float | None:
        """The bound on the forward's buffer broadcast: ``sync_timeout_s`` if the user set it,
        else None — torch DDP never blocks the host there (on NCCL a bounded wait would)."""
        return self.sync_timeout_s if self.sync_timeout_from_user else None

    def __post_init__(self) -> None:
        if self.bucket_cap_mb_list:
            self.bucket_cap_mb = max(self.bucket_cap_mb_list)  # what DDP reports as the cap
        if self.first_bucket_bytes is None:
            self.first_bucket_bytes = (dist._DEFAULT_FIRST_BUCKET_BYTES
                                       if self.bucket_cap_mb is None else self.bucket_bytes_cap)

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes (DDP truncates MiB × 2**20 to an integer)."""
        cap = DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb
        return int(cap * MIB)

    @property
    def rebuilds_layout(self) -> bool:
        """Whether iteration 1's bucket layout is replaced once, by one in gradient-ready order
        (before the second forward; the third with a static graph): DDP rebuilds unless it
        searches for unused parameters without a static graph."""
        return self.static_graph or not self.find_unused_parameters

    def initial_size_limits(self) -> list[int]:
        """Caps for iteration 1's layout, over the parameters' definition order.

        Without unused-parameter search (or with a static graph) DDP puts everything of one
        dtype/device into a single bucket: definition order is not backward order, and a wrong
        early launch could deadlock against other collectives. The rebuild fixes the layout.
        """
        if self.bucket_cap_mb_list:
            return self.per_bucket_caps()
        if self.rebuilds_layout:
            return [sys.maxsize]
        if self.first_bucket_bytes < self.bucket_bytes_cap:
            return [self.first_bucket_bytes, self.bucket_bytes_cap]
        return [self.bucket_bytes_cap]

    def rebuild_size_limits(self) -> list[int]:
        """Caps for the one-time rebuild over gradient-ready order: [first bucket, cap]."""
        if self.bucket_cap_mb_list:
            return self.per_bucket_caps()
        return [self.first_bucket_bytes, self.bucket_bytes_cap]

    def per_bucket_caps(self) -> list[int]:
        """``bucket_cap_mb_list`` in bytes (DDP truncates each MiB × 2**20 to an integer)."""
        return [int(cap * MIB) for cap in self.bucket_cap_mb_list or ()]

    def layout_reason(self, rebuilt: bool) -> str:
        """Why the bucket layout is what it is, in one line (start-up log, ``explain``)."""
        caps = (f"cap {_mib(self.bucket_bytes_cap)}" if self.first_bucket_bytes
                == self.bucket_bytes_cap else f"first bucket cap "
                f"{_mib(self.first_bucket_bytes)}, then {_mib(self.bucket_bytes_cap)}")
        if rebuilt:
            when = "iteration 2" if self.static_graph else "iteration 1"
            return (f"rebuilt once, in the order gradients became ready in {when}'s backward "
                    f"(rank 0's order, broadcast to all ranks), {caps}")
        if self.rebuilds_layout:
            flag = "static_graph=True" if self.static_graph else "find_unused_parameters=False"
            return (f"iteration 1: one bucket per dtype/device, no size cap ({flag}: DDP does "
                    f"not cut buckets before it has seen the gradient-ready order; rebuilt "
                    f"before the {'third' if self.static_graph else 'second'} forward)")
        return (f"definition order, last parameters first, {caps} "
                f"(find_unused_parameters=True: never rebuilt)")


def process_group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout ``group``'s collectives were created with (``init_process_group`` /
    ``new_group(timeout=...)``), in seconds.

    torch keeps it in the backend's options (``ProcessGroupGloo.options._timeout``); a backend
    without readable options falls back to torch's default for its kind (30 min for Gloo).
    """
    try:
        backend = group._get_backend(torch.device("cpu" if dist.get_backend(group) == "gloo"
                                                  else "cuda"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group)).total_seconds()


def format_bytes(nbytes: int | None) -> str:
    """A size for people: ``"10.2 KiB"``, ``"25 MiB"``, ``"512 B"`` (3 significant digits)."""
    value, unit = float(nbytes or 0), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def _mib(nbytes: int | None) -> str:
    return f"{format_bytes(nbytes)} ({nbytes or 0:,} bytes)"


DEBUG_ENV = "MINI_DDP_DEBUG"
"""The environment variable of mini_ddp's debug switch (:mod:`mini_ddp.checks.debug`)."""


def debug_requested(explicit: bool | None = None) -> bool:
    """The switch: ``explicit`` when given, else ``MINI_DDP_DEBUG`` (anything but empty or
    ``0``), else whether torch's ``TORCH_DISTRIBUTED_DEBUG`` is ``DETAIL``."""
    if explicit is not None:
        return explicit
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return True
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"

"""Gradient buckets: which parameters share one flat tensor, and that tensor itself.

Two things live here, and nothing about autograd or hooks:

* :func:`assign_buckets` — DDP's size-capped bucket assignment as a pure function of parameter
  sizes, dtypes, devices, limits and order. It reproduces torch's
  ``dist._compute_bucket_assignment_by_size`` (tested against it directly), because the layout
  decides the position of every element in the flat all-reduce buffer, and Gloo's summation
  order — hence the bits of the result — depends on that position.
* :class:`Bucket` — one flat gradient tensor, the per-parameter views into it, and the
  per-step bookkeeping (how many gradients are still missing, the pending collective).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# DDP's default bucket cap (25 MiB) and its smaller first bucket (1 MiB, used only when the
# user did not choose a cap). "MB" in DDP's arguments means MiB.
DEFAULT_BUCKET_CAP_MB = 25
MIB = 1024 * 1024

Allocator = Callable[[int, torch.dtype, torch.device], torch.Tensor]
"""Makes a bucket's zero-filled flat buffer: ``allocate(numel, dtype, device)``."""


def zeros_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The plain allocator: a private ``torch.zeros`` buffer."""
    return torch.zeros(numel, dtype=dtype, device=device)


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many tensors (views included) share ``tensor``'s storage, plus one for the query.

    The zero-copy write-back uses it to see whether anything besides the reducer's own views
    still looks into a bucket buffer before it overwrites it.
    """
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def storage_object_refs(tensor: torch.Tensor) -> int:
    """Python references to ``tensor``'s storage object, plus the query's own.

    torch keeps one Python object per storage while anything holds it (``t.untyped_storage()``
    returns that same object), so a kept storage shows here although it does not change
    :func:`storage_use_count`.
    """
    return sys.getrefcount(tensor.untyped_storage())


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` look into the same memory (is ``.grad`` already a bucket view)?"""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def assign_buckets(
    params: Sequence[torch.Tensor],
    size_limits: Sequence[int],
    order: Sequence[int] | None = None,
    expect_sparse: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets exactly as torch DDP does.

    Parameters are visited in ``order`` (default: index order) and added to the open bucket of
    their (dtype, device); a bucket closes as soon as its byte size *reaches* its limit, so it
    may exceed it. Each (dtype, device) walks through ``size_limits`` one bucket at a time and
    then keeps using the last limit. With the default order the result is sorted by the
    smallest index a bucket holds; with an explicit ``order`` (the gradient-ready order of the
    rebuild) buckets keep the order in which they closed. A parameter flagged in
    ``expect_sparse`` gets a bucket of its own, with no cap (DDP's rule for sparse gradients).
    """
    if not params:
        raise ValueError("assign_buckets needs at least one parameter")
    # torch's C++ reducer holds the caps as size_t: a negative ``bucket_cap_mb`` (which torch
    # DDP accepts) wraps around to a huge cap, i.e. one bucket per dtype/device.
    size_limits = [limit % (1 << 64) for limit in size_limits]
    visit = list(range(len(params))) if order is None else list(order)
    result: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    limit_pos: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in visit:
        tensor = params[index]
        if expect_sparse is not None and expect_sparse[index]:
            result.append([index])
            continue
        key = (tensor.dtype, tensor.device)
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        pos = limit_pos.setdefault(key, 0)
        if open_bytes[key] >= size_limits[pos]:
            result.append(open_buckets.pop(key))
            open_bytes[key] = 0
            limit_pos[key] = min(pos + 1, len(size_limits) - 1)
    # Buckets still open at the end, in the order their (dtype, device) first appeared.
    # (torch iterates a hash map here; the order of *whole buckets* never changes any value.)
    result.extend(indices for indices in open_buckets.values() if indices)
    if order is None:
        result.sort(key=min)
    return result


def agree_on_layout(layout: list[list[int]], group: dist.ProcessGroup | None,
                    device: torch.device) -> list[list[int]]:
    """Make every rank use rank 0's bucket layout (DDP broadcasts the rebuilt layout too).

    Gradient-ready order can differ between ranks (threads, data-dependent control flow);
    all-reducing buckets of different shapes would mix unrelated gradients, so rank 0 decides.
    """
    sizes = [len(bucket) for bucket in layout]
    header = torch.tensor([len(sizes), sum(sizes)], dtype=torch.int64, device=device)
    dist.broadcast(header, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    num_buckets, num_indices = (int(v) for v in header.tolist())
    body = torch.zeros(num_buckets + num_indices, dtype=torch.int64, device=device)
    if dist.get_rank(group) == 0:
        body.copy_(torch.tensor(sizes + [i for bucket in layout for i in bucket]))
    dist.broadcast(body, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    values = body.tolist()
    agreed, cursor = [], num_buckets
    for size in values[:num_buckets]:
        agreed.append(values[cursor:cursor + size])
        cursor += size
    return agreed


def _is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """True when some permutation of ``t``'s dimensions is contiguous (C++'s check of that name)."""
    if t.numel() < 2:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.size(), t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def flat_view(buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """A contiguous view of ``buffer`` at ``offset`` shaped like ``param``.

    What a comm hook's ``bucket.gradients()`` returns: torch's ``GradBucket`` slices its buffer
    and views each slice with the parameter's *shape only*, so for a channels-last weight it
    does not match the bucket's own view (it reads the same memory in contiguous order).
    """
    return buffer.narrow(0, offset, param.numel()).view(param.size())


def _view_like(buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``buffer`` at ``offset`` shaped like ``param``.

    Like DDP, a dense parameter gets a view with *its own strides* (so a channels-last weight
    gets a channels-last gradient, as AccumulateGrad would have made); anything else gets a
    contiguous view.
    """
    if _is_non_overlapping_and_dense(param):
        return buffer.as_strided(param.size(), param.stride(), offset)
    return flat_view(buffer, param, offset)


@dataclass(eq=False)
class Bucket:
    """One flat gradient tensor shared by several parameters.

    ``buffer`` is what the collective reduces; ``views[i]`` is parameter ``params[i]``'s
    gradient inside it. ``pending`` counts the gradients still missing this step; the bucket
    is ready to launch when it reaches zero. ``future`` holds the running collective's result.
    """

    index: int
    param_indices: list[int]
    params: list[torch.Tensor]
    buffer: torch.Tensor
    offsets: list[int]
    views: list[torch.Tensor]
    pending: int = 0
    future: torch.futures.Future | None = None
    grad_bucket: Any = None  # the GradBucket handed to the comm hook at launch
    handed_out: bool = False  # views were made ``.grad`` by the zero-copy write-back
    base_refs: int = 0  # storage_use_count(buffer) while only this bucket looks into it
    storage_refs: int = 0  # storage_object_refs(buffer) then
    sparse: bool = False  # one parameter with sparse gradients: ``buffer`` *is* its ``.grad``
    deferred: list[int] = field(default_factory=list)  # batched_grad_copy: positions to copy

    @classmethod
    def build(cls, index: int, param_indices: list[int], all_params: Sequence[torch.Tensor],
              allocate: Allocator = zeros_allocator, sparse: bool = False) -> Bucket:
        """Allocate the flat buffer for ``param_indices`` (in that order) and its views.

        A ``sparse`` bucket allocates nothing and has no views: its buffer becomes the
        parameter's sparse ``.grad`` when that is ready (:mod:`mini_ddp.engine.sparse`).
        """
        params = [all_params[i] for i in param_indices]
        if sparse:
            # An empty sparse stand-in until the first gradient: join's shadow all-reduce
            # can send zeros shaped like it before this rank has ever had a gradient.
            p = params[0]
            empty = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.long, device=p.device),
                                            p.new_empty(0, *p.shape[1:]), p.shape,
                                            check_invariants=False)
            return cls(index, list(param_indices), params, empty, [0], [], pending=1,
                       sparse=True)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        first = params[0]
        bucket = cls(index, list(param_indices), params, first.new_empty(0), offsets, [],
                     pending=len(params))
        bucket.replace_buffer(allocate(total, first.dtype, first.device))
        return bucket

    def replace_buffer(self, buffer: torch.Tensor) -> None:
        """Move the bucket onto ``buffer`` (same size, zero-filled) and re-make its views."""
        self.buffer = buffer
        self.views = [_view_like(buffer, p, off) for p, off in zip(self.params, self.offsets,
                                                                   strict=True)]
        self.handed_out = False
        self.base_refs = storage_use_count(buffer)
        self.storage_refs = storage_object_refs(buffer)

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.buffer.numel() * self.buffer.element_size()

    def views_of(self, result: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a collective's result (a hook may return a new tensor)."""
        if result is self.buffer:
            return self.views
        return [_view_like(result, p, off) for p, off in zip(self.params, self.offsets,
                                                              strict=True)]


def build_buckets(layout: list[list[int]], params: Sequence[torch.Tensor],
                  allocate: Allocator = zeros_allocator,
                  expect_sparse: Sequence[bool] | None = None
                  ) -> tuple[list[Bucket], list[tuple[int, int]]]:
    """Make the buckets for ``layout`` and a locator: param index -> (bucket, position)."""
    buckets = [Bucket.build(i, indices, params, allocate, sparse=bool(
        expect_sparse and len(indices) == 1 and expect_sparse[indices[0]]))
        for i, indices in enumerate(layout)]
    locator: list[tuple[int, int]] = [(-1, -1)] * len(params)
    for bucket in buckets:
        for pos, param_index in enumerate(bucket.param_indices):
            locator[param_index] = (bucket.index, pos)
    return buckets, locator


def describe_layout(buckets: Sequence[Bucket], names: Sequence[str],
                    max_names: int | None = 6) -> str:
    """The bucket layout as a table, one row per bucket (start-up log and ``explain``).

    Buckets launch strictly in index order — each waits until every earlier one has launched —
    so the bucket index *is* the launch order. Names are in buffer order; ``max_names`` cuts
    long lists (``None``: all).
    """
    lines = ["  bucket  dtype       device        bytes  params  parameters (in buffer order)"]
    for b in buckets:
        shown = [names[i] for i in b.param_indices]
        if max_names is not None and len(shown) > max_names:
            shown = shown[:max_names] + [f"… (+{len(shown) - max_names})"]
        dtype = str(b.buffer.dtype).replace("torch.", "")
        lines.append(f"  {b.index:>6}  {dtype:<10}  {str(b.buffer.device):<6}  {b.nbytes:>11,}"
                     f"  {len(b.param_indices):>6}  {', '.join(shown)}")
    return "\n".join(lines)

"""Gradient buckets: which parameters share one flat tensor, and that tensor itself.

What lives here, and nothing about autograd hooks:

* :func:`assign_buckets` — DDP's size-capped bucket assignment as a pure function of parameter
  sizes, dtypes, devices, limits and order. It reproduces torch's
  ``dist._compute_bucket_assignment_by_size`` (tested against it directly), because the layout
  decides the position of every element in the flat all-reduce buffer, and Gloo's summation
  order — hence the bits of the result — depends on that position.
* :class:`Bucket` — one flat gradient tensor, the per-parameter views into it, and the
  per-step bookkeeping (how many gradients are still missing, the pending collective).
* :class:`BucketLayout` — which buckets exist now, and their one-time rebuild in gradient
  order: it installs a layout's buffers (allocating them in shared memory when the transport
  will sum them); the hooks of the first backward record the order in which gradients arrive
  (:meth:`BucketLayout.record_ready`), and before the second forward
  :meth:`BucketLayout.rebuild_if_needed` rebuilds the buckets once in that order, with rank 0's
  layout (DDP's ``rebuild_buckets``). It also tracks which of several live wrappers of the
  same parameters armed last (:meth:`BucketLayout.armed_elsewhere`): each keeps its hooks, as
  torch DDP's reducers do, and a backward belongs to the wrapper whose forward ran. It knows
  parameters, the config and the transport, never the reducer, which owns one.
* Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``), as torch
  DDP: such a parameter gets a bucket of its own, outside the dense flat buffers (DDP's
  ``compute_bucket_assignment_by_size`` does the same, with no size cap), and that bucket's
  "buffer" is the sparse ``.grad`` itself. When the gradient is ready the reducer divides it
  in place (a true division, DDP's ``mark_variable_ready_sparse``; with a comm hook it is left
  for the hook); the collective is an all-reduce of that sparse tensor (Gloo sums sparse
  tensors), launched in bucket order like any other, and a comm hook gets a bucket whose
  ``buffer()`` is the sparse tensor; at the end of backward the result is copied back into the
  same ``.grad`` (:func:`sparse_write_back`). A parameter that expects a sparse gradient must
  receive one: DDP refuses an undefined or dense gradient for it (:func:`check_sparse_grad`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.errors import naming_collective
from mini_ddp.transport.shm import SharedMemoryAllreduce, ShmAllocationError, shm_supported

logger = logging.getLogger("mini_ddp")

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
        open_bytes[key] = open_bytes.get(key, 0) + tensor.nbytes
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
                    device: torch.device, flight: Any = None, step: int = 0
                    ) -> list[list[int]]:
    """Make every rank use rank 0's bucket layout (DDP broadcasts the rebuilt layout too).

    Gradient-ready order can differ between ranks (threads, data-dependent control flow);
    all-reducing buckets of different shapes would mix unrelated gradients, so rank 0 decides.
    ``flight``: the flight recorder that records both broadcasts (as ``layout_broadcast`` of
    ``step``).
    """
    sizes = [len(bucket) for bucket in layout]
    src = dist.get_global_rank(group, 0) if group else 0
    header = torch.tensor([len(sizes), sum(sizes)], dtype=torch.int64, device=device)
    _recorded_broadcast(header, src, group, flight, step)
    num_buckets, num_indices = (int(v) for v in header.tolist())
    body = torch.zeros(num_buckets + num_indices, dtype=torch.int64, device=device)
    if dist.get_rank(group) == 0:
        body.copy_(torch.tensor(sizes + [i for bucket in layout for i in bucket]))
    _recorded_broadcast(body, src, group, flight, step)
    values = body.tolist()
    agreed, cursor = [], num_buckets
    for size in values[:num_buckets]:
        agreed.append(values[cursor:cursor + size])
        cursor += size
    return agreed


def _recorded_broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None,
                        flight: Any, step: int) -> None:
    entry = None if flight is None else flight.started("layout_broadcast", step, tensor)
    dist.broadcast(tensor, src=src, group=group)
    if entry is not None:
        flight.finished(entry)


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
    if param.is_contiguous() or _is_non_overlapping_and_dense(param):
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
    # The default path: (position, .grad, its version) as each hook saw it, this step.
    noted: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)

    @classmethod
    def build(cls, index: int, param_indices: list[int], all_params: Sequence[torch.Tensor],
              allocate: Allocator = zeros_allocator, sparse: bool = False) -> Bucket:
        """Allocate the flat buffer for ``param_indices`` (in that order) and its views.

        A ``sparse`` bucket allocates nothing and has no views: its buffer becomes the
        parameter's sparse ``.grad`` when that is ready (:func:`check_sparse_grad`).
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


def _sparse_bucket(indices: list[int], expect_sparse: Sequence[bool] | None) -> bool:
    # A parameter that expects sparse gradients has a bucket of its own, with no buffer.
    return bool(expect_sparse and len(indices) == 1 and expect_sparse[indices[0]])


def build_buckets(layout: list[list[int]], params: Sequence[torch.Tensor],
                  allocate: Allocator = zeros_allocator,
                  expect_sparse: Sequence[bool] | None = None
                  ) -> tuple[list[Bucket], list[tuple[int, int]]]:
    """Make the buckets for ``layout`` and a locator: param index -> (bucket, position)."""
    buckets = [Bucket.build(i, indices, params, allocate,
                            sparse=_sparse_bucket(indices, expect_sparse))
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


def assign_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad``, allowing a dtype other than the parameter's.

    DDP's C++ reducer sets ``.grad`` without Python's dtype check. With mixed precision and
    ``gradient_as_bucket_view=True`` it hands a ``param_dtype`` bucket view to a
    full-precision parameter (and a view the comm hook upcast to a low-precision one).
    """
    if grad.dtype != param.dtype:
        param.grad_dtype = None  # torch's documented switch for "any dtype"
    param.grad = grad


# ---- the layout in use, and its one-time rebuild ----------------------------------------
class _ArmedBy:
    """Per parameter (by identity), the layout whose reducer armed last for a backward.

    Held as ``id(param) -> weak reference to the layout``. An entry is its parameter's for as
    long as the layout lives: a live layout keeps its parameters alive, so no other live tensor
    can have one of their ids. So nothing is watched per parameter (a weak reference with a
    callback per parameter would cost a model of 200 small ones ~0.3 ms at its first forward);
    a layout's entries go when it does (the callback of the reference :meth:`register` hands
    out, which this registry holds, so that it runs even when the layout dies in a cycle).
    """

    def __init__(self) -> None:
        self._entries: dict[int, weakref.ref] = {}  # id(param) -> the layout that armed last
        self._claimed: dict[int, tuple[int, ...]] = {}  # id(layout ref) -> the ids it set
        self._refs: dict[int, weakref.ref] = {}  # id(layout ref) -> it, kept for its callback
        self._last: weakref.ref | None = None  # the layout that claimed last

    def register(self, layout: Any) -> weakref.ref:
        """The weak reference by which ``layout`` claims; its entries go when it dies."""
        ref = weakref.ref(layout, self._forget)
        self._refs[id(ref)] = ref
        return ref

    def claim(self, params: Sequence[torch.Tensor], layout: weakref.ref) -> bool:
        """``layout`` (its :meth:`register` reference) armed last for each of ``params``; True
        if another live layout had armed for one of them (two wrappers of the same parameters).

        Every step claims its parameters again; when the same layout claimed last (one
        wrapper per model, the common case) nothing changed since: no walk over them.
        """
        if self._last is layout:
            return False
        self._last = layout
        entries, keys = self._entries, tuple(map(id, params))
        # By id: a weak reference hashes as its referent, and a dead one cannot be hashed.
        before = {id(ref): ref for ref in map(entries.get, keys)
                  if ref is not None and ref is not layout}
        entries.update(dict.fromkeys(keys, layout))
        self._claimed[id(layout)] = keys
        return any(ref() is not None for ref in before.values())

    def holder(self, param: torch.Tensor) -> Any:
        """The live layout that armed last for ``param``, or None."""
        ref = self._entries.get(id(param))
        return None if ref is None else ref()

    def _forget(self, dead: weakref.ref) -> None:
        entries = self._entries
        for key in self._claimed.pop(id(dead), ()):
            if entries.get(key) is dead:
                del entries[key]
        del self._refs[id(dead)]
        if self._last is dead:
            self._last = None


_ARMED_BY = _ArmedBy()


def _in_shared_memory(numel: int, dtype: torch.dtype, device: torch.device,
                      config: DataParallelConfig, rebuilt_later: bool) -> bool:
    # Where the transport sums a bucket: CPU floats of at least shared_memory_min_bytes, in a
    # layout that lasts — not ``rebuilt_later``, iteration 1's when DDP replaces it once
    # (BucketLayout.should_rebuild). That one lasts one step (by default it is one bucket for
    # everything): a fresh segment for it would be zero-filled and would fault in every page
    # on every rank at its first touch, about what Gloo's sum of it costs, and making it would
    # compete with the start-up broadcast. Gloo sums it, as torch DDP's.
    return device.type == "cpu" and shm_supported(dtype) \
        and numel * dtype.itemsize >= config.shared_memory_min_bytes \
        and not rebuilt_later


class BucketLayout:
    """The reducer's buckets, where each parameter sits in them, and their rebuild."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 config: DataParallelConfig, group: dist.ProcessGroup | None, rank: int,
                 transport: SharedMemoryAllreduce | None,
                 layout: list[list[int]] | None = None):
        self.params, self.names, self.config = params, names, config
        self.group, self.rank, self.transport = group, rank, transport
        self.buckets: list[Bucket] = []
        self.locator: list[tuple[int, int]] = []  # param index -> (bucket, position)
        self.history: list[list[list[int]]] = []  # every layout installed, oldest first
        self.has_rebuilt = False
        self.rebuild_order: list[int] = []  # gradient-ready order seen by the recording backward
        self.grad_dtype: torch.dtype | None = None  # set by use_grad_dtype
        self._me = _ARMED_BY.register(self)
        # Another live wrapper armed for some of these parameters since this one was built: both
        # reducers' hooks see their gradients (and both write them back). Set by the claims.
        self.shared_with_another = False
        # ``layout``: iteration 1's, when the caller has it (initial_layout; None: made here).
        self.install(self.initial_layout(params, config) if layout is None else layout)

    @staticmethod
    def initial_layout(params: Sequence[torch.Tensor], config: DataParallelConfig
                       ) -> list[list[int]]:
        """Iteration 1's buckets (parameter indices), bucket 0 first: one per dtype/device
        unless unused parameters are searched for (then DDP applies the size caps over the
        definition order). Reversed, so that the last-defined parameters, whose gradients
        come first, are in bucket 0."""
        return list(reversed(assign_buckets(params, config.initial_size_limits(),
                                            expect_sparse=config.expect_sparse_gradients)))

    @staticmethod
    def shared_sizes(layout: list[list[int]], params: Sequence[torch.Tensor],
                     config: DataParallelConfig) -> list[tuple[int, torch.dtype]]:
        """``(numel, dtype)`` of each buffer that installing iteration 1's ``layout`` over
        ``params`` takes from the transport, in the order it allocates them: what the model's
        constructor reserves ahead (:meth:`~mini_ddp.transport.shm.SharedMemoryAllreduce.reserve`).
        Empty when that layout is rebuilt (Gloo sums it: :func:`_in_shared_memory`)."""
        sizes = []
        for indices in layout:
            if _sparse_bucket(indices, config.expect_sparse_gradients):
                continue
            first = params[indices[0]]
            numel = sum(params[i].numel() for i in indices)
            if _in_shared_memory(numel, first.dtype, first.device, config,
                                 rebuilt_later=config.rebuilds_layout):
                sizes.append((numel, first.dtype))
        return sizes

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A bucket's zero-filled buffer: shared memory when the transport will sum it."""
        dtype = self.grad_dtype or dtype
        if self.transport is not None and _in_shared_memory(numel, dtype, device, self.config,
                                                            self.should_rebuild()):
            try:
                return self.transport.allocate(numel, dtype)  # collective: same on all ranks
            except ShmAllocationError as err:  # raised on all ranks: all fall back
                logger.warning("mini_ddp rank %d: %s; this bucket uses Gloo", self.rank, err)
        return zeros_allocator(numel, dtype, device)

    def use_grad_dtype(self, dtype: torch.dtype) -> None:
        """Buckets hold ``dtype`` from now on, whatever the parameters' dtype.

        DDP's mixed precision moves its buckets to ``param_dtype``; with
        ``gradient_as_bucket_view=True`` that dtype is visible in ``.grad``.
        """
        self.grad_dtype = dtype
        for bucket in self.buckets:
            if bucket.sparse or bucket.buffer.dtype == dtype:
                continue
            if self.transport is not None and self.transport.owns(bucket.buffer):
                self.transport.free(bucket.buffer)
            bucket.replace_buffer(self.allocate(bucket.buffer.numel(), dtype,
                                                bucket.buffer.device))

    def install(self, layout: list[list[int]], rebuilt: bool = False,
                movable: Sequence[tuple[int, torch.Tensor]] = ()) -> None:
        """Replace the buckets by fresh ones for ``layout`` (lists of parameter indices).

        ``movable``: ``(param index, view)`` of the gradients still handed out as views of the
        old buffers (the zero-copy write-back's), copied into the new ones and kept as views.
        """
        for bucket in self.buckets:
            if self.transport is not None and self.transport.owns(bucket.buffer):
                self.transport.free(bucket.buffer)  # memory goes once the old views do
        self.buckets, self.locator = build_buckets(
            layout, self.params, self.allocate, self.config.expect_sparse_gradients)
        self.history.append([list(indices) for indices in layout])
        for index, old_view in movable:
            bucket_index, position = self.locator[index]
            bucket = self.buckets[bucket_index]
            self.params[index].grad = bucket.views[position].copy_(old_view)
            bucket.handed_out = True
        if self.config.gradient_as_bucket_view:
            # Gradients that already exist move into the new buffers (DDP does the same when
            # it rebuilds), so ``.grad`` is a bucket view from now on.
            for bucket in self.buckets:
                if bucket.sparse:
                    continue  # its buffer is the sparse .grad itself
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is not None and not shares_storage(p.grad, bucket.buffer):
                        view.copy_(p.grad)
                        assign_grad(p, view)  # mixed precision: a param_dtype view
        # One line at INFO (torch DDP logs nothing here; scripts that set root logging to INFO
        # should not get a table per rank); the table at DEBUG, and in ``explain``.
        logger.info("mini_ddp rank %d: %d buckets %s (%s)", self.rank, len(self.buckets),
                    "rebuilt" if rebuilt else "built", self.config.layout_reason(rebuilt))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("mini_ddp rank %d bucket layout, %s:\n%s", self.rank,
                         self.config.layout_reason(rebuilt),
                         describe_layout(self.buckets, self.names))

    def should_rebuild(self) -> bool:
        """DDP rebuilds once, in gradient-ready order, unless it searches for unused params."""
        return self.config.rebuilds_layout and not self.has_rebuilt

    def reset_bucket_counting(self) -> None:
        """Before a synced backward: every bucket waits for all its gradients again."""
        if _ARMED_BY.claim(self.params, self._me):
            self.shared_with_another = True
        for bucket in self.buckets:
            bucket.pending = len(bucket.param_indices)
            bucket.future = None
            bucket.deferred.clear()  # batched_grad_copy: nothing deferred yet
            bucket.noted.clear()

    def armed_elsewhere(self, index: int) -> bool:
        """Has another live wrapper of parameter ``index`` armed for a backward since this one?

        Then a gradient after this layout's synchronised step is that wrapper's (torch DDP's
        reducer ignores a hook it does not expect), not a second backward of ours.
        """
        holder = _ARMED_BY.holder(self.params[index])
        return holder is not None and holder is not self

    def record_ready(self, *indices: int) -> None:
        """Note that these parameters' gradients are the next ones to become ready."""
        self.rebuild_order.extend(indices)

    def record_all(self) -> None:
        """Rebuild with every parameter if nothing was recorded (a joined rank's backward:
        DDP pushes every parameter so that it rebuilds with the others)."""
        if self.should_rebuild() and not self.rebuild_order:
            self.rebuild_order = list(range(len(self.params)))

    def rebuild_if_needed(self, handed_out: Callable[[Sequence[Bucket]],
                                                     list[tuple[int, torch.Tensor]]],
                          flight: Any = None, step: int = 0) -> bool:
        """Before a forward: rebuild the buckets once, in the recorded order, with rank 0's.

        ``handed_out(buckets)`` lists the gradients that move along into the new buffers
        (:func:`mini_ddp.engine.writeback.handed_out_grads`); ``flight`` records the
        broadcast of the layout (:func:`agree_on_layout`).
        """
        if not self.should_rebuild() or not self.rebuild_order:
            return False
        layout = assign_buckets(self.params, self.config.rebuild_size_limits(),
                                          order=self.rebuild_order,
                                          expect_sparse=self.config.expect_sparse_gradients)
        with naming_collective(self.rank, "the broadcast of rank 0's rebuilt bucket layout "
                               "(before the second forward)"):
            layout = agree_on_layout(layout, self.group, self.params[0].device, flight, step)
        self.has_rebuilt = True
        self.rebuild_order = []
        self.install(layout, rebuilt=True, movable=handed_out(self.buckets))
        return True


# ---- sparse gradients: a bucket of their own -------------------------------------------
NOT_DEFINED = "Expected sparse gradient to be defined."
NOT_SPARSE = "Expected variable to have sparse gradient."


def produces_sparse_gradient(module: nn.Module) -> bool:
    """DDP's test: an ``Embedding`` or ``EmbeddingBag`` built with ``sparse=True``."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse


def expect_sparse_gradients(owned: Sequence[tuple[nn.Module, Sequence[torch.Tensor]]],
                            params: Sequence[torch.Tensor]) -> list[bool]:
    """For each of the reducer's ``params``: does its (first) owning module make sparse grads?

    ``owned``: every module of the model (in ``modules()`` order) with its own parameters.
    """
    sparse = [produces_sparse_gradient(sub) for sub, _ in owned]
    if not any(sparse):
        return [False] * len(params)
    owner: dict[int, bool] = {}
    for makes_sparse, (_, own) in zip(sparse, owned, strict=True):
        for param in own:
            owner.setdefault(id(param), makes_sparse)
    return [owner.get(id(p), False) for p in params]


def check_sparse_grad(grad: torch.Tensor | None, name: str, rank: int) -> torch.Tensor:
    """The gradient of a sparse-bucket parameter, or DDP's error (``RuntimeError``)."""
    if grad is None:
        raise RuntimeError(f"{NOT_DEFINED} (mini_ddp: parameter '{name}' on rank {rank} got no "
                           f"gradient; a sparse bucket cannot contribute zeros)")
    if grad.layout != torch.sparse_coo:
        raise RuntimeError(f"{NOT_SPARSE} (mini_ddp: parameter '{name}' on rank {rank} got a "
                           f"{grad.layout} gradient)")
    return grad


def sparse_write_back(bucket: Bucket, value: object) -> None:
    """Copy the collective's result into the bucket, which is the parameter's ``.grad``."""
    result = value[0] if isinstance(value, (list, tuple)) else value
    if not isinstance(result, torch.Tensor) or not result.is_sparse:
        raise TypeError(f"mini_ddp: the collective of sparse bucket {bucket.index} must "
                        f"resolve to a sparse tensor; it held a {type(result).__name__}")
    if result is not bucket.buffer:
        bucket.buffer.copy_(result)

"""Back into ``.grad``: the last leg of a gradient, from the reduced bucket to ``param.grad``.

:meth:`mini_ddp.engine.reducer.Reducer.finalize_backward` waits for each bucket, then picks one of:

* :func:`copy_out` — DDP's copy of a whole bucket into the separate ``.grad`` tensors, in one
  foreach copy (the plain path with ``zero_copy_write_back=False``);
* :func:`hand_out` — the zero-copy write-back (opt-in, ``zero_copy_write_back=True``): ``.grad`` *becomes*
  its view of the bucket. Before the next backward writes into a bucket, the reducer calls
  :func:`reclaim_buffers`, which moves any bucket that something besides ``.grad`` still looks
  into (:func:`held_elsewhere`) to a fresh buffer, so saved gradients keep DDP's values.
  When the bucket layout changes, the handed-out ``.grad`` tensors nobody else holds move
  into the new buffers (:func:`handed_out_grads`, for :class:`~mini_ddp.engine.buckets.BucketLayout`);
* :func:`write_back` — one parameter at a time, for the paths with DDP's own rules: unused
  parameters, static graphs, ``gradient_as_bucket_view``, a comm hook returning a new tensor.

Whether anybody else holds a tensor is read from reference counts — Python's, the C++
tensor's and weak ones (:func:`held_elsewhere`, :func:`is_private`) — against a baseline
measured once, on first use, through the same calls (:func:`_baseline`). That is why the
zero-copy write-back is opt-in: a consumer that keeps only a raw pointer is invisible to any
count (docs/limitations.md lists what breaks it).
"""

from __future__ import annotations

import functools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from mini_ddp.engine.buckets import (
    Bucket,
    assign_grad,
    shares_storage,
    storage_object_refs,
    storage_use_count,
)

if TYPE_CHECKING:
    from mini_ddp.transport.shm import SharedMemoryAllreduce


_GRAD = operator.attrgetter("grad")


def copy_out(bucket: Bucket) -> None:
    """The common case of :func:`write_back` for a whole bucket, in one foreach copy.

    DDP's copy_bucket_to_grad per parameter; the same bits (a copy), much less Python.
    """
    grads = list(map(_GRAD, bucket.params))  # each .grad read once: a read may wrap it
    for i, grad in enumerate(grads):
        if grad is None:
            grads[i] = bucket.params[i].grad = _fresh_grad(bucket.params[i])
    torch._foreach_copy_(grads, bucket.views)


def _fresh_grad(param: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``.grad`` with the parameter's own strides (autograd's layout
    contract, which DDP keeps when it allocates a gradient)."""
    return torch.empty_strided(param.size(), param.stride(), dtype=param.dtype,
                               device=param.device)


def hand_out(bucket: Bucket) -> None:
    """Zero-copy write-back: make each ``.grad`` its view of the bucket, no copy.

    DDP copies the bucket into ``.grad`` (a separate tensor) because the next backward
    overwrites the bucket. We let ``.grad`` *be* the bucket view and instead make sure,
    before the next backward writes into the buffer (:func:`reclaim_buffers`), that
    nobody but ``.grad`` itself still looks at it. A gradient someone else holds keeps its
    identity and gets a copy, as in DDP. Values are copies of the same bits either way.
    """
    for param, view in zip(bucket.params, bucket.views, strict=True):
        if param.grad is view:
            continue  # accumulated in place (zero_grad(set_to_none=False)): already there
        if param.grad is None or is_private(param):
            param.grad = view  # the tensor autograd made is dropped: nobody can see it
        else:
            param.grad.copy_(view)
    bucket.handed_out = True


def reclaim_buffers(buckets: Iterable[Bucket], transport: SharedMemoryAllreduce | None) -> None:
    """Before a backward writes into buckets whose views were handed out as ``.grad``.

    If anything besides ``.grad`` holds such a view (``saved = p.grad`` before
    ``zero_grad()``, a hook's state…), writing this step's gradients into the buffer
    would change the values it holds; DDP's separate ``.grad`` would not. That bucket
    moves to a fresh buffer instead (:func:`renew_buffer`), and the old one stays with
    whoever holds it.
    """
    for bucket in buckets:
        if bucket.handed_out:
            if held_elsewhere(bucket):
                renew_buffer(bucket, transport)
            bucket.handed_out = False


def renew_buffer(bucket: Bucket, transport: SharedMemoryAllreduce | None) -> None:
    """Move ``bucket`` to a fresh buffer (local: the transport's peer learns of it later)."""
    old = bucket.buffer
    if transport is not None and transport.owns(old):
        bucket.replace_buffer(transport.renew(old))
    else:
        bucket.replace_buffer(torch.zeros_like(old))


def handed_out_grads(buckets: Iterable[Bucket]) -> list[tuple[int, torch.Tensor]]:
    """``(param index, view)`` for each ``.grad`` still its bucket view, held by nobody else.

    When the layout changes these move along into the new buffers (copied over by
    :meth:`mini_ddp.engine.buckets.BucketLayout.install`), so later steps keep writing in place
    instead of copying.
    """
    # held_elsewhere is asked before any pair of that bucket exists: the pairs would count.
    return [(index, view) for bucket in buckets
            if bucket.handed_out and not held_elsewhere(bucket)
            for index, p, view in zip(bucket.param_indices, bucket.params, bucket.views,
                                      strict=True) if p.grad is view]


def write_back_bucket(bucket: Bucket, result: torch.Tensor, *, plain: bool, zero_copy: bool,
                      as_bucket_view: bool, skip: Callable[[int], bool] | None = None) -> None:
    """Put a bucket's reduced ``result`` into its parameters' ``.grad``.

    ``plain`` (no unused-parameter tracking, no ``gradient_as_bucket_view``) with the bucket's
    own buffer as result: the whole bucket at once (:func:`hand_out` when ``zero_copy``, else
    :func:`copy_out`). Otherwise one :func:`write_back` per parameter, leaving out each
    parameter index for which ``skip`` is true (nobody used it: ``.grad`` stays as it was).
    """
    if plain and result is bucket.buffer:
        (hand_out if zero_copy else copy_out)(bucket)
        return
    views_out = bucket.views_of(result)
    if as_bucket_view and result is bucket.buffer and not all(
            shares_storage(view, bucket.buffer) for view in bucket.views):
        # DDP copies the result into a bucket view unless the two *alias*: a view whose
        # ``.data`` something rebound (mixed precision's comm hook upcasts ``.grad``, which
        # with gradient_as_bucket_view is the view itself) gets the reduced values copied in.
        views_out = bucket.views_of(result.view_as(result))
    for param, index, view_in, view_out in zip(bucket.params, bucket.param_indices,
                                               bucket.views, views_out, strict=True):
        if skip is None or not skip(index):
            write_back(param, view_in, view_out, as_bucket_view)


def write_back(param: torch.Tensor, view_in: torch.Tensor, view_out: torch.Tensor,
               as_bucket_view: bool) -> None:
    """Put one parameter's reduced gradient ``view_out`` into ``param.grad``, DDP's way.

    ``view_in`` is the parameter's view of the bucket buffer, ``view_out`` its view of the
    collective's result (the same tensor unless a comm hook returned a new one). With
    ``as_bucket_view`` (``gradient_as_bucket_view=True``) ``.grad`` is the bucket view itself.
    """
    if as_bucket_view:
        if not shares_storage(view_out, view_in):
            view_in.copy_(view_out)  # a hook returned a new tensor, or rebound the view
        if param.grad is None:
            assign_grad(param, view_in)
        return
    if param.grad is None:
        param.grad = _fresh_grad(param)
    param.grad.copy_(view_out)


# ---- who else holds a tensor: reference counts ------------------------------------------
# Every count is taken of a value on the evaluation stack (``param.grad``, ``map`` over a
# list), never of a local variable: a tool that reads ``frame.f_locals`` (a debugger, some
# coverage modes) snapshots locals into a dict that holds them once more, which would shift a
# baseline measured through locals. Each count sees different holders: Python references (a
# list, a closure, ``.numpy()``), references to the C++ tensor (a DLPack export such as
# ``np.from_dlpack``), weak references (``weakref.ref``), the storage's users (a view) and the
# storage's Python object (a kept ``untyped_storage()``).
def _view_counts(bucket: Bucket) -> list[tuple[int, int, int]]:
    """(Python refs, C++ tensor refs, weak refs) of each view, not counting its own ``.grad``."""
    refs = list(map(sys.getrefcount, bucket.views))
    impl = list(map(torch.Tensor._use_count, bucket.views))
    weak = list(map(weakref.getweakrefcount, bucket.views))
    is_grad = [p.grad is v for p, v in zip(bucket.params, bucket.views, strict=True)]
    return [(r - g, i - g, w) for r, i, w, g in zip(refs, impl, weak, is_grad, strict=True)]


def _grad_counts(param: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(Python refs, C++ tensor refs, weak refs, storage users, storage object refs) of
    ``param.grad``."""
    return (sys.getrefcount(param.grad), param.grad._use_count(),
            weakref.getweakrefcount(param.grad), storage_use_count(param.grad),
            storage_object_refs(param.grad))


@functools.cache
def _baseline() -> tuple[tuple[int, int, int], tuple[int, int, int, int, int]]:
    """What :func:`_view_counts` and :func:`_grad_counts` read when nothing else holds a tensor.

    Measured once, on first use, on this interpreter rather than assumed: reference counts
    differ between Python and torch versions. Through the same calls on a probe, so it means
    the same in use.
    """
    param = torch.nn.Parameter(torch.zeros(2))
    probe = Bucket.build(0, [0], [param])
    param.grad = probe.views[0]
    view_counts = _view_counts(probe)[0]
    param.grad = torch.zeros(2)  # as autograd leaves it: referenced by .grad alone
    return view_counts, _grad_counts(param)


def held_elsewhere(bucket: Bucket) -> bool:
    """Does anything besides the bucket and the ``.grad`` slots look into its buffer?

    Blind to holders no count sees: a raw pointer (``data_ptr()``, ``ctypes``, a C extension
    that copied one), anything reached through ``.data`` of ``.grad`` (docs/limitations.md).
    """
    baseline = _baseline()[0]
    return (storage_use_count(bucket.buffer) != bucket.base_refs
            or storage_object_refs(bucket.buffer) != bucket.storage_refs
            or any(counts != baseline for counts in _view_counts(bucket)))


def is_private(param: torch.Tensor) -> bool:
    """Is ``param.grad`` seen by nobody else?

    True for the tensor autograd just stored: no other Python, C++ or weak reference, not a
    view, no view of it anywhere nor a kept storage object (its storage is referenced by it
    alone), not part of a graph.
    """
    return (not param.grad.requires_grad and param.grad._base is None
            and _grad_counts(param) == _baseline()[1])

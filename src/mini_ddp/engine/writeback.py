"""Back into ``.grad``: the last leg of a gradient, from the reduced bucket to ``param.grad``.

:meth:`mini_ddp.engine.reducer.Reducer.finish_grad_sync` waits for each bucket, then picks one of:

* :func:`copy_out` — DDP's copy of a whole bucket into the separate ``.grad`` tensors, in one
  foreach copy (the plain path with ``zero_copy_write_back=False``);
* :func:`hand_out` — the zero-copy write-back (the plain path's default): ``.grad`` *becomes*
  its view of the bucket. Before the next backward writes into a bucket, the reducer calls
  :func:`reclaim_buffers`, which moves any bucket that something besides ``.grad`` still looks
  into (:func:`held_elsewhere`) to a fresh buffer, so saved gradients keep DDP's values.
  When the bucket layout changes, the handed-out ``.grad`` tensors nobody else holds move
  into the new buffers (:func:`handed_out_grads`, for :class:`~mini_ddp.engine.graph_state.BucketLayout`);
* :func:`write_back` — one parameter at a time, for the paths with DDP's own rules: unused
  parameters, static graphs, ``gradient_as_bucket_view``, a comm hook returning a new tensor.

Whether anybody else holds a tensor is read from Python reference counts
(:func:`held_elsewhere`, :func:`is_private`), against a baseline measured once at import
through the same calls (:func:`_calibrate`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from mini_ddp.engine.buckets import Bucket, shares_storage, storage_use_count

if TYPE_CHECKING:
    from mini_ddp.transport.shm import SharedMemoryAllreduce


def copy_out(bucket: Bucket) -> None:
    """The common case of :func:`write_back` for a whole bucket, in one foreach copy.

    DDP's copy_bucket_to_grad per parameter; the same bits (a copy), much less Python.
    """
    grads = []
    for param in bucket.params:
        if param.grad is None:
            param.grad = _fresh_grad(param)
        grads.append(param.grad)
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
        # Read into a local and passed to is_private as is: _calibrate measured exactly
        # these references (is_private's own argument is its ``+ 1``).
        grad = param.grad
        if grad is view:
            continue  # accumulated in place (zero_grad(set_to_none=False)): already there
        if grad is None or is_private(grad):
            param.grad = view  # the tensor autograd made is dropped: nobody can see it
        else:
            grad.copy_(view)
        del grad
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
    :meth:`mini_ddp.engine.graph_state.BucketLayout.install`), so later steps keep writing in place
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


def assign_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad``, allowing a dtype other than the parameter's.

    DDP's C++ reducer sets ``.grad`` without Python's dtype check. With mixed precision and
    ``gradient_as_bucket_view=True`` it hands a ``param_dtype`` bucket view to a
    full-precision parameter (and a view the comm hook upcast to a low-precision one).
    """
    if grad.dtype != param.dtype:
        param.grad_dtype = None  # torch's documented switch for "any dtype"
    param.grad = grad


# ---- who else holds a tensor: reference counts ------------------------------------------
def _view_refs(bucket: Bucket) -> list[int]:
    """Python references to each of ``bucket``'s views, not counting its own ``.grad``."""
    return [sys.getrefcount(v) - (p.grad is v) for p, v in zip(bucket.params, bucket.views,
                                                                  strict=True)]


def _grad_refs(grad: torch.Tensor) -> int:
    return sys.getrefcount(grad)


def _calibrate() -> tuple[int, int]:
    """What :func:`_view_refs` and :func:`_grad_refs` read when nothing else holds a tensor.

    Measured once on this interpreter rather than assumed: reference counts of arguments and
    locals differ between Python versions. The grad probe mirrors :func:`hand_out` minus one
    layer: a local read from ``.grad``, passed straight to :func:`_grad_refs`, where
    :func:`is_private` adds its own argument (hence its ``+ 1``).
    """
    param = torch.nn.Parameter(torch.zeros(2))
    probe = Bucket.build(0, [0], [param])
    param.grad = probe.views[0]
    view_refs = _view_refs(probe)[0]
    param.grad = torch.zeros(2)
    grad = param.grad
    grad_refs = _grad_refs(grad)
    return view_refs, grad_refs


_VIEW_REFS, _GRAD_REFS = _calibrate()


def held_elsewhere(bucket: Bucket) -> bool:
    """Does anything besides the bucket and the ``.grad`` slots look into its buffer?"""
    return (storage_use_count(bucket.buffer) != bucket.base_refs
            or any(refs != _VIEW_REFS for refs in _view_refs(bucket)))


def is_private(grad: torch.Tensor) -> bool:
    """Is ``grad`` (a parameter's ``.grad``, read into a local) seen by nobody else?

    True for the tensor autograd just stored: no other Python reference, not a view, no view
    of it anywhere (its storage is referenced by it alone), not part of a graph.
    """
    return (not grad.requires_grad and grad._base is None
            and storage_use_count(grad) == 2 and _grad_refs(grad) == _GRAD_REFS + 1)

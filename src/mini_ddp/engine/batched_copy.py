"""``batched_grad_copy=True``: gradients go into a bucket all at once when it is full.

torch DDP's variant of step 2 of :mod:`mini_ddp.engine.reducer`: instead of one scaled copy per
gradient as it arrives (:func:`mini_ddp.engine.copy_in.copy_grad_in`), a ready gradient that
is not already the bucket view is only *noted*; when the bucket's last gradient is in,
:func:`flush` copies the noted ones with a single ``torch._foreach_copy_`` and divides the
whole flat bucket once with ``div_`` (no comm hook). A true division, so the bits differ from
the default path's multiply by ``1/world_size`` — exactly as they do in torch DDP.

Kept from DDP: an undefined gradient zeroes its view at once; a gradient that already is the
view is neither copied nor divided on its own (the flat ``div_`` covers it); a gradient that
requires grad (``create_graph=True``) bypasses batching — and is then divided a second time
by the flat ``div_``, as in DDP.
"""

from __future__ import annotations

import torch

from mini_ddp.engine.buckets import Bucket, shares_storage
from mini_ddp.engine.copy_in import copy_grad_in


def note_grad(bucket: Bucket, position: int, *, hooked: bool, as_bucket_view: bool,
              div_factor: int, scale: torch.Tensor) -> None:
    """Gradient ``position`` of ``bucket`` is ready: note it for :func:`flush` (DDP's defer)."""
    param, view = bucket.params[position], bucket.views[position]
    grad = param.grad
    if grad is None:
        view.zero_()
    elif grad is view or (as_bucket_view and shares_storage(grad, bucket.buffer)):
        pass  # already in the bucket; the flat div_ scales it
    elif not grad.requires_grad:
        bucket.deferred.append(position)
    else:
        copy_grad_in(bucket, position, hooked=hooked, as_bucket_view=as_bucket_view,
                     div_factor=div_factor, scale=scale)


def flush(bucket: Bucket, *, hooked: bool, as_bucket_view: bool, div_factor: int) -> None:
    """The bucket is full: copy the noted gradients in, then divide the bucket once."""
    if bucket.sparse:
        return  # divided on its own way in (mini_ddp.engine.sparse)
    if bucket.deferred:
        torch._foreach_copy_([bucket.views[i] for i in bucket.deferred],
                             [bucket.params[i].grad for i in bucket.deferred])
        if as_bucket_view:
            for i in bucket.deferred:
                bucket.params[i].grad = bucket.views[i]
        bucket.deferred.clear()
    if not hooked:
        bucket.buffer.div_(div_factor)

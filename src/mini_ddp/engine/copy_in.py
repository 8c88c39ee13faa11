"""Into the bucket: a gradient's copy into its bucket view, scaled the way DDP scales it.

Step 2 of :mod:`mini_ddp.engine.reducer`. Without a comm hook, DDP multiplies by
``1/world_size`` *while copying* (``mul_out`` with a double scalar); with a hook it copies
unscaled, since the hook averages. ``x * (1/3)`` differs from ``x / 3`` in about a third of
fp32 values, so this module is where bitwise parity is won.
"""

from __future__ import annotations

import torch

from mini_ddp.engine.buckets import Bucket, shares_storage
from mini_ddp.engine.writeback import assign_grad


def scale_tensor(div_factor: int) -> torch.Tensor:
    """``1/div_factor`` as the 0-dim float64 CPU tensor DDP hands ``mul_out``.

    A wrapped double scalar: made once per divisor instead of per gradient (a Python float
    makes ``torch.mul`` build that tensor on every call). Same kernel, same bits.
    """
    return torch.tensor(1.0 / div_factor, dtype=torch.float64)


def copy_grad_in(bucket: Bucket, position: int, *, hooked: bool, as_bucket_view: bool,
                 div_factor: int, scale: torch.Tensor) -> None:
    """Put ``bucket.params[position]``'s gradient into its view of the bucket.

    ``hooked``: a comm hook will reduce the bucket (no scaling here); ``as_bucket_view``:
    ``gradient_as_bucket_view=True``; ``scale`` is :func:`scale_tensor` of ``div_factor``.
    """
    param, view = bucket.params[position], bucket.views[position]
    grad = param.grad
    if grad is None:
        view.zero_()  # marked ready without a gradient: contribute zeros
        return
    if grad is view or (as_bucket_view and shares_storage(grad, bucket.buffer)):
        # The gradient already *is* the bucket view, and autograd accumulated into it.
        if not hooked:
            if as_bucket_view:
                view.div_(div_factor)  # DDP divides in place here: a true division
            else:
                # Zero-copy write-back left it here: the default path's multiply, in
                # place — the same kernel and scalar as below, so the same bits.
                torch.mul(view, scale, out=view)
        return
    if hooked:
        view.copy_(grad)  # a user hook does its own averaging
    elif grad.requires_grad:  # create_graph=True: the copy must not join the graph
        view.copy_(torch.mul(grad.detach(), 1.0 / div_factor))
    else:
        torch.mul(grad, scale, out=view)  # DDP's mul_out: where parity is won
    if as_bucket_view:
        assign_grad(param, view)

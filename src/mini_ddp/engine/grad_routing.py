"""DDP's variants of step 2 (into the bucket) and step 3 (launch), apart from the plain path.

``batched_grad_copy`` only notes each gradient and copies a bucket's gradients at once when it
is full (:mod:`mini_ddp.engine.batched_copy`); a sparse gradient *is* its own bucket
(:mod:`mini_ddp.engine.sparse`); with ``skip_all_reduce_unused_params`` a bucket holding only
unused parameters is not launched. The reducer calls these at the matching step.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine.batched_copy import flush, note_grad
from mini_ddp.engine.config import DataParallelConfig
from mini_ddp.engine.copy_in import copy_grad_in
from mini_ddp.engine.sparse import sparse_grad_in


def grad_into_bucket(bucket: bucketing.Bucket, position: int, config: DataParallelConfig, *,
                     hooked: bool, div_factor: int, scale: torch.Tensor, names: Sequence[str],
                     rank: int) -> None:
    """Copy (or note, or hand over) the gradient at ``position`` of ``bucket``."""
    if bucket.sparse:  # the sparse .grad becomes the bucket (mini_ddp.engine.sparse)
        sparse_grad_in(bucket, hooked=hooked, div_factor=div_factor,
                       name=names[bucket.param_indices[0]], rank=rank)
        return
    # batched_grad_copy only notes the gradient; flush_if_batched copies when the bucket is full.
    (note_grad if config.batched_grad_copy else copy_grad_in)(
        bucket, position, hooked=hooked, as_bucket_view=config.gradient_as_bucket_view,
        div_factor=div_factor, scale=scale)


def flush_if_batched(bucket: bucketing.Bucket, config: DataParallelConfig, *, hooked: bool,
                     div_factor: int) -> None:
    """``batched_grad_copy``: the bucket is full, copy its noted gradients in at once."""
    if config.batched_grad_copy:
        flush(bucket, hooked=hooked, as_bucket_view=config.gradient_as_bucket_view,
              div_factor=div_factor)


def skipped(bucket: bucketing.Bucket, config: DataParallelConfig, unused: Container[int]
            ) -> bool:
    """``skip_all_reduce_unused_params``: a bucket of unused parameters only stays local
    (no future: its ``.grad`` are left alone), as DDP's ``should_skip_all_reduce_bucket``."""
    return config.skip_all_reduce_unused_params and all(
        i in unused for i in bucket.param_indices)

"""Rung 2 — buckets: pack the gradients into a few flat buffers, one all-reduce per buffer.

Over rung 1 (:mod:`mini_ddp.ladder.naive`) this adds the first thing DDP does to cut the
number of collectives: *gradient buckets*. Tens of parameters become one or two collectives.

1. :func:`assign_buckets` — ``compute_bucket_assignment_by_size`` in ``reducer.cpp``. Walk
   the parameters in definition order, add each to the open bucket of its dtype and device,
   and close that bucket once its bytes *reach* the current cap (so a bucket may exceed it).
   The caps are ``[1 MiB, 25 MiB]`` by default — only the first bucket of each dtype is small
   — or ``[bucket_cap_mb]`` alone when the user chose a cap (torch then drops the 1 MiB first
   cap). DDP then *reverses* the list of buckets: backward produces the last layers'
   gradients first, so they go in bucket 0.
2. :func:`flat_buckets` — ``Reducer::initialize_buckets``: one zero-filled flat tensor per
   bucket and, for each parameter, a view of its slice.
3. :meth:`BucketedDataParallel.sync_grads` — per bucket, ``Reducer::mark_variable_ready_dense``
   (copy each gradient into its slice, *multiplied* by ``1/world_size``:
   ``torch.mul(grad, 1/world_size, out=slice)``), ``Reducer::all_reduce_bucket`` (one SUM
   all-reduce of the flat tensor) and ``Reducer::finalize_bucket_dense`` (copy the slices
   back into ``.grad``).

Why the first bucket is small, twice over: in this rung's order (definition order, reversed)
the small bucket holds the *first-defined* parameters, whose gradients backward computes last —
so it is the bucket sent *last*, after backward has ended; keeping it small keeps those
gradients from spilling into a huge bucket whose all-reduce the step would then wait for.
After DDP's rebuild (rung 3) the buckets follow the order gradients arrived in, the small
bucket holds the first gradients to arrive, and the first message leaves early.
(``docs/buckets.md`` has the rules and the numbers.)

This fixed, capped layout is the one DDP keeps for good with ``find_unused_parameters=True``
(rung 4). With DDP's defaults the first backward instead uses ONE bucket per dtype, then
rebuilds — so this rung's bits match DDP's only while the model fits in one bucket.

Still missing: nothing is sent until ``backward()`` has finished, and DDP's rebuild.
Rung 3 (:mod:`mini_ddp.ladder.overlapped`) does both, and with them reproduces DDP bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mini_ddp.ladder.naive import broadcast_from_rank0

MIB = 1024 * 1024  # "MB" in DDP's arguments means MiB
DEFAULT_BUCKET_CAP_MB = 25  # DDP's bucket_cap_mb default
FIRST_BUCKET_MB = 1  # DDP's first_bucket_bytes_cap, used only when the user set no cap


def size_limits(bucket_cap_mb: float | None) -> list[int]:
    """DDP's bucket caps in bytes: ``[1 MiB, 25 MiB]``, or just ``[cap]`` when the user chose
    one (``_BucketCapacityConfig``: a user's cap replaces the 1 MiB first cap too)."""
    if bucket_cap_mb is None:
        return [FIRST_BUCKET_MB * MIB, DEFAULT_BUCKET_CAP_MB * MIB]
    return [int(bucket_cap_mb * MIB)]


def assign_buckets(params: Sequence[torch.Tensor], limits: Sequence[int],
                   order: Sequence[int] | None = None) -> list[list[int]]:
    """Group parameter indices into buckets as ``compute_bucket_assignment_by_size`` does
    (dense gradients, positive caps): visit ``order`` (default: definition order)."""
    closed: list[list[int]] = []
    open_: dict[tuple, list[int]] = {}  # (dtype, device) -> [bytes so far, index, ...]
    cap_index: dict[tuple, int] = {}
    for i in (range(len(params)) if order is None else order):
        key = (params[i].dtype, params[i].device)
        bucket = open_.setdefault(key, [0])
        bucket[0] += params[i].numel() * params[i].element_size()
        bucket.append(i)
        cap = cap_index.setdefault(key, 0)
        if bucket[0] >= limits[cap]:  # reached the cap: close it, move to the next cap
            closed.append(open_.pop(key)[1:])
            cap_index[key] = min(cap + 1, len(limits) - 1)
    closed += [bucket[1:] for bucket in open_.values()]  # what is left, still open
    # In definition order torch sorts the buckets by their first parameter; in a given
    # order (the rebuild's) they keep the order in which they closed.
    return sorted(closed, key=min) if order is None else closed


def flat_buckets(params: Sequence[torch.Tensor], layout: list[list[int]]
                 ) -> list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]]:
    """One zero-filled flat buffer per bucket and, for each parameter in it, its view there."""
    buckets = []
    for indices in layout:
        buffer = torch.zeros(sum(params[i].numel() for i in indices),
                             dtype=params[indices[0]].dtype, device=params[indices[0]].device)
        views, offset = [], 0
        for i in indices:
            views.append((i, buffer[offset:offset + params[i].numel()].view_as(params[i])))
            offset += params[i].numel()
        buckets.append((buffer, views))
    return buckets


class BucketedDataParallel(nn.Module):
    """Wrap ``module``; call :meth:`sync_grads` between ``backward()`` and the optimizer step."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        broadcast_from_rank0(module, group)  # start from rank 0's model, as in rung 1
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Definition order, then reversed: the last layers (whose gradients backward produces
        # first) land in bucket 0.
        layout = list(reversed(assign_buckets(self.params, size_limits(bucket_cap_mb))))
        self.buckets = flat_buckets(self.params, layout)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Just the wrapped module's forward: all the work happens in :meth:`sync_grads`."""
        return self.module(*inputs, **kwargs)

    def sync_grads(self) -> None:
        """Average every ``.grad`` over the ranks, one SUM all-reduce per bucket."""
        scale = 1.0 / self.world_size
        for buffer, views in self.buckets:
            for i, view in views:
                # DDP's averaging: multiply while copying in (x * (1/3) is not x / 3 in fp32).
                torch.mul(self.params[i].grad, scale, out=view)
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
            for i, view in views:
                self.params[i].grad.copy_(view)

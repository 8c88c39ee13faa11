"""Teaching implementations of collectives, built only from point-to-point sends and receives.

Every algorithm here works **in place** on a contiguous tensor, like ``dist.all_reduce``, and
also **returns the tensor** (``dist.all_reduce`` returns ``None``) so calls can be chained. They
take an optional ``group`` (default: WORLD); roots (``src``/``dst``) are *global* ranks, as in
``dist.broadcast``/``dist.reduce``, and ranks outside ``group`` return without communicating.

Supported ops: SUM, AVG, PRODUCT, MAX, MIN. AVG is SUM followed by one division by the group
size (floating-point tensors only), so it works on any backend. Older Gloo builds rejected
``ReduceOp.AVG`` outright; torch 2.14's Gloo accepts it for floating-point tensors (and, like
us, fails on integer ones). A world size of 1 is a no-op.

* :func:`naive_allreduce` — gather at rank 0, send back: ``O(n)`` latency and bandwidth.
* :func:`ring_allreduce` — reduce-scatter + all-gather round a ring: bandwidth-optimal.
* :func:`halving_doubling_allreduce` — Rabenseifner: bandwidth-optimal, ``log n`` latency.
* :func:`tree_broadcast`, :func:`tree_reduce`, :func:`tree_allreduce` — binomial trees.
* :func:`collective_hook` — wrap any of the allreduces as a DDP communication hook.

Cost formulas are in each module's docstring and, as code, in :mod:`mini_ddp.transport.collectives.cost`.
"""

# No ``from __future__ import annotations`` here: torch's DDP inspects the hook's annotations
# and rejects any that are not *exactly* dist.GradBucket / Future[Tensor] (strings included).
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from mini_ddp.transport.collectives.halving_doubling import halving_doubling_allreduce
from mini_ddp.transport.collectives.naive import naive_allreduce
from mini_ddp.transport.collectives.ring import ring_allreduce
from mini_ddp.transport.collectives.tree import tree_allreduce, tree_broadcast, tree_reduce

AllreduceFn = Callable[..., Any]

ALLREDUCES: dict[str, AllreduceFn] = {
    "ring": ring_allreduce,
    "halving_doubling": halving_doubling_allreduce,
    "tree": tree_allreduce,
    "naive": naive_allreduce,
}


def collective_hook(allreduce_fn: AllreduceFn) -> Callable[[Any, Any], torch.futures.Future]:
    """A DDP communication hook that averages each gradient bucket with ``allreduce_fn``.

    Usable with torch's DDP (``ddp.register_comm_hook(None, collective_hook(ring_allreduce))``)
    and with ours. Like torch's ``default_hooks.allreduce_hook`` it divides the bucket by the
    world size *before* summing (``div_``, so the rounding matches), then sums in place. The
    state may be ``None`` (WORLD) or the process group to reduce over. Our allreduces are
    synchronous, so the returned Future is already completed, holding the bucket buffer.
    """

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else None
        buf = bucket.buffer()
        buf.div_(dist.get_world_size(group))
        allreduce_fn(buf, op=ReduceOp.SUM, group=group)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    hook.__name__ = f"collective_hook({getattr(allreduce_fn, '__name__', 'allreduce')})"
    hook.__qualname__ = hook.__name__
    return hook


__all__ = [
    "ALLREDUCES",
    "collective_hook",
    "halving_doubling_allreduce",
    "naive_allreduce",
    "ring_allreduce",
    "tree_allreduce",
    "tree_broadcast",
    "tree_reduce",
]

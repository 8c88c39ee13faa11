"""A teaching ladder: data-parallel gradient averaging built up in three short steps.

Read the rungs in order; each is one file, top to bottom, and its docstring says what it adds:

1. :mod:`mini_ddp.ladder.naive` — after ``backward()``, one all-reduce per gradient, then
   divide by the world size.
2. :mod:`mini_ddp.ladder.bucketed` — pack gradients into flat buckets with DDP's bucket
   assignment and scaling; one all-reduce per bucket.
3. :mod:`mini_ddp.ladder.overlapped` — hooks launch each bucket's all-reduce during backward,
   and the bucket layout is rebuilt once in gradient-arrival order: torch DDP's bits.

The last rung is the full engine, :mod:`mini_ddp.engine` (:class:`mini_ddp.DataParallelModel`),
which adds everything a real job needs around the same core.

The rungs use only torch, :mod:`mini_ddp.engine.buckets` and each other, are not exported by
:mod:`mini_ddp`, and are tested against torch DDP in ``tests/test_ladder.py``.
"""

from mini_ddp.ladder.bucketed import BucketedDataParallel
from mini_ddp.ladder.naive import NaiveDataParallel
from mini_ddp.ladder.overlapped import OverlappedDataParallel

__all__ = ["BucketedDataParallel", "NaiveDataParallel", "OverlappedDataParallel"]

"""A teaching ladder: data-parallel gradient averaging built up in four short steps.

Read the rungs in order; each is one file, top to bottom, and its docstring says what it adds
and which function of torch DDP's C++ reducer (``reducer.cpp``) each of its steps stands for:

1. :mod:`mini_ddp.ladder.naive` — after ``backward()``, one all-reduce per gradient, then
   divide by the world size.
2. :mod:`mini_ddp.ladder.bucketed` — pack gradients into flat buckets with DDP's bucket
   assignment and scaling; one all-reduce per bucket.
3. :mod:`mini_ddp.ladder.overlapped` — hooks launch each bucket's all-reduce during backward,
   and the bucket layout is rebuilt once in gradient-arrival order: torch DDP's bits.
4. :mod:`mini_ddp.ladder.unused_and_no_sync` — ``no_sync()`` (decided in forward) and
   ``find_unused_parameters`` (a graph walk from the outputs, unused parameters marked ready,
   the used-map all-reduce).

After the ladder comes the full engine, :mod:`mini_ddp.engine`
(:class:`mini_ddp.DataParallelModel`), which adds everything a real job needs around the same
core. The rungs use only torch and each other (no engine code), are not exported by
:mod:`mini_ddp`, are tested against torch DDP in ``tests/test_ladder.py``, and
``python -m mini_ddp ladder --model X`` runs them all on a model of your own.
"""

from mini_ddp.ladder.bucketed import BucketedDataParallel
from mini_ddp.ladder.naive import NaiveDataParallel
from mini_ddp.ladder.overlapped import OverlappedDataParallel
from mini_ddp.ladder.unused_and_no_sync import UnusedAndNoSyncDataParallel

__all__ = ["BucketedDataParallel", "NaiveDataParallel", "OverlappedDataParallel",
           "UnusedAndNoSyncDataParallel"]

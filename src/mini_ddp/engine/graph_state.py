"""What the reducer learns about the autograd graph, and the bucket layouts it builds from it.

The bookkeeping of torch's C++ reducer (``reducer.cpp``) that changes a value or an error but
is not on the path of one gradient (that path is :mod:`mini_ddp.engine.reducer`):

* **which** parameters a backward can reach — :func:`unreachable_params`, the search
  ``find_unused_parameters=True`` runs before each backward (DDP's
  ``search_unused_parameters``); the unreachable ones are marked ready, with zeros, at the
  first hook;
* **in what order** their gradients arrive — the hooks record it, and before the second
  forward :func:`rebuild_buckets_if_needed` rebuilds the buckets once in that order, with
  rank 0's layout (DDP's ``rebuild_buckets``); :func:`install_buckets` puts a layout's buffers
  in place, the first one included;
* **how often** — a static graph's first backward only counts hooks; :func:`delay_all_reduce`
  then reduces everything once that backward has finished (DDP's ``delay_all_reduce``).

They are functions of the reducer rather than its methods so that :mod:`mini_ddp.engine.reducer`
holds the main path alone; each reads and sets the reducer's state, as the method did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mini_ddp.engine import buckets as bucketing
from mini_ddp.engine import writeback
from mini_ddp.engine.buckets import shares_storage
from mini_ddp.errors import naming_collective

if TYPE_CHECKING:
    from mini_ddp.engine.reducer import Reducer

logger = logging.getLogger("mini_ddp")


# ---- which parameters: the unused-parameter search -------------------------------------
def unreachable_params(accumulators: Sequence[Any], outputs: Sequence[torch.Tensor]
                       ) -> list[int]:
    """Indices of the ``accumulators`` (AccumulateGrad nodes) unreachable from ``outputs``."""
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return [i for i, acc in enumerate(accumulators) if acc not in seen]


# ---- in what order: bucket layouts and the one-time rebuild ----------------------------
def install_buckets(reducer: Reducer, layout: list[list[int]], rebuilt: bool = False) -> None:
    """Give ``reducer`` fresh buckets for ``layout`` (lists of parameter indices)."""
    # Gradients the zero-copy write-back left in the old buffers move along (unless someone
    # else holds them), so later steps keep writing in place instead of copying. (No buckets
    # yet when the constructor installs the first layout.)
    movable = writeback.handed_out_grads(getattr(reducer, "buckets", ()))
    for bucket in getattr(reducer, "buckets", ()):
        if reducer.transport is not None and reducer.transport.owns(bucket.buffer):
            reducer.transport.free(bucket.buffer)  # memory goes once the old views do
    reducer.buckets, reducer.locator = bucketing.build_buckets(layout, reducer.params,
                                                               reducer.allocate)
    reducer.layout_history.append([list(indices) for indices in layout])
    for index, old_view in movable:
        bucket_index, position = reducer.locator[index]
        bucket = reducer.buckets[bucket_index]
        reducer.params[index].grad = bucket.views[position].copy_(old_view)
        bucket.handed_out = True
    del movable
    if reducer.config.gradient_as_bucket_view:
        # Gradients that already exist move into the new buffers (DDP does the same when
        # it rebuilds), so ``.grad`` is a bucket view from now on.
        for bucket in reducer.buckets:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is not None and not shares_storage(p.grad, bucket.buffer):
                    view.copy_(p.grad)
                    p.grad = view
    logger.info("mini_ddp rank %d bucket layout, %s:\n%s", reducer.rank,
                reducer.config.layout_reason(rebuilt),
                bucketing.describe_layout(reducer.buckets, reducer.names))


def should_rebuild(reducer: Reducer) -> bool:
    """DDP rebuilds once, in gradient-ready order, unless it searches for unused params."""
    return ((reducer.config.static_graph or not reducer.config.find_unused_parameters)
            and not reducer.has_rebuilt)


def rebuild_buckets_if_needed(reducer: Reducer) -> bool:
    """Before a forward: check the last backward finished; rebuild buckets once."""
    reducer.ensure_prior_reduction_finished()
    if not should_rebuild(reducer) or not reducer.rebuild_order:
        return False
    layout = bucketing.assign_buckets(reducer.params, reducer.config.rebuild_size_limits(),
                                      order=reducer.rebuild_order)
    with naming_collective(reducer.rank, "the broadcast of rank 0's rebuilt bucket layout "
                           "(before the second forward)"):
        layout = bucketing.agree_on_layout(layout, reducer.group, reducer.local_used.device)
    reducer.has_rebuilt = True
    reducer.rebuild_order = []
    install_buckets(reducer, layout, rebuilt=True)
    return True


# ---- how often: a static graph's first iteration ---------------------------------------
def delay_all_reduce(reducer: Reducer) -> None:
    """Static graph, first iteration: reduce everything once backward has finished.

    In iteration 1 the hooks only count how often each parameter's gradient arrives; this
    (queued by the output sink) then copies every gradient in and reduces all buckets, through
    the reducer's own steps 2-4 (:mod:`mini_ddp.engine.reducer`).
    """
    with reducer._lock:
        reducer._launch_used_map_reduce()
        reducer.unused = [i for i, c in enumerate(reducer.static_hook_counts) if c == 0]
        reducer.require_finalize = True
        for bucket in reducer.buckets:
            for position in range(len(bucket.params)):
                reducer._copy_grad_into_bucket(bucket, position)
        for bucket in reducer.buckets:
            reducer._launch(bucket)
        reducer.next_bucket = len(reducer.buckets)
    reducer.finish_grad_sync()

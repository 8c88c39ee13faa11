"""The output sink: an identity on the forward's outputs whose backward runs first.

``DataParallelModel.forward`` routes its outputs through :class:`OutputSink` when it must act
before any parameter gradient arrives (``find_unused_parameters``, a static graph's first
iteration), and uses :func:`find_tensors` to collect the outputs the unused-parameter search
starts from.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


class OutputSink(torch.autograd.Function):
    """Identity on the forward outputs whose backward runs before any parameter gradient.

    With ``find_unused_parameters`` it keeps undefined gradients undefined
    (``set_materialize_grads(False)``): an output left out of the loss then sends *no*
    gradient into its subgraph, whose parameters' hooks still fire — marked ready with zeros
    and kept as globally unused, as in DDP. With ``static_graph`` its backward queues the
    iteration-1 reduction, which must run after all hooks (the model's ``on_backward``).
    """

    @staticmethod
    def forward(ctx: Any, on_backward: weakref.WeakMethod, clone: bool, *outputs: Any) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        # DDPSink clones unless ``_set_ddp_sink_clone(False)``: a loss modified in place must
        # not be the sink's own output.
        return tuple(o.clone() if clone and isinstance(o, torch.Tensor) else o for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        on_backward = ctx.on_backward()  # None once the model is gone
        if on_backward is not None:
            on_backward()
        return (None, None, *grads)


def through_sink(output: Any, on_backward: Callable[[], None], clone: bool = True) -> Any:
    """Route every output tensor through :class:`OutputSink`; ``on_backward`` (a bound method,
    held weakly: the graph must not keep the model alive) runs when its backward does;
    ``clone=False`` passes the tensors through uncloned (``_set_ddp_sink_clone(False)``)."""
    leaves, spec = pytree.tree_flatten(output)
    passed = OutputSink.apply(weakref.WeakMethod(on_backward), clone, *leaves)
    # Tensors that are not part of a graph stay as they were (DDP does the same).
    merged = [leaf if isinstance(leaf, torch.Tensor) and leaf.grad_fn is None else new
              for leaf, new in zip(leaves, passed, strict=True)]
    return pytree.tree_unflatten(merged, spec)


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in an output: tensors, lists/tuples (namedtuples), dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in find_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in find_tensors(item)]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in fields(obj) for t in find_tensors(getattr(obj, f.name))]
    return []

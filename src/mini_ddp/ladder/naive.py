"""Rung 1 — the obvious way: after ``backward()``, all-reduce every gradient and divide.

Data parallelism in one idea: every rank holds the same model, computes gradients on its own
slice of the batch, and before the optimizer step the ranks replace each gradient by the
average over all ranks. Then every rank takes the same step and the models stay identical.

This rung does exactly that, in the most direct way::

    model = NaiveDataParallel(net)
    loss_fn(model(x), y).backward()
    model.sync_grads()              # one all_reduce per parameter, then divide
    optimizer.step()

Where each step sits in torch DDP (``torch/nn/parallel/distributed.py`` and the C++
``reducer.cpp``):

* :func:`broadcast_from_rank0` — DDP's constructor, ``_sync_module_states``: rank 0's
  parameters and buffers overwrite everyone's;
* only parameters with ``requires_grad=True`` take part (DDP builds its reducer over those
  alone; a frozen parameter has no gradient to average);
* :meth:`NaiveDataParallel.sync_grads` — what ``Reducer::all_reduce_bucket`` does per bucket,
  here per parameter, with the division done *after* the sum (DDP multiplies by
  ``1/world_size`` before it, in ``Reducer::mark_variable_ready_dense``).

It is correct, and it is what the rest of the ladder improves on:

* one collective per parameter: a ResNet has ~60 of them, each paying the network's latency;
* nothing is sent until ``backward()`` has finished, so the network idles while autograd works
  and autograd idles while the network works;
* the arithmetic is not torch DDP's. DDP multiplies each gradient by ``1/world_size`` and then
  sums; this rung sums and then divides. At two ranks both give the same bits (one addition,
  and halving is exact); at three they differ in the last bit of many elements
  (``python -m mini_ddp ladder`` shows it, ``docs/buckets.md`` explains it).

Next rung: :mod:`mini_ddp.ladder.bucketed` packs the gradients into a few flat buffers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def broadcast_from_rank0(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Start from one model: every rank takes rank 0's parameters and buffers, as DDP does in
    its constructor. (Each rank may have initialised its copy with a different seed.)"""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=src, group=group)


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters DDP synchronises: those with ``requires_grad=True``, by name."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


class NaiveDataParallel(nn.Module):
    """Wrap ``module``; call :meth:`sync_grads` between ``backward()`` and the optimizer step."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        broadcast_from_rank0(module, group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Just the wrapped module's forward: all the work happens in :meth:`sync_grads`."""
        return self.module(*inputs, **kwargs)

    def sync_grads(self) -> None:
        """Replace every ``.grad`` by its mean over the ranks: sum, then divide."""
        for name, param in trainable(self.module):
            if param.grad is None:
                # Every rank must issue the same collectives in the same order; a parameter
                # without a gradient here would need a zero tensor on this rank. Keep the
                # rung simple and demand that every trainable parameter was used.
                raise RuntimeError(
                    f"NaiveDataParallel: parameter '{name}' (shape {tuple(param.shape)}) got "
                    f"no gradient on rank {self.rank} this step; every trainable parameter "
                    "must take part in the loss (freeze it with requires_grad_(False), or use "
                    "rung 4's find_unused_parameters)")
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.group)
            param.grad /= self.world_size

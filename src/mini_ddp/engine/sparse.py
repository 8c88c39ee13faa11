"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``), as torch DDP.

A parameter whose module produces sparse gradients gets a bucket of its own, outside the dense
flat buffers (DDP's ``compute_bucket_assignment_by_size`` does the same, with no size cap), and
that bucket's "buffer" is the sparse ``.grad`` itself:

* when its gradient is ready, the ``.grad`` is divided *in place* by the world size (a true
  division of the values: DDP's ``mark_variable_ready_sparse`` — unlike the dense path's
  multiplication by ``1/world_size``); with a comm hook it is left for the hook;
* the bucket's collective is an all-reduce of that sparse tensor (Gloo sums sparse tensors),
  launched in bucket order like any other; a comm hook gets a bucket whose ``buffer()`` is the
  sparse tensor;
* at the end of backward the result is copied back into the same ``.grad`` (``copy_``), which
  is the bucket: nothing else to write back, with or without ``gradient_as_bucket_view``.

A parameter that expects a sparse gradient must receive one: DDP refuses an undefined or dense
gradient for it with the sentences below.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mini_ddp.engine.buckets import Bucket

NOT_DEFINED = "Expected sparse gradient to be defined."
NOT_SPARSE = "Expected variable to have sparse gradient."


def produces_sparse_gradient(module: nn.Module) -> bool:
    """DDP's test: an ``Embedding`` or ``EmbeddingBag`` built with ``sparse=True``."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse


def expect_sparse_gradients(module: nn.Module, params: Sequence[torch.Tensor]) -> list[bool]:
    """For each of the reducer's ``params``: does its (first) owning module make sparse grads?"""
    owner: dict[int, bool] = {}
    for sub in module.modules():
        for param in sub.parameters(recurse=False):
            owner.setdefault(id(param), produces_sparse_gradient(sub))
    return [owner.get(id(p), False) for p in params]


def check_sparse_grad(grad: torch.Tensor | None, name: str, rank: int) -> torch.Tensor:
    """The gradient of a sparse-bucket parameter, or DDP's error (``RuntimeError``)."""
    if grad is None:
        raise RuntimeError(f"{NOT_DEFINED} (mini_ddp: parameter '{name}' on rank {rank} got no "
                           f"gradient; a sparse bucket cannot contribute zeros)")
    if grad.layout != torch.sparse_coo:
        raise RuntimeError(f"{NOT_SPARSE} (mini_ddp: parameter '{name}' on rank {rank} got a "
                           f"{grad.layout} gradient)")
    return grad


def sparse_grad_in(bucket: Bucket, *, hooked: bool, div_factor: int, name: str, rank: int
                   ) -> None:
    """The gradient is ready: it becomes the bucket's buffer, divided in place (no hook)."""
    grad = check_sparse_grad(bucket.params[0].grad, name, rank)
    bucket.buffer = grad
    if not hooked:
        grad.div_(div_factor)  # DDP: a true division, on the .grad itself


def sparse_write_back(bucket: Bucket, value: object) -> None:
    """Copy the collective's result into the bucket, which is the parameter's ``.grad``."""
    result = value[0] if isinstance(value, (list, tuple)) else value
    if not isinstance(result, torch.Tensor) or not result.is_sparse:
        raise TypeError(f"mini_ddp: the collective of sparse bucket {bucket.index} must "
                        f"resolve to a sparse tensor; it held a {type(result).__name__}")
    if result is not bucket.buffer:
        bucket.buffer.copy_(result)
